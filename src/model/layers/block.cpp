#include "model/layers/block.h"

#include <algorithm>

namespace mt {

BlockParams block_params(const ModelConfig& c, int64_t layer, int base, int64_t local_experts) {
  BlockParams p;
  const bool moe = c.is_moe_layer(layer);
  p.moe = moe;
  const bool shared = moe && c.moe_shared_experts > 0;
  if (c.arch == Arch::GPT2) {  // ln_1 w b, c_attn w b, attn c_proj w b, ln_2 w b, c_fc w b, mlp c_proj w b
    p.ln1_w = base, p.ln1_b = base + 1, p.qkv_w = base + 2, p.qkv_b = base + 3, p.proj_w = base + 4,
    p.proj_b = base + 5, p.ln2_w = base + 6, p.ln2_b = base + 7;
    int at = base + 8;
    if (moe) {  // router, experts, shared experts (c_fc w b, c_proj w b)
      p.router = at++;
      p.expert0 = at;
      at += static_cast<int>(local_experts) * 4;
    }
    if (!moe || shared) p.fc_w = at, p.fc_b = at + 1, p.down_w = at + 2, p.down_b = at + 3;
  } else {  // input_layernorm, q k v, o, post_attention_layernorm, gate, up, down (, q k v biases)
    p.ln1_w = base, p.qkv_w = base + 1, p.proj_w = base + 4, p.ln2_w = base + 5;
    int at = base + 6;
    if (moe) {  // router, experts (w1 w2 w3), shared experts (gate, up, down)
      p.router = at++;
      p.expert0 = at;
      at += static_cast<int>(local_experts) * 3;
    }
    if (!moe || shared) {
      p.fc_w = at, p.up_w = at + 1, p.down_w = at + 2;
      at += 3;
    }
    // Qwen 2's q, k, v biases (model.qkv_bias) follow, contiguous: one [QKV] bias, as the fused
    // q|k|v projection's output.
    if (c.qkv_bias) p.qkv_b = at;
  }
  return p;
}

void alloc_block_acts(BlockActivations& a, const ModelConfig& c, DType cd, int64_t BT, int64_t R, int64_t B,
                             int64_t nh, int64_t nkv, int64_t F, bool flash, bool gelu_bf16, bool res_bf16) {
  const int64_t C = c.n_embd, QKV = (nh + 2 * nkv) * c.head_dim();
  auto A = MemCategory::Activations;
  a.ln1 = Tensor::empty({R, C}, cd, A);
  a.ln1_rstd = Tensor::empty({R}, DType::F32, A);
  if (c.arch == Arch::GPT2) a.ln1_mean = Tensor::empty({R}, DType::F32, A);
  if (flash)
    a.qkv_bf = Tensor::empty({BT, QKV}, DType::BF16, A);
  else
    a.qkv = Tensor::empty({BT, QKV}, DType::F32, A);
  if (!flash) a.atty = Tensor::empty({BT, nh * c.head_dim()}, DType::F32, A);  // flash writes atty_bf only
  if (cd == DType::BF16) a.atty_bf = Tensor::empty({BT, nh * c.head_dim()}, DType::BF16, A);
  a.lse = Tensor::empty({B * nh * (BT / B)}, DType::F32, A);
  a.res2 = Tensor::empty({R, C}, res_bf16 ? DType::BF16 : DType::F32, A);
  a.ln2 = Tensor::empty({R, C}, cd, A);
  a.ln2_rstd = Tensor::empty({R}, DType::F32, A);
  if (c.arch == Arch::GPT2) a.ln2_mean = Tensor::empty({R}, DType::F32, A);
  if (F > 0) {  // the dense MLP, or an MoE layer's shared experts
    a.fc = Tensor::empty({BT, F}, gelu_bf16 ? DType::BF16 : DType::F32, A);
    if (c.arch == Arch::Llama) a.up = Tensor::empty({BT, F}, gelu_bf16 ? DType::BF16 : DType::F32, A);
    a.act = Tensor::empty({BT, F}, cd, A);
  }
}

void alloc_moe_acts(BlockActivations& a, const ModelConfig& c, DType cd, int64_t BT, int64_t M, int64_t Fe,
                    bool bf16_pre) {
  const int64_t C = c.n_embd, E = c.moe_experts, k = c.moe_top_k;
  auto A = MemCategory::Activations;
  if (!a.r_logits.defined()) {
    a.r_logits = Tensor::empty({BT, E}, DType::F32, A);
    a.r_scores = Tensor::empty({BT, E}, DType::F32, A);
    a.r_idx = Tensor::empty({BT, k}, DType::I32, A);
    a.r_w = Tensor::empty({BT, k}, DType::F32, A);
    a.r_lse = Tensor::empty({BT}, DType::F32, A);
    a.r_pos = Tensor::empty({BT, k}, DType::I32, A);
  }
  if (a.xs.defined() && a.xs.numel() >= M * C) return;
  M = std::max<int64_t>(M, 1);
  a.xs = Tensor::empty({M, C}, cd, A);
  const DType pre = bf16_pre ? DType::BF16 : DType::F32;
  a.h1 = Tensor::empty({M, Fe}, pre, A);
  if (c.arch == Arch::Llama) a.h3 = Tensor::empty({M, Fe}, pre, A);
  a.xact = Tensor::empty({M, Fe}, cd, A);
  a.y = Tensor::empty({M, C}, DType::F32, A);
  a.order = Tensor::empty({M}, DType::I32, A);
}

}  // namespace mt
