// Causal grouped-query attention and RoPE against double references; backward against central
// finite differences of the double reference.
#include "kernels/cpu/attention.h"

#include <gtest/gtest.h>

#include <cmath>

#include "kernels/backend.h"
#include "runtime/device.h"
#include "test_util.h"

namespace mt::kernels::cpu {
namespace {

struct Dims {
  int64_t B, T, nh, nkv, hd;
  int64_t ld() const { return (nh + 2 * nkv) * hd; }
  size_t qkv_size() const { return size_t(B * T * ld()); }
  size_t out_size() const { return size_t(B * T * nh * hd); }
};

// Straightforward causal softmax attention in double; optionally returns lse [B, nh, T].
std::vector<double> ref_attention(const std::vector<double>& qkv, const Dims& d,
                                  std::vector<double>* lse = nullptr) {
  const int64_t ld = d.ld(), grp = d.nh / d.nkv;
  const double sc = 1.0 / std::sqrt(double(d.hd));
  std::vector<double> out(d.out_size(), 0.0);
  if (lse) lse->assign(size_t(d.B * d.nh * d.T), 0.0);
  std::vector<double> s(size_t(d.T));
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t h = 0; h < d.nh; ++h) {
      const int64_t kh = d.nh + h / grp, vh = d.nh + d.nkv + h / grp;
      for (int64_t t = 0; t < d.T; ++t) {
        const double* q = &qkv[size_t((b * d.T + t) * ld + h * d.hd)];
        double m = -1e300;
        for (int64_t j = 0; j <= t; ++j) {
          const double* k = &qkv[size_t((b * d.T + j) * ld + kh * d.hd)];
          double dot = 0.0;
          for (int64_t i = 0; i < d.hd; ++i) dot += q[i] * k[i];
          s[j] = dot * sc;
          m = std::max(m, s[j]);
        }
        double z = 0.0;
        for (int64_t j = 0; j <= t; ++j) z += std::exp(s[j] - m);
        double* o = &out[size_t((b * d.T + t) * d.nh * d.hd + h * d.hd)];
        for (int64_t j = 0; j <= t; ++j) {
          const double p = std::exp(s[j] - m) / z;
          const double* v = &qkv[size_t((b * d.T + j) * ld + vh * d.hd)];
          for (int64_t i = 0; i < d.hd; ++i) o[i] += p * v[i];
        }
        if (lse) (*lse)[size_t((b * d.nh + h) * d.T + t)] = m + std::log(z);
      }
    }
  return out;
}

// `k`: the kernel table to run (default: this file's baseline variant, called directly).
void check_forward(const Dims& d, uint64_t seed, const KernelTable* k = nullptr) {
  auto qkv = kt::randn(d.qkv_size(), seed);
  std::vector<double> lse_ref;
  auto want = ref_attention(kt::to_double(qkv), d, &lse_ref);
  std::vector<float> out(d.out_size()), lse(size_t(d.B * d.nh * d.T));
  if (k)
    k->attention_forward(out.data(), lse.data(), qkv.data(), d.B, d.T, d.nh, d.nkv, d.hd, nullptr);
  else
    attention_forward(out.data(), lse.data(), qkv.data(), d.B, d.T, d.nh, d.nkv, d.hd);
  EXPECT_TRUE(kt::close(out, want, 1e-5, 1e-5)) << "T=" << d.T << " nh=" << d.nh << " nkv=" << d.nkv;
  EXPECT_TRUE(kt::close(lse, lse_ref, 1e-5, 1e-5));
}

TEST(Attention, ForwardMatchesReference) {
  check_forward({2, 9, 4, 2, 6}, 1);    // grouped-query
  check_forward({1, 7, 3, 3, 5}, 2);    // multi-head, odd head dim
  check_forward({2, 5, 4, 1, 8}, 3);    // multi-query
  check_forward({1, 1, 2, 1, 4}, 4);    // a single token
  check_forward({2, 130, 4, 2, 16}, 5); // several query blocks (block size 64)
}

// L = sum dout * attention(qkv); analytic gradient of every qkv element (or a random subset for
// the larger case) against central differences; tolerance rel 1e-4, abs 1e-5.
// `k`: the kernel table to run (default: this file's baseline variant, called directly).
void check_backward(const Dims& d, uint64_t seed, size_t subset, const KernelTable* k = nullptr) {
  auto qkv = kt::randn(d.qkv_size(), seed);
  auto dout = kt::randn(d.out_size(), seed + 100);
  std::vector<float> out(d.out_size()), lse(size_t(d.B * d.nh * d.T));
  std::vector<float> dqkv(d.qkv_size(), 0.0f);
  if (k) {
    k->attention_forward(out.data(), lse.data(), qkv.data(), d.B, d.T, d.nh, d.nkv, d.hd, nullptr);
    k->attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), d.B, d.T, d.nh, d.nkv,
                          d.hd, nullptr);
  } else {
    attention_forward(out.data(), lse.data(), qkv.data(), d.B, d.T, d.nh, d.nkv, d.hd);
    attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), d.B, d.T, d.nh, d.nkv, d.hd);
  }
  auto dd = kt::to_double(dout);
  std::vector<size_t> idx;
  if (subset) {
    std::mt19937_64 rng(seed);
    for (size_t i = 0; i < subset; ++i) idx.push_back(size_t(rng() % d.qkv_size()));
  }
  auto num = kt::numgrad([&](const std::vector<double>& v) { return kt::dot(dd, ref_attention(v, d)); },
                         kt::to_double(qkv), idx);
  if (subset) {
    std::vector<float> got;
    std::vector<double> want;
    for (size_t i : idx) {
      got.push_back(dqkv[i]);
      want.push_back(num[i]);
    }
    EXPECT_TRUE(kt::close(got, want, 1e-4, 1e-5)) << "T=" << d.T;
  } else {
    EXPECT_TRUE(kt::close(dqkv, num, 1e-4, 1e-5)) << "T=" << d.T << " nh=" << d.nh << " nkv=" << d.nkv;
  }
}

