// A 16 x 16 transpose of 32-bit elements in AVX-512 registers, shared by the AMX GEMM's packing
// (amx_gemm.cpp) and the attention kernels' packing (attention.cpp, avx512 variant). It carries
// its own target attribute and lives in a namespace named for AVX-512, so it is only ever called
// from code that runs after the run-time check (isa.h; tests/kernels/isa_test.cpp looks for
// AVX-512 instructions outside such names).
#pragma once
#include <immintrin.h>

namespace mt::kernels::cpu::avx512_util {

#pragma GCC push_options
#pragma GCC target("avx512f")
// GCC 12's AVX-512 intrinsic headers start some results from `__m512i __Y = __Y;`, which
// -Wmaybe-uninitialized reports once inlined (a false positive).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

// r[i][j] -> r[j][i] for 16 registers of 16 32-bit elements.
__attribute__((always_inline)) inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // Now lane L (128 bits) of r[4q + j] holds rows 4q .. 4q+3 at column 4L + j; two rounds of
  // lane shuffles put the four lanes of a column in order.
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
  }
}

#pragma GCC diagnostic pop
#pragma GCC pop_options

}  // namespace mt::kernels::cpu::avx512_util
