#include "kernels/cpu/fma_peak.h"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <vector>

#include "kernels/cpu/cpu_isa.h"

namespace mt::kernels::cpu {

namespace {

using Clock = std::chrono::steady_clock;
volatile float g_sink = 0.0f;

// One trial: FLOP/s of nt threads, iters rounds of 12 FMAs each. A macro so that the AVX-512 copy
// is compiled under its own target pragma (and its name says avx512, which tests/kernels/isa_test
// requires of any function holding AVX-512 instructions).
#define MT_FMA_TRIAL(V, LANES, SET1, FMA, FIRST)                                          \
  constexpr int kAcc = 12;                                                               \
  float total = 0.0f;                                                                    \
  const auto t0 = Clock::now();                                                          \
  _Pragma("omp parallel num_threads(nt) reduction(+ : total)") {                         \
    V acc[kAcc];                                                                         \
    for (int i = 0; i < kAcc; ++i) acc[i] = SET1(float(i + omp_get_thread_num()));      \
    const V b = SET1(1.0000001f), c = SET1(1e-7f);                                       \
    for (int64_t k = 0; k < iters; ++k) {                                                \
      _Pragma("GCC unroll 12") for (int i = 0; i < kAcc; ++i) acc[i] = FMA(acc[i], b, c); \
    }                                                                                    \
    for (int i = 0; i < kAcc; ++i) total += FIRST(acc[i]);                               \
  }                                                                                      \
  g_sink = total; /* keeps the loops observable */                                       \
  const double sec = std::chrono::duration<double>(Clock::now() - t0).count();           \
  return double(nt) * double(iters) * kAcc * LANES * 2.0 / std::max(sec, 1e-9);

double fma_trial_avx2(int nt, int64_t iters) { MT_FMA_TRIAL(__m256, 8, _mm256_set1_ps, _mm256_fmadd_ps, _mm256_cvtss_f32) }
#pragma GCC push_options
#pragma GCC target("avx512f")
double fma_trial_avx512(int nt, int64_t iters) { MT_FMA_TRIAL(__m512, 16, _mm512_set1_ps, _mm512_fmadd_ps, _mm512_cvtss_f32) }
#pragma GCC pop_options
#undef MT_FMA_TRIAL

}  // namespace

bool fma_peak_uses_avx512() { return active_isa() >= CpuIsa::AVX512; }

double fma_peak(int threads, double seconds, int trials) {
  const int nt = threads > 0 ? threads : omp_get_max_threads();
  const bool wide = fma_peak_uses_avx512();
  auto trial = [&](int64_t iters) { return wide ? fma_trial_avx512(nt, iters) : fma_trial_avx2(nt, iters); };
  // Calibrate the length: a short trial gives the rate, then trials of `seconds` each.
  const int64_t probe = 20000;
  const double rate = trial(probe);  // FLOP/s
  const double flops_per_iter = double(nt) * 12.0 * (wide ? 16 : 8) * 2.0;
  const int64_t iters = std::max<int64_t>(probe, static_cast<int64_t>(seconds * rate / flops_per_iter));
  std::vector<double> r;
  for (int i = 0; i < std::max(1, trials); ++i) r.push_back(trial(iters));
  std::sort(r.begin(), r.end());
  return r[r.size() / 2];
}

}  // namespace mt::kernels::cpu
