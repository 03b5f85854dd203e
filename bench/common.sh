# Sourced by the bench scripts: builds the binary if it is missing, prepares the byte-level
# benchmark corpus (Debian's fortunes) if it is missing, and lets mpirun run as root.
#
#   bench_setup BUILD_DIR DATA_DIR   -> sets MT=BUILD_DIR/meshtrain
bench_setup() {
  local build=$1 data=$2 root
  root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  if [[ ! -x "$build/meshtrain" ]]; then
    cmake -S "$root" -B "$build" -G Ninja >/dev/null
    ninja -C "$build" meshtrain >/dev/null
  fi
  MT=$build/meshtrain
  [[ -f "$data/train.bin" ]] ||
    "$MT" prepare --tokenizer byte --input /usr/share/games/fortunes/fortunes --out "$data" >/dev/null
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
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
