// Pointwise activations and elementwise helpers. Backward functions accumulate (+=) into their
// gradient outputs.
#pragma once
#include "kernels/cpu/isa.h"
#include <cstdint>

#include "runtime/dtype.h"

MT_CPU_NS_BEGIN

// GELU, tanh approximation (as GPT-2): out = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
void gelu_forward(float* out, const float* inp, int64_t n);
void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t n);

// SwiGLU (Llama MLP): out = silu(gate) * up, silu(x) = x / (1 + exp(-x)).
void swiglu_forward(float* out, const float* gate, const float* up, int64_t n);
void swiglu_backward(float* dgate, float* dup, const float* dout, const float* gate, const float* up,
                     int64_t n);

// The same on bf16 gate and up, fp32 arithmetic: out = bf16(silu(g) u); the backward WRITES (does
// not add) dgate = bf16(dout u silu'(g)) and dup = bf16(dout silu(g)), rounded to nearest even.
void swiglu_forward_bf16(bf16* out, const bf16* gate, const bf16* up, int64_t n);
void swiglu_backward_bf16(bf16* dgate, bf16* dup, const float* dout, const bf16* gate, const bf16* up, int64_t n);

// out = a + b (out may alias a or b).
void add(float* out, const float* a, const float* b, int64_t n);
// y += x
void accumulate(float* y, const float* x, int64_t n);
// x *= s
void scale(float* x, float s, int64_t n);
// Sum of squares in double precision (for global gradient norms).
double sum_squares(const float* x, int64_t n);
// *out = sum_squares(x, n) / sum(x, n) (kernels/ops.def sum_squares_to, sum_to).
void sum_squares_to(double* out, const float* x, int64_t n);
void sum_to(double* out, const float* x, int64_t n);

// Round-to-nearest-even casts.
void cast_f32_to_bf16(bf16* out, const float* in, int64_t n);
void cast_bf16_to_f32(float* out, const bf16* in, int64_t n);

// Sum in double precision, in index order (per-token loss sums: the same on any thread count).
double sum(const float* x, int64_t n);
// x[n, :] += b for x [N, C].
void add_bias(float* x, const float* b, int64_t N, int64_t C);
// Columns [c0, c0 + cols) of the [N, ld] matrix `in` into the dense [N, cols] matrix `out`.
void copy_columns(float* out, const float* in, int64_t N, int64_t ld, int64_t c0, int64_t cols);

MT_CPU_NS_END  // namespace mt::kernels::cpu
