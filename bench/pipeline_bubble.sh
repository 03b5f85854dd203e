#!/usr/bin/env bash
# Pipeline bubble, measured by the engine, next to the formula (results in
# docs/bench-notes/pipeline.md).
#
# For p = 2 and 4 pipeline ranks, each schedule (gpipe, 1f1b, interleaved_1f1b with v = 2, the
# zero-bubble zb1p and zbv) and m = 4, 8, 16 micro-batches, runs `meshtrain train --parallel.pp p` on a GPT of 8 blocks (width
# 256, seq 128, byte vocabulary: the stages balance to within one block) and reports the idle share
# of the step that the executor measures on every pipeline rank (1 - compute / span, mean over the
# ranks and the steps after the first: `pp_bubble` in the metrics), beside the formula
# (p-1)/(m+p-1), interleaved (p-1)/(v*m+p-1), zb1p (p-1)/(3m+p-1), zbv its simulated timeline,
# which assume equal stages, free communication and (zero bubble) T_F = T_B = T_W. The idle time
# per step (ms) is the measured idle share times the step time. --runs N repeats every
# configuration N times, the schedules alternating (the table gives the medians).
#
# usage: bench/pipeline_bubble.sh [--steps 4] [--ranks "2 4"] [--micro "4 8 16"] [--runs 1]
#                                 [--scheds "gpipe 1f1b interleaved_1f1b zb1p zbv"] [--build DIR]
#                                 [--data DIR] [--out DIR]
# p = 4 runs 4 processes; on a machine with fewer cores than that they share cores (the table
# records the core count), which inflates compute time and makes the bubble there an upper bound.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
source "$ROOT/bench/common.sh"
STEPS=4
RANKS="2 4"
MICRO="4 8 16"
SCHEDS="gpipe 1f1b interleaved_1f1b zb1p zbv"
RUNS=1
BUILD=$ROOT/build
DATA=/tmp/mt_bench_data
OUT=
bench_opt --steps STEPS --ranks RANKS --micro MICRO --scheds SCHEDS --runs RUNS
bench_parse "$@"
bench_out pp_bubble
bench_setup "$BUILD" "$DATA"

ARGS=(--model.preset gpt2-mini --model.n_layer 8 --model.n_embd 256 --model.n_head 4 --model.seq_len 128
  --train.micro_batch 1 --data.train "$DATA/train.bin" --data.val '' --train.steps "$STEPS"
  --train.eval_every 0 --train.sample_tokens 0 --log.print_every 1000 --train.threads 1)

echo "pipeline_bubble: $(nproc) cores; ranks {$RANKS}, micro-batches {$MICRO}, schedules {$SCHEDS}, $STEPS steps, $RUNS runs; raw output in $OUT"
for run in $(seq 1 "$RUNS"); do
  for p in $RANKS; do
    for m in $MICRO; do
      for sched in $SCHEDS; do  # innermost: the schedules alternate on the same load
        v=1
        [[ $sched == interleaved_1f1b ]] && v=2
        tag=p${p}_${sched}_m${m}_r$run
        bench_run "$tag" mpirun -np "$p" --oversubscribe --bind-to none -x OMP_NUM_THREADS=1 "$MT" train "${ARGS[@]}" \
          --parallel.pp "$p" --parallel.pp_schedule "$sched" --parallel.pp_virtual_stages "$v" \
          --train.grad_accum "$m"
      done
    done
  done
done

python3 - "$OUT" "$RANKS" "$MICRO" "$SCHEDS" "$RUNS" <<'EOF'
import json, statistics, sys
out, ranks, micro, scheds, runs = sys.argv[1], sys.argv[2].split(), sys.argv[3].split(), sys.argv[4].split(), int(sys.argv[5])
print("\n| p | schedule | m | measured idle share | predicted | idle ms per step | step ms | tokens/s | peak activation slots (rank 0) |")
print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
for p in ranks:
    for m in micro:
        for s in scheds:
            idle, idle_ms, steps, tpss = [], [], [], []
            for r in range(1, runs + 1):
                recs = [json.loads(l) for l in open(f"{out}/p{p}_{s}_m{m}_r{r}.jsonl") if l.strip()]
                fin = [x for x in recs if x.get("final")][0]
                st = [x for x in recs if not x.get("final")][1:]
                step = statistics.median(x["step_ms"] for x in st)
                idle.append(fin["pp_bubble"]); idle_ms.append(fin["pp_bubble"] * step); steps.append(step)
                tpss.append(statistics.median(x["tokens_per_s"] for x in st))
            name = s + (" (v=2)" if s.startswith("inter") else "")
            print(f"| {p} | {name} | {m} | {100*statistics.median(idle):.1f}% | {100*fin['pp_bubble_formula']:.1f}% | "
                  f"{statistics.median(idle_ms):.1f} | {statistics.median(steps):.0f} | {statistics.median(tpss):.0f} | "
                  f"{fin['pp_peak_activation_slots']} |")
EOF