TEST(Attention, BackwardMatchesFiniteDifferences) {
  check_backward({2, 9, 4, 2, 6}, 11, 0);  // grouped-query, all 864 inputs
  check_backward({1, 7, 3, 3, 5}, 12, 0);  // multi-head
  check_backward({2, 5, 4, 1, 8}, 13, 0);  // multi-query
  check_backward({1, 70, 2, 1, 8}, 14, 120);  // two query blocks (subset of inputs)
}

// The variant this CPU runs (kernels::table: on AVX-512 CPUs the avx512 variant, whose small GEMMs
// are its own packed FMA loops with causal skipping) against the double reference and finite
// differences: whole 32-column panels (head dimension 32, the register transposes), partial ones,
// several query blocks, grouped-query.
TEST(Attention, DispatchedVariantMatchesReferenceAndFiniteDifferences) {
  const KernelTable& k = table(Device::CPU);
  check_forward({1, 100, 2, 2, 32}, 15, &k);
  check_forward({2, 130, 4, 2, 16}, 5, &k);
  check_forward({1, 7, 3, 3, 5}, 2, &k);
  check_backward({1, 100, 2, 2, 32}, 15, 400, &k);
  check_backward({1, 77, 4, 2, 16}, 16, 400, &k);
  check_backward({2, 9, 4, 2, 6}, 11, 0, &k);  // every input
}

TEST(Attention, GradientCheckRejectsWrongGradient) {
  // Dropping the scale from dK (a classic mistake) must be detected.
  const Dims d{1, 6, 2, 1, 4};
  auto qkv = kt::randn(d.qkv_size(), 21);
  auto dout = kt::randn(d.out_size(), 22);
  std::vector<float> out(d.out_size()), lse(size_t(d.nh * d.T));
  attention_forward(out.data(), lse.data(), qkv.data(), d.B, d.T, d.nh, d.nkv, d.hd);
  std::vector<float> dqkv(d.qkv_size(), 0.0f);
  attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), d.B, d.T, d.nh,
                     d.nkv, d.hd);
  auto dd = kt::to_double(dout);
  auto num = kt::numgrad([&](const std::vector<double>& v) { return kt::dot(dd, ref_attention(v, d)); },
                         kt::to_double(qkv));
  ASSERT_TRUE(kt::close(dqkv, num, 1e-4, 1e-5));
  for (int64_t t = 0; t < d.T; ++t)
    for (int64_t i = 0; i < d.hd; ++i) dqkv[size_t(t * d.ld() + d.nh * d.hd + i)] *= 2.0f;  // sqrt(hd)
  EXPECT_FALSE(kt::close(dqkv, num, 1e-4, 1e-5));
}

TEST(Attention, BackwardAccumulatesAndIsDeterministic) {
  for (Dims d : {Dims{2, 70, 4, 2, 8}, Dims{3, 33, 3, 3, 8}}) {
    auto qkv = kt::randn(d.qkv_size(), 31), dout = kt::randn(d.out_size(), 32);
    std::vector<float> out(d.out_size()), lse(size_t(d.B * d.nh * d.T));
    attention_forward(out.data(), lse.data(), qkv.data(), d.B, d.T, d.nh, d.nkv, d.hd);
    auto g0 = kt::randn(d.qkv_size(), 33);
    auto run = [&](int threads, std::vector<float> g) {
      kt::with_threads(threads, [&] {
        attention_backward(g.data(), dout.data(), qkv.data(), out.data(), lse.data(), d.B, d.T,
                           d.nh, d.nkv, d.hd);
      });
      return g;
    };
    auto z = run(2, std::vector<float>(d.qkv_size(), 0.0f));
    auto a2 = run(2, g0), b2 = run(2, g0), a1 = run(1, g0), a3 = run(3, g0);
    EXPECT_TRUE(kt::bitwise_equal(a2, b2));
    EXPECT_TRUE(kt::bitwise_equal(a2, a1));  // same result whatever the thread count
    EXPECT_TRUE(kt::bitwise_equal(a2, a3));
    std::vector<double> want(g0.size());
    for (size_t i = 0; i < g0.size(); ++i) want[i] = double(g0[i]) + double(z[i]);
    EXPECT_TRUE(kt::close(a2, want, 1e-6, 1e-6));
    // Forward is deterministic too.
    std::vector<float> out2(d.out_size()), lse2(lse.size());
    kt::with_threads(1, [&] {
      attention_forward(out2.data(), lse2.data(), qkv.data(), d.B, d.T, d.nh, d.nkv, d.hd);
    });
    EXPECT_TRUE(kt::bitwise_equal(out, out2));
    EXPECT_TRUE(kt::bitwise_equal(lse, lse2));
  }
}

