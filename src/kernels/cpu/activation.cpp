// Elementwise activations and helpers. Each loop is `parallel for simd` over elements; nothing is
// reduced across threads except in sum_squares, which sums fixed-size blocks (the block size
// depends only on n) and adds the block sums in order, so results do not depend on thread count.
#include "kernels/cpu/activation.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/cpu/vecmath.h"
#include "kernels/cpu/workspace.h"

MT_CPU_VARIANT_BEGIN

using detail::kParallelMin;

namespace {
constexpr float kGeluK = 0.7978845608028654f;  // sqrt(2/pi)
constexpr float kGeluC = 0.044715f;
}  // namespace

// 0.5 x (1 + tanh(u)) == x * sigmoid(2u): no cancellation near tanh(u) = -1 and one exp.
void gelu_forward(float* out, const float* inp, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n > kParallelMin)
  for (int64_t i = 0; i < n; ++i) {
    const float x = inp[i];
    const float u = kGeluK * (x + kGeluC * x * x * x);
    out[i] = x * detail::sigmoid_f(2.0f * u);
  }
}

// d/dx [x s(2u)] = s + x * 2 s (1 - s) * du/dx, du/dx = k (1 + 3 c x^2).
void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n > kParallelMin)
  for (int64_t i = 0; i < n; ++i) {
    const float x = inp[i];
    const float u = kGeluK * (x + kGeluC * x * x * x);
    const float s = detail::sigmoid_f(2.0f * u);
    const float du = kGeluK * (1.0f + 3.0f * kGeluC * x * x);
    dinp[i] += dout[i] * (s + x * 2.0f * s * (1.0f - s) * du);
  }
}

void swiglu_forward(float* out, const float* gate, const float* up, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n > kParallelMin)
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    out[i] = g * detail::sigmoid_f(g) * up[i];
  }
}

void swiglu_backward(float* dgate, float* dup, const float* dout, const float* gate, const float* up,
                     int64_t n) {
#pragma omp parallel for simd schedule(static) if (n > kParallelMin)
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    const float s = detail::sigmoid_f(g);
    const float silu = g * s;
    const float d = dout[i];
    dgate[i] += d * up[i] * (s + g * s * (1.0f - s));
    dup[i] += d * silu;
  }
}

void swiglu_forward_bf16(bf16* out, const bf16* gate, const bf16* up, int64_t n) {
#pragma omp parallel for schedule(static) if (n > kParallelMin)
  for (int64_t i = 0; i < n; ++i) {
    const float g = bf16_to_float(gate[i]);
    out[i] = float_to_bf16(g * detail::sigmoid_f(g) * bf16_to_float(up[i]));
  }
}

void swiglu_backward_bf16(bf16* dgate, bf16* dup, const float* dout, const bf16* gate, const bf16* up, int64_t n) {
#pragma omp parallel for schedule(static) if (n > kParallelMin)
  for (int64_t i = 0; i < n; ++i) {
    const float g = bf16_to_float(gate[i]);
    const float s = detail::sigmoid_f(g);
    const float d = dout[i];
    dgate[i] = float_to_bf16(d * bf16_to_float(up[i]) * (s + g * s * (1.0f - s)));
    dup[i] = float_to_bf16(d * (g * s));
  }
}

void add(float* out, const float* a, const float* b, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n > kParallelMin)
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

void accumulate(float* y, const float* x, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n > kParallelMin)
  for (int64_t i = 0; i < n; ++i) y[i] += x[i];
}

void scale(float* x, float s, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n > kParallelMin)
  for (int64_t i = 0; i < n; ++i) x[i] *= s;
}

double sum_squares(const float* x, int64_t n) {
  if (n <= 0) return 0.0;
  constexpr int64_t kMaxBlocks = 1024;
  const int64_t bs = std::max<int64_t>(int64_t(1) << 15, (n + kMaxBlocks - 1) / kMaxBlocks);
  const int64_t nb = (n + bs - 1) / bs;
  double part[kMaxBlocks];
#pragma omp parallel for schedule(static) if (n > kParallelMin)
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t i0 = b * bs, i1 = std::min(n, i0 + bs);
    double s = 0.0;
#pragma omp simd reduction(+ : s)
    for (int64_t i = i0; i < i1; ++i) s += static_cast<double>(x[i]) * static_cast<double>(x[i]);
    part[b] = s;
  }
  double total = 0.0;
  for (int64_t b = 0; b < nb; ++b) total += part[b];
  return total;
}

void cast_f32_to_bf16(bf16* out, const float* in, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n > kParallelMin)
  for (int64_t i = 0; i < n; ++i) out[i] = detail::to_bf16(in[i]);
}

void cast_bf16_to_f32(float* out, const bf16* in, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n > kParallelMin)
  for (int64_t i = 0; i < n; ++i) out[i] = detail::from_bf16(in[i]);
}

double sum(const float* x, int64_t n) {
  double s = 0.0;
  for (int64_t i = 0; i < n; ++i) s += x[i];
  return s;
}
void sum_squares_to(double* out, const float* x, int64_t n) { *out = sum_squares(x, n); }
void sum_to(double* out, const float* x, int64_t n) { *out = sum(x, n); }

void add_bias(float* x, const float* b, int64_t N, int64_t C) {
#pragma omp parallel for
  for (int64_t n = 0; n < N; ++n)
    for (int64_t c = 0; c < C; ++c) x[n * C + c] += b[c];
}

void copy_columns(float* out, const float* in, int64_t N, int64_t ld, int64_t c0, int64_t cols) {
#pragma omp parallel for
  for (int64_t n = 0; n < N; ++n) std::memcpy(out + n * cols, in + n * ld + c0, static_cast<size_t>(cols) * sizeof(float));
}

MT_CPU_VARIANT_END  // namespace mt::kernels::cpu
