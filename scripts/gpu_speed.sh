#!/usr/bin/env bash
# The GPU speed check, run on a GPU machine from the kit (scripts/gpu_kit.sh copies it there), in
# one go within a 10-minute limit (GPU_SPEED_BUDGET_S, default 540 s; steps past it are skipped):
#   1. the GPU (nvidia-smi) and the host;
#   2. per-kernel times: `meshtrain check-ops --device cuda --shapes model --time 20`: every kernel
#      at GPT-2 124M shapes timed with CUDA events, with its roofline line (achieved bytes/s and
#      FLOP/s against the H200's 4.8 TB/s and 989 TFLOP/s dense bf16), table in kernel_times.txt;
#   3. GPT-2 124M, bf16, T 1024, micro-batches 16 and 32: meshtrain's tokens/s and MFU (mean of the
#      steps after the second);
#   4. the same model in PyTorch eager and torch.compile at the same batches (gpu_torch_bench.py),
#      where python3 imports torch with CUDA;
#   5. CPU offload of the optimizer state: Llama models in bf16 (full recompute, micro-batch 1), each
#      without and with `train.offload = optimizer`: step time, tokens/s and MFU of each, and the
#      offloaded/device step-time ratio where both fit (goal: within 1.6x). The default pair is a
#      Llama 3 8B cut to 20 layers (5.4B parameters: its Adam state does not fit an 80 GB GPU, so the
#      preflight refuses it there without offload and the row says so; it fits an H200) and Llama
#      3.2 1B (fits either way).
# Results under $OUT (else ./gpu_speed_out): gpu_speed.md (one row per measurement), gpu_speed.log,
# kernel_times.txt. Exit status 0 when every step ran, 1 otherwise.
#
# The shapes are variables so that a test runs the same logic at a tiny shape in the emulator
# build (tests/CMakeLists.txt, CudaEmu.GpuSpeedScript): MESHTRAIN_BIN (default the kit's
# bin/meshtrain), GPU_SPEED_MODEL (gpt2-124m), GPU_SPEED_T (1024), GPU_SPEED_BATCHES ("16 32"),
# GPU_SPEED_STEPS (10), GPU_SPEED_OPS (check-ops filter, default "--shapes model"), GPU_SPEED_REPS
# (20), GPU_SPEED_OFFLOAD_MODELS ("llama3-8b:20 llama3.2-1b": PRESET[:LAYERS] each),
# GPU_SPEED_OFFLOAD_T (2048), GPU_SPEED_OFFLOAD_STEPS (5), GPU_SPEED_NO_GPU_OK=1 (run without
# nvidia-smi: the emulator).
set -uo pipefail
KIT=$(cd "$(dirname "$0")" && pwd)
BIN=${MESHTRAIN_BIN:-$KIT/bin/meshtrain}
export LD_LIBRARY_PATH="$KIT/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
MODEL=${GPU_SPEED_MODEL:-gpt2-124m}
T=${GPU_SPEED_T:-1024}
BATCHES=${GPU_SPEED_BATCHES:-16 32}
STEPS=${GPU_SPEED_STEPS:-10}
OPS=${GPU_SPEED_OPS:---shapes model}
REPS=${GPU_SPEED_REPS:-20}
OFFLOAD_MODELS=${GPU_SPEED_OFFLOAD_MODELS:-llama3-8b:20 llama3.2-1b}
OFFLOAD_T=${GPU_SPEED_OFFLOAD_T:-2048}
OFFLOAD_STEPS=${GPU_SPEED_OFFLOAD_STEPS:-5}
BUDGET=${GPU_SPEED_BUDGET_S:-540}
OUTDIR=${OUT:-$PWD/gpu_speed_out}
mkdir -p "$OUTDIR"
LOG="$OUTDIR/gpu_speed.log"
MD="$OUTDIR/gpu_speed.md"
: >"$LOG"
printf '| step | result | detail |\n|---|---|---|\n' >"$MD"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
status=0
row() {
  printf '| %s | %s | %s |\n' "$1" "$2" "${3//|/\\|}" >>"$MD"
  echo "gpu_speed: $1: $2: $3" | tee -a "$LOG"
  [ "$2" = ok ] || status=1
}
left() { echo $((BUDGET - SECONDS)); }
run() {  # LIMIT_S LABEL CMD...: output into the log and $TMP/out; the command's status
  local lim=$1 label=$2
  shift 2
  echo "== $label: $*" >>"$LOG"
  timeout "$lim" "$@" >"$TMP/out" 2>&1
  local rc=$?
  cat "$TMP/out" >>"$LOG"
  return $rc
}

