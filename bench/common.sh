# Sourced by the bench scripts: builds the programs if they are missing, prepares the byte-level
# benchmark corpus (Debian's fortunes) if it is missing, and lets mpirun run as root.
#
#   bench_setup BUILD_DIR DATA_DIR [PROGRAM ...]   -> sets MT (absolute path of BUILD_DIR/meshtrain)
# PROGRAM: further programs the script needs, relative to BUILD_DIR (e.g. bench/kernel_bench).
# BENCH_TEXTS: the fortunes files the corpus is made of (default "fortunes").
#
# Options every script takes, and its output folder:
#   bench_option "$@" && shift 2   consumes --build DIR, --data DIR or --out DIR (sets BUILD, DATA
#                                  or OUT); returns 1 for any other option
#   bench_out NAME                 OUT, or a new /tmp/mt_NAME.XXXXXX when it is empty; created
bench_setup() {
  local build=$1 data=$2 root p missing=0 targets=(meshtrain) inputs=()
  shift 2
  root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  [[ -x "$build/meshtrain" ]] || missing=1
  for p in "$@"; do
    [[ -x "$build/$p" ]] || missing=1
    targets+=("$(basename "$p")")
  done
  if ((missing)); then
    cmake -S "$root" -B "$build" -G Ninja -DMESHTRAIN_BENCH=ON >/dev/null
    ninja -C "$build" "${targets[@]}" >/dev/null
  fi
  MT=$(realpath "$build/meshtrain")
  for p in ${BENCH_TEXTS:-fortunes}; do inputs+=(--input "/usr/share/games/fortunes/$p"); done
  [[ -f "$data/train.bin" ]] || "$MT" prepare --tokenizer byte "${inputs[@]}" --out "$data" >/dev/null
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
}

# The machine's CPU time so far, "total steal" in jiffies (/proc/stat's aggregate line), and the share
# of the time since such a snapshot that the hypervisor gave other guests (steal; on a shared
# virtual machine the main reason one run differs from the next):
#   s0=$(cpu_snapshot); ...; echo "steal $(steal_since "$s0")"
cpu_snapshot() {
  awk '/^cpu / { t = 0; for (i = 2; i <= 9; i++) t += $i; print t, $9; exit }' /proc/stat 2>/dev/null || echo "0 0"
}
steal_since() {
  local t0 s0 t1 s1
  read -r t0 s0 <<<"$1"
  read -r t1 s1 <<<"$(cpu_snapshot)"
  awk -v t0="$t0" -v s0="$s0" -v t1="$t1" -v s1="$s1" \
    'BEGIN { if (t1 > t0) printf "%.0f%%", 100 * (s1 - s0) / (t1 - t0); else printf "-" }'
}

# Waits, polling every 30 s for at most LIMIT seconds, until the 1-minute load is at most MAX;
# sets `waited` to the seconds it waited.
#
#   wait_for_load MAX LIMIT
wait_for_load() {
  local max=$1 limit=$2 l
  waited=0
  while :; do
    l=$(cut -d' ' -f1 /proc/loadavg)
    awk -v l="$l" -v m="$max" 'BEGIN { exit !(l <= m) }' && break
    if ((waited >= limit)); then
      echo "  (1-min load still $l after ${waited}s; starting anyway)"
      break
    fi
    sleep 30
    waited=$((waited + 30))
  done
  ((waited == 0)) || echo "  (waited ${waited}s for the 1-min load to fall to $max; now $l)"
}

bench_option() {
  case "$1" in
    --build | --data | --out) ;;
    *) return 1 ;;
  esac
  [[ $# -ge 2 ]] || { echo "$(basename "$0"): $1 needs a value" >&2; exit 2; }
  case "$1" in
    --build) BUILD=$2 ;;
    --data) DATA=$2 ;;
    --out) OUT=$2 ;;
  esac
}

bench_out() {
  [[ -n "$OUT" ]] || OUT=$(mktemp -d "/tmp/mt_$1.XXXXXX")
  mkdir -p "$OUT"
}

# Warns when interpreter PY's torch multiplies fp32 slowly: Debian's python3-torch links
# libblas.so.3, which is the unoptimised netlib build unless OpenBLAS (or BLIS) provides it
# (measured on a 2-core Xeon: 5.7 GFLOP/s with the reference BLAS, 306 with libopenblas0-pthread).
# A peer measured that way is not PyTorch at its best. The check times a 512^3 matmul on 1 thread.
#
#   check_torch_blas PY
check_torch_blas() {
  local gf
  gf=$("$1" - 2>/dev/null <<'PYEOF'
import time, torch
torch.set_num_threads(1)
a, b = torch.randn(512, 512), torch.randn(512, 512)
a @ b
t = time.perf_counter(); n = 0
while time.perf_counter() - t < 0.3:
    a @ b; n += 1
print(int(n * 2 * 512**3 / (time.perf_counter() - t) / 1e9))
PYEOF
)
  if [[ -n "$gf" ]] && ((gf < 20)); then
    echo "warning: $1's torch multiplies fp32 at $gf GFLOP/s per thread (reference BLAS?): install libopenblas0-pthread for a fair peer" >&2
  fi
}
