#include "model/transformer.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include "kernels/backend.h"
#include "model/rng.h"

namespace mt {

// Everything one micro-batch keeps between its forward and its backward.
struct Transformer::Slot {
  int64_t B = 0, T = 0;
  bool have_backward = false;
  std::vector<std::unique_ptr<BlockActivations>> acts;  // per block (null: not owned or recomputed)
  std::vector<Tensor> block_out;                         // output of unit u (0..L), [B*T, C]
  Tensor ids;
  // Document masking: doc_start on the host and the device, and positions t - doc_start (host).
  std::vector<int32_t> doc_start, doc_pos;
  Tensor doc_start_dev;
  HeadActivations head;
  std::vector<DeferredGrads> deferred;  // split backward: per unit, the queued weight gradients
  bool have_weights = false;            // a split backward queued work that backward_weights runs
  int64_t lora_micro = -1;              // LoRA dropout: the training micro-batch in the slot (-1: none)
};

Transformer::Transformer(const ModelConfig& cfg, DType compute, Recompute recompute)
    : Transformer(cfg, ModelOptions{.compute = compute, .recompute = recompute}) {}

Transformer::Transformer(const ModelConfig& cfg, ModelOptions o)
    : cfg_(cfg), compute_(o.compute), recompute_(o.recompute), dev_(current_device()), kt_(&kernels::table(dev_)),
      storage_(o.storage), tpc_(kt_, o.compute, o.tp), ep_(o.ep), ep_rank_(o.ep_rank), ep_comm_(o.ep_comm),
      owned_(std::move(o.owned_units)), split_backward_(o.split_backward) {
  cfg_.resolve();
  if (o.loss_chunk < 0) throw std::invalid_argument("loss chunk rows must be >= 0");
  tpc_.sp = o.sequence_parallel && tpc_.tp();
  tpc_.overlap = o.tp_overlap;
  cp_ = o.cp && o.cp->size() > 1 ? o.cp : nullptr;
  cp_allgather_ = o.cp_allgather;
  flash_ = o.flash_attention;
  gelu_epi_ = o.gelu_epilogue;
  if (gelu_epi_ && (compute_ != DType::BF16 || tpc_.tp() || split_backward_))
    throw std::invalid_argument("the fused bf16 MLP needs bf16 compute, no tensor parallelism and no split backward");
  if (flash_ && compute_ != DType::BF16) throw std::invalid_argument("flash attention needs bf16 compute");
  res_bf16_ = o.residual_bf16;
  if (res_bf16_ && (compute_ != DType::BF16 || (o.tp && o.tp->size() > 1) || (o.cp && o.cp->size() > 1) ||
                    split_backward_ ||
                    std::any_of(o.owned_units.begin(), o.owned_units.end(), [](char c) { return !c; })))
    throw std::invalid_argument("a bf16 residual stream needs bf16 compute and one model-parallel rank (no tensor, "
                                "pipeline or context parallelism)");
  if (flash_ && cp_) throw std::invalid_argument("flash attention does not take context parallelism yet");
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
    const int64_t ep = std::max(1, ep_), er = ep_rank_;
    need(cfg_.expert_ffn(), "model.moe_ffn_hidden (one expert's width)");
    if (cfg_.moe_experts % ep != 0)
      throw std::invalid_argument("model.moe_experts (" + std::to_string(cfg_.moe_experts) +
                                  ") is not divisible by parallel.ep (" + std::to_string(ep) + ")");
    if (er < 0 || er >= ep) throw std::invalid_argument("expert-parallel rank outside parallel.ep");
    moe_shape_.local_experts = cfg_.moe_experts / ep;
    moe_shape_.first_expert = er * moe_shape_.local_experts;
    moe_shape_.expert_width = cfg_.expert_ffn() / t;
    moe_shape_.shared_width = cfg_.moe_shared_experts * cfg_.expert_ffn() / t;
    moe_shape_.experts_apart = experts_apart();
    moe_shape_.bf16_pre = gelu_epi_ && compute_ == DType::BF16 && cfg_.arch == Arch::Llama;
  }
  Vp_l_ = cfg_.padded_vocab / t;
  vocab_lo_ = tpc_.rank * Vp_l_;
  build_params();
  if (cfg_.lora()) {  // each adapted weight's adapters (A; its B follows it)
    lora_of_.assign(params_.size(), {});
    lora_parts_.assign(params_.size(), {});
    for (size_t i = 0; i < params_.size(); ++i)
      if (params_[i].lora_kind == 'A') lora_of_[static_cast<size_t>(params_[i].lora_base)].push_back(static_cast<int>(i));
  }
  if (cfg_.moe())
    moe_ = std::make_unique<MoeLayer>(cfg_, compute_, dev_, kt_, tpc_, moe_shape_, ep_comm_, cp_);
  attn_ = std::make_unique<Attention>(cfg_, compute_, dev_, kt_, tpc_, nh_l_, nkv_l_, cp_, cp_allgather_, flash_);
  mlp_ = std::make_unique<Mlp>(cfg_, compute_, dev_, kt_, tpc_, F_l_, gelu_epi_);
  embedding_ = std::make_unique<Embedding>(cfg_, compute_, dev_, kt_, tpc_, Vp_l_, vocab_lo_);
  head_ = std::make_unique<LmHead>(cfg_, compute_, dev_, kt_, tpc_, Vp_l_, vocab_lo_, o.loss_chunk, o.logits_bf16);
  build_state_layout();
  const bool f32 = compute_ == DType::F32;
  if (f32 ? storage_.weights : storage_.master)  // fp32: the flat weights; bf16: the master, state layout
    weights_ = Tensor::zeros({f32 ? flat_size_ : state_size_}, DType::F32, f32 ? MemCategory::Params : MemCategory::Optimizer);
  if (storage_.grads) grads_ = Tensor::zeros({state_size_}, DType::F32, MemCategory::Grads);
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

// Registers one parameter of unit `unit`: at *pos of the flat buffers (advanced past it), or with
// `apart` at the end of the expert buffers.
void Transformer::add_param(const std::string& name, std::vector<int64_t> shape, bool decay, bool hf_transposed,
                            TpSplit split, int unit, bool apart, int64_t* pos) {
  ParamInfo p;
  p.name = name;
  p.shape = std::move(shape);
  p.numel = 1;
  for (auto d : p.shape) p.numel *= d;
  p.unit = unit;
  p.decay = decay;
  p.hf_transposed = hf_transposed;
  p.tp_split = split;
  p.trainable = !cfg_.lora();  // LoRA: every base parameter is frozen
  if (apart) {
    p.offset = expert_size_;
    expert_size_ += p.numel;
    expert_params_.push_back(p);
    return;
  }
  p.offset = *pos;
  total_ += p.numel;
  *pos += p.numel;
  unit_params_[unit].push_back(static_cast<int>(params_.size()));
  params_.push_back(p);
}

void Transformer::build_params() {
  // Shapes are this tp rank's share (the whole model when tp = 1).
  const int64_t C = cfg_.n_embd, hd = cfg_.head_dim(), F = F_l_, V = Vp_l_;
  const int64_t nh = nh_l_, nkv = nkv_l_;
  int cur_unit = 0;
  int64_t pos = 0;
  bool to_experts = false;  // add() registers an expert parameter kept apart (expert parallelism)
  auto add = [&](const std::string& name, std::vector<int64_t> shape, bool decay, bool tr = false,
                 TpSplit split = TpSplit::None) {
    if (owned_[cur_unit]) add_param(name, std::move(shape), decay, tr, split, cur_unit, to_experts, &pos);
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
  // one routed expert's and the shared experts' width (this tp rank's), the local experts
  const int64_t Fe = moe_shape_.expert_width, Fs = moe_shape_.shared_width;
  const int64_t E_lo = moe_shape_.first_expert, E_hi = E_lo + moe_shape_.local_experts;
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
        for (int64_t e = E_lo; e < E_hi; ++e) {
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
        for (int64_t e = E_lo; e < E_hi; ++e) {
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
    if (cfg_.lora() && !moe && owned_[cur_unit]) add_lora_params(l, cur_unit, &pos);
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

// Block l's LoRA adapters (after its base parameters): A [rank, in] then B [rows, rank] for every
// target, named after the projection they adapt as PEFT names them (q_proj.lora_A.weight, ...).
void Transformer::add_lora_params(int64_t l, int unit, int64_t* pos) {
  const int64_t C = cfg_.n_embd, hd = cfg_.head_dim(), F = F_l_, r = cfg_.lora_rank;
  const int64_t q = nh_l_ * hd, kv = nkv_l_ * hd;
  const BlockParams bp = block_params(cfg_, l, unit_params_[unit][0], 0);
  const bool gpt = cfg_.arch == Arch::GPT2;
  const std::string pre = gpt ? "h." + std::to_string(l) + "." : "model.layers." + std::to_string(l) + ".";
  // Tensor parallelism: a column-parallel base (q, k, v, c_attn, gate, up) has its B split by output
  // rows as the base is (c_attn's whole q|k|v by heads) and A replicated; a row-parallel base (o,
  // down) has A split by input columns and B replicated. The shapes here are this rank's share.
  auto lora = [&](uint32_t bit, const std::string& module, int base, int64_t in, int64_t row0, int64_t rows) {
    if (!(cfg_.lora_targets & bit)) return;
    const bool row_parallel = bit == kLoraO || bit == kLoraDown;
    for (char kind : {'A', 'B'}) {
      std::vector<int64_t> shape = kind == 'A' ? std::vector<int64_t>{r, in} : std::vector<int64_t>{rows, r};
      TpSplit split = TpSplit::None;
      if (row_parallel && kind == 'A') split = TpSplit::Cols;
      if (!row_parallel && kind == 'B') split = bit == kLoraQkv ? TpSplit::QkvRows : TpSplit::Rows;
      add_param(pre + module + ".lora_" + kind + ".weight", shape, true, false, split, unit, false, pos);
      ParamInfo& pi = params_.back();
      pi.trainable = true;
      pi.lora_base = base;
      pi.lora_kind = kind;
      pi.lora_row0 = row0;
      pi.lora_rows = rows;
    }
  };
  if (gpt) {
    lora(kLoraQkv, "attn.c_attn", bp.qkv_w, C, 0, q + 2 * kv);
    lora(kLoraQ, "attn.c_attn.q", bp.qkv_w, C, 0, q);
    lora(kLoraK, "attn.c_attn.k", bp.qkv_w, C, q, kv);
    lora(kLoraV, "attn.c_attn.v", bp.qkv_w, C, q + kv, kv);
    lora(kLoraO, "attn.c_proj", bp.proj_w, q, 0, C);
    lora(kLoraUp, "mlp.c_fc", bp.fc_w, C, 0, F);
    lora(kLoraDown, "mlp.c_proj", bp.down_w, F, 0, C);
  } else {
    lora(kLoraQ, "self_attn.q_proj", bp.qkv_w, C, 0, q);
    lora(kLoraK, "self_attn.k_proj", bp.qkv_w, C, q, kv);
    lora(kLoraV, "self_attn.v_proj", bp.qkv_w, C, q + kv, kv);
    lora(kLoraO, "self_attn.o_proj", bp.proj_w, q, 0, C);
    lora(kLoraGate, "mlp.gate_proj", bp.fc_w, C, 0, F);
    lora(kLoraUp, "mlp.up_proj", bp.up_w, C, 0, F);
    lora(kLoraDown, "mlp.down_proj", bp.down_w, F, 0, C);
  }
}

const ParamInfo& Transformer::param(const std::string& name) const {
  for (const auto& p : params_)
    if (p.name == name) return p;
  throw std::out_of_range("no parameter named " + name);
}

void Transformer::build_state_layout() {
  compact_ = storage_.compact_state && cfg_.lora();
  state_.assign(units_.size(), StateRange{});
  state_size_ = 0;
  for (size_t u = 0; u < units_.size(); ++u) {
    StateRange& s = state_[u];
    if (!compact_) {
      s = {units_[u].offset, units_[u].numel, units_[u].offset, units_[u].numel};
      continue;
    }
    // The unit's trainable parameters: one contiguous run (adapters follow the block's base).
    int64_t b = -1, e = -1;
    for (int i : unit_params_[u]) {
      const ParamInfo& p = params_[static_cast<size_t>(i)];
      if (!p.trainable) continue;
      if (b < 0) b = p.offset;
      else if (p.offset != e) throw std::logic_error("unit " + units_[u].name + ": trainable parameters are not contiguous");
      e = p.offset + p.numel;
    }
    for (int i : unit_params_[u]) {  // and no frozen parameter inside the run
      const ParamInfo& p = params_[static_cast<size_t>(i)];
      if (!p.trainable && b >= 0 && p.offset < e && p.offset + p.numel > b)
        throw std::logic_error("unit " + units_[u].name + ": a frozen parameter lies among the trainable ones");
    }
    const int64_t a = storage_.unit_align, run = b < 0 ? 0 : e - b;
    s = StateRange{b < 0 ? units_[u].offset : b, (run + a - 1) / a * a, state_size_, run};
    state_size_ += s.numel;
  }
  if (!compact_) state_size_ = flat_size_;
}

void Transformer::zero_grads() {
  if (grads_.defined()) grads_.zero_();
  if (eg_.defined()) eg_.zero_();
  if (tied_g_.defined()) tied_g_.zero_();
}

void Transformer::init_weights(uint64_t seed) {
  if (!weights_.defined()) throw std::logic_error("init_weights: the model holds no full fp32 weights");
  if (dev_ == Device::Meta) return;  // nothing to initialise on a count-only device
  if (compute_ == DType::BF16 && compact_) {  // the frozen base goes straight to bf16
    Tensor full = Tensor::empty({flat_size_}, DType::F32, MemCategory::Workspace);
    init_weights_into(seed, full.f32());
    if (weights_bf16_.defined()) kt_->cast_f32_to_bf16(weights_bf16_.bf(), full.f32(), flat_size_);
    for (const StateRange& s : state_)
      if (s.run > 0)
        dev::copy(dev_, weights_.f32() + s.pos, full.f32() + s.begin, static_cast<size_t>(s.run) * sizeof(float));
    return;
  }
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
    if (p.lora_kind) continue;  // adapters: below, from a stream of their own (the base is unchanged)
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
  init_lora_into(seed, w);
}

// LoRA adapters as PEFT initialises them: A Kaiming-uniform with a = sqrt(5), i.e. U(-b, b) with
// b = 1 / sqrt(in), B zero (so the adapted model starts as the base model).
void Transformer::init_lora_into(uint64_t seed, float* w) const {
  for (int u = 0; u < num_units(); ++u) init_lora_unit(seed, u, w + units_[u].offset);
}

void Transformer::init_lora_unit(uint64_t seed, int u, float* unit_w) const {
  Rng rng(seed ^ 0x4C6F5241ull);  // "LoRA": one stream over every adapter of the model, in order
  for (const auto& p : params_) {
    if (p.lora_kind != 'A') continue;
    const float bound = 1.0f / std::sqrt(static_cast<float>(p.shape[1]));
    float* d = p.unit == u ? unit_w + (p.offset - units_[u].offset) : nullptr;
    for (int64_t i = 0; i < p.numel; ++i) {
      const float v = static_cast<float>(2.0 * rng.uniform() - 1.0) * bound;
      if (d) d[i] = v;
    }
  }
  for (const auto& p : params_)  // B = 0
    if (p.lora_kind == 'B' && p.unit == u) std::memset(unit_w + (p.offset - units_[u].offset), 0, static_cast<size_t>(p.numel) * sizeof(float));
}

void Transformer::sync_compute_weights() {
  if (compute_ == DType::BF16 && weights_.defined() && weights_bf16_.defined()) {
    if (!compact_) {
      kt_->cast_f32_to_bf16(weights_bf16_.bf(), weights_.f32(), flat_size_);
    } else {  // only the trainable parameters have a master; the frozen base is bf16 already
      for (const StateRange& s : state_)
        if (s.run > 0) kt_->cast_f32_to_bf16(weights_bf16_.bf() + s.begin, weights_.f32() + s.pos, s.run);
    }
  }
  if (compute_ == DType::BF16 && ewb_.defined()) kt_->cast_f32_to_bf16(ewb_.bf(), ew_.f32(), expert_size_);
}

void Transformer::set_unit_weights(int u, const void* w) { unit_w_.at(u) = w; }
void Transformer::set_unit_grads(int u, float* g) { unit_g_.at(u) = g; }

// fp32 view of a parameter. In bf16 mode the model computes from the bf16 weights only (so a
// sharded run that gathers bf16 computes exactly what an unsharded bf16 run does): small
// parameters (norms, biases, positions) are converted to fp32 on use.
const float* Transformer::param_f32(int idx) {
  const ParamInfo& p = params_[idx];
  const UnitRange& ur = units_[p.unit];
  if (compute_ == DType::BF16) {
    Tensor& t = upcast_[idx];
    if (!t.defined()) t = Tensor::empty({p.numel}, DType::F32, MemCategory::Workspace);
    kt_->cast_bf16_to_f32(t.f32(), param_bf16(idx), p.numel);
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
  if (compute_ != DType::BF16) return param_f32(first);
  int64_t n = 0;
  for (int i = 0; i < 3; ++i) n += params_[first + i].numel;
  if (qkv_bias_.numel() != n) qkv_bias_ = Tensor::empty({n}, DType::F32, MemCategory::Workspace);
  int64_t at = 0;
  for (int i = 0; i < 3; ++i) {
    const int64_t m = params_[first + i].numel;
    dev::copy(dev_, qkv_bias_.f32() + at, param_f32(first + i), static_cast<size_t>(m) * sizeof(float));
    at += m;
  }
  return qkv_bias_.f32();
}

const bf16* Transformer::param_bf16(int idx) const {
  const ParamInfo& p = params_[idx];
  const UnitRange& ur = units_[p.unit];
  if (unit_w_[p.unit]) return static_cast<const bf16*>(unit_w_[p.unit]) + (p.offset - ur.offset);
  if (!weights_bf16_.defined()) throw std::logic_error("unit " + ur.name + " has no weights (not gathered?)");
  return weights_bf16_.bf() + p.offset;
}

float* Transformer::param_grad(int idx) const {
  const ParamInfo& p = params_[idx];
  if (!p.trainable) return nullptr;  // frozen (LoRA): no gradient
  // Gradients are in the state layout; a redirected unit's buffer holds its state range.
  if (unit_g_[p.unit]) return unit_g_[p.unit] + (p.offset - state_[p.unit].begin);
  if (!grads_.defined()) throw std::logic_error("unit " + units_[p.unit].name + " has no gradient buffer");
  return grads_.f32() + state_offset(p);
}

bool Transformer::recomputes(int layer) const {
  if (recompute_ == Recompute::Full) return true;
  if (recompute_ == Recompute::Selective) return layer % 2 == 1;  // every second block
  return false;
}


void Transformer::set_document_masking(int32_t separator) {
  doc_sep_ = separator < 0 ? -1 : separator;
}

void Transformer::document_starts(const int32_t* ids, int64_t B, int64_t T, int32_t separator, int32_t* doc_start) {
  for (int64_t b = 0; b < B; ++b) {
    int32_t start = 0;
    for (int64_t t = 0; t < T; ++t) {
      if (ids[b * T + t] == separator) start = static_cast<int32_t>(t);
      doc_start[b * T + t] = start;
    }
  }
}

// The current slot's document starts and positions from its micro-batch's ids (host or, with
// device inputs, device memory). Under context parallelism the cp ranks' ids are all-gathered: a
// local token's document may begin in a chunk of another rank, so its start (and position) is
// taken in the full sequence.
void Transformer::document_slot(const int32_t* ids, int64_t B, int64_t T) {
  Slot& s = *s_;
  const int64_t N = B * T;
  s.doc_start.resize(static_cast<size_t>(N));
  s.doc_pos.resize(static_cast<size_t>(N));
  std::vector<int32_t> host_ids;
  const int32_t* hid = ids;
  if (device_inputs_) {
    host_ids.resize(static_cast<size_t>(N));
    dev::copy_to_host(dev_, host_ids.data(), ids, static_cast<size_t>(N) * sizeof(int32_t));
    hid = host_ids.data();
  }
  if (!cp_) {
    document_starts(hid, B, T, doc_sep_, s.doc_start.data());
    for (int64_t i = 0; i < N; ++i) s.doc_pos[i] = static_cast<int32_t>(i % T) - s.doc_start[i];
  } else {
    // Token ids travel as floats (exact below 2^24: every vocabulary's).
    const int n = cp_->size();
    const int64_t Tf = T * n;
    std::vector<float> mine(static_cast<size_t>(N)), all(static_cast<size_t>(N * n));
    for (int64_t i = 0; i < N; ++i) mine[i] = static_cast<float>(hid[i]);
    Tensor dmine = Tensor::empty({N}, DType::F32, MemCategory::Comm);
    Tensor dall = Tensor::empty({N * n}, DType::F32, MemCategory::Comm);
    dev::copy_from_host(dev_, dmine.raw(), mine.data(), mine.size() * sizeof(float));
    cp_->all_gather(dmine.f32(), dall.f32(), N);
    dev::copy_to_host(dev_, all.data(), dall.raw(), all.size() * sizeof(float));
    std::vector<int32_t> full(static_cast<size_t>(B * Tf)), ds(static_cast<size_t>(B * Tf));
    for (int q = 0; q < n; ++q) {
      const std::vector<int32_t> pos = cp_positions(q, n, T);
      for (int64_t b = 0; b < B; ++b)
        for (int64_t t = 0; t < T; ++t) full[b * Tf + pos[t]] = static_cast<int32_t>(all[(q * B + b) * T + t]);
    }
    document_starts(full.data(), B, Tf, doc_sep_, ds.data());
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < T; ++t) {
        const int32_t g = cp_pos_[t];
        s.doc_start[b * T + t] = ds[b * Tf + g];
        s.doc_pos[b * T + t] = g - ds[b * Tf + g];
      }
  }
  if (!s.doc_start_dev.defined() || s.doc_start_dev.numel() != N)
    s.doc_start_dev = Tensor::empty({N}, DType::I32, MemCategory::Activations);
  dev::copy_from_host(dev_, s.doc_start_dev.raw(), s.doc_start.data(), static_cast<size_t>(N) * sizeof(int32_t));
}

TokenShape Transformer::tokens() const {
  if (doc_sep_ >= 0 && s_ && static_cast<int64_t>(s_->doc_start.size()) == B_ * T_ && s_->doc_start_dev.defined())
    return {B_, T_, s_->doc_pos.data(), true, s_->doc_start_dev.i32(), s_->doc_start.data()};
  return {B_, T_, cp_ ? cp_pos_.data() : nullptr};
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
  if (!t.defined())
    t = Tensor::empty({residual_rows(B_ * T_), cfg_.n_embd}, res_bf16_ ? DType::BF16 : DType::F32,
                      MemCategory::Activations);
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
  const int64_t BT = B * T;
  if (tpc_.sp && BT % tpc_.size != 0)
    throw std::invalid_argument("sequence parallelism needs micro_batch x sequence (" + std::to_string(BT) +
                                " tokens) divisible by parallel.tp (" + std::to_string(tpc_.size) + ")");
  const int64_t R = residual_rows(BT);
  if (cp_ && T % 2 != 0)
    throw std::invalid_argument("context parallelism needs an even number of local tokens per sequence (two chunks), got " +
                                std::to_string(T));
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
        alloc_block_acts(*s.acts[l], cfg_, compute_, BT, R, B, nh_l_, nkv_l_, mlp_width(l), flash_,
                         gelu_epi_ && !cfg_.is_moe_layer(l), res_bf16_);
        if (cfg_.is_moe_layer(l))
          alloc_moe_acts(*s.acts[l], cfg_, compute_, BT, moe_->rows_hint(BT), moe_shape_.expert_width,
                         moe_shape_.bf16_pre);
      }
    } else if (!s.head.losses.defined()) {
      out_buf(L);
      head_->allocate(s.head, BT, R);
    }
  }
  ensure_workspace();
}

// Workspace shared by every slot (one backward or recompute runs at a time), sized for the current
// slot's B x T (slots of different lengths: data.packing = false).
void Transformer::ensure_workspace() {
  const int64_t BT = B_ * T_;
  if (cp_ && static_cast<int64_t>(cp_pos_.size()) != T_) cp_pos_ = cp_positions(cp_->rank(), cp_->size(), T_);
  if (ws_bt_ == BT) return;
  const int64_t B = B_, C = cfg_.n_embd, F = F_l_, R = residual_rows(BT);
  ws_bt_ = BT;
  scratch_acts_.reset();
  attn_->release();
  mlp_->release();
  dnorm_ = Tensor();
  stage_ = Tensor();
  scratch_moe_acts_.reset();
  if (recompute_ != Recompute::None) {
    scratch_acts_ = std::make_unique<BlockActivations>();
    alloc_block_acts(*scratch_acts_, cfg_, compute_, BT, R, B, nh_l_, nkv_l_, F_l_, flash_, gelu_epi_, res_bf16_);
    if (cfg_.moe()) {  // recomputed MoE layers share their own set
      scratch_moe_acts_ = std::make_unique<BlockActivations>();
      alloc_block_acts(*scratch_moe_acts_, cfg_, compute_, BT, R, B, nh_l_, nkv_l_, moe_shape_.shared_width, flash_,
                       false, res_bf16_);
      alloc_moe_acts(*scratch_moe_acts_, cfg_, compute_, BT, moe_->rows_hint(BT), moe_shape_.expert_width,
                     moe_shape_.bf16_pre);
    }
  }
  auto W = MemCategory::Workspace;
  dres_ = Tensor::empty({BT, C}, DType::F32, W);
  dnorm_ = Tensor::empty({BT, C}, DType::F32, W);
  attn_->allocate(BT);
  mlp_->allocate(BT);
  stage_ = Tensor::empty({BT, std::max(C, F)}, DType::F32, W);
  tpc_.stage = stage_.f32();
  tpc_.allocate(BT, C);
  attn_->allocate_cp(BT);
}

Weight Transformer::weight(int w, int b, int64_t out, bool grads) {
  Weight r;
  r.out = out;
  if (compute_ == DType::BF16)
    r.wb = param_bf16(w);
  else
    r.wf = param_f32(w);
  if (grads) {
    r.dw = param_grad(w);
    if (b >= 0) r.db = param_grad(b);
  } else if (b >= 0) {
    r.b = param_f32(b);
  }
  if (!lora_of_.empty() && !lora_of_[w].empty()) attach_lora(w, grads, &r);
  return r;
}

void Transformer::set_lora_dropout_step(uint64_t seed, int64_t first_micro, int64_t dp_rank) {
  lora_seed_ = seed;
  lora_micro0_ = first_micro;
  lora_row0_ = dp_rank;
  lora_forwards_.clear();
}

// Weight w's adapters as the layers read them (pointers refreshed on every call: a sharded
// strategy may have gathered the unit anywhere).
void Transformer::attach_lora(int w, bool grads, Weight* r) {
  std::vector<LoraPart>& parts = lora_parts_[w];
  parts.clear();
  const bool bf = compute_ == DType::BF16;
  for (int a : lora_of_[w]) {
    const ParamInfo& pa = params_[a];
    LoraPart l;
    l.rank = pa.shape[0];
    l.row0 = pa.lora_row0;
    l.rows = pa.lora_rows;
    l.scale = cfg_.lora_scale();
    if (s_ && s_->lora_micro >= 0) {  // dropout: keyed by the run seed, the micro-batch and the adapter
      l.dropout = cfg_.lora_dropout;
      uint64_t h = 0xCBF29CE484222325ull;  // FNV-1a of the adapter's name (the same in every layout)
      for (char c : pa.name) h = (h ^ static_cast<unsigned char>(c)) * 0x100000001B3ull;
      l.dropout_key = splitmix64(lora_seed_ ^ splitmix64(static_cast<uint64_t>(s_->lora_micro) ^ splitmix64(h)));
      l.T = T_;
      l.sample0 = lora_row0_ * B_;
      l.col0 = pa.tp_split == TpSplit::Cols ? tpc_.rank * pa.shape[1] : 0;
    }
    // tp: the gradient that is a partial sum over the tp ranks (of the replicated matrix)
    if (tpc_.size > 1) l.tp_partial = pa.tp_split == TpSplit::Cols ? 'B' : 'A';
    if (bf) {
      l.ab = param_bf16(a);
      l.bb = param_bf16(a + 1);
    } else {
      l.af = param_f32(a);
      l.bf = param_f32(a + 1);
    }
    if (grads) {
      l.da = param_grad(a);
      l.db = param_grad(a + 1);
    }
    parts.push_back(l);
  }
  r->lora = parts.data();
  r->nlora = static_cast<int>(parts.size());
}

// The block's q|k|v projection: GPT-2's fused weight and bias, or Llama's q, k, v weights (one
// contiguous matrix) with Qwen 2's three biases joined into one (qkv_bias_f32).
Weight Transformer::qkv_weight(const BlockParams& p, int64_t out, bool grads) {
  Weight r = weight(p.qkv_w, p.qkv_b, out, grads);
  if (cfg_.arch != Arch::GPT2 && !grads && p.qkv_b >= 0) r.b = qkv_bias_f32(p.qkv_b);
  return r;
}

Norm Transformer::norm(int w, int b, bool grads) {
  return Norm(tpc_, cfg_.n_embd, cfg_.norm_eps, param_f32(w), b >= 0 ? param_f32(b) : nullptr, grads ? param_grad(w) : nullptr,
              grads && b >= 0 ? param_grad(b) : nullptr, cfg_.arch == Arch::GPT2);
}

// The block's parameter indices (this rank's experts: from the expert buffers when apart).
BlockParams Transformer::block_params_of(int layer) const {
  BlockParams p = block_params(cfg_, layer, unit_params_[layer + 1][0], experts_apart() ? 0 : moe_shape_.local_experts);
  if (experts_apart() && p.moe) p.expert0 = expert_base_[layer];
  return p;
}

// x + attention(ln1(x)), then + mlp(ln2(.)) (or the MoE layer). Under sequence parallelism x,
// out, the norms and the residual hold this rank's R rows; the parallel layers gather and
// reduce-scatter around the matmuls. With the bf16 residual stream the attention projection and
// the MLP write fp32 into dnorm_ (free in forward, and in a recompute before the block's backward)
// and the adds round to bf16: res2 = bf16(x + attention) with the second norm in one kernel, and
// out = bf16(res2 + mlp) with the next norm (the next block's first, or the final norm): the add
// is left pending here, and this block's first norm completes the previous block's add into x.
void Transformer::block_forward(int layer, const Tensor& xt, BlockActivations& a, void* out, bool discard) {
  const int64_t N = B_ * T_, C = cfg_.n_embd, R = residual_rows(N);
  const BlockParams p = block_params_of(layer);
  const TokenShape ts = tokens();
  const Norm n1 = norm(p.ln1_w, p.ln1_b, false), n2 = norm(p.ln2_w, p.ln2_b, false);
  if (res_bf16_) {
    if (pending_res_ && pending_out_ != xt.raw()) flush_residual();
    const bf16* prev = pending_res_;  // x = bf16(prev + dnorm_), written by this norm
    pending_res_ = nullptr;
    float* proj = dnorm_.f32();
    const float* ln1 = prev ? n1.forward_saved_bf16(a.ln1, a.ln1_mean, a.ln1_rstd, xt.bf(), prev, dnorm_.f32(), R)
                            : n1.forward_saved_bf16(a.ln1, a.ln1_mean, a.ln1_rstd, nullptr, xt.bf(), nullptr, R);
    attn_->forward(*this, p, a, ln1, ts, proj);
    const float* ln2 = n2.forward_saved_bf16(a.ln2, a.ln2_mean, a.ln2_rstd, a.res2.bf(), xt.bf(), proj, R);
    float* y = dnorm_.f32();  // the projection is consumed: the MLP's output goes there
    if (p.moe)
      moe_->forward(*this, layer, p, a, a.ln2, y, N, router_dloss_.value_or(cur_dloss_), !recomputing_);
    else
      mlp_->forward(*this, p, a, ln2, y, N, stage_.f32());
    if (!discard) {
      pending_res_ = a.res2.bf();
      pending_out_ = static_cast<bf16*>(out);
    }
    return;
  }
  const float* x = xt.f32();
  float* outf = static_cast<float*>(out);
  const float* ln1 = n1.forward_saved(a.ln1, a.ln1_mean, a.ln1_rstd, x, R);
  attn_->forward(*this, p, a, ln1, ts, a.res2.f32());
  // res2 = attention output + x and its norm in one kernel (the bits of an add, then the norm).
  const float* ln2 = n2.forward_saved_residual(a.ln2, a.ln2_mean, a.ln2_rstd, a.res2.f32(), x, R);
  if (p.moe)  // under SP on every row, gathered as the dense MLP's column-parallel layer does
    moe_->forward(*this, layer, p, a, tpc_.sp ? tpc_.gather(a.ln2, ln2) : a.ln2, outf, N,
                  router_dloss_.value_or(cur_dloss_), !recomputing_);
  else
    mlp_->forward(*this, p, a, ln2, outf, N, stage_.f32());
  kt_->accumulate(outf, a.res2.f32(), R * C);
}

void Transformer::flush_residual() {
  if (!pending_res_) return;
  const int64_t R = residual_rows(B_ * T_);
  kt_->residual_add_bf16(pending_out_, pending_res_, dnorm_.f32(), R * cfg_.n_embd);
  pending_res_ = nullptr;
}

// dx holds d(block output) on entry and d(block input) on exit (this rank's R rows under sequence
// parallelism); it already carries the residual paths' gradient.
void Transformer::block_backward(int layer, const Tensor& x, BlockActivations& a, float* dx) {
  const int64_t N = B_ * T_, R = residual_rows(N);
  const BlockParams p = block_params_of(layer);
  const TokenShape ts = tokens();
  if (tpc_.sp) tpc_.defer_norm_grads();  // the block's two norm-gradient sums in one all-reduce (below)
  float* dnorm = dnorm_.f32();
  const float* dln2 = p.moe ? moe_->backward(*this, p, a, dx, dnorm, N) : mlp_->backward(*this, p, a, dx, dnorm, N);
  const Norm n2 = norm(p.ln2_w, p.ln2_b, true);
  if (res_bf16_)
    n2.backward_bf16(dx, dln2, a.res2.bf(), a.ln2_mean, a.ln2_rstd, R);
  else
    n2.backward(dx, dln2, a.res2.f32(), a.ln2_mean, a.ln2_rstd, R);
  const float* dln1 = attn_->backward(*this, p, a, dx, dnorm, ts);
  const Norm n1 = norm(p.ln1_w, p.ln1_b, true);
  if (res_bf16_)
    n1.backward_bf16(dx, dln1, x.bf(), a.ln1_mean, a.ln1_rstd, R);
  else
    n1.backward(dx, dln1, x.f32(), a.ln1_mean, a.ln1_rstd, R);
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
  pending_res_ = nullptr;  // a forward that threw may have left one
  cur_dloss_ = dloss_scale;
  Slot& s = *s_;
  const int64_t N = B * T, C = cfg_.n_embd, V = cfg_.vocab_size, R = residual_rows(N);
  const bool gpt = cfg_.arch == Arch::GPT2;
  const bool bf = compute_ == DType::BF16;
  s.have_backward = false;
  // LoRA dropout: the micro-batch this forward trains on (each stage forwards its micro-batches in
  // order, so the k-th training forward of a unit range in a step is micro-batch k).
  s.lora_micro = train && cfg_.lora() && cfg_.lora_dropout > 0 ? lora_micro0_ + lora_forwards_[first]++ : -1;

  // Document masking: every stage derives the document starts (and positions) of the micro-batch
  // from its input ids (a pipeline stage after the first as well: its blocks mask and rotate by them).
  if (doc_sep_ >= 0) {
    if (!ids) throw std::invalid_argument("forward_units: document masking needs the micro-batch's ids on every stage");
    document_slot(ids, B, T);
  }
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
    const int emb = unit_params_[0][0];
    // a bf16 stream: the fp32 lookup (+ positions) in workspace, rounded once into the stream
    embedding_->forward(res_bf16_ ? dnorm_.f32() : s.block_out[0].f32(), ids_saved,
                        bf ? static_cast<const void*>(param_bf16(emb)) : param_f32(emb),
                        gpt ? param_f32(emb + 1) : nullptr, tokens());
    if (res_bf16_) kt_->cast_f32_to_bf16(s.block_out[0].bf(), dnorm_.f32(), R * C);
    if (hooks_) hooks_->post_forward(0);
  } else {
    if (!input) throw std::invalid_argument("forward_units: a stage that starts after the embedding needs its input");
    if (res_bf16_) throw std::logic_error("forward_units: a bf16 residual stream runs every unit in one call");
    dev::copy(dev_, s.block_out[first - 1].f32(), input, static_cast<size_t>(R * C) * sizeof(float));
  }
  // blocks
  for (int u = std::max(first, 1); u <= std::min(last, hu - 1); ++u) {
    const int64_t l = u - 1;
    if (hooks_) hooks_->pre_forward(u);
    BlockActivations& a = s.acts[l] ? *s.acts[l] : scratch_for(static_cast<int>(l));
    block_forward(static_cast<int>(l), s.block_out[l], a, s.block_out[l + 1].raw());
    if (hooks_) hooks_->post_forward(u);
  }
  if (last < hu) {
    flush_residual();
    s.have_backward = train;
    return 0.0;
  }
  // head: the final norm on this rank's rows (under sequence parallelism gathered for the
  // vocab-parallel projection, which needs every row), then the projection and the loss
  if (hooks_) hooks_->pre_forward(hu);
  const int hb = unit_params_[hu][0];
  HeadActivations& h = s.head;
  float* hin = tpc_.sp ? stage_.f32() : h.in.f32();
  if (res_bf16_) {  // the last block's pending add fused with the final norm
    bf16* x = s.block_out[cfg_.n_layer].bf();
    if (pending_res_ && pending_out_ != x) flush_residual();
    const bf16* prev = pending_res_;
    pending_res_ = nullptr;
    const Norm hn = norm(hb, gpt ? hb + 1 : -1, false);
    if (prev)
      hn.forward_bf16(hin, h.mean, h.rstd, x, prev, dnorm_.f32(), R);
    else
      hn.forward_bf16(hin, h.mean, h.rstd, nullptr, x, nullptr, R);
  } else {
    norm(hb, gpt ? hb + 1 : -1, false).forward(hin, h.mean, h.rstd, s.block_out[cfg_.n_layer].f32(), R);
  }
  if (tpc_.sp) tpc_.gather_into(hin, h.in.f32());
  if (bf) kt_->cast_f32_to_bf16(h.in_bf.bf(), h.in.f32(), N * C);
  const double loss = head_->forward(head_weight(false), h, targets, N, train, dloss_scale, head_grad_ready(),
                                     {.device_targets = device_inputs_, .sink = loss_sink_});
  if (hooks_) hooks_->post_forward(hu);
  s.have_backward = train && targets;
  return loss;
}

HeadWeight Transformer::head_weight(bool grads) {
  HeadWeight w;
  if (tied_w_.defined()) {  // the replica of a tied embedding cut off by a pipeline
    if (compute_ == DType::F32)
      w.wf = tied_w_.f32();
    else
      w.wb = tied_w_.bf();
    if (grads) w.grad = tied_g_.f32();
    return w;
  }
  const int idx = cfg_.tied_embeddings ? unit_params_[0][0] : unit_params_.back()[1];
  if (compute_ == DType::F32)
    w.wf = param_f32(idx);
  else
    w.wb = param_bf16(idx);
  if (grads) w.grad = param_grad(idx);
  return w;
}

HeadGradReady Transformer::head_grad_ready() {
  if (!sparse_embedding_grad()) return {};
  const int64_t r = hooks_->grad_ready_rows(unit_params_[0][0]);
  return {hooks_, unit_params_[0][0], r > 0 ? std::min(r, Vp_l_) : 0};
}

void Transformer::backward_units(int first, int last, const float* dout, const float* tied_grad, bool split) {
  Slot& s = *s_;
  if (!s.have_backward) throw std::logic_error("backward without a training forward (with targets at the head)");
  if (s.have_weights) throw std::logic_error("backward_units: the slot's previous split backward has not run its weights");
  const int hu = num_units() - 1;
  if (first < 0 || last > hu || first > last) throw std::invalid_argument("backward_units: bad unit range");
  ensure_workspace();  // a forward of another length may have run since this slot's
  const int64_t B = B_, T = T_, N = B * T, C = cfg_.n_embd, R = residual_rows(N);
  const bool gpt = cfg_.arch == Arch::GPT2;
  if (split) s.deferred.resize(static_cast<size_t>(num_units()));
  // Split: unit u's layers queue their weight gradients on s.deferred[u]; its post_backward waits
  // for backward_weights.
  auto begin_unit = [&](int u) {
    if (hooks_) hooks_->pre_backward(u);
    if (split) tpc_.defer = &s.deferred[static_cast<size_t>(u)];
  };
  auto end_unit = [&](int u) {
    tpc_.defer = nullptr;
    tpc_.inputs_kept = false;
    if (hooks_ && !split) hooks_->post_backward(u);
  };
  float* dx = dres_.f32();  // R rows
  if (last == hu) {
    const int hb = unit_params_[hu][0];
    begin_unit(hu);
    tpc_.inputs_kept = split;  // the head's input and logits stay in the slot until W
    const float* dhin = head_->backward(head_weight(true), s.head, N, dnorm_.f32(), head_grad_ready());
    dev::zero(dev_, dx, static_cast<size_t>(R * C) * sizeof(float));
    const Norm hn = norm(hb, gpt ? hb + 1 : -1, true);
    if (res_bf16_)
      hn.backward_bf16(dx, dhin, s.block_out[cfg_.n_layer].bf(), s.head.mean, s.head.rstd, R);
    else
      hn.backward(dx, dhin, s.block_out[cfg_.n_layer].f32(), s.head.mean, s.head.rstd, R);
    end_unit(hu);
  } else {
    if (!dout) throw std::invalid_argument("backward_units: a stage that ends before the head needs its output gradient");
    dev::copy(dev_, dx, dout, static_cast<size_t>(R * C) * sizeof(float));
  }
  for (int u = std::min(last, hu - 1); u >= std::max(first, 1); --u) {
    const int64_t l = u - 1;
    begin_unit(u);
    BlockActivations* a = s.acts[l].get();
    tpc_.inputs_kept = split && a;  // recomputed activations are scratch: copied
    if (!a) {  // recompute this block's forward from its saved input
      a = &scratch_for(static_cast<int>(l));
      recomputing_ = true;
      DeferredGrads* d = tpc_.defer;
      tpc_.defer = nullptr;
      block_forward(static_cast<int>(l), s.block_out[l], *a, stage_.f32(), /*discard=*/true);
      tpc_.defer = d;
      recomputing_ = false;
    }
    block_backward(static_cast<int>(l), s.block_out[l], *a, dx);
    end_unit(u);
  }
  if (first == 0) {
    const int emb = unit_params_[0][0];
    begin_unit(0);
    tpc_.defer = nullptr;
    if (!params_[emb].trainable) {
      // a frozen (LoRA) embedding has nothing to compute
    } else if (split) {
      // The lookup's gradient is all weight gradient: the whole backward runs later, from a copy
      // of its output gradient (the token ids stay in the slot).
      Slot* sp = &s;
      s.deferred[0].add({s.deferred[0].hold(dx, DType::F32, R * C, dev_)},
                        [this, sp, emb, gpt, tied_grad, N](const std::vector<Tensor>& h) {
                          const bool sparse = sparse_embedding_grad();
                          embedding_->backward(h[0].f32(), sp->ids.i32(), param_grad(emb),
                                               gpt ? param_grad(emb + 1) : nullptr, tied_grad, sparse, tokens());
                          if (sparse) hooks_->sparse_grad(emb, embedding_->sparse_ids(), embedding_->sparse_rows(), N);
                        });
    } else {
      const bool sparse = sparse_embedding_grad();  // tp = 1: the lookup's rows are the hooks'
      embedding_->backward(dx, s.ids.i32(), param_grad(emb), gpt ? param_grad(emb + 1) : nullptr, tied_grad, sparse,
                           tokens());
      if (sparse) hooks_->sparse_grad(emb, embedding_->sparse_ids(), embedding_->sparse_rows(), N);
    }
    end_unit(0);
  }
  s.have_backward = false;
  s.have_weights = split;
}

void Transformer::backward_weights(int first, int last, const std::function<void(int, bool)>& around) {
  Slot& s = *s_;
  if (!s.have_weights) throw std::logic_error("backward_weights without a split backward on this slot");
  const int hu = num_units() - 1;
  if (first < 0 || last > hu || first > last) throw std::invalid_argument("backward_weights: bad unit range");
  // A micro-batch of another length may have run since this slot's B (a schedule that defers
  // W past other micro-batches' F and B): the layers size their work by the current token count.
  ensure_workspace();
  for (int u = last; u >= first; --u) {
    if (around) around(u, false);
    if (hooks_) hooks_->pre_weights(u);
    s.deferred[static_cast<size_t>(u)].run();
    if (hooks_) hooks_->post_backward(u);
    if (around) around(u, true);
  }
  s.have_weights = false;
}

int64_t Transformer::deferred_bytes() const {
  int64_t b = 0;
  for (const DeferredGrads& d : s_->deferred) b += d.bytes();
  return b;
}

bool Transformer::can_hand_sparse_grad() const {
  return cfg_.tied_embeddings && tpc_.size == 1 && owned_.front() && owned_.back() && !split_backward_ && !cfg_.lora();
}

bool Transformer::sparse_embedding_grad() {
  return hooks_ && can_hand_sparse_grad() && hooks_->takes_sparse_grad(unit_params_[0][0]);
}


const float* Transformer::unit_output(int u) const {
  if (u < 0 || u > cfg_.n_layer || !s_->block_out[u].defined())
    throw std::logic_error("unit_output: no output of unit " + std::to_string(u) + " on this slot");
  if (res_bf16_) throw std::logic_error("unit_output: the residual stream is bf16 (model.residual_dtype)");
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

const float* Transformer::logits() const { return s_->head.logits.f32(); }

void Transformer::logits_row_to_host(int64_t row, int64_t n, float* host) const {
  const Tensor& lg = s_->head.logits;
  if (lg.dtype() != DType::BF16) {
    dev::copy_to_host(dev_, host, lg.f32() + row * Vp_l_, static_cast<size_t>(n) * sizeof(float));
    return;
  }
  std::vector<bf16> b(static_cast<size_t>(n));
  dev::copy_to_host(dev_, b.data(), lg.bf() + row * Vp_l_, static_cast<size_t>(n) * sizeof(bf16));
  for (int64_t i = 0; i < n; ++i) host[i] = bf16_to_float(b[static_cast<size_t>(i)]);
}

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
    if (sp->ids.defined()) b += static_cast<int64_t>(sp->ids.nbytes());
    b += sp->head.bytes();
    for (const DeferredGrads& d : sp->deferred) b += d.pool_bytes();  // copies held for a split backward's weights
  }
  if (scratch_acts_) b += scratch_acts_->bytes();
  if (scratch_moe_acts_) b += scratch_moe_acts_->bytes();
  return b;
}

}  // namespace mt

namespace mt {

Transformer::MoeStats Transformer::take_moe_stats() { return moe_ ? moe_->take_stats() : MoeStats{}; }

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

}  // namespace mt
