#include "plan/cost_model.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <stdexcept>
#include <vector>

namespace mt::plan {

// ---- names ----------------------------------------------------------------------------------------

const char* strategy_label(Strategy s) {
  switch (s) {
    case Strategy::NoShard: return "DDP";
    case Strategy::Zero1: return "ZeRO-1";
    case Strategy::ShardGradOp: return "ZeRO-2";
    case Strategy::FullShard: return "ZeRO-3";
    case Strategy::HybridShard: return "HSDP";
    case Strategy::HybridShardZero2: return "HSDP-ZeRO-2";
  }
  return "?";
}

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

std::string Layout::describe() const {
  char buf[256];
  std::snprintf(buf, sizeof buf, "%s dp_replicate=%d dp_shard=%d%s tp=%d pp=%d%s%s mb=%lldx%lld ac=%s%s",
                strategy_label(strategy), dp_replicate, dp_shard, cp > 1 ? (" cp=" + std::to_string(cp)).c_str() : "",
                tp, pp, pp > 1 ? " " : "",
                pp > 1 ? (std::string(to_string(schedule)) +
                          (schedule == Schedule::Interleaved ? "(v=" + std::to_string(virtual_stages) + ")" : ""))
                             .c_str()
                       : "",
                static_cast<long long>(micro_batch), static_cast<long long>(microbatches),
                to_string(checkpointing), cpu_offload ? " offload" : "");
  if (ep > 1) return std::string(buf) + " ep=" + std::to_string(ep);
  return buf;
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

namespace {

struct Shape {
  double L, h, a, hk, f, V, s, wpe, norm_block, norm_final, block, block_mm;
  // MoE: share of layers that are MoE layers, routed-expert parameters of one MoE layer, tokens'
  // expert choices k, and the width the activations see per token ((k + shared) x expert width).
  double moe_frac = 0, expert_layer = 0, k = 0, moe_f = 0;
  bool gpt2, tied;
};

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

}  // namespace

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
  const double e = st.act_bytes(), d = st.dropout ? 1.0 : 0.0;
  LayerActs r;
  if (x.gpt2) {
    r.rep = (4 * e + 2 * d) * x.h;                       // ln1 in, qkv in, ln2 in, fc in, 2 masks
    r.split = e * (2 * x.h + 2 * x.hk + 2 * x.f);        // q, k, v, proj in, gelu in, gelu out
  } else {
    r.rep = 4 * e * x.h;                                 // norm1 in, qkv in, norm2 in, gate/up in
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
  const double input = tokens * setup.act_bytes() * x.h / (sp ? T : 1.0);  // what a recomputed layer keeps
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

namespace {

// `parts` equal collectives that together move `bytes` (per-block gathers, gradient buckets).
CollCost split_collective(Collective kind, double bytes, double parts, GroupShape g, const Cluster& c) {
  parts = std::max(1.0, parts);
  CollCost one = collective(kind, bytes / parts, g, c);
  return {one.time * parts, one.intra_bytes * parts, one.inter_bytes * parts};
}

CollCost operator+(CollCost a, const CollCost& b) {
  return {a.time + b.time, a.intra_bytes + b.intra_bytes, a.inter_bytes + b.inter_bytes};
}
CollCost operator*(double k, CollCost a) { return {k * a.time, k * a.intra_bytes, k * a.inter_bytes}; }

}  // namespace

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
  } else if (l.virtual_stages != 1) {
    return "virtual_stages > 1 only with interleaved_1f1b";
  }
  if (l.cpu_offload) {
    if (l.strategy == Strategy::NoShard) return "CPU offload of optimizer state needs a sharded strategy";
    if (c.host_link_bw <= 0 || c.host_mem_bw_per_node <= 0) return "cluster has no separate host memory to offload to";
  }
  if (setup.reduce_bytes != 2 && setup.reduce_bytes != 4) return "reduce dtype must be 2 or 4 bytes";
  if (setup.grad_bytes != 0 && setup.grad_bytes != 2 && setup.grad_bytes != 4) return "grad dtype must be 2 or 4 bytes";
  return "";
}

// ---- the estimate ------------------------------------------------------------------------------------

namespace {

std::string gib(double b) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f GiB", b / GiB);
  return buf;
}

std::string pct(double f) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.0f%%", 100.0 * f);
  return buf;
}

double recompute_share(Checkpointing c) {
  return c == Checkpointing::Full ? 1.0 : c == Checkpointing::Selective ? 0.5 : 0.0;
}

struct StageWork {
  double fwd_flops = 0, fwd_bytes = 0, bwd_flops = 0, bwd_bytes = 0, rc_flops = 0, rc_bytes = 0;
};

