#!/usr/bin/env bash
# Tensor parallelism's blocking collectives on the caller's thread (comm::InlineScope) vs through
# the communication thread (MESHTRAIN_COMM_INLINE_KB=0): gpt2-mini, tp 2 on 2 ranks, micro-batch 4,
# fp32 and bf16 + sequence parallelism; per run the median over steps 2.. of the step time and of
# the exposed communication time (metrics: step_ms, exposed_comm_ms), medians over repeats (the two
# settings alternate in each repeat).
#
# usage: bench/tp_inline.sh [--steps N] [--repeats R] [--build DIR] [--data DIR] [--out DIR]
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
source "$ROOT/bench/common.sh"
STEPS=40
REPEATS=3
BUILD=$ROOT/build-bench
DATA=/tmp/mt_benchdata
OUT=
bench_opt --steps STEPS --repeats REPEATS
bench_parse "$@"
bench_out tp_inline
bench_setup "$BUILD" "$DATA"
echo "tp_inline: $REPEATS repeats x $STEPS steps; raw output in $OUT; load $(cut -d' ' -f1-3 /proc/loadavg)"
ARGS=(--model.preset gpt2-mini --parallel.tp 2 --train.micro_batch 4 --data.train "$DATA/train.bin" --data.val ''
  --train.steps "$STEPS" --train.eval_every 0 --train.sample_tokens 0 --log.print_every 1000)
for ((r = 1; r <= REPEATS; r++)); do
  for cfg in fp32 bf16sp; do
    extra=(); [[ $cfg == bf16sp ]] && extra=(--train.dtype bf16 --parallel.sequence_parallel true)
    for kb in 1024 0; do
      MESHTRAIN_COMM_INLINE_KB=$kb "$MT" launch -n 2 -- train "${ARGS[@]}" "${extra[@]}" \
        --log.metrics_out "$OUT/${cfg}_inline${kb}_r$r.jsonl" >"$OUT/${cfg}_inline${kb}_r$r.log" 2>&1
    done
  done
done
python3 - "$OUT" "$REPEATS" <<'PY'
import json, statistics as st, sys
out, R = sys.argv[1], int(sys.argv[2])
def fig(cfg, kb, r):
    recs = [json.loads(l) for l in open(f"{out}/{cfg}_inline{kb}_r{r}.jsonl") if l.strip()]
    s = [x for x in recs if not x.get("final")][1:]
    return st.median(x["step_ms"] for x in s), st.median(x["exposed_comm_ms"] for x in s)
print("\n| config | comm path | step ms | exposed comm ms |\n|---|---|---:|---:|")
for cfg in ("fp32", "bf16sp"):
    for kb, name in ((1024, "caller's thread (default)"), (0, "communication thread")):
        v = [fig(cfg, kb, r) for r in range(1, R + 1)]
        print(f"| tp2 {cfg} | {name} | {st.median(a for a, _ in v):.1f} | {st.median(b for _, b in v):.1f} |")
PY
