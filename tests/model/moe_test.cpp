// Mixture of experts on one rank against an independent fp64 reference written here: a one-block
// model whose attention output projection is zero (so the block is x + MoE(norm(x))), evaluated
// in double precision from the model's own weights, with the router (softmax or sigmoid top-k),
// routed and shared experts, capacity drops, the load-balancing loss and the z-loss. Gradients
// are checked against central finite differences of that reference objective.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>
#include <vector>

#include "model/rng.h"
#include "model/transformer.h"

namespace mt {
namespace {

std::vector<int32_t> tokens(int64_t n, int64_t vocab, uint64_t seed) {
  Rng r(seed);
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (auto& t : v) t = static_cast<int32_t>(r.next_u64() % static_cast<uint64_t>(vocab));
  return v;
}

struct Case {
  Arch arch;
  bool sigmoid;
  int64_t shared;
  float capacity;
};

// What a failing case prints for GetParam().
void PrintTo(const Case& k, std::ostream* os) {
  *os << arch_name(k.arch) << (k.sigmoid ? " sigmoid" : " softmax") << " router, " << k.shared
      << " shared, capacity factor " << k.capacity;
}

ModelConfig moe_config(const Case& k) {
  ModelConfig c = model_preset(k.arch == Arch::GPT2 ? "gpt2-tiny" : "llama-tiny");
  c.n_layer = 1;
  c.vocab_size = 61;
  c.padded_vocab = 0;
  c.moe_experts = 4;
  c.moe_top_k = 2;
  c.moe_ffn_hidden = 24;
  c.moe_shared_experts = k.shared;
  c.moe_sigmoid = k.sigmoid;
  c.moe_aux_loss_coef = 0.05f;
  c.moe_z_loss_coef = 0.01f;
  c.moe_capacity_factor = k.capacity;
  c.resolve();
  return c;
}

// The objective in double: mean cross-entropy + aux_coef * aux + z_coef * z, for a one-block model
// whose attention contributes nothing. Also returns the parts and the choices dropped.
struct RefOut {
  double ce = 0, aux = 0, z = 0, dropped = 0;
  double objective(const ModelConfig& c) const { return ce + c.moe_aux_loss_coef * aux + c.moe_z_loss_coef * z; }
};

RefOut reference(const Transformer& m, const std::vector<double>& w, const std::vector<int32_t>& ids,
                 const std::vector<int32_t>& tg, int64_t B, int64_t T) {
  const ModelConfig& c = m.config();
  const bool gpt = c.arch == Arch::GPT2;
  const int64_t N = B * T, C = c.n_embd, E = c.moe_experts, K = c.moe_top_k, F = c.expert_ffn(),
                Fs = c.moe_shared_experts * F, V = c.vocab_size;
  auto P = [&](const std::string& n) { return w.data() + m.param(n).offset; };
  const std::string pre = gpt ? "h.0." : "model.layers.0.";
  auto normf = [&](const double* x, const double* g, const double* b, double* out) {
    double mean = 0, var = 0;
    if (gpt) {
      for (int64_t i = 0; i < C; ++i) mean += x[i];
      mean /= C;
      for (int64_t i = 0; i < C; ++i) var += (x[i] - mean) * (x[i] - mean);
      var /= C;
    } else {
      for (int64_t i = 0; i < C; ++i) var += x[i] * x[i];
      var /= C;
    }
    const double r = 1.0 / std::sqrt(var + c.norm_eps);
    for (int64_t i = 0; i < C; ++i) out[i] = (x[i] - mean) * r * g[i] + (b ? b[i] : 0.0);
  };
  auto matvec = [&](const double* W, const double* x, int64_t out, int64_t in, double* y) {
    for (int64_t o = 0; o < out; ++o) {
      double s = 0;
      for (int64_t i = 0; i < in; ++i) s += W[o * in + i] * x[i];
      y[o] = s;
    }
  };
  auto gelu = [](double x) { return 0.5 * x * (1 + std::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x))); };
  auto silu = [](double x) { return x / (1 + std::exp(-x)); };
  // an MLP of width W with weights under prefix q (expert or shared), added to y with weight g
  auto mlp = [&](const std::string& q, int64_t W, const double* h, double g, double* y) {
    std::vector<double> a(static_cast<size_t>(W)), b(static_cast<size_t>(W)), o(static_cast<size_t>(C));
    if (gpt) {
      matvec(P(q + "c_fc.weight"), h, W, C, a.data());
      for (int64_t i = 0; i < W; ++i) a[i] = gelu(a[i] + P(q + "c_fc.bias")[i]);
      matvec(P(q + "c_proj.weight"), a.data(), C, W, o.data());
      for (int64_t i = 0; i < C; ++i) o[i] += P(q + "c_proj.bias")[i];
    } else {
      const bool sh = q.find("shared") != std::string::npos;
      matvec(P(q + (sh ? "gate_proj.weight" : "w1.weight")), h, W, C, a.data());
      matvec(P(q + (sh ? "up_proj.weight" : "w3.weight")), h, W, C, b.data());
      for (int64_t i = 0; i < W; ++i) a[i] = silu(a[i]) * b[i];
      matvec(P(q + (sh ? "down_proj.weight" : "w2.weight")), a.data(), C, W, o.data());
    }
    for (int64_t i = 0; i < C; ++i) y[i] += g * o[i];
  };
  const std::string moe = gpt ? pre + "mlp." : pre + "block_sparse_moe.";
  // embeddings, and the block input x (attention adds nothing)
  std::vector<double> x(static_cast<size_t>(N * C)), h(static_cast<size_t>(N * C));
  const double* wte = P(gpt ? "wte.weight" : "model.embed_tokens.weight");
  for (int64_t t = 0; t < N; ++t)
    for (int64_t i = 0; i < C; ++i)
      x[t * C + i] = wte[ids[t] * C + i] + (gpt ? P("wpe.weight")[(t % T) * C + i] : 0.0);
  for (int64_t t = 0; t < N; ++t)
    normf(&x[t * C], P(pre + (gpt ? "ln_2.weight" : "post_attention_layernorm.weight")), gpt ? P(pre + "ln_2.bias") : nullptr,
          &h[t * C]);
  // router
  RefOut r;
  std::vector<double> score(static_cast<size_t>(N * E)), q(static_cast<size_t>(N * E));
  std::vector<int> choice(static_cast<size_t>(N * K));
  std::vector<double> weight(static_cast<size_t>(N * K));
  std::vector<int64_t> count(static_cast<size_t>(E), 0);
  for (int64_t t = 0; t < N; ++t) {
    double lg[64];
    matvec(P(moe + "gate.weight"), &h[t * C], E, C, lg);
    double mx = *std::max_element(lg, lg + E), z = 0;
    for (int64_t e = 0; e < E; ++e) z += std::exp(lg[e] - mx);
    const double lse = mx + std::log(z);
    r.z += lse * lse / N;
    double tot = 0;
    for (int64_t e = 0; e < E; ++e) {
      score[t * E + e] = c.moe_sigmoid ? 1 / (1 + std::exp(-lg[e])) : std::exp(lg[e] - lse);
      tot += score[t * E + e];
    }
    for (int64_t e = 0; e < E; ++e) q[t * E + e] = score[t * E + e] / tot;
    std::vector<int> o(static_cast<size_t>(E));
    std::iota(o.begin(), o.end(), 0);
    std::stable_sort(o.begin(), o.end(), [&](int a, int b) { return score[t * E + a] > score[t * E + b]; });
    double S = 0;
    for (int64_t j = 0; j < K; ++j) S += score[t * E + o[j]];
    for (int64_t j = 0; j < K; ++j) {
      choice[t * K + j] = o[j];
      weight[t * K + j] = score[t * E + o[j]] / S;
      ++count[o[j]];
    }
  }
  for (int64_t e = 0; e < E; ++e) {
    double Pe = 0;
    for (int64_t t = 0; t < N; ++t) Pe += q[t * E + e] / N;
    r.aux += E * (static_cast<double>(count[e]) / (N * K)) * Pe;
  }
  const int64_t cap = c.moe_capacity_factor > 0 ? static_cast<int64_t>(std::ceil(c.moe_capacity_factor * N * K / double(E)))
                                                : N * K;
  std::vector<int64_t> fill(static_cast<size_t>(E), 0);
  // block output, final norm, head, cross-entropy
  const double* wh = P(gpt ? "wte.weight" : "lm_head.weight");
  for (int64_t t = 0; t < N; ++t) {
    std::vector<double> y(x.begin() + t * C, x.begin() + (t + 1) * C), f(static_cast<size_t>(C));
    for (int64_t j = 0; j < K; ++j) {
      const int e = choice[t * K + j];
      if (fill[e]++ >= cap) {
        ++r.dropped;
        continue;
      }
      mlp(moe + "experts." + std::to_string(e) + ".", F, &h[t * C], weight[t * K + j], y.data());
    }
    if (Fs > 0) mlp(moe + "shared_experts.", Fs, &h[t * C], 1.0, y.data());
    normf(y.data(), P(gpt ? "ln_f.weight" : "model.norm.weight"), gpt ? P("ln_f.bias") : nullptr, f.data());
    std::vector<double> lg(static_cast<size_t>(V));
    matvec(wh, f.data(), V, C, lg.data());
    const double mx = *std::max_element(lg.begin(), lg.end());
    double z = 0;
    for (double v : lg) z += std::exp(v - mx);
    r.ce += (mx + std::log(z) - lg[tg[t]]) / N;
  }
  return r;
}