std::string why_sentence(const Estimate& e) {
  const Layout& l = e.layout;
  if (!e.host_fits) {
    std::string s = "Does not fit: the offloaded optimizer state needs " + gib(e.host_bytes_per_node) +
                    " of host memory per node (" + gib(e.host_usable) + " usable)";
    if (e.mem.total() > e.mem_usable) s += ", and " + gib(e.mem.total()) + " per " + e.device + " exceeds " + gib(e.mem_usable);
    return s + ".";
  }
  if (!e.fits) {
    const MemoryBytes& m = e.mem;
    std::pair<double, const char*> parts[] = {{m.params, "parameters"},
                                              {m.grads, "gradients"},
                                              {m.optimizer, "optimizer state"},
                                              {m.activations, "activations"},
                                              {m.comm, "communication buffers"}};
    auto big = *std::max_element(std::begin(parts), std::end(parts),
                                 [](auto& a, auto& b) { return a.first < b.first; });
    return "Does not fit: needs " + gib(m.total()) + " per " + e.device + " but only " + gib(e.mem_usable) +
           " is usable; the largest part is " + big.second + " (" + gib(big.first) + ").";
  }
  const double T = e.time.total();
  struct Loss {
    double s;
    std::string what;
  };
  std::vector<Loss> losses;
  if (e.time.bubble > 0)
    losses.push_back({e.time.bubble, "the pipeline bubble"});
  if (e.dp_exposed_s > 0) {
    std::string what;
    switch (l.strategy) {
      case Strategy::NoShard: what = "gradient all-reduce"; break;
      case Strategy::Zero1:
      case Strategy::ShardGradOp: what = "gradient reduce-scatter and parameter all-gather"; break;
      case Strategy::FullShard: what = "ZeRO-3 all-gathers and reduce-scatters"; break;
      case Strategy::HybridShard:
      case Strategy::HybridShardZero2: what = "HSDP shard collectives and replica all-reduce"; break;
    }
    what = "exposed " + what + (e.dp_inter_node ? " across nodes" : " inside the node");
    losses.push_back({e.dp_exposed_s, what});
  }
  if (e.tp_exposed_s > 0) losses.push_back({e.tp_exposed_s, "tensor-parallel collectives that do not overlap"});
  if (e.pp_comm_s > 0) losses.push_back({e.pp_comm_s, "pipeline sends between stages"});
  if (e.offload_s > 0) losses.push_back({e.offload_s, "PCIe copies of the offloaded optimizer shard"});
  if (e.recompute_s > 0) losses.push_back({e.recompute_s, "recomputing checkpointed activations"});
  if (l.cpu_offload && e.optimizer_s > 0) losses.push_back({e.optimizer_s, "the CPU Adam step"});
  std::sort(losses.begin(), losses.end(), [](const Loss& a, const Loss& b) { return a.s > b.s; });
  std::string head = "Fits with " + gib(e.mem_usable - e.mem.total()) + " to spare";
  std::vector<std::string> named;
  for (const Loss& x : losses)
    if (x.s / T >= 0.03 && named.size() < 2) named.push_back(pct(x.s / T) + " of the step is " + x.what);
  if (named.empty())
    return head + " and hides nearly all communication; " +
           pct((e.time.compute - e.recompute_s) / T) + " of the step is useful compute.";
  std::string s = head + "; " + named[0];
  if (named.size() > 1) s += " and " + named[1];
  return s + ".";
}

}  // namespace

