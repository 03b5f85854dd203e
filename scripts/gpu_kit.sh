#!/usr/bin/env bash
# Builds the GPU kit: a self-contained folder (default gpu_kit/, git-ignored, at most 60 MiB) to
# carry to a GPU machine that has no package registry and no build of meshtrain:
#   bin/   meshtrain and the CUDA test binaries (test_kernels, test_runtime), built with
#          -DMESHTRAIN_CUDA=ON for the portable CPU baseline (-DMESHTRAIN_ARCH=x86-64-v3: the GPU
#          machine's CPU is not this one) and CUDA sm_80 + sm_90 machine code plus compute_90 PTX;
#   lib/   the shared libraries they need that a bare machine may lack (found with ldd), except the
#          C runtime and the CUDA libraries: the driver (libcuda) and cuBLASLt (libcublasLt, about
#          500 MiB) are that machine's, and gpu_check.sh finds them there;
#   data/  a byte-level token file (this repository's docs/*.md) for the training runs;
#   ref/   CPU reference losses: the parity configs of gpu_check.sh trained for 8 steps on this
#          machine's CPU with the kit's own meshtrain (ref/losses.txt: name, then loss per step);
#   gpu_check.sh, gpu_torch_bench.py and MANIFEST (what is in the kit and how it was built).
# On the GPU machine: `gpu_kit/gpu_check.sh` (results under $OUT, else ./gpu_check_out).
#
#   scripts/gpu_kit.sh [KIT_DIR]
#
# docs/gpu.md says what the check covers.
set -euo pipefail
cd "$(dirname "$0")/.."
KIT=${1:-gpu_kit}
BUILD=${MT_KIT_BUILD:-build-gpu-kit}
command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ] || {
  echo "gpu_kit.sh: no nvcc (CUDA toolkit) found: install the CUDA toolkit or put its bin/ on PATH" >&2
  exit 2
}
export PATH="$PATH:/usr/local/cuda/bin"
launcher=()
if command -v ccache >/dev/null; then launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache); fi
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMESHTRAIN_WERROR=ON -DMESHTRAIN_CUDA=ON \
  -DMESHTRAIN_ARCH=x86-64-v3 "-DCMAKE_CUDA_ARCHITECTURES=80-real;90" "${launcher[@]}" >/dev/null
ninja -C "$BUILD" meshtrain test_kernels test_runtime
rm -rf "$KIT"
mkdir -p "$KIT/bin" "$KIT/lib" "$KIT/data" "$KIT/ref"
cp "$BUILD/meshtrain" "$BUILD/tests/test_kernels" "$BUILD/tests/test_runtime" "$KIT/bin/"
strip --strip-unneeded "$KIT"/bin/*
cp scripts/gpu_check.sh scripts/gpu_speed.sh scripts/gpu_torch_bench.py "$KIT/"

# Libraries: everything ldd resolves but the C runtime, the driver and the CUDA libraries.
skip='^(linux-vdso|ld-linux|libc\.so|libm\.so|libdl\.so|librt\.so|libpthread\.so|libcuda\.so|libcublas|libcudart|libcudnn|libnccl|libnvidia)'
for b in "$KIT"/bin/*; do
  ldd "$b" | awk '/=> \//{print $1, $3}'
done | sort -u | while read -r name path; do
  if [[ ! "$name" =~ $skip ]]; then cp -L "$path" "$KIT/lib/$name"; fi
done

# Data and the CPU reference losses (the configs gpu_check.sh trains on the GPU, same arguments).
text=$(mktemp)
trap 'rm -f "$text"' EXIT
cat docs/*.md README.md >"$text"
LD_LIBRARY_PATH="$KIT/lib" "$KIT/bin/meshtrain" prepare --tokenizer byte --out "$KIT/data" --val-fraction 0.05 \
  "$text" >/dev/null
"$KIT/gpu_check.sh" --reference "$KIT/ref/losses.txt"

{
  echo "meshtrain GPU kit, built $(git describe --always --dirty) by scripts/gpu_kit.sh"
  echo "host: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'), -march=x86-64-v3"
  echo "nvcc: $(nvcc --version | tail -1); CUDA architectures 80-real;90 (sm_80, sm_90, compute_90 PTX)"
  echo "binaries: $(cd "$KIT/bin" && ls | tr '\n' ' ')"
  echo "libraries: $(cd "$KIT/lib" && ls | tr '\n' ' ')"
  echo "needed from the GPU machine: libcuda.so.1 (driver), $(readelf -d "$KIT/bin/meshtrain" | sed -n 's/.*Shared library: \[\(libcublas[^]]*\)\]/\1/p' | tr '\n' ' ')"
} >"$KIT/MANIFEST"
size=$(du -sm "$KIT" | cut -f1)
echo "gpu_kit.sh: $KIT is ${size} MiB: $(ls "$KIT/bin" | tr '\n' ' ')+ $(ls "$KIT/lib" | wc -l) libraries, $(wc -l <"$KIT/ref/losses.txt") reference runs"
if [ "$size" -gt 60 ]; then
  echo "gpu_kit.sh: the kit is ${size} MiB, over its 60 MiB limit (at most 64 MiB can be carried): drop a binary or build for fewer CUDA architectures" >&2
  exit 1
fi
