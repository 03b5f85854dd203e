#!/usr/bin/env bash
# The CPU AdamW kernel's throughput on this machine (`meshtrain bench adamw`): the CPU side of
# train.offload = "optimizer" and the figure behind the planner's CPU-offload estimate
# (`meshtrain plan --host-mem-bw`, docs/plan.md "CPU offload"). Runs the bench REPEATS times,
# alternating 1 thread and every core in each repeat (the machine is shared and noisy), fp32 only
# and with the bf16 copy, and prints each run's rates, the median over repeats per configuration,
# the CPU model and the load average before each run.
#
# usage: bench/offload_adamw.sh [--params N] [--repeats R] [--build DIR] [--out DIR]
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
source "$ROOT/bench/common.sh"
PARAMS=16M
REPEATS=3
BUILD=$ROOT/build
DATA=/tmp/mt_benchdata
OUT=
bench_opt --params PARAMS --repeats REPEATS
bench_parse "$@"
bench_out offload_adamw
MT=$BUILD/meshtrain
[[ -x "$MT" ]] || { echo "offload_adamw: $MT not found: build it first (ninja -C $BUILD meshtrain)" >&2; exit 2; }
CORES=$(nproc)
echo "offload_adamw: $PARAMS parameters, $REPEATS repeats, threads 1 and $CORES; raw output in $OUT"
grep -m1 'model name' /proc/cpuinfo | sed 's/^/cpu: /'
"$MT" bench --cpu-isa | sed 's/^/meshtrain: /'
for ((r = 1; r <= REPEATS; r++)); do
  for bf in "" --bf16; do
    for t in 1 "$CORES"; do
      tag="r${r}_t${t}${bf:+_bf16}"
      load=$(cut -d' ' -f1 /proc/loadavg)
      "$MT" bench adamw --params "$PARAMS" --threads "$t" --reps 5 $bf >"$OUT/$tag.txt"
      row=$(awk '$1 ~ /^[0-9]+$/' "$OUT/$tag.txt")
      echo "$tag load $load: $row" | tee -a "$OUT/rows.txt"
    done
  done
done
echo "median over repeats (threads, copy: ms/update, Mparams/s, state GB/s, traffic GB/s):"
for bf in "" _bf16; do
  for t in 1 "$CORES"; do
    awk -v want="_t${t}${bf}\$" -v t="$t" -v c="$([[ -n $bf ]] && echo "with the bf16 copy" || echo fp32)" '
      $1 !~ want { next }
      { n++; ms[n] = $5; mp[n] = $6; sg[n] = $7; tg[n] = $8 }
      function med(a, n,   i, j, x) { for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++) if (a[j] < a[i]) { x = a[i]; a[i] = a[j]; a[j] = x }
                                     return a[int((n + 1) / 2)] }
      END { if (n) printf "  %d threads, %s: %.2f ms, %.1f Mparams/s, %.2f GB/s state, %.2f GB/s traffic\n", t, c, med(ms, n), med(mp, n), med(sg, n), med(tg, n) }' "$OUT/rows.txt"
  done
done
