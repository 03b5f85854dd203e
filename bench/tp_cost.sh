#!/usr/bin/env bash
# What tensor parallelism costs (results in docs/bench-notes/pipeline.md).
#
# Part 1, one machine (shared memory): 2 ranks as DDP (NO_SHARD) vs tp=2 vs tp=2 with sequence
# parallelism, same model and global batch: step time, tokens/s, exposed communication, and the
# bytes each rank moved per group.
# Part 2, two network-namespace "nodes" joined by a shaped link (bench/two_nodes.sh; needs root):
# 4 ranks as tp=2 x DDP 2, once with each tp pair inside a node (the data-parallel all-reduce
# crosses the link, overlapped with backward) and once with the tp pairs spanning the nodes
# (mpirun --map-by node: every tensor-parallel all-reduce crosses the link).
# Both parts also run tensor parallelism with --parallel.tp_overlap false: the column-parallel
# layers' input-gradient reductions then complete before the weight gradients are computed instead
# of overlapping them (the difference is what that overlap hides).
#
# usage: [sudo] bench/tp_cost.sh [--steps 4] [--rate 1gbit] [--part 1|2|both] [--micro 4] [--build DIR] [--data DIR] [--out DIR]
# --micro: part 2's sequences per rank per step; the tensor-parallel traffic grows with it, the
# data-parallel traffic (the gradients) does not.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
source "$ROOT/bench/common.sh"
STEPS=4
RATE=1gbit
PART=both
MICRO=4
BUILD=$ROOT/build
DATA=/tmp/mt_bench_data
OUT=
bench_opt --steps STEPS --rate RATE --part PART --micro MICRO
bench_parse "$@"
bench_out tp_cost
bench_setup "$BUILD" "$DATA"

# 6 blocks of width 384, seq 256, byte vocabulary (10.6 M parameters), 1 thread per rank.
ARGS=(--model.preset gpt2-mini --model.n_layer 6 --model.n_embd 384 --model.n_head 6 --model.seq_len 256
  --data.train "$DATA/train.bin" --data.val '' --train.steps "$STEPS" --train.eval_every 0
  --train.sample_tokens 0 --log.print_every 1000 --train.threads 1)
echo "tp_cost: $(nproc) cores, $STEPS steps per run; raw output in $OUT"
if [[ $PART == 1 || $PART == both ]]; then
  L=(mpirun -np 2 --bind-to none -x OMP_NUM_THREADS=1 "$MT" train "${ARGS[@]}" --train.micro_batch 4)
  bench_run ddp2 "${L[@]}"
  bench_run tp2 "${L[@]}" --parallel.tp 2 --train.micro_batch 8
  bench_run tp2_sync "${L[@]}" --parallel.tp 2 --train.micro_batch 8 --parallel.tp_overlap false
  bench_run tp2sp "${L[@]}" --parallel.tp 2 --parallel.sequence_parallel true --train.micro_batch 8
fi
if [[ $PART == 2 || $PART == both ]]; then
  [[ $EUID -eq 0 ]] || { echo "tp_cost.sh: part 2 needs root (network namespaces)" >&2; exit 1; }
  trap '"$ROOT/bench/two_nodes.sh" --cleanup >/dev/null 2>&1 || true' EXIT
  T=("$ROOT/bench/two_nodes.sh" --rate "$RATE" -p 2)
  TA=("$MT" train "${ARGS[@]}" --parallel.tp 2 --train.micro_batch "$MICRO")
  OMP_NUM_THREADS=1 bench_run tp_in_node "${T[@]}" -- "${TA[@]}"
  OMP_NUM_THREADS=1 bench_run tp_across "${T[@]}" -x "--map-by node" -- "${TA[@]}"
  OMP_NUM_THREADS=1 bench_run tp_across_sync "${T[@]}" -x "--map-by node" -- "${TA[@]}" --parallel.tp_overlap false
fi

MICRO=$MICRO python3 - "$OUT" <<'EOF'
import json, os, re, statistics, sys
out = sys.argv[1]
def res(tag):
    if not os.path.exists(f"{out}/{tag}.jsonl"):
        return None
    recs = [json.loads(l) for l in open(f"{out}/{tag}.jsonl") if l.strip()]
    st = [r for r in recs if not r.get("final")][1:]
    fin = [r for r in recs if r.get("final")][0]
    med = lambda k: statistics.median(r[k] for r in st)
    return dict(step=med("step_ms"), tps=med("tokens_per_s"), comm=med("comm_ms"), exp=med("exposed_comm_ms"),
                groups=fin["comm_bytes_by_group"], steps=fin["steps"])
rows = [("ddp2", "2 ranks, DDP (NO_SHARD), micro-batch 4 per rank"),
        ("tp2", "2 ranks, tp=2, micro-batch 8 (same global batch)"),
        ("tp2_sync", "2 ranks, tp=2, micro-batch 8, tp_overlap false"),
        ("tp2sp", "2 ranks, tp=2 + sequence parallel, micro-batch 8"),
        ("tp_in_node", "2 nodes x 2 ranks, tp=2 inside each node x DDP 2 across the link"),
        ("tp_across", "2 nodes x 2 ranks, tp=2 across the link x DDP 2 inside each node"),
        ("tp_across_sync", "2 nodes x 2 ranks, tp=2 across the link, tp_overlap false")]
micro = os.environ.get("MICRO", "")
print("\n| run | step ms | tokens/s | comm ms/step | exposed ms/step | MiB per step per group (rank 0) |")
print("|---|---:|---:|---:|---:|---|")
for tag, what in rows:
    r = res(tag)
    if not r:
        continue
    g = ", ".join(f"{k} {v/2**20/r['steps']:.1f}" for k, v in sorted(r["groups"].items()) if k in ("dp", "tp") and v)
    if tag.startswith("tp_") and micro:
        what += f", micro-batch {micro}"
    print(f"| {what} | {r['step']:.0f} | {r['tps']:.0f} | {r['comm']:.0f} | {r['exp']:.0f} | {g} |")
EOF
