// AdamW (decoupled weight decay) as torch.optim.AdamW: bias corrections in double once per call,
// the elementwise update in float, vectorised and parallel over elements (results do not depend
// on the thread count: every element is updated independently).
#include "kernels/cpu/adamw.h"

#include <algorithm>
#include <cmath>

#if defined(__AVX__)
#include <immintrin.h>
#endif

#include "kernels/cpu/vecmath.h"
#include "kernels/cpu/workspace.h"

MT_CPU_VARIANT_BEGIN

namespace {

// x[i] = sqrt(x[i]), correctly rounded. std::sqrt in a loop stays scalar under the default
// -fmath-errno (GCC guards it with a branch to libm), so use the vector instruction directly.
inline void sqrt_inplace(float* x, int64_t n) {
  int64_t i = 0;
#if defined(__AVX__)
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_sqrt_ps(_mm256_loadu_ps(x + i)));
#endif
  for (; i < n; ++i) x[i] = std::sqrt(x[i]);
}

}  // namespace

void adamw_update(float* param, const float* grad, float* m, float* v, int64_t n, float lr, float beta1,
                  float beta2, float eps, float weight_decay, int64_t step, float grad_scale, bf16* param_bf16) {
  const double bc1 = 1.0 - std::pow(static_cast<double>(beta1), static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(static_cast<double>(beta2), static_cast<double>(step));
  const float inv_bc1 = static_cast<float>(1.0 / bc1);
  const float inv_bc2 = static_cast<float>(1.0 / bc2);
  const float omb1 = 1.0f - beta1, omb2 = 1.0f - beta2;
  const float lr_wd = lr * weight_decay;
  constexpr int64_t kBlk = 512;
  const int64_t nblk = (n + kBlk - 1) / kBlk;
#pragma omp parallel for schedule(static) if (n > detail::kParallelMin)
  for (int64_t b = 0; b < nblk; ++b) {
    const int64_t i0 = b * kBlk;
    const int64_t len = std::min(kBlk, n - i0);
    float den[kBlk];
    float* pb = param + i0;
    const float* gb = grad + i0;
    float* mb = m + i0;
    float* vb = v + i0;
#pragma omp simd
    for (int64_t i = 0; i < len; ++i) {
      const float g = gb[i] * grad_scale;
      const float mi = beta1 * mb[i] + omb1 * g;
      const float vi = beta2 * vb[i] + omb2 * g * g;
      mb[i] = mi;
      vb[i] = vi;
      den[i] = vi * inv_bc2;  // vhat
    }
    sqrt_inplace(den, len);
#pragma omp simd
    for (int64_t i = 0; i < len; ++i) {
      const float mhat = mb[i] * inv_bc1;
      const float p = pb[i];
      pb[i] = p - (lr * (mhat / (den[i] + eps)) + lr_wd * p);
    }
    if (param_bf16) {
      bf16* ob = param_bf16 + i0;
#pragma omp simd
      for (int64_t i = 0; i < len; ++i) ob[i] = detail::to_bf16(pb[i]);
    }
  }
}

void adamw_update_multi(const AdamWTensor* tensors, int64_t count, float lr, float beta1, float beta2, float eps,
                        int64_t step, float grad_scale, const double* clip_norm_sq, double clip_max) {
  if (clip_norm_sq && !std::isfinite(*clip_norm_sq)) return;
  float scale = grad_scale;
  if (clip_norm_sq && clip_max > 0) {
    const double norm = std::sqrt(*clip_norm_sq);
    if (norm > clip_max) scale = static_cast<float>(clip_max / (norm + 1e-6));
  }
  for (int64_t i = 0; i < count; ++i) {
    const AdamWTensor& t = tensors[i];
    if (t.n > 0)
      adamw_update(t.param, t.grad, t.m, t.v, t.n, lr, beta1, beta2, eps, t.weight_decay, step, scale, t.param_bf16);
  }
}

MT_CPU_VARIANT_END  // namespace mt::kernels::cpu
