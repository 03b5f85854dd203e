#!/usr/bin/env bash
# DDP communication/computation overlap over a slow link (results in docs/bench-notes/ddp.md).
# Needs root (network namespaces).
#
# Two ranks, one per "node": bench/two_nodes.sh builds two network namespaces joined by a veth
# pair shaped with tc tbf to --rate (default 1gbit), so the gradient all-reduce (fp32, 120 MB for
# gpt2-small-cpu) crosses a slow TCP link and takes a large share of a step. Configurations:
#   bucket_mb 1, 5, 25 (default), 100: bucketed all-reduces started during backward
#   bucket_mb 1000 ("single"): larger than the model's 120 MB of gradients, so everything except
#                  the head's 3 KB first bucket (capped at 1 MB) is one bucket that only starts
#                  when backward has finished -- one all-reduce after backward
# Per run (rank 0's metrics, steps after the first, medians): step ms, comm ms (time the
# all-reduces ran on the communication thread), exposed ms (time the step waited for them after
# backward), hidden share = 1 - exposed / comm. Medians over repeats; configurations alternate.
# Only the namespaces and addresses two_nodes.sh creates are used; it deletes them on exit (and
# this script runs `two_nodes.sh --cleanup` at the end as well).
#
# usage: sudo bench/ddp_overlap.sh [--rate 1gbit] [--steps 6] [--repeats 2] [--buckets "1 5 25 100 1000"]
#                                  [--threads 1] [--build DIR] [--data DIR] [--out DIR]
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
source "$ROOT/bench/common.sh"
RATE=1gbit
STEPS=6
REPEATS=2
BUCKETS="1 5 25 100 1000"
THREADS=1
BUILD=$ROOT/build-bench
DATA=/tmp/mt_benchdata
OUT=
bench_opt --rate RATE --steps STEPS --repeats REPEATS --buckets BUCKETS --threads THREADS
bench_parse "$@"
[[ $EUID -eq 0 ]] || { echo "ddp_overlap.sh: needs root" >&2; exit 1; }
bench_out ddp_overlap
bench_setup "$BUILD" "$DATA"
trap '"$ROOT/bench/two_nodes.sh" --cleanup >/dev/null 2>&1 || true' EXIT

ARGS=(--model.preset gpt2-small-cpu --train.micro_batch 4 --data.train "$DATA/train.bin" --data.val ''
  --train.steps "$STEPS" --train.eval_every 0 --train.sample_tokens 0 --log.print_every 1
  --train.threads "$THREADS")

echo "ddp_overlap: 2 nodes x 1 rank x $THREADS thread(s), link $RATE, buckets {$BUCKETS} MB, $REPEATS repeats x $STEPS steps; raw output in $OUT"
for ((r = 1; r <= REPEATS; r++)); do
  list=($BUCKETS)
  if ((r % 2 == 0)); then rev=(); for ((i = ${#list[@]} - 1; i >= 0; i--)); do rev+=("${list[$i]}"); done; list=("${rev[@]}"); fi
  for mb in "${list[@]}"; do
    echo "repeat $r bucket_mb $mb: load $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$OUT/load.txt"
    OMP_NUM_THREADS=$THREADS "$ROOT/bench/two_nodes.sh" --rate "$RATE" -- "$MT" train "${ARGS[@]}" \
      --parallel.bucket_mb "$mb" --log.metrics_out "$OUT/b${mb}_r$r.jsonl" >"$OUT/b${mb}_r$r.log" 2>&1 ||
      { echo "run failed, see $OUT/b${mb}_r$r.log" >&2; tail -20 "$OUT/b${mb}_r$r.log" >&2; exit 1; }
  done
done
echo "after: load $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$OUT/load.txt"
grep -h 'qdisc' "$OUT"/b*_r1.log | grep -m2 'Sent\|rate' | sed 's/^/link: /' || true

python3 - "$OUT" "$REPEATS" "$BUCKETS" <<'EOF'
import json, re, statistics, sys
out, R, buckets = sys.argv[1], int(sys.argv[2]), sys.argv[3].split()
med = statistics.median

def run(tag):
    recs = [json.loads(l) for l in open(f"{out}/{tag}.jsonl") if l.strip()]
    st = [x for x in recs if not x.get("final")][1:]
    fin = [x for x in recs if x.get("final")][0]
    comm, exp = sum(x["comm_ms"] for x in st), sum(x["exposed_comm_ms"] for x in st)
    # all-reduce calls on the dp group per step, from the summary table of the log
    calls = None
    for line in open(f"{out}/{tag}.log"):
        m = re.match(r"\s*dp\s+all_reduce\s+(\d+)", line)
        if m:
            calls = int(m.group(1)) / len(recs[:-1])
    return dict(step=med(x["step_ms"] for x in st), comm=med(x["comm_ms"] for x in st),
                exp=med(x["exposed_comm_ms"] for x in st), hidden=1 - exp / comm if comm else 0,
                tps=med(x["tokens_per_s"] for x in st), calls=calls)

def per_repeat(rs):
    return ", ".join("%.0f%%" % (100 * x["hidden"]) for x in rs)

print("\n| bucket_mb | all-reduces/step | step ms | comm ms/step | exposed ms/step | compute ms/step (step - exposed) | hidden = 1 - exposed/comm | tokens/s | per-repeat hidden |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
for mb in buckets:
    rs = [run(f"b{mb}_r{r}") for r in range(1, R + 1)]
    label = f"{mb} (single, after backward)" if float(mb) * 1e6 > 120.25e6 else mb
    calls = rs[0]["calls"]
    print(f"| {label} | {calls:.0f} | {med(x['step'] for x in rs):.0f} | {med(x['comm'] for x in rs):.0f} | "
          f"{med(x['exp'] for x in rs):.0f} | {med(x['step'] - x['exp'] for x in rs):.0f} | "
          f"{100*med(x['hidden'] for x in rs):.0f}% | {med(x['tps'] for x in rs):.0f} | "
          f"{per_repeat(rs)} |")
EOF
