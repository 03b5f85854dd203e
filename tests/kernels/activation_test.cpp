// GELU, SwiGLU, elementwise helpers and bf16 casts.
#include "kernels/cpu/activation.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "kernels/cpu/vecmath.h"
#include "test_util.h"

namespace mt::kernels::cpu {
namespace {

double ref_gelu(double x) {
  const double k = std::sqrt(2.0 / M_PI);
  return 0.5 * x * (1.0 + std::tanh(k * (x + 0.044715 * x * x * x)));
}
double ref_silu(double x) { return x / (1.0 + std::exp(-x)); }

TEST(VecMath, ExpIsAccurateAndHandlesLimits) {
  double worst = 0.0;
  for (int i = 0; i <= 200000; ++i) {
    const float x = -87.0f + 175.0f * float(i) / 200000.0f;
    const double want = std::exp(double(x));
    worst = std::max(worst, std::abs(double(detail::exp_f(x)) - want) / want);
  }
  EXPECT_LT(worst, 4e-7);  // a few ulp
  EXPECT_EQ(detail::exp_f(0.0f), 1.0f);
  EXPECT_EQ(detail::exp_f(-std::numeric_limits<float>::infinity()), 0.0f);
  EXPECT_EQ(detail::exp_f(-1000.0f), 0.0f);
  EXPECT_TRUE(std::isfinite(detail::exp_f(1000.0f)));
  EXPECT_TRUE(std::isnan(detail::exp_f(std::numeric_limits<float>::quiet_NaN())));
}

// Odd length (not a multiple of the vector width) and a wide range of inputs, including the
// saturated tails.
std::vector<float> act_inputs() {
  auto x = kt::randn(37, 1, 3.0f);
  for (float v : {0.0f, 1e-6f, -1e-6f, 8.0f, -8.0f, 30.0f, -30.0f, 100.0f, -100.0f}) x.push_back(v);
  return x;
}

TEST(Gelu, ForwardMatchesReference) {
  auto x = act_inputs();
  std::vector<float> y(x.size());
  gelu_forward(y.data(), x.data(), int64_t(x.size()));
  std::vector<double> want(x.size());
  for (size_t i = 0; i < x.size(); ++i) want[i] = ref_gelu(x[i]);
  EXPECT_TRUE(kt::close(y, want, 2e-6, 1e-7));
}

// Pointwise, so the finite differences of L = sum dout * gelu(x) are per element.
TEST(Gelu, BackwardMatchesFiniteDifferencesAndAccumulates) {
  auto x = act_inputs();
  auto dout = kt::randn(x.size(), 2);
  auto g0 = kt::randn(x.size(), 3);
  std::vector<float> dx = g0;
  gelu_backward(dx.data(), x.data(), dout.data(), int64_t(x.size()));
  auto dd = kt::to_double(dout);
  auto num = kt::numgrad([&](const std::vector<double>& v) {
    double s = 0.0;
    for (size_t i = 0; i < v.size(); ++i) s += dd[i] * ref_gelu(v[i]);
    return s;
  }, kt::to_double(x));
  std::vector<double> want(x.size());
  for (size_t i = 0; i < x.size(); ++i) want[i] = double(g0[i]) + num[i];
  EXPECT_TRUE(kt::close(dx, want, 1e-4, 1e-5));
  // A wrong derivative (the exact-erf GELU's, which differs by up to ~1e-3) is rejected.
  std::vector<float> wrong(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const double xi = x[i];
    const double d = 0.5 * (1.0 + std::erf(xi / std::sqrt(2.0))) + xi * std::exp(-0.5 * xi * xi) / std::sqrt(2.0 * M_PI);
    wrong[i] = float(g0[i] + dout[i] * d);
  }
  EXPECT_FALSE(kt::close(wrong, want, 1e-4, 1e-5));
}

TEST(SwiGLU, ForwardAndBackwardMatchReference) {
  auto g = act_inputs();
  auto u = kt::randn(g.size(), 4);
  auto dout = kt::randn(g.size(), 5);
  std::vector<float> y(g.size());
  swiglu_forward(y.data(), g.data(), u.data(), int64_t(g.size()));
  std::vector<double> want(g.size());
  for (size_t i = 0; i < g.size(); ++i) want[i] = ref_silu(g[i]) * double(u[i]);
  EXPECT_TRUE(kt::close(y, want, 2e-6, 1e-7));

  auto dg0 = kt::randn(g.size(), 6), du0 = kt::randn(g.size(), 7);
  std::vector<float> dg = dg0, du = du0;
  swiglu_backward(dg.data(), du.data(), dout.data(), g.data(), u.data(), int64_t(g.size()));
  auto gd = kt::to_double(g), ud = kt::to_double(u), dd = kt::to_double(dout);
  auto loss = [&](const std::vector<double>& gg, const std::vector<double>& uu) {
    double s = 0.0;
    for (size_t i = 0; i < gg.size(); ++i) s += dd[i] * ref_silu(gg[i]) * uu[i];
    return s;
  };
  auto ng = kt::numgrad([&](const std::vector<double>& v) { return loss(v, ud); }, gd);
  auto nu = kt::numgrad([&](const std::vector<double>& v) { return loss(gd, v); }, ud);
  std::vector<double> wg(g.size()), wu(g.size());
  for (size_t i = 0; i < g.size(); ++i) {
    wg[i] = dg0[i] + ng[i];
    wu[i] = du0[i] + nu[i];
  }
  EXPECT_TRUE(kt::close(dg, wg, 1e-4, 1e-5));
  EXPECT_TRUE(kt::close(du, wu, 1e-4, 1e-5));
}

// The bf16 forms are the fp32 kernels on the widened bf16 gate and up, each result rounded to bf16
// (within half a bf16 step of the fp32 value; a step allows for ulps between the two loops), and the
// backward writes its gradients (their starting contents do not matter).
TEST(SwiGLU, Bf16FormsRoundTheFp32KernelsOnTheSameValues) {
  const std::vector<float> g0 = act_inputs(), u0 = kt::randn(g0.size(), 4), dout = kt::randn(g0.size(), 5);
  const int64_t n = static_cast<int64_t>(g0.size());
  std::vector<bf16> g16(g0.size()), u16(g0.size());
  std::vector<float> g(g0.size()), u(g0.size());
  for (size_t i = 0; i < g0.size(); ++i) {
    g16[i] = float_to_bf16(g0[i]);
    u16[i] = float_to_bf16(u0[i]);
    g[i] = bf16_to_float(g16[i]);
    u[i] = bf16_to_float(u16[i]);
  }
  auto within = [](const std::vector<bf16>& got, const std::vector<float>& want, const char* what) {
    int bad = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      const float x = bf16_to_float(got[i]);
      if (!(std::abs(x - want[i]) <= std::abs(want[i]) / 256.0f + 1e-30f)) ++bad;
    }
    EXPECT_EQ(bad, 0) << what;
  };
  std::vector<float> y(g.size());
  swiglu_forward(y.data(), g.data(), u.data(), n);
  std::vector<bf16> y16(g.size(), float_to_bf16(7.0f));
  swiglu_forward_bf16(y16.data(), g16.data(), u16.data(), n);
  within(y16, y, "forward");

