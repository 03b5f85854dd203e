// LayerNorm and RMSNorm. Rows are independent in forward; in backward the weight/bias gradients
// are summed over rows in fixed chunks of kRowChunk rows and the chunk partials are added in
// chunk order, so the result does not depend on the thread count.
#include "kernels/cpu/norm.h"

#include <algorithm>
#include <cmath>

#include "kernels/cpu/workspace.h"

MT_CPU_VARIANT_BEGIN

namespace {
constexpr int64_t kRowChunk = 32;

// dst[c] += sum over chunks k of part[k * stride + c], chunks in order; parallel over columns.
void reduce_partials(float* dst, const float* part, int64_t nchunks, int64_t stride, int64_t C) {
  constexpr int64_t kCb = 64;
  const int64_t nblk = (C + kCb - 1) / kCb;
#pragma omp parallel for schedule(static) if (nchunks * C > detail::kParallelMin)
  for (int64_t blk = 0; blk < nblk; ++blk) {
    const int64_t c0 = blk * kCb;
    const int64_t cl = std::min(kCb, C - c0);
    float acc[kCb] = {};
    for (int64_t k = 0; k < nchunks; ++k) {
      const float* p = part + k * stride + c0;
#pragma omp simd
      for (int64_t c = 0; c < cl; ++c) acc[c] += p[c];
    }
    for (int64_t c = 0; c < cl; ++c) dst[c0 + c] += acc[c];
  }
}
}  // namespace

void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* w,
                       const float* b, int64_t N, int64_t C, float eps) {
  const float invC = 1.0f / static_cast<float>(C);
#pragma omp parallel for schedule(static) if (N * C > detail::kParallelMin)
  for (int64_t n = 0; n < N; ++n) {
    const float* x = inp + n * C;
    float* y = out + n * C;
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t c = 0; c < C; ++c) s += x[c];
    const float m = s * invC;
    float v = 0.0f;
#pragma omp simd reduction(+ : v)
    for (int64_t c = 0; c < C; ++c) {
      const float d = x[c] - m;
      v += d * d;
    }
    const float r = 1.0f / std::sqrt(v * invC + eps);
    if (b) {
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) y[c] = (x[c] - m) * r * w[c] + b[c];
    } else {
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) y[c] = (x[c] - m) * r * w[c];
    }
    if (mean) mean[n] = m;
    if (rstd) rstd[n] = r;
  }
}

void layernorm_backward(float* dinp, float* dw, float* db, const float* dout, const float* inp,
                        const float* w, const float* mean, const float* rstd, int64_t N, int64_t C) {
  if (N <= 0 || C <= 0) return;
  const int64_t nchunks = (N + kRowChunk - 1) / kRowChunk;
  const int64_t stride = 2 * C;  // per chunk: dw partial [C], then db partial [C]
  thread_local detail::Scratch scratch;
  float* part = scratch.as<float>(static_cast<size_t>(nchunks * stride));
  const float invC = 1.0f / static_cast<float>(C);
#pragma omp parallel for schedule(static) if (N * C > detail::kParallelMin)
  for (int64_t k = 0; k < nchunks; ++k) {
    float* pw = part + k * stride;
    float* pb = pw + C;
    std::fill(pw, pw + stride, 0.0f);
    const int64_t n1 = std::min(N, (k + 1) * kRowChunk);
    for (int64_t n = k * kRowChunk; n < n1; ++n) {
      const float* x = inp + n * C;
      const float* dy = dout + n * C;
      const float m = mean[n], r = rstd[n];
      float sd = 0.0f, sdx = 0.0f;
#pragma omp simd reduction(+ : sd, sdx)
      for (int64_t c = 0; c < C; ++c) {
        const float xh = (x[c] - m) * r;
        const float dn = dy[c] * w[c];
        sd += dn;
        sdx += dn * xh;
      }
      sd *= invC;
      sdx *= invC;
      if (dinp) {
        float* dx = dinp + n * C;
#pragma omp simd
        for (int64_t c = 0; c < C; ++c) {
          const float xh = (x[c] - m) * r;
          dx[c] += r * (dy[c] * w[c] - sd - xh * sdx);
        }
      }
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) {
        pw[c] += dy[c] * ((x[c] - m) * r);
        pb[c] += dy[c];
      }
    }
  }
  if (dw) reduce_partials(dw, part, nchunks, stride, C);
  if (db) reduce_partials(db, part + C, nchunks, stride, C);
}

void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* w, int64_t N, int64_t C,
                     float eps) {
  const float invC = 1.0f / static_cast<float>(C);
#pragma omp parallel for schedule(static) if (N * C > detail::kParallelMin)
  for (int64_t n = 0; n < N; ++n) {
    const float* x = inp + n * C;
    float* y = out + n * C;
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t c = 0; c < C; ++c) ss += x[c] * x[c];
    const float r = 1.0f / std::sqrt(ss * invC + eps);
#pragma omp simd
    for (int64_t c = 0; c < C; ++c) y[c] = x[c] * r * w[c];
    if (rstd) rstd[n] = r;
  }
}

