#!/usr/bin/env bash
# Builds the GPU kit: a self-contained folder (default gpu_kit/, git-ignored) holding the CUDA
# build of meshtrain and the GPU tests, compiled for the portable CPU baseline (x86-64-v3: the GPU
# machine's CPU is not this one), the shared libraries they need that a bare GPU machine lacks
# (resolved with ldd; glibc, the CUDA driver and the CUDA toolkit libraries come from that
# machine), and gpu_check.sh. Run there as `gpu_kit/gpu_check.sh` (results under $OUT when set).
#
#   scripts/gpu_kit.sh [KIT_DIR]      (default: gpu_kit; the kit must stay under 60 MiB)
#
# docs/gpu.md says what the check covers.
set -euo pipefail
cd "$(dirname "$0")/.."
KIT=${1:-gpu_kit}
BUILD=build-gpu-kit
command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ] || { echo "gpu_kit.sh: no nvcc (CUDA toolkit) found" >&2; exit 1; }
export PATH="$PATH:/usr/local/cuda/bin"
launcher=()
if command -v ccache >/dev/null; then launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache); fi
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMESHTRAIN_WERROR=ON -DMESHTRAIN_CUDA=ON \
  -DMESHTRAIN_ARCH=x86-64-v3 "${launcher[@]}" >/dev/null
ninja -C "$BUILD" meshtrain test_kernels test_runtime
rm -rf "$KIT"
mkdir -p "$KIT/bin" "$KIT/lib"
cp "$BUILD/meshtrain" "$BUILD/tests/test_kernels" "$BUILD/tests/test_runtime" "$KIT/bin/"
cp scripts/gpu_check.sh "$KIT/"
# Libraries to carry: everything ldd resolves except the C runtime, the CUDA driver and the CUDA
# toolkit's own libraries (the GPU machine has CUDA 13; the kit would not fit with cuBLAS in it).
skip='^(linux-vdso|ld-linux|libc\.so|libm\.so|libdl\.so|librt\.so|libpthread\.so|libgcc_s\.so|libcuda\.so|libcublas|libcublasLt|libcudart|libcudnn|libnccl|libnvidia)'
for b in "$KIT"/bin/*; do
  ldd "$b" | awk '/=> \//{print $1, $3}'
done | sort -u | while read -r name path; do
  if [[ ! "$name" =~ $skip ]]; then cp -L "$path" "$KIT/lib/$name"; fi
done
size=$(du -sm "$KIT" | cut -f1)
echo "gpu_kit.sh: $KIT is ${size} MiB: $(ls "$KIT/bin" | tr '\n' ' ')+ $(ls "$KIT/lib" | wc -l) libraries"
if [ "$size" -gt 60 ]; then echo "gpu_kit.sh: the kit is over 60 MiB (at most 64 MiB can be carried)" >&2; exit 1; fi
