#!/usr/bin/env bash
# Fuzzes every file reader (docs/fuzzing.md): configures a clang tree (build-fuzz, -DMESHTRAIN_FUZZ=ON),
# builds the libFuzzer targets of fuzz/ and runs each for SECONDS (default 10) from its seed corpus
# (written by fuzz/make_corpus.py into build-fuzz/seeds/<target>; new inputs go to
# build-fuzz/corpus/<target>). Prints, per
# target, the inputs tried and the crashes; a crash's input is kept as build-fuzz/crashes/<target>-crash-*
# (rerun it with build-fuzz/fuzz/<target>_fuzz FILE). Exit 1 when any target crashed.
# Usage: scripts/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]   (targets: see fuzz/CMakeLists.txt)
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-10}
shift || true
if ! [[ "$secs" =~ ^[0-9]+$ ]] || ((secs < 1)); then
  echo "scripts/fuzz.sh: SECONDS_PER_TARGET must be a positive whole number, got '$secs'" >&2
  exit 2
fi
if ! command -v clang++ >/dev/null; then
  echo "scripts/fuzz.sh: clang++ not found; install it with scripts/install_deps.sh --test" >&2
  exit 2
fi
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_C_COMPILER_LAUNCHER=ccache)
cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=Release -DMESHTRAIN_FUZZ=ON -DMESHTRAIN_WERROR=ON \
  -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ "${launcher[@]}" >/dev/null
ninja -C build-fuzz fuzz_targets
targets=("$@")
((${#targets[@]})) || targets=(safetensors token_shard jsonl tokenizer_json hf_config toml_config checkpoint_meta)
mkdir -p build-fuzz/crashes build-fuzz/logs
python3 fuzz/make_corpus.py build-fuzz/seeds
printf '%-16s %8s %12s %8s\n' target seconds inputs crashes
failed=0
for t in "${targets[@]}"; do
  exe=build-fuzz/fuzz/${t}_fuzz
  [[ -x $exe ]] || { echo "scripts/fuzz.sh: no target $t (expected $exe)" >&2; exit 2; }
  mkdir -p "build-fuzz/corpus/$t"
  log=build-fuzz/logs/$t.log
  rm -f build-fuzz/crashes/"$t"-*
  # -timeout: an input that takes longer is a hang, reported as a crash.
  set +e
  "$exe" -max_total_time="$secs" -timeout=30 -rss_limit_mb=4096 -print_final_stats=1 \
    -artifact_prefix="build-fuzz/crashes/$t-" "build-fuzz/corpus/$t" "build-fuzz/seeds/$t" >"$log" 2>&1
  rc=$?
  set -e
  inputs=$(grep -a -o 'stat::number_of_executed_units: [0-9]*' "$log" | tail -1 | grep -o '[0-9]*$' || true)
  crashes=$(find build-fuzz/crashes -name "$t-*" | wc -l)
  ((rc != 0 && crashes == 0)) && crashes=1  # died without writing its input (see the log)
  printf '%-16s %8s %12s %8s\n' "$t" "$secs" "${inputs:-?}" "$crashes"
  if ((crashes > 0)); then
    failed=1
    grep -a -m1 -A3 -E 'CONTRACT BROKEN|ERROR: (AddressSanitizer|libFuzzer|UndefinedBehaviorSanitizer)|runtime error:' "$log" |
      sed 's/^/    /' || true
    echo "    log: $log; input: $(find build-fuzz/crashes -name "$t-*" | head -1)"
  fi
done
echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), load average: $(cut -d' ' -f1-3 /proc/loadavg)"
exit $failed
