// Whole-model checks: gradients against finite differences, initial loss, overfitting one batch,
// bf16 against fp32, determinism, recompute equivalence, memory accounting.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cpu/adamw.h"
#include "model/rng.h"
#include "model/transformer.h"
#include "runtime/memory.h"

namespace mt {

// What a failing ModelGrad case prints for GetParam() (found by argument-dependent lookup in mt).
static void PrintTo(Arch a, std::ostream* os) { *os << arch_name(a); }

namespace {

std::vector<int32_t> random_tokens(int64_t n, int64_t vocab, uint64_t seed) {
  Rng r(seed);
  std::vector<int32_t> v(n);
  for (auto& t : v) t = static_cast<int32_t>(r.next_u64() % static_cast<uint64_t>(vocab));
  return v;
}

ModelConfig tiny(Arch a) {
  ModelConfig c = model_preset(a == Arch::GPT2 ? "gpt2-tiny" : "llama-tiny");
  c.vocab_size = 61;  // odd vocabulary: exercises padding (padded to 64)
  c.padded_vocab = 0;
  c.resolve();
  return c;
}

// Loss of the model at its current weights, in double where it matters (sum of per-token losses).
double loss_at(Transformer& m, const std::vector<int32_t>& x, const std::vector<int32_t>& y, int64_t B, int64_t T) {
  return m.forward(x.data(), y.data(), B, T, false);
}

class ModelGrad : public ::testing::TestWithParam<Arch> {};

// Directional finite differences per parameter tensor: for a random direction d supported on one
// tensor, (L(w + eps d) - L(w - eps d)) / (2 eps) must equal <grad, d>. Checking one direction per
// tensor covers every tensor's gradient (a wrong gradient anywhere in a tensor changes <grad, d>).
void check_gradients(const ModelConfig& c) {
  const int64_t B = 2, T = 9;
  Transformer m(c, DType::F32);
  m.init_weights(7);
  // Larger weights than the 0.02 init so that every path has a sizeable gradient.
  float* w = m.weights().f32();
  Rng r(3);
  for (int64_t i = 0; i < m.flat_size(); ++i) w[i] += static_cast<float>(r.normal() * 0.1);
  auto x = random_tokens(B * T, c.vocab_size, 1), y = random_tokens(B * T, c.vocab_size, 2);
  m.zero_grads();
  m.forward(x.data(), y.data(), B, T, true, 1.0f / static_cast<float>(B * T));
  m.backward();
  std::vector<float> g(m.grads().f32(), m.grads().f32() + m.flat_size());
  int checked = 0;
  for (const auto& p : m.params()) {
    std::vector<double> d(p.numel);
    double dot = 0, nrm = 0;
    for (int64_t i = 0; i < p.numel; ++i) {
      bool pad_row = p.shape.size() == 2 && p.shape[0] == c.padded_vocab && i / p.shape[1] >= c.vocab_size;
      d[i] = pad_row ? 0.0 : r.normal();
      nrm += d[i] * d[i];
    }
    nrm = std::sqrt(nrm);
    for (int64_t i = 0; i < p.numel; ++i) {
      d[i] /= nrm;
      dot += d[i] * g[p.offset + i];
    }
    const double eps = 1e-2;
    std::vector<float> saved(w + p.offset, w + p.offset + p.numel);
    for (int64_t i = 0; i < p.numel; ++i) w[p.offset + i] = static_cast<float>(saved[i] + eps * d[i]);
    double lp = loss_at(m, x, y, B, T);
    for (int64_t i = 0; i < p.numel; ++i) w[p.offset + i] = static_cast<float>(saved[i] - eps * d[i]);
    double lm = loss_at(m, x, y, B, T);
    std::copy(saved.begin(), saved.end(), w + p.offset);
    double fd = (lp - lm) / (2 * eps);
    // float forward: loss noise ~1e-7 relative; eps 1e-2 -> FD noise ~1e-5 absolute, truncation O(eps^2).
    if (getenv("MT_DEBUG_FD")) printf("%-32s dot %.6e fd %.6e\n", p.name.c_str(), dot, fd);
    EXPECT_NEAR(dot, fd, 3e-3 * std::abs(fd) + 3e-5) << p.name;
    ++checked;
  }
  EXPECT_EQ(checked, static_cast<int>(m.params().size()));
}

TEST_P(ModelGrad, MatchesFiniteDifferences) { check_gradients(tiny(GetParam())); }

// Qwen 2's Llama block with q/k/v biases (model.qkv_bias): the biases' gradients too.
TEST(ModelGradQkvBias, MatchesFiniteDifferences) {
  ModelConfig c = tiny(Arch::Llama);
  c.qkv_bias = true;
  c.resolve();
  Transformer m(c, DType::F32);
  ASSERT_EQ(m.num_params(), c.num_params());
  int biases = 0;
  for (const auto& p : m.params()) biases += p.name.find("_proj.bias") != std::string::npos;
  EXPECT_EQ(biases, 3 * static_cast<int>(c.n_layer));
  check_gradients(c);
}

INSTANTIATE_TEST_SUITE_P(Archs, ModelGrad, ::testing::Values(Arch::GPT2, Arch::Llama),
                         [](const auto& i) { return std::string(arch_name(i.param)); });

TEST(Model, InitialLossIsLogVocab) {
  for (Arch a : {Arch::GPT2, Arch::Llama}) {
    ModelConfig c = model_preset(a == Arch::GPT2 ? "gpt2-mini" : "llama-mini");
    Transformer m(c, DType::F32);
    m.init_weights(1337);
    const int64_t B = 2, T = 64;
    auto x = random_tokens(B * T, c.vocab_size, 5), y = random_tokens(B * T, c.vocab_size, 6);
    double l = m.forward(x.data(), y.data(), B, T, false);
    EXPECT_NEAR(l, std::log(static_cast<double>(c.vocab_size)), 0.1) << arch_name(a);
  }
}

// Plain AdamW loop on one batch (the trainer adds clipping, schedules and data).
double overfit(Transformer& m, const std::vector<int32_t>& x, const std::vector<int32_t>& y, int64_t B, int64_t T,
               int steps, double lr) {
  std::vector<float> mom(m.flat_size(), 0.0f), var(m.flat_size(), 0.0f);
  double loss = 0;
  for (int s = 1; s <= steps; ++s) {
    m.zero_grads();
    loss = m.forward(x.data(), y.data(), B, T, true, 1.0f / static_cast<float>(B * T));
    m.backward();
    kernels::cpu::adamw_update(m.weights().f32(), m.grads().f32(), mom.data(), var.data(), m.flat_size(),
                          static_cast<float>(lr), 0.9f, 0.95f, 1e-8f, 0.0f, s);
    m.sync_compute_weights();
  }
  return loss;
}

TEST(Model, OverfitsOneBatch) {
  for (Arch a : {Arch::GPT2, Arch::Llama}) {
    ModelConfig c = tiny(a);
    Transformer m(c, DType::F32);
    m.init_weights(11);
    const int64_t B = 2, T = 16;
    auto x = random_tokens(B * T, c.vocab_size, 8), y = random_tokens(B * T, c.vocab_size, 9);
    double l = overfit(m, x, y, B, T, 150, 1e-2);
    EXPECT_LT(l, 0.05) << arch_name(a);
  }
}

TEST(Model, DeterministicBitForBit) {
  ModelConfig c = tiny(Arch::Llama);
  auto run = [&]() {
    Transformer m(c, DType::F32);
    m.init_weights(5);
    auto x = random_tokens(32, c.vocab_size, 1), y = random_tokens(32, c.vocab_size, 2);
    overfit(m, x, y, 2, 16, 5, 1e-3);
    return std::vector<float>(m.weights().f32(), m.weights().f32() + m.flat_size());
  };
  EXPECT_EQ(run(), run());
}

// Recomputing activations must give exactly the gradients of storing them.
TEST(Model, RecomputeGivesIdenticalGradients) {
  for (Arch a : {Arch::GPT2, Arch::Llama}) {
    ModelConfig c = tiny(a);
    c.n_layer = 4;
    auto x = random_tokens(32, c.vocab_size, 1), y = random_tokens(32, c.vocab_size, 2);
    std::vector<std::vector<float>> grads;
    std::vector<int64_t> act;
    for (Recompute r : {Recompute::None, Recompute::Full, Recompute::Selective}) {
      Transformer m(c, DType::F32, r);
      m.init_weights(5);
      m.zero_grads();
      m.forward(x.data(), y.data(), 2, 16, true, 1.0f / 32);
      act.push_back(m.activation_bytes());
      m.backward();
      grads.emplace_back(m.grads().f32(), m.grads().f32() + m.flat_size());
    }
    EXPECT_EQ(grads[0], grads[1]) << arch_name(a);
    EXPECT_EQ(grads[0], grads[2]) << arch_name(a);
    EXPECT_LT(act[1], act[2]);
    EXPECT_LT(act[2], act[0]);
  }
}

// The chunked LM head (ModelOptions::loss_chunk) computes the same losses and gradients as the whole-logits
// head - only the weight gradient's summation order differs - and holds no [tokens, vocab] logits:
// GPT-2 (tied) and Llama, fp32 and bf16, a chunk that does not divide the tokens, two accumulated
// micro-batches whose head gradients are added by the backward that follows each forward, and an
// eval forward in between.
TEST(Model, ChunkedHeadMatchesWholeLogits) {
  for (Arch a : {Arch::GPT2, Arch::Llama}) {
    for (DType dt : {DType::F32, DType::BF16}) {
      ModelConfig c = tiny(a);
      const int64_t B = 2, T = 16, N = B * T;
      auto x1 = random_tokens(N, c.vocab_size, 1), y1 = random_tokens(N, c.vocab_size, 2);
      auto x2 = random_tokens(N, c.vocab_size, 3), y2 = random_tokens(N, c.vocab_size, 4);
      std::vector<std::vector<float>> grads;
      std::vector<double> losses, evals;
      std::vector<int64_t> act;
      for (int64_t chunk : {int64_t{0}, int64_t{7}}) {
        Transformer m(c, ModelOptions{.compute = dt, .loss_chunk = chunk});
        m.init_weights(5);
        m.zero_grads();
        losses.push_back(m.forward(x1.data(), y1.data(), B, T, true, 1.0f / (2 * N)));
        m.backward();
        evals.push_back(m.forward(x2.data(), y2.data(), B, T, false));
        losses.push_back(m.forward(x2.data(), y2.data(), B, T, true, 1.0f / (2 * N)));
        m.backward();
        act.push_back(m.activation_bytes());
        grads.emplace_back(m.grads().f32(), m.grads().f32() + m.flat_size());
      }
      const std::string what = std::string(arch_name(a)) + (dt == DType::F32 ? " fp32" : " bf16");
      EXPECT_NEAR(losses[0], losses[2], 1e-6) << what;
      EXPECT_NEAR(losses[1], losses[3], 1e-6) << what;
      EXPECT_NEAR(evals[0], evals[1], 1e-6) << what;
      double maxd = 0, maxg = 0;
      for (size_t i = 0; i < grads[0].size(); ++i) {
        maxd = std::max(maxd, static_cast<double>(std::fabs(grads[0][i] - grads[1][i])));
        maxg = std::max(maxg, static_cast<double>(std::fabs(grads[0][i])));
      }
      EXPECT_LT(maxd, 1e-5 * maxg) << what << ": max gradient difference " << maxd << " of " << maxg;
      // The whole-logits head holds [N, padded vocab] fp32 logits; the chunked one N x C input gradients.
      EXPECT_EQ(act[0] - act[1], N * c.padded_vocab * 4 - N * c.n_embd * 4) << what;
    }
  }
}

// bf16 compute tracks fp32 training: same data, 50 AdamW steps, losses within a stated tolerance.
TEST(Model, Bf16TracksFp32Over50Steps) {
  ModelConfig c = model_preset("gpt2-tiny");
  const int64_t B = 4, T = 32;
  auto x = random_tokens(B * T, c.vocab_size, 21), y = random_tokens(B * T, c.vocab_size, 22);
  std::vector<double> l32, l16;
  for (DType dt : {DType::F32, DType::BF16}) {
    Transformer m(c, dt);
    m.init_weights(3);
    std::vector<float> mom(m.flat_size(), 0.0f), var(m.flat_size(), 0.0f);
    for (int s = 1; s <= 50; ++s) {
      m.zero_grads();
      double l = m.forward(x.data(), y.data(), B, T, true, 1.0f / static_cast<float>(B * T));
      (dt == DType::F32 ? l32 : l16).push_back(l);
      m.backward();
      kernels::cpu::adamw_update(m.weights().f32(), m.grads().f32(), mom.data(), var.data(), m.flat_size(), 3e-3f, 0.9f,
                            0.95f, 1e-8f, 0.0f, s);
      m.sync_compute_weights();
    }
  }
  // Tolerance: bf16 keeps 8 significant bits (relative rounding 2^-9 ~ 0.2%) in matmul inputs;
  // over 50 steps the loss curves must stay within 2% of each other (and both must fall).
  for (int s = 0; s < 50; ++s) EXPECT_NEAR(l16[s], l32[s], 0.02 * l32[s]) << "step " << s;
  EXPECT_LT(l32.back(), l32.front() - 1.0);
}

// Memory accounting: fp32 params and grads are exactly 4 bytes per parameter.
TEST(Model, MemoryCategoriesMatchArithmetic) {
  auto before = MemoryTracker::instance().stats().current;
  {
    ModelConfig c = model_preset("gpt2-mini");
    Transformer m(c, DType::F32);
    auto now = MemoryTracker::instance().stats().current;
    EXPECT_EQ(now[static_cast<int>(MemCategory::Params)] - before[static_cast<int>(MemCategory::Params)],
              4 * m.num_params());
    EXPECT_EQ(now[static_cast<int>(MemCategory::Grads)] - before[static_cast<int>(MemCategory::Grads)],
              4 * m.num_params());
    EXPECT_EQ(m.num_params(), c.num_params());
  }
  {
    ModelConfig c = model_preset("gpt2-mini");
    Transformer m(c, DType::BF16);
    auto now = MemoryTracker::instance().stats().current;
    EXPECT_EQ(now[static_cast<int>(MemCategory::Params)] - before[static_cast<int>(MemCategory::Params)],
              2 * m.num_params());  // the bf16 compute copy
    EXPECT_EQ(now[static_cast<int>(MemCategory::Optimizer)] - before[static_cast<int>(MemCategory::Optimizer)],
              4 * m.num_params());  // the fp32 master copy
  }
  auto after = MemoryTracker::instance().stats().current;
  EXPECT_EQ(after[static_cast<int>(MemCategory::Params)], before[static_cast<int>(MemCategory::Params)]);
}

TEST(Model, GPT2_124MParameterCount) {
  ModelConfig c = model_preset("gpt2-124m");
  // 124,475,904 with the vocabulary padded to 50304 (llm.c's figure); 124,439,808 at 50257.
  EXPECT_EQ(c.num_params(), 124475904);
}

TEST(Model, RejectsBadTokensAndLengths) {
  ModelConfig c = tiny(Arch::GPT2);
  Transformer m(c, DType::F32);
  m.init_weights(1);
  std::vector<int32_t> x(8, 1), y(8, 1);
  x[3] = 61;
  EXPECT_THROW(m.forward(x.data(), y.data(), 1, 8, false), std::out_of_range);
  std::vector<int32_t> big(2 * c.seq_len, 1);
  EXPECT_THROW(m.forward(big.data(), big.data(), 1, 2 * c.seq_len, false), std::invalid_argument);
}

// A hook that takes the tied embedding's lookup gradient over (UnitHooks::takes_sparse_grad) and
// asks for the head's weight-gradient rows as they are final (grad_ready_rows) - as data
// parallelism does - sees every vocabulary row reported once, in order and before the embedding
// unit finishes, and the lookup's ids and rows; adding those rows itself gives the gradient of a
// model without the hook. The chunked head reports its rows the same way.
class TakeLookupGrad : public UnitHooks {
 public:
  TakeLookupGrad(int64_t rows, int64_t C) : rows_(rows), C_(C) {}
  bool takes_sparse_grad(int param) override { return param == 0; }
  int64_t grad_ready_rows(int param) override { return param == 0 ? rows_ : 0; }
  void grad_ready(int param, int64_t r0, int64_t r1) override {
    EXPECT_EQ(param, 0);
    EXPECT_EQ(r0, next_row);
    EXPECT_FALSE(embedding_done);
    next_row = r1;
  }
  void sparse_grad(int param, const int32_t* i, const float* r, int64_t n) override {
    EXPECT_EQ(param, 0);
    ids.assign(i, i + n);
    rows.assign(r, r + n * C_);
  }
  void post_backward(int unit) override { embedding_done = embedding_done || unit == 0; }
  int64_t next_row = 0;
  bool embedding_done = false;
  std::vector<int32_t> ids;
  std::vector<float> rows;

