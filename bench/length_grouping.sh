#!/usr/bin/env bash
# Variable-length batches without stragglers (summary in docs/finetuning.md): 2 ranks of DDP, one
# core each, training on unpacked documents of very different lengths (data.packing = false), with
# and without length grouping (data.group_by_length), and every micro-batch padded to seq_len as the
# fixed-shape reference. Per configuration: the mean over steps of the ranks' busy-time spread
# ((slowest - fastest) / mean of busy_ms_per_rank, compared every step), the mean step time, the
# padding share and the real (non-padding) tokens per second (their sum over the steps' time). Runs alternate between the
# configurations, REPEATS rounds; the table has the median over the rounds.
#
# The corpus: tinyshakespeare lines joined into documents of 1 to 30 lines (a Pareto number of
# lines: most documents are one short line, a few are long), byte-level, one document per line.
#
# usage: bench/length_grouping.sh [--steps 30] [--repeats 3] [--seq 512] [--micro-batch 4]
#                                 [--build DIR] [--data DIR] [--out DIR] [--no-wait]
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
source "$ROOT/bench/common.sh"
STEPS=30
REPEATS=3
SEQ=512
MB=4
BUILD=$ROOT/build
DATA=/tmp/mt_lengroup_data
OUT=
bench_opt --steps STEPS --repeats REPEATS --seq SEQ --micro-batch MB
bench_quiet_options
bench_parse "$@"
bench_out lengroup
SRC=${MT_SHAKESPEARE:-$ROOT/../shared/data/tinyshakespeare/input.txt}
if [[ ! -f "$DATA/train.bin" ]]; then
  [[ -f "$SRC" ]] || { echo "length_grouping.sh: no corpus at $SRC (set MT_SHAKESPEARE)" >&2; exit 2; }
  mkdir -p "$DATA"
  python3 - "$SRC" "$DATA/docs.txt" <<'PY'
import random, sys
lines = [l for l in open(sys.argv[1]).read().split("\n") if l.strip()]
r = random.Random(1)
docs = []
for _ in range(4000):
    k = min(int(r.paretovariate(1.2)), 30)
    j = r.randrange(len(lines) - k)
    docs.append(" ".join(lines[j:j + k]))
open(sys.argv[2], "w").write("\n".join(docs) + "\n")
PY
  [[ -x "$BUILD/meshtrain" ]] || bench_setup "$BUILD" /dev/null 2>/dev/null || true
  "$BUILD/meshtrain" prepare --tokenizer byte --input "$DATA/docs.txt" --out "$DATA" --val-fraction 0 >/dev/null
fi
bench_setup "$BUILD" "$DATA"
CPU=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')
echo "cpu: $CPU   load at start: $(cut -d' ' -f1-3 /proc/loadavg)   out: $OUT"

ARGS=(train --model.preset gpt2-mini --model.seq_len "$SEQ" --data.train "$DATA/train.bin" --data.val ''
  --data.tokenizer byte --train.steps "$STEPS" --train.micro_batch "$MB" --train.grad_accum 1 --train.threads 1
  --train.warmup_steps 2 --train.sample_tokens 0 --train.eval_every 0 --data.packing false --data.shuffle true
  --log.straggler_every 1 --log.straggler_min_ms 1e9 --log.print_every 1000)
declare -A CONF=(
  [fixed]="--data.pad_to_multiple 0"
  [ungrouped]="--data.group_by_length false"
  [grouped]="--data.group_by_length true"
)
ORDER=(ungrouped grouped fixed)
MPI=(mpirun -np 2 --bind-to core --map-by core -x OMP_NUM_THREADS=1)
for ((r = 1; r <= REPEATS; r++)); do
  for c in "${ORDER[@]}"; do
    bench_wait_quiet
    # shellcheck disable=SC2086
    bench_run "${c}_$r" "${MPI[@]}" "$MT" "${ARGS[@]}" ${CONF[$c]}
  done
done

python3 - "$OUT" "$REPEATS" "${ORDER[@]}" <<'PY'
import json, statistics, sys
out, repeats, order = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
def run(path):
    L = [json.loads(l) for l in open(path) if l.strip()]
    s = [x for x in L if "final" not in x and x["step"] > 1]  # the first step is warm-up
    spread = [(max(x["busy_ms_per_rank"]) - min(x["busy_ms_per_rank"])) / statistics.mean(x["busy_ms_per_rank"])
              for x in s if x.get("busy_ms_per_rank")]
    step = statistics.mean(x["step_ms"] for x in s)
    idle = [max(x["idle_ms_per_rank"]) / x["step_ms"] for x in s if x.get("idle_ms_per_rank")]
    return dict(spread=statistics.mean(spread), step=step, idle=statistics.mean(idle),
                pad=statistics.mean(x["padding_share"] for x in s),
                tps=1000 * sum(x["trained_tokens"] for x in s) / sum(x["step_ms"] for x in s))
rows = {c: [run(f"{out}/{c}_{r}.jsonl") for r in range(1, repeats + 1)] for c in order}
med = {c: {k: statistics.median(v[k] for v in rows[c]) for k in rows[c][0]} for c in order}
print(f"\n{'config':<10} {'busy spread':>12} {'idle/step':>10} {'step ms':>9} {'padding':>8} {'real tok/s':>11}   (median of {repeats} rounds)")
for c in order:
    m = med[c]
    print(f"{c:<10} {100 * m['spread']:>11.1f}% {100 * m['idle']:>9.1f}% {m['step']:>9.1f} {100 * m['pad']:>7.1f}% {m['tps']:>11.0f}")
g, u = med["grouped"], med["ungrouped"]
print(f"\ngrouped / ungrouped: busy spread x{g['spread'] / u['spread']:.2f}, step time x{g['step'] / u['step']:.2f}, "
      f"real tokens/s x{g['tps'] / u['tps']:.2f}")
for c in order:
    print(c, "per round (spread %, step ms):", [(round(100 * v["spread"], 1), round(v["step"], 1)) for v in rows[c]])
PY
echo "load at end: $(cut -d' ' -f1-3 /proc/loadavg)"
