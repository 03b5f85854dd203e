// Tensor-core fragments of one warp: mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32
// (sm_80 and later), D = A B + C with A 16x16 and B 16x8 in bf16, C and D 16x8 in fp32.
//
// Each lane holds a fixed part of each matrix (PTX ISA, "Matrix fragments for mma.m16n8k16"). With
// g = lane / 4 (the group) and t = lane % 4 (the thread in the group), and the element of lower
// column (A, C) or lower row (B) in the low 16 bits of a register:
//   A (row-major 16x16): a[0] = A[g][2t, 2t+1]      a[1] = A[g+8][2t, 2t+1]
//                        a[2] = A[g][2t+8, 2t+9]    a[3] = A[g+8][2t+8, 2t+9]
//   B (16x8, k by n):    b[0] = B[2t, 2t+1][g]      b[1] = B[2t+8, 2t+9][g]
//   C, D (16x8):         c[0], c[1] = C[g][2t, 2t+1]   c[2], c[3] = C[g+8][2t, 2t+1]
// So an accumulator pair of n-tiles (c of tiles 2j and 2j+1) packed to bf16 is exactly the A
// fragment of k-step j: the probabilities P = exp(S) computed in registers feed P V directly.
//
// Under nvcc (sm_80 / sm_90) mma() is the PTX instruction. In the CPU emulator (MT_CUDA_EMU) it is
// a warp collective made of shuffles: every lane gathers, from the lanes that hold them by the
// layout above, the row of A and the column of B it needs, and computes its own four elements of
// D. A kernel that puts a value in the wrong register, or reads a result from the wrong one, gets
// wrong numbers here as it would on a GPU.
#pragma once
#include <cstdint>

#include "kernels/cuda/common.cuh"

namespace mt::kernels::cuda::mma {

struct FragA {
  uint32_t x[4];
};
struct FragB {
  uint32_t x[2];
};
struct FragC {
  float x[4];
};

// Two floats rounded to bf16 (nearest even, as the CPU rounds), lo in the low 16 bits.
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  return static_cast<uint32_t>(f32_to_bf16_bits(lo)) | (static_cast<uint32_t>(f32_to_bf16_bits(hi)) << 16);
}
// Two bf16 values (as stored) into one register, lo in the low 16 bits.
__device__ __forceinline__ uint32_t pack_bits(uint16_t lo, uint16_t hi) {
  return static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
}
__device__ __forceinline__ float lo_f32(uint32_t r) { return __uint_as_float(r << 16); }
__device__ __forceinline__ float hi_f32(uint32_t r) { return __uint_as_float(r & 0xffff0000u); }

__device__ __forceinline__ void zero(FragC& c) {
  c.x[0] = c.x[1] = c.x[2] = c.x[3] = 0.0f;
}

// d += a b, for the whole warp (every lane of the warp must call it, converged).
__device__ __forceinline__ void mma(FragC& d, const FragA& a, const FragB& b) {
#if defined(MT_CUDA_EMU)
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  // Row g and g+8 of A (16 k each) and columns 2t and 2t+1 of B, gathered from their owners:
  // A[g][2j, 2j+1] and A[g][2j+8, 2j+9] are in lane 4g + j; B[2j, 2j+1][n] and B[2j+8, 2j+9][n]
  // in lane 4n + j.
  float a0[16], a1[16], b0[16], b1[16];
  const uint64_t my_a01 = static_cast<uint64_t>(a.x[0]) | (static_cast<uint64_t>(a.x[1]) << 32);
  const uint64_t my_a23 = static_cast<uint64_t>(a.x[2]) | (static_cast<uint64_t>(a.x[3]) << 32);
  const uint64_t my_b = static_cast<uint64_t>(b.x[0]) | (static_cast<uint64_t>(b.x[1]) << 32);
  for (int j = 0; j < 4; ++j) {
    const uint64_t r01 = __shfl_sync(0xffffffffu, my_a01, 4 * g + j);
    const uint64_t r23 = __shfl_sync(0xffffffffu, my_a23, 4 * g + j);
    const uint64_t c0 = __shfl_sync(0xffffffffu, my_b, 4 * (2 * t) + j);
    const uint64_t c1 = __shfl_sync(0xffffffffu, my_b, 4 * (2 * t + 1) + j);
    const auto lo = [](uint64_t v) { return static_cast<uint32_t>(v); };
    const auto hi = [](uint64_t v) { return static_cast<uint32_t>(v >> 32); };
    a0[2 * j] = lo_f32(lo(r01)), a0[2 * j + 1] = hi_f32(lo(r01));          // A[g][2j, 2j+1]
    a1[2 * j] = lo_f32(hi(r01)), a1[2 * j + 1] = hi_f32(hi(r01));          // A[g+8][2j, 2j+1]
    a0[2 * j + 8] = lo_f32(lo(r23)), a0[2 * j + 9] = hi_f32(lo(r23));      // A[g][2j+8, 2j+9]
    a1[2 * j + 8] = lo_f32(hi(r23)), a1[2 * j + 9] = hi_f32(hi(r23));      // A[g+8][2j+8, 2j+9]
    b0[2 * j] = lo_f32(lo(c0)), b0[2 * j + 1] = hi_f32(lo(c0));            // B[2j, 2j+1][2t]
    b0[2 * j + 8] = lo_f32(hi(c0)), b0[2 * j + 9] = hi_f32(hi(c0));        // B[2j+8, 2j+9][2t]
    b1[2 * j] = lo_f32(lo(c1)), b1[2 * j + 1] = hi_f32(lo(c1));            // B[.][2t+1]
    b1[2 * j + 8] = lo_f32(hi(c1)), b1[2 * j + 9] = hi_f32(hi(c1));
  }
  // Products of bf16 values are exact in fp32; the sum over k is added to the accumulator once.
  float s00 = 0.0f, s01 = 0.0f, s10 = 0.0f, s11 = 0.0f;
  for (int k = 0; k < 16; ++k) {
    s00 += a0[k] * b0[k];
    s01 += a0[k] * b1[k];
    s10 += a1[k] * b0[k];
    s11 += a1[k] * b1[k];
  }
  d.x[0] += s00;
  d.x[1] += s01;
  d.x[2] += s10;
  d.x[3] += s11;
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d.x[0]), "+f"(d.x[1]), "+f"(d.x[2]), "+f"(d.x[3])
      : "r"(a.x[0]), "r"(a.x[1]), "r"(a.x[2]), "r"(a.x[3]), "r"(b.x[0]), "r"(b.x[1]));
#elif defined(__CUDA_ARCH__)
  __trap();  // built for sm_80 and sm_90 only (CMAKE_CUDA_ARCHITECTURES)
#endif
}

// The A fragment of k-step j from the accumulators of n-tiles 2j and 2j+1, rounded to bf16.
__device__ __forceinline__ FragA a_from_c(const FragC& c0, const FragC& c1) {
  FragA a;
  a.x[0] = pack_bf16(c0.x[0], c0.x[1]);
  a.x[1] = pack_bf16(c0.x[2], c0.x[3]);
  a.x[2] = pack_bf16(c1.x[0], c1.x[1]);
  a.x[3] = pack_bf16(c1.x[2], c1.x[3]);
  return a;
}

}  // namespace mt::kernels::cuda::mma