# 1. The GPU and its dense bf16 peak (vendor data sheets, SXM parts unless named).
gpu=""
if command -v nvidia-smi >/dev/null && q=$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>>"$LOG") &&
  [ -n "$q" ]; then
  gpu=$(head -1 <<<"$q" | cut -d, -f1)
  row gpu ok "$(head -1 <<<"$q")"
elif [ "${GPU_SPEED_NO_GPU_OK:-0}" = 1 ]; then
  row gpu ok "no nvidia-smi (GPU_SPEED_NO_GPU_OK: the emulator build)"
else
  row gpu FAIL "no GPU: nvidia-smi $(command -v nvidia-smi >/dev/null && echo 'found no device' || echo 'is not installed')"
  exit 1
fi
case "$gpu" in
  *H100*PCIe*) peak=756e12 ;; *H100* | *H200*) peak=989e12 ;; *A100*) peak=312e12 ;; *) peak=0 ;;
esac
row host ok "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'), $(nproc) CPUs"

# Token data for the training runs: this script's own bytes, repeated (speed, not learning).
for _ in $(seq 200); do cat "$0"; done >"$TMP/corpus.txt"
if ! run 60 prepare "$BIN" prepare --tokenizer byte --out "$TMP/data" --val-fraction 0.05 "$TMP/corpus.txt"; then
  row data FAIL "meshtrain prepare failed: $(tail -1 "$TMP/out")"
  exit 1
fi

# 2. Per-kernel times with the roofline.
# shellcheck disable=SC2086
if run 150 kernel-times "$BIN" check-ops --device cuda $OPS --time "$REPS"; then
  sed -n '/^per-kernel times/,/^timed /p' "$TMP/out" >"$OUTDIR/kernel_times.txt"
  row "kernel times" ok "$(grep '^timed ' "$TMP/out"); table in kernel_times.txt"
else
  rc=$?
  row "kernel times" FAIL "status $rc$([ $rc = 124 ] && echo ' (150 s limit)'): $(tail -1 "$TMP/out")"
fi

# 3. meshtrain's throughput; 4. PyTorch's at the same shapes.
torch_ok=0
python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null && torch_ok=1
for B in $BATCHES; do
  if [ "$(left)" -lt 30 ]; then
    row "meshtrain $MODEL B $B" skipped "time budget spent"
  elif run 150 "meshtrain B $B" "$BIN" train --data.train "$TMP/data/train.bin" --data.val "$TMP/data/val.bin" \
    --data.tokenizer byte --model.preset "$MODEL" --model.seq_len "$T" --train.micro_batch "$B" --train.dtype bf16 \
    --train.steps "$STEPS" --train.eval_every 0 --train.sample_tokens 0 --log.print_every 100 --train.device cuda \
    --log.peak_flops "$peak" --log.metrics_out "$TMP/tp$B.jsonl"; then
    row "meshtrain $MODEL B $B" ok "$(python3 -c 'import json,sys
