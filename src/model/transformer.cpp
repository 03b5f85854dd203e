#include "model/transformer.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include "kernels/backend.h"
#include "model/rng.h"

namespace mt {

// Everything one block saves in forward for its backward. Matmul inputs are kept in the compute
// dtype only (bf16 in mixed precision); what elementwise backward passes need stays fp32.
struct BlockActivations {
  Tensor ln1, ln1_mean, ln1_rstd;  // ln1: f32 or bf16
  Tensor qkv;                       // f32 [N, QKV] (after RoPE for Llama)
  Tensor atty, atty_bf, lse;        // attention output f32 (+ bf16 copy), lse [B, nh, T]
  Tensor res2;                      // residual after attention, f32 [N, C]
  Tensor ln2, ln2_mean, ln2_rstd;
  Tensor fc;                        // GPT-2: pre-GELU [N, F]; Llama: gate [N, F] (MoE: the shared experts')
  Tensor up;                        // Llama: up [N, F]
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
    for (const Tensor* t : {&ln1, &ln1_mean, &ln1_rstd, &qkv, &atty, &atty_bf, &lse, &res2, &ln2, &ln2_mean,
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

namespace {
// Parameters per routed expert: Llama w1 (gate), w2 (down), w3 (up); GPT-2 c_fc w b, c_proj w b.
int expert_stride(const ModelConfig& c) { return c.arch == Arch::GPT2 ? 4 : 3; }

// `local_experts`: the routed experts this rank's block holds (all of them without expert parallelism).
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
}  // namespace

// Everything one micro-batch keeps between its forward and its backward.
struct Transformer::Slot {
  int64_t B = 0, T = 0;
  bool have_backward = false;
  std::vector<std::unique_ptr<BlockActivations>> acts;  // per block (null: not owned or recomputed)
  std::vector<Tensor> block_out;                         // output of unit u (0..L), [B*T, C]
  Tensor ids, targets, head_in, head_in_bf, head_mean, head_rstd, logits, losses;
  Tensor head_dx;          // chunked head: the head input's gradient, computed by the forward
  bool chunked = false;    // the last forward of this slot used the chunked head
  // The training forward left the logits' gradient in bf16, a dense [N, Vp] matrix over the first
  // half of the logits' storage: bf16 compute, whole head, tp = 1, no chunked head-weight gradient.
  bool grad_bf16 = false;
};

Transformer::Transformer(const ModelConfig& cfg, DType compute, Recompute recompute, ModelStorage storage,
                         TpComm* tp, std::vector<char> owned_units)
    : cfg_(cfg), compute_(compute), recompute_(recompute), dev_(current_device()), kt_(&kernels::table(dev_)),
      storage_(storage), tpc_(kt_, compute, tp), owned_(std::move(owned_units)) {
  cfg_.resolve();
  const size_t U = static_cast<size_t>(cfg_.n_layer) + 2;
  if (owned_.empty()) owned_.assign(U, 1);
  if (owned_.size() != U)
    throw std::invalid_argument("owned_units has " + std::to_string(owned_.size()) + " entries, the model has " +
                                std::to_string(U) + " units");
  if (storage_.unit_align < 1) storage_.unit_align = 1;
  const int64_t t = tpc_.size;
  auto need = [&](int64_t v, const char* what) {
    if (v % t != 0)
      throw std::invalid_argument(std::string(what) + " (" + std::to_string(v) + ") is not divisible by parallel.tp (" +
                                  std::to_string(t) + ")");
  };
  need(cfg_.n_head, "model.n_head");
  need(cfg_.n_kv_head, "model.n_kv_head");
  need(cfg_.ffn_hidden, "model.ffn_hidden");
  need(cfg_.padded_vocab, "the padded vocabulary");
  nh_l_ = cfg_.n_head / t;
  nkv_l_ = cfg_.n_kv_head / t;
  F_l_ = cfg_.ffn_hidden / t;
  if (cfg_.moe()) {
    const int64_t ep = std::max(1, storage_.ep), er = storage_.ep_rank;
    need(cfg_.expert_ffn(), "model.moe_ffn_hidden (one expert's width)");
    if (cfg_.moe_experts % ep != 0)
      throw std::invalid_argument("model.moe_experts (" + std::to_string(cfg_.moe_experts) +
                                  ") is not divisible by parallel.ep (" + std::to_string(ep) + ")");
    if (er < 0 || er >= ep) throw std::invalid_argument("expert-parallel rank outside parallel.ep");
    E_l_ = cfg_.moe_experts / ep;
    E_lo_ = er * E_l_;
    Fe_l_ = cfg_.expert_ffn() / t;
    Fs_l_ = cfg_.moe_shared_experts * cfg_.expert_ffn() / t;
  }
  Vp_l_ = cfg_.padded_vocab / t;
  vocab_lo_ = tpc_.rank * Vp_l_;
  build_params();
  if (cfg_.rope_scaled()) rope_inv_freq_ = cfg_.rope_inv_freq();  // Llama 3.1 scaled frequencies
  const bool f32 = compute_ == DType::F32;
  if (f32 ? storage_.weights : storage_.master)
    weights_ = Tensor::zeros({flat_size_}, DType::F32, f32 ? MemCategory::Params : MemCategory::Optimizer);
  if (storage_.grads) grads_ = Tensor::zeros({flat_size_}, DType::F32, MemCategory::Grads);
  if (!f32 && storage_.weights) weights_bf16_ = Tensor::zeros({flat_size_}, DType::BF16, MemCategory::Params);
  if (expert_size_ > 0) {  // expert parallelism: the local experts' own buffers
    ew_ = Tensor::zeros({expert_size_}, DType::F32, f32 ? MemCategory::Params : MemCategory::Optimizer);
    eg_ = Tensor::zeros({expert_size_}, DType::F32, MemCategory::Grads);
    if (!f32) ewb_ = Tensor::zeros({expert_size_}, DType::BF16, MemCategory::Params);
    eupcast_.resize(expert_params_.size());
  }
  unit_w_.assign(units_.size(), nullptr);
  unit_g_.assign(units_.size(), nullptr);
  upcast_.resize(params_.size());
  if (cfg_.tied_embeddings && owned_[U - 1] && !owned_[0]) {
    tied_w_ = Tensor::zeros({Vp_l_, cfg_.n_embd}, compute_, MemCategory::Params);
    tied_g_ = Tensor::zeros({Vp_l_, cfg_.n_embd}, DType::F32, MemCategory::Grads);
  }
  select_slot(0);
}

Transformer::~Transformer() = default;

void Transformer::build_params() {
  // Shapes are this tp rank's share (the whole model when tp = 1).
  const int64_t C = cfg_.n_embd, hd = cfg_.head_dim(), F = F_l_, V = Vp_l_;
  const int64_t nh = nh_l_, nkv = nkv_l_;
  int cur_unit = 0;
  int64_t pos = 0;
  bool to_experts = false;  // add() registers an expert parameter kept apart (expert parallelism)
  auto add = [&](const std::string& name, std::vector<int64_t> shape, bool decay, bool tr = false,
                 TpSplit split = TpSplit::None) {
    if (!owned_[cur_unit]) return;  // another pipeline rank's unit
    if (to_experts) {
      ParamInfo p;
      p.name = name;
      p.shape = shape;
      p.numel = 1;
      for (auto d : shape) p.numel *= d;
      p.offset = expert_size_;
      p.unit = cur_unit;
      p.decay = decay;
      p.hf_transposed = tr;
      p.tp_split = split;
      expert_size_ += p.numel;
      expert_params_.push_back(p);
      return;
    }
    ParamInfo p;
    p.name = name;
    p.shape = shape;
    p.numel = 1;
    for (auto d : shape) p.numel *= d;
    p.offset = pos;
    p.unit = cur_unit;
    p.decay = decay;
    p.hf_transposed = tr;
    p.tp_split = split;
    total_ += p.numel;
    pos += p.numel;
    unit_params_[cur_unit].push_back(static_cast<int>(params_.size()));
    params_.push_back(p);
  };
  // Parameter offsets are positions in the flat buffer: units are padded to unit_align, so
  // offsets run ahead of the parameter count (total_) once padding appears.
  auto begin_unit = [&](const std::string& name) {
    cur_unit = static_cast<int>(units_.size());
    units_.push_back(UnitRange{name, pos, 0});
    unit_params_.emplace_back();
  };
  auto end_unit = [&]() {
    const int64_t a = storage_.unit_align;
    pos = (pos + a - 1) / a * a;
    units_.back().numel = pos - units_.back().offset;
    flat_size_ = pos;
  };

  const bool gpt = cfg_.arch == Arch::GPT2;
  begin_unit("embedding");
  if (gpt) {
    add("wte.weight", {V, C}, false, false, TpSplit::Rows);
    add("wpe.weight", {cfg_.max_position, C}, false);  // HF max_position rows; the first T are used
  } else {
    add("model.embed_tokens.weight", {V, C}, false, false, TpSplit::Rows);
  }
  end_unit();
  const int64_t Fe = Fe_l_, Fs = Fs_l_;  // one routed expert's and the shared experts' width (this tp rank's)
  expert_base_.assign(static_cast<size_t>(cfg_.n_layer), -1);
  for (int64_t l = 0; l < cfg_.n_layer; ++l) {
    begin_unit("block." + std::to_string(l));
    const bool moe = cfg_.is_moe_layer(l);
    if (moe && experts_apart() && owned_[cur_unit]) expert_base_[l] = static_cast<int>(expert_params_.size());
    if (gpt) {
      std::string p = "h." + std::to_string(l) + ".";
      add(p + "ln_1.weight", {C}, false);
      add(p + "ln_1.bias", {C}, false);
      add(p + "attn.c_attn.weight", {3 * nh * hd, C}, true, true, TpSplit::QkvRows);
      add(p + "attn.c_attn.bias", {3 * nh * hd}, false, false, TpSplit::QkvRows);
      add(p + "attn.c_proj.weight", {C, nh * hd}, true, true, TpSplit::Cols);
      add(p + "attn.c_proj.bias", {C}, false);
      add(p + "ln_2.weight", {C}, false);
      add(p + "ln_2.bias", {C}, false);
      if (moe) {
        add(p + "mlp.gate.weight", {cfg_.moe_experts, C}, true);
        to_experts = experts_apart();
        for (int64_t e = E_lo_; e < E_lo_ + E_l_; ++e) {
          const std::string q = p + "mlp.experts." + std::to_string(e) + ".";
          add(q + "c_fc.weight", {Fe, C}, true, false, TpSplit::Rows);
          add(q + "c_fc.bias", {Fe}, false, false, TpSplit::Rows);
          add(q + "c_proj.weight", {C, Fe}, true, false, TpSplit::Cols);
          add(q + "c_proj.bias", {C}, false);
        }
        to_experts = false;
      }
      if (!moe || Fs > 0) {
        const std::string q = moe ? p + "mlp.shared_experts." : p + "mlp.";
        const int64_t W = moe ? Fs : F;
        add(q + "c_fc.weight", {W, C}, true, !moe, TpSplit::Rows);
        add(q + "c_fc.bias", {W}, false, false, TpSplit::Rows);
        add(q + "c_proj.weight", {C, W}, true, !moe, TpSplit::Cols);
        add(q + "c_proj.bias", {C}, false);
      }
    } else {
      std::string p = "model.layers." + std::to_string(l) + ".";
      add(p + "input_layernorm.weight", {C}, false);
      add(p + "self_attn.q_proj.weight", {nh * hd, C}, true, false, TpSplit::Rows);
      add(p + "self_attn.k_proj.weight", {nkv * hd, C}, true, false, TpSplit::Rows);
      add(p + "self_attn.v_proj.weight", {nkv * hd, C}, true, false, TpSplit::Rows);
      add(p + "self_attn.o_proj.weight", {C, nh * hd}, true, false, TpSplit::Cols);
      add(p + "post_attention_layernorm.weight", {C}, false);
      if (moe) {  // Mixtral's names (block_sparse_moe), DeepSeek's shared experts
        add(p + "block_sparse_moe.gate.weight", {cfg_.moe_experts, C}, true);
        to_experts = experts_apart();
        for (int64_t e = E_lo_; e < E_lo_ + E_l_; ++e) {
          const std::string q = p + "block_sparse_moe.experts." + std::to_string(e) + ".";
          add(q + "w1.weight", {Fe, C}, true, false, TpSplit::Rows);
          add(q + "w2.weight", {C, Fe}, true, false, TpSplit::Cols);
          add(q + "w3.weight", {Fe, C}, true, false, TpSplit::Rows);
        }
        to_experts = false;
      }
      if (!moe || Fs > 0) {
        const std::string q = moe ? p + "block_sparse_moe.shared_experts." : p + "mlp.";
        const int64_t W = moe ? Fs : F;
        add(q + "gate_proj.weight", {W, C}, true, false, TpSplit::Rows);
        add(q + "up_proj.weight", {W, C}, true, false, TpSplit::Rows);
        add(q + "down_proj.weight", {C, W}, true, false, TpSplit::Cols);
      }
      if (cfg_.qkv_bias) {
        add(p + "self_attn.q_proj.bias", {nh * hd}, false, false, TpSplit::Rows);
        add(p + "self_attn.k_proj.bias", {nkv * hd}, false, false, TpSplit::Rows);
        add(p + "self_attn.v_proj.bias", {nkv * hd}, false, false, TpSplit::Rows);
      }
    }
    end_unit();
  }
  begin_unit("head");
  if (gpt) {
    add("ln_f.weight", {C}, false);
    add("ln_f.bias", {C}, false);
  } else {
    add("model.norm.weight", {C}, false);
    if (!cfg_.tied_embeddings) add("lm_head.weight", {V, C}, true, false, TpSplit::Rows);
  }
  end_unit();
}

const ParamInfo& Transformer::param(const std::string& name) const {
  for (const auto& p : params_)
    if (p.name == name) return p;
  throw std::out_of_range("no parameter named " + name);
}

void Transformer::zero_grads() {
  if (grads_.defined()) grads_.zero_();
  if (eg_.defined()) eg_.zero_();
  if (tied_g_.defined()) tied_g_.zero_();
}

void Transformer::init_weights(uint64_t seed) {
  if (!weights_.defined()) throw std::logic_error("init_weights: the model holds no full fp32 weights");
  if (dev_ == Device::Meta) return;  // nothing to initialise on a count-only device
  init_weights_into(seed, weights_.f32());
  sync_compute_weights();
}

void Transformer::init_weights_into(uint64_t seed, float* w) const {
  if (tpc_.size > 1) throw std::logic_error("init_weights_into needs an unsplit (tp = 1) layout; use shard_unit_from_full");
  if (experts_apart()) throw std::logic_error("init_weights_into needs every expert in the flat buffer (parallel.ep = 1)");
  Rng rng(seed);
  std::memset(w, 0, static_cast<size_t>(flat_size_) * sizeof(float));
  const float resid_std = 0.02f / std::sqrt(2.0f * static_cast<float>(cfg_.n_layer));
  for (const auto& p : params_) {
    float* d = w + p.offset;
    const std::string& n = p.name;
    auto ends = [&](const char* s) {
      size_t L = std::strlen(s);
      return n.size() >= L && n.compare(n.size() - L, L, s) == 0;
    };
    bool is_norm = ends("ln_1.weight") || ends("ln_2.weight") || ends("ln_f.weight") ||
                   ends("layernorm.weight") || n == "model.norm.weight";
    if (is_norm) {
      for (int64_t i = 0; i < p.numel; ++i) d[i] = 1.0f;
    } else if (p.shape.size() == 1) {
      for (int64_t i = 0; i < p.numel; ++i) d[i] = 0.0f;
    } else {
      bool resid = ends("attn.c_proj.weight") || ends("c_proj.weight") || ends("o_proj.weight") ||
                   ends("down_proj.weight") || ends("w2.weight");
      float sd = resid ? resid_std : 0.02f;
      // Padded vocabulary rows stay zero (they never receive gradient through the loss).
      int64_t rows = p.shape[0], cols = p.numel / rows;
      bool vocab = n == "wte.weight" || n == "model.embed_tokens.weight" || n == "lm_head.weight";
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c)
          d[r * cols + c] = (vocab && r >= cfg_.vocab_size) ? 0.0f : static_cast<float>(rng.normal()) * sd;
    }
  }
}

void Transformer::sync_compute_weights() {
  if (compute_ == DType::BF16 && weights_.defined() && weights_bf16_.defined())
    kt_->cast_f32_to_bf16(weights_bf16_.bf(), weights_.f32(), flat_size_);
  if (compute_ == DType::BF16 && ewb_.defined()) kt_->cast_f32_to_bf16(ewb_.bf(), ew_.f32(), expert_size_);
}

void Transformer::set_unit_weights(int u, const void* w) { unit_w_.at(u) = w; }
void Transformer::set_unit_grads(int u, float* g) { unit_g_.at(u) = g; }

// fp32 view of a parameter. In bf16 mode the model computes from the bf16 weights only (so a
// sharded run that gathers bf16 computes exactly what an unsharded bf16 run does): small
// parameters (norms, biases, positions) are converted to fp32 on use.
const float* Transformer::wf(int idx) {
  const ParamInfo& p = params_[idx];
  const UnitRange& ur = units_[p.unit];
  if (compute_ == DType::BF16) {
    Tensor& t = upcast_[idx];
    if (!t.defined()) t = Tensor::empty({p.numel}, DType::F32, MemCategory::Workspace);
    kt_->cast_bf16_to_f32(t.f32(), wb(idx), p.numel);
    return t.f32();
  }
  if (unit_w_[p.unit]) return static_cast<const float*>(unit_w_[p.unit]) + (p.offset - ur.offset);
  if (!weights_.defined()) throw std::logic_error("unit " + ur.name + " has no weights (not gathered?)");
  return weights_.f32() + p.offset;
}

// The Llama block's fused q|k|v bias (parameter `first` and the two after it) in fp32, or null
// without one. fp32: the three parameters are contiguous in the flat buffer; bf16: their upcasts
// are joined in a workspace tensor.
const float* Transformer::qkv_bias_f32(int first) {
  if (first < 0) return nullptr;
  if (compute_ != DType::BF16) return wf(first);
  int64_t n = 0;
  for (int i = 0; i < 3; ++i) n += params_[first + i].numel;
  if (qkv_bias_.numel() != n) qkv_bias_ = Tensor::empty({n}, DType::F32, MemCategory::Workspace);
  int64_t at = 0;
  for (int i = 0; i < 3; ++i) {
    const int64_t m = params_[first + i].numel;
    dev::copy(dev_, qkv_bias_.f32() + at, wf(first + i), static_cast<size_t>(m) * sizeof(float));
    at += m;
  }
  return qkv_bias_.f32();
}

const bf16* Transformer::wb(int idx) const {
  const ParamInfo& p = params_[idx];
  const UnitRange& ur = units_[p.unit];
  if (unit_w_[p.unit]) return static_cast<const bf16*>(unit_w_[p.unit]) + (p.offset - ur.offset);
  if (!weights_bf16_.defined()) throw std::logic_error("unit " + ur.name + " has no weights (not gathered?)");
  return weights_bf16_.bf() + p.offset;
}

float* Transformer::gp(int idx) const {
  const ParamInfo& p = params_[idx];
  if (unit_g_[p.unit]) return unit_g_[p.unit] + (p.offset - units_[p.unit].offset);
  if (!grads_.defined()) throw std::logic_error("unit " + units_[p.unit].name + " has no gradient buffer");
  return grads_.f32() + p.offset;
}

bool Transformer::recomputes(int layer) const {
  if (recompute_ == Recompute::Full) return true;
  if (recompute_ == Recompute::Selective) return layer % 2 == 1;  // every second block
  return false;
}

// nh, nkv, F: this tp rank's heads and MLP width.
// R: rows of the residual stream this rank holds (BT, or BT / tp with sequence parallelism): the
// norms' inputs, outputs and statistics and the residual are kept for R rows only.
static void alloc_block_acts(BlockActivations& a, const ModelConfig& c, DType cd, int64_t BT, int64_t R, int64_t B,
                             int64_t nh, int64_t nkv, int64_t F) {
  const int64_t C = c.n_embd, QKV = (nh + 2 * nkv) * c.head_dim();
  auto A = MemCategory::Activations;
  a.ln1 = Tensor::empty({R, C}, cd, A);
  a.ln1_rstd = Tensor::empty({R}, DType::F32, A);
  if (c.arch == Arch::GPT2) a.ln1_mean = Tensor::empty({R}, DType::F32, A);
  a.qkv = Tensor::empty({BT, QKV}, DType::F32, A);
  a.atty = Tensor::empty({BT, nh * c.head_dim()}, DType::F32, A);
  if (cd == DType::BF16) a.atty_bf = Tensor::empty({BT, nh * c.head_dim()}, DType::BF16, A);
  a.lse = Tensor::empty({B * nh * (BT / B)}, DType::F32, A);
  a.res2 = Tensor::empty({R, C}, DType::F32, A);
  a.ln2 = Tensor::empty({R, C}, cd, A);
  a.ln2_rstd = Tensor::empty({R}, DType::F32, A);
  if (c.arch == Arch::GPT2) a.ln2_mean = Tensor::empty({R}, DType::F32, A);
  if (F > 0) {  // the dense MLP, or an MoE layer's shared experts
    a.fc = Tensor::empty({BT, F}, DType::F32, A);
    if (c.arch == Arch::Llama) a.up = Tensor::empty({BT, F}, DType::F32, A);
    a.act = Tensor::empty({BT, F}, cd, A);
  }
}

// An MoE layer's router outputs, and its routed rows for up to `M` rows of width Fe.
static void alloc_moe_acts(BlockActivations& a, const ModelConfig& c, DType cd, int64_t BT, int64_t M, int64_t Fe) {
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
  a.h1 = Tensor::empty({M, Fe}, DType::F32, A);
  if (c.arch == Arch::Llama) a.h3 = Tensor::empty({M, Fe}, DType::F32, A);
  a.xact = Tensor::empty({M, Fe}, cd, A);
  a.y = Tensor::empty({M, C}, DType::F32, A);
  a.order = Tensor::empty({M}, DType::I32, A);
}

void Transformer::select_slot(int slot) {
  if (slot < 0) throw std::invalid_argument("negative activation slot");
  while (static_cast<int>(slots_.size()) <= slot) slots_.push_back(std::make_unique<Slot>());
  s_ = slots_[slot].get();
  B_ = s_->B;
  T_ = s_->T;
}

Tensor& Transformer::out_buf(int64_t l) {
  Tensor& t = s_->block_out[l];
  if (!t.defined()) t = Tensor::empty({residual_rows(B_ * T_), cfg_.n_embd}, DType::F32, MemCategory::Activations);
  return t;
}

// Allocates what units first..last need on the current slot (kept across steps; a new shape
// reallocates, and the caching allocator hands the same blocks back when the shape returns).
void Transformer::ensure_buffers(int64_t B, int64_t T, int first, int last) {
  if (T > cfg_.seq_len)
    throw std::invalid_argument("sequence of " + std::to_string(T) + " tokens is longer than the model's seq_len " +
                                std::to_string(cfg_.seq_len));
  for (int u = first; u <= last; ++u)
    if (!owned_[u]) throw std::logic_error("unit " + units_[u].name + " belongs to another pipeline stage");
  const int64_t L = cfg_.n_layer;
  Slot& s = *s_;
  if (s.B != B || s.T != T) {
    Slot fresh;
    s = std::move(fresh);
    s.B = B;
    s.T = T;
    s.acts.resize(L);
    s.block_out.resize(L + 1);
  }
  B_ = B;
  T_ = T;
  const int64_t BT = B * T, C = cfg_.n_embd, V = Vp_l_, F = F_l_;
  const int64_t QKV = (nh_l_ + 2 * nkv_l_) * cfg_.head_dim();
  if (tpc_.sp && BT % tpc_.size != 0)
    throw std::invalid_argument("sequence parallelism needs micro_batch x sequence (" + std::to_string(BT) +
                                " tokens) divisible by parallel.tp (" + std::to_string(tpc_.size) + ")");
  const int64_t R = residual_rows(BT);
  if (cp_) {
    if (T % 2 != 0)
      throw std::invalid_argument("context parallelism needs an even number of local tokens per sequence (two chunks), got " +
                                  std::to_string(T));
    if (static_cast<int64_t>(cp_pos_.size()) != T) cp_pos_ = cp_positions(cp_->rank(), cp_->size(), T);
  }
  auto A = MemCategory::Activations;
  for (int u = first; u <= last; ++u) {
    if (u == 0) {
      if (!s.ids.defined()) s.ids = Tensor::empty({BT}, DType::I32, A);
      out_buf(0);
    } else if (u <= L) {
      const int64_t l = u - 1;
      out_buf(l);
      out_buf(l + 1);
      if (!recomputes(static_cast<int>(l)) && !s.acts[l]) {
        s.acts[l] = std::make_unique<BlockActivations>();
        alloc_block_acts(*s.acts[l], cfg_, compute_, BT, R, B, nh_l_, nkv_l_, mlp_width(l));
        if (cfg_.is_moe_layer(l)) alloc_moe_acts(*s.acts[l], cfg_, compute_, BT, moe_rows_hint(BT), Fe_l_);
      }
    } else if (!s.losses.defined()) {
      out_buf(L);
      s.targets = Tensor::empty({BT}, DType::I32, A);
      s.head_in = Tensor::empty({BT, C}, DType::F32, A);
      if (compute_ == DType::BF16) s.head_in_bf = Tensor::empty({BT, C}, DType::BF16, A);
      s.head_rstd = Tensor::empty({R}, DType::F32, A);
      s.head_mean = Tensor::empty({R}, DType::F32, A);
      if (loss_chunk_ > 0)  // the logits only exist a chunk at a time (and whole for sampling, on demand)
        s.head_dx = Tensor::empty({BT, C}, DType::F32, A);
      else
        s.logits = Tensor::empty({BT, V}, DType::F32, A);
      s.losses = Tensor::empty({BT}, DType::F32, A);
    }
  }
  if (ws_bt_ == BT) return;
  // Workspace shared by every slot (one backward or recompute runs at a time).
  ws_bt_ = BT;
  scratch_acts_.reset();
  bwd_ws_.clear();
  scratch_moe_acts_.reset();
  if (recompute_ != Recompute::None) {
    scratch_acts_ = std::make_unique<BlockActivations>();
    alloc_block_acts(*scratch_acts_, cfg_, compute_, BT, R, B, nh_l_, nkv_l_, F_l_);
    if (cfg_.moe()) {  // recomputed MoE layers share their own set
      scratch_moe_acts_ = std::make_unique<BlockActivations>();
      alloc_block_acts(*scratch_moe_acts_, cfg_, compute_, BT, R, B, nh_l_, nkv_l_, Fs_l_);
      alloc_moe_acts(*scratch_moe_acts_, cfg_, compute_, BT, moe_rows_hint(BT), Fe_l_);
    }
  }
  auto W = MemCategory::Workspace;
  dres_ = Tensor::empty({BT, C}, DType::F32, W);
  // backward workspace: [0] d(normed) [N,C], [1] dqkv [N,QKV], [2] datty [N,C], [3] dfc [N,F],
  // [4] dup / dact [N,F], [5] d act [N,F], [6] scratch f32 [N, max(C,F)]
  bwd_ws_.push_back(Tensor::empty({BT, C}, DType::F32, W));
  bwd_ws_.push_back(Tensor::empty({BT, QKV}, DType::F32, W));
  bwd_ws_.push_back(Tensor::empty({BT, C}, DType::F32, W));
  bwd_ws_.push_back(Tensor::empty({BT, F}, DType::F32, W));
  bwd_ws_.push_back(Tensor::empty({BT, F}, DType::F32, W));
  bwd_ws_.push_back(Tensor::empty({BT, F}, DType::F32, W));
  bwd_ws_.push_back(Tensor::empty({BT, std::max(C, F)}, DType::F32, W));
  tpc_.stage = bwd_ws_[6].f32();
  tpc_.allocate(BT, C);
  if (cp_) {  // the travelling key / value blocks and their gradients
    const int64_t KVW = 2 * nkv_l_ * cfg_.head_dim(), n = cp_->size();
    for (Tensor& t : cp_kv_) t = Tensor();
    for (Tensor& t : cp_dkv_) t = Tensor();
    if (cp_allgather_) {  // every rank's blocks at once
      cp_kv_[0] = Tensor::empty({n * BT, KVW}, DType::F32, W);
      cp_dkv_[0] = Tensor::empty({n * BT, KVW}, DType::F32, W);
      cp_dkv_[1] = Tensor::empty({BT, KVW}, DType::F32, W);
    } else {
      for (Tensor& t : cp_kv_) t = Tensor::empty({BT, KVW}, DType::F32, W);
      for (Tensor& t : cp_dkv_) t = Tensor::empty({BT, KVW}, DType::F32, W);
    }
  }
}

void Transformer::set_context_parallel(CpComm* comm, bool allgather) {
  if (ws_bt_ != 0) throw std::logic_error("set_context_parallel must come before the first forward");
  cp_ = comm && comm->size() > 1 ? comm : nullptr;
  cp_allgather_ = allgather;
}

namespace {
constexpr int kTagKv = 1, kTagKvBackward = 2, kTagDkv = 3;  // ring transfers of one block's K/V and dK/dV
}

// Ring attention (forward): step s computes this rank's queries against the key / value block of
// cp rank (rank - s) mod cp while that block travels on to the next rank; the partial results are
// merged by log-sum-exp inside the kernel. Entirely masked chunk pairs are skipped (modes).
void Transformer::cp_attention_forward(BlockActivations& a) {
  const int64_t B = B_, T = T_, N = B * T, hd = cfg_.head_dim(), nh = nh_l_, nkv = nkv_l_;
  const int64_t QKV = (nh + 2 * nkv) * hd, KVW = 2 * nkv * hd;
  const int n = cp_->size(), r = cp_->rank();
  int8_t modes[4];
  if (cp_allgather_) {
    float* all = cp_kv_[0].f32();
    kt_->copy_columns(all + r * N * KVW, a.qkv.f32(), N, QKV, nh * hd, KVW);
    cp_->all_gather(all + r * N * KVW, all, N * KVW);
    for (int s = 0; s < n; ++s) {
      const int src = (r - s + n) % n;
      cp_block_modes(r, src, modes);
      kt_->attention_block_forward(a.atty.f32(), a.lse.f32(), a.qkv.f32(), all + src * N * KVW, B, T, nh, nkv, hd, 2,
                                   modes, s == 0);
    }
    return;
  }
  float* cur = cp_kv_[0].f32();
  float* nxt = cp_kv_[1].f32();
  kt_->copy_columns(cur, a.qkv.f32(), N, QKV, nh * hd, KVW);
  for (int s = 0; s < n; ++s) {
    const int h = s + 1 < n ? cp_->start_ring_exchange(cur, nxt, N * KVW, kTagKv) : -1;
    const int src = (r - s + n) % n;
    cp_block_modes(r, src, modes);
    kt_->attention_block_forward(a.atty.f32(), a.lse.f32(), a.qkv.f32(), cur, B, T, nh, nkv, hd, 2, modes, s == 0);
    if (h >= 0) {
      cp_->wait(h);
      std::swap(cur, nxt);
    }
  }
}

// Ring attention (backward): the key / value blocks go around the ring again, each with the
// gradient of its keys and values accumulated by the ranks it has visited. The owner's own
// contribution (step 0) stays home; the accumulation starts at the next rank (step 1) and after
// the last step travels one more hop, home: cp - 1 transfers of each block's gradient, as a
// reduce-scatter would move. Each step's contribution is computed into a fresh buffer while the
// block's accumulated gradient is still on its way, then added to it.
void Transformer::cp_attention_backward(BlockActivations& a, const float* datty, float* dqkv) {
  const int64_t B = B_, T = T_, N = B * T, hd = cfg_.head_dim(), nh = nh_l_, nkv = nkv_l_;
  const int64_t QKV = (nh + 2 * nkv) * hd, KVW = 2 * nkv * hd;
  const size_t block_bytes = static_cast<size_t>(N * KVW) * sizeof(float);
  const int n = cp_->size(), r = cp_->rank();
  int8_t modes[4];
  if (cp_allgather_) {
    float* all = cp_kv_[0].f32();  // shared by the layers: gathered again
    float* dall = cp_dkv_[0].f32();
    kt_->copy_columns(all + r * N * KVW, a.qkv.f32(), N, QKV, nh * hd, KVW);
    cp_->all_gather(all + r * N * KVW, all, N * KVW);
    dev::zero(dev_, dall, static_cast<size_t>(n) * block_bytes);
    for (int s = 0; s < n; ++s) {
      const int src = (r - s + n) % n;
      cp_block_modes(r, src, modes);
      kt_->attention_block_backward(dqkv, dall + src * N * KVW, datty, a.qkv.f32(), all + src * N * KVW, a.atty.f32(),
                                    a.lse.f32(), B, T, nh, nkv, hd, 2, modes);
    }
    cp_->reduce_scatter_sum(dall, cp_dkv_[1].f32(), N * KVW);
    kt_->add_columns(dqkv, cp_dkv_[1].f32(), N, QKV, nh * hd, KVW);
    return;
  }
  float* cur = cp_kv_[0].f32();
  float* nxt = cp_kv_[1].f32();
  float* dacc = cp_dkv_[0].f32();  // gradient of the block held now, accumulated along the ring
  float* dinc = cp_dkv_[1].f32();  // the next block's accumulated gradient, arriving
  float* dloc = cp_dkv_[2].f32();  // this step's contribution
  kt_->copy_columns(cur, a.qkv.f32(), N, QKV, nh * hd, KVW);
  int hkv = -1, hd_in = -1;
  for (int s = 0; s < n; ++s) {
    if (hkv >= 0) {
      cp_->wait(hkv);
      std::swap(cur, nxt);
    }
    hkv = s + 1 < n ? cp_->start_ring_exchange(cur, nxt, N * KVW, kTagKvBackward) : -1;
    const int src = (r - s + n) % n;
    cp_block_modes(r, src, modes);
    float* into = s == 1 ? dacc : dloc;
    dev::zero(dev_, into, block_bytes);
    kt_->attention_block_backward(dqkv, into, datty, a.qkv.f32(), cur, a.atty.f32(), a.lse.f32(), B, T, nh, nkv, hd, 2,
                                  modes);
    if (s == 0) {  // this rank's own block: its own queries' part stays here
      kt_->add_columns(dqkv, dloc, N, QKV, nh * hd, KVW);
      continue;
    }
    if (s > 1) {
      cp_->wait(hd_in);  // the block's gradient so far (and the previous send) are through
      kt_->accumulate(dinc, dloc, N * KVW);
      std::swap(dacc, dinc);
    }
    hd_in = cp_->start_ring_exchange(dacc, dinc, N * KVW, kTagDkv);
  }
  cp_->wait(hd_in);  // dinc: this rank's own block's gradient from every other rank
  kt_->add_columns(dqkv, dinc, N, QKV, nh * hd, KVW);
}

void Transformer::set_loss_chunk(int64_t rows) {
  if (ws_bt_ != 0) throw std::logic_error("set_loss_chunk must come before the first forward");
  if (rows < 0) throw std::invalid_argument("loss chunk rows must be >= 0");
  loss_chunk_ = rows;
}

// The head of a forward with targets, `loss_chunk_` tokens at a time: logits of the chunk, its
// softmax cross-entropy (with train: turned into the logits' gradient in place), then right away
// the chunk's rows of the head input's gradient (s.head_dx) and its contribution to the pending
// head weight gradient (head_dw_). The per-token losses go to s.losses.
void Transformer::chunked_head_forward(const float* hin, bool train, float dloss_scale) {
  Slot& s = *s_;
  const int64_t N = B_ * T_, C = cfg_.n_embd, V = cfg_.vocab_size, Vp = Vp_l_;
  const int64_t rows = std::min(loss_chunk_, N);
  const bool bf = compute_ == DType::BF16;
  if (chunk_logits_.numel() < rows * Vp) chunk_logits_ = Tensor::empty({rows, Vp}, DType::F32, MemCategory::Workspace);
  if (train) {
    if (!head_dw_.defined()) head_dw_ = Tensor::empty({Vp, C}, DType::F32, MemCategory::Workspace);
    if (!head_dw_pending_) head_dw_.zero_();
    head_dw_pending_ = true;
    s.head_dx.zero_();
  }
  float* lg = chunk_logits_.f32();
  const int32_t* tg = s.targets.i32();
  for (int64_t r0 = 0; r0 < N; r0 += rows) {
    const int64_t nr = std::min(rows, N - r0);
    if (bf)
      kt_->linear_forward_bf16(lg, s.head_in_bf.bf() + r0 * C, head_wb(), nullptr, nr, C, Vp);
    else
      kt_->linear_forward(lg, hin + r0 * C, head_wf(), nullptr, nr, C, Vp);
    // vocab-parallel: this rank's columns, row statistics reduced over the tp ranks
    VocabParallelCrossEntropy(tpc_, V, vocab_lo_, Vp).forward(lg, tg + r0, s.losses.f32() + r0, nr, train, dloss_scale);
    if (!train) continue;
    // With tp these input-gradient rows are this rank's partial sums; the backward reduces them.
    if (bf)
      kt_->linear_backward_bf16(s.head_dx.f32() + r0 * C, head_dw_.f32(), nullptr, lg, s.head_in_bf.bf() + r0 * C,
                              head_wb(), nr, C, Vp);
    else
      kt_->linear_backward(s.head_dx.f32() + r0 * C, head_dw_.f32(), nullptr, lg, hin + r0 * C, head_wf(), nr, C, Vp);
  }
}

void Transformer::set_sequence_parallel(bool on) {
  if (ws_bt_ != 0) throw std::logic_error("set_sequence_parallel must come before the first forward");
  tpc_.sp = on && tpc_.tp();
}

Weight Transformer::weight(int w, int b, int64_t out, bool grads) {
  Weight r;
  r.out = out;
  if (compute_ == DType::BF16)
    r.wb = wb(w);
  else
    r.wf = wf(w);
  if (grads) {
    r.dw = gp(w);
    if (b >= 0) r.db = gp(b);
  } else if (b >= 0) {
    r.b = wf(b);
  }
  return r;
}

// The block's q|k|v projection: GPT-2's fused weight and bias, or Llama's q, k, v weights (one
// contiguous matrix) with Qwen 2's three biases joined into one (qkv_bias_f32).
Weight Transformer::qkv_weight(const BlockParams& p, int64_t out, bool grads) {
  Weight r = weight(p.qkv_w, p.qkv_b, out, grads);
  if (cfg_.arch != Arch::GPT2 && !grads && p.qkv_b >= 0) r.b = qkv_bias_f32(p.qkv_b);
  return r;
}

Norm Transformer::norm(int w, int b, bool grads) {
  return Norm(tpc_, cfg_.n_embd, cfg_.norm_eps, wf(w), b >= 0 ? wf(b) : nullptr, grads ? gp(w) : nullptr,
              grads && b >= 0 ? gp(b) : nullptr, cfg_.arch == Arch::GPT2);
}

// Under sequence parallelism x, out, the norms and the residual hold this rank's R rows; the
// parallel layers gather and reduce-scatter around the matmuls.
void Transformer::block_forward(int layer, const float* x, BlockActivations& a, float* out) {
  const int64_t B = B_, T = T_, N = B * T, C = cfg_.n_embd, F = F_l_, hd = cfg_.head_dim();
  const int64_t nh = nh_l_, nkv = nkv_l_, QKV = (nh + 2 * nkv) * hd;  // this tp rank's share
  const int64_t R = residual_rows(N);
  BlockParams p = block_params(cfg_, layer, unit_params_[layer + 1][0], experts_apart() ? 0 : E_l_);
  if (experts_apart() && p.moe) p.expert0 = expert_base_[layer];
  const bool gpt = cfg_.arch == Arch::GPT2;
  const bool bf = compute_ == DType::BF16;
  float* tmp = bwd_ws_[6].f32();  // fp32 staging for values stored as bf16
  // Attention: res2 = x + proj(attn(qkv(ln1(x)))).
  const float* ln1 = norm(p.ln1_w, p.ln1_b, false).forward_saved(a.ln1, a.ln1_mean, a.ln1_rstd, x, R);
  ColumnParallelLinear(tpc_, C).forward(a.ln1, ln1, {{a.qkv.f32(), qkv_weight(p, QKV, false)}});
  if (!gpt && cp_)
    kt_->rope_forward_pos(a.qkv.f32(), B, T, nh, nkv, hd, cfg_.rope_theta,
                          rope_inv_freq_.empty() ? nullptr : rope_inv_freq_.data(), cp_pos_.data());
  else if (!gpt && rope_inv_freq_.empty())
    kt_->rope_forward(a.qkv.f32(), B, T, nh, nkv, hd, cfg_.rope_theta);
  else if (!gpt)
    kt_->rope_forward_freq(a.qkv.f32(), B, T, nh, nkv, hd, rope_inv_freq_.data());
  if (cp_)
    cp_attention_forward(a);
  else
    kt_->attention_forward(a.atty.f32(), a.lse.f32(), a.qkv.f32(), B, T, nh, nkv, hd);
  if (bf) store_compute(kt_, a.atty_bf, a.atty.f32(), N * nh * hd);
  RowParallelLinear(tpc_, nh * hd, weight(p.proj_w, p.proj_b, C, false)).forward(a.res2.f32(), bf ? a.atty_bf : a.atty);
  kt_->accumulate(a.res2.f32(), x, R * C);
  // MLP: out = res2 + down(act(ln2(res2))).
  const float* ln2 = norm(p.ln2_w, p.ln2_b, false).forward_saved(a.ln2, a.ln2_mean, a.ln2_rstd, a.res2.f32(), R);
  if (p.moe) {  // under SP on every row, gathered as the dense MLP's column-parallel layer does
    moe_forward(layer, p, a, tpc_.sp ? tpc_.gather(a.ln2, ln2) : a.ln2, out);
    kt_->accumulate(out, a.res2.f32(), R * C);
    return;
  }
  float* act_out = bf ? tmp : a.act.f32();
  if (gpt) {
    ColumnParallelLinear(tpc_, C).forward(a.ln2, ln2, {{a.fc.f32(), weight(p.fc_w, p.fc_b, F, false)}});
    kt_->gelu_forward(act_out, a.fc.f32(), N * F);
  } else {
    ColumnParallelLinear(tpc_, C).forward(
        a.ln2, ln2, {{a.fc.f32(), weight(p.fc_w, -1, F, false)}, {a.up.f32(), weight(p.up_w, -1, F, false)}});
    kt_->swiglu_forward(act_out, a.fc.f32(), a.up.f32(), N * F);
  }
  if (bf) store_compute(kt_, a.act, act_out, N * F);
  RowParallelLinear(tpc_, F, weight(p.down_w, p.down_b, C, false)).forward(out, a.act);
  kt_->accumulate(out, a.res2.f32(), R * C);
}

// dx holds d(block output) on entry and d(block input) on exit (this rank's R rows under sequence
// parallelism).
void Transformer::block_backward(int layer, const float* x, BlockActivations& a, float* dx) {
  const int64_t B = B_, T = T_, N = B * T, C = cfg_.n_embd, F = F_l_, hd = cfg_.head_dim();
  const int64_t nh = nh_l_, nkv = nkv_l_, QKV = (nh + 2 * nkv) * hd;  // this tp rank's share
  const int64_t R = residual_rows(N);
  BlockParams p = block_params(cfg_, layer, unit_params_[layer + 1][0], experts_apart() ? 0 : E_l_);
  if (experts_apart() && p.moe) p.expert0 = expert_base_[layer];
  const bool gpt = cfg_.arch == Arch::GPT2;
  const bool bf = compute_ == DType::BF16;
  if (tpc_.sp) tpc_.defer_norm_grads();  // the block's two norm-gradient sums in one all-reduce (below)
  float* dnorm = bwd_ws_[0].f32();
  float* dqkv = bwd_ws_[1].f32();
  float* datty = bwd_ws_[2].f32();
  float* dfc = bwd_ws_[3].f32();
  float* dup = bwd_ws_[4].f32();
  float* dact = bwd_ws_[5].f32();
  // MLP. dx already carries the residual path's gradient.
  if (p.moe) {
    const float* dln2 = moe_backward(layer, p, a, dx, dnorm);
    norm(p.ln2_w, p.ln2_b, true).backward(dx, dln2, a.res2.f32(), a.ln2_mean, a.ln2_rstd, R);
  } else {
    RowParallelLinear(tpc_, F, weight(p.down_w, p.down_b, C, true)).backward(dact, dx, a.act);
    dev::zero(dev_, dfc, static_cast<size_t>(N * F) * sizeof(float));
    const float* dln2 = nullptr;
    if (gpt) {
      kt_->gelu_backward(dfc, a.fc.f32(), dact, N * F);
      dln2 = ColumnParallelLinear(tpc_, C).backward(a.ln2, {{dfc, weight(p.fc_w, p.fc_b, F, true)}}, dnorm);
    } else {
      dev::zero(dev_, dup, static_cast<size_t>(N * F) * sizeof(float));
      kt_->swiglu_backward(dfc, dup, dact, a.fc.f32(), a.up.f32(), N * F);
      dln2 = ColumnParallelLinear(tpc_, C).backward(
          a.ln2, {{dfc, weight(p.fc_w, -1, F, true)}, {dup, weight(p.up_w, -1, F, true)}}, dnorm);
    }
    norm(p.ln2_w, p.ln2_b, true).backward(dx, dln2, a.res2.f32(), a.ln2_mean, a.ln2_rstd, R);
  }
  // Attention.
  RowParallelLinear(tpc_, nh * hd, weight(p.proj_w, p.proj_b, C, true)).backward(datty, dx, bf ? a.atty_bf : a.atty);
  dev::zero(dev_, dqkv, static_cast<size_t>(N * QKV) * sizeof(float));
  if (cp_)
    cp_attention_backward(a, datty, dqkv);
  else
    kt_->attention_backward(dqkv, datty, a.qkv.f32(), a.atty.f32(), a.lse.f32(), B, T, nh, nkv, hd);
  if (!gpt && cp_)
    kt_->rope_backward_pos(dqkv, B, T, nh, nkv, hd, cfg_.rope_theta,
                           rope_inv_freq_.empty() ? nullptr : rope_inv_freq_.data(), cp_pos_.data());
  else if (!gpt && rope_inv_freq_.empty())
    kt_->rope_backward(dqkv, B, T, nh, nkv, hd, cfg_.rope_theta);
  else if (!gpt)
    kt_->rope_backward_freq(dqkv, B, T, nh, nkv, hd, rope_inv_freq_.data());
  const float* dln1 = ColumnParallelLinear(tpc_, C).backward(a.ln1, {{dqkv, qkv_weight(p, QKV, true)}}, dnorm);
  norm(p.ln1_w, p.ln1_b, true).backward(dx, dln1, x, a.ln1_mean, a.ln1_rstd, R);
  if (tpc_.sp) tpc_.flush_norm_grads();  // before the unit's gradients are handed to data parallelism
}

double Transformer::forward(const int32_t* ids, const int32_t* targets, int64_t B, int64_t T, bool train,
                           float dloss_scale) {
  return forward_units(0, num_units() - 1, ids, targets, nullptr, B, T, train, dloss_scale);
}

void Transformer::backward() { backward_units(0, num_units() - 1, nullptr); }

double Transformer::forward_units(int first, int last, const int32_t* ids, const int32_t* targets,
                                  const float* input, int64_t B, int64_t T, bool train, float dloss_scale) {
  const int hu = num_units() - 1;
  if (first < 0 || last > hu || first > last) throw std::invalid_argument("forward_units: bad unit range");
  ensure_buffers(B, T, first, last);
  cur_dloss_ = dloss_scale;
  Slot& s = *s_;
  const int64_t N = B * T, C = cfg_.n_embd, V = cfg_.vocab_size, Vp = Vp_l_, R = residual_rows(N);
  const bool gpt = cfg_.arch == Arch::GPT2;
  const bool bf = compute_ == DType::BF16;
  s.have_backward = false;

  if (first == 0) {  // unit 0: embedding
    if (device_inputs_) {
      dev::copy(dev_, s.ids.raw(), ids, static_cast<size_t>(N) * sizeof(int32_t));
    } else {
      for (int64_t i = 0; i < N; ++i)
        if (ids[i] < 0 || ids[i] >= V)
          throw std::out_of_range("token id " + std::to_string(ids[i]) + " at position " + std::to_string(i) +
                                  " is outside the vocabulary of " + std::to_string(V));
      dev::copy_from_host(dev_, s.ids.raw(), ids, static_cast<size_t>(N) * sizeof(int32_t));
    }
    const int32_t* ids_saved = s.ids.i32();
    if (hooks_) hooks_->pre_forward(0);
    float* x = s.block_out[0].f32();
    const int emb = unit_params_[0][0];
    VocabParallelEmbedding(tpc_, C, vocab_lo_, Vp_l_)
        .forward(x, ids_saved, bf ? static_cast<const void*>(wb(emb)) : wf(emb));
    if (gpt && cp_) {  // original positions of this cp rank's tokens (and SP: rows r*R ..)
      kt_->position_add_pos(x, wf(emb + 1), cp_pos_.data(), R, T, tpc_.sp ? tpc_.rank * R : 0, C);
    } else if (gpt && tpc_.sp) {  // this rank's rows are tokens r*R .. r*R + R-1 of the flattened [B, T]
      kt_->position_add_rows(x, wf(emb + 1), R, T, tpc_.rank * R, C);
    } else if (gpt) {
      kt_->position_add_forward(x, wf(emb + 1), B, T, C);
    }
    if (hooks_) hooks_->post_forward(0);
  } else {
    if (!input) throw std::invalid_argument("forward_units: a stage that starts after the embedding needs its input");
    dev::copy(dev_, s.block_out[first - 1].f32(), input, static_cast<size_t>(R * C) * sizeof(float));
  }
  // blocks
  for (int u = std::max(first, 1); u <= std::min(last, hu - 1); ++u) {
    const int64_t l = u - 1;
    if (hooks_) hooks_->pre_forward(u);
    BlockActivations& a = s.acts[l] ? *s.acts[l] : scratch_for(static_cast<int>(l));
    block_forward(static_cast<int>(l), s.block_out[l].f32(), a, s.block_out[l + 1].f32());
    if (hooks_) hooks_->post_forward(u);
  }
  if (last < hu) {
    s.have_backward = train;
    return 0.0;
  }
  // head
  if (hooks_) hooks_->pre_forward(hu);
  const int hb = unit_params_[hu][0];
  const float* xl = s.block_out[cfg_.n_layer].f32();
  // Sequence parallelism: the final norm on this rank's rows, gathered for the (vocab-parallel)
  // output projection, which needs every row; head_in keeps the gathered rows for its backward.
  float* hin = tpc_.sp ? bwd_ws_[6].f32() : s.head_in.f32();
  norm(hb, gpt ? hb + 1 : -1, false).forward(hin, s.head_mean, s.head_rstd, xl, R);
  if (tpc_.sp) {
    tpc_.gather_into(hin, s.head_in.f32());
    hin = s.head_in.f32();
  }
  if (bf) kt_->cast_f32_to_bf16(s.head_in_bf.bf(), hin, N * C);
  s.chunked = loss_chunk_ > 0 && targets;
  if (!s.chunked) {
    if (!s.logits.defined())  // chunked-head model asked for whole logits (sampling)
      s.logits = Tensor::empty({N, Vp}, DType::F32, MemCategory::Activations);
    if (bf)
      kt_->linear_forward_bf16(s.logits.f32(), s.head_in_bf.bf(), head_wb(), nullptr, N, C, Vp);
    else
      kt_->linear_forward(s.logits.f32(), hin, head_wf(), nullptr, N, C, Vp);
  }
  double loss = 0.0;
  if (targets) {
    if (device_inputs_) {
      dev::copy(dev_, s.targets.raw(), targets, static_cast<size_t>(N) * sizeof(int32_t));
    } else {
      for (int64_t i = 0; i < N; ++i)
        if (targets[i] >= V)
          throw std::out_of_range("target id " + std::to_string(targets[i]) + " is outside the vocabulary");
      dev::copy_from_host(dev_, s.targets.raw(), targets, static_cast<size_t>(N) * sizeof(int32_t));
    }
    // In bf16 the head's backward multiplies the logits' gradient in bf16: with the whole vocabulary
    // here (tp = 1) the loss rounds it as it writes it, saving the fp32 gradient and a cast pass.
    s.grad_bf16 = train && bf && !s.chunked && !tpc_.tp() && !(defer_emb_ && head_chunk_done_);
    if (s.chunked)
      chunked_head_forward(hin, train, dloss_scale);
    else if (s.grad_bf16)
      kt_->softmax_cross_entropy_bf16(s.logits.f32(), s.losses.f32(), s.targets.i32(), N, V, Vp, dloss_scale);
    else
      VocabParallelCrossEntropy(tpc_, V, vocab_lo_, Vp)
          .forward(s.logits.f32(), s.targets.i32(), s.losses.f32(), N, train, dloss_scale);
    if (loss_sink_ && train) kt_->accumulate(loss_sink_, s.losses.f32(), N);
    else loss = kt_->sum(s.losses.f32(), N) / static_cast<double>(N);
  }
  if (hooks_) hooks_->post_forward(hu);
  s.have_backward = train && targets;
  return loss;
}

// The head's output weight: the token embedding (tied; the replica when a pipeline cut them
// apart) or lm_head.
const float* Transformer::head_wf() {
  if (tied_w_.defined()) return tied_w_.f32();
  return wf(cfg_.tied_embeddings ? unit_params_[0][0] : unit_params_.back()[1]);
}
const bf16* Transformer::head_wb() const {
  if (tied_w_.defined()) return tied_w_.bf();
  return wb(cfg_.tied_embeddings ? unit_params_[0][0] : unit_params_.back()[1]);
}
const bf16* Transformer::head_grad_bf16() const { return reinterpret_cast<const bf16*>(s_->logits.f32()); }
float* Transformer::head_gp() const {
  if (tied_g_.defined()) return tied_g_.f32();
  return gp(cfg_.tied_embeddings ? unit_params_[0][0] : unit_params_.back()[1]);
}

void Transformer::backward_units(int first, int last, const float* dout) {
  Slot& s = *s_;
  if (!s.have_backward) throw std::logic_error("backward without a training forward (with targets at the head)");
  const int hu = num_units() - 1;
  if (first < 0 || last > hu || first > last) throw std::invalid_argument("backward_units: bad unit range");
  const int64_t B = B_, T = T_, N = B * T, C = cfg_.n_embd, Vp = Vp_l_, R = residual_rows(N);
  const bool gpt = cfg_.arch == Arch::GPT2;
  const bool bf = compute_ == DType::BF16;
  float* dx = dres_.f32();  // R rows
  if (last == hu) {
    const int hb = unit_params_[hu][0];
    if (hooks_) hooks_->pre_backward(hu);
    // The head input's gradient (with a vocab-parallel head: this rank's partial sums): computed by
    // the forward when the head is chunked, else here.
    float* dhin = s.chunked ? s.head_dx.f32() : bwd_ws_[0].f32();
    if (s.chunked) {
      // The weight gradient the forwards accumulated is added while the input gradient's sum over
      // the tp ranks runs (in vocabulary-row chunks, each handed over, when the embedding gradient
      // is deferred).
      const int h = tpc_.start_input_grad_sum(dhin);
      const int64_t rows = defer_emb_ && head_chunk_done_ ? std::clamp<int64_t>(head_chunk_rows_, 1, Vp) : Vp;
      for (int64_t r0 = 0; r0 < Vp; r0 += rows) {
        const int64_t cv = std::min(rows, Vp - r0);
        if (head_dw_pending_) kt_->accumulate(head_gp() + r0 * C, head_dw_.f32() + r0 * C, cv * C);
        if (defer_emb_ && head_chunk_done_) head_chunk_done_(r0, r0 + cv);
      }
      head_dw_pending_ = false;
      dhin = tpc_.input_grad_sum(dhin, h);
    } else if (defer_emb_ && head_chunk_done_) {  // tp = 1
      // In vocabulary-row chunks, each chunk's weight-gradient rows handed over when complete.
      dev::zero(dev_, dhin, static_cast<size_t>(N * C) * sizeof(float));
      const int64_t rows = std::clamp<int64_t>(head_chunk_rows_, 1, Vp);
      if (rows < Vp && head_chunk_buf_.numel() != N * rows)
        head_chunk_buf_ = Tensor::empty({N, rows}, DType::F32, MemCategory::Workspace);
      for (int64_t r0 = 0; r0 < Vp; r0 += rows) {
        const int64_t cv = std::min(rows, Vp - r0);
        const float* dl = s.logits.f32();
        if (s.grad_bf16 && cv == Vp) {
          kt_->linear_backward_bf16_dy(dhin, head_gp(), head_grad_bf16(), s.head_in_bf.bf(), head_wb(), N, C, Vp);
          head_chunk_done_(r0, r0 + cv);
          continue;
        }
        if (s.grad_bf16) {
          // The forward chose the bf16 gradient before the deferral was switched on (a schedule that
          // interleaves micro-batches): the chunk's columns, widened exactly (cast back unchanged).
          const bf16* g = head_grad_bf16();
          for (int64_t n = 0; n < N; ++n) kt_->cast_bf16_to_f32(head_chunk_buf_.f32() + n * cv, g + n * Vp + r0, cv);
          dl = head_chunk_buf_.f32();
        } else if (cv < Vp) {  // the chunk's columns of the logits' gradient, contiguous
          kt_->copy_columns(head_chunk_buf_.f32(), dl, N, Vp, r0, cv);
          dl = head_chunk_buf_.f32();
        }
        if (bf)
          kt_->linear_backward_bf16(dhin, head_gp() + r0 * C, nullptr, dl, s.head_in_bf.bf(), head_wb() + r0 * C, N, C, cv);
        else
          kt_->linear_backward(dhin, head_gp() + r0 * C, nullptr, dl, s.head_in.f32(), head_wf() + r0 * C, N, C, cv);
        head_chunk_done_(r0, r0 + cv);
      }
    } else if (s.grad_bf16) {
      dev::zero(dev_, dhin, static_cast<size_t>(N * C) * sizeof(float));
      kt_->linear_backward_bf16_dy(dhin, head_gp(), head_grad_bf16(), s.head_in_bf.bf(), head_wb(), N, C, Vp);
    } else {
      // The head is column-parallel over the vocabulary; its input was kept with every row.
      Weight w;
      if (bf)
        w.wb = head_wb();
      else
        w.wf = head_wf();
      w.dw = head_gp();
      w.out = Vp;
      dhin = ColumnParallelLinear(tpc_, C).backward(bf ? s.head_in_bf : s.head_in, {{s.logits.f32(), w}}, dhin, false);
    }
    dev::zero(dev_, dx, static_cast<size_t>(R * C) * sizeof(float));
    norm(hb, gpt ? hb + 1 : -1, true).backward(dx, dhin, s.block_out[cfg_.n_layer].f32(), s.head_mean, s.head_rstd, R);
    if (hooks_) hooks_->post_backward(hu);
  } else {
    if (!dout) throw std::invalid_argument("backward_units: a stage that ends before the head needs its output gradient");
    dev::copy(dev_, dx, dout, static_cast<size_t>(R * C) * sizeof(float));
  }
  for (int u = std::min(last, hu - 1); u >= std::max(first, 1); --u) {
    const int64_t l = u - 1;
    if (hooks_) hooks_->pre_backward(u);
    BlockActivations* a = s.acts[l].get();
    if (!a) {  // recompute this block's forward from its saved input
      a = &scratch_for(static_cast<int>(l));
      recomputing_ = true;
      block_forward(static_cast<int>(l), s.block_out[l].f32(), *a, bwd_ws_[6].f32() /*discarded output*/);
      recomputing_ = false;
    }
    block_backward(static_cast<int>(l), s.block_out[l].f32(), *a, dx);
    if (hooks_) hooks_->post_backward(u);
  }
  if (first == 0) {
    const int emb = unit_params_[0][0];
    if (hooks_) hooks_->pre_backward(0);
    // Every token's gradient (any may index this rank's vocabulary rows).
    VocabParallelEmbedding embedding(tpc_, C, vocab_lo_, Vp_l_);
    const float* dall = embedding.grad_rows(dx);
    if (defer_emb_) {  // tp = 1: kept for the caller (see set_defer_embedding_grad)
      if (!deferred_rows_.defined() || deferred_rows_.numel() != N * C) {
        deferred_rows_ = Tensor::empty({N, C}, DType::F32, MemCategory::Workspace);
        deferred_ids_ = Tensor::empty({N}, DType::I32, MemCategory::Workspace);
      }
      dev::copy(dev_, deferred_rows_.f32(), dall, static_cast<size_t>(N * C) * sizeof(float));
      dev::copy(dev_, deferred_ids_.raw(), s.ids.raw(), static_cast<size_t>(N) * sizeof(int32_t));
      deferred_n_ = N;
    } else {
      embedding.backward(gp(emb), dall, s.ids.i32());
    }
    if (extra_emb_grad_) {  // the pipeline's head contribution to a tied embedding
      kt_->accumulate(gp(emb), extra_emb_grad_, Vp * C);
      extra_emb_grad_ = nullptr;
    }
    if (gpt && cp_)
      kt_->position_backward_pos(gp(emb + 1), dall, cp_pos_.data(), B, T, C);
    else if (gpt)
      kt_->position_add_backward(gp(emb + 1), dall, B, T, C);
    if (hooks_) hooks_->post_backward(0);
  }
  s.have_backward = false;
}

bool Transformer::can_defer_embedding_grad() const {
  return cfg_.tied_embeddings && tpc_.size == 1 && owned_.front() && owned_.back();
}

const float* Transformer::unit_output(int u) const {
  if (u < 0 || u > cfg_.n_layer || !s_->block_out[u].defined())
    throw std::logic_error("unit_output: no output of unit " + std::to_string(u) + " on this slot");
  return s_->block_out[u].f32();
}

const float* Transformer::input_grad() const { return dres_.f32(); }

void Transformer::load_tied_replica(const Transformer& full_layout, const float* full) {
  if (!tied_w_.defined()) return;
  const ParamInfo& fp = full_layout.params().at(full_layout.unit_params_[0][0]);
  const int64_t C = cfg_.n_embd, rows = Vp_l_;
  // This tp rank's rows (vocab-parallel split); rows past the full table stay zero.
  Tensor tmp = Tensor::zeros({rows, C}, DType::F32, MemCategory::Workspace);
  const int64_t full_rows = fp.shape[0];
  const int64_t have = std::clamp<int64_t>(full_rows - vocab_lo_, 0, rows);
  dev::copy(dev_, tmp.f32(), full + fp.offset + vocab_lo_ * C, static_cast<size_t>(have * C) * sizeof(float));
  if (compute_ == DType::F32)
    dev::copy(dev_, tied_w_.f32(), tmp.f32(), static_cast<size_t>(rows * C) * sizeof(float));
  else
    kt_->cast_f32_to_bf16(tied_w_.bf(), tmp.f32(), rows * C);
}

namespace {
// Calls f(full_index, local_index, count) for the contiguous runs that make up rank r's share of
// parameter p (local shape `lp`, full shape `fp`) under tensor parallelism of size t.
template <typename Fn>
void for_each_tp_run(const ParamInfo& lp, const ParamInfo& fp, int r, int t, const ModelConfig& c, Fn f) {
  const int64_t rows = lp.shape[0], cols = lp.shape.size() > 1 ? lp.numel / rows : 1;
  switch (lp.tp_split) {
    case TpSplit::None:
      f(0, 0, lp.numel);
      break;
    case TpSplit::Rows:
      f(r * rows * cols, 0, rows * cols);
      break;
    case TpSplit::Cols: {
      const int64_t full_cols = fp.numel / fp.shape[0];
      for (int64_t i = 0; i < rows; ++i) f(i * full_cols + r * cols, i * cols, cols);
      break;
    }
    case TpSplit::QkvRows: {  // [q; k; v] blocks of nh*hd, nkv*hd, nkv*hd rows, each split by heads
      const int64_t hd = c.head_dim();
      const int64_t full_blocks[3] = {c.n_head * hd, c.n_kv_head * hd, c.n_kv_head * hd};
      int64_t full_off = 0, local_off = 0;
      for (int b = 0; b < 3; ++b) {
        const int64_t lrows = full_blocks[b] / t;
        f((full_off + r * lrows) * cols, local_off * cols, lrows * cols);
        full_off += full_blocks[b];
        local_off += lrows;
      }
      break;
    }
  }
}
}  // namespace

std::vector<Transformer::TpRows> Transformer::tp_row_runs(const ParamInfo& lp, int64_t* col0) const {
  const int r = tpc_.rank, t = tpc_.size;
  const int64_t rows = lp.shape[0], cols = lp.shape.size() > 1 ? lp.numel / rows : 1;
  *col0 = 0;
  if (t == 1) return {{0, rows, 0}};  // unsplit: the parameter itself
  switch (lp.tp_split) {
    case TpSplit::None:
      return {{0, rows, 0}};
    case TpSplit::Rows:
      return {{0, rows, r * rows}};
    case TpSplit::Cols:
      *col0 = r * cols;
      return {{0, rows, 0}};
    case TpSplit::QkvRows: {  // as for_each_tp_run: q, k and v blocks each split by heads
      const int64_t hd = cfg_.head_dim();
      const int64_t full_blocks[3] = {cfg_.n_head * hd, cfg_.n_kv_head * hd, cfg_.n_kv_head * hd};
      std::vector<TpRows> out;
      int64_t full_off = 0, local_off = 0;
      for (int b = 0; b < 3; ++b) {
        const int64_t lrows = full_blocks[b] / t;
        out.push_back({local_off, lrows, full_off + r * lrows});
        full_off += full_blocks[b];
        local_off += lrows;
      }
      return out;
    }
  }
  return {};
}

void Transformer::shard_unit_from_full(const Transformer& full_layout, int u, const float* full, float* local) const {
  const int64_t lo = units_[u].offset, fo = full_layout.units_[u].offset;
  dev::zero(dev_, local, static_cast<size_t>(units_[u].numel) * sizeof(float));
  for (const auto& lp : params_) {
    if (lp.unit != u) continue;
    const ParamInfo& fp = full_layout.param(lp.name);
    for_each_tp_run(lp, fp, tpc_.rank, tpc_.size, cfg_, [&](int64_t fi, int64_t li, int64_t n) {
      dev::copy(dev_, local + (lp.offset - lo) + li, full + (fp.offset - fo) + fi, static_cast<size_t>(n) * sizeof(float));
    });
  }
}

void Transformer::shard_param_from_full(const ParamInfo& lp, const ParamInfo& fp, const float* full, float* local) const {
  for_each_tp_run(lp, fp, tpc_.rank, tpc_.size, cfg_, [&](int64_t fi, int64_t li, int64_t n) {
    dev::copy(dev_, local + li, full + fi, static_cast<size_t>(n) * sizeof(float));
  });
}

void Transformer::assemble_param_full(const ParamInfo& lp, const ParamInfo& fp, const std::vector<const float*>& locals,
                                      float* full) const {
  if (static_cast<int>(locals.size()) != tpc_.size) throw std::invalid_argument("assemble_param_full: one buffer per tp rank");
  for (int r = 0; r < tpc_.size; ++r)
    for_each_tp_run(lp, fp, r, tpc_.size, cfg_, [&](int64_t fi, int64_t li, int64_t n) {
      dev::copy(dev_, full + fi, locals[r] + li, static_cast<size_t>(n) * sizeof(float));
    });
}

void Transformer::assemble_unit_full(const Transformer& full_layout, int u, const std::vector<const float*>& locals,
                                     float* full) const {
  if (static_cast<int>(locals.size()) != tpc_.size) throw std::invalid_argument("assemble_unit_full: one buffer per tp rank");
  const int64_t lo = units_[u].offset, fo = full_layout.units_[u].offset;
  dev::zero(dev_, full, static_cast<size_t>(full_layout.units_[u].numel) * sizeof(float));
  for (const auto& lp : params_) {
    if (lp.unit != u) continue;
    const ParamInfo& fp = full_layout.param(lp.name);
    for (int r = 0; r < tpc_.size; ++r)
      for_each_tp_run(lp, fp, r, tpc_.size, cfg_, [&](int64_t fi, int64_t li, int64_t n) {
        dev::copy(dev_, full + (fp.offset - fo) + fi, locals[r] + (lp.offset - lo) + li, static_cast<size_t>(n) * sizeof(float));
      });
  }
}

const float* Transformer::logits() const { return s_->logits.f32(); }

int64_t Transformer::activation_bytes_saved() const {
  if (!scratch_acts_) return 0;
  int64_t recomputed = 0;
  for (int64_t l = 0; l < cfg_.n_layer; ++l) recomputed += owned_[l + 1] && recomputes(static_cast<int>(l)) ? 1 : 0;
  return std::max<int64_t>(0, recomputed - 1) * scratch_acts_->bytes();
}

int64_t Transformer::activation_bytes() const {
  int64_t b = 0;
  for (const auto& sp : slots_) {
    for (const auto& a : sp->acts)
      if (a) b += a->bytes();
    for (const auto& t : sp->block_out)
      if (t.defined()) b += static_cast<int64_t>(t.nbytes());
    for (const Tensor* t : {&sp->ids, &sp->targets, &sp->head_in, &sp->head_in_bf, &sp->head_mean, &sp->head_rstd,
                            &sp->logits, &sp->losses, &sp->head_dx})
      if (t->defined()) b += static_cast<int64_t>(t->nbytes());
  }
  if (scratch_acts_) b += scratch_acts_->bytes();
  if (scratch_moe_acts_) b += scratch_moe_acts_->bytes();
  return b;
}

}  // namespace mt

namespace mt {

Tensor& Transformer::moe_ws(size_t i, int64_t n, DType dt) {
  if (moe_ws_.size() <= i) moe_ws_.resize(i + 1);
  Tensor& t = moe_ws_[i];
  n = std::max<int64_t>(n, 1);
  if (!t.defined() || t.numel() < n || t.dtype() != dt) t = Tensor::empty({n}, dt, MemCategory::Workspace);
  return t;
}

// An expert's capacity for n tokens' choices: ceil(factor x n k / E), or every choice (dropless).
int64_t Transformer::moe_capacity(int64_t n) const {
  const int64_t k = cfg_.moe_top_k;
  if (cfg_.moe_capacity_factor <= 0) return n * k;
  return static_cast<int64_t>(std::ceil(static_cast<double>(cfg_.moe_capacity_factor) * static_cast<double>(n * k) /
                                        static_cast<double>(cfg_.moe_experts)));
}

// Routed rows an MoE layer's activations are first sized for: every choice (dropless or with a
// capacity: a rank may receive up to that many with ep), or exactly E x capacity when padded (what
// a rank sends, and with ep receives).
int64_t Transformer::moe_rows_hint(int64_t n) const {
  return cfg_.moe_pad_to_capacity ? cfg_.moe_experts * moe_capacity(n) : n * cfg_.moe_top_k;
}

Transformer::MoeStats Transformer::take_moe_stats() {
  MoeStats s = std::move(moe_stats_);
  moe_stats_ = MoeStats{};
  if (s.microbatches > 0) {
    s.aux_loss /= static_cast<double>(s.microbatches);
    s.z_loss /= static_cast<double>(s.microbatches);
  }
  return s;
}

// A routed expert's weight: from the flat buffers, or with expert parallelism from the expert
// buffers (indices into expert_params_).
Weight Transformer::expert_weight(int w, int b, int64_t out, bool grads) {
  if (!experts_apart()) return weight(w, b, out, grads);
  Weight r;
  r.out = out;
  const ParamInfo& pw = expert_params_[w];
  if (compute_ == DType::BF16)
    r.wb = ewb_.bf() + pw.offset;
  else
    r.wf = ew_.f32() + pw.offset;
  if (grads) {
    r.dw = eg_.f32() + pw.offset;
    if (b >= 0) r.db = eg_.f32() + expert_params_[b].offset;
  } else if (b >= 0) {
    const ParamInfo& pb = expert_params_[b];
    if (compute_ == DType::BF16) {  // computed from the bf16 copy, as the flat buffers' biases are
      Tensor& t = eupcast_[b];
      if (!t.defined()) t = Tensor::empty({pb.numel}, DType::F32, MemCategory::Workspace);
      kt_->cast_bf16_to_f32(t.f32(), ewb_.bf() + pb.offset, pb.numel);
      r.b = t.f32();
    } else {
      r.b = ew_.f32() + pb.offset;
    }
  }
  return r;
}

// The MoE layer of block `layer` on the normalised input x ([N, C], compute dtype): out = the
// router-weighted sum of each token's k experts' outputs plus the shared experts' output.
//   router   logits = ln2 @ Wr^T (fp32), scores, top-k and normalised weights (moe_router_forward)
//   dispatch the host reads the choices and orders them expert by expert (token order inside an
//            expert), dropping what exceeds the capacity; the input rows are gathered in that order
//   exchange with expert parallelism, the rows of each rank's experts go there (variable-size
//            all-to-all, counts exchanged first) and are put in expert order there
//   experts  one GEMM per expert over its contiguous rows (grouped: no per-token loop)
//   return   the outputs travel back the same way
//   combine  out[t] = sum_j w[t, j] * y[row of (t, j)]
// x: the normalised input of every token of the micro-batch ([N, C], compute dtype: a.ln2, or under
// sequence parallelism its rows gathered over tp); out: this rank's rows of the output.
void Transformer::moe_forward(int layer, const BlockParams& p, BlockActivations& a, const Tensor& x, float* out) {
  const int64_t N = B_ * T_, C = cfg_.n_embd, E = cfg_.moe_experts, k = cfg_.moe_top_k, Fe = Fe_l_;
  const bool gpt = cfg_.arch == Arch::GPT2;
  const bool bf = compute_ == DType::BF16;
  const bool ep = experts_apart();
  const int sig = cfg_.moe_sigmoid ? 1 : 0;
  const int64_t esz = bf ? 2 : 4;
  a.dloss = cur_dloss_;
  if (ep && !ep_comm_) throw std::logic_error("expert parallelism without an expert communicator (set_expert_comm)");
  // Router, in fp32 from the stored (compute-dtype) normalised input.
  const float* xin = nullptr;
  if (bf) {
    float* t = moe_ws(0, N * C).f32();
    kt_->cast_bf16_to_f32(t, x.bf(), N * C);
    xin = t;
  } else {
    xin = x.f32();
  }
  kt_->linear_forward(a.r_logits.f32(), xin, wf(p.router), nullptr, N, C, E);
  kt_->moe_router_forward(a.r_scores.f32(), a.r_idx.i32(), a.r_w.f32(), a.r_lse.f32(), a.r_logits.f32(), N, E,
                          k, sig);
  // Dispatch plan on the host: every choice's row, expert by expert.
  std::vector<int32_t> idx(static_cast<size_t>(N * k));
  if (dev_ == Device::Meta) {  // nothing to read: an even spread
    for (int64_t i = 0; i < N * k; ++i) idx[i] = static_cast<int32_t>(i % E);
  } else {
    dev::copy_to_host(dev_, idx.data(), a.r_idx.raw(), idx.size() * sizeof(int32_t));
  }
  a.counts.assign(static_cast<size_t>(E), 0);
  for (int32_t e : idx) ++a.counts[e];
  moe_counts_over_cp(a);
  // With model.moe_pad_to_capacity every expert gets exactly `cap` rows, the kept choices' rows
  // first, then zero rows (order -1); their outputs are never combined and their gradients are zero.
  const bool pad = cfg_.moe_pad_to_capacity;
  const int64_t cap = moe_capacity(N);
  std::vector<int64_t> off(static_cast<size_t>(E) + 1, 0), fill(static_cast<size_t>(E), 0), kept(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) {
    kept[e] = pad ? cap : std::min(a.counts[e], cap);  // rows sent to expert e
    off[e + 1] = off[e] + kept[e];
  }
  const int64_t Ms = off[E];  // rows this rank's tokens send (to every expert)
  std::vector<int32_t> pos(static_cast<size_t>(N * k)), order(static_cast<size_t>(std::max<int64_t>(Ms, 1)), -1);
  int64_t dropped = 0;
  for (int64_t t = 0; t < N; ++t)
    for (int64_t j = 0; j < k; ++j) {
      const int32_t e = idx[t * k + j];
      if (fill[e] < cap) {
        const int64_t r = off[e] + fill[e]++;
        pos[t * k + j] = static_cast<int32_t>(r);
        order[r] = static_cast<int32_t>(t);
      } else {
        pos[t * k + j] = -1;
        ++dropped;
      }
    }
  dev::copy_from_host(dev_, a.r_pos.raw(), pos.data(), pos.size() * sizeof(int32_t));
  a.Msend = Ms;
  a.kept.assign(static_cast<size_t>(E_l_), 0);
  if (!ep) {
    for (int64_t e = 0; e < E_l_; ++e) a.kept[e] = kept[E_lo_ + e];
    a.M = Ms;
    alloc_moe_acts(a, cfg_, compute_, N, Ms, Fe);
    dev::copy_from_host(dev_, a.order.raw(), order.data(), static_cast<size_t>(Ms) * sizeof(int32_t));
    kt_->moe_gather_rows(a.xs.raw(), x.raw(), a.order.i32(), Ms, C * esz);
  } else {
    // Counts first: every ep rank's rows per expert; then the rows themselves.
    const int R = ep_comm_->size();
    std::vector<int64_t> K(static_cast<size_t>(R * E), cap);
    if (!pad) ep_comm_->all_gather_counts(kept.data(), K.data(), E);  // padded: every count is cap
    a.send_rows.assign(static_cast<size_t>(R), 0);
    a.recv_rows.assign(static_cast<size_t>(R), 0);
    for (int r = 0; r < R; ++r)
      for (int64_t e = 0; e < E_l_; ++e) {
        a.send_rows[r] += kept[r * E_l_ + e];
        a.recv_rows[r] += K[r * E + E_lo_ + e];
      }
    int64_t Mr = 0;
    for (int r = 0; r < R; ++r) Mr += a.recv_rows[r];
    // Received rows come by source rank, each source's in expert order; `perm` puts them in
    // expert order (source order inside an expert).
    std::vector<int32_t> perm, inv(static_cast<size_t>(std::max<int64_t>(Mr, 1)));
    perm.reserve(static_cast<size_t>(Mr));
    for (int64_t e = 0; e < E_l_; ++e) {
      int64_t base = 0;
      for (int r = 0; r < R; ++r) {
        int64_t within = 0;
        for (int64_t f = 0; f < e; ++f) within += K[r * E + E_lo_ + f];
        for (int64_t i = 0; i < K[r * E + E_lo_ + e]; ++i) perm.push_back(static_cast<int32_t>(base + within + i));
        base += a.recv_rows[r];
      }
      for (int r = 0; r < R; ++r) a.kept[e] += K[r * E + E_lo_ + e];
    }
    for (int64_t i = 0; i < Mr; ++i) inv[perm[i]] = static_cast<int32_t>(i);
    a.M = Mr;
    alloc_moe_acts(a, cfg_, compute_, N, Mr, Fe);
    if (!a.inv.defined() || a.inv.numel() < std::max<int64_t>(Mr, 1))
      a.inv = Tensor::empty({std::max<int64_t>(Mr, 1)}, DType::I32, MemCategory::Activations);
    if (!a.ysend.defined() || a.ysend.numel() < std::max<int64_t>(Ms, 1) * C)
      a.ysend = Tensor::empty({std::max<int64_t>(Ms, 1), C}, DType::F32, MemCategory::Activations);
    dev::copy_from_host(dev_, a.order.raw(), perm.data(), static_cast<size_t>(Mr) * sizeof(int32_t));
    dev::copy_from_host(dev_, a.inv.raw(), inv.data(), static_cast<size_t>(Mr) * sizeof(int32_t));
    Tensor& tok = moe_ws(15, Ms, DType::I32);
    dev::copy_from_host(dev_, tok.raw(), order.data(), static_cast<size_t>(Ms) * sizeof(int32_t));
    void* xsend = moe_ws(16, Ms * C, compute_).raw();
    void* xrecv = moe_ws(17, Mr * C, compute_).raw();
    kt_->moe_gather_rows(xsend, x.raw(), tok.i32(), Ms, C * esz);
    ep_comm_->all_to_all_v(xsend, a.send_rows.data(), xrecv, a.recv_rows.data(), C, compute_);
    kt_->moe_gather_rows(a.xs.raw(), xrecv, a.order.i32(), Mr, C * esz);
  }
  const int64_t M = a.M;
  // Experts: each one's rows are contiguous.
  auto lin = [&](float* y, const Tensor& x, int64_t row0, const Weight& w, int64_t n, int64_t in) {
    if (n == 0) return;
    if (bf)
      kt_->linear_forward_bf16(y, x.bf() + row0 * in, w.wb, w.b, n, in, w.out);
    else
      kt_->linear_forward(y, x.f32() + row0 * in, w.wf, w.b, n, in, w.out);
  };
  const int st = expert_stride(cfg_);
  int64_t r0 = 0;
  for (int64_t e = 0; e < E_l_; ++e) {
    const int q = p.expert0 + static_cast<int>(e) * st;
    const int64_t n = a.kept[e];
    if (gpt) {
      lin(a.h1.f32() + r0 * Fe, a.xs, r0, expert_weight(q, q + 1, Fe, false), n, C);
    } else {
      lin(a.h1.f32() + r0 * Fe, a.xs, r0, expert_weight(q, -1, Fe, false), n, C);      // w1: gate
      lin(a.h3.f32() + r0 * Fe, a.xs, r0, expert_weight(q + 2, -1, Fe, false), n, C);  // w3: up
    }
    r0 += n;
  }
  float* act = bf ? moe_ws(1, M * Fe).f32() : a.xact.f32();
  if (gpt)
    kt_->gelu_forward(act, a.h1.f32(), M * Fe);
  else
    kt_->swiglu_forward(act, a.h1.f32(), a.h3.f32(), M * Fe);
  if (bf) kt_->cast_f32_to_bf16(a.xact.bf(), act, M * Fe);
  r0 = 0;
  for (int64_t e = 0; e < E_l_; ++e) {
    const int q = p.expert0 + static_cast<int>(e) * st;
    const int64_t n = a.kept[e];
    if (gpt)  // row-parallel over tp: the bias is added by one tp rank only (the outputs are summed)
      lin(a.y.f32() + r0 * C, a.xact, r0, expert_weight(q + 2, tpc_.rank == 0 ? q + 3 : -1, C, false), n, Fe);
    else
      lin(a.y.f32() + r0 * C, a.xact, r0, expert_weight(q + 1, -1, C, false), n, Fe);  // w2: down
    r0 += n;
  }
  const float* yback = a.y.f32();
  if (ep) {  // back to the ranks the rows came from, in the order they were sent
    float* yrecv = moe_ws(18, M * C).f32();
    kt_->moe_gather_rows(yrecv, a.y.raw(), a.inv.i32(), M, C * 4);
    ep_comm_->all_to_all_v(yrecv, a.recv_rows.data(), a.ysend.f32(), a.send_rows.data(), C, DType::F32);
    yback = a.ysend.f32();
  }
  float* y = tpc_.partial_buffer(out);  // every token's output (this tp rank's partial sums)
  dev::zero(dev_, y, static_cast<size_t>(N * C) * sizeof(float));
  kt_->moe_combine(y, yback, a.r_pos.i32(), a.r_w.f32(), N, k, C);
  // Shared experts: a dense MLP of width Fs on every token.
  const int64_t Fs = Fs_l_;
  if (Fs > 0) {
    float* so = moe_ws(13, N * C).f32();
    float* sact = bf ? moe_ws(1, std::max(M * Fe, N * Fs)).f32() : a.act.f32();
    if (gpt) {
      lin(a.fc.f32(), x, 0, weight(p.fc_w, p.fc_b, Fs, false), N, C);
      kt_->gelu_forward(sact, a.fc.f32(), N * Fs);
    } else {
      lin(a.fc.f32(), x, 0, weight(p.fc_w, -1, Fs, false), N, C);
      lin(a.up.f32(), x, 0, weight(p.up_w, -1, Fs, false), N, C);
      kt_->swiglu_forward(sact, a.fc.f32(), a.up.f32(), N * Fs);
    }
    if (bf) kt_->cast_f32_to_bf16(a.act.bf(), sact, N * Fs);
    lin(so, a.act, 0, weight(p.down_w, tpc_.rank == 0 ? p.down_b : -1, C, false), N, Fs);
    kt_->accumulate(y, so, N * C);
  }
  // Tensor parallelism: every expert's hidden width is split (w1 / w3 / c_fc by rows, w2 / c_proj
  // by columns), so each tp rank holds a partial sum of the layer's output: all-reduced, or under
  // SP reduce-scattered to this rank's rows (the row-parallel layer's reduction).
  tpc_.reduce_partial(y, out);
  if (recomputing_) return;
  // Statistics and the auxiliary losses' values (their gradients are applied in backward).
  if (moe_stats_.layers.empty() || moe_stats_.layers.front() == layer) ++moe_stats_.microbatches;
  size_t li = 0;
  while (li < moe_stats_.layers.size() && moe_stats_.layers[li] != layer) ++li;
  if (li == moe_stats_.layers.size()) {
    moe_stats_.layers.push_back(layer);
    moe_stats_.tokens.emplace_back(static_cast<size_t>(E), 0);
  }
  for (int64_t e = 0; e < E; ++e) moe_stats_.tokens[li][e] += a.counts[e];
  moe_stats_.dropped += dropped;
  Tensor& P = moe_ws(2, E);  // before the dry run's return: the same workspace
  if (dev_ == Device::Meta) return;
  kt_->moe_balance_probs(P.f32(), a.r_scores.f32(), N, E, sig);
  std::vector<float> hp(static_cast<size_t>(E)), hl(static_cast<size_t>(N));
  dev::copy_to_host(dev_, hp.data(), P.raw(), hp.size() * sizeof(float));
  dev::copy_to_host(dev_, hl.data(), a.r_lse.raw(), hl.size() * sizeof(float));
  // With cp this rank's share of the whole micro-batch's losses (its tokens' part of P_e and of the
  // z-loss's mean, f_e over every cp rank's choices): the shares sum to the micro-batch's losses.
  const double Nall = static_cast<double>(N) * (cp_ ? cp_->size() : 1);
  double aux = 0, z = 0;
  for (int64_t e = 0; e < E; ++e) aux += static_cast<double>(a.counts_all[e]) / (Nall * k) * hp[e];
  for (float v : hl) z += static_cast<double>(v) * v;
  moe_stats_.aux_loss += static_cast<double>(E) * aux * (static_cast<double>(N) / Nall);
  moe_stats_.z_loss += z / Nall;
}

// f_e of the load-balancing loss counts the whole micro-batch's choices: with context parallelism
// every cp rank routes its chunks of the same sequences, so the counts are summed over the cp ranks
// (Megatron-Core reduces them over its tp x cp group; the tp ranks here route the same tokens).
void Transformer::moe_counts_over_cp(BlockActivations& a) {
  a.counts_all = a.counts;
  if (!cp_) return;
  const int64_t E = cfg_.moe_experts;
  const int n = cp_->size();
  std::vector<float> mine(a.counts.begin(), a.counts.end()), all(static_cast<size_t>(n * E), 0.0f);
  cp_->all_gather(mine.data(), all.data(), E);  // host counts, as the ep counts' all-gather
  for (int64_t e = 0; e < E; ++e) {
    int64_t c = 0;
    for (int r = 0; r < n; ++r) c += static_cast<int64_t>(all[static_cast<size_t>(r * E + e)]);
    a.counts_all[e] = c;
  }
}

// dout_rows: the gradient of this rank's rows of the MoE layer's output; dln2: [N, C] workspace.
// Returns the gradient of the layer's input, summed over tp (this rank's rows under sequence
// parallelism, as the column-parallel layer's backward returns it). The exchanges of the forward
// run in reverse: the output gradients go to the experts' ranks, the input gradients come back.
const float* Transformer::moe_backward(int layer, const BlockParams& p, BlockActivations& a, const float* dout_rows,
                                       float* dln2) {
  (void)layer;
  const int64_t N = B_ * T_, C = cfg_.n_embd, E = cfg_.moe_experts, k = cfg_.moe_top_k, Fe = Fe_l_, M = a.M;
  const int64_t Ms = a.Msend;
  const bool gpt = cfg_.arch == Arch::GPT2;
  const bool bf = compute_ == DType::BF16;
  const bool ep = experts_apart();
  const int sig = cfg_.moe_sigmoid ? 1 : 0;
  auto linb = [&](float* dx, const Weight& w, const float* dy, const Tensor& x, int64_t row0, int64_t n, int64_t in) {
    if (n == 0) return;
    if (bf)
      kt_->linear_backward_bf16(dx, w.dw, w.db, dy, x.bf() + row0 * in, w.wb, n, in, w.out);
    else
      kt_->linear_backward(dx, w.dw, w.db, dy, x.f32() + row0 * in, w.wf, n, in, w.out);
  };
  // Under SP every token's output gradient and input (the saved rows gathered again), as the
  // dense MLP's row- and column-parallel layers gather them.
  const float* dout = tpc_.gather_grad(dout_rows);
  if (tpc_.sp) tpc_.comm->wait(tpc_.start_regather(a.ln2));
  const Tensor& x = tpc_.sp ? tpc_.full_compute() : a.ln2;
  dev::zero(dev_, dln2, static_cast<size_t>(N * C) * sizeof(float));
  // Shared experts.
  const int64_t Fs = Fs_l_;
  if (Fs > 0) {
    float* sdact = moe_ws(10, N * Fs).f32();
    float* sdfc = moe_ws(11, N * Fs).f32();
    dev::zero(dev_, sdact, static_cast<size_t>(N * Fs) * sizeof(float));
    dev::zero(dev_, sdfc, static_cast<size_t>(N * Fs) * sizeof(float));
    linb(sdact, weight(p.down_w, p.down_b, C, true), dout, a.act, 0, N, Fs);
    if (gpt) {
      kt_->gelu_backward(sdfc, a.fc.f32(), sdact, N * Fs);
      linb(dln2, weight(p.fc_w, p.fc_b, Fs, true), sdfc, x, 0, N, C);
    } else {
      float* sdup = moe_ws(12, N * Fs).f32();
      dev::zero(dev_, sdup, static_cast<size_t>(N * Fs) * sizeof(float));
      kt_->swiglu_backward(sdfc, sdup, sdact, a.fc.f32(), a.up.f32(), N * Fs);
      linb(dln2, weight(p.fc_w, -1, Fs, true), sdfc, x, 0, N, C);
      linb(dln2, weight(p.up_w, -1, Fs, true), sdup, x, 0, N, C);
    }
  }
  // Combine: the routed rows' output gradients (in the order sent) and the router weights' gradients.
  float* dw = moe_ws(8, N * k).f32();
  float* dy = moe_ws(3, M * C).f32();  // in expert order
  const bool pad = cfg_.moe_pad_to_capacity;  // padding rows get no gradient: zero, not left unwritten
  if (!ep) {
    if (pad) dev::zero(dev_, dy, static_cast<size_t>(M * C) * sizeof(float));
    kt_->moe_combine_backward(dy, dw, dout, a.y.f32(), a.r_pos.i32(), a.r_w.f32(), N, k, C);
    if (tpc_.tp()) tpc_.comm->all_reduce_sum(dw, N * k);  // <dout, y> over the tp ranks' partial outputs
  } else {
    float* dysend = moe_ws(19, Ms * C).f32();
    float* dyrecv = moe_ws(18, M * C).f32();
    if (pad) dev::zero(dev_, dysend, static_cast<size_t>(Ms * C) * sizeof(float));
    kt_->moe_combine_backward(dysend, dw, dout, a.ysend.f32(), a.r_pos.i32(), a.r_w.f32(), N, k, C);
    // With tp the returned outputs are this tp rank's partial sums (its slice of every expert, as
    // the ep peers sharing its tp rank computed them): <dout, y> is summed over the tp ranks.
    if (tpc_.tp()) tpc_.comm->all_reduce_sum(dw, N * k);
    ep_comm_->all_to_all_v(dysend, a.send_rows.data(), dyrecv, a.recv_rows.data(), C, DType::F32);
    kt_->moe_gather_rows(dy, dyrecv, a.order.i32(), M, C * 4);
  }
  // Experts, in the forward's row order.
  float* dact = moe_ws(4, M * Fe).f32();
  float* dh1 = moe_ws(5, M * Fe).f32();
  float* dxs = moe_ws(7, M * C).f32();
  dev::zero(dev_, dact, static_cast<size_t>(M * Fe) * sizeof(float));
  dev::zero(dev_, dh1, static_cast<size_t>(M * Fe) * sizeof(float));
  dev::zero(dev_, dxs, static_cast<size_t>(M * C) * sizeof(float));
  const int st = expert_stride(cfg_);
  int64_t r0 = 0;
  for (int64_t e = 0; e < E_l_; ++e) {
    const int q = p.expert0 + static_cast<int>(e) * st;
    const int64_t n = a.kept[e];
    const Weight w2 = gpt ? expert_weight(q + 2, q + 3, C, true) : expert_weight(q + 1, -1, C, true);
    linb(dact + r0 * Fe, w2, dy + r0 * C, a.xact, r0, n, Fe);
    r0 += n;
  }
  float* dh3 = nullptr;
  if (gpt) {
    kt_->gelu_backward(dh1, a.h1.f32(), dact, M * Fe);
  } else {
    dh3 = moe_ws(6, M * Fe).f32();
    dev::zero(dev_, dh3, static_cast<size_t>(M * Fe) * sizeof(float));
    kt_->swiglu_backward(dh1, dh3, dact, a.h1.f32(), a.h3.f32(), M * Fe);
  }
  r0 = 0;
  for (int64_t e = 0; e < E_l_; ++e) {
    const int q = p.expert0 + static_cast<int>(e) * st;
    const int64_t n = a.kept[e];
    if (gpt) {
      linb(dxs + r0 * C, expert_weight(q, q + 1, Fe, true), dh1 + r0 * Fe, a.xs, r0, n, C);
    } else {
      linb(dxs + r0 * C, expert_weight(q, -1, Fe, true), dh1 + r0 * Fe, a.xs, r0, n, C);
      linb(dxs + r0 * C, expert_weight(q + 2, -1, Fe, true), dh3 + r0 * Fe, a.xs, r0, n, C);
    }
    r0 += n;
  }
  // Dispatch backward: each token collects its rows' input gradients.
  const float* dxback = dxs;
  if (ep) {
    float* dxrecv = moe_ws(18, M * C).f32();
    float* dxsend = moe_ws(19, Ms * C).f32();
    kt_->moe_gather_rows(dxrecv, dxs, a.inv.i32(), M, C * 4);
    ep_comm_->all_to_all_v(dxrecv, a.recv_rows.data(), dxsend, a.send_rows.data(), C, DType::F32);
    dxback = dxsend;
  }
  kt_->moe_combine(dln2, dxback, a.r_pos.i32(), nullptr, N, k, C);
  // Router: the weights' gradient, the load-balancing loss (d/dP_e = coef E f_e per unit of the
  // micro-batch's mean loss, whose weight is dloss x N) and the z-loss. With cp (N local tokens of
  // N cp in the micro-batch, gradients averaged over the cp ranks) each rank differentiates cp
  // times its share: the same per-token factor, with f_e over the whole micro-batch.
  float* aux = nullptr;
  if (cfg_.moe_aux_loss_coef > 0) {
    const double Nall = static_cast<double>(N) * (cp_ ? cp_->size() : 1);
    std::vector<float> h(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e)
      h[e] = static_cast<float>(static_cast<double>(a.dloss) * N * cfg_.moe_aux_loss_coef * E *
                                (static_cast<double>(a.counts_all[e]) / (Nall * k)) / static_cast<double>(N));
    aux = moe_ws(14, E).f32();
    dev::copy_from_host(dev_, aux, h.data(), h.size() * sizeof(float));
  }
  const float z_scale = a.dloss * cfg_.moe_z_loss_coef;  // weight dloss x N on the mean over N tokens
  float* dlogits = moe_ws(9, N * E).f32();
  kt_->moe_router_backward(dlogits, dw, a.r_scores.f32(), a.r_idx.i32(), a.r_w.f32(), a.r_lse.f32(),
                           a.r_logits.f32(), aux, z_scale, N, E, k, sig);
  const float* xin = nullptr;
  if (bf) {
    float* t = moe_ws(0, N * C).f32();
    kt_->cast_bf16_to_f32(t, x.bf(), N * C);
    xin = t;
  } else {
    xin = x.f32();
  }
  // The experts' input gradients are partial sums over the tp ranks, the router's is whole on each:
  // tp rank 0 adds it, then the sum over tp (reduce-scattered under SP) overlaps the router's
  // weight gradient.
  kt_->linear_backward(tpc_.rank == 0 ? dln2 : nullptr, nullptr, nullptr, dlogits, xin, wf(p.router), N, C, E);
  const int h = tpc_.start_input_grad_sum(dln2);
  kt_->linear_backward(nullptr, gp(p.router), nullptr, dlogits, xin, wf(p.router), N, C, E);
  return tpc_.input_grad_sum(dln2, h);
}

}  // namespace mt
