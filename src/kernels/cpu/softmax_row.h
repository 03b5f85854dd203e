// Softmax row helpers shared by the CPU kernels (attention, block attention, the loss). The header
// opens the ISA variant's namespace and target itself, so each variant compiles its own copy with
// its own vector width (which sets the order of the reductions, and so the results).
#pragma once
#include <cstdint>

#include "kernels/cpu/isa.h"
#include "kernels/cpu/vecmath.h"

MT_CPU_VARIANT_BEGIN

// The largest of x[0..n), n > 0.
inline float row_max(const float* x, int64_t n) {
  float m = x[0];
#pragma omp simd reduction(max : m)
  for (int64_t j = 0; j < n; ++j) m = x[j] > m ? x[j] : m;  // (std::max here stays scalar)
  return m;
}

struct RowExp {
  float max, sum;
};

// e[j] = exp(x[j] - max) over n > 0 entries (e may be x); returns the max and the sum of the
// exponentials (a softmax row's statistics).
inline RowExp exp_row(const float* x, float* e, int64_t n) {
  const float m = row_max(x, n);
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t j = 0; j < n; ++j) {
    const float v = detail::exp_f(x[j] - m);
    e[j] = v;
    s += v;
  }
  return {m, s};
}

MT_CPU_VARIANT_END  // namespace mt::kernels::cpu
