#!/usr/bin/env bash
# The CPU backend's instruction-set levels side by side (docs/cpu.md): the same binary run with
# MESHTRAIN_CPU_ISA capped at each level this CPU has (avx2, avx512, avx512_bf16, amx_bf16), on
# the benchmark config (gpt2-small-cpu, micro-batch 4, 1024 tokens per step), fp32 and bf16, at the
# given thread count; per level also kernel_bench's per-op table (the non-GEMM kernels of that
# level's variant, oneDNN capped at the same level). Reported: median tokens/s over the steps
# after the first, per run, and the ratio to the avx2 level measured in the same repeat.
#
# usage: bench/cpu_levels.sh [--steps N] [--repeats R] [--threads T] [--dtypes "fp32 bf16"]
#                            [--build DIR] [--data DIR] [--out DIR] [--no-kernels]
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
source "$ROOT/bench/common.sh"
STEPS=8
REPEATS=2
THREADS=2
DTYPES="fp32 bf16"
KERNELS=1
BUILD=$ROOT/build-bench
DATA=/tmp/mt_benchdata
OUT=
bench_opt --steps STEPS --repeats REPEATS --threads THREADS --dtypes DTYPES
bench_flag --no-kernels KERNELS=0
bench_parse "$@"
bench_out cpu_levels
bench_setup "$BUILD" "$DATA" bench/kernel_bench

levels=()
for l in avx2 avx512 avx512_bf16 amx_bf16; do
  MESHTRAIN_CPU_ISA=$l "$MT" bench --cpu-isa >/dev/null 2>&1 && levels+=("$l")
done
echo "cpu_levels: levels {${levels[*]}}, $REPEATS repeats x $STEPS steps, $THREADS threads, dtypes {$DTYPES}; raw output in $OUT"
grep -m1 'model name' /proc/cpuinfo | sed 's/^/cpu: /'
"$MT" bench --cpu-isa | sed 's/^/meshtrain: /'

ARGS=(--model.preset gpt2-small-cpu --train.micro_batch 4 --data.train "$DATA/train.bin" --data.val ''
  --train.steps "$STEPS" --train.eval_every 0 --train.sample_tokens 0 --log.print_every 1000
  --train.threads "$THREADS")
if ((KERNELS)); then
  for l in "${levels[@]}"; do
    MESHTRAIN_CPU_ISA=$l "$BUILD/bench/kernel_bench" --threads "$THREADS" --min-time 0.05 >"$OUT/kernels_$l.txt" 2>&1
  done
fi
for ((r = 1; r <= REPEATS; r++)); do
  echo "repeat $r/$REPEATS: load $(cut -d' ' -f1-3 /proc/loadavg)"
  for dt in $DTYPES; do
    order=("${levels[@]}")
    if ((r % 2 == 0)); then order=(); for ((i = ${#levels[@]} - 1; i >= 0; i--)); do order+=("${levels[$i]}"); done; fi
    for l in "${order[@]}"; do
      MESHTRAIN_CPU_ISA=$l "$MT" train "${ARGS[@]}" --train.dtype "$dt" \
        --log.metrics_out "$OUT/${dt}_${l}_r$r.jsonl" >"$OUT/${dt}_${l}_r$r.log" 2>&1
    done
  done
done

python3 - "$OUT" "$REPEATS" "$DTYPES" "${levels[*]}" "$THREADS" <<'EOF'
import json, re, statistics, sys
out, R, dtypes, levels, threads = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(), sys.argv[4].split(), sys.argv[5]
def tps(dt, l, r):
    recs = [json.loads(x) for x in open(f"{out}/{dt}_{l}_r{r}.jsonl") if x.strip()]
    steps = [x["tokens_per_s"] for x in recs if not x.get("final")]
    return statistics.median(steps[1:])
print(f"\ntokens/s at {threads} threads (median over steps 2.., then over repeats); ratio to avx2 in the same repeat\n")
print("| dtype | " + " | ".join(levels) + " |")
print("|---|" + "---:|" * len(levels))
for dt in dtypes:
    cells = []
    for l in levels:
        v = [tps(dt, l, r) for r in range(1, R + 1)]
        base = [tps(dt, levels[0], r) for r in range(1, R + 1)]
        ratio = statistics.median([a / b for a, b in zip(v, base)])
        cells.append(f"{statistics.median(v):.0f} ({ratio:.2f}x)")
    print(f"| {dt} | " + " | ".join(cells) + " |")
import os
if os.path.exists(f"{out}/kernels_{levels[0]}.txt"):
    print(f"\nkernel_bench at {threads} threads, ms per call (wall), per level:\n")
    rows = {}
    for l in levels:
        for line in open(f"{out}/kernels_{l}.txt"):
            m = re.match(r"\| ([^|]+?) \| (\d+) \| ([\d.]+) \(", line)
            if m:
                rows.setdefault(m.group(1), {})[l] = float(m.group(3))
            m = re.match(r"\| (\S+ \S+) \| (fwd|dinp|dW) \| \S+ \| [\d.]+ \([\d.]+\) \| ([\d.]+) \(", line)
            if m and "lm_head" in m.group(1):
                rows.setdefault(f"bf16 GEMM GFLOP/s {m.group(1)} {m.group(2)}", {})[l] = float(m.group(3))
    print("| op | " + " | ".join(levels) + " |")
    print("|---|" + "---:|" * len(levels))
    for k, v in rows.items():
        print(f"| {k} | " + " | ".join(f"{v.get(l, float('nan')):.3f}" for l in levels) + " |")
EOF