TEST(Attention, RejectsBadHeadCounts) {
  std::vector<float> buf(1024);
  EXPECT_THROW(attention_forward(buf.data(), buf.data(), buf.data(), 1, 2, 3, 2, 4),
               std::invalid_argument);
  EXPECT_THROW(rope_forward(buf.data(), 1, 2, 2, 1, 5, 10000.0f), std::invalid_argument);
}

// ---- RoPE -----------------------------------------------------------------------------------

// Hugging Face rotate_half convention, angles in double.
std::vector<double> ref_rope(const std::vector<double>& qkv, const Dims& d, double theta) {
  std::vector<double> y = qkv;
  const int64_t half = d.hd / 2, ld = d.ld();
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t t = 0; t < d.T; ++t)
      for (int64_t h = 0; h < d.nh + d.nkv; ++h)
        for (int64_t i = 0; i < half; ++i) {
          const size_t base = size_t((b * d.T + t) * ld + h * d.hd);
          const double a = double(t) * std::pow(theta, -2.0 * double(i) / double(d.hd));
          const double x1 = qkv[base + i], x2 = qkv[base + i + half];
          y[base + i] = x1 * std::cos(a) - x2 * std::sin(a);
          y[base + i + half] = x2 * std::cos(a) + x1 * std::sin(a);
        }
  return y;
}

TEST(Rope, ForwardMatchesReferenceAndLeavesValuesAlone) {
  const Dims d{2, 9, 4, 2, 6};
  auto qkv = kt::randn(d.qkv_size(), 41);
  auto want = ref_rope(kt::to_double(qkv), d, 10000.0);
  auto x = qkv;
  rope_forward(x.data(), d.B, d.T, d.nh, d.nkv, d.hd, 10000.0f);
  EXPECT_TRUE(kt::close(x, want, 1e-5, 1e-6));
  for (int64_t r = 0; r < d.B * d.T; ++r)
    for (int64_t i = (d.nh + d.nkv) * d.hd; i < d.ld(); ++i)
      ASSERT_EQ(x[size_t(r * d.ld() + i)], qkv[size_t(r * d.ld() + i)]);
  // A longer table cached first must not change the result for a shorter sequence.
  Dims d2 = d;
  d2.T = 40;
  auto big = kt::randn(d2.qkv_size(), 42);
  rope_forward(big.data(), d2.B, d2.T, d2.nh, d2.nkv, d2.hd, 10000.0f);
  auto x2 = qkv;
  rope_forward(x2.data(), d.B, d.T, d.nh, d.nkv, d.hd, 10000.0f);
  EXPECT_TRUE(kt::bitwise_equal(x, x2));
  // Large positions: the angle is computed in double.
  Dims d3{1, 3000, 1, 1, 8};
  auto y3 = kt::randn(d3.qkv_size(), 43);
  auto want3 = ref_rope(kt::to_double(y3), d3, 500000.0);
  rope_forward(y3.data(), d3.B, d3.T, d3.nh, d3.nkv, d3.hd, 500000.0f);
  EXPECT_TRUE(kt::close(y3, want3, 1e-5, 1e-6));
}

TEST(Rope, BackwardIsInverseOfForwardAndMatchesFiniteDifferences) {
  const Dims d{2, 9, 4, 2, 6};
  auto qkv = kt::randn(d.qkv_size(), 51);
  auto x = qkv;
  rope_forward(x.data(), d.B, d.T, d.nh, d.nkv, d.hd, 10000.0f);
  rope_backward(x.data(), d.B, d.T, d.nh, d.nkv, d.hd, 10000.0f);
  EXPECT_TRUE(kt::close(x, kt::to_double(qkv), 1e-6, 1e-6));
  // rope_backward(dout) is the gradient of L = sum dout * rope(x).
  auto dout = kt::randn(d.qkv_size(), 52);
  auto g = dout;
  rope_backward(g.data(), d.B, d.T, d.nh, d.nkv, d.hd, 10000.0f);
  auto dd = kt::to_double(dout);
  auto num = kt::numgrad([&](const std::vector<double>& v) { return kt::dot(dd, ref_rope(v, d, 10000.0)); },
                         kt::to_double(qkv));
  EXPECT_TRUE(kt::close(g, num, 1e-4, 1e-5));
  // Sensitivity: applying the forward rotation instead is rejected.
  auto wrong = dout;
  rope_forward(wrong.data(), d.B, d.T, d.nh, d.nkv, d.hd, 10000.0f);
  EXPECT_FALSE(kt::close(wrong, num, 1e-4, 1e-5));
}

}  // namespace
}  // namespace mt::kernels::cpu