Estimate estimate(const ModelConfig& m, const Cluster& cluster_in, const TrainSetup& st, const Layout& l) {
  if (std::string err = check_layout(m, cluster_in, st, l); !err.empty()) throw std::invalid_argument(err);
  Estimate E;
  E.layout = l;
  E.world = l.world();
  const Cluster c = cluster_in.per_rank(E.world);
  const int64_t seq = st.seq_or(m);
  const Shape x = shape_of(m, seq);
  const int t = l.tp, p = l.pp, v = l.virtual_stages;
  const double T = t, mbs = static_cast<double>(l.micro_batch), M = static_cast<double>(l.microbatches);
  const bool sp = st.sequence_parallel && t > 1;
  const double e = st.act_bytes();
  const ModelStateBytes kpp = bytes_per_param(st.fp32, st.grad_bytes);
  const double pb = kpp.params, gb = kpp.grads, rb = st.reduce_bytes;
  const double eta = c.overlap_efficiency;
  const double flops_rate = c.peak_flops(st.fp32) * c.compute_efficiency;
  const double bw_rate = c.mem_bw * c.mem_bw_efficiency;
  // Layers on the heaviest pipeline rank: ceil(L / (p v)) per chunk (uneven splits put the extra
  // layers somewhere; the slowest rank paces the pipeline).
  const double Lps = std::ceil(x.L / (p * static_cast<double>(v))) * v;
  // Context parallelism: a rank holds T/cp tokens of each sequence (their queries still attend to
  // every earlier key of the sequence, so attention FLOPs per token keep the full s).
  const int cp = l.cp;
  const double tokens = x.s * mbs / cp;
  // MoE rows per token through the routed experts: its k choices, or with model.moe_pad_to_capacity
  // E x capacity rows per micro-batch (capacity = ceil(factor x tokens x k / E)), zero rows included:
  // they are computed, held and sent like the others.
  double k_rows = x.k;
  if (m.moe() && m.moe_pad_to_capacity && m.moe_capacity_factor > 0) {
    const double E_moe = static_cast<double>(m.moe_experts);
    k_rows = E_moe * std::ceil(static_cast<double>(m.moe_capacity_factor) * tokens * x.k / E_moe) / tokens;
  }
  const double pad_f = (k_rows - x.k) * static_cast<double>(m.expert_ffn());  // extra expert width per token

  // ---- parameters per GPU: heaviest pipeline stage after TP ----
  const double block_tp = (x.block - x.norm_block) / T + x.norm_block;
  const double emb_tp = x.V * x.h / T;
  double first = Lps * block_tp + emb_tp + x.wpe;
  double last = Lps * block_tp + x.norm_final + emb_tp;  // the head (tied: a copy of wte) on the last stage
  if (p == 1) first += x.norm_final + (x.tied ? 0.0 : emb_tp);
  // Routed experts on this GPU: its stage's MoE layers' experts, split by tp and ep.
  const int ep = std::max(1, l.ep);
  const double psi_e = Lps * x.moe_frac * x.expert_layer / (T * ep);
  const double psi_dense = p == 1 ? first : std::max(first, last);
  // With ep = 1 the experts are ordinary parameters under the strategy; with ep > 1 this engine
  // keeps them apart, data parallel (replicated, DDP-style) over the dp / ep ranks holding them.
  const double psi = psi_dense + psi_e;
  E.psi_stage = psi;
  E.psi_experts = psi_e;

  const int shard = (l.strategy == Strategy::NoShard) ? 1 : l.dp_shard * cp;  // cp ranks shard too
  ModelStateBytes ms = zero_model_state(ep > 1 ? psi_dense : psi, l.strategy, shard, st.fp32, l.cpu_offload, st.grad_bytes);
  if (ep > 1) {
    const ModelStateBytes me = zero_model_state(psi_e, Strategy::NoShard, 1, st.fp32, false, st.grad_bytes);
    ms.params += me.params;
    ms.grads += me.grads;
    ms.optimizer += me.optimizer;
  }
  E.mem.params = ms.params;
  E.mem.grads = ms.grads;
  E.mem.optimizer = ms.optimizer;
  const double psi_opt = psi / shard;  // parameters this GPU updates
  // What the data-parallel strategy reduces and gathers: with ep > 1 the experts are not in it.
  const double psi_dp = ep > 1 ? psi_dense : psi;

  // ---- activations ----
  // MoE layers: the activations of a dense MLP as wide as the token's k routed and shared experts
  // (the router's [tokens, E] scores are small next to them).
  ModelConfig ma = m;
  if (m.moe()) {
    ma.moe_experts = 0;
    ma.ffn_hidden = static_cast<int64_t>((1 - x.moe_frac) * x.f + x.moe_frac * (x.moe_f + pad_f));
  }
  TrainSetup st_rank = st;  // this rank's tokens per sequence
  st_rank.seq = seq / cp;
  const double a_layer = layer_activation_bytes(ma, st_rank, l.micro_batch, t, l.checkpointing);
  const double a_full = layer_activation_bytes(ma, st_rank, l.micro_batch, t, Checkpointing::None);
  // A recomputed layer's full activations exist again while its backward runs (one at a time).
  const double ws = l.checkpointing != Checkpointing::None ? a_full : 0.0;
  const double head_acts = tokens * (e * x.h / (sp ? T : 1.0) + e * x.h + 4.0 * x.V / T);
  double inflight_first = 1, inflight_last = 1;
  switch (l.schedule) {
    case Schedule::None: break;
    case Schedule::GPipe: inflight_first = inflight_last = M; break;
    case Schedule::OneFOneB: inflight_first = std::min<double>(M, p); break;
    case Schedule::Interleaved:
      inflight_first = std::min<double>(M, p) * (1.0 + (p - 1.0) / (p * static_cast<double>(v)));
      break;
  }
  const double act_first = inflight_first * Lps * a_layer + ws;
  const double act_last = inflight_last * Lps * a_layer + ws + head_acts;
  E.mem.activations = p == 1 ? act_first + head_acts : std::max(act_first, act_last);

  // ---- communication buffers ----
  const double unit0 = emb_tp * ((p == 1 && !x.tied) ? 2.0 : 1.0) + x.wpe;  // root FSDP unit
  const double unit = std::max(block_tp, unit0);
  double comm_buf = 0;
  const int dpc = l.dp() * cp;  // ranks the gradients are reduced over
  if (dpc > 1) {
    if (l.strategy == Strategy::FullShard || l.strategy == Strategy::HybridShard)
      comm_buf += 2 * unit * pb + unit * rb;  // gathered current + prefetched unit, unsharded grad
    else
      comm_buf += 2 * std::min(st.bucket_bytes, psi_dp * rb);
  }
  if (t > 1) comm_buf += 2 * tokens * x.h * e;
  if (p > 1) comm_buf += 2 * tokens * x.h * e / (sp ? T : 1.0);
  E.mem.comm = comm_buf;
  E.mem_usable = c.usable_mem();
  E.fits = E.mem.total() <= E.mem_usable;

  const int ranks_per_node = std::min(c.gpus_per_node, E.world);
  if (l.cpu_offload) {
    E.host_bytes_per_node = (kpp.optimizer + gb) * psi_opt * ranks_per_node;
    E.host_usable = 0.8 * c.host_mem_per_node;  // the OS, data loaders and page cache keep the rest
    E.host_fits = E.host_bytes_per_node <= E.host_usable;
    E.fits = E.fits && E.host_fits;
  }

  // ---- compute per micro-batch on the first and the last stage ----
  // Recomputed share of the forward: selective = every second layer (our engine, and torchtitan's
  // "selective layer" option), full = every layer; an override describes other systems' policies.
  double rc_mm = 0, rc_attn = 0, rc_elem = 0;
  const bool unfused = st.attention == AttentionImpl::Unfused;
  if (st.recompute_fraction >= 0) {
    rc_mm = rc_elem = st.recompute_fraction;
    rc_attn = unfused ? st.recompute_fraction : 0.0;  // op-level policies keep the flash-attention output
  } else {
    rc_mm = rc_attn = rc_elem = recompute_share(l.checkpointing);
  }
  const double mm_f = 2.0 * (x.block_mm + x.moe_frac * (x.gpt2 ? 2.0 : 3.0) * x.h * pad_f) / T;
  const double at_f = 4.0 * x.s * x.h / T;
  const double d = st.dropout ? 1.0 : 0.0;
  double elem_rep, elem_split;  // forward elementwise traffic per token per layer
  if (x.gpt2) {
    elem_rep = e * 10 * x.h + d * 2 * (2 * e + 1) * x.h;  // 2 LN, 2 residual adds, (2 dropouts)
    elem_split = e * 2 * x.f;                             // GELU
  } else {
    elem_rep = e * 10 * x.h;                              // 2 RMSNorm, 2 residual adds
    elem_split = e * (2 * (x.h + x.hk) + 3 * x.f);        // RoPE on q,k; SwiGLU
  }
  const double elem_f = elem_rep / (sp ? T : 1.0) + elem_split / T;
  const double s2_f = unfused ? x.a * x.s * (4 * e + d * (2 * e + 1)) / T : 0.0;
  const double s2_b = unfused ? x.a * x.s * (6 * e + d * (2 * e + 1)) / T : 0.0;

  auto stage_work = [&](bool has_embed, bool has_head) {
    StageWork w;
    w.fwd_flops = tokens * Lps * (mm_f + at_f);
    w.fwd_bytes = tokens * Lps * (elem_f + s2_f);
    w.bwd_flops = 2 * w.fwd_flops;
    w.bwd_bytes = tokens * Lps * (2 * elem_f + s2_b);
    w.rc_flops = tokens * Lps * (rc_mm * mm_f + rc_attn * at_f);
    w.rc_bytes = tokens * Lps * (rc_elem * elem_f + rc_attn * s2_f);
    if (has_embed) {
      w.fwd_bytes += tokens * 2 * e * x.h;
      w.bwd_bytes += tokens * (e + 4) * x.h;
    }
    if (has_head) {
      w.fwd_flops += tokens * 2 * x.V * x.h / T;
      w.bwd_flops += tokens * 4 * x.V * x.h / T;
      w.fwd_bytes += tokens * x.V / T * (2 * e + 4);
      w.bwd_bytes += tokens * x.V / T * (4 + e);
    }
    return w;
  };
  const StageWork w_first = stage_work(true, p == 1), w_last = stage_work(false, true);
  auto stage_time = [&](const StageWork& w) {
    return (w.fwd_flops + w.bwd_flops + w.rc_flops) / flops_rate + (w.fwd_bytes + w.bwd_bytes + w.rc_bytes) / bw_rate;
  };
  const StageWork& w = (p == 1 || stage_time(w_first) >= stage_time(w_last)) ? w_first : w_last;
  // Fixed per-kernel cost: ~12 kernels per layer forward, 24 backward (+ the recomputed forward).
  const double k_f = Lps * 12.0 * c.kernel_overhead_s, k_b = Lps * 24.0 * c.kernel_overhead_s;
  const double T_f = w.fwd_flops / flops_rate + w.fwd_bytes / bw_rate + k_f;
  const double rc_s = w.rc_flops / flops_rate + w.rc_bytes / bw_rate + rc_elem * k_f;
  const double T_b = w.bwd_flops / flops_rate + w.bwd_bytes / bw_rate + k_b + rc_s;
  const double elem_s = (w.fwd_bytes + w.bwd_bytes + w.rc_bytes) / bw_rate;

  // ---- groups ----
  const int G = c.gpus_per_node;
  const GroupShape g_tp = group_shape(t, 1, G);
  const GroupShape g_cp = group_shape(cp, t, G);
  const GroupShape g_shard = group_shape(l.dp_shard * cp, t, G);
  const GroupShape g_rep = group_shape(l.dp_replicate, t * cp * l.dp_shard, G);
  // DDP reduces over the replicas and the cp ranks (dp_shard = 1: contiguous at stride t).
  const GroupShape g_dp = l.strategy == Strategy::NoShard ? group_shape(l.dp_replicate * cp, t, G) : g_shard;

  CollCost per_mb, per_step;  // bytes per micro-batch / per step
  double mb_tp = 0, mb_pp = 0, mb_dp = 0, step_dp = 0;  // exposed seconds

  Cluster cs = c;  // blocking collectives: the link they see (Cluster::intra_sync)
  if (c.intra_sync.bw > 0) cs.intra = c.intra_sync;
  // Tensor parallel, as this engine issues them (model/tp_layers.cpp) on b*s*h activations: per
  // layer 2 all-reduces forward (attention and MLP outputs) and 2 backward (their inputs'
  // gradients), and 2 more per recomputed forward; the vocab-parallel embedding's output 1 and the
  // head input's gradient 1. With SP each all-reduce becomes an all-gather + reduce-scatter pair,
  // the backward re-gathers the 2 column-parallel inputs for their weight gradients (2 all-gathers
  // per layer), and the embedding / head add a pair each way. Vocab-parallel CE: three tiny
  // all-reduces.
  // In bf16 the activations and the input gradients' sums travel in bf16 (TpComm's *_activations
  // calls, parallel/tensor_parallel.cpp); under SP the gathered output gradients, which also feed
  // bias and embedding gradients, travel in fp32 (TpContext::gather_grad). Checked against the
  // engine's bytes by plan --validate and its test, to the byte.
  if (t > 1) {
    const double act = tokens * x.h * e, grad = tokens * x.h * 4.0;
    const double fwd_passes = 1.0 + rc_mm;  // recomputed layers re-issue their forward collectives
    CollCost tp;
    if (sp) {
      const CollCost ag = collective(Collective::AllGather, act, g_tp, cs), rs = collective(Collective::ReduceScatter, act, g_tp, cs);
      const CollCost ag_g = collective(Collective::AllGather, grad, g_tp, cs);
      // Per layer: forward 2 gathers + 2 reduce-scatters; backward the 2 output gradients gathered,
      // the 2 input gradients reduce-scattered, the 2 saved inputs re-gathered. Embedding and head:
      // a reduce-scatter and a gather forward, the head input gradient's reduce-scatter and the
      // embedding output gradient's gather backward.
      tp = Lps * (fwd_passes * (2.0 * ag + 2.0 * rs) + (2.0 * ag_g + 2.0 * rs) + 2.0 * ag) + (ag + 2.0 * rs + ag_g);
      // Each norm saw only its rank's rows: its parameters' gradient (fp32) is summed over the tp
      // ranks in backward (model/tp_layers.cpp TpContext::flush_norm_grads): one small all-reduce
      // per block for its two norms, one for the final norm. Latency-bound: on a CPU each costs a
      // round trip.
      tp = tp + Lps * collective(Collective::AllReduce, x.norm_block * 4.0, g_tp, cs) +
           collective(Collective::AllReduce, x.norm_final * 4.0, g_tp, cs);
    } else {
      const CollCost ar = collective(Collective::AllReduce, act, g_tp, cs);
      tp = Lps * (fwd_passes * 2.0 + 2.0) * ar + 2.0 * ar;
    }
    tp = tp + 3.0 * collective(Collective::AllReduce, tokens * 4.0, g_tp, cs);
    per_mb = per_mb + tp;
    mb_tp = st.tp_comm_overlap ? std::max(0.0, tp.time - eta * (T_f + T_b)) : tp.time;
    E.tp_comm_s = M * tp.time;
    E.group_bytes.tp = M * (tp.intra_bytes + tp.inter_bytes);
    E.tp_exposed_s = M * mb_tp;
  }

  // Pipeline: per micro-batch and model chunk one activation send forward and one gradient send
  // backward; with SP only 1/t of it crosses (scatter/gather optimisation, arXiv 2104.04473 §4.1).
  if (p > 1) {
    const double bytes = tokens * x.h * e / (sp ? T : 1.0);
    const int stride = t * cp * l.dp();
    const bool inter = stride >= G || stride * p > G;
    const Link& link = inter ? c.inter : c.intra;
    const double sends = 2.0 * v;
    CollCost pc;
    pc.time = sends * (bytes / link.bw + link.latency_s);
    (inter ? pc.inter_bytes : pc.intra_bytes) = sends * bytes;
    per_mb = per_mb + pc;
    mb_pp = pc.time;
    E.group_bytes.pp = M * sends * bytes;
  }

  // Expert parallelism: per MoE layer and micro-batch four all-to-alls of the token choices' rows
  // that leave the rank ((ep-1)/ep of k x tokens rows of h): input rows (compute dtype) and output
  // rows (fp32) forward, their gradients (fp32) backward, as this engine sends them; a recomputed
  // forward repeats its two. Point-to-point, synchronous: all exposed. Every tp rank routes all the
  // micro-batch's tokens, with sequence parallelism too (the MoE layer gathers its input over tp).
  if (ep > 1 && m.moe()) {
    const GroupShape g_ep = group_shape(ep, t * cp, G);  // consecutive dp ranks of one cp and tp rank
    const double rows = k_rows * tokens * (ep - 1.0) / ep;
    const double per_layer = rows * x.h * (e + 4.0 + 4.0 + 4.0 + rc_mm * (e + 4.0));
    const double bytes = Lps * x.moe_frac * per_layer;
    // Peers off the node: (ep - local) of the ep - 1 others.
    const double inter_share = g_ep.nodes > 1 ? (ep - g_ep.local) / (ep - 1.0) : 0.0;
    CollCost a2a;
    a2a.inter_bytes = bytes * inter_share;
    a2a.intra_bytes = bytes - a2a.inter_bytes;
    const double msgs = Lps * x.moe_frac * (4.0 + 2.0 * rc_mm) * (ep - 1.0);
    a2a.time = std::max(a2a.intra_bytes / c.intra.bw, a2a.inter_bytes / c.inter.bw) +
               msgs * (inter_share > 0 ? c.inter.latency_s : c.intra.latency_s);
    per_mb = per_mb + a2a;
    E.ep_comm_s = M * a2a.time;
    E.group_bytes.ep = M * bytes;
  }

  // Data parallel. `overlapped`: a collective of total time `comm` issued while `window` seconds of
  // compute run; its last piece (`tail`, one bucket or unit) cannot hide. The tail runs when the
  // compute it would hide behind has not started or is over (the first unit's gather, the last
  // bucket's reduction), so it sees the link of collectives the ranks wait for (cs: on CPUs, the
  // cores idle), not the one of communication competing with compute.
  auto overlapped = [&](double comm, double tail, double window) {
    return tail + std::max(0.0, comm - tail - eta * window);
  };
  const double n_units = Lps + 1.0;  // FSDP units: one per block plus the root (embedding/head)
  auto buckets = [&](double bytes) { return std::ceil(bytes / st.bucket_bytes); };
  // Context parallelism (the engine's ring, model/transformer.cpp): per layer and micro-batch the
  // fp32 key / value block (tokens x 2 kv heads' width / t x 4 bytes) is sent cp - 1 times forward,
  // cp - 1 times again in backward with cp - 1 sends of its gradient, and cp - 1 more for every
  // recomputed forward; each send overlaps the attention of the block in hand.
  double mb_cp = 0;
  if (cp > 1) {
    const double block = tokens * 2.0 * x.hk / T * 4.0;
    const double sends = Lps * (cp - 1.0) * (3.0 + rc_mm);
    const Link& link = g_cp.nodes > 1 ? c.inter : cs.intra;
    CollCost cc;
    cc.time = sends * (block / link.bw + link.latency_s);
    (g_cp.nodes > 1 ? cc.inter_bytes : cc.intra_bytes) = sends * block;
    per_mb = per_mb + cc;
    const double attn_s = tokens * Lps * at_f * (3.0 + rc_attn) / flops_rate;
    mb_cp = std::max(0.0, cc.time - eta * attn_s);
    E.cp_comm_s = M * cc.time;
    E.cp_exposed_s = M * mb_cp;
    E.group_bytes.cp = M * 2.0 * sends * block;  // the engine counts each transfer's send and receive
  }

  double dp_total = 0;
  if (dpc > 1) {
    const double grad_bytes = psi_dp * rb, param_bytes = psi_dp * pb;
    const double bucket_g = std::min(grad_bytes, st.bucket_bytes), bucket_p = std::min(param_bytes, st.bucket_bytes);
    switch (l.strategy) {
      case Strategy::NoShard: {  // all-reduce once per step (no_sync while accumulating), during the last backward
        CollCost ar = split_collective(Collective::AllReduce, grad_bytes, buckets(grad_bytes), g_dp, c);
        per_step = per_step + ar;
        dp_total = ar.time;
        E.group_bytes.dp = ar.intra_bytes + ar.inter_bytes;
        step_dp = overlapped(ar.time, collective(Collective::AllReduce, bucket_g, g_dp, cs).time, T_b);
        break;
      }
      case Strategy::Zero1:
      case Strategy::ShardGradOp: {
        CollCost rs = split_collective(Collective::ReduceScatter, grad_bytes, buckets(grad_bytes), g_dp, c);
        const double rs_ex = overlapped(rs.time, collective(Collective::ReduceScatter, bucket_g, g_dp, cs).time, T_b);
        CollCost ag = split_collective(Collective::AllGather, param_bytes, buckets(param_bytes), g_dp, c);
        const double ag_ex = st.overlap_param_gather
                                 ? overlapped(ag.time, collective(Collective::AllGather, bucket_p, g_dp, cs).time, T_f)
                                 : split_collective(Collective::AllGather, param_bytes, buckets(param_bytes), g_dp, cs).time;
        if (l.strategy == Strategy::Zero1) {  // full gradients accumulate locally; reduce once
          per_step = per_step + rs;
          step_dp = rs_ex;
          dp_total = rs.time;
        } else {  // gradients are sharded: reduce-scatter after every micro-batch
          per_mb = per_mb + rs;
          mb_dp = rs_ex;
          dp_total = M * rs.time;
        }
        per_step = per_step + ag;
        step_dp += ag_ex;
        dp_total += ag.time;
        E.group_bytes.dp = (l.strategy == Strategy::Zero1 ? 1.0 : M) * (rs.intra_bytes + rs.inter_bytes) +
                           ag.intra_bytes + ag.inter_bytes;
        break;
      }
      case Strategy::FullShard:
      case Strategy::HybridShard: {  // per micro-batch: gather forward, gather backward, reduce-scatter
        CollCost ag = split_collective(Collective::AllGather, param_bytes, n_units, g_shard, c);
        CollCost rs = split_collective(Collective::ReduceScatter, grad_bytes, n_units, g_shard, c);
        const double first = collective(Collective::AllGather, unit0 * pb, g_shard, cs).time;
        const double last = collective(Collective::ReduceScatter, unit0 * rb, g_shard, cs).time;
        per_mb = per_mb + ag + ag + rs;
        const double ex_b = overlapped(ag.time + rs.time, last, T_b);
        mb_dp = overlapped(ag.time, first, T_f) + ex_b;
        dp_total = M * (2 * ag.time + rs.time);
        E.group_bytes.dp = M * (2 * (ag.intra_bytes + ag.inter_bytes) + rs.intra_bytes + rs.inter_bytes);
        if (l.strategy == Strategy::HybridShard) {  // replicas all-reduce their gradient shard once per step
          CollCost ar = split_collective(Collective::AllReduce, grad_bytes / shard, n_units, g_rep, c);
          const double ar_last = collective(Collective::AllReduce, unit0 * rb / shard, g_rep, cs).time;
          per_step = per_step + ar;
          dp_total += ar.time;
          E.group_bytes.dp_replicate = ar.intra_bytes + ar.inter_bytes;
          // It shares the last micro-batch's backward window with that micro-batch's collectives.
          step_dp = overlapped(ag.time + rs.time + ar.time, last + ar_last, T_b) - ex_b;
        }
        break;
      }
      case Strategy::HybridShardZero2: break;  // refused by check_layout
    }
  }
  E.dp_comm_s = dp_total;
  E.dp_exposed_s = M * mb_dp + step_dp;
  E.dp_inter_node = (l.strategy == Strategy::NoShard ? g_rep : g_shard).nodes > 1 ||
                    (l.strategy == Strategy::HybridShard && g_rep.nodes > 1);

  // ---- optimizer step and offload ----
  const double adam_bytes = 28.0;  // read+write fp32 master, m, v (24) + read grad + write param
  double opt_s = adam_bytes * psi_opt / bw_rate;
  if (l.cpu_offload) {  // CPU Adam bound by host memory bandwidth shared by the node's GPUs
    opt_s = adam_bytes * psi_opt * ranks_per_node / c.host_mem_bw_per_node;
    E.offload_s = (gb + pb) * psi_opt / c.host_link_bw;  // gradient shard down, parameter shard up
  }
  E.optimizer_s = opt_s;

  // ---- step time: compute on the critical stage + exposed communication + bubble ----
  // The experts' gradient all-reduce over the dp / ep ranks holding them times the cp ranks (ep > 1),
  // once per step after backward (this engine does not overlap it). With cp the group's shape is
  // that of its cp ranks' stride (they are the closest members).
  double step_edp = 0;
  if (ep > 1 && l.dp() / ep * cp > 1) {
    const GroupShape g_edp = group_shape(l.dp() / ep * cp, cp > 1 ? t : t * ep, G);
    CollCost ar = collective(Collective::AllReduce, psi_e * rb, g_edp, c);
    per_step = per_step + ar;
    step_edp = ar.time;
    E.group_bytes.edp = ar.intra_bytes + ar.inter_bytes;
  }
  const double mb_ep = M > 0 ? E.ep_comm_s / M : 0.0;
  const double slot = T_f + T_b + mb_tp + mb_pp + mb_dp + mb_ep + mb_cp;  // one micro-batch on the critical stage
  E.time.compute = M * (T_f + T_b) + opt_s;
  E.time.exposed_comm = M * (mb_tp + mb_pp + mb_dp + mb_ep + mb_cp) + step_dp + step_edp + E.offload_s;
  E.time.bubble = p > 1 ? (p - 1.0) / v * slot : 0.0;
  // Ranks time-sharing cores (per-rank rates measured with every rank computing): each computes a
  // share beta of the step and waits the rest, and while it waits the others get its cores. With n
  // ranks on c cores a computing rank then has min(1, c / (n beta)) of a core where the probes had
  // c / n, so its compute - and the bubble, which is the other stage's compute - shrink by
  // max(c / n, beta). beta from the times before the scaling (one pass).
  if (c.cores_per_rank > 0 && c.cores_per_rank < 1 && E.time.total() > 0) {
    const double s = std::max(c.cores_per_rank, E.time.compute / E.time.total());
    E.time.compute *= s;
    E.time.bubble *= s;
  }
  E.pp_comm_s = M * mb_pp;
  E.recompute_s = M * rc_s;
  E.elementwise_s = M * elem_s;
  const double total = E.time.total();
  E.comm.intra_node = M * per_mb.intra_bytes + per_step.intra_bytes;
  E.comm.inter_node = M * per_mb.inter_bytes + per_step.inter_bytes;
  const double global_tokens = static_cast<double>(l.global_batch()) * x.s;
  E.tokens_per_s = global_tokens / total;
  E.mfu = flops_per_token(m, seq) * E.tokens_per_s / (E.world * c.peak_flops(st.fp32));
  E.device = c.device;
  E.why = why_sentence(E);
  return E;
}

}  // namespace mt::plan

