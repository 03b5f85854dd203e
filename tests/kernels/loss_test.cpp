// Fused softmax + cross-entropy against a double reference and finite differences.
#include "kernels/cpu/loss.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "runtime/dtype.h"
#include "test_util.h"

namespace mt::kernels::cpu {
namespace {

// Per-row losses of logits [N, Vp] over the first V columns; ignored rows give 0.
std::vector<double> ref_losses(const std::vector<double>& logits, const std::vector<int32_t>& tg,
                               int64_t V, int64_t Vp) {
  std::vector<double> l(tg.size(), 0.0);
  for (size_t n = 0; n < tg.size(); ++n) {
    if (tg[n] < 0) continue;
    const double* x = &logits[n * size_t(Vp)];
    double m = x[0];
    for (int64_t j = 0; j < V; ++j) m = std::max(m, x[j]);
    double z = 0.0;
    for (int64_t j = 0; j < V; ++j) z += std::exp(x[j] - m);
    l[n] = m + std::log(z) - x[tg[n]];
  }
  return l;
}

TEST(CrossEntropy, LossesAndGradientMatchReference) {
  const int64_t N = 5, V = 7, Vp = 9;
  const std::vector<int32_t> tg = {3, -1, 0, 6, 2};  // row 1 ignored
  auto logits = kt::randn(N * Vp, 1, 2.0f);
  // Padded columns hold garbage (even NaN) that must not be read.
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = V; j < Vp; ++j) logits[size_t(n * Vp + j)] = std::numeric_limits<float>::quiet_NaN();
  const float dloss = 0.25f;
  auto ld = kt::to_double(logits);
  auto want = ref_losses(ld, tg, V, Vp);
  std::vector<float> fwd(N);
  softmax_cross_entropy_forward(logits.data(), fwd.data(), tg.data(), N, V, Vp);
  EXPECT_TRUE(kt::close(fwd, want, 1e-5, 1e-6));

  auto g = logits;
  std::vector<float> losses(N);
  softmax_cross_entropy(g.data(), losses.data(), tg.data(), N, V, Vp, dloss);
  EXPECT_TRUE(kt::close(losses, want, 1e-5, 1e-6));
  EXPECT_TRUE(kt::bitwise_equal(losses, fwd));
  // Gradient of dloss * sum losses w.r.t. the real columns, by finite differences (padding and
  // NaNs replaced by 0 for the numerical derivative, they are not read by the reference).
  for (auto& v : ld)
    if (std::isnan(v)) v = 0.0;
  auto num = kt::numgrad([&](const std::vector<double>& x) {
    double s = 0.0;
    for (double l : ref_losses(x, tg, V, Vp)) s += double(dloss) * l;
    return s;
  }, ld);
  EXPECT_TRUE(kt::close(g, num, 1e-4, 1e-6));
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = V; j < Vp; ++j) EXPECT_EQ(g[size_t(n * Vp + j)], 0.0f) << "padded column";
  for (int64_t j = 0; j < Vp; ++j) EXPECT_EQ(g[size_t(1 * Vp + j)], 0.0f) << "ignored row";
  EXPECT_EQ(losses[1], 0.0f);
  // Sensitivity: forgetting the one-hot term is rejected.
  auto wrong = g;
  wrong[size_t(0 * Vp + 3)] += dloss;
  EXPECT_FALSE(kt::close(wrong, num, 1e-4, 1e-6));
}