 private:
  int64_t rows_, C_;
};

TEST(Model, HooksTakeTheTiedEmbeddingGradient) {
  ModelConfig c = tiny(Arch::GPT2);  // tied embeddings
  const int64_t B = 2, T = 8, N = B * T, C = c.n_embd;
  auto x = random_tokens(N, c.vocab_size, 11), y = random_tokens(N, c.vocab_size, 12);
  for (int64_t chunk : {int64_t{0}, int64_t{5}}) {
    std::vector<std::vector<float>> grads;
    for (bool hooked : {false, true}) {
      Transformer m(c, ModelOptions{.loss_chunk = chunk});
      TakeLookupGrad h(24, C);  // 24 rows at a time: the padded 64 rows in three runs
      ASSERT_TRUE(m.can_hand_sparse_grad());
      if (hooked) m.set_hooks(&h);
      m.init_weights(9);
      m.zero_grads();
      m.forward(x.data(), y.data(), B, T, true, 1.0f / N);
      m.backward();
      std::vector<float> g(m.grads().f32(), m.grads().f32() + m.flat_size());
      if (hooked) {
        EXPECT_EQ(h.next_row, c.padded_vocab) << "chunk " << chunk;
        ASSERT_EQ(h.ids, x) << "chunk " << chunk;
        m.kernels().embedding_backward(g.data() + m.params()[0].offset, h.rows.data(), h.ids.data(), N, C);
      }
      grads.push_back(std::move(g));
    }
    double maxd = 0, maxg = 0;
    for (size_t i = 0; i < grads[0].size(); ++i) {
      maxd = std::max(maxd, static_cast<double>(std::fabs(grads[0][i] - grads[1][i])));
      maxg = std::max(maxg, static_cast<double>(std::fabs(grads[0][i])));
    }
    EXPECT_LT(maxd, 1e-5 * maxg) << "chunk " << chunk << ": max gradient difference " << maxd << " of " << maxg;
  }
}

}  // namespace
}  // namespace mt