namespace mt::plan {

double elementwise_bytes(const ModelConfig& m, int64_t micro_batch, bool bf16, int tp, bool sp) {
  // estimate() on a cluster whose arithmetic is free and whose memory moves one byte per second:
  // its elementwise and optimizer seconds are then the bytes it charges.
  Cluster c;
  c.name = "bytes";
  c.gpus = tp;
  c.gpus_per_node = tp;
  c.mem_per_gpu = 1e18;
  c.peak_flops_bf16 = c.peak_flops_fp32 = 1e30;
  c.compute_efficiency = 1.0;
  c.mem_bw = 1.0;
  c.mem_bw_efficiency = 1.0;
  c.intra = c.inter = {1e30, 0.0};
  c.kernel_overhead_s = 0.0;
  TrainSetup st;
  st.fp32 = !bf16;
  st.grad_bytes = 4;
  st.reduce_bytes = 4;
  st.seq = m.seq_len;
  st.global_batch = micro_batch;
  st.micro_batch = micro_batch;
  st.attention = AttentionImpl::Flash;
  st.sequence_parallel = sp && tp > 1;
  Layout l;
  l.tp = tp;
  l.micro_batch = micro_batch;
  l.microbatches = 1;
  const Estimate e = estimate(m, c, st, l);
  return e.elementwise_s + e.optimizer_s;
}

}  // namespace mt::plan