  std::vector<float> dg(g.size(), 0.0f), du(g.size(), 0.0f);
  swiglu_backward(dg.data(), du.data(), dout.data(), g.data(), u.data(), n);
  std::vector<bf16> dg16(g.size(), float_to_bf16(3.0f)), du16(g.size(), float_to_bf16(-5.0f));
  swiglu_backward_bf16(dg16.data(), du16.data(), dout.data(), g16.data(), u16.data(), n);
  within(dg16, dg, "dgate");
  within(du16, du, "dup");
}

// Elementwise kernels split the range differently per thread count (vector body vs scalar tail);
// the results must not change.
TEST(Activations, ThreadCountIndependent) {
  const int64_t n = 100003;
  auto x = kt::randn(size_t(n), 31, 3.0f), u = kt::randn(size_t(n), 32), d = kt::randn(size_t(n), 33);
  auto run = [&](int threads) {
    const size_t sz = static_cast<size_t>(n);
    std::vector<float> y(sz), dx(sz, 0.0f), s(sz), dg(sz, 0.0f), du(sz, 0.0f);
    kt::with_threads(threads, [&] {
      gelu_forward(y.data(), x.data(), n);
      gelu_backward(dx.data(), x.data(), d.data(), n);
      swiglu_forward(s.data(), x.data(), u.data(), n);
      swiglu_backward(dg.data(), du.data(), d.data(), x.data(), u.data(), n);
    });
    for (auto* v : {&dx, &s, &dg, &du}) y.insert(y.end(), v->begin(), v->end());
    return y;
  };
  const auto a1 = run(1);
  EXPECT_TRUE(kt::bitwise_equal(a1, run(2)));
  EXPECT_TRUE(kt::bitwise_equal(a1, run(3)));
}

TEST(Elementwise, AddAccumulateScale) {
  const int64_t n = 40001;  // large enough for the parallel path, odd
  auto a = kt::randn(n, 11), b = kt::randn(n, 12);
  std::vector<float> out(n);
  add(out.data(), a.data(), b.data(), n);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(out[i], a[i] + b[i]);
  auto y = a;
  add(y.data(), y.data(), b.data(), n);  // aliasing out == a
  EXPECT_TRUE(kt::bitwise_equal(y, out));
  y = a;
  accumulate(y.data(), b.data(), n);
  EXPECT_TRUE(kt::bitwise_equal(y, out));
  y = a;
  scale(y.data(), 0.25f, n);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(y[i], a[i] * 0.25f);
}

TEST(Elementwise, SumSquaresDoublePrecisionAndThreadIndependent) {
  for (int64_t n : {int64_t(0), int64_t(7), int64_t(100003), int64_t(3000017)}) {
    auto x = kt::randn(size_t(n), 21);
    double want = 0.0;
    for (float v : x) want += double(v) * double(v);
    double s1 = 0, s2 = 0;
    kt::with_threads(1, [&] { s1 = sum_squares(x.data(), n); });
    kt::with_threads(2, [&] { s2 = sum_squares(x.data(), n); });
    EXPECT_NEAR(s1, want, 1e-12 * std::max(1.0, want));
    EXPECT_EQ(s1, s2) << "n=" << n;
  }
}

uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

TEST(Casts, RoundToNearestEvenAndSpecialValues) {
  struct Case {
    uint32_t in;
    uint16_t out;
  };
  const Case cases[] = {
      {0x3f800000u, 0x3f80},  // 1.0 exact
      {0x3f808000u, 0x3f80},  // 1 + 2^-8: tie, rounds to even (down)
      {0x3f818000u, 0x3f82},  // 1 + 3*2^-8: tie, rounds to even (up)
      {0x3f808001u, 0x3f81},  // just above the tie: up
      {0x3f807fffu, 0x3f80},  // just below the tie: down
      {0xbf808000u, 0xbf80},  // negative tie
      {0x7f7fffffu, 0x7f80},  // FLT_MAX rounds to +inf
      {0x7f800000u, 0x7f80},  // +inf
      {0xff800000u, 0xff80},  // -inf
      {0x00000001u, 0x0000},  // smallest denormal rounds to +0
      {0x80000000u, 0x8000},  // -0
      {0x00018000u, 0x0002},  // denormal tie, rounds to even (up)
  };
  for (const Case& c : cases) {
    float f = from_bits(c.in);
    bf16 o;
    cast_f32_to_bf16(&o, &f, 1);
    EXPECT_EQ(o.bits, c.out) << std::hex << c.in;
  }
  // NaNs (quiet, signalling, negative, payload in the low bits only) stay NaN.
  for (uint32_t nan : {0x7fc00000u, 0x7f800001u, 0xffc00000u, 0x7f80ffffu, 0x7fffffffu}) {
    float f = from_bits(nan);
    bf16 o;
    cast_f32_to_bf16(&o, &f, 1);
    EXPECT_TRUE(std::isnan(bf16_to_float(o))) << std::hex << nan;
    EXPECT_EQ(o.bits & 0x8000u, (nan >> 16) & 0x8000u);  // sign kept
  }
}

TEST(Casts, MatchScalarConversionAndRoundTrip) {
  // Random bit patterns (all classes of floats), vector path vs the scalar reference.
  const int64_t n = 100003;
  std::vector<float> f(n);
  std::mt19937_64 rng(99);
  for (auto& v : f) v = from_bits(static_cast<uint32_t>(rng()));
  std::vector<bf16> o(n);
  cast_f32_to_bf16(o.data(), f.data(), n);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(o[i].bits, float_to_bf16(f[i]).bits) << i;
  // Every bf16 value widens exactly and converts back to itself (NaNs stay NaN).
  std::vector<bf16> all(65536);
  for (uint32_t i = 0; i < 65536; ++i) all[i] = bf16{static_cast<uint16_t>(i)};
  std::vector<float> wide(65536);
  cast_bf16_to_f32(wide.data(), all.data(), 65536);
  std::vector<bf16> back(65536);
  cast_f32_to_bf16(back.data(), wide.data(), 65536);
  for (uint32_t i = 0; i < 65536; ++i) {
    ASSERT_EQ(bits_of(wide[i]), i << 16);
    if (std::isnan(wide[i])) ASSERT_TRUE(std::isnan(bf16_to_float(back[i])));
    else ASSERT_EQ(back[i].bits, i);
  }
}

}  // namespace
}  // namespace mt::kernels::cpu
