#!/usr/bin/env bash
# Installs what is missing, builds everything (warnings as errors, the benchmark programs included)
# and runs the whole test suite, single-process and multi-rank (mpirun) tests alike. Then the CUDA
# backend on the CPU emulator (docs/gpu.md, "The emulator"): an EMU build tree and an EMU +
# AddressSanitizer one, each with only the targets its tests need, and their tests (ctest -L emu).
# Last, a short run of every fuzz target (scripts/fuzz.sh, a clang tree; MT_FUZZ_SECONDS each,
# default 4). Arguments go to the main ctest; MT_TEST_EMU=0 skips the emulator part,
# MT_TEST_FUZZ=0 the fuzzing.
set -euo pipefail
cd "$(dirname "$0")/.."
# With ccache, the emulator trees reuse the main build's objects (same flags) instead of compiling
# the CPU side again.
if command -v ccache >/dev/null; then export CMAKE_CXX_COMPILER_LAUNCHER=ccache CMAKE_CUDA_COMPILER_LAUNCHER=ccache; fi
scripts/install_deps.sh --test
scripts/build.sh
# The benchmark programs too (bench/: built only with MESHTRAIN_BENCH=ON), so that they keep
# compiling against the kernels they time.
cmake -S . -B build -DMESHTRAIN_BENCH=ON >/dev/null
ninja -C build kernel_bench gemm_libs
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
ctest --test-dir build --output-on-failure --timeout 900 "$@"

emu_tree() {  # DIR [cmake options]: configures DIR as an emulator build
  local dir=$1
  shift
  cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMESHTRAIN_WERROR=ON -DMESHTRAIN_CUDA=EMU "$@" >/dev/null
}
if [ "${MT_TEST_EMU:-1}" != 0 ]; then
  emu_tree build-emu
  ninja -C build-emu meshtrain test_kernels test_runtime test_cuda_emu test_train
  emu_tree build-emu-asan -DMESHTRAIN_EMU_ASAN=ON
  ninja -C build-emu-asan test_kernels test_cuda_emu
  ctest --test-dir build-emu -L emu --output-on-failure --timeout 900
  ctest --test-dir build-emu-asan -L emu --output-on-failure --timeout 900
fi
# Every file reader's fuzz target for a few seconds from its seed corpus (docs/fuzzing.md).
if [ "${MT_TEST_FUZZ:-1}" != 0 ]; then
  scripts/fuzz.sh "${MT_FUZZ_SECONDS:-4}"
fi