bool attention_param(const std::string& n) {
  for (const char* s : {"attn.", "self_attn.", "ln_1.", "input_layernorm."})
    if (n.find(s) != std::string::npos) return true;
  return false;
}

class MoeReference : public ::testing::TestWithParam<Case> {};

TEST_P(MoeReference, LossAuxLossesAndGradientsMatchAnFp64Reference) {
  const Case k = GetParam();
  const ModelConfig c = moe_config(k);
  const int64_t B = 2, T = 8, N = B * T;
  Transformer m(c, DType::F32);
  m.init_weights(5);
  float* w = m.weights().f32();
  Rng rng(11);
  for (int64_t i = 0; i < m.flat_size(); ++i) w[i] += static_cast<float>(rng.normal() * 0.2);
  // Attention contributes nothing: its output projection (and bias) is zero.
  for (const auto& p : m.params())
    if (p.name.find("attn.c_proj") != std::string::npos || p.name.find("o_proj") != std::string::npos)
      std::fill(w + p.offset, w + p.offset + p.numel, 0.0f);
  for (const auto& p : m.params())  // padded vocabulary rows stay zero
    if (p.shape.size() == 2 && p.shape[0] == c.padded_vocab)
      std::fill(w + p.offset + c.vocab_size * p.shape[1], w + p.offset + p.numel, 0.0f);
  const auto x = tokens(N, c.vocab_size, 1), y = tokens(N, c.vocab_size, 2);
  m.zero_grads();
  const double ce = m.forward(x.data(), y.data(), B, T, true, 1.0f / static_cast<float>(N));
  m.backward();
  const Transformer::MoeStats st = m.take_moe_stats();
  std::vector<double> wd(w, w + m.flat_size());
  const RefOut ref = reference(m, wd, x, y, B, T);
  EXPECT_NEAR(ce, ref.ce, 2e-5);
  EXPECT_NEAR(st.aux_loss, ref.aux, 1e-5);
  EXPECT_NEAR(st.z_loss, ref.z, 1e-4 * std::max(1.0, ref.z));
  EXPECT_EQ(st.dropped, static_cast<int64_t>(ref.dropped));
  ASSERT_EQ(st.tokens.size(), 1u);
  EXPECT_EQ(std::accumulate(st.tokens[0].begin(), st.tokens[0].end(), int64_t{0}), N * c.moe_top_k);
  if (k.capacity == 0) EXPECT_EQ(st.dropped, 0);
  else EXPECT_GT(st.dropped, 0);  // the case is built so that the capacity bites
  // Gradients: one random direction per parameter tensor against central differences of the
  // reference objective (the model's backward includes the aux and z gradients).
  const float* g = m.grads().f32();
  int checked = 0;
  for (const auto& p : m.params()) {
    if (attention_param(p.name)) continue;
    std::vector<double> d(static_cast<size_t>(p.numel));
    for (int64_t i = 0; i < p.numel; ++i) {
      const bool pad = p.shape.size() == 2 && p.shape[0] == c.padded_vocab && i / p.shape[1] >= c.vocab_size;
      d[i] = pad ? 0.0 : rng.normal();
    }
    double dot = 0;
    for (int64_t i = 0; i < p.numel; ++i) dot += d[i] * g[p.offset + i];
    const double eps = 1e-5;
    std::vector<double> wp = wd, wm = wd;
    for (int64_t i = 0; i < p.numel; ++i) {
      wp[p.offset + i] += eps * d[i];
      wm[p.offset + i] -= eps * d[i];
    }
    const double fd = (reference(m, wp, x, y, B, T).objective(c) - reference(m, wm, x, y, B, T).objective(c)) / (2 * eps);
    EXPECT_NEAR(dot, fd, 2e-4 * std::max(1.0, std::fabs(fd))) << p.name;
    ++checked;
  }
  EXPECT_GE(checked, 8);
}

