// Context parallelism's block attention: a sequence cut into 2 x cp chunks, each "rank" holding
// chunks i and 2cp-1-i, attended block by block (the ring's order, log-sum-exp merge) gives the
// rows, the log-sum-exp and - with the key / value gradients of every block summed - the gradient of
// whole-sequence causal attention (attention_forward / attention_backward). Also the position-
// indexed RoPE and learned-position kernels against the plain ones.
#include "kernels/cpu/attention_block.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "kernels/cpu/attention.h"
#include "kernels/cpu/embedding.h"
#include "model/context_parallel.h"

namespace mt::kernels::cpu {
namespace {

std::vector<float> randv(size_t n, uint32_t seed) {
  std::mt19937 g(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

// Rows of the full [B, T, w] layout for rank r's local tokens ([B, T / cp, w]).
std::vector<float> take_rows(const std::vector<float>& full, int64_t B, int64_t T, int64_t w, int r, int cp) {
  const int64_t Tl = T / cp;
  const std::vector<int32_t> pos = cp_positions(r, cp, Tl);
  std::vector<float> out(static_cast<size_t>(B * Tl * w));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < Tl; ++t)
      for (int64_t i = 0; i < w; ++i) out[(b * Tl + t) * w + i] = full[(b * T + pos[t]) * w + i];
  return out;
}

// c: tokens per chunk (above 64 the kernels cut a chunk into several query tiles). docs: document
// masking, documents of `docs` tokens (row b's start where (t + 3b) % docs == 1): the blocks with
// the global document starts of the queries and the keys' chunk positions against
// attention_forward / attention_backward with doc_start.
void check_cp(int cp, int64_t nh, int64_t nkv, int64_t c = 4, int docs = 0) {
  const int64_t B = 2, T = 2 * c * cp, hd = 8, ld = (nh + 2 * nkv) * hd, KVW = 2 * nkv * hd, Tl = T / cp;
  const auto qkv = randv(static_cast<size_t>(B * T * ld), 1);
  const auto dout = randv(static_cast<size_t>(B * T * nh * hd), 2);
  std::vector<int32_t> ds(static_cast<size_t>(B * T));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0, start = 0; t < T; ++t) {
      if (docs && (t + 3 * b) % docs == 1) start = t;
      ds[b * T + t] = static_cast<int32_t>(start);
    }
  const int32_t* dsp = docs ? ds.data() : nullptr;
  std::vector<float> out(static_cast<size_t>(B * T * nh * hd)), lse(static_cast<size_t>(B * nh * T));
  attention_forward(out.data(), lse.data(), qkv.data(), B, T, nh, nkv, hd, dsp);
  std::vector<float> dqkv(qkv.size(), 0.0f);
  attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), B, T, nh, nkv, hd, dsp);

  // Every rank's local q|k|v and its key / value block.
  std::vector<std::vector<float>> lq(cp), lkv(cp), ldkv(cp, std::vector<float>(static_cast<size_t>(B * Tl * KVW), 0.0f));
  for (int r = 0; r < cp; ++r) {
    lq[r] = take_rows(qkv, B, T, ld, r, cp);
    lkv[r].resize(static_cast<size_t>(B * Tl * KVW));
    for (int64_t n = 0; n < B * Tl; ++n)
      for (int64_t j = 0; j < KVW; ++j) lkv[r][n * KVW + j] = lq[r][n * ld + nh * hd + j];
  }
  double max_out = 0, max_lse = 0, max_dq = 0;
  std::vector<std::vector<float>> ldq(cp);
  // Each rank's queries' document starts, and where rank src's two key chunks sit.
  auto local_docs = [&](int r) {
    const std::vector<int32_t> pos = cp_positions(r, cp, Tl);
    std::vector<int32_t> q(static_cast<size_t>(B * Tl));
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < Tl; ++t) q[b * Tl + t] = ds[b * T + pos[t]];
    return q;
  };
  auto key_start = [&](int src) {
    return std::vector<int32_t>{static_cast<int32_t>(src * c), static_cast<int32_t>((2 * cp - 1 - src) * c)};
  };
  for (int r = 0; r < cp; ++r) {
    std::vector<float> o(static_cast<size_t>(B * Tl * nh * hd)), l(static_cast<size_t>(B * nh * Tl));
    int8_t modes[4];
    const std::vector<int32_t> qd = local_docs(r);
    for (int s = 0; s < cp; ++s) {
      const int src = (r - s + cp) % cp;
      cp_block_modes(r, src, modes);
      const std::vector<int32_t> ks = key_start(src);
      attention_block_forward(o.data(), l.data(), lq[r].data(), lkv[src].data(), B, Tl, nh, nkv, hd, 2, modes, s == 0,
                              docs ? qd.data() : nullptr, ks.data());
    }
    const auto want_o = take_rows(out, B, T, nh * hd, r, cp);
    for (size_t i = 0; i < o.size(); ++i) max_out = std::max(max_out, double(std::abs(o[i] - want_o[i])));
    const std::vector<int32_t> pos = cp_positions(r, cp, Tl);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < nh; ++h)
        for (int64_t t = 0; t < Tl; ++t)
          max_lse = std::max(max_lse, double(std::abs(l[(b * nh + h) * Tl + t] - lse[(b * nh + h) * T + pos[t]])));
    const auto dl = take_rows(dout, B, T, nh * hd, r, cp);
    ldq[r].assign(lq[r].size(), 0.0f);
    for (int s = 0; s < cp; ++s) {
      const int src = (r - s + cp) % cp;
      cp_block_modes(r, src, modes);
      const std::vector<int32_t> ks = key_start(src);
      attention_block_backward(ldq[r].data(), ldkv[src].data(), dl.data(), lq[r].data(), lkv[src].data(), o.data(),
                               l.data(), B, Tl, nh, nkv, hd, 2, modes, docs ? qd.data() : nullptr, ks.data());
    }
  }
  for (int r = 0; r < cp; ++r) {
    add_columns(ldq[r].data(), ldkv[r].data(), B * Tl, ld, nh * hd, KVW);
    const auto want = take_rows(dqkv, B, T, ld, r, cp);
    for (size_t i = 0; i < want.size(); ++i) max_dq = std::max(max_dq, double(std::abs(ldq[r][i] - want[i])));
  }
  EXPECT_LT(max_out, 2e-6) << "cp " << cp << " docs " << docs;
  EXPECT_LT(max_lse, 2e-6) << "cp " << cp << " docs " << docs;
  EXPECT_LT(max_dq, 2e-5) << "cp " << cp << " docs " << docs;
}