void rmsnorm_backward(float* dinp, float* dw, const float* dout, const float* inp, const float* w,
                      const float* rstd, int64_t N, int64_t C) {
  if (N <= 0 || C <= 0) return;
  const int64_t nchunks = (N + kRowChunk - 1) / kRowChunk;
  thread_local detail::Scratch scratch;
  float* part = scratch.as<float>(static_cast<size_t>(nchunks * C));
  const float invC = 1.0f / static_cast<float>(C);
#pragma omp parallel for schedule(static) if (N * C > detail::kParallelMin)
  for (int64_t k = 0; k < nchunks; ++k) {
    float* pw = part + k * C;
    std::fill(pw, pw + C, 0.0f);
    const int64_t n1 = std::min(N, (k + 1) * kRowChunk);
    for (int64_t n = k * kRowChunk; n < n1; ++n) {
      const float* x = inp + n * C;
      const float* dy = dout + n * C;
      const float r = rstd[n];
      float sdx = 0.0f;
#pragma omp simd reduction(+ : sdx)
      for (int64_t c = 0; c < C; ++c) sdx += dy[c] * w[c] * (x[c] * r);
      sdx *= invC;
      if (dinp) {
        float* dx = dinp + n * C;
#pragma omp simd
        for (int64_t c = 0; c < C; ++c) dx[c] += r * (dy[c] * w[c] - (x[c] * r) * sdx);
      }
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) pw[c] += dy[c] * (x[c] * r);
    }
  }
  if (dw) reduce_partials(dw, part, nchunks, C, C);
}

// The add first over the whole block of rows, then the norm: the bits of accumulate + the norm.
void residual_layernorm_forward(float* out, float* mean, float* rstd, float* res, const float* x, const float* w,
                                const float* b, int64_t N, int64_t C, float eps) {
  const int64_t n = N * C;
#pragma omp parallel for simd schedule(static) if (n > detail::kParallelMin)
  for (int64_t i = 0; i < n; ++i) res[i] += x[i];
  layernorm_forward(out, mean, rstd, res, w, b, N, C, eps);
}

void residual_rmsnorm_forward(float* out, float* rstd, float* res, const float* x, const float* w, int64_t N,
                              int64_t C, float eps) {
  const int64_t n = N * C;
#pragma omp parallel for simd schedule(static) if (n > detail::kParallelMin)
  for (int64_t i = 0; i < n; ++i) res[i] += x[i];
  rmsnorm_forward(out, rstd, res, w, N, C, eps);
}

// ---- the bf16 residual stream: widen into scratch, then the fp32 kernels ----

namespace {
// res + x rounded to bf16 into res_out (x non-null) and the widened stream into a scratch buffer.
const float* widen_residual(bf16* res_out, const bf16* res, const float* x, int64_t n) {
  thread_local detail::Scratch scratch;
  float* w = scratch.as<float>(static_cast<size_t>(n));
#pragma omp parallel for schedule(static) if (n > detail::kParallelMin)
  for (int64_t i = 0; i < n; ++i) {
    if (x) {
      const bf16 r = float_to_bf16(bf16_to_float(res[i]) + x[i]);
      res_out[i] = r;
      w[i] = bf16_to_float(r);
    } else {
      w[i] = bf16_to_float(res[i]);
    }
  }
  return w;
}
}  // namespace

void residual_add_bf16(bf16* out, const bf16* res, const float* x, int64_t n) {
#pragma omp parallel for schedule(static) if (n > detail::kParallelMin)
  for (int64_t i = 0; i < n; ++i) out[i] = float_to_bf16(bf16_to_float(res[i]) + x[i]);
}

void residual_layernorm_forward_bf16(float* out, float* mean, float* rstd, bf16* res_out, const bf16* res,
                                     const float* x, const float* w, const float* b, int64_t N, int64_t C,
                                     float eps) {
  if (N <= 0 || C <= 0) return;
  layernorm_forward(out, mean, rstd, widen_residual(res_out, res, x, N * C), w, b, N, C, eps);
}

void residual_rmsnorm_forward_bf16(float* out, float* rstd, bf16* res_out, const bf16* res, const float* x,
                                   const float* w, int64_t N, int64_t C, float eps) {
  if (N <= 0 || C <= 0) return;
  rmsnorm_forward(out, rstd, widen_residual(res_out, res, x, N * C), w, N, C, eps);
}

void layernorm_backward_bf16(float* dinp, float* dw, float* db, const float* dout, const bf16* inp, const float* w,
                             const float* mean, const float* rstd, int64_t N, int64_t C) {
  if (N <= 0 || C <= 0) return;
  layernorm_backward(dinp, dw, db, dout, widen_residual(nullptr, inp, nullptr, N * C), w, mean, rstd, N, C);
}

void rmsnorm_backward_bf16(float* dinp, float* dw, const float* dout, const bf16* inp, const float* w,
                           const float* rstd, int64_t N, int64_t C) {
  if (N <= 0 || C <= 0) return;
  rmsnorm_backward(dinp, dw, dout, widen_residual(nullptr, inp, nullptr, N * C), w, rstd, N, C);
}

MT_CPU_VARIANT_END  // namespace mt::kernels::cpu