TEST(CrossEntropy, StableForLargeLogitsAndDeterministic) {
  const int64_t N = 64, V = 1000, Vp = 1024;
  auto logits = kt::randn(N * Vp, 2, 3.0f);
  for (auto& v : logits) v *= 300.0f;  // |logit| up to ~3000
  std::vector<int32_t> tg(N);
  for (int64_t n = 0; n < N; ++n) tg[n] = int32_t((n * 37) % V);
  auto want = ref_losses(kt::to_double(logits), tg, V, Vp);
  std::vector<float> l1(N), l2(N);
  auto g1 = logits, g2 = logits;
  kt::with_threads(1, [&] { softmax_cross_entropy(g1.data(), l1.data(), tg.data(), N, V, Vp, 1.0f / N); });
  kt::with_threads(2, [&] { softmax_cross_entropy(g2.data(), l2.data(), tg.data(), N, V, Vp, 1.0f / N); });
  EXPECT_TRUE(kt::close(l1, want, 1e-5, 1e-3));
  EXPECT_TRUE(kt::bitwise_equal(l1, l2));
  EXPECT_TRUE(kt::bitwise_equal(g1, g2));
  for (float v : g1) ASSERT_TRUE(std::isfinite(v));
  // Each gradient row sums to zero (softmax minus one-hot).
  for (int64_t n = 0; n < N; ++n) {
    double s = 0.0;
    for (int64_t j = 0; j < Vp; ++j) s += g1[size_t(n * Vp + j)];
    EXPECT_NEAR(s, 0.0, 1e-6);
  }
}

// The bf16-gradient form equals the fp32 kernel followed by the cast, bit for bit: losses, every
// gradient value (padded columns and ignored rows zero), at 1 and 2 threads, as a dense [N, Vp]
// bf16 matrix over the first half of the logits' storage.
TEST(CrossEntropy, Bf16GradientInPlaceEqualsFp32KernelThenCast) {
  const int64_t N = 37, V = 1000, Vp = 1040;
  auto logits = kt::randn(N * Vp, 7, 4.0f);
  std::vector<int32_t> tg(N);
  for (int64_t n = 0; n < N; ++n) tg[n] = n == 5 ? -1 : int32_t((n * 131) % V);
  tg[3] = 0;
  tg[4] = int32_t(V - 1);
  const float dloss = 1.0f / N;
  auto g32 = logits;
  std::vector<float> l32(N);
  softmax_cross_entropy(g32.data(), l32.data(), tg.data(), N, V, Vp, dloss);
  for (int threads : {1, 2}) {
    auto buf = logits;
    std::vector<float> l16(N, -1.0f);
    kt::with_threads(threads, [&] { softmax_cross_entropy_bf16(buf.data(), l16.data(), tg.data(), N, V, Vp, dloss); });
    EXPECT_TRUE(kt::bitwise_equal(l16, l32)) << threads << " threads";
    int64_t bad = 0;
    for (int64_t n = 0; n < N; ++n) {
      const unsigned char* row = reinterpret_cast<const unsigned char*>(buf.data()) + 2 * n * Vp;
      for (int64_t j = 0; j < Vp; ++j) {
        uint16_t got;
        std::memcpy(&got, row + 2 * j, 2);
        if (got != float_to_bf16(g32[size_t(n * Vp + j)]).bits) ++bad;
      }
    }
    EXPECT_EQ(bad, 0) << threads << " threads";
  }
  // The loss is rejected where the fp32 one is.
  std::vector<int32_t> out = tg;
  out[0] = int32_t(V);
  auto buf = logits;
  std::vector<float> l(N);
  EXPECT_THROW(softmax_cross_entropy_bf16(buf.data(), l.data(), out.data(), N, V, Vp, dloss), std::out_of_range);
}

TEST(CrossEntropy, RejectsTargetOutsideVocabulary) {
  std::vector<float> logits(2 * 8, 0.0f), losses(2);
  std::vector<int32_t> tg = {1, 7};  // 7 is a padded column for V = 6
  EXPECT_THROW(softmax_cross_entropy(logits.data(), losses.data(), tg.data(), 2, 6, 8, 1.0f),
               std::out_of_range);
  EXPECT_THROW(softmax_cross_entropy_forward(logits.data(), losses.data(), tg.data(), 2, 6, 8),
               std::out_of_range);
}

}  // namespace
}  // namespace mt::kernels::cpu
