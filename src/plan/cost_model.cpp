#include "plan/cost_model.h"

#include "plan/shape.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <stdexcept>
#include <vector>

namespace mt::plan {

// ---- names ----------------------------------------------------------------------------------------

bool parse_strategy(const std::string& s, Strategy* out) {
  for (Strategy v : {Strategy::NoShard, Strategy::Zero1, Strategy::ShardGradOp, Strategy::FullShard, Strategy::HybridShard})
    if (s == strategy_label(v) || s == to_string(v)) {
      *out = v;
      return true;
    }
  if (s == "ddp") *out = Strategy::NoShard;
  else if (s == "zero1" || s == "zero-1") *out = Strategy::Zero1;
  else if (s == "zero2" || s == "zero-2") *out = Strategy::ShardGradOp;
  else if (s == "zero3" || s == "zero-3" || s == "fsdp") *out = Strategy::FullShard;
  else if (s == "hsdp") *out = Strategy::HybridShard;
  else return false;
  return true;
}

bool parse_schedule(const std::string& s, Schedule* out) {
  if (s == to_string(Schedule::None)) {
    *out = Schedule::None;
    return true;
  }
  if (std::optional<Schedule> v = try_parse_pipeline_schedule(s)) {
    *out = *v;
    return true;
  }
  if (s == "interleaved") {
    *out = Schedule::Interleaved;
    return true;
  }
  return false;
}

bool parse_checkpointing(const std::string& s, Checkpointing* out) {
  if (std::optional<Checkpointing> v = try_parse_recompute(s)) {
    *out = *v;
    return true;
  }
  return false;
}

// ---- model-state formulas -------------------------------------------------------------------------

ModelStateBytes bytes_per_param(bool fp32, int grad_bytes) {
  ModelStateBytes k = fp32 ? ModelStateBytes{4, 4, 8}    // fp32 param, fp32 grad, Adam m and v (param = master)
                           : ModelStateBytes{2, 2, 12};  // bf16 param, bf16 grad, fp32 master + m + v
  if (grad_bytes > 0) k.grads = grad_bytes;
  return k;
}

ModelStateBytes zero_model_state(double psi, Strategy s, int shard, bool fp32, bool cpu_offload, int grad_bytes) {
  const ModelStateBytes k = bytes_per_param(fp32, grad_bytes);
  const double n = std::max(1, shard);
  ModelStateBytes r;
  switch (s) {
    case Strategy::NoShard:
      r = {k.params * psi, k.grads * psi, k.optimizer * psi};
      break;
    case Strategy::Zero1:
      r = {k.params * psi, k.grads * psi, k.optimizer * psi / n};
      break;
    case Strategy::ShardGradOp:
    case Strategy::HybridShardZero2:  // ZeRO-2 inside the shard group
      r = {k.params * psi, k.grads * psi / n, k.optimizer * psi / n};
      break;
    case Strategy::FullShard:
    case Strategy::HybridShard:
      r = {k.params * psi / n, k.grads * psi / n, k.optimizer * psi / n};
      break;
  }
  if (cpu_offload) r.optimizer = 0;
  return r;
}

double model_state_bytes(const ModelConfig& m, bool fp32) {
  return bytes_per_param(fp32).total() * static_cast<double>(m.num_params());
}

// ---- model shape helpers --------------------------------------------------------------------------

Shape shape_of(const ModelConfig& m, int64_t seq) {
  Shape x;
  x.gpt2 = m.arch == Arch::GPT2;
  x.tied = m.tied_embeddings;
  x.L = static_cast<double>(m.n_layer);
  x.h = static_cast<double>(m.n_embd);
  x.a = static_cast<double>(m.n_head);
  x.hk = static_cast<double>(m.n_kv_head * m.head_dim());
  x.f = static_cast<double>(m.ffn_hidden);
  x.V = static_cast<double>(m.padded_vocab);
  x.s = static_cast<double>(seq);
  x.wpe = x.gpt2 ? static_cast<double>(m.seq_len) * x.h : 0.0;
  x.norm_block = x.gpt2 ? 4 * x.h : 2 * x.h;
  x.norm_final = x.gpt2 ? 2 * x.h : x.h;
  const double qkv = x.h + 2 * x.hk;
  x.block_mm = x.h * qkv + x.h * x.h + (x.gpt2 ? 2.0 : 3.0) * x.h * x.f;
  if (!m.moe()) {
    x.block = static_cast<double>(m.block_params());
    return x;
  }
  // Per-layer averages over the dense and MoE layers; `block` excludes the routed experts (held
  // apart: split by ep), block_mm counts what one token multiplies (router, k experts, shared).
  const double nm = static_cast<double>(m.moe_layers());
  x.moe_frac = nm / x.L;
  x.expert_layer = static_cast<double>(m.moe_experts * m.expert_params());
  x.k = static_cast<double>(m.moe_top_k);
  const double fe = static_cast<double>(m.expert_ffn());
  x.moe_f = (x.k + static_cast<double>(m.moe_shared_experts)) * fe;
  double all = 0;
  for (int64_t l = 0; l < m.n_layer; ++l) all += static_cast<double>(m.block_params(l));
  x.block = (all - nm * x.expert_layer) / x.L;
  const double mlp_mm = (x.gpt2 ? 2.0 : 3.0) * x.h;
  const double moe_mm = x.h * qkv + x.h * x.h + static_cast<double>(m.moe_experts) * x.h + mlp_mm * x.moe_f;
  x.block_mm = (1 - x.moe_frac) * x.block_mm + x.moe_frac * moe_mm;
  return x;
}

double matmul_params(const ModelConfig& m) {
  Shape x = shape_of(m, m.seq_len);
  return x.L * x.block_mm + x.V * x.h;
}

double flops_per_token(const ModelConfig& m, int64_t seq) {
  Shape x = shape_of(m, seq);
  double n = static_cast<double>(m.active_params());  // MoE: what one token multiplies
  if (!x.tied) n -= x.V * x.h;  // the input embedding is a lookup
  n -= x.wpe;                   // so is GPT-2's position table
  return 6.0 * n + 12.0 * x.L * x.h * x.s;
}

double megatron_flops_per_iteration(const ModelConfig& m, int64_t global_batch, int64_t seq) {
  Shape x = shape_of(m, seq);
  const double B = static_cast<double>(global_batch);
  return 96.0 * B * x.s * x.L * x.h * x.h * (1.0 + x.s / (6.0 * x.h) + x.V / (16.0 * x.L * x.h));
}

// ---- activation formulas --------------------------------------------------------------------------

double korthikanti_layer_activation_bytes(double s, double b, double h, double a, int t, bool sp,
                                          Checkpointing ckpt) {
  const double sbh = s * b * h, T = std::max(1, t);
  if (ckpt == Checkpointing::Full) return 2.0 * sbh / (sp ? T : 1.0);
  const double s2 = ckpt == Checkpointing::Selective ? 0.0 : 5.0 * a * s / h;
  if (sp) return sbh / T * (34.0 + s2);
  return sbh * (10.0 + 24.0 / T + s2 / T);
}

namespace {

// Per token, one layer, forward: bytes stored for backward split into the part replicated across TP
// ranks without SP (norm inputs, inputs of column-parallel matmuls, dropout masks) and the part
// already split by TP, plus the attention-score part (per token, also split).
struct LayerActs {
  double rep = 0, split = 0, scores = 0;
};

LayerActs layer_acts(const Shape& x, const TrainSetup& st) {
  const double e = st.act_bytes(), d = st.dropout ? 1.0 : 0.0, rs = st.res_bytes();
  LayerActs r;
  if (x.gpt2) {
    r.rep = (2 * rs + 2 * e + 2 * d) * x.h;              // ln1 in, ln2 in (the residual stream), qkv in, fc in, 2 masks
    r.split = e * (2 * x.h + 2 * x.hk + 2 * x.f);        // q, k, v, proj in, gelu in, gelu out
  } else {
    r.rep = (2 * rs + 2 * e) * x.h;                      // norm1 in, norm2 in (the residual stream), qkv in, gate/up in
    r.split = e * (2 * x.h + 2 * x.hk + 3 * x.f);        // q, k, v, o in, gate, up, down in
  }
  if (st.attention == AttentionImpl::Unfused)
    r.scores = x.a * x.s * (e + d * (1 + e));            // softmax out (+ mask + dropout out)
  else
    r.scores = 4.0 * x.a;                                // flash: fp32 log-sum-exp per head
  return r;
}

}  // namespace

double layer_activation_bytes(const ModelConfig& m, const TrainSetup& setup, int64_t micro_batch, int tp,
                              Checkpointing ckpt) {
  const Shape x = shape_of(m, setup.seq_or(m));
  const double T = std::max(1, tp);
  const bool sp = setup.sequence_parallel && tp > 1;
  const double tokens = x.s * static_cast<double>(micro_batch);
  const double input = tokens * setup.res_bytes() * x.h / (sp ? T : 1.0);  // what a recomputed layer keeps
  const LayerActs a = layer_acts(x, setup);
  const double all = tokens * (a.rep / (sp ? T : 1.0) + a.split / T + a.scores / T);
  switch (ckpt) {
    case Checkpointing::None: return all;
    case Checkpointing::Full: return input;
    case Checkpointing::Selective: return 0.5 * (all + input);  // every second layer recomputed
  }
  return all;
}

// ---- collectives ------------------------------------------------------------------------------------

GroupShape group_shape(int size, int stride, int gpus_per_node) {
  GroupShape g;
  g.size = std::max(1, size);
  if (g.size == 1) return g;
  const int G = std::max(1, gpus_per_node);
  g.local = stride >= G ? 1 : std::max(1, std::min(g.size, G / std::max(1, stride)));
  g.nodes = (g.size + g.local - 1) / g.local;
  return g;
}

CollCost collective(Collective kind, double bytes, GroupShape g, const Cluster& c) {
  CollCost r;
  if (g.size <= 1 || bytes <= 0) return r;
  const double n = g.size;
  const double passes = kind == Collective::AllReduce ? 2.0 : 1.0;
  const double total = passes * (n - 1) / n * bytes;
  if (g.nodes > 1) {
    r.inter_bytes = total / g.local;
    r.intra_bytes = total - r.inter_bytes;
  } else {
    r.intra_bytes = total;
  }
  const double bw_time = std::max(r.intra_bytes / c.intra.bw, r.inter_bytes / c.inter.bw);
  double alpha = c.intra.latency_s;
  if (g.nodes > 1) alpha = ((g.local - 1) * c.intra.latency_s + c.inter.latency_s) / g.local;
  const double ring = passes * (n - 1) * alpha;
  const double tree = passes * 2.0 * std::ceil(std::log2(n)) *
                      (g.nodes > 1 ? std::max(c.inter.latency_s, c.intra.latency_s) : c.intra.latency_s);
  r.time = bw_time + std::min(ring, tree);
  return r;
}

double bubble_fraction(int p, int64_t m, int v) {
  if (p <= 1) return 0.0;
  const double slots = static_cast<double>(p - 1) / std::max(1, v);
  return slots / (static_cast<double>(m) + slots);
}

// ---- layout checks ----------------------------------------------------------------------------------

std::string check_layout(const ModelConfig& m, const Cluster& c, const TrainSetup& setup, const Layout& l) {
  auto str = [](auto v) { return std::to_string(v); };
  if (l.dp_replicate < 1 || l.dp_shard < 1 || l.tp < 1 || l.pp < 1 || l.cp < 1) return "parallel degrees must be >= 1";
  if (l.cp > 1 && setup.seq_or(m) % (2 * l.cp) != 0)
    return "cp=" + str(l.cp) + " needs the sequence (" + str(setup.seq_or(m)) + ") divisible by 2 x cp";
  if (l.micro_batch < 1 || l.microbatches < 1) return "micro-batch size and count must be >= 1";
  switch (l.strategy) {
    case Strategy::NoShard:
      if (l.dp_shard != 1) return "DDP replicates: dp_shard must be 1";
      break;
    case Strategy::Zero1:
    case Strategy::ShardGradOp:
    case Strategy::FullShard:
      if (l.dp_replicate != 1) return std::string(strategy_label(l.strategy)) + " shards over all data-parallel ranks: dp_replicate must be 1";
      break;
    case Strategy::HybridShard:
      if (l.dp_replicate < 2 || l.dp_shard < 2) return "HSDP needs dp_replicate >= 2 and dp_shard >= 2";
      break;
    case Strategy::HybridShardZero2:
      return "HYBRID_SHARD_ZERO2 is not modelled by the planner";
  }
  if (m.n_head % l.tp != 0) return "tp=" + str(l.tp) + " does not divide n_head=" + str(m.n_head);
  if (m.n_kv_head % l.tp != 0) return "tp=" + str(l.tp) + " does not divide n_kv_head=" + str(m.n_kv_head);
  if (m.ffn_hidden % l.tp != 0) return "tp=" + str(l.tp) + " does not divide ffn_hidden=" + str(m.ffn_hidden);
  if (m.padded_vocab % l.tp != 0) return "tp=" + str(l.tp) + " does not divide the padded vocabulary " + str(m.padded_vocab);
  if (l.pp > m.n_layer) return "pp=" + str(l.pp) + " exceeds n_layer=" + str(m.n_layer);
  if (l.pp == 1 && l.schedule != Schedule::None) return "a pipeline schedule needs pp > 1";
  if (l.pp > 1 && l.schedule == Schedule::None) return "pp > 1 needs a schedule (gpipe, 1f1b, interleaved_1f1b)";
  if (l.schedule == Schedule::Interleaved) {
    if (l.virtual_stages < 2) return "interleaved_1f1b needs virtual_stages >= 2";
    if (static_cast<int64_t>(l.pp) * l.virtual_stages > m.n_layer)
      return "pp*virtual_stages=" + str(l.pp * l.virtual_stages) + " exceeds n_layer=" + str(m.n_layer);
    if (l.microbatches % l.pp != 0) return "interleaved_1f1b needs microbatches divisible by pp (Megatron)";
  } else if (l.schedule == Schedule::ZeroBubbleV) {
    if (l.virtual_stages != 2) return "zbv has 2 virtual stages per rank (a V)";
    if (2LL * l.pp > m.n_layer) return "zbv: 2*pp=" + str(2 * l.pp) + " exceeds n_layer=" + str(m.n_layer);
  } else if (l.virtual_stages != 1) {
    return "virtual_stages > 1 only with interleaved_1f1b and zbv";
  }
  if (l.offload_optimizer()) {
    // One GPU holds the whole model whatever the strategy, so DDP offloads there as the engine does
    // (train.offload at one rank); over several GPUs each must hold a shard of the state.
    if (l.strategy == Strategy::NoShard && l.world() > 1)
      return "CPU offload of optimizer state needs a sharded strategy (or a single GPU)";
    if (c.host_link_bw <= 0 || c.host_mem_bw_per_node <= 0) return "cluster has no separate host memory to offload to";
  }
  if (setup.reduce_bytes != 2 && setup.reduce_bytes != 4) return "reduce dtype must be 2 or 4 bytes";
  if (setup.grad_bytes != 0 && setup.grad_bytes != 2 && setup.grad_bytes != 4) return "grad dtype must be 2 or 4 bytes";
  return "";
}

}  // namespace mt::plan
