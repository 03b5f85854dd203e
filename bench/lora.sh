#!/usr/bin/env bash
# LoRA against full fine-tuning (summary in docs/finetuning.md): a small Llama (llama-small-cpu,
# seq 128) trained for a few steps on 1 rank and on 2 ranks (DDP, FULL_SHARD), full fine-tuning
# and LoRA (rank 16 on q,k,v,o,gate,up,down), fp32. Per run: tokens/s (mean over steps after the
# first), resident memory by category of rank 0 (params, grads, optimizer) and the bytes rank 0
# moved per step by group. Then the dry run (exact memory, no machine needed) of Llama 3 8B on 1
# rank and Llama 3 70B on 8 ranks (FULL_SHARD), bf16, full recompute, full fine-tuning next to LoRA.
#
# The summary's bytes per step are each group's total over the run / steps (the start-up broadcast of
# the weights included); the runs' logs (OUT/TAG.log) have the table by operation.
#
# usage: bench/lora.sh [--steps N] [--build DIR] [--data DIR] [--out DIR]
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
source "$ROOT/bench/common.sh"
STEPS=6
BUILD=$ROOT/build
DATA=/tmp/mt_bench_data
OUT=
bench_opt --steps STEPS
bench_parse "$@"
bench_out lora
bench_setup "$BUILD" "$DATA"
echo "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2-)   load at start: $(cut -d' ' -f1-3 /proc/loadavg)   out: $OUT"

LORA=(--lora.rank 16 --lora.alpha 32 --lora.targets q,k,v,o,gate,up,down)
ARGS=(--model.preset llama-small-cpu --model.seq_len 128 --data.train "$DATA/train.bin" --data.val ''
  --train.steps "$STEPS" --train.warmup_steps 1 --train.micro_batch 4 --train.sample_tokens 0
  --train.eval_every 0 --log.print_every 1000)

for np in 1 2; do
  for strat in NO_SHARD FULL_SHARD; do
    [[ $np == 1 && $strat == FULL_SHARD ]] && continue
    for mode in full lora; do
      extra=()
      [[ $mode == lora ]] && extra=("${LORA[@]}")
      tag=${mode}_np${np}_${strat}
      if [[ $np == 1 ]]; then
        bench_run "$tag" env MESHTRAIN_MPI=0 "$MT" train "${ARGS[@]}" "${extra[@]}" --train.threads 2
      else
        bench_run "$tag" mpirun -np "$np" --bind-to none -x OMP_NUM_THREADS=1 "$MT" train "${ARGS[@]}" "${extra[@]}" \
          --train.threads 1 --parallel.strategy "$strat"
      fi
    done
  done
done

DRY=(--train.dtype bf16 --train.activation_checkpointing full --train.micro_batch 1 --train.steps 1 --data.val '')
bench_run dry_8b_full "$MT" train --model.preset llama3-8b "${DRY[@]}" --dry-run --world 1 --rank 0
bench_run dry_8b_lora "$MT" train --model.preset llama3-8b "${DRY[@]}" "${LORA[@]}" --dry-run --world 1 --rank 0
bench_run dry_70b_full "$MT" train --model.preset llama3-70b "${DRY[@]}" --parallel.strategy FULL_SHARD --dry-run --world 8 --rank 0
bench_run dry_70b_lora "$MT" train --model.preset llama3-70b "${DRY[@]}" "${LORA[@]}" --parallel.strategy FULL_SHARD --dry-run --world 8 --rank 0

python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
def fin(tag):
    with open(os.path.join(out, tag + ".jsonl")) as f:
        return [json.loads(l) for l in f if '"final"' in l][-1]
gib = 2.0 ** 30
print(f"{'run':24} {'tokens/s':>9} {'params MiB':>11} {'grads MiB':>10} {'optim MiB':>10} {'bytes/step (rank 0)':>20}")
for tag in sorted(t[:-6] for t in os.listdir(out) if t.endswith(".jsonl")):
    j = fin(tag)
    m = j.get("mem_resident_by_category", {})
    if "mem_resident_by_category_per_rank" in j:
        m = j["mem_resident_by_category_per_rank"][0]
    steps = max(1, j.get("steps", 1))
    moved = sum(j.get("comm_bytes_by_group", {}).values()) / steps
    scale = gib if tag.startswith("dry") else 2.0 ** 20
    unit = "GiB" if tag.startswith("dry") else "MiB"
    print(f"{tag:24} {j.get('tokens_per_s', 0):9.0f} {m.get('params', 0) / scale:10.2f}{unit[0]} "
          f"{m.get('grads', 0) / scale:9.2f}{unit[0]} {m.get('optimizer', 0) / scale:9.2f}{unit[0]} {moved:20.0f}")
PY
