// Row helpers shared by the attention kernels (attention.cpp, attention_block.cpp). The header
// opens the ISA variant's namespace and target itself, so each variant compiles its own copy
// with its own vector width (which sets the order of the reductions, and so the results).
#pragma once
#include <cstdint>

#include "kernels/cpu/isa.h"
#include "kernels/cpu/vecmath.h"

MT_CPU_VARIANT_BEGIN

struct RowExp {
  float max, sum;
};

// In place row[j] = exp(row[j] - max) over n > 0 entries; returns the max and the sum of the
// exponentials (a softmax row's statistics).
inline RowExp exp_row(float* row, int64_t n) {
  float m = row[0];
#pragma omp simd reduction(max : m)
  for (int64_t j = 0; j < n; ++j) m = row[j] > m ? row[j] : m;  // (std::max here stays scalar)
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t j = 0; j < n; ++j) {
    const float e = detail::exp_f(row[j] - m);
    row[j] = e;
    s += e;
  }
  return {m, s};
}

MT_CPU_VARIANT_END  // namespace mt::kernels::cpu
