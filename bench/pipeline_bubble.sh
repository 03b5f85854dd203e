#!/usr/bin/env bash
# Pipeline bubble, measured by the engine, next to the formula (results in
# docs/bench-notes/pipeline.md).
#
# For p = 2 and 4 pipeline ranks, each schedule (gpipe, 1f1b, interleaved_1f1b with v = 2) and
# m = 4, 8, 16 micro-batches, runs `meshtrain train --parallel.pp p` on a GPT of 8 blocks (width
# 256, seq 128, byte vocabulary: the stages balance to within one block) and reports the idle share
# of the step that the executor measures on every pipeline rank (1 - compute / span, mean over the
# ranks and the steps after the first: `pp_bubble` in the metrics), beside the formula
# (p-1)/(m+p-1), interleaved (p-1)/(v*m+p-1), which assumes equal stages and free communication.
#
# usage: bench/pipeline_bubble.sh [--steps 4] [--ranks "2 4"] [--micro "4 8 16"] [--build DIR]
#                                 [--data DIR] [--out DIR]
# p = 4 runs 4 processes; on a machine with fewer cores than that they share cores (the table
# records the core count), which inflates compute time and makes the bubble there an upper bound.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
source "$ROOT/bench/common.sh"
STEPS=4
RANKS="2 4"
MICRO="4 8 16"
BUILD=$ROOT/build
DATA=/tmp/mt_bench_data
OUT=
bench_opt --steps STEPS --ranks RANKS --micro MICRO
bench_parse "$@"
bench_out pp_bubble
bench_setup "$BUILD" "$DATA"

ARGS=(--model.preset gpt2-mini --model.n_layer 8 --model.n_embd 256 --model.n_head 4 --model.seq_len 128
  --train.micro_batch 1 --data.train "$DATA/train.bin" --data.val '' --train.steps "$STEPS"
  --train.eval_every 0 --train.sample_tokens 0 --log.print_every 1000 --train.threads 1)

echo "pipeline_bubble: $(nproc) cores; ranks {$RANKS}, micro-batches {$MICRO}, $STEPS steps; raw output in $OUT"
for p in $RANKS; do
  for sched in gpipe 1f1b interleaved_1f1b; do
    v=1
    [[ $sched == interleaved_1f1b ]] && v=2
    for m in $MICRO; do
      tag=p${p}_${sched}_m$m
      bench_run "$tag" mpirun -np "$p" --oversubscribe --bind-to none -x OMP_NUM_THREADS=1 "$MT" train "${ARGS[@]}" \
        --parallel.pp "$p" --parallel.pp_schedule "$sched" --parallel.pp_virtual_stages "$v" \
        --train.grad_accum "$m"
    done
  done
done

python3 - "$OUT" "$RANKS" "$MICRO" <<'EOF'
import json, statistics, sys
out, ranks, micro = sys.argv[1], sys.argv[2].split(), sys.argv[3].split()
print("\n| p | schedule | m | measured idle share | formula | measured - formula | step ms | tokens/s | peak activation slots (rank 0) |")
print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
for p in ranks:
    for s in ["gpipe", "1f1b", "interleaved_1f1b"]:
        for m in micro:
            recs = [json.loads(l) for l in open(f"{out}/p{p}_{s}_m{m}.jsonl") if l.strip()]
            fin = [r for r in recs if r.get("final")][0]
            st = [r for r in recs if not r.get("final")][1:]
            step = statistics.median(r["step_ms"] for r in st)
            tps = statistics.median(r["tokens_per_s"] for r in st)
            name = s + (" (v=2)" if s.startswith("inter") else "")
            print(f"| {p} | {name} | {m} | {100*fin['pp_bubble']:.1f}% | {100*fin['pp_bubble_formula']:.1f}% | "
                  f"{100*(fin['pp_bubble']-fin['pp_bubble_formula']):+.1f} | {step:.0f} | {tps:.0f} | "
                  f"{fin['pp_peak_activation_slots']} |")
EOF