namespace mt {
namespace {

// Split backward (zero-bubble schedules) on one model: the weight gradients equal the unsplit
// backward's bit for bit; the layers' inputs that stay in the slot are held by reference (a fully
// recomputed model, whose inputs are scratch, holds more: copies of them); and a second step
// reuses the first step's held buffers (its activation peak grows no more than the unsplit one's).
TEST(Model, SplitBackwardHoldsSlotInputsByReferenceAndReusesItsBuffers) {
  const ModelConfig c = tiny(Arch::Llama);
  const int64_t B = 2, T = 8;
  const auto x = random_tokens(B * T, c.vocab_size, 11), y = random_tokens(B * T, c.vocab_size, 12);
  struct Run {
    std::vector<float> grads;
    int64_t held = 0, peak_growth = 0;
  };
  auto run = [&](Recompute rc, bool split) {
    Transformer m(c, DType::F32, rc);
    m.init_weights(5);
    const int hu = m.num_units() - 1;
    Run r;
    for (int step = 0; step < 2; ++step) {
      m.zero_grads();
      auto& mt = MemoryTracker::instance();
      const int64_t start = mt.stats().current[static_cast<int>(MemCategory::Activations)];
      mt.reset_peaks();
      m.forward(x.data(), y.data(), B, T, true, 1.0f / static_cast<float>(B * T));
      m.backward_units(0, hu, nullptr, nullptr, split);
      if (split) {
        r.held = m.deferred_bytes();
        m.backward_weights(0, hu);
      }
      r.peak_growth = mt.stats().peak[static_cast<int>(MemCategory::Activations)] - start;  // the last step's
    }
    r.grads.assign(m.grads().f32(), m.grads().f32() + m.flat_size());
    return r;
  };
  const Run plain = run(Recompute::None, false), split = run(Recompute::None, true);
  const Run plain_rc = run(Recompute::Full, false), split_rc = run(Recompute::Full, true);
  ASSERT_EQ(plain.grads.size(), split.grads.size());
  EXPECT_EQ(0, std::memcmp(plain.grads.data(), split.grads.data(), plain.grads.size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(plain_rc.grads.data(), split_rc.grads.data(), plain_rc.grads.size() * sizeof(float)));
  EXPECT_GT(split.held, 0);
  EXPECT_GT(split_rc.held, split.held) << "recomputed inputs are copied; the slot's own are referenced";
  EXPECT_EQ(split.peak_growth, plain.peak_growth) << "the second step reuses the held buffers";
  EXPECT_EQ(split_rc.peak_growth, plain_rc.peak_growth);
}

// backward_weights' callback brackets each unit's weight gradients, last unit first: the pipeline
// sends a tied embedding's head contribution right after the head's (its first) and waits for it
// right before the embedding's (its last). Inside the bracket of unit u the gradient of u changes,
// outside it not (Llama: untied, so the head's W adds to the head's own weight).
TEST(Model, BackwardWeightsCallsAroundEachUnitLastToFirst) {
  const ModelConfig c = tiny(Arch::Llama);
  const int64_t B = 2, T = 8;
  const auto x = random_tokens(B * T, c.vocab_size, 11), y = random_tokens(B * T, c.vocab_size, 12);
  Transformer m(c, DType::F32);
  m.init_weights(5);
  m.zero_grads();
  const int hu = m.num_units() - 1;
  m.forward(x.data(), y.data(), B, T, true, 1.0f / static_cast<float>(B * T));
  m.backward_units(0, hu, nullptr, nullptr, true);
  const float* g = m.grads().f32();
  auto unit_grad_sum = [&](int u) {
    double sum = 0;
    for (const ParamInfo& p : m.params())
      if (p.unit == u)
        for (int64_t i = 0; i < p.numel; ++i) sum += std::fabs(g[p.offset + i]);
    return sum;
  };
  std::vector<std::pair<int, bool>> calls;
  std::vector<double> sums(static_cast<size_t>(hu + 1));
  for (int u = 0; u <= hu; ++u) sums[static_cast<size_t>(u)] = unit_grad_sum(u);
  m.backward_weights(0, hu, [&](int u, bool after) {
    calls.emplace_back(u, after);
    for (int v = 0; v <= hu; ++v) {
      const double now = unit_grad_sum(v), was = sums[static_cast<size_t>(v)];
      if (after && v == u)
        EXPECT_NE(now, was) << "unit " << u << "'s weight gradients are computed inside its bracket";
      else
        EXPECT_EQ(now, was) << "unit " << v << " changed outside its bracket (at " << u << (after ? " after)" : " before)");
      sums[static_cast<size_t>(v)] = now;
    }
  });
  std::vector<std::pair<int, bool>> want;
  for (int u = hu; u >= 0; --u) want.insert(want.end(), {{u, false}, {u, true}});
  EXPECT_EQ(calls, want);
}

}  // namespace
}  // namespace mt
