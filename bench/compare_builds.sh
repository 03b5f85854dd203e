#!/usr/bin/env bash
# Training throughput of two meshtrain binaries side by side on the same machine (a change's
# "before" and "after"): the benchmark config (gpt2-small-cpu, micro-batch 4, 1024 tokens per step),
# one process, fp32 and bf16, runs alternating A, B, B, A, ... so both see the same load; prints
# the mean tokens/s (steps after the first) of each and the ratio B / A, with the CPU model and the
# load average.
#
# usage: bench/compare_builds.sh --a OLD/meshtrain --b NEW/meshtrain [--steps 6] [--repeats 3]
#        [--threads 2] [--data DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/common.sh
A="" B="" STEPS=6 REPEATS=3 THREADS=2 DATA=/tmp/mt-bench-gpt2
bench_opt --a A --b B --steps STEPS --repeats REPEATS --threads THREADS
bench_parse "$@"
[[ -x "$A" && -x "$B" ]] || { echo "--a and --b must name meshtrain binaries" >&2; exit 2; }
if [[ ! -f "$DATA/train.bin" ]]; then
  text=../shared/data/tinyshakespeare/input.txt  # English text; Debian's fortunes without it
  [[ -f $text ]] || text=/usr/share/games/fortunes/fortunes
  "$B" prepare --tokenizer gpt2 --input "$text" --out "$DATA" --val-fraction 0.01 >/dev/null
fi
run() {  # binary dtype -> mean tokens/s of the steps after the first
  local m; m=$(mktemp)
  MESHTRAIN_MPI=0 "$1" train --model.preset gpt2-small-cpu --train.micro_batch 4 --train.steps "$STEPS" \
    --train.warmup_steps 1 --train.threads "$THREADS" --train.dtype "$2" --data.train "$DATA/train.bin" \
    --data.val "" --train.sample_tokens 0 --log.print_every 1000 --log.metrics_out "$m" >/dev/null
  python3 -c "import json,sys; print(json.loads(open(sys.argv[1]).read().splitlines()[-1])['tokens_per_s'])" "$m"
  rm -f "$m"
}
echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); load before: $(cut -d' ' -f1-3 /proc/loadavg)"
for dt in fp32 bf16; do
  sa=0 sb=0
  for ((i = 0; i < REPEATS; i++)); do
    if ((i % 2 == 0)); then a=$(run "$A" $dt); b=$(run "$B" $dt); else b=$(run "$B" $dt); a=$(run "$A" $dt); fi
    sa=$(python3 -c "print($sa + $a)"); sb=$(python3 -c "print($sb + $b)")
    printf '%s repeat %d: A %.0f  B %.0f tokens/s\n' $dt $((i + 1)) "$a" "$b"
  done
  python3 -c "a=$sa/$REPEATS; b=$sb/$REPEATS; print('$dt %d threads: A %.0f  B %.0f tokens/s  B/A %.3f' % ($THREADS, a, b, b/a))"
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
