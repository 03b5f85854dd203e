#!/usr/bin/env bash
# DDP scaling on one machine (results in docs/bench-notes/ddp.md):
# meshtrain 2 ranks x 1 thread vs 1 rank x 1 thread on the benchmark config (gpt2-small-cpu,
# micro-batch 4 per rank, fp32), scaling efficiency = tokens/s(2 ranks) / (2 x tokens/s(1 rank)).
# Optionally (--pytorch, default when /usr/bin/python3 has torch) the same pair in PyTorch in the
# same repeat: eager 1 process x 1 thread and DDP (gloo) 2 ranks x 1 thread (bench/pytorch_compare.py).
#
# Each repeat runs the configurations one after the other (order reversed every second repeat);
# per run the figure is the median of the per-step tokens_per_s (global tokens, rank 0's metrics
# file) over the steps after the first; the table gives medians over repeats, and the efficiency is
# the median of the per-repeat ratios (1 and 2 ranks measured side by side).
# Both meshtrain runs get GLIBC_TUNABLES=glibc.malloc.hugetlb=1 (what `meshtrain launch` gives
# its ranks) and 1 OpenMP thread per rank. Each run's line gives the steal: the share of the
# machine's CPU time the hypervisor gave other guests meanwhile.
#
# usage: bench/ddp_scaling.sh [--steps N] [--repeats R] [--torch-steps N] [--pytorch] [--no-pytorch]
#                             [--python PY] [--build DIR] [--data DIR] [--out DIR]
#   --python PY: the interpreter whose torch is the peer (default /usr/bin/python3, Debian's 1.13)
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
source "$ROOT/bench/common.sh"
STEPS=12
REPEATS=3
TORCH_STEPS=6
PYTORCH=auto
PY=/usr/bin/python3
PY_ARG=
BUILD=$ROOT/build-bench
DATA=/tmp/mt_benchdata
OUT=
bench_opt --steps STEPS --repeats REPEATS --torch-steps TORCH_STEPS --python PY_ARG
bench_flag --pytorch PYTORCH=1 --no-pytorch PYTORCH=0
bench_parse "$@"
if [[ -n $PY_ARG ]]; then PY=$PY_ARG; [[ $PYTORCH == 0 ]] || PYTORCH=1; fi
bench_out ddp_scaling
if [[ $PYTORCH == auto ]]; then
  if "$PY" -c 'import torch' 2>/dev/null; then PYTORCH=1; else PYTORCH=0; fi
fi
bench_setup "$BUILD" "$DATA"

ARGS=(--model.preset gpt2-small-cpu --train.micro_batch 4 --data.train "$DATA/train.bin" --data.val ''
  --train.steps "$STEPS" --train.eval_every 0 --train.sample_tokens 0 --log.print_every 1000
  --train.threads 1)

runs=(mt1 mt2)
[[ $PYTORCH == 1 ]] && runs+=(pt1 pt2) && check_torch_blas "$PY"
echo "ddp_scaling: $REPEATS repeats, meshtrain $STEPS steps, pytorch $([[ $PYTORCH == 1 ]] && echo "$TORCH_STEPS steps" || echo off); raw output in $OUT"
for ((r = 1; r <= REPEATS; r++)); do
  echo "repeat $r/$REPEATS: load $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$OUT/load.txt"
  order=("${runs[@]}")
  if ((r % 2 == 0)); then order=(); for ((i = ${#runs[@]} - 1; i >= 0; i--)); do order+=("${runs[$i]}"); done; fi
  for run in "${order[@]}"; do
    snap=$(cpu_snapshot)
    case $run in
      mt1) GLIBC_TUNABLES=glibc.malloc.hugetlb=1 OMP_NUM_THREADS=1 "$MT" train "${ARGS[@]}" \
             --log.metrics_out "$OUT/mt1_r$r.jsonl" >"$OUT/mt1_r$r.log" 2>&1 ;;
      mt2) "$MT" launch -n 2 --threads 1 -- train "${ARGS[@]}" \
             --log.metrics_out "$OUT/mt2_r$r.jsonl" >"$OUT/mt2_r$r.log" 2>&1 ;;
      pt1) "$PY" "$ROOT/bench/pytorch_compare.py" --mode eager --dtypes fp32 --threads 1 \
             --steps "$TORCH_STEPS" --warmup 1 >"$OUT/pt1_r$r.jsonl" 2>"$OUT/pt1_r$r.log" ;;
      pt2) "$PY" "$ROOT/bench/pytorch_compare.py" --mode ddp --ranks 2 \
             --steps "$TORCH_STEPS" --warmup 1 >"$OUT/pt2_r$r.jsonl" 2>"$OUT/pt2_r$r.log" ;;
    esac
    echo "  $run done, load $(cut -d' ' -f1 /proc/loadavg), steal $(steal_since "$snap")" | tee -a "$OUT/load.txt"
  done