INSTANTIATE_TEST_SUITE_P(Moe, MoeReference,
                         ::testing::Values(Case{Arch::Llama, false, 0, 0.0f}, Case{Arch::Llama, true, 1, 0.0f},
                                           Case{Arch::GPT2, false, 1, 0.0f}, Case{Arch::GPT2, true, 0, 0.0f},
                                           Case{Arch::Llama, false, 1, 0.6f}),
                         [](const auto& i) {
                           const Case& k = i.param;
                           return std::string(k.arch == Arch::GPT2 ? "Gpt2" : "Llama") + (k.sigmoid ? "Sigmoid" : "Softmax") +
                                  (k.shared ? "Shared" : "") + (k.capacity > 0 ? "Capacity" : "Dropless");
                         });

TEST(Moe, HuggingFaceNamesFollowMixtral) {
  ModelConfig c = moe_config({Arch::Llama, false, 1, 0.0f});
  Transformer m(c, DType::F32);
  EXPECT_EQ(m.param("model.layers.0.block_sparse_moe.gate.weight").shape, (std::vector<int64_t>{4, c.n_embd}));
  EXPECT_EQ(m.param("model.layers.0.block_sparse_moe.experts.3.w1.weight").shape, (std::vector<int64_t>{24, c.n_embd}));
  EXPECT_EQ(m.param("model.layers.0.block_sparse_moe.experts.3.w2.weight").shape, (std::vector<int64_t>{c.n_embd, 24}));
  EXPECT_EQ(m.param("model.layers.0.block_sparse_moe.experts.0.w3.weight").shape, (std::vector<int64_t>{24, c.n_embd}));
  EXPECT_EQ(m.param("model.layers.0.block_sparse_moe.shared_experts.down_proj.weight").shape,
            (std::vector<int64_t>{c.n_embd, 24}));
  EXPECT_EQ(m.num_params(), c.num_params());
  EXPECT_LT(c.active_params(), c.num_params());
  EXPECT_EQ(c.num_params() - c.active_params(), 2 * c.expert_params());  // 4 experts, 2 active
}

