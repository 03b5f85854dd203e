#!/usr/bin/env bash
# scripts/gpu_speed.sh's logic at a tiny shape on the emulated device (CTest CudaEmu.GpuSpeedScript):
# the per-kernel table of `check-ops --time` with its roofline column, a training throughput row,
# and the offload rows (without and with train.offload = optimizer, and their ratio). PyTorch with
# CUDA is absent here, so the script reports itself incomplete (exit 1); the rows are what is checked. Usage: gpu_speed_test.sh MESHTRAIN_BINARY OUT_DIR
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
out=$2
rm -rf "$out"
MESHTRAIN_BIN=$1 GPU_SPEED_MODEL=gpt2-tiny GPU_SPEED_T=32 GPU_SPEED_BATCHES=2 GPU_SPEED_STEPS=4 GPU_SPEED_REPS=2 \
  GPU_SPEED_OPS="--shapes small --op layernorm_backward" GPU_SPEED_OFFLOAD_MODELS="llama-tiny:1" GPU_SPEED_OFFLOAD_T=32 \
  GPU_SPEED_OFFLOAD_STEPS=3 GPU_SPEED_NO_GPU_OK=1 OUT=$out "$root/scripts/gpu_speed.sh"
fail=0
check() {  # PATTERN FILE WHAT
  grep -Eq "$1" "$2" || { echo "gpu_speed_test: missing $3 (pattern '$1' in $2)"; fail=1; }
}
check '^\| kernel times \| ok \|' "$out/gpu_speed.md" "the kernel-times row"
check '^cuda +layernorm_backward +f32 .* [0-9.]+%$' "$out/kernel_times.txt" "a timed layernorm_backward with its roofline share"
check '^\| meshtrain gpt2-tiny B 2 \| ok \| T 32: [0-9]+ tokens/s' "$out/gpu_speed.md" "the throughput row"
check '^\| offload none: llama-tiny n_layer 1 \| ok \| T 32: [0-9.]+ ms/step' "$out/gpu_speed.md" "the device-optimizer row"
check '^\| offload optimizer: llama-tiny n_layer 1 \| ok \| T 32: [0-9.]+ ms/step' "$out/gpu_speed.md" "the offloaded row"
check '^\| offload ratio: llama-tiny n_layer 1 \| ok \| offloaded/device step time [0-9.]+x' "$out/gpu_speed.md" "the offload ratio row"
[ $fail = 0 ] && echo "gpu_speed_test: ok"
exit $fail
