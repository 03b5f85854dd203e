// LoRA adapters against an independent reference: the same model with every adapted weight merged
// (W + scale B A, computed here in double) and no adapters. Its loss must equal the LoRA model's,
// and the LoRA model's adapter gradients must equal what the chain rule makes of the merged
// model's weight gradient G (for y = x (W + s B A)^T: dB = s G A^T, dA = s B^T G). Frozen base
// parameters must get no gradient, and initialisation must leave the base as without LoRA.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "model/rng.h"
#include "model/tp_layers.h"
#include "model/transformer.h"

namespace mt {
namespace {

struct LoraCase {
  const char* name;
  Arch arch;
  const char* targets;
  DType dtype;
};
void PrintTo(const LoraCase& c, std::ostream* os) { *os << c.name; }

ModelConfig lora_config(const LoraCase& c, int64_t rank) {
  ModelConfig m = model_preset(c.arch == Arch::GPT2 ? "gpt2-tiny" : "llama-tiny");
  m.vocab_size = 61;
  m.padded_vocab = 0;
  m.lora_rank = rank;
  m.lora_alpha = 3.0f * static_cast<float>(rank);  // scale 3
  m.lora_targets = rank > 0 ? parse_lora_targets(c.targets, c.arch) : 0;
  m.resolve();
  return m;
}

std::vector<int32_t> tokens(int64_t n, int64_t vocab, uint64_t seed) {
  Rng r(seed);
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (auto& t : v) t = static_cast<int32_t>(r.next_u64() % static_cast<uint64_t>(vocab));
  return v;
}

class Lora : public ::testing::TestWithParam<LoraCase> {};

TEST_P(Lora, EqualsTheMergedModelAndItsGradient) {
  const LoraCase& c = GetParam();
  const ModelConfig lc = lora_config(c, 2), bc = lora_config(c, 0);
  const float s = lc.lora_scale();
  Transformer lm(lc, c.dtype), bm(bc, c.dtype);
  lm.init_weights(5);
  // B starts at zero (the adapted model starts as the base); random B and larger weights give
  // every path a sizeable gradient.
  float* w = lm.weights().f32();
  Rng r(11);
  for (int64_t i = 0; i < lm.flat_size(); ++i) w[i] += static_cast<float>(r.normal() * 0.1);
  lm.sync_compute_weights();
  // The merged model: every base parameter by name, each adapter's s B A added in double.
  float* bw = bm.weights().f32();
  for (const ParamInfo& p : bm.params()) {
    const ParamInfo& q = lm.param(p.name);
    for (int64_t i = 0; i < p.numel; ++i) bw[p.offset + i] = w[q.offset + i];
  }
  int adapters = 0;
  for (const ParamInfo& a : lm.params()) {
    if (a.lora_kind != 'A') continue;
    ++adapters;
    const ParamInfo& b = lm.params()[static_cast<size_t>(&a - lm.params().data()) + 1];
    const ParamInfo& base = bm.param(lm.params()[static_cast<size_t>(a.lora_base)].name);
    const int64_t rk = a.shape[0], in = a.shape[1];
    ASSERT_EQ(b.lora_kind, 'B');
    ASSERT_EQ(base.numel / base.shape[0], in);
    for (int64_t o = 0; o < a.lora_rows; ++o)
      for (int64_t i = 0; i < in; ++i) {
        double d = 0;
        for (int64_t k = 0; k < rk; ++k)
          d += static_cast<double>(w[b.offset + o * rk + k]) * static_cast<double>(w[a.offset + k * in + i]);
        float& t = bw[base.offset + (a.lora_row0 + o) * in + i];
        t = static_cast<float>(static_cast<double>(t) + s * d);
      }
  }
  ASSERT_GT(adapters, 0);
  bm.sync_compute_weights();

  const int64_t B = 2, T = 9;
  const auto x = tokens(B * T, lc.vocab_size, 1), y = tokens(B * T, lc.vocab_size, 2);
  lm.zero_grads();
  bm.zero_grads();
  const double ll = lm.forward(x.data(), y.data(), B, T, true, 1.0f / static_cast<float>(B * T));
  lm.backward();
  const double lb = bm.forward(x.data(), y.data(), B, T, true, 1.0f / static_cast<float>(B * T));
  bm.backward();
  const bool bf = c.dtype == DType::BF16;
  EXPECT_NEAR(ll, lb, bf ? 2e-2 : 2e-6) << "loss with adapters vs merged weights";

  const float* g = lm.grads().f32();
  const float* gb = bm.grads().f32();
  for (const ParamInfo& p : lm.params()) {
    if (p.lora_kind) continue;
    double mx = 0;
    for (int64_t i = 0; i < p.numel; ++i) mx = std::max(mx, std::abs(static_cast<double>(g[p.offset + i])));
    EXPECT_EQ(mx, 0.0) << p.name << ": a frozen parameter got a gradient";
  }
  for (const ParamInfo& a : lm.params()) {
    if (a.lora_kind != 'A') continue;
    const ParamInfo& b = lm.params()[static_cast<size_t>(&a - lm.params().data()) + 1];
    const ParamInfo& base = bm.param(lm.params()[static_cast<size_t>(a.lora_base)].name);
    const int64_t rk = a.shape[0], in = a.shape[1], rows = a.lora_rows;
    auto G = [&](int64_t o, int64_t i) { return static_cast<double>(gb[base.offset + (a.lora_row0 + o) * in + i]); };
    double worst = 0, scale = 0;
    for (int64_t k = 0; k < rk; ++k)  // dA[k, i] = s sum_o B[o, k] G[o, i]
      for (int64_t i = 0; i < in; ++i) {
        double ref = 0;
        for (int64_t o = 0; o < rows; ++o) ref += static_cast<double>(w[b.offset + o * rk + k]) * G(o, i);
        ref *= s;
        worst = std::max(worst, std::abs(ref - static_cast<double>(g[a.offset + k * in + i])));
        scale = std::max(scale, std::abs(ref));
      }
    for (int64_t o = 0; o < rows; ++o)  // dB[o, k] = s sum_i G[o, i] A[k, i]
      for (int64_t k = 0; k < rk; ++k) {
        double ref = 0;
        for (int64_t i = 0; i < in; ++i) ref += G(o, i) * static_cast<double>(w[a.offset + k * in + i]);
        ref *= s;
        worst = std::max(worst, std::abs(ref - static_cast<double>(g[b.offset + o * rk + k])));
        scale = std::max(scale, std::abs(ref));
      }
    EXPECT_GT(scale, 1e-6) << a.name << ": no gradient reached the adapter";
    EXPECT_LE(worst, (bf ? 5e-2 : 2e-4) * scale + 1e-7) << a.name << " and its B: adapter gradients vs s B^T G, s G A^T";
  }
}

TEST_P(Lora, InitialisesAsPeftAndLeavesTheBaseAsWithout) {
  const LoraCase& c = GetParam();
  Transformer lm(lora_config(c, 4), DType::F32), bm(lora_config(c, 0), DType::F32);
  lm.init_weights(9);
  bm.init_weights(9);
  const float* w = lm.weights().f32();
  const float* wb = bm.weights().f32();
  for (const ParamInfo& p : bm.params()) {
    const ParamInfo& q = lm.param(p.name);
    for (int64_t i = 0; i < p.numel; ++i) ASSERT_EQ(wb[p.offset + i], w[q.offset + i]) << p.name;
  }
  for (const ParamInfo& p : lm.params()) {
    if (!p.lora_kind) continue;
    EXPECT_TRUE(p.trainable);
    double mx = 0;
    for (int64_t i = 0; i < p.numel; ++i) mx = std::max(mx, std::abs(static_cast<double>(w[p.offset + i])));
    if (p.lora_kind == 'B') {
      EXPECT_EQ(mx, 0.0) << p.name << ": B starts at zero";
    } else {  // Kaiming-uniform with a = sqrt(5): U(-1/sqrt(in), 1/sqrt(in))
      const double bound = 1.0 / std::sqrt(static_cast<double>(p.shape[1]));
      EXPECT_LE(mx, bound) << p.name;
      EXPECT_GT(mx, 0.5 * bound) << p.name;
    }
  }
  EXPECT_EQ(lm.num_params(), lora_config(c, 4).num_params()) << "ModelConfig counts the adapters as the model holds them";
}

INSTANTIATE_TEST_SUITE_P(
    Targets, Lora,
    ::testing::Values(LoraCase{"llama_all", Arch::Llama, "q,k,v,o,gate,up,down", DType::F32},
                      LoraCase{"llama_qv_bf16", Arch::Llama, "q,v", DType::BF16},
                      LoraCase{"gpt2_c_attn_o_up_down", Arch::GPT2, "c_attn,o,up,down", DType::F32},
                      LoraCase{"gpt2_qkv_parts", Arch::GPT2, "q,k,v,mlp.c_proj", DType::F32}),
    [](const ::testing::TestParamInfo<LoraCase>& i) { return std::string(i.param.name); });

TEST(LoraConfig, TargetsAreCheckedWithOneMessage) {
  EXPECT_EQ(parse_lora_targets("q, v", Arch::Llama), static_cast<uint32_t>(kLoraQ | kLoraV));
  EXPECT_EQ(parse_lora_targets("c_fc,attn.c_proj", Arch::GPT2), static_cast<uint32_t>(kLoraUp | kLoraO));
  EXPECT_THROW(parse_lora_targets("gate", Arch::GPT2), std::invalid_argument);
  EXPECT_THROW(parse_lora_targets("c_attn", Arch::Llama), std::invalid_argument);
  EXPECT_THROW(parse_lora_targets("q_proj", Arch::Llama), std::invalid_argument);
  ModelConfig m = model_preset("gpt2-tiny");
  m.lora_rank = 2;
  m.lora_targets = kLoraQkv | kLoraQ;
  EXPECT_THROW(m.resolve(), std::invalid_argument);
}

// Adapter dropout as PEFT applies it: on the adapter's input only, each element kept with
// probability 1 - p and then scaled by 1 / (1 - p). With W = 0 and A = B = I (scale 1) the layer's
// output is the dropped-out input itself: every y / x is 0 or 1 / (1 - p), about p of them 0; the
// backward passes dy through the same mask; the mask is a function of its key, sample and column
// (the same again for the same ones, another for another sample or key).
TEST(LoraDropout, DropsTheAdapterInputAsPeftAndBackwardUsesTheSameMask) {
  constexpr int64_t N = 64, R = 16;  // tokens (4 samples of 16), width = rank
  const float p = 0.25f;
  std::vector<float> W(R * R, 0.0f), I(R * R, 0.0f), x(N * R), dy(N * R);
  for (int64_t i = 0; i < R; ++i) I[static_cast<size_t>(i * R + i)] = 1.0f;
  Rng rng(7);
  for (auto& v : x) v = 1.0f + static_cast<float>(rng.uniform());  // never 0
  for (auto& v : dy) v = 1.0f + static_cast<float>(rng.uniform());
  const Linear lin{&kernels::table(Device::CPU), DType::F32};
  auto run = [&](uint64_t key, int64_t sample0, std::vector<float>* dx) {
    LoraPart a;
    a.af = I.data();
    a.bf = I.data();
    a.rank = R;
    a.rows = R;
    a.dropout = p;
    a.dropout_key = key;
    a.T = 16;
    a.sample0 = sample0;
    std::vector<float> dA(R * R, 0.0f), dB(R * R, 0.0f);
    a.da = dA.data();
    a.db = dB.data();
    Weight w;
    w.wf = W.data();
    w.out = R;
    w.lora = &a;
    w.nlora = 1;
    Tensor xt = Tensor::empty({N, R}, DType::F32, MemCategory::Workspace);
    std::copy(x.begin(), x.end(), xt.f32());
    std::vector<float> y(N * R, 0.0f);
    lin.forward(y.data(), xt, w, nullptr, N, R);
    if (dx) {
      dx->assign(N * R, 0.0f);
      lin.backward(dx->data(), nullptr, nullptr, dy.data(), xt, w, N, R);
    }
    for (int64_t k = 0; k < N * R; ++k) y[static_cast<size_t>(k)] /= x[static_cast<size_t>(k)];
    return y;
  };
  std::vector<float> dx;
  const std::vector<float> m = run(11, 0, &dx);
  int dropped = 0;
  for (int64_t k = 0; k < N * R; ++k) {
    const float v = m[static_cast<size_t>(k)];
    if (v == 0.0f) ++dropped;
    else ASSERT_NEAR(v, 1.0f / (1.0f - p), 1e-6) << k;
    // dx = dy masked and scaled the same way
    ASSERT_NEAR(dx[static_cast<size_t>(k)], dy[static_cast<size_t>(k)] * v, 1e-5) << k;
  }
  const double frac = static_cast<double>(dropped) / (N * R);
  EXPECT_NEAR(frac, p, 0.06) << "dropped fraction";  // 1024 draws: sd 0.014
  EXPECT_EQ(run(11, 0, nullptr), m) << "the same key and samples draw the same mask";
  EXPECT_NE(run(12, 0, nullptr), m) << "another key (micro-batch, adapter, seed) draws another mask";
  // Samples 4.. of a batch starting at sample 4 are not samples 0..3 again.
  EXPECT_NE(run(11, 4, nullptr), m);
}

}  // namespace
}  // namespace mt
