# Sourced by the bench scripts: their options, the build and the corpus they need, and the run
# set-up they share.
#
# Options. A script sets its defaults, declares its own options, then parses:
#   bench_opt --steps STEPS [--repeats REPEATS ...]    options with a value, stored in STEPS, ...
#   bench_flag --no-wait WAIT=0 [...]                  options without a value, and the assignment
#                                                      each makes
#   bench_quiet_options              --no-wait, --max-load L, --load-wait S (see bench_wait_quiet)
#   bench_parse "$@"
# Every script also takes --build DIR, --data DIR and --out DIR (BUILD, DATA, OUT) and -h / --help,
# which prints the script's opening comment. An unknown option is an error naming it.
#
# Set-up:
#   bench_setup BUILD_DIR DATA_DIR [PROGRAM ...]   -> sets MT (absolute path of BUILD_DIR/meshtrain)
#     Builds the programs if they are missing and prepares the byte-level benchmark corpus (Debian's
#     fortunes) if it is missing; lets mpirun run as root. PROGRAM: further programs the script
#     needs, relative to BUILD_DIR (e.g. bench/kernel_bench). BENCH_TEXTS: the fortunes files the
#     corpus is made of (default "fortunes").
#   bench_out NAME                 OUT, or a new /tmp/mt_NAME.XXXXXX when it is empty; created
#   bench_run TAG COMMAND ...      runs a training command with --log.metrics_out OUT/TAG.jsonl,
#                                  its output in OUT/TAG.log, the load before it in OUT/load.txt;
#                                  stops the script with the log's tail when it fails
declare -A BENCH_OPTS=([--build]=BUILD [--data]=DATA [--out]=OUT) BENCH_FLAGS=()
bench_opt() { while [[ $# -ge 2 ]]; do BENCH_OPTS[$1]=$2; shift 2; done; }
bench_flag() { while [[ $# -ge 2 ]]; do BENCH_FLAGS[$1]=$2; shift 2; done; }

bench_usage() { awk 'NR == 1 && /^#!/ { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$0"; }

bench_parse() {
  local a me
  me=$(basename "$0")
  while [[ $# -gt 0 ]]; do
    a=$1
    if [[ $a == -h || $a == --help ]]; then
      bench_usage
      exit 0
    elif [[ -n ${BENCH_FLAGS[$a]+set} ]]; then
      printf -v "${BENCH_FLAGS[$a]%%=*}" '%s' "${BENCH_FLAGS[$a]#*=}"
      shift
    elif [[ -n ${BENCH_OPTS[$a]+set} ]]; then
      [[ $# -ge 2 ]] || { echo "$me: $a needs a value" >&2; exit 2; }
      printf -v "${BENCH_OPTS[$a]}" '%s' "$2"
      shift 2
    else
      echo "$me: unknown option $a (see --help)" >&2
      exit 2
    fi
  done
}

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

bench_out() {
  [[ -n "$OUT" ]] || OUT=$(mktemp -d "/tmp/mt_$1.XXXXXX")
  mkdir -p "$OUT"
}

bench_run() {
  local tag=$1
  shift
  echo "$tag: load $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$OUT/load.txt"
  "$@" --log.metrics_out "$OUT/$tag.jsonl" >"$OUT/$tag.log" 2>&1 ||
    { echo "run failed, see $OUT/$tag.log" >&2; tail -20 "$OUT/$tag.log" >&2; exit 1; }
}

# Runs on a shared machine: before each run, wait until no other benchmark runs (a process matching
# WAIT_PATTERN, or BUSY, a command that succeeds while some shared resource is taken), then until
# the 1-minute load is at most MAX_LOAD (at most LOAD_WAIT seconds). --no-wait skips both.
#
#   bench_quiet_options            (before bench_parse) the options and their defaults
#   bench_wait_quiet [BUSY]
bench_quiet_options() {
  WAIT=1 MAX_LOAD=1.5 LOAD_WAIT=300
  WAIT_PATTERN=${WAIT_PATTERN:-'ddp_overlap|ddp_scaling|train_throughput|pytorch_compare|two_nodes'}
  bench_flag --no-wait WAIT=0
  bench_opt --max-load MAX_LOAD --load-wait LOAD_WAIT
}
bench_wait_quiet() {
  [[ $WAIT == 1 ]] || return 0
  local waited=0 busy=${1:-false}
  while pgrep -f "$WAIT_PATTERN" >/dev/null || $busy; do
    sleep 10
    waited=$((waited + 10))
  done
  ((waited == 0)) || echo "  (waited ${waited}s for other benchmarks to finish)"
  wait_for_load "$MAX_LOAD" "$LOAD_WAIT"
}

# Busy CPU ticks of the whole machine (all cores, /proc/stat: user nice system irq softirq steal).
busy_ticks() { awk '/^cpu / {print $2 + $3 + $4 + $7 + $8 + $9}' /proc/stat; }

# Peak RSS and CPU ticks (utime+stime) of the processes `$MT train ...`, sampled every 0.5 s until
# PID exits: lines "pid VmHWM_kB ticks". Bash builtins only (no process per sample), so that the
# sampler itself costs little of the cores.
#
#   sample_ranks PID FILE
sample_ranks() {
  local pid=$1 file=$2 d p c k v rest hwm st argv
  : >"$file"
  while kill -0 "$pid" 2>/dev/null; do
    for d in /proc/[0-9]*; do
      p=${d#/proc/}
      { read -r c <"$d/comm"; } 2>/dev/null || continue
      [[ $c == meshtrain ]] || continue
      { mapfile -d '' -t argv <"$d/cmdline"; } 2>/dev/null || continue
      [[ ${argv[0]:-} == "$MT" && ${argv[1]:-} == train ]] || continue
      hwm=
      { while read -r k v rest; do [[ $k == VmHWM: ]] && { hwm=$v; break; }; done <"$d/status"; } 2>/dev/null
      { read -r -a st <"$d/stat"; } 2>/dev/null || continue
      [[ -n $hwm ]] && echo "$p $hwm $((st[13] + st[14]))" >>"$file"
    done
    sleep 0.5
  done
}

# Warns when interpreter PY's torch multiplies fp32 slowly: Debian's python3-torch links
# libblas.so.3, which is the unoptimised netlib build, tens of times slower than OpenBLAS, unless
# OpenBLAS (or BLIS) provides it. A peer measured that way is not PyTorch at its best. The check
# times a 512^3 matmul on 1 thread.
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
