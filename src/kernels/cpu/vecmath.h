// Private helpers of the CPU kernels: branch-free float math that GCC vectorises inside
// `#pragma omp simd` loops (libm's expf/tanhf are scalar calls without -ffast-math).
#pragma once
#include <cstdint>
#include <cstring>

#include "runtime/dtype.h"

namespace mt::kernels::cpu::detail {

// exp(x) in float, max error about 2 ulp for x in [-87, 88]. Below -87 it returns 0 (exp(-inf)
// = 0, as softmax needs), above 88 it saturates at exp(88) ~ 1.65e38 (finite). NaN gives NaN.
// Range reduction x = n ln2 + f with |f| <= ln2/2 (Cody-Waite, two-part ln2), degree-7 Taylor
// polynomial for e^f, and 2^n built directly in the exponent bits.
//
// The clamping and the special cases are done on the integer bit pattern, and the result is
// masked rather than selected, on purpose: with float selects (`x < lo ? 0 : res`) GCC threads
// the branches and sinks the polynomial into one of them, where a float operation "could trap"
// (the default -ftrapping-math), and the calling loop stays scalar. Written this way every loop
// using it vectorises (checked with -fopt-info-vec; softmax and GELU depend on it).
inline float exp_f(float x) {
  constexpr uint32_t kLoBits = 0xc2ae0000u;  // -87.0f
  constexpr int32_t kHiBits = 0x42b00000;    // 88.0f
  uint32_t ux;
  std::memcpy(&ux, &x, 4);
  // Clamp to [-87, 88]: negative floats order as unsigned integers above the positive ones, and
  // among themselves by magnitude; positive floats order as signed integers.
  const uint32_t u1 = ux < kLoBits ? ux : kLoBits;  // x < -87 (or negative NaN) -> -87
  const int32_t s1 = static_cast<int32_t>(u1) < kHiBits ? static_cast<int32_t>(u1) : kHiBits;
  float xc;
  std::memcpy(&xc, &s1, 4);
  const float magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  float t = xc * 1.44269504088896341f;
  float r = (t + magic) - magic;
  // Fused multiply-adds, written out: every supported CPU has FMA (the x86-64-v3 baseline), the
  // result is then the same on every ISA variant and thread count, and the polynomial costs 7
  // instructions instead of 14 (the softmax of the loss is bound by this function).
  float f = __builtin_fmaf(-r, 0.693145751953125f, xc);
  f = __builtin_fmaf(-r, 1.428606820309417232e-06f, f);
  float p = 1.98412698412698413e-04f;  // 1/7!
  p = __builtin_fmaf(p, f, 1.38888888888888889e-03f);
  p = __builtin_fmaf(p, f, 8.33333333333333333e-03f);
  p = __builtin_fmaf(p, f, 4.16666666666666667e-02f);
  p = __builtin_fmaf(p, f, 1.66666666666666667e-01f);
  p = __builtin_fmaf(p, f, 0.5f);
  p = __builtin_fmaf(p, f, 1.0f);
  p = __builtin_fmaf(p, f, 1.0f);
  // 2^r: r + (1.5*2^23 + 127) holds r + 127 in its low mantissa bits; shifting them into the
  // exponent field discards everything else.
  float m = r + 12583039.0f;
  uint32_t mb;
  std::memcpy(&mb, &m, 4);
  uint32_t sb = mb << 23;
  float sc;
  std::memcpy(&sc, &sb, 4);
  float res = p * sc;
  uint32_t rb;
  std::memcpy(&rb, &res, 4);
  rb &= 0u - static_cast<uint32_t>(ux <= kLoBits);  // x < -87 (or negative NaN): 0
  // NaN in: add a NaN (0 otherwise), so NaN propagates.
  const uint32_t nb = (ux & 0x7fffffffu) > 0x7f800000u ? (ux | 0x00400000u) : 0u;
  float nanadd;
  std::memcpy(&nanadd, &nb, 4);
  std::memcpy(&res, &rb, 4);
  return res + nanadd;
}

// Logistic sigmoid 1 / (1 + e^-x).
inline float sigmoid_f(float x) { return 1.0f / (1.0f + exp_f(-x)); }

}  // namespace mt::kernels::cpu::detail

namespace mt::kernels::cpu::detail {

// float -> bf16 with round-to-nearest-even, NaN kept quiet; bit-identical to mt::float_to_bf16
// but written without a branch so that loops over it vectorise.
inline bf16 to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  uint32_t nan = (u >> 16) | 0x40u;
  uint32_t r = (u & 0x7fffffffu) > 0x7f800000u ? nan : rounded;
  return bf16{static_cast<uint16_t>(r)};
}

}  // namespace mt::kernels::cpu::detail

namespace mt::kernels::cpu::detail {
inline float from_bf16(bf16 v) {
  uint32_t u = static_cast<uint32_t>(v.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
}  // namespace mt::kernels::cpu::detail
