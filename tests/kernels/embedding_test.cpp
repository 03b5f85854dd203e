// Token and position embeddings against double references and finite differences.
#include "kernels/cpu/embedding.h"

#include <gtest/gtest.h>

#include "test_util.h"

namespace mt::kernels::cpu {
namespace {

std::vector<double> ref_embed(const std::vector<double>& table, const std::vector<int32_t>& ids,
                              int64_t C) {
  std::vector<double> out;
  for (int32_t id : ids)
    for (int64_t c = 0; c < C; ++c) out.push_back(table[size_t(id * C + c)]);
  return out;
}

TEST(Embedding, ForwardCopiesRows) {
  const int64_t V = 11, C = 7;
  const std::vector<int32_t> ids = {3, 0, 10, 3, 5};
  auto table = kt::randn(V * C, 1);
  std::vector<float> out(ids.size() * C);
  embedding_forward(out.data(), ids.data(), table.data(), int64_t(ids.size()), C);
  EXPECT_TRUE(kt::close(out, ref_embed(kt::to_double(table), ids, C), 0.0, 0.0));
}

// L = sum dout * embed(table); repeated ids must add up. Tolerance rel 1e-5, abs 1e-6.
TEST(Embedding, BackwardMatchesFiniteDifferencesAndAccumulates) {
  const int64_t V = 11, C = 7;
  const std::vector<int32_t> ids = {3, 0, 10, 3, 5, 3};
  auto table = kt::randn(V * C, 2), dout = kt::randn(ids.size() * C, 3), g0 = kt::randn(V * C, 4);
  auto dt = g0;
  embedding_backward(dt.data(), dout.data(), ids.data(), int64_t(ids.size()), C);
  auto dd = kt::to_double(dout);
  auto num = kt::numgrad([&](const std::vector<double>& v) { return kt::dot(dd, ref_embed(v, ids, C)); },
                         kt::to_double(table));
  std::vector<double> want(num.size());
  for (size_t i = 0; i < num.size(); ++i) want[i] = double(g0[i]) + num[i];
  EXPECT_TRUE(kt::close(dt, want, 1e-5, 1e-6));
}

TEST(Embedding, BackwardIsThreadCountIndependent) {
  const int64_t V = 50, C = 384, N = 1024;  // many repeats of each id
  std::vector<int32_t> ids(N);
  std::mt19937 rng(5);
  for (auto& id : ids) id = int32_t(rng() % V);
  auto dout = kt::randn(N * C, 6), g0 = kt::randn(V * C, 7);
  auto run = [&](int threads) {
    auto g = g0;
    kt::with_threads(threads, [&] { embedding_backward(g.data(), dout.data(), ids.data(), N, C); });
    return g;
  };
  auto a1 = run(1), a2 = run(2), a3 = run(3);
  EXPECT_TRUE(kt::bitwise_equal(a1, a2));
  EXPECT_TRUE(kt::bitwise_equal(a1, a3));
}

TEST(PositionEmbedding, ForwardAndBackward) {
  const int64_t B = 3, T = 5, C = 7;
  auto x = kt::randn(B * T * C, 11), pos = kt::randn(T * C, 12);
  auto y = x;
  position_add_forward(y.data(), pos.data(), B, T, C);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t c = 0; c < C; ++c)
        ASSERT_EQ(y[size_t((b * T + t) * C + c)], x[size_t((b * T + t) * C + c)] + pos[size_t(t * C + c)]);
  // L = sum dout * (x + pos): dpos[t] = sum_b dout[b, t] (finite differences of the reference).
  auto dout = kt::randn(B * T * C, 13), g0 = kt::randn(T * C, 14);
  auto dp = g0;
  position_add_backward(dp.data(), dout.data(), B, T, C);
  auto dd = kt::to_double(dout);
  auto xd = kt::to_double(x);
  auto num = kt::numgrad([&](const std::vector<double>& p) {
    double s = 0.0;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < T; ++t)
        for (int64_t c = 0; c < C; ++c) {
          const size_t i = size_t((b * T + t) * C + c);
          s += dd[i] * (xd[i] + p[size_t(t * C + c)]);
        }
    return s;
  }, kt::to_double(pos));
  std::vector<double> want(num.size());
  for (size_t i = 0; i < num.size(); ++i) want[i] = double(g0[i]) + num[i];
  EXPECT_TRUE(kt::close(dp, want, 1e-5, 1e-6));
}

}  // namespace
}  // namespace mt::kernels::cpu
