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