r=[json.loads(l) for l in open(sys.argv[1])]; r=[x for x in r if "tokens_per_s" in x and "step" in x][2:]
t=sum(x["tokens_per_s"] for x in r)/len(r); m=[x["mfu"] for x in r if x.get("mfu")]
print("T %s: %.0f tokens/s, MFU %s (steps 3-%d)" % (sys.argv[2], t, "%.1f%%" % (100*sum(m)/len(m)) if m else "n/a", len(r)+2))' \
      "$TMP/tp$B.jsonl" "$T")"
  else
    row "meshtrain $MODEL B $B" FAIL "status $?: $(tail -1 "$TMP/out")"
  fi
  if [ $torch_ok = 0 ]; then
    row "pytorch B $B" skipped "python3 cannot import torch with CUDA"
  elif [ "$(left)" -lt 60 ]; then
    row "pytorch B $B" skipped "time budget spent"
  elif run "$(($(left) - 5))" "pytorch B $B" python3 "$KIT/gpu_torch_bench.py" --batch "$B" --seq "$T" --steps "$STEPS" \
    --peak "$peak"; then
    while read -r mode line; do row "pytorch $mode" ok "$line"; done < <(grep '^result ' "$TMP/out" | cut -d' ' -f2-)
  else
    row "pytorch B $B" FAIL "status $?: $(tail -1 "$TMP/out")"
  fi
done
# 5. CPU offload of the optimizer state against the device optimizer, per model.
# Prints "STEP_MS TOKENS_PER_S MFU" of the steps after the second (the first carries start-up).
summary() {
  python3 -c 'import json,sys
r=[json.loads(l) for l in open(sys.argv[1])]; r=[x for x in r if "step_ms" in x and "step" in x]; r=r[2:] or r
ms=sum(x["step_ms"] for x in r)/len(r); t=sum(x["tokens_per_s"] for x in r)/len(r); m=[x["mfu"] for x in r if x.get("mfu")]
print("%.1f %.0f %s" % (ms, t, "%.1f%%" % (100*sum(m)/len(m)) if m else "n/a"))' "$1"
}
for spec in $OFFLOAD_MODELS; do
  preset=${spec%%:*}
  layers=""
  [ "$spec" != "$preset" ] && layers="--model.n_layer ${spec#*:}"
  name="$preset${layers:+ n_layer ${spec#*:}}"
  declare -A ms=()
  for mode in none optimizer; do
    label="offload $mode: $name"
    if [ "$(left)" -lt 60 ]; then
      row "$label" skipped "time budget spent"
      continue
    fi
    # shellcheck disable=SC2086
    run "$(($(left) - 30))" "$label" "$BIN" train --data.train "$TMP/data/train.bin" --data.val '' --data.tokenizer byte \
      --model.preset "$preset" $layers --model.seq_len "$OFFLOAD_T" --train.micro_batch 1 --train.dtype bf16 \
      --train.activation_checkpointing full --train.offload "$mode" --train.steps "$OFFLOAD_STEPS" --train.eval_every 0 \
      --train.sample_tokens 0 --log.print_every 100 --train.device cuda --log.peak_flops "$peak" \
      --log.metrics_out "$TMP/off_$mode.jsonl"
    rc=$?
    if [ $rc = 0 ] && read -r step tps mfu < <(summary "$TMP/off_$mode.jsonl"); then
      ms[$mode]=$step
      row "$label" ok "T $OFFLOAD_T: $step ms/step, $tps tokens/s, MFU $mfu"
    elif [ $rc = 2 ] && [ $mode = none ] && grep -q "does not fit\|needs" "$TMP/out"; then
      row "$label" ok "refused before allocating (needs offload here): $(grep -m1 "does not fit\|needs" "$TMP/out")"
    else
      row "$label" FAIL "status $rc$([ $rc = 124 ] && echo ' (time limit)'): $(tail -1 "$TMP/out")"
    fi
  done
  if [ -n "${ms[none]:-}" ] && [ -n "${ms[optimizer]:-}" ]; then
    row "offload ratio: $name" ok "$(python3 -c 'import sys; r=float(sys.argv[2])/float(sys.argv[1]); print("offloaded/device step time %.2fx (goal <= 1.6x: %s)" % (r, "met" if r <= 1.6 else "not met"))' "${ms[none]}" "${ms[optimizer]}")"
  fi
  unset ms
done
echo "gpu_speed: $([ $status = 0 ] && echo 'every step ran' || echo 'NOT COMPLETE'); report in $MD"
exit $status
