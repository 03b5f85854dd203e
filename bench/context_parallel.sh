#!/usr/bin/env bash
# What context parallelism (ring attention, parallel.cp) saves and costs (results in
# docs/benchmarks.md and docs/context_parallel.md).
#
# Part 1, memory and bytes at --seq (exact, from the engine's dry run, which matches a real run byte
# for byte - DryRun.MatchesARealRunByteForByte): activations, workspace and the cp group's bytes per
# rank and step for cp = 1, 2, 4, next to the ring's byte formula.
# Part 2, time on this machine at --time-seq: one sequence per step as one process (cp = 1), and as
# cp = 2 with the ring and with the all-gather variant (2 processes, 1 thread each): tokens/s, the
# cp transfers' time per step and the part the compute thread waited for (exposed); and the real
# runs' memory next to the dry runs'.
#
# usage: bench/context_parallel.sh [--seq 8192] [--time-seq 4096] [--steps 3] [--preset llama-mini] [--build DIR] [--data DIR] [--out DIR]
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
source "$ROOT/bench/common.sh"
SEQ=8192
TSEQ=4096
STEPS=3
PRESET=llama-mini
BUILD=$ROOT/build
DATA=/tmp/mt_bench_data
OUT=
bench_opt --seq SEQ --time-seq TSEQ --steps STEPS --preset PRESET
bench_parse "$@"
bench_out context_parallel
bench_setup "$BUILD" "$DATA"

ARGS=(--model.preset "$PRESET" --train.micro_batch 1 --data.train "$DATA/train.bin"
  --data.val '' --train.eval_every 0 --train.sample_tokens 0 --log.print_every 1000 --train.threads 1)
echo "context_parallel: $(nproc) cores, $PRESET, seq $SEQ; raw output in $OUT"
for cp in 1 2 4; do
  bench_run "dry_cp$cp" "$MT" train "${ARGS[@]}" --model.seq_len "$SEQ" --train.steps 1 --parallel.cp "$cp" --dry-run --world "$cp" --rank 0
  bench_run "dry_t_cp$cp" "$MT" train "${ARGS[@]}" --model.seq_len "$TSEQ" --train.steps 1 --parallel.cp "$cp" --dry-run --world "$cp" --rank 0
done
bench_run real_cp1 env MESHTRAIN_MPI=0 "$MT" train "${ARGS[@]}" --model.seq_len "$TSEQ" --train.steps "$STEPS"
L=(mpirun -np 2 --bind-to none -x OMP_NUM_THREADS=1 "$MT" train "${ARGS[@]}" --model.seq_len "$TSEQ" --train.steps "$STEPS" --parallel.cp 2)
bench_run real_cp2_ring "${L[@]}"
bench_run real_cp2_allgather "${L[@]}" --parallel.cp_mode allgather

python3 - "$OUT" "$PRESET" "$SEQ" "$TSEQ" <<'PY'
import json, sys
out, preset, seq, tseq = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
def final(tag):
    return [json.loads(l) for l in open(f"{out}/{tag}.jsonl")][-1]
MiB = 1 << 20
print(f"\nmemory and bytes per rank, {preset}, micro-batch 1 (seq {seq}: dry runs; seq {tseq}: dry and real runs):")
print(f"{'run':22} {'activations':>12} {'workspace':>10} {'cp bytes/step':>14}")
for tag in ["dry_cp1", "dry_cp2", "dry_cp4", "dry_t_cp1", "dry_t_cp2", "real_cp1", "real_cp2_ring", "real_cp2_allgather"]:
    f = final(tag)
    steps = f["steps"]
    m = f["mem_peak_by_category"]
    cpb = f["comm_bytes_by_group"].get("cp", 0) / steps
    print(f"{tag:22} {m['activations']/MiB:10.2f} MiB {m['workspace']/MiB:6.2f} MiB {cpb/MiB:10.2f} MiB")
print("\ntime per step (mean over the steps after the first):")
print(f"{'run':22} {'tokens/s':>9} {'cp transfers ms':>16} {'exposed ms':>11} {'hidden':>7}")
for tag in ["real_cp1", "real_cp2_ring", "real_cp2_allgather"]:
    f = final(tag)
    c, e = f.get("cp_comm_ms_per_step", 0.0), f.get("cp_exposed_ms_per_step", 0.0)
    # the all-gather variant's collectives block the compute thread: nothing of them is hidden
    hidden = f"{max(0.0, 100 * (1 - e / c)):.0f}%" if c > 0 else "-"
    print(f"{tag:22} {f['tokens_per_s']:9.0f} {c:16.1f} {e:11.1f} {hidden:>7}")
PY