// moe_every = 2: blocks 0 and 2 are MoE layers, 1 and 3 dense; recompute and bf16 still agree.
TEST(Moe, InterleavedLayersRecomputeAndBf16) {
  ModelConfig c = model_preset("llama-tiny");
  c.n_layer = 4;
  c.moe_experts = 4;
  c.moe_top_k = 2;
  c.moe_every = 2;
  c.moe_shared_experts = 1;
  c.resolve();
  const int64_t B = 2, T = 16;
  const auto x = tokens(B * T, c.vocab_size, 3), y = tokens(B * T, c.vocab_size, 4);
  Transformer a(c, DType::F32), r(c, DType::F32, Recompute::Full), h(c, DType::BF16);
  for (Transformer* t : {&a, &r, &h}) t->init_weights(9);
  EXPECT_NO_THROW(a.param("model.layers.2.block_sparse_moe.gate.weight"));
  EXPECT_NO_THROW(a.param("model.layers.1.mlp.gate_proj.weight"));
  EXPECT_THROW(a.param("model.layers.1.block_sparse_moe.gate.weight"), std::out_of_range);
  std::vector<double> loss;
  for (Transformer* t : {&a, &r, &h}) {
    t->zero_grads();
    loss.push_back(t->forward(x.data(), y.data(), B, T, true, 1.0f / (B * T)));
    t->backward();
  }
  const auto sa = a.take_moe_stats(), sr = r.take_moe_stats();
  EXPECT_EQ(sa.layers, (std::vector<int>{0, 2}));
  EXPECT_EQ(sa.tokens, sr.tokens);  // recomputed forwards are not counted twice
  EXPECT_DOUBLE_EQ(sa.aux_loss, sr.aux_loss);
  EXPECT_EQ(loss[0], loss[1]);
  for (int64_t i = 0; i < a.flat_size(); ++i) ASSERT_EQ(a.grads().f32()[i], r.grads().f32()[i]) << i;
  EXPECT_NEAR(loss[2], loss[0], 2e-2);
}

}  // namespace
}  // namespace mt
