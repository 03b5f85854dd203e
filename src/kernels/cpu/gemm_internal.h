// Private GEMM helpers shared by the CPU kernels and their tests (not part of the kernel
// interface; callers outside src/kernels and tests/kernels should use gemm.h).
#pragma once
#include <cstdint>

#include "runtime/dtype.h"

namespace mt::kernels::cpu::detail {

// Row-major sgemm with explicit leading dimensions (C = alpha op(A) op(B) + beta C). Called from
// inside OpenMP parallel regions it runs on the calling thread only.
void sgemm_strided(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
                   int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc);

// Whether gemm_bf16 at this shape runs the oneDNN bf16 matmul primitive (true) or widens the
// inputs to fp32 and calls sgemm (false: CPU without bf16 support in oneDNN).
bool bf16_gemm_is_native(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, float beta);

// Testing hooks: force the widening path, and shrink its block size so small tests cover the
// blocked loops. Not thread-safe; call them only while no GEMM runs.
void set_bf16_force_fallback(bool force);
void set_bf16_fallback_block_elems(int64_t elems);
// Testing hook: where the native bf16 GEMM splits large problems (K or N >= min_dim splits into
// chunks of k_chunk / n_chunk; defaults 16384, 4096, 4096).
void set_bf16_split(int64_t min_dim, int64_t k_chunk, int64_t n_chunk);

// bf16 GEMMs on AMX tiles (amx_gemm.cpp). Ready when the level in force is amx_bf16, the CPU and
// the kernel grant the tile state, and the path is enabled (default on; MESHTRAIN_AMX_GEMM=0 or
// the hook below turn it off, leaving oneDNN's matmul).
bool amx_gemm_ready();
bool amx_gemm_enabled();
// MESHTRAIN_AMX_GEMM as set in the environment: unset or 1 -> true, 0 -> false; any other value
// throws std::runtime_error naming the variable.
bool amx_gemm_env();
void set_amx_gemm_enabled(bool enabled);
// C = alpha op(A) op(B) + beta C, plus bias[n] on every row when bias != nullptr; bf16 inputs,
// fp32 sums and output. Call only when amx_gemm_ready(). Results are bit-identical on any
// number of threads.
void amx_gemm_bf16(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const bf16* A, int64_t lda,
                   const bf16* B, int64_t ldb, float beta, float* C, int64_t ldc, const float* bias);
// bench/kernel_bench --amx-probe: GFLOP/s of `steps` steps of four TDPBF16PS on four accumulator
// tiles with `loads` (0, 1, 2 or 4) tile loads each from L1, on the calling thread. Call only when
// amx_gemm_ready().
double amx_tile_probe_gflops(long steps, int loads);

}  // namespace mt::kernels::cpu::detail
