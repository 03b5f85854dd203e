// AdamW against hand-computed values and a double-precision re-statement of torch.optim.AdamW.
#include "kernels/cpu/adamw.h"
#include "kernels/cpu/activation.h"

#include <gtest/gtest.h>

#include <cmath>

#include "test_util.h"

namespace mt::kernels::cpu {
namespace {

// One parameter, two steps, worked by hand (lr 0.1, betas 0.9/0.999, eps 1e-8, wd 0.01):
// step 1, g = 0.5:   m = 0.05, v = 2.5e-4, mhat = 0.5, vhat = 0.25,
//                    p = 1 - 0.1 * (0.5 / (0.5 + 1e-8) + 0.01 * 1) = 0.899000002
// step 2, g = -0.25: m = 0.045 - 0.025 = 0.02, v = 2.4975e-4 + 6.25e-5 = 3.1225e-4,
//                    mhat = 0.02 / 0.19 = 0.1052631579, vhat = 3.1225e-4 / 0.001999 = 0.1562031016,
//                    p = 0.899000002 - 0.1 * (0.1052631579 / 0.3952253808 + 0.01 * 0.899000002)
//                      = 0.8714672987
// The kernel takes float betas: 0.999f is 0.99900001287, so 1 - beta2 (and v) carry a relative
// error of 1.3e-5 against the exact 0.999 of the hand computation; p is insensitive to it.
TEST(AdamW, HandComputedTwoSteps) {
  float p = 1.0f, m = 0.0f, v = 0.0f;
  float g = 0.5f;
  adamw_update(&p, &g, &m, &v, 1, 0.1f, 0.9f, 0.999f, 1e-8f, 0.01f, 1);
  EXPECT_NEAR(m, 0.05, 5e-8);  // 1 - 0.9f = 0.100000024
  EXPECT_NEAR(v, 2.5e-4, 2e-5 * 2.5e-4);
  EXPECT_NEAR(p, 0.899000002, 1e-7);
  g = -0.25f;
  adamw_update(&p, &g, &m, &v, 1, 0.1f, 0.9f, 0.999f, 1e-8f, 0.01f, 2);
  EXPECT_NEAR(m, 0.02, 5e-8);
  EXPECT_NEAR(v, 3.1225e-4, 2e-5 * 3.1225e-4);
  EXPECT_NEAR(p, 0.8714672987, 1e-7);
}

// torch.optim.AdamW's own arrangement, in double: decay first, then the Adam step with
// denom = sqrt(v) / sqrt(bc2) + eps and step size lr / bc1.
struct RefAdamW {
  std::vector<double> p, m, v;
  void step(const std::vector<float>& grad, double lr, double b1, double b2, double eps, double wd,
            int step, double gscale) {
    const double bc1 = 1.0 - std::pow(b1, step), bc2 = 1.0 - std::pow(b2, step);
    for (size_t i = 0; i < p.size(); ++i) {
      const double g = double(grad[i]) * gscale;
      p[i] *= 1.0 - lr * wd;
      m[i] = b1 * m[i] + (1.0 - b1) * g;
      v[i] = b2 * v[i] + (1.0 - b2) * g * g;
      const double denom = std::sqrt(v[i]) / std::sqrt(bc2) + eps;
      p[i] -= lr / bc1 * m[i] / denom;
    }
  }
};

TEST(AdamW, MatchesDoubleReferenceOverSteps) {
  for (int64_t n : {int64_t(7), int64_t(50001)}) {  // serial and parallel paths
    auto p = kt::randn(size_t(n), 1);
    std::vector<float> m(size_t(n), 0.0f), v(size_t(n), 0.0f);
    RefAdamW ref{kt::to_double(p), std::vector<double>(size_t(n), 0.0), std::vector<double>(size_t(n), 0.0)};
    for (int step = 1; step <= 3; ++step) {
      auto g = kt::randn(size_t(n), 10 + step, 0.1f);
      const float gs = step == 2 ? 0.5f : 1.0f;  // clipping scale on one step
      adamw_update(p.data(), g.data(), m.data(), v.data(), n, 3e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, step, gs);
      ref.step(g, 3e-3, 0.9f, 0.95f, 1e-8, 0.1, step, gs);
    }
    EXPECT_TRUE(kt::close(p, ref.p, 1e-6, 1e-7)) << "n=" << n;
    EXPECT_TRUE(kt::close(m, ref.m, 1e-5, 1e-8));  // |m| terms ~1e-2
    EXPECT_TRUE(kt::close(v, ref.v, 1e-5, 1e-10));  // |v| terms ~1e-4
  }
}

TEST(AdamW, DeterministicAcrossThreadCounts) {
  const int64_t n = 100003;
  auto p0 = kt::randn(size_t(n), 21), g = kt::randn(size_t(n), 22);
  auto run = [&](int threads) {
    auto p = p0;
    std::vector<float> m(size_t(n), 0.1f), v(size_t(n), 0.01f);
    kt::with_threads(threads, [&] {
      adamw_update(p.data(), g.data(), m.data(), v.data(), n, 1e-3f, 0.9f, 0.999f, 1e-8f, 0.1f, 5);
    });
    p.insert(p.end(), m.begin(), m.end());
    p.insert(p.end(), v.begin(), v.end());
    return p;
  };
  EXPECT_TRUE(kt::bitwise_equal(run(1), run(2)));
}

// The bf16 copy written by the update is the updated fp32 weight rounded as cast_f32_to_bf16
// rounds it (every element, tail block included), and the fp32 results do not change.
TEST(AdamW, Bf16CopyInTheSamePassEqualsCastAfterwards) {
  const int64_t n = 100003;
  auto p0 = kt::randn(size_t(n), 31), g = kt::randn(size_t(n), 32);
  auto a = p0, b = p0;
  std::vector<float> ma(size_t(n), 0.1f), va(size_t(n), 0.01f), mb = ma, vb = va;
  std::vector<bf16> copy(size_t(n), bf16{0xffff});
  std::vector<bf16> want(static_cast<size_t>(n));
  adamw_update(a.data(), g.data(), ma.data(), va.data(), n, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 3, 0.8f);
  kt::with_threads(2, [&] {
    adamw_update(b.data(), g.data(), mb.data(), vb.data(), n, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 3, 0.8f, copy.data());
  });
  EXPECT_TRUE(kt::bitwise_equal(a, b));
  EXPECT_TRUE(kt::bitwise_equal(ma, mb));
  EXPECT_TRUE(kt::bitwise_equal(va, vb));
  cast_f32_to_bf16(want.data(), a.data(), n);
  int64_t differ = 0;
  for (int64_t i = 0; i < n; ++i) differ += copy[size_t(i)].bits != want[size_t(i)].bits;
  EXPECT_EQ(differ, 0);
}

// The multi-tensor form with the norm in memory: a norm that is not finite changes nothing (the
// trainer then stops the run with the last good step's weights); a finite one updates.
TEST(AdamW, MultiTensorLeavesEverythingWhenTheNormIsNotFinite) {
  const int64_t n = 1001;
  const auto p0 = kt::randn(size_t(n), 41), g = kt::randn(size_t(n), 42);
  for (const double norm_sq : {std::nan(""), HUGE_VAL, 4.0}) {
    auto p = p0;
    std::vector<float> m(size_t(n), 0.1f), v(size_t(n), 0.01f);
    const AdamWTensor t{p.data(), g.data(), m.data(), v.data(), nullptr, n, 0.1f};
    adamw_update_multi(&t, 1, 1e-3f, 0.9f, 0.95f, 1e-8f, 3, 1.0f, &norm_sq, 1.0);
    EXPECT_EQ(kt::bitwise_equal(p, p0), !std::isfinite(norm_sq)) << norm_sq;
    EXPECT_EQ(m[0] == 0.1f, !std::isfinite(norm_sq)) << norm_sq;
  }
}

}  // namespace
}  // namespace mt::kernels::cpu
