// What the layers of one transformer block share: the block's parameters by index, what its
// forward saves for its backward, and how a layer reaches the model's parameters (LayerParams).
#pragma once
#include <cstdint>
#include <vector>

#include "model/config/model_config.h"
#include "model/tp_layers.h"
#include "runtime/tensor.h"

namespace mt {

// Everything one block saves in forward for its backward. Matmul inputs are kept in the compute
// dtype only (bf16 in mixed precision); what elementwise backward passes need stays fp32.
struct BlockActivations {
  Tensor ln1, ln1_mean, ln1_rstd;  // ln1: f32 or bf16
  Tensor qkv;                       // f32 [N, QKV] (after RoPE for Llama)
  Tensor qkv_bf;                    // flash attention: the same in bf16 instead (qkv undefined)
  Tensor atty, atty_bf, lse;        // attention output f32 (+ bf16 copy; flash: bf16 only), lse [B, nh, T]
  Tensor res2;                      // residual after attention [N, C]: f32, or bf16 with a bf16 residual stream
  Tensor ln2, ln2_mean, ln2_rstd;
  Tensor fc;                        // GPT-2: pre-GELU [N, F] (bf16 with the fused GELU epilogue); Llama: gate [N, F] (MoE: the shared experts')
  Tensor up;                        // Llama: up [N, F] (bf16 with the fused MLP)
  Tensor act;                       // GELU / SwiGLU output, matmul input [N, F] (compute dtype)
  // MoE layer: the router's logits, scores, chosen experts (int32), weights, logsumexp and each
  // choice's row among the routed rows (int32, -1 = dropped); the routed rows (sorted by expert:
  // input in the compute dtype, pre-activations, activation, output) and each row's token.
  Tensor r_logits, r_scores, r_idx, r_w, r_lse, r_pos;
  Tensor xs, h1, h3, xact, y, order;
  // Expert parallelism: the rows this rank sent, by destination rank, and received, by source; the
  // inverse of `order` (the received rows' positions in expert order); the outputs returned to
  // this rank's tokens, in the order their rows were sent.
  std::vector<int64_t> send_rows, recv_rows;
  Tensor inv, ysend;
  int64_t Msend = 0;
  std::vector<int64_t> counts;      // choices per expert, all experts, before any capacity drop (host)
  std::vector<int64_t> counts_all;  // the same over the whole micro-batch (summed over the cp ranks)
  std::vector<int64_t> kept;        // routed rows per local expert (host)
  int64_t M = 0;                    // routed rows in use
  float dloss = 0.0f;               // the loss-gradient scale of the forward that filled this set
  int64_t bytes() const {
    int64_t b = 0;
    for (const Tensor* t : {&ln1, &ln1_mean, &ln1_rstd, &qkv, &qkv_bf, &atty, &atty_bf, &lse, &res2, &ln2, &ln2_mean,
                            &ln2_rstd, &fc, &up, &act, &r_logits, &r_scores, &r_idx, &r_w, &r_lse, &r_pos, &xs, &h1,
                            &h3, &xact, &y, &order, &inv, &ysend})
      if (t->defined()) b += static_cast<int64_t>(t->nbytes());
    return b;
  }
};

// One block's parameters by name: their indices in params_ (this tp rank's shares), -1 where the
// architecture has none. GPT-2: LayerNorms with biases, the fused qkv and the MLP with biases;
// Llama: RMSNorms, q | k | v contiguous (used as one [QKV, C] matrix), gate (`fc`) / up / down
// without biases. Resolved once from the registration order of build_params.
struct BlockParams {
  int ln1_w = -1, ln1_b = -1, qkv_w = -1, qkv_b = -1, proj_w = -1, proj_b = -1;
  int ln2_w = -1, ln2_b = -1, fc_w = -1, fc_b = -1, up_w = -1, down_w = -1, down_b = -1;
  // MoE layer: the router, the first routed expert's first parameter (experts follow one another,
  // kExpertParams each) and the shared experts (fc_w.. as for a dense MLP; -1 without).
  int router = -1, expert0 = -1;
  bool moe = false;
};

// Parameters per routed expert: Llama w1 (gate), w2 (down), w3 (up); GPT-2 c_fc w b, c_proj w b.
inline int expert_stride(const ModelConfig& c) { return c.arch == Arch::GPT2 ? 4 : 3; }
// The parameter indices of block `layer`, whose first parameter is `base`.
// `local_experts`: the routed experts this rank's block holds (all of them without expert parallelism).
BlockParams block_params(const ModelConfig& c, int64_t layer, int base, int64_t local_experts);

// A block's saved activations for B sequences of BT / B tokens (allocated once per shape):
// nh, nkv, F: this tp rank's heads and MLP width (the dense MLP's, or an MoE layer's shared
// experts'); R: rows of the residual stream this rank holds (BT, or BT / tp with sequence
// parallelism): the norms' inputs, outputs and statistics and the residual are kept for R rows only.
// flash: the attention takes bf16 q, k, v (ModelOptions::flash_attention): qkv_bf instead of qkv.
// gelu_bf16: the MLP's pre-activations `fc` (and Llama's `up`) are kept in bf16 (ModelOptions::gelu_epilogue).
// res_bf16: the residual after attention (res2) is kept in bf16 (ModelOptions::residual_bf16).
void alloc_block_acts(BlockActivations& a, const ModelConfig& c, DType cd, int64_t BT, int64_t R, int64_t B,
                      int64_t nh, int64_t nkv, int64_t F, bool flash = false, bool gelu_bf16 = false,
                      bool res_bf16 = false);
// An MoE layer's router outputs, and its routed rows for up to `M` rows of width Fe (bf16_pre: the
// pre-activations h1 / h3 in bf16, MoeShape::bf16_pre).
void alloc_moe_acts(BlockActivations& a, const ModelConfig& c, DType cd, int64_t BT, int64_t M, int64_t Fe,
                    bool bf16_pre = false);

// How a layer reaches the model's parameters by index: where their values and gradients live now
// (the flat buffers, a unit's gathered weights, the expert buffers). Implemented by the model.
class LayerParams {
 public:
  // Parameter w as a matrix of `out` rows in the compute dtype: for a forward with bias b (-1:
  // none), with `grads` (backward) with the gradients of w and b instead.
  virtual Weight weight(int w, int b, int64_t out, bool grads) = 0;
  // The same for a routed expert's parameter (indices into the expert parameters when they are
  // kept apart, expert parallelism).
  virtual Weight expert_weight(int w, int b, int64_t out, bool grads) = 0;
  // The block's q|k|v projection: GPT-2's fused weight and bias, or Llama's q, k, v weights (one
  // contiguous matrix) with Qwen 2's three biases joined into one.
  virtual Weight qkv_weight(const BlockParams& p, int64_t out, bool grads) = 0;
  // The norm with weight w and bias b (and their gradients with `grads`).
  virtual Norm norm(int w, int b, bool grads) = 0;
  // fp32 values of a parameter (converted from the bf16 weights in bf16 mode) and its gradient.
  virtual const float* f32(int idx) = 0;
  virtual float* grad(int idx) = 0;

 protected:
  ~LayerParams() = default;
};

}  // namespace mt
