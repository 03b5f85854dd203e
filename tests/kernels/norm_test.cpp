// LayerNorm / RMSNorm against double references; backward against central finite differences.
#include "kernels/cpu/norm.h"

#include <gtest/gtest.h>

#include <cmath>

#include "test_util.h"

namespace mt::kernels::cpu {
namespace {

constexpr double kEps = 1e-5;

std::vector<double> ref_layernorm(const std::vector<double>& x, const std::vector<double>& w,
                                  const std::vector<double>& b, int64_t N, int64_t C,
                                  std::vector<double>* mean = nullptr,
                                  std::vector<double>* rstd = nullptr) {
  std::vector<double> y(x.size());
  for (int64_t n = 0; n < N; ++n) {
    double m = 0.0;
    for (int64_t c = 0; c < C; ++c) m += x[n * C + c];
    m /= double(C);
    double v = 0.0;
    for (int64_t c = 0; c < C; ++c) v += (x[n * C + c] - m) * (x[n * C + c] - m);
    v /= double(C);
    const double r = 1.0 / std::sqrt(v + kEps);
    for (int64_t c = 0; c < C; ++c) y[n * C + c] = (x[n * C + c] - m) * r * w[c] + b[c];
    if (mean) mean->push_back(m);
    if (rstd) rstd->push_back(r);
  }
  return y;
}

std::vector<double> ref_rmsnorm(const std::vector<double>& x, const std::vector<double>& w, int64_t N,
                                int64_t C, std::vector<double>* rstd = nullptr) {
  std::vector<double> y(x.size());
  for (int64_t n = 0; n < N; ++n) {
    double ss = 0.0;
    for (int64_t c = 0; c < C; ++c) ss += x[n * C + c] * x[n * C + c];
    const double r = 1.0 / std::sqrt(ss / double(C) + kEps);
    for (int64_t c = 0; c < C; ++c) y[n * C + c] = x[n * C + c] * r * w[c];
    if (rstd) rstd->push_back(r);
  }
  return y;
}

struct LnCase {
  int64_t N, C;
};

TEST(LayerNorm, ForwardMatchesReference) {
  for (LnCase s : {LnCase{5, 7}, LnCase{3, 1}, LnCase{70, 384}}) {
    auto x = kt::randn(s.N * s.C, 1, 2.0f), w = kt::randn(s.C, 2), b = kt::randn(s.C, 3);
    for (auto& v : x) v += 3.0f;  // non-zero mean
    std::vector<double> m, r;
    auto want = ref_layernorm(kt::to_double(x), kt::to_double(w), kt::to_double(b), s.N, s.C, &m, &r);
    std::vector<float> y(x.size()), mean(s.N), rstd(s.N);
    layernorm_forward(y.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), s.N, s.C);
    EXPECT_TRUE(kt::close(y, want, 1e-5, 2e-5)) << s.N << "x" << s.C;
    EXPECT_TRUE(kt::close(mean, m, 1e-6, 1e-6));
    EXPECT_TRUE(kt::close(rstd, r, 1e-5, 1e-6));
  }
}

// L = sum dout * layernorm(x; w, b); tolerance rel 1e-4, abs 1e-5.
TEST(LayerNorm, BackwardMatchesFiniteDifferences) {
  const int64_t N = 5, C = 7;
  auto x = kt::randn(N * C, 11), w = kt::randn(C, 12), b = kt::randn(C, 13), dout = kt::randn(N * C, 14);
  auto xd = kt::to_double(x), wd = kt::to_double(w), bd = kt::to_double(b), dd = kt::to_double(dout);
  std::vector<float> y(N * C), mean(N), rstd(N);
  layernorm_forward(y.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C);
  std::vector<float> dx(N * C, 0.0f), dw(C, 0.0f), db(C, 0.0f);
  layernorm_backward(dx.data(), dw.data(), db.data(), dout.data(), x.data(), w.data(), mean.data(),
                     rstd.data(), N, C);
  auto gx = kt::numgrad([&](const std::vector<double>& v) { return kt::dot(dd, ref_layernorm(v, wd, bd, N, C)); }, xd);
  auto gw = kt::numgrad([&](const std::vector<double>& v) { return kt::dot(dd, ref_layernorm(xd, v, bd, N, C)); }, wd);
  auto gb = kt::numgrad([&](const std::vector<double>& v) { return kt::dot(dd, ref_layernorm(xd, wd, v, N, C)); }, bd);
  EXPECT_TRUE(kt::close(dx, gx, 1e-4, 1e-5));
  EXPECT_TRUE(kt::close(dw, gw, 1e-4, 1e-5));
  EXPECT_TRUE(kt::close(db, gb, 1e-4, 1e-5));
  // Sensitivity: dropping the mean-subtraction term of dx is caught.
  std::vector<float> wrong(N * C);
  for (int64_t n = 0; n < N; ++n) {
    double sdx = 0.0;
    for (int64_t c = 0; c < C; ++c)
      sdx += dout[n * C + c] * w[c] * (x[n * C + c] - mean[n]) * rstd[n];
    for (int64_t c = 0; c < C; ++c) {
      const double xh = (x[n * C + c] - mean[n]) * rstd[n];
      wrong[n * C + c] = float(rstd[n] * (dout[n * C + c] * w[c] - xh * sdx / C));
    }
  }
  EXPECT_FALSE(kt::close(wrong, gx, 1e-4, 1e-5));
}

TEST(LayerNorm, BackwardAccumulatesAndIsThreadCountIndependent) {
  const int64_t N = 200, C = 129;  // several row chunks, large enough to run in parallel
  auto x = kt::randn(N * C, 21), w = kt::randn(C, 22), b = kt::randn(C, 23), dout = kt::randn(N * C, 24);
  std::vector<float> y(N * C), mean(N), rstd(N);
  layernorm_forward(y.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C);
  auto run = [&](int threads, std::vector<float> dx, std::vector<float> dw, std::vector<float> db) {
    kt::with_threads(threads, [&] {
      layernorm_backward(dx.data(), dw.data(), db.data(), dout.data(), x.data(), w.data(),
                         mean.data(), rstd.data(), N, C);
    });
    std::vector<float> all = dx;
    all.insert(all.end(), dw.begin(), dw.end());
    all.insert(all.end(), db.begin(), db.end());
    return all;
  };
  auto z = run(1, std::vector<float>(N * C, 0.f), std::vector<float>(C, 0.f), std::vector<float>(C, 0.f));
  auto g0x = kt::randn(N * C, 25), g0w = kt::randn(C, 26), g0b = kt::randn(C, 27);
  auto a1 = run(1, g0x, g0w, g0b);
  auto a2 = run(2, g0x, g0w, g0b);
  auto a3 = run(3, g0x, g0w, g0b);
  EXPECT_TRUE(kt::bitwise_equal(a1, a2));
  EXPECT_TRUE(kt::bitwise_equal(a1, a3));
  std::vector<float> g0 = g0x;
  g0.insert(g0.end(), g0w.begin(), g0w.end());
  g0.insert(g0.end(), g0b.begin(), g0b.end());
  std::vector<double> want(g0.size());
  for (size_t i = 0; i < g0.size(); ++i) want[i] = double(g0[i]) + double(z[i]);
  EXPECT_TRUE(kt::close(a1, want, 1e-6, 1e-6));
}

TEST(RMSNorm, ForwardMatchesReference) {
  for (LnCase s : {LnCase{5, 7}, LnCase{70, 384}}) {
    auto x = kt::randn(s.N * s.C, 31, 2.0f), w = kt::randn(s.C, 32);
    std::vector<double> r;
    auto want = ref_rmsnorm(kt::to_double(x), kt::to_double(w), s.N, s.C, &r);
    std::vector<float> y(x.size()), rstd(s.N);
    rmsnorm_forward(y.data(), rstd.data(), x.data(), w.data(), s.N, s.C);
    EXPECT_TRUE(kt::close(y, want, 1e-5, 2e-5));
    EXPECT_TRUE(kt::close(rstd, r, 1e-5, 1e-6));
  }
}

TEST(RMSNorm, BackwardMatchesFiniteDifferences) {
  const int64_t N = 5, C = 7;
  auto x = kt::randn(N * C, 41), w = kt::randn(C, 42), dout = kt::randn(N * C, 43);
  auto xd = kt::to_double(x), wd = kt::to_double(w), dd = kt::to_double(dout);
  std::vector<float> y(N * C), rstd(N);
  rmsnorm_forward(y.data(), rstd.data(), x.data(), w.data(), N, C);
  std::vector<float> dx(N * C, 0.0f), dw(C, 0.0f);
  rmsnorm_backward(dx.data(), dw.data(), dout.data(), x.data(), w.data(), rstd.data(), N, C);
  auto gx = kt::numgrad([&](const std::vector<double>& v) { return kt::dot(dd, ref_rmsnorm(v, wd, N, C)); }, xd);
  auto gw = kt::numgrad([&](const std::vector<double>& v) { return kt::dot(dd, ref_rmsnorm(xd, v, N, C)); }, wd);
  EXPECT_TRUE(kt::close(dx, gx, 1e-4, 1e-5));
  EXPECT_TRUE(kt::close(dw, gw, 1e-4, 1e-5));
}

TEST(RMSNorm, BackwardAccumulatesAndIsThreadCountIndependent) {
  const int64_t N = 200, C = 129;
  auto x = kt::randn(N * C, 51), w = kt::randn(C, 52), dout = kt::randn(N * C, 53);
  std::vector<float> y(N * C), rstd(N);
  rmsnorm_forward(y.data(), rstd.data(), x.data(), w.data(), N, C);
  auto run = [&](int threads, std::vector<float> dx, std::vector<float> dw) {
    kt::with_threads(threads, [&] {
      rmsnorm_backward(dx.data(), dw.data(), dout.data(), x.data(), w.data(), rstd.data(), N, C);
    });
    dx.insert(dx.end(), dw.begin(), dw.end());
    return dx;
  };
  auto z = run(1, std::vector<float>(N * C, 0.f), std::vector<float>(C, 0.f));
  auto g0x = kt::randn(N * C, 54), g0w = kt::randn(C, 55);
  auto a1 = run(1, g0x, g0w), a2 = run(2, g0x, g0w);
  EXPECT_TRUE(kt::bitwise_equal(a1, a2));
  std::vector<float> g0 = g0x;
  g0.insert(g0.end(), g0w.begin(), g0w.end());
  std::vector<double> want(g0.size());
  for (size_t i = 0; i < g0.size(); ++i) want[i] = double(g0[i]) + double(z[i]);
  EXPECT_TRUE(kt::close(a1, want, 1e-6, 1e-6));
}

}  // namespace
}  // namespace mt::kernels::cpu