TEST(AttentionBlock, RingOfBlocksEqualsCausalAttention) {
  check_cp(1, 2, 2);
  check_cp(2, 2, 2);
  check_cp(4, 2, 2);
  check_cp(3, 4, 2);  // grouped-query attention
  check_cp(4, 4, 1);
  check_cp(2, 4, 2, 100);  // two query tiles per chunk (64 + 36 rows)
}

// Document masking: documents shorter and longer than a chunk, so whole key chunks, parts of
// tiles and whole query tiles are cut off (the rows of a block that see none of its keys).
TEST(AttentionBlock, RingOfBlocksWithDocumentsEqualsDocumentMaskedAttention) {
  check_cp(1, 2, 2, 4, 3);
  check_cp(2, 2, 2, 4, 3);
  check_cp(2, 2, 2, 4, 11);
  check_cp(4, 2, 2, 4, 7);
  check_cp(3, 4, 2, 4, 5);  // grouped-query attention
  check_cp(4, 4, 1, 4, 13);
  check_cp(2, 4, 2, 100, 37);  // two query tiles per chunk
  check_cp(2, 4, 2, 100, 150);
}

TEST(AttentionBlock, PositionIndexedRopeAndPositionsMatchThePlainKernels) {
  const int64_t B = 2, T = 16, nh = 4, nkv = 2, hd = 8, ld = (nh + 2 * nkv) * hd, C = 8;
  const int cp = 2;
  const auto qkv = randv(static_cast<size_t>(B * T * ld), 3);
  auto full = qkv;
  rope_forward(full.data(), B, T, nh, nkv, hd, 10000.0f);
  for (int r = 0; r < cp; ++r) {
    auto loc = take_rows(qkv, B, T, ld, r, cp);
    const auto pos = cp_positions(r, cp, T / cp);
    rope_forward_pos(loc.data(), B, T / cp, nh, nkv, hd, 10000.0f, nullptr, pos.data());
    const auto want = take_rows(full, B, T, ld, r, cp);
    for (size_t i = 0; i < loc.size(); ++i) ASSERT_EQ(loc[i], want[i]) << i;
    rope_backward_pos(loc.data(), B, T / cp, nh, nkv, hd, 10000.0f, nullptr, pos.data());
    const auto orig = take_rows(qkv, B, T, ld, r, cp);
    for (size_t i = 0; i < loc.size(); ++i) ASSERT_NEAR(loc[i], orig[i], 1e-5) << i;
  }
  // Learned positions: the rows each rank adds, and the table gradient summed over ranks.
  const auto table = randv(static_cast<size_t>(T * C), 4);
  const auto x = randv(static_cast<size_t>(B * T * C), 5);
  auto xf = x;
  position_add_forward(xf.data(), table.data(), B, T, C);
  std::vector<float> dfull(table.size(), 0.0f), dsum(table.size(), 0.0f);
  position_add_backward(dfull.data(), x.data(), B, T, C);
  for (int r = 0; r < cp; ++r) {
    auto loc = take_rows(x, B, T, C, r, cp);
    const auto pos = cp_positions(r, cp, T / cp);
    position_backward_pos(dsum.data(), loc.data(), pos.data(), B, T / cp, C);
    position_add_pos(loc.data(), table.data(), pos.data(), B * T / cp, T / cp, 0, C);
    const auto want = take_rows(xf, B, T, C, r, cp);
    for (size_t i = 0; i < loc.size(); ++i) ASSERT_EQ(loc[i], want[i]) << i;
  }
  for (size_t i = 0; i < dsum.size(); ++i) ASSERT_NEAR(dsum[i], dfull[i], 1e-6) << i;
}

}  // namespace
}  // namespace mt::kernels::cpu
