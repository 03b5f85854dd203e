// Unpacked data (data.packing = false): a micro-batch of documents of different lengths, padded to a
// common length with untrained targets (-1), gives the summed loss and the parameter gradients of
// running every document alone at its own length - the padding neither trains nor reaches a
// document's tokens (it comes after them under the causal mask). GPT-2 and Llama positions.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "model/rng.h"
#include "model/transformer.h"

namespace mt {

static void PrintTo(Arch a, std::ostream* os) { *os << arch_name(a); }

namespace {

struct Sum {
  double loss_sum = 0;       // summed cross-entropy of the trained targets
  std::vector<float> grads;  // every parameter's gradient (loss gradient 1 per target)
};

Sum run(Transformer& m, const std::vector<int32_t>& x, const std::vector<int32_t>& y, int64_t B, int64_t T) {
  Sum s;
  m.zero_grads();
  s.loss_sum = m.forward(x.data(), y.data(), B, T, true, 1.0f) * static_cast<double>(B * T);
  m.backward();
  s.grads.assign(m.grads().f32(), m.grads().f32() + m.flat_size());
  return s;
}

// Worst |a - b| relative to max(1, max |b|).
double rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double d = 0, s = 1;
  for (size_t i = 0; i < a.size(); ++i) {
    d = std::max(d, std::fabs(static_cast<double>(a[i]) - b[i]));
    s = std::max(s, std::fabs(static_cast<double>(b[i])));
  }
  return d / s;
}

class PaddedBatch : public ::testing::TestWithParam<Arch> {};

TEST_P(PaddedBatch, EqualsEverySampleAloneAtItsLength) {
  ModelConfig c = model_preset(GetParam() == Arch::GPT2 ? "gpt2-tiny" : "llama-tiny");
  c.vocab_size = 61;
  c.seq_len = 32;
  c.padded_vocab = 0;
  c.resolve();
  Transformer m(c, DType::F32);
  m.init_weights(7);
  float* w = m.weights().f32();  // attention far from uniform
  Rng r(3);
  for (int64_t i = 0; i < m.flat_size(); ++i) w[i] += static_cast<float>(r.normal() * 0.1);

  const std::vector<int64_t> lens = {5, 13, 3};
  const int64_t B = static_cast<int64_t>(lens.size());
  std::vector<std::vector<int32_t>> xs, ys;
  for (int64_t len : lens) {
    xs.emplace_back();
    ys.emplace_back();
    for (int64_t i = 0; i < len; ++i) {
      xs.back().push_back(static_cast<int32_t>(r.next_u64() % 61));
      ys.back().push_back(static_cast<int32_t>(r.next_u64() % 61));
    }
  }
  // Every sample alone, its sums added.
  Sum alone;
  alone.grads.assign(static_cast<size_t>(m.flat_size()), 0.0f);
  for (size_t b = 0; b < lens.size(); ++b) {
    const Sum s = run(m, xs[b], ys[b], 1, lens[b]);
    alone.loss_sum += s.loss_sum;
    for (size_t i = 0; i < s.grads.size(); ++i) alone.grads[i] += s.grads[i];
  }
  // Padded to 16 (the longest, rounded up as data.pad_to_multiple does) and to the model's seq_len.
  for (int64_t L : {int64_t{16}, c.seq_len}) {
    std::vector<int32_t> x(static_cast<size_t>(B * L), 0), y(x.size(), -1);
    for (int64_t b = 0; b < B; ++b) {
      std::copy(xs[b].begin(), xs[b].end(), x.begin() + b * L);
      std::copy(ys[b].begin(), ys[b].end(), y.begin() + b * L);
    }
    SCOPED_TRACE("padded to " + std::to_string(L));
    const Sum padded = run(m, x, y, B, L);
    EXPECT_NEAR(padded.loss_sum, alone.loss_sum, 1e-4 * alone.loss_sum);
    EXPECT_LT(rel_diff(padded.grads, alone.grads), 1e-4);
    // The test can fail: padding that trained (target 0) changes both.
    std::vector<int32_t> y0 = y;
    std::replace(y0.begin(), y0.end(), -1, 0);
    const Sum trained_pad = run(m, x, y0, B, L);
    EXPECT_GT(trained_pad.loss_sum - alone.loss_sum, 1.0);
    EXPECT_GT(rel_diff(trained_pad.grads, alone.grads), 1e-2);
  }
}

INSTANTIATE_TEST_SUITE_P(Arch, PaddedBatch, ::testing::Values(Arch::GPT2, Arch::Llama),
                         [](const auto& i) { return std::string(arch_name(i.param)); });

}  // namespace
}  // namespace mt
