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
# which assume equal stages, free communication and (zero bubble) T_F = T_B = T_W. Idle time per
# step (ms), two ways: over each rank's own span (the measured idle share times the step time),
# and over the step's common window, the longest rank span (`pp_idle_ms`: a rank that finishes
# early idles until the last one ends, as in the formula), the median over the steps after the
# first. --runs N repeats every configuration N times, the schedules alternating (the table
# gives the medians over the runs).
#
# Per stage it also reports what the executor's timers measured for one micro-batch: the forward
# (F), the backward or, under a split schedule, its input-gradient part (B), and the weight
# gradients (W), in wall time and in the compute thread's CPU time (which leaves out the waits for
# a core on a loaded machine), and the schedule's simulated bubble with the CPU-time costs
# ("costed"). A schedule
# written NAME:c (zb1p:c, zbv:c) is built for the costs given with --costs F,B,W
# (--parallel.pp_costs; e.g. the relative F/B/W that a plain zb1p run measured), NAME:auto for the
# costs the run measures in its second step (--parallel.pp_costs auto).
#
# usage: bench/pipeline_bubble.sh [--steps 4] [--ranks "2 4"] [--micro "4 8 16"] [--runs 1]
#                                 [--scheds "gpipe 1f1b interleaved_1f1b zb1p zbv"] [--build DIR]
#                                 [--bind core] [--costs F,B,W] [--trace] [--data DIR] [--out DIR]
#                                 [--layers 8] [--width 256] [--heads 4]
# --layers / --width / --heads change the GPT's blocks (e.g. --layers 4 --width 768 --heads 12:
# GPT-2 small's blocks, whose time is mostly GEMMs, so W is close to F as the zero-bubble papers
# assume; at width 256 attention and elementwise work make W about 0.8 F).
# --bind core (default) pins each rank to a core of its own (mpirun --bind-to core) when there are
# at least p cores; --bind none, or p above the core count, leaves placement to the OS. p = 4 runs
# 4 processes; on a machine with fewer cores than that they share cores (the table records the
# core count), which inflates compute time and makes the bubble there an upper bound.
# --trace records the executor's trace of every run (MESHTRAIN_PP_TRACE) and prints, per
# configuration, where each rank's idle time went (bench/pipeline_trace.py, means over the runs).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
source "$ROOT/bench/common.sh"
STEPS=4
RANKS="2 4"
MICRO="4 8 16"
SCHEDS="gpipe 1f1b interleaved_1f1b zb1p zbv"
RUNS=1
BIND=core
COSTS=
TRACE=0
BUILD=$ROOT/build
DATA=/tmp/mt_bench_data
OUT=
LAYERS=8
WIDTH=256
HEADS=4
bench_opt --steps STEPS --ranks RANKS --micro MICRO --scheds SCHEDS --runs RUNS --bind BIND --costs COSTS \
  --layers LAYERS --width WIDTH --heads HEADS
bench_flag --trace TRACE=1
bench_parse "$@"
bench_out pp_bubble
bench_setup "$BUILD" "$DATA"
[[ $BIND == core || $BIND == none ]] || { echo "pipeline_bubble.sh: --bind takes core or none, not $BIND" >&2; exit 2; }

ARGS=(--model.preset gpt2-mini --model.n_layer "$LAYERS" --model.n_embd "$WIDTH" --model.n_head "$HEADS" --model.seq_len 128
  --train.micro_batch 1 --data.train "$DATA/train.bin" --data.val '' --train.steps "$STEPS"
  --train.eval_every 0 --train.sample_tokens 0 --log.print_every 1000 --train.threads 1)

