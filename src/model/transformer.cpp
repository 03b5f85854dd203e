#include "model/transformer.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include "kernels/backend.h"
#include "model/rng.h"

namespace mt {

bool parse_recompute(const std::string& s, Recompute* out) {
  if (s == "none") *out = Recompute::None;
  else if (s == "full") *out = Recompute::Full;
  else if (s == "selective") *out = Recompute::Selective;
  else return false;
  return true;
}

const char* recompute_name(Recompute r) {
  return r == Recompute::None ? "none" : r == Recompute::Full ? "full" : "selective";
}

// Everything one block saves in forward for its backward. Matmul inputs are kept in the compute
// dtype only (bf16 in mixed precision); what elementwise backward passes need stays fp32.
struct BlockActivations {
  Tensor ln1, ln1_mean, ln1_rstd;  // ln1: f32 or bf16
  Tensor qkv;                       // f32 [N, QKV] (after RoPE for Llama)
  Tensor atty, atty_bf, lse;        // attention output f32 (+ bf16 copy), lse [B, nh, T]
  Tensor res2;                      // residual after attention, f32 [N, C]
  Tensor ln2, ln2_mean, ln2_rstd;
  Tensor fc;                        // GPT-2: pre-GELU [N, F]; Llama: gate [N, F]
  Tensor up;                        // Llama: up [N, F]
  Tensor act;                       // GELU / SwiGLU output, matmul input [N, F] (compute dtype)
  int64_t bytes() const {
    int64_t b = 0;
    for (const Tensor* t : {&ln1, &ln1_mean, &ln1_rstd, &qkv, &atty, &atty_bf, &lse, &res2, &ln2,
                            &ln2_mean, &ln2_rstd, &fc, &up, &act})
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
};

namespace {
BlockParams block_params(const ModelConfig& c, int base) {
  BlockParams p;
  if (c.arch == Arch::GPT2) {  // ln_1 w b, c_attn w b, attn c_proj w b, ln_2 w b, c_fc w b, mlp c_proj w b
    p.ln1_w = base, p.ln1_b = base + 1, p.qkv_w = base + 2, p.qkv_b = base + 3, p.proj_w = base + 4,
    p.proj_b = base + 5, p.ln2_w = base + 6, p.ln2_b = base + 7, p.fc_w = base + 8, p.fc_b = base + 9,
    p.down_w = base + 10, p.down_b = base + 11;
  } else {  // input_layernorm, q k v, o, post_attention_layernorm, gate, up, down (, q k v biases)
    p.ln1_w = base, p.qkv_w = base + 1, p.proj_w = base + 4, p.ln2_w = base + 5, p.fc_w = base + 6,
    p.up_w = base + 7, p.down_w = base + 8;
    // Qwen 2's q, k, v biases (model.qkv_bias) follow, contiguous: one [QKV] bias, as the fused
    // q|k|v projection's output.
    if (c.qkv_bias) p.qkv_b = base + 9;
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
};

Transformer::Transformer(const ModelConfig& cfg, DType compute, Recompute recompute, ModelStorage storage,
                         TpComm* tp, std::vector<char> owned_units)
    : cfg_(cfg), compute_(compute), recompute_(recompute), dev_(current_device()), kt_(&kernels::table(dev_)),
      storage_(storage), tp_(tp), owned_(std::move(owned_units)) {
  cfg_.resolve();
  const size_t U = static_cast<size_t>(cfg_.n_layer) + 2;
  if (owned_.empty()) owned_.assign(U, 1);
  if (owned_.size() != U)
    throw std::invalid_argument("owned_units has " + std::to_string(owned_.size()) + " entries, the model has " +
                                std::to_string(U) + " units");
  if (storage_.unit_align < 1) storage_.unit_align = 1;
  if (tp_) {
    tp_size_ = tp_->size();
    tp_rank_ = tp_->rank();
  }
  const int64_t t = tp_size_;
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
  Vp_l_ = cfg_.padded_vocab / t;
  vocab_lo_ = tp_rank_ * Vp_l_;
  build_params();
  if (cfg_.rope_scaled()) rope_inv_freq_ = cfg_.rope_inv_freq();  // Llama 3.1 scaled frequencies
  const bool f32 = compute_ == DType::F32;
  if (f32 ? storage_.weights : storage_.master)
    weights_ = Tensor::zeros({flat_size_}, DType::F32, f32 ? MemCategory::Params : MemCategory::Optimizer);
  if (storage_.grads) grads_ = Tensor::zeros({flat_size_}, DType::F32, MemCategory::Grads);
  if (!f32 && storage_.weights) weights_bf16_ = Tensor::zeros({flat_size_}, DType::BF16, MemCategory::Params);
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
  auto add = [&](const std::string& name, std::vector<int64_t> shape, bool decay, bool tr = false,
                 TpSplit split = TpSplit::None) {
    if (!owned_[cur_unit]) return;  // another pipeline rank's unit
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
  for (int64_t l = 0; l < cfg_.n_layer; ++l) {
    begin_unit("block." + std::to_string(l));
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
      add(p + "mlp.c_fc.weight", {F, C}, true, true, TpSplit::Rows);
      add(p + "mlp.c_fc.bias", {F}, false, false, TpSplit::Rows);
      add(p + "mlp.c_proj.weight", {C, F}, true, true, TpSplit::Cols);
      add(p + "mlp.c_proj.bias", {C}, false);
    } else {
      std::string p = "model.layers." + std::to_string(l) + ".";
      add(p + "input_layernorm.weight", {C}, false);
      add(p + "self_attn.q_proj.weight", {nh * hd, C}, true, false, TpSplit::Rows);
      add(p + "self_attn.k_proj.weight", {nkv * hd, C}, true, false, TpSplit::Rows);
      add(p + "self_attn.v_proj.weight", {nkv * hd, C}, true, false, TpSplit::Rows);
      add(p + "self_attn.o_proj.weight", {C, nh * hd}, true, false, TpSplit::Cols);
      add(p + "post_attention_layernorm.weight", {C}, false);
      add(p + "mlp.gate_proj.weight", {F, C}, true, false, TpSplit::Rows);
      add(p + "mlp.up_proj.weight", {F, C}, true, false, TpSplit::Rows);
      add(p + "mlp.down_proj.weight", {C, F}, true, false, TpSplit::Cols);
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
  if (tied_g_.defined()) tied_g_.zero_();
}

void Transformer::init_weights(uint64_t seed) {
  if (!weights_.defined()) throw std::logic_error("init_weights: the model holds no full fp32 weights");
  if (dev_ == Device::Meta) return;  // nothing to initialise on a count-only device
  init_weights_into(seed, weights_.f32());
  sync_compute_weights();
}

void Transformer::init_weights_into(uint64_t seed, float* w) const {
  if (tp_size_ > 1) throw std::logic_error("init_weights_into needs an unsplit (tp = 1) layout; use shard_unit_from_full");
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
      bool resid = ends("attn.c_proj.weight") || ends("mlp.c_proj.weight") || ends("o_proj.weight") ||
                   ends("down_proj.weight");
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
  a.fc = Tensor::empty({BT, F}, DType::F32, A);
  if (c.arch == Arch::Llama) a.up = Tensor::empty({BT, F}, DType::F32, A);
  a.act = Tensor::empty({BT, F}, cd, A);
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
  if (sp_ && BT % tp_size_ != 0)
    throw std::invalid_argument("sequence parallelism needs micro_batch x sequence (" + std::to_string(BT) +
                                " tokens) divisible by parallel.tp (" + std::to_string(tp_size_) + ")");
  const int64_t R = residual_rows(BT);
  auto A = MemCategory::Activations;
  for (int u = first; u <= last; ++u) {
    if (u == 0) {
      if (!s.ids.defined()) s.ids = Tensor::empty({BT}, DType::F32, A);  // int32 storage (same size)
      out_buf(0);
    } else if (u <= L) {
      const int64_t l = u - 1;
      out_buf(l);
      out_buf(l + 1);
      if (!recomputes(static_cast<int>(l)) && !s.acts[l]) {
        s.acts[l] = std::make_unique<BlockActivations>();
        alloc_block_acts(*s.acts[l], cfg_, compute_, BT, R, B, nh_l_, nkv_l_, F_l_);
      }
    } else if (!s.losses.defined()) {
      out_buf(L);
      s.targets = Tensor::empty({BT}, DType::F32, A);
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
  if (recompute_ != Recompute::None) {
    scratch_acts_ = std::make_unique<BlockActivations>();
    alloc_block_acts(*scratch_acts_, cfg_, compute_, BT, R, B, nh_l_, nkv_l_, F_l_);
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
  if (sp_) {
    sp_full_ = Tensor::empty({BT, C}, DType::F32, W);
    if (compute_ == DType::BF16) sp_full_bf_ = Tensor::empty({BT, C}, DType::BF16, W);
    sp_dfull_ = Tensor::empty({BT, C}, DType::F32, W);
    sp_part_ = Tensor::empty({BT, C}, DType::F32, W);
    sp_pgrad_ = Tensor::empty({std::max<int64_t>(2 * C, 16)}, DType::F32, W);
  }
}

void TpComm::all_gather(const float* in, float* out, int64_t n) {
  const Device d = current_device();
  const size_t bytes = static_cast<size_t>(n) * sizeof(float);
  dev::zero(d, out, bytes * static_cast<size_t>(size()));
  dev::copy(d, out + rank() * n, in, bytes);
  all_reduce_sum(out, n * size());
}

void TpComm::reduce_scatter_sum(const float* in, float* out, int64_t n) {
  const Device d = current_device();
  const size_t bytes = static_cast<size_t>(n) * sizeof(float);
  Tensor all = Tensor::empty({n * size()}, DType::F32, MemCategory::Workspace);
  dev::copy(d, all.f32(), in, bytes * static_cast<size_t>(size()));
  all_reduce_sum(all.f32(), n * size());
  dev::copy(d, out, all.f32() + rank() * n, bytes);
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
  const int32_t* tg = s.targets.data<int32_t>();
  for (int64_t r0 = 0; r0 < N; r0 += rows) {
    const int64_t nr = std::min(rows, N - r0);
    if (bf)
      kt_->linear_forward_bf16(lg, s.head_in_bf.bf() + r0 * C, head_wb(), nullptr, nr, C, Vp);
    else
      kt_->linear_forward(lg, hin + r0 * C, head_wf(), nullptr, nr, C, Vp);
    if (tp_size_ > 1)  // vocab-parallel: this rank's columns, row statistics reduced over the tp ranks
      tp_cross_entropy(lg, tg + r0, s.losses.f32() + r0, nr, train, dloss_scale);
    else if (train)
      kt_->softmax_cross_entropy(lg, s.losses.f32() + r0, tg + r0, nr, V, Vp, dloss_scale);
    else
      kt_->softmax_cross_entropy_forward(lg, s.losses.f32() + r0, tg + r0, nr, V, Vp);
    if (!train) continue;
    // With tp these input-gradient rows are this rank's partial sums; the backward reduces them.
    if (bf)
      kt_->linear_backward_bf16(s.head_dx.f32() + r0 * C, head_dw_.f32(), nullptr, lg, s.head_in_bf.bf() + r0 * C,
                              head_wb(), nr, C, Vp);
    else
      kt_->linear_backward(s.head_dx.f32() + r0 * C, head_dw_.f32(), nullptr, lg, hin + r0 * C, head_wf(), nr, C, Vp);
  }
}

// A column-parallel layer's (or the vocab-parallel head's) input gradient, `partial` [B*T, C],
// summed over the tp ranks (reduce-scattered to this rank's R rows in sp_part_ under sequence
// parallelism). Started as soon as the input-gradient matmul is done so that it overlaps the
// weight-gradient matmul (Megatron's async tensor-parallel all-reduce) unless tp_overlap_ is off;
// input_grad_sum waits and returns where the sum is.
int Transformer::start_input_grad_sum(float* partial) {
  if (tp_size_ == 1) return -1;
  const int64_t N = B_ * T_, C = cfg_.n_embd;
  const int h = sp_ ? tp_->start_reduce_scatter_activations(partial, sp_part_.f32(), residual_rows(N) * C)
                    : tp_->start_all_reduce_activations(partial, N * C);
  if (tp_overlap_) return h;
  tp_->wait(h);
  return -1;
}

float* Transformer::input_grad_sum(float* partial, int h) {
  if (tp_size_ == 1) return partial;
  tp_->wait(h);
  return sp_ ? sp_part_.f32() : partial;
}

void Transformer::set_sequence_parallel(bool on) {
  if (ws_bt_ != 0) throw std::logic_error("set_sequence_parallel must come before the first forward");
  sp_ = on && tp_size_ > 1;
}

// The full [N, C] rows from this rank's R = N / t (fp32 shard) in the compute dtype.
const Tensor& Transformer::sp_gather(const float* shard, int64_t n) {
  tp_->all_gather_activations(shard, sp_full_.f32(), n * cfg_.n_embd);
  if (compute_ == DType::F32) return sp_full_;
  kt_->cast_f32_to_bf16(sp_full_bf_.bf(), sp_full_.f32(), n * tp_size_ * cfg_.n_embd);
  return sp_full_bf_;
}

// Backward of the norm whose weight is parameter w and bias parameter b (GPT-2's LayerNorm; -1:
// Llama's RMSNorm, no bias) over R rows: dx += d(input), and the parameters' gradients accumulate. Under
// sequence parallelism each rank saw only its rows, so the parameters' contribution is computed
// into a zeroed buffer and summed over the tp ranks first: every rank adds the same full value.
void Transformer::norm_backward(float* dx, int w, int b, const float* dout, const float* x, const Tensor& mean,
                                const Tensor& rstd, int64_t R) {
  const int64_t C = cfg_.n_embd;
  const bool layernorm = cfg_.arch == Arch::GPT2;
  auto run = [&](float* dw, float* db) {
    if (layernorm)
      kt_->layernorm_backward(dx, dw, db, dout, x, wf(w), mean.f32(), rstd.f32(), R, C);
    else
      kt_->rmsnorm_backward(dx, dw, dout, x, wf(w), rstd.f32(), R, C);
  };
  if (!sp_) return run(gp(w), b >= 0 ? gp(b) : nullptr);
  const int64_t n = layernorm ? 2 * C : C;
  float* t = sp_pgrad_.f32();
  dev::zero(dev_, t, static_cast<size_t>(n) * sizeof(float));
  run(t, layernorm ? t + C : nullptr);
  tp_->all_reduce_sum(t, n);
  kt_->accumulate(gp(w), t, C);
  if (b >= 0) kt_->accumulate(gp(b), t + C, C);
}

// y = x @ W^T (+ b), with x in the compute dtype.
namespace {
struct Lin {
  const kernels::KernelTable* kt_;
  DType cd;
  void fwd(float* out, const Tensor& x, const float* wf, const bf16* wb, const float* b, int64_t N, int64_t IC,
           int64_t OC) const {
    if (cd == DType::F32)
      kt_->linear_forward(out, x.f32(), wf, b, N, IC, OC);
    else
      kt_->linear_forward_bf16(out, x.bf(), wb, b, N, IC, OC);
  }
  void bwd(float* dx, float* dw, float* db, const float* dout, const Tensor& x, const float* wf, const bf16* wb,
           int64_t N, int64_t IC, int64_t OC) const {
    if (cd == DType::F32)
      kt_->linear_backward(dx, dw, db, dout, x.f32(), wf, N, IC, OC);
    else
      kt_->linear_backward_bf16(dx, dw, db, dout, x.bf(), wb, N, IC, OC);
  }
};
// Writes an fp32 result into a compute-dtype tensor (cast in bf16 mode, through scratch).
void store(const kernels::KernelTable* kt_, const Tensor& dst, const float* src, int64_t n) {
  if (dst.dtype() == DType::F32)
    dev::copy(kt_->device, dst.f32(), src, static_cast<size_t>(n) * sizeof(float));
  else
    kt_->cast_f32_to_bf16(dst.bf(), src, n);
}
}  // namespace

void Transformer::block_forward(int layer, const float* x, BlockActivations& a, float* out) {
  const int64_t B = B_, T = T_, N = B * T, C = cfg_.n_embd, F = F_l_, hd = cfg_.head_dim();
  const int64_t nh = nh_l_, nkv = nkv_l_, QKV = (nh + 2 * nkv) * hd;  // this tp rank's share
  const bool tp = tp_size_ > 1;
  const BlockParams p = block_params(cfg_, unit_params_[layer + 1][0]);
  const bool gpt = cfg_.arch == Arch::GPT2;
  const bool bf = compute_ == DType::BF16;
  Lin lin{kt_, compute_};
  auto WB = [&](int i) { return bf ? wb(i) : nullptr; };  // a matrix in the compute dtype
  auto WF = [&](int i) { return bf ? nullptr : wf(i); };
  auto V = [&](int i) { return i < 0 ? nullptr : wf(i); };  // a vector (norm weight, bias), fp32
  const int64_t R = residual_rows(N);  // rows of x, out, the norms and the residual on this rank
  float* tmp = bwd_ws_[6].f32();  // fp32 staging for values stored as bf16
  // Sequence parallelism: the norm runs on this rank's rows; the matmul gets all rows (gathered).
  float* ln1_out = bf || sp_ ? tmp : a.ln1.f32();
  if (gpt)
    kt_->layernorm_forward(ln1_out, a.ln1_mean.f32(), a.ln1_rstd.f32(), x, V(p.ln1_w), V(p.ln1_b), R, C, cfg_.norm_eps);
  else
    kt_->rmsnorm_forward(ln1_out, a.ln1_rstd.f32(), x, V(p.ln1_w), R, C, cfg_.norm_eps);
  if (bf || sp_) store(kt_, a.ln1, ln1_out, R * C);
  const Tensor& ln1_in = sp_ ? sp_gather(ln1_out, R) : a.ln1;
  // qkv: GPT-2 has one fused weight; Llama's q, k, v weights are contiguous so they form one too.
  lin.fwd(a.qkv.f32(), ln1_in, WF(p.qkv_w), WB(p.qkv_w), gpt ? V(p.qkv_b) : qkv_bias_f32(p.qkv_b), N, C, QKV);
  if (!gpt && rope_inv_freq_.empty()) kt_->rope_forward(a.qkv.f32(), B, T, nh, nkv, hd, cfg_.rope_theta);
  if (!gpt && !rope_inv_freq_.empty()) kt_->rope_forward_freq(a.qkv.f32(), B, T, nh, nkv, hd, rope_inv_freq_.data());
  kt_->attention_forward(a.atty.f32(), a.lse.f32(), a.qkv.f32(), B, T, nh, nkv, hd);
  if (bf) store(kt_, a.atty_bf, a.atty.f32(), N * nh * hd);
  const Tensor& atty_in = bf ? a.atty_bf : a.atty;
  // Row-parallel output projection: partial sums over this rank's heads, summed across tp ranks
  // (reduce-scattered to this rank's rows with sequence parallelism), then the (replicated) bias once.
  float* proj_out = sp_ ? sp_part_.f32() : a.res2.f32();
  lin.fwd(proj_out, atty_in, WF(p.proj_w), WB(p.proj_w), tp ? nullptr : V(p.proj_b), N, nh * hd, C);
  if (sp_)
    tp_->reduce_scatter_activations(proj_out, a.res2.f32(), R * C);
  else if (tp)
    tp_->all_reduce_activations(a.res2.f32(), N * C);
  if (tp && p.proj_b >= 0) kt_->add_bias(a.res2.f32(), V(p.proj_b), R, C);
  kt_->accumulate(a.res2.f32(), x, R * C);
  float* ln2_out = bf || sp_ ? tmp : a.ln2.f32();
  if (gpt)
    kt_->layernorm_forward(ln2_out, a.ln2_mean.f32(), a.ln2_rstd.f32(), a.res2.f32(), V(p.ln2_w), V(p.ln2_b), R, C,
                           cfg_.norm_eps);
  else
    kt_->rmsnorm_forward(ln2_out, a.ln2_rstd.f32(), a.res2.f32(), V(p.ln2_w), R, C, cfg_.norm_eps);
  if (bf || sp_) store(kt_, a.ln2, ln2_out, R * C);
  const Tensor& ln2_in = sp_ ? sp_gather(ln2_out, R) : a.ln2;
  float* act_out = bf ? tmp : a.act.f32();
  if (gpt) {
    lin.fwd(a.fc.f32(), ln2_in, WF(p.fc_w), WB(p.fc_w), V(p.fc_b), N, C, F);
    kt_->gelu_forward(act_out, a.fc.f32(), N * F);
  } else {
    lin.fwd(a.fc.f32(), ln2_in, WF(p.fc_w), WB(p.fc_w), nullptr, N, C, F);
    lin.fwd(a.up.f32(), ln2_in, WF(p.up_w), WB(p.up_w), nullptr, N, C, F);
    kt_->swiglu_forward(act_out, a.fc.f32(), a.up.f32(), N * F);
  }
  if (bf) store(kt_, a.act, act_out, N * F);
  float* down_out = sp_ ? sp_part_.f32() : out;
  lin.fwd(down_out, a.act, WF(p.down_w), WB(p.down_w), tp ? nullptr : V(p.down_b), N, F, C);
  if (sp_)
    tp_->reduce_scatter_activations(down_out, out, R * C);
  else if (tp)
    tp_->all_reduce_activations(out, N * C);
  if (tp && p.down_b >= 0) kt_->add_bias(out, V(p.down_b), R, C);
  kt_->accumulate(out, a.res2.f32(), R * C);
}

// dx holds d(block output) on entry and d(block input) on exit.
void Transformer::block_backward(int layer, const float* x, BlockActivations& a, float* dx) {
  const int64_t B = B_, T = T_, N = B * T, C = cfg_.n_embd, F = F_l_, hd = cfg_.head_dim();
  const int64_t nh = nh_l_, nkv = nkv_l_, QKV = (nh + 2 * nkv) * hd;  // this tp rank's share
  const BlockParams p = block_params(cfg_, unit_params_[layer + 1][0]);
  const bool gpt = cfg_.arch == Arch::GPT2;
  const bool bf = compute_ == DType::BF16;
  Lin lin{kt_, compute_};
  auto WB = [&](int i) { return bf ? wb(i) : nullptr; };
  auto WF = [&](int i) { return bf ? nullptr : wf(i); };
  auto G = [&](int i) { return i < 0 ? nullptr : gp(i); };  // a parameter's gradient (null: none)
  float* dnorm = bwd_ws_[0].f32();
  float* dqkv = bwd_ws_[1].f32();
  float* datty = bwd_ws_[2].f32();
  float* dfc = bwd_ws_[3].f32();
  float* dup = bwd_ws_[4].f32();
  float* dact = bwd_ws_[5].f32();

  // Sequence parallelism: dx holds this rank's R rows; the row-parallel matmuls' backward needs
  // every row (all-gather, the conjugate of the forward's reduce-scatter), the column-parallel
  // ones' input gradients are reduce-scattered back to R rows, and the norms' parameter gradients
  // (computed from R rows) are summed over the tp ranks.
  const int64_t R = residual_rows(N);
  auto all_rows = [&](const float* g) -> const float* {
    if (!sp_) return g;
    // fp32 on the wire: besides the matmuls (bf16 inputs) this gradient feeds the bias gradient,
    // which tensor parallelism without SP computes from the fp32 rows.
    tp_->all_gather(g, sp_dfull_.f32(), R * C);
    return sp_dfull_.f32();
  };
  // The norm output a column-parallel layer's weight gradient needs, all rows: under sequence
  // parallelism re-gathered from the stored R rows, started before the input-gradient matmul
  // (which does not need it) so that the gather overlaps it.
  auto start_norm_input = [&](const Tensor& stored) -> int {
    if (!sp_) return -1;
    const float* src = nullptr;
    if (bf) {
      kt_->cast_bf16_to_f32(bwd_ws_[6].f32(), stored.bf(), R * C);
      src = bwd_ws_[6].f32();
    } else {
      src = stored.f32();
    }
    return tp_->start_all_gather_activations(src, sp_full_.f32(), R * C);
  };
  auto norm_input = [&](const Tensor& stored, int h) -> const Tensor& {
    if (!sp_) return stored;
    tp_->wait(h);
    if (!bf) return sp_full_;
    kt_->cast_f32_to_bf16(sp_full_bf_.bf(), sp_full_.f32(), N * C);
    return sp_full_bf_;
  };
  // MLP: out = res2 + down(act(ln2(res2))). dx already carries the residual path's gradient.
  dev::zero(dev_, dact, static_cast<size_t>(N * F) * sizeof(float));
  const float* dout = all_rows(dx);
  lin.bwd(dact, G(p.down_w), G(p.down_b), dout, a.act, WF(p.down_w), WB(p.down_w), N, F, C);
  dev::zero(dev_, dfc, static_cast<size_t>(N * F) * sizeof(float));
  dev::zero(dev_, dnorm, static_cast<size_t>(N * C) * sizeof(float));
  if (gpt) {
    kt_->gelu_backward(dfc, a.fc.f32(), dact, N * F);
    const int hin = start_norm_input(a.ln2);
    lin.bwd(dnorm, nullptr, nullptr, dfc, a.ln2, WF(p.fc_w), WB(p.fc_w), N, C, F);  // input gradient first
    const int hsum = start_input_grad_sum(dnorm);
    lin.bwd(nullptr, G(p.fc_w), G(p.fc_b), dfc, norm_input(a.ln2, hin), WF(p.fc_w), WB(p.fc_w), N, C, F);
    norm_backward(dx, p.ln2_w, p.ln2_b, input_grad_sum(dnorm, hsum), a.res2.f32(), a.ln2_mean, a.ln2_rstd, R);
  } else {
    dev::zero(dev_, dup, static_cast<size_t>(N * F) * sizeof(float));
    kt_->swiglu_backward(dfc, dup, dact, a.fc.f32(), a.up.f32(), N * F);
    const int hin = start_norm_input(a.ln2);
    lin.bwd(dnorm, nullptr, nullptr, dfc, a.ln2, WF(p.fc_w), WB(p.fc_w), N, C, F);
    lin.bwd(dnorm, nullptr, nullptr, dup, a.ln2, WF(p.up_w), WB(p.up_w), N, C, F);
    const int hsum = start_input_grad_sum(dnorm);
    const Tensor& ln2_in = norm_input(a.ln2, hin);
    lin.bwd(nullptr, G(p.fc_w), nullptr, dfc, ln2_in, WF(p.fc_w), WB(p.fc_w), N, C, F);
    lin.bwd(nullptr, G(p.up_w), nullptr, dup, ln2_in, WF(p.up_w), WB(p.up_w), N, C, F);
    norm_backward(dx, p.ln2_w, p.ln2_b, input_grad_sum(dnorm, hsum), a.res2.f32(), a.ln2_mean, a.ln2_rstd, R);
  }
  // Attention: res2 = x + proj(attn(qkv(ln1(x)))).
  dev::zero(dev_, datty, static_cast<size_t>(N * nh * hd) * sizeof(float));
  const Tensor& atty_in = bf ? a.atty_bf : a.atty;
  const float* dres2 = all_rows(dx);
  lin.bwd(datty, G(p.proj_w), G(p.proj_b), dres2, atty_in, WF(p.proj_w), WB(p.proj_w), N, nh * hd, C);
  dev::zero(dev_, dqkv, static_cast<size_t>(N * QKV) * sizeof(float));
  kt_->attention_backward(dqkv, datty, a.qkv.f32(), a.atty.f32(), a.lse.f32(), B, T, nh, nkv, hd);
  if (!gpt && rope_inv_freq_.empty()) kt_->rope_backward(dqkv, B, T, nh, nkv, hd, cfg_.rope_theta);
  if (!gpt && !rope_inv_freq_.empty()) kt_->rope_backward_freq(dqkv, B, T, nh, nkv, hd, rope_inv_freq_.data());
  dev::zero(dev_, dnorm, static_cast<size_t>(N * C) * sizeof(float));
  const int hin = start_norm_input(a.ln1);
  lin.bwd(dnorm, nullptr, nullptr, dqkv, a.ln1, WF(p.qkv_w), WB(p.qkv_w), N, C, QKV);
  const int hsum = start_input_grad_sum(dnorm);
  lin.bwd(nullptr, G(p.qkv_w), G(p.qkv_b), dqkv, norm_input(a.ln1, hin), WF(p.qkv_w), WB(p.qkv_w), N, C, QKV);
  norm_backward(dx, p.ln1_w, p.ln1_b, input_grad_sum(dnorm, hsum), x, a.ln1_mean, a.ln1_rstd, R);
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
  Slot& s = *s_;
  const int64_t N = B * T, C = cfg_.n_embd, V = cfg_.vocab_size, Vp = Vp_l_, R = residual_rows(N);
  const bool gpt = cfg_.arch == Arch::GPT2;
  const bool bf = compute_ == DType::BF16;
  const bool tp = tp_size_ > 1;
  s.have_backward = false;

  if (first == 0) {  // unit 0: embedding
    for (int64_t i = 0; i < N; ++i)
      if (ids[i] < 0 || ids[i] >= V)
        throw std::out_of_range("token id " + std::to_string(ids[i]) + " at position " + std::to_string(i) +
                                " is outside the vocabulary of " + std::to_string(V));
    dev::copy_from_host(dev_, s.ids.raw(), ids, static_cast<size_t>(N) * sizeof(int32_t));
    const int32_t* ids_saved = s.ids.data<int32_t>();
    if (hooks_) hooks_->pre_forward(0);
    // With sequence parallelism the vocab-parallel partial rows of all N tokens are built in
    // workspace and reduce-scattered to this rank's R rows.
    float* x = sp_ ? sp_part_.f32() : s.block_out[0].f32();
    const int emb = unit_params_[0][0];
    if (tp) {
      // Vocab-parallel embedding: rows this rank holds, zero elsewhere, summed across tp ranks.
      kt_->vocab_embedding_forward(x, ids_saved, bf ? static_cast<const void*>(wb(emb)) : wf(emb), compute_, vocab_lo_,
                                   Vp_l_, N, C);
      if (sp_) {
        tp_->reduce_scatter_activations(x, s.block_out[0].f32(), R * C);
        x = s.block_out[0].f32();
      } else {
        tp_->all_reduce_activations(x, N * C);
      }
    } else if (bf) {  // rows of the bf16 table, widened
      kt_->vocab_embedding_forward(x, ids_saved, wb(emb), DType::BF16, 0, Vp_l_, N, C);
    } else {
      kt_->embedding_forward(x, ids_saved, wf(emb), N, C);
    }
    if (gpt && sp_) {  // this rank's rows are tokens r*R .. r*R + R-1 of the flattened [B, T]
      kt_->position_add_rows(x, wf(emb + 1), R, T, tp_rank_ * R, C);
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
    BlockActivations& a = s.acts[l] ? *s.acts[l] : *scratch_acts_;
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
  float* hin = sp_ ? bwd_ws_[6].f32() : s.head_in.f32();
  if (gpt)
    kt_->layernorm_forward(hin, s.head_mean.f32(), s.head_rstd.f32(), xl, wf(hb), wf(hb + 1), R, C, cfg_.norm_eps);
  else
    kt_->rmsnorm_forward(hin, s.head_rstd.f32(), xl, wf(hb), R, C, cfg_.norm_eps);
  if (sp_) {
    tp_->all_gather_activations(hin, s.head_in.f32(), R * C);
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
    for (int64_t i = 0; i < N; ++i)
      if (targets[i] >= V)
        throw std::out_of_range("target id " + std::to_string(targets[i]) + " is outside the vocabulary");
    dev::copy_from_host(dev_, s.targets.raw(), targets, static_cast<size_t>(N) * sizeof(int32_t));
    if (s.chunked)
      chunked_head_forward(hin, train, dloss_scale);
    else if (tp)
      tp_cross_entropy(s.logits.f32(), s.targets.data<int32_t>(), s.losses.f32(), N, train, dloss_scale);
    else if (train)
      kt_->softmax_cross_entropy(s.logits.f32(), s.losses.f32(), s.targets.data<int32_t>(), N, V, Vp, dloss_scale);
    else
      kt_->softmax_cross_entropy_forward(s.logits.f32(), s.losses.f32(), s.targets.data<int32_t>(), N, V, Vp);
    loss = kt_->sum(s.losses.f32(), N) / static_cast<double>(N);
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
  const bool tp = tp_size_ > 1;
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
      const int h = start_input_grad_sum(dhin);
      const int64_t rows = defer_emb_ && head_chunk_done_ ? std::clamp<int64_t>(head_chunk_rows_, 1, Vp) : Vp;
      for (int64_t r0 = 0; r0 < Vp; r0 += rows) {
        const int64_t cv = std::min(rows, Vp - r0);
        if (head_dw_pending_) kt_->accumulate(head_gp() + r0 * C, head_dw_.f32() + r0 * C, cv * C);
        if (defer_emb_ && head_chunk_done_) head_chunk_done_(r0, r0 + cv);
      }
      head_dw_pending_ = false;
      dhin = input_grad_sum(dhin, h);
    } else if (defer_emb_ && head_chunk_done_) {  // tp = 1
      // In vocabulary-row chunks, each chunk's weight-gradient rows handed over when complete.
      dev::zero(dev_, dhin, static_cast<size_t>(N * C) * sizeof(float));
      const int64_t rows = std::clamp<int64_t>(head_chunk_rows_, 1, Vp);
      if (rows < Vp && head_chunk_buf_.numel() != N * rows)
        head_chunk_buf_ = Tensor::empty({N, rows}, DType::F32, MemCategory::Workspace);
      for (int64_t r0 = 0; r0 < Vp; r0 += rows) {
        const int64_t cv = std::min(rows, Vp - r0);
        const float* dl = s.logits.f32();
        if (cv < Vp) {  // the chunk's columns of the logits' gradient, contiguous
          kt_->copy_columns(head_chunk_buf_.f32(), dl, N, Vp, r0, cv);
          dl = head_chunk_buf_.f32();
        }
        if (bf)
          kt_->linear_backward_bf16(dhin, head_gp() + r0 * C, nullptr, dl, s.head_in_bf.bf(), head_wb() + r0 * C, N, C, cv);
        else
          kt_->linear_backward(dhin, head_gp() + r0 * C, nullptr, dl, s.head_in.f32(), head_wf() + r0 * C, N, C, cv);
        head_chunk_done_(r0, r0 + cv);
      }
    } else {
      // Input gradient first, so that its sum over the tp ranks runs while the weight gradient is computed.
      dev::zero(dev_, dhin, static_cast<size_t>(N * C) * sizeof(float));
      auto head_bwd = [&](float* dinp, float* dw) {
        if (bf)
          kt_->linear_backward_bf16(dinp, dw, nullptr, s.logits.f32(), s.head_in_bf.bf(), head_wb(), N, C, Vp);
        else
          kt_->linear_backward(dinp, dw, nullptr, s.logits.f32(), s.head_in.f32(), head_wf(), N, C, Vp);
      };
      head_bwd(dhin, nullptr);
      const int h = start_input_grad_sum(dhin);
      head_bwd(nullptr, head_gp());
      dhin = input_grad_sum(dhin, h);
    }
    dev::zero(dev_, dx, static_cast<size_t>(R * C) * sizeof(float));
    norm_backward(dx, hb, gpt ? hb + 1 : -1, dhin, s.block_out[cfg_.n_layer].f32(), s.head_mean, s.head_rstd, R);
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
      a = scratch_acts_.get();
      block_forward(static_cast<int>(l), s.block_out[l].f32(), *a, bwd_ws_[6].f32() /*discarded output*/);
    }
    block_backward(static_cast<int>(l), s.block_out[l].f32(), *a, dx);
    if (hooks_) hooks_->post_backward(u);
  }
  if (first == 0) {
    const int emb = unit_params_[0][0];
    if (hooks_) hooks_->pre_backward(0);
    if (sp_) {  // every token's gradient (any may index this rank's vocabulary rows); fp32: a parameter gradient
      tp_->all_gather(dx, sp_dfull_.f32(), R * C);
      dx = sp_dfull_.f32();
    }
    if (tp) {  // only the rows this rank holds
      kt_->vocab_embedding_backward(gp(emb), dx, s.ids.data<int32_t>(), vocab_lo_, Vp_l_, N, C);
    } else if (defer_emb_) {  // kept for the caller (see set_defer_embedding_grad)
      if (!deferred_rows_.defined() || deferred_rows_.numel() != N * C) {
        deferred_rows_ = Tensor::empty({N, C}, DType::F32, MemCategory::Workspace);
        deferred_ids_ = Tensor::empty({N}, DType::F32, MemCategory::Workspace);  // int32 storage
      }
      dev::copy(dev_, deferred_rows_.f32(), dx, static_cast<size_t>(N * C) * sizeof(float));
      dev::copy(dev_, deferred_ids_.raw(), s.ids.raw(), static_cast<size_t>(N) * sizeof(int32_t));
      deferred_n_ = N;
    } else {
      kt_->embedding_backward(gp(emb), dx, s.ids.data<int32_t>(), N, C);
    }
    if (extra_emb_grad_) {  // the pipeline's head contribution to a tied embedding
      kt_->accumulate(gp(emb), extra_emb_grad_, Vp * C);
      extra_emb_grad_ = nullptr;
    }
    if (gpt) kt_->position_add_backward(gp(emb + 1), dx, B, T, C);
    if (hooks_) hooks_->post_backward(0);
  }
  s.have_backward = false;
}

bool Transformer::can_defer_embedding_grad() const {
  return cfg_.tied_embeddings && tp_size_ == 1 && owned_.front() && owned_.back();
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

// Vocab-parallel softmax cross-entropy (Megatron): each rank holds Vp/t columns of the logits;
// the row max, then the sum of exponentials and the target's logit are reduced across tp ranks,
// so the full [N, V] logits are never gathered. With train, the local logits become their gradient.
void Transformer::tp_cross_entropy(float* lg, const int32_t* tg, float* losses, int64_t N, bool train, float dloss) {
  const int64_t Vl = Vp_l_, V = cfg_.vocab_size, lo = vocab_lo_;
  const int64_t valid = std::clamp<int64_t>(V - lo, 0, Vl);  // real vocabulary columns on this rank
  Tensor mx = Tensor::empty({N}, DType::F32, MemCategory::Workspace);
  Tensor red = Tensor::empty({2 * N}, DType::F32, MemCategory::Workspace);  // [sum of exp | target logit]
  kt_->vp_ce_rowmax(mx.f32(), lg, N, Vl, valid);
  tp_->all_reduce_max(mx.f32(), N);
  kt_->vp_ce_stats(red.f32(), lg, mx.f32(), tg, N, Vl, valid, lo);
  tp_->all_reduce_sum(red.f32(), 2 * N);
  kt_->vp_ce_finish(lg, losses, mx.f32(), red.f32(), tg, N, Vl, valid, lo, train, dloss);
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

void Transformer::shard_unit_from_full(const Transformer& full_layout, int u, const float* full, float* local) const {
  const int64_t lo = units_[u].offset, fo = full_layout.units_[u].offset;
  dev::zero(dev_, local, static_cast<size_t>(units_[u].numel) * sizeof(float));
  for (const auto& lp : params_) {
    if (lp.unit != u) continue;
    const ParamInfo& fp = full_layout.param(lp.name);
    for_each_tp_run(lp, fp, tp_rank_, tp_size_, cfg_, [&](int64_t fi, int64_t li, int64_t n) {
      dev::copy(dev_, local + (lp.offset - lo) + li, full + (fp.offset - fo) + fi, static_cast<size_t>(n) * sizeof(float));
    });
  }
}

void Transformer::assemble_unit_full(const Transformer& full_layout, int u, const std::vector<const float*>& locals,
                                     float* full) const {
  if (static_cast<int>(locals.size()) != tp_size_) throw std::invalid_argument("assemble_unit_full: one buffer per tp rank");
  const int64_t lo = units_[u].offset, fo = full_layout.units_[u].offset;
  dev::zero(dev_, full, static_cast<size_t>(full_layout.units_[u].numel) * sizeof(float));
  for (const auto& lp : params_) {
    if (lp.unit != u) continue;
    const ParamInfo& fp = full_layout.param(lp.name);
    for (int r = 0; r < tp_size_; ++r)
      for_each_tp_run(lp, fp, r, tp_size_, cfg_, [&](int64_t fi, int64_t li, int64_t n) {
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
  return b;
}

}  // namespace mt