done
echo "after: load $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$OUT/load.txt"

python3 - "$OUT" "$REPEATS" "$PYTORCH" <<'EOF'
import json, statistics, sys
out, R, pt = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
med = statistics.median

def mt(tag):
    recs = [json.loads(l) for l in open(f"{out}/{tag}.jsonl") if l.strip()]
    st = [x for x in recs if not x.get("final")][1:]
    return (med(x["tokens_per_s"] for x in st), med(x["comm_ms"] for x in st),
            med(x["exposed_comm_ms"] for x in st), med(x["step_ms"] for x in st))

def torch(tag):
    return [json.loads(l) for l in open(f"{out}/{tag}.jsonl") if l.startswith("{")][0]["tokens_per_s"]

m1 = [mt(f"mt1_r{r}") for r in range(1, R + 1)]
m2 = [mt(f"mt2_r{r}") for r in range(1, R + 1)]
eff = [b[0] / (2 * a[0]) for a, b in zip(m1, m2)]
print("\n| engine | ranks x threads | tokens/s (global) | step ms | comm ms/step | exposed ms/step | per-repeat tokens/s |")
print("|---|---|---:|---:|---:|---:|---|")
print(f"| meshtrain | 1 x 1 | {med(a[0] for a in m1):.0f} | {med(a[3] for a in m1):.0f} | - | - | {' / '.join(f'{a[0]:.0f}' for a in m1)} |")
print(f"| meshtrain DDP | 2 x 1 | {med(a[0] for a in m2):.0f} | {med(a[3] for a in m2):.0f} | {med(a[1] for a in m2):.1f} | {med(a[2] for a in m2):.1f} | {' / '.join(f'{a[0]:.0f}' for a in m2)} |")
if pt:
    p1 = [torch(f"pt1_r{r}") for r in range(1, R + 1)]
    p2 = [torch(f"pt2_r{r}") for r in range(1, R + 1)]
    peff = [b / (2 * a) for a, b in zip(p1, p2)]
    print(f"| PyTorch eager | 1 x 1 | {med(p1):.0f} | | | | {' / '.join(f'{a:.0f}' for a in p1)} |")
    print(f"| PyTorch DDP gloo | 2 x 1 | {med(p2):.0f} | | | | {' / '.join(f'{a:.0f}' for a in p2)} |")
print(f"\nmeshtrain scaling efficiency tps(2)/(2 tps(1)): median {100*med(eff):.0f}% (per repeat {', '.join(f'{100*e:.0f}%' for e in eff)})")
if pt:
    print(f"PyTorch scaling efficiency: median {100*med(peff):.0f}% (per repeat {', '.join(f'{100*e:.0f}%' for e in peff)})")
    rat = [b[0] / p for b, p in zip(m2, p2)]
    rat1 = [a[0] / p for a, p in zip(m1, p1)]
    print(f"meshtrain DDP / PyTorch DDP (2 x 1): median {med(rat):.2f}x (per repeat {', '.join(f'{x:.2f}' for x in rat)})")
    print(f"meshtrain / PyTorch eager (1 x 1): median {med(rat1):.2f}x (per repeat {', '.join(f'{x:.2f}' for x in rat1)})")
EOF