echo "pipeline_bubble: $(nproc) cores, bind $BIND; GPT of $LAYERS blocks, width $WIDTH, $HEADS heads; ranks {$RANKS}, micro-batches {$MICRO}, schedules {$SCHEDS}, $STEPS steps, $RUNS runs; raw output in $OUT"
for run in $(seq 1 "$RUNS"); do
  for p in $RANKS; do
    for m in $MICRO; do
      for sched in $SCHEDS; do  # innermost: the schedules alternate on the same load
        v=1
        [[ $sched == interleaved_1f1b ]] && v=2
        extra=()
        if [[ $sched == *:c ]]; then
          [[ -n $COSTS ]] || { echo "pipeline_bubble.sh: $sched needs --costs F,B,W" >&2; exit 2; }
          extra=(--parallel.pp_costs "$COSTS")
        elif [[ $sched == *:auto ]]; then
          extra=(--parallel.pp_costs auto)
        fi
        tag=p${p}_${sched/:/_}_m${m}_r$run
        bind=$BIND
        ((p > $(nproc))) && bind=none
        if ((TRACE)); then export MESHTRAIN_PP_TRACE=$OUT/$tag.trace; else unset MESHTRAIN_PP_TRACE; fi
        bench_run "$tag" mpirun -np "$p" --oversubscribe --bind-to "$bind" -x OMP_NUM_THREADS=1 "$MT" train "${ARGS[@]}" \
          --parallel.pp "$p" --parallel.pp_schedule "${sched%:*}" --parallel.pp_virtual_stages "$v" \
          --train.grad_accum "$m" "${extra[@]}"
      done
    done
  done
done

python3 - "$OUT" "$RANKS" "$MICRO" "$SCHEDS" "$RUNS" <<'EOF'
import json, statistics, sys
out, ranks, micro, scheds, runs = sys.argv[1], sys.argv[2].split(), sys.argv[3].split(), sys.argv[4].split(), int(sys.argv[5])
print("\n| p | schedule | m | measured idle share | predicted | costed | idle ms per step (own span) | idle ms per step (step window) | step ms | tokens/s | peak activation slots (rank 0) | F / B / W ms per stage (wall) | F / B / W CPU ms per stage |")
print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|")
for p in ranks:
    for m in micro:
        for s in scheds:
            idle, idle_ms, win_ms, steps, tpss, costed, stage, cpu = [], [], [], [], [], [], [], []
            for r in range(1, runs + 1):
                recs = [json.loads(l) for l in open(f"{out}/p{p}_{s.replace(':', '_')}_m{m}_r{r}.jsonl") if l.strip()]
                fin = [x for x in recs if x.get("final")][0]
                st = [x for x in recs if not x.get("final")][1:]
                step = statistics.median(x["step_ms"] for x in st)
                idle.append(fin["pp_bubble"]); idle_ms.append(fin["pp_bubble"] * step); steps.append(step)
                win_ms.append(statistics.median(x["pp_idle_ms"] for x in st))
                tpss.append(statistics.median(x["tokens_per_s"] for x in st))
                costed.append(fin.get("pp_bubble_costed", 0.0))
                stage.append(fin.get("pp_stage_ms", []))
                cpu.append(fin.get("pp_stage_cpu_ms", []))
            def fbw(st):
                return "; ".join("/".join(f"{statistics.median(run[i][k] for run in st):.1f}" for k in "FBW")
                                 for i in range(len(st[0])))
            name = s + (" (v=2)" if s.startswith("inter") else "")
            print(f"| {p} | {name} | {m} | {100*statistics.median(idle):.1f}% | {100*fin['pp_bubble_formula']:.1f}% | "
                  f"{100*statistics.median(costed):.1f}% | "
                  f"{statistics.median(idle_ms):.1f} | {statistics.median(win_ms):.1f} | {statistics.median(steps):.0f} | {statistics.median(tpss):.0f} | "
                  f"{fin['pp_peak_activation_slots']} | {fbw(stage)} | {fbw(cpu)} |")
EOF
if ((TRACE)); then
  for p in $RANKS; do
    for m in $MICRO; do
      for sched in $SCHEDS; do
        echo; echo "p $p, m $m, $sched: where the idle time went"
        prefixes=()
        for run in $(seq 1 "$RUNS"); do prefixes+=("$OUT/p${p}_${sched/:/_}_m${m}_r$run.trace"); done
        python3 "$ROOT/bench/pipeline_trace.py" "${prefixes[@]}"
      done
    done
  done
fi
