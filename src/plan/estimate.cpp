// The cost model's estimate of one layout (declared in cost_model.h): memory per GPU, compute on
// the critical pipeline stage, each parallel dimension's communication and how much of it the
// compute hides, the optimizer step, and the step time they add up to.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

#include "plan/cost_model.h"
#include "plan/shape.h"

namespace mt::plan {

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
  if (l.offload_optimizer() && e.optimizer_s > 0) losses.push_back({e.optimizer_s, "the CPU Adam step"});
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

// ---- what every part of the estimate reads -------------------------------------------------------------

// The model, setup and layout, the cluster per rank, and the quantities derived from them once.
struct Ctx {
  const ModelConfig& m;
  const TrainSetup& st;
  const Layout& l;
  Cluster c;  // per rank
  int64_t seq;
  Shape x;
  int t, p, v, cp, ep;
  double T, mbs, M;
  bool sp;
  double e;  // activation element bytes
  ModelStateBytes kpp;
  double pb, gb, rb;  // bytes per parameter, stored gradient, reduced gradient element
  double eta, flops_rate, bw_rate;
  double Lps;     // layers on the heaviest pipeline rank
  double tokens;  // this rank's tokens of one micro-batch
  double k_rows, pad_f;  // MoE: rows per token through the routed experts, extra expert width per token
  // Parameters per GPU: a block and the embedding after TP, the root FSDP unit; the heaviest stage
  // without and with its routed experts; what the data-parallel strategy reduces; what this GPU updates.
  double block_tp, emb_tp, unit0, psi_dense, psi_e, psi, psi_dp, psi_opt;
  // LoRA: the trainable parameters (the adapters) of the heaviest stage; without LoRA psi. Their
  // share psi_tr of psi_dp is what gradients, the optimizer and ZeRO-1/2's gathers move.
  double psi_tr, psi_g;
  bool lora;
  int shard;  // ways the model state is sharded
  int dpc;    // ranks the gradients are reduced over
  int ranks_per_node;

  Ctx(const ModelConfig& m_, const Cluster& cluster, const TrainSetup& st_, const Layout& l_);
};

Ctx::Ctx(const ModelConfig& m_, const Cluster& cluster, const TrainSetup& st_, const Layout& l_)
    : m(m_), st(st_), l(l_), c(cluster.per_rank(l_.world())), seq(st_.seq_or(m_)), x(shape_of(m_, seq)) {
  t = l.tp, p = l.pp, v = l.virtual_stages;
  T = t, mbs = static_cast<double>(l.micro_batch), M = static_cast<double>(l.microbatches);
  sp = st.sequence_parallel && t > 1;
  e = st.act_bytes();
  kpp = bytes_per_param(st.fp32, st.grad_bytes);
  pb = kpp.params, gb = kpp.grads, rb = st.reduce_bytes;
  eta = c.overlap_efficiency;
  flops_rate = c.peak_flops(st.fp32) * c.compute_efficiency;
  bw_rate = c.mem_bw * c.mem_bw_efficiency;
  // Layers on the heaviest pipeline rank: ceil(L / (p v)) per chunk (uneven splits put the extra
  // layers somewhere; the slowest rank paces the pipeline).
  Lps = std::ceil(x.L / (p * static_cast<double>(v))) * v;
  // Context parallelism: a rank holds T/cp tokens of each sequence (their queries still attend to
  // every earlier key of the sequence, so attention FLOPs per token keep the full s).
  cp = l.cp;
  tokens = x.s * mbs / cp;
  // MoE rows per token through the routed experts: its k choices, or with model.moe_pad_to_capacity
  // E x capacity rows per micro-batch (capacity = ceil(factor x tokens x k / E)), zero rows included:
  // they are computed, held and sent like the others.
  k_rows = x.k;
  if (m.moe() && m.moe_pad_to_capacity && m.moe_capacity_factor > 0) {
    const double E_moe = static_cast<double>(m.moe_experts);
    k_rows = E_moe * std::ceil(static_cast<double>(m.moe_capacity_factor) * tokens * x.k / E_moe) / tokens;
  }
  pad_f = (k_rows - x.k) * static_cast<double>(m.expert_ffn());

  // The heaviest pipeline stage after TP.
  block_tp = (x.block - x.norm_block) / T + x.norm_block;
  emb_tp = x.V * x.h / T;
  double first = Lps * block_tp + emb_tp + x.wpe;
  double last = Lps * block_tp + x.norm_final + emb_tp;  // the head (tied: a copy of wte) on the last stage
  if (p == 1) first += x.norm_final + (x.tied ? 0.0 : emb_tp);
  // Routed experts on this GPU: its stage's MoE layers' experts, split by tp and ep.
  ep = std::max(1, l.ep);
  psi_e = Lps * x.moe_frac * x.expert_layer / (T * ep);
  psi_dense = p == 1 ? first : std::max(first, last);
  // With ep = 1 the experts are ordinary parameters under the strategy; with ep > 1 this engine
  // keeps them apart, data parallel (replicated, DDP-style) over the dp / ep ranks holding them.
  psi = psi_dense + psi_e;
  shard = (l.strategy == Strategy::NoShard) ? 1 : l.dp_shard * cp;  // cp ranks shard too
  psi_opt = psi / shard;
  // What the data-parallel strategy reduces and gathers: with ep > 1 the experts are not in it.
  psi_dp = ep > 1 ? psi_dense : psi;
  lora = m.lora();
  psi_tr = lora ? Lps * static_cast<double>(m.lora_block_params()) : psi;
  psi_g = lora ? psi_tr : psi_dp;
  psi_opt = psi_tr / shard;
  unit0 = emb_tp * ((p == 1 && !x.tied) ? 2.0 : 1.0) + x.wpe;
  dpc = l.dp() * cp;
  ranks_per_node = std::min(c.gpus_per_node, l.world());
}

// ---- memory ------------------------------------------------------------------------------------------------

void model_state_memory(const Ctx& cx, Estimate& E) {
  const Layout& l = cx.l;
  if (cx.lora) {
    // LoRA (the engine's compact state): the frozen base in the compute dtype only (sharded by
    // ZeRO-3), gradients, fp32 master and moments for the adapters alone.
    const bool zero3 = l.strategy == Strategy::FullShard || l.strategy == Strategy::HybridShard;
    const bool gshard = l.strategy != Strategy::NoShard && l.strategy != Strategy::Zero1;
    E.psi_stage = cx.psi;
    E.psi_experts = 0;
    E.mem.params = cx.pb * cx.psi / (zero3 ? cx.shard : 1);
    E.mem.grads = cx.gb * cx.psi_tr / (gshard ? cx.shard : 1);
    E.mem.optimizer = l.offload_optimizer() ? 0.0 : (cx.st.fp32 && l.strategy == Strategy::NoShard ? 8.0 : 12.0) * cx.psi_opt;
    return;
  }
  ModelStateBytes ms = zero_model_state(cx.ep > 1 ? cx.psi_dense : cx.psi, l.strategy, cx.shard, cx.st.fp32,
                                        l.offload_optimizer(), cx.st.grad_bytes);
  if (cx.ep > 1) {
    const ModelStateBytes me = zero_model_state(cx.psi_e, Strategy::NoShard, 1, cx.st.fp32, false, cx.st.grad_bytes);
    ms.params += me.params;
    ms.grads += me.grads;
    ms.optimizer += me.optimizer;
  }
  E.psi_stage = cx.psi;
  E.psi_experts = cx.psi_e;
  E.mem.params = ms.params;
  E.mem.grads = ms.grads;
  E.mem.optimizer = ms.optimizer;
}

double activation_memory(const Ctx& cx) {
  const Shape& x = cx.x;
  const Layout& l = cx.l;
  const int p = cx.p, t = cx.t;
  // MoE layers: the activations of a dense MLP as wide as the token's k routed and shared experts
  // (the router's [tokens, E] scores are small next to them).
  ModelConfig ma = cx.m;
  if (cx.m.moe()) {
    ma.moe_experts = 0;
    ma.ffn_hidden = static_cast<int64_t>((1 - x.moe_frac) * x.f + x.moe_frac * (x.moe_f + cx.pad_f));
  }
  TrainSetup st_rank = cx.st;  // this rank's tokens per sequence
  st_rank.seq = cx.seq / cx.cp;
  const double a_layer = layer_activation_bytes(ma, st_rank, l.micro_batch, t, l.checkpointing);
  const double a_full = layer_activation_bytes(ma, st_rank, l.micro_batch, t, Checkpointing::None);
  // A recomputed layer's full activations exist again while its backward runs (one at a time).
  const double ws = l.checkpointing != Checkpointing::None ? a_full : 0.0;
  const double head_acts = cx.tokens * (cx.e * x.h / (cx.sp ? cx.T : 1.0) + cx.e * x.h +
                                             static_cast<double>(cx.st.logits_bytes) * x.V / cx.T);
  double inflight_first = 1, inflight_last = 1;
  switch (l.schedule) {
    case Schedule::None: break;
    case Schedule::GPipe: inflight_first = inflight_last = cx.M; break;
    case Schedule::OneFOneB: inflight_first = std::min<double>(cx.M, p); break;
    case Schedule::Interleaved:
      inflight_first = std::min<double>(cx.M, p) * (1.0 + (p - 1.0) / (p * static_cast<double>(cx.v)));
      break;
    // Split backward: a micro-batch's set is held until its W (ZB-H1 and ZB-V: at most p
    // micro-batches' worth on a rank), and between its B and W the copies the weight gradients read.
    case Schedule::ZeroBubbleH1:
    case Schedule::ZeroBubbleV: inflight_first = inflight_last = std::min<double>(cx.M, p); break;
  }
  // Per micro-batch and layer: the linears' output gradients (fp32), and their inputs (compute
  // dtype) where those do not stay in the slot until W (recomputed, or re-gathered under SP);
  // otherwise the inputs are held by reference.
  double held_w = 0;
  if (l.schedule == Schedule::ZeroBubbleH1 || l.schedule == Schedule::ZeroBubbleV) {
    const bool copies_inputs = cx.sp || l.checkpointing != Checkpointing::None;
    held_w = cx.tokens * ((copies_inputs ? cx.e * (4.0 * x.h + x.f) : 0.0) + 4.0 * (5.0 * x.h + 2.0 * x.f)) / t;
  }
  const double a_zb = a_layer + held_w;
  const double act_first = inflight_first * cx.Lps * a_zb + ws;
  const double act_last = inflight_last * cx.Lps * a_zb + ws + head_acts;
  return p == 1 ? act_first + head_acts : std::max(act_first, act_last);
}

double comm_buffer_memory(const Ctx& cx) {
  const double unit = std::max(cx.block_tp, cx.unit0);
  double comm_buf = 0;
  if (cx.dpc > 1) {
    if (cx.l.strategy == Strategy::FullShard || cx.l.strategy == Strategy::HybridShard)
      comm_buf += 2 * unit * cx.pb + unit * cx.rb;  // gathered current + prefetched unit, unsharded grad
    else
      comm_buf += 2 * std::min(cx.st.bucket_bytes, cx.psi_dp * cx.rb);
  }
  if (cx.t > 1) comm_buf += 2 * cx.tokens * cx.x.h * cx.e;
  if (cx.p > 1) comm_buf += 2 * cx.tokens * cx.x.h * cx.e / (cx.sp ? cx.T : 1.0);
  return comm_buf;
}

void memory(const Ctx& cx, Estimate& E) {
  model_state_memory(cx, E);
  E.mem.activations = activation_memory(cx);
  E.mem.comm = comm_buffer_memory(cx);
  E.mem_usable = cx.c.usable_mem();
  E.fits = E.mem.total() <= E.mem_usable;
  if (cx.l.offload_optimizer()) {
    E.host_bytes_per_node = (cx.kpp.optimizer + cx.gb) * cx.psi_opt * cx.ranks_per_node;
    E.host_usable = 0.8 * cx.c.host_mem_per_node;  // the OS, data loaders and page cache keep the rest
    E.host_fits = E.host_bytes_per_node <= E.host_usable;
    E.fits = E.fits && E.host_fits;
  }
}

// ---- compute -----------------------------------------------------------------------------------------------

// One micro-batch on the critical stage, and what the communication parts need of it.
struct Compute {
  double rc_mm = 0, rc_attn = 0, rc_elem = 0;  // recomputed shares of matmuls, attention, elementwise
  double at_f = 0;                              // attention FLOPs per token and layer
  double T_f = 0, T_b = 0;                      // forward; backward with its recomputation
  double rc_s = 0, elem_s = 0;                  // of them: recomputation; memory-bound elementwise work
};

Compute compute_time(const Ctx& cx) {
  const Shape& x = cx.x;
  const TrainSetup& st = cx.st;
  const double T = cx.T, e = cx.e, tokens = cx.tokens, Lps = cx.Lps;
  const int p = cx.p;
  Compute r;
  // Recomputed share of the forward: selective = every second layer (our engine, and torchtitan's
  // "selective layer" option), full = every layer; an override describes other systems' policies.
  const bool unfused = st.attention == AttentionImpl::Unfused;
  if (st.recompute_fraction >= 0) {
    r.rc_mm = r.rc_elem = st.recompute_fraction;
    r.rc_attn = unfused ? st.recompute_fraction : 0.0;  // op-level policies keep the flash-attention output
  } else {
    r.rc_mm = r.rc_attn = r.rc_elem = recompute_share(cx.l.checkpointing);
  }
  const double rc_mm = r.rc_mm, rc_attn = r.rc_attn, rc_elem = r.rc_elem;
  const double mm_f = 2.0 * (x.block_mm + x.moe_frac * (x.gpt2 ? 2.0 : 3.0) * x.h * cx.pad_f) / T;
  const double at_f = 4.0 * x.s * x.h / T;
  r.at_f = at_f;
  const double d = st.dropout ? 1.0 : 0.0;
  double elem_rep, elem_split;  // forward elementwise traffic per token per layer
  if (x.gpt2) {
    elem_rep = e * 10 * x.h + d * 2 * (2 * e + 1) * x.h;  // 2 LN, 2 residual adds, (2 dropouts)
    elem_split = e * 2 * x.f;                             // GELU
  } else {
    elem_rep = e * 10 * x.h;                              // 2 RMSNorm, 2 residual adds
    elem_split = e * (2 * (x.h + x.hk) + 3 * x.f);        // RoPE on q,k; SwiGLU
  }
  const double elem_f = elem_rep / (cx.sp ? T : 1.0) + elem_split / T;
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
  const double flops_rate = cx.flops_rate, bw_rate = cx.bw_rate;
  const StageWork w_first = stage_work(true, p == 1), w_last = stage_work(false, true);
  auto stage_time = [&](const StageWork& w) {
    return (w.fwd_flops + w.bwd_flops + w.rc_flops) / flops_rate + (w.fwd_bytes + w.bwd_bytes + w.rc_bytes) / bw_rate;
  };
  const StageWork& w = (p == 1 || stage_time(w_first) >= stage_time(w_last)) ? w_first : w_last;
  // Fixed per-kernel cost: ~12 kernels per layer forward, 24 backward (+ the recomputed forward).
  const double k_f = Lps * 12.0 * cx.c.kernel_overhead_s, k_b = Lps * 24.0 * cx.c.kernel_overhead_s;
  r.T_f = w.fwd_flops / flops_rate + w.fwd_bytes / bw_rate + k_f;
  r.rc_s = w.rc_flops / flops_rate + w.rc_bytes / bw_rate + rc_elem * k_f;
  r.T_b = w.bwd_flops / flops_rate + w.bwd_bytes / bw_rate + k_b + r.rc_s;
  r.elem_s = (w.fwd_bytes + w.bwd_bytes + w.rc_bytes) / bw_rate;
  return r;
}

// ---- communication -----------------------------------------------------------------------------------------

// The process groups' shapes (mesh order tp, cp, dp_shard, dp_replicate, pp).
struct Groups {
  GroupShape tp, cp, shard, rep, dp;
  Cluster cs;  // blocking collectives: the link they see (Cluster::intra_sync)
};

Groups groups_of(const Ctx& cx) {
  const Layout& l = cx.l;
  const int G = cx.c.gpus_per_node, t = cx.t, cp = cx.cp;
  Groups g;
  g.tp = group_shape(t, 1, G);
  g.cp = group_shape(cp, t, G);
  g.shard = group_shape(l.dp_shard * cp, t, G);
  g.rep = group_shape(l.dp_replicate, t * cp * l.dp_shard, G);
  // DDP reduces over the replicas and the cp ranks (dp_shard = 1: contiguous at stride t).
  g.dp = l.strategy == Strategy::NoShard ? group_shape(l.dp_replicate * cp, t, G) : g.shard;
  g.cs = cx.c;
  if (cx.c.intra_sync.bw > 0) g.cs.intra = cx.c.intra_sync;
  return g;
}

// What the communication parts add up: bytes per micro-batch and per step, exposed seconds.
struct Comm {
  CollCost per_mb, per_step;
  double mb_tp = 0, mb_pp = 0, mb_dp = 0, mb_cp = 0, step_dp = 0, step_edp = 0;
};

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
void tp_comm(const Ctx& cx, const Groups& g, const Compute& k, Comm& cm, Estimate& E) {
  if (cx.t <= 1) return;
  const Shape& x = cx.x;
  const double Lps = cx.Lps;
  const Cluster& cs = g.cs;
  const double act = cx.tokens * x.h * cx.e, grad = cx.tokens * x.h * 4.0;
  const double fwd_passes = 1.0 + k.rc_mm;  // recomputed layers re-issue their forward collectives
  CollCost tp;
  if (cx.sp) {
    const CollCost ag = collective(Collective::AllGather, act, g.tp, cs), rs = collective(Collective::ReduceScatter, act, g.tp, cs);
    const CollCost ag_g = collective(Collective::AllGather, grad, g.tp, cs);
    // Per layer: forward 2 gathers + 2 reduce-scatters; backward the 2 output gradients gathered,
    // the 2 input gradients reduce-scattered, the 2 saved inputs re-gathered. Embedding and head:
    // a reduce-scatter and a gather forward, the head input gradient's reduce-scatter and the
    // embedding output gradient's gather backward.
    tp = Lps * (fwd_passes * (2.0 * ag + 2.0 * rs) + (2.0 * ag_g + 2.0 * rs) + 2.0 * ag) + (ag + 2.0 * rs + ag_g);
    // Each norm saw only its rank's rows: its parameters' gradient (fp32) is summed over the tp
    // ranks in backward (model/tp_layers.cpp TpContext::flush_norm_grads): one small all-reduce
    // per block for its two norms, one for the final norm. Latency-bound: on a CPU each costs a
    // round trip.
    tp = tp + Lps * collective(Collective::AllReduce, x.norm_block * 4.0, g.tp, cs) +
         collective(Collective::AllReduce, x.norm_final * 4.0, g.tp, cs);
  } else {
    const CollCost ar = collective(Collective::AllReduce, act, g.tp, cs);
    tp = Lps * (fwd_passes * 2.0 + 2.0) * ar + 2.0 * ar;
  }
  tp = tp + 3.0 * collective(Collective::AllReduce, cx.tokens * 4.0, g.tp, cs);
  cm.per_mb = cm.per_mb + tp;
  cm.mb_tp = cx.st.tp_comm_overlap ? std::max(0.0, tp.time - cx.eta * (k.T_f + k.T_b)) : tp.time;
  E.tp_comm_s = cx.M * tp.time;
  E.group_bytes.tp = cx.M * (tp.intra_bytes + tp.inter_bytes);
  E.tp_exposed_s = cx.M * cm.mb_tp;
}

// Pipeline: per micro-batch and model chunk one activation send forward and one gradient send
// backward; with SP only 1/t of it crosses (scatter/gather optimisation, arXiv 2104.04473 §4.1).
void pp_comm(const Ctx& cx, Comm& cm, Estimate& E) {
  if (cx.p <= 1) return;
  const int G = cx.c.gpus_per_node;
  const double bytes = cx.tokens * cx.x.h * cx.e / (cx.sp ? cx.T : 1.0);
  const int stride = cx.t * cx.cp * cx.l.dp();
  const bool inter = stride >= G || stride * cx.p > G;
  const Link& link = inter ? cx.c.inter : cx.c.intra;
  const double sends = 2.0 * cx.v;
  CollCost pc;
  pc.time = sends * (bytes / link.bw + link.latency_s);
  (inter ? pc.inter_bytes : pc.intra_bytes) = sends * bytes;
  cm.per_mb = cm.per_mb + pc;
  cm.mb_pp = pc.time;
  E.group_bytes.pp = cx.M * sends * bytes;
}

// Expert parallelism: per MoE layer and micro-batch four all-to-alls of the token choices' rows
// that leave the rank ((ep-1)/ep of k x tokens rows of h): input rows (compute dtype) and output
// rows (fp32) forward, their gradients (fp32) backward, as this engine sends them; a recomputed
// forward repeats its two. Point-to-point, synchronous: all exposed. Every tp rank routes all the
// micro-batch's tokens, with sequence parallelism too (the MoE layer gathers its input over tp).
void ep_comm(const Ctx& cx, const Compute& k, Comm& cm, Estimate& E) {
  const int ep = cx.ep;
  if (ep <= 1 || !cx.m.moe()) return;
  const Shape& x = cx.x;
  const Cluster& c = cx.c;
  const double e = cx.e, rc_mm = k.rc_mm;
  const GroupShape g_ep = group_shape(ep, cx.t * cx.cp, c.gpus_per_node);  // consecutive dp ranks of one cp and tp rank
  const double rows = cx.k_rows * cx.tokens * (ep - 1.0) / ep;
  const double per_layer = rows * x.h * (e + 4.0 + 4.0 + 4.0 + rc_mm * (e + 4.0));
  const double bytes = cx.Lps * x.moe_frac * per_layer;
  // Peers off the node: (ep - local) of the ep - 1 others.
  const double inter_share = g_ep.nodes > 1 ? (ep - g_ep.local) / (ep - 1.0) : 0.0;
  CollCost a2a;
  a2a.inter_bytes = bytes * inter_share;
  a2a.intra_bytes = bytes - a2a.inter_bytes;
  const double msgs = cx.Lps * x.moe_frac * (4.0 + 2.0 * rc_mm) * (ep - 1.0);
  a2a.time = std::max(a2a.intra_bytes / c.intra.bw, a2a.inter_bytes / c.inter.bw) +
             msgs * (inter_share > 0 ? c.inter.latency_s : c.intra.latency_s);
  cm.per_mb = cm.per_mb + a2a;
  E.ep_comm_s = cx.M * a2a.time;
  E.group_bytes.ep = cx.M * bytes;
}

// Context parallelism (the engine's ring, model/transformer.cpp): per layer and micro-batch the
// fp32 key / value block (tokens x 2 kv heads' width / t x 4 bytes) is sent cp - 1 times forward,
// cp - 1 times again in backward with cp - 1 sends of its gradient, and cp - 1 more for every
// recomputed forward; each send overlaps the attention of the block in hand.
void cp_comm(const Ctx& cx, const Groups& g, const Compute& k, Comm& cm, Estimate& E) {
  const int cp = cx.cp;
  if (cp <= 1) return;
  const double block = cx.tokens * 2.0 * cx.x.hk / cx.T * 4.0;
  const double sends = cx.Lps * (cp - 1.0) * (3.0 + k.rc_mm);
  const Link& link = g.cp.nodes > 1 ? cx.c.inter : g.cs.intra;
  CollCost cc;
  cc.time = sends * (block / link.bw + link.latency_s);
  (g.cp.nodes > 1 ? cc.inter_bytes : cc.intra_bytes) = sends * block;
  cm.per_mb = cm.per_mb + cc;
  const double attn_s = cx.tokens * cx.Lps * k.at_f * (3.0 + k.rc_attn) / cx.flops_rate;
  cm.mb_cp = std::max(0.0, cc.time - cx.eta * attn_s);
  E.cp_comm_s = cx.M * cc.time;
  E.cp_exposed_s = cx.M * cm.mb_cp;
  E.group_bytes.cp = cx.M * 2.0 * sends * block;  // the engine counts each transfer's send and receive
}

// A collective of total time `comm` issued while `window` seconds of compute run; its last piece
// (`tail`, one bucket or unit) cannot hide. The tail runs when the compute it would hide behind
// has not started or is over (the first unit's gather, the last bucket's reduction), so it sees
// the link of collectives the ranks wait for (cs: on CPUs, the cores idle), not the one of
// communication competing with compute.
double overlapped(double comm, double tail, double window, double eta) {
  return tail + std::max(0.0, comm - tail - eta * window);
}

// DDP: all-reduce once per step (no_sync while accumulating), during the last backward.
void ddp_comm(const Ctx& cx, const Groups& g, const Compute& k, Comm& cm, Estimate& E) {
  const double grad_bytes = cx.psi_g * cx.rb;
  const double bucket_g = std::min(grad_bytes, cx.st.bucket_bytes);
  CollCost ar = split_collective(Collective::AllReduce, grad_bytes, std::ceil(grad_bytes / cx.st.bucket_bytes), g.dp, cx.c);
  cm.per_step = cm.per_step + ar;
  E.dp_comm_s = ar.time;
  E.group_bytes.dp = ar.intra_bytes + ar.inter_bytes;
  cm.step_dp = overlapped(ar.time, collective(Collective::AllReduce, bucket_g, g.dp, g.cs).time, k.T_b, cx.eta);
}

// ZeRO-1 / ZeRO-2: gradients reduce-scattered in buckets, parameters all-gathered after the step.
void zero12_comm(const Ctx& cx, const Groups& g, const Compute& k, Comm& cm, Estimate& E) {
  const Layout& l = cx.l;
  // LoRA: the adapters' gradients and, after the step, the adapters alone are all-gathered.
  const double grad_bytes = cx.psi_g * cx.rb, param_bytes = (cx.lora ? cx.psi_tr : cx.psi_dp) * cx.pb;
  const double bucket_g = std::min(grad_bytes, cx.st.bucket_bytes), bucket_p = std::min(param_bytes, cx.st.bucket_bytes);
  auto buckets = [&](double bytes) { return std::ceil(bytes / cx.st.bucket_bytes); };
  CollCost rs = split_collective(Collective::ReduceScatter, grad_bytes, buckets(grad_bytes), g.dp, cx.c);
  const double rs_ex = overlapped(rs.time, collective(Collective::ReduceScatter, bucket_g, g.dp, g.cs).time, k.T_b, cx.eta);
  CollCost ag = split_collective(Collective::AllGather, param_bytes, buckets(param_bytes), g.dp, cx.c);
  const double ag_ex = cx.st.overlap_param_gather
                           ? overlapped(ag.time, collective(Collective::AllGather, bucket_p, g.dp, g.cs).time, k.T_f, cx.eta)
                           : split_collective(Collective::AllGather, param_bytes, buckets(param_bytes), g.dp, g.cs).time;
  double dp_total;
  if (l.strategy == Strategy::Zero1) {  // full gradients accumulate locally; reduce once
    cm.per_step = cm.per_step + rs;
    cm.step_dp = rs_ex;
    dp_total = rs.time;
  } else {  // gradients are sharded: reduce-scatter after every micro-batch
    cm.per_mb = cm.per_mb + rs;
    cm.mb_dp = rs_ex;
    dp_total = cx.M * rs.time;
  }
  cm.per_step = cm.per_step + ag;
  cm.step_dp += ag_ex;
  dp_total += ag.time;
  E.dp_comm_s = dp_total;
  E.group_bytes.dp = (l.strategy == Strategy::Zero1 ? 1.0 : cx.M) * (rs.intra_bytes + rs.inter_bytes) +
                     ag.intra_bytes + ag.inter_bytes;
}

// ZeRO-3 / HSDP: per micro-batch gather forward, gather backward, reduce-scatter, one FSDP unit
// (block, or the root: embedding / head) at a time; HSDP's replicas then all-reduce their shard.
void zero3_comm(const Ctx& cx, const Groups& g, const Compute& k, Comm& cm, Estimate& E) {
  const double grad_bytes = cx.psi_g * cx.rb, param_bytes = cx.psi_dp * cx.pb;
  const double n_units = cx.Lps + 1.0;  // FSDP units: one per block plus the root (embedding/head)
  CollCost ag = split_collective(Collective::AllGather, param_bytes, n_units, g.shard, cx.c);
  CollCost rs = split_collective(Collective::ReduceScatter, grad_bytes, n_units, g.shard, cx.c);
  const double first = collective(Collective::AllGather, cx.unit0 * cx.pb, g.shard, g.cs).time;
  const double last = collective(Collective::ReduceScatter, cx.unit0 * cx.rb, g.shard, g.cs).time;
  cm.per_mb = cm.per_mb + ag + ag + rs;
  const double ex_b = overlapped(ag.time + rs.time, last, k.T_b, cx.eta);
  cm.mb_dp = overlapped(ag.time, first, k.T_f, cx.eta) + ex_b;
  double dp_total = cx.M * (2 * ag.time + rs.time);
  E.group_bytes.dp = cx.M * (2 * (ag.intra_bytes + ag.inter_bytes) + rs.intra_bytes + rs.inter_bytes);
  if (cx.l.strategy == Strategy::HybridShard) {  // replicas all-reduce their gradient shard once per step
    CollCost ar = split_collective(Collective::AllReduce, grad_bytes / cx.shard, n_units, g.rep, cx.c);
    const double ar_last = collective(Collective::AllReduce, cx.unit0 * cx.rb / cx.shard, g.rep, g.cs).time;
    cm.per_step = cm.per_step + ar;
    dp_total += ar.time;
    E.group_bytes.dp_replicate = ar.intra_bytes + ar.inter_bytes;
    // It shares the last micro-batch's backward window with that micro-batch's collectives.
    cm.step_dp = overlapped(ag.time + rs.time + ar.time, last + ar_last, k.T_b, cx.eta) - ex_b;
  }
  E.dp_comm_s = dp_total;
}

// Data parallel: the strategy's collectives and how much of them the compute hides.
void dp_comm(const Ctx& cx, const Groups& g, const Compute& k, Comm& cm, Estimate& E) {
  const Layout& l = cx.l;
  if (cx.dpc > 1) {
    switch (l.strategy) {
      case Strategy::NoShard: ddp_comm(cx, g, k, cm, E); break;
      case Strategy::Zero1:
      case Strategy::ShardGradOp: zero12_comm(cx, g, k, cm, E); break;
      case Strategy::FullShard:
      case Strategy::HybridShard: zero3_comm(cx, g, k, cm, E); break;
      case Strategy::HybridShardZero2: break;  // refused by check_layout
    }
  }
  E.dp_exposed_s = cx.M * cm.mb_dp + cm.step_dp;
  E.dp_inter_node = (l.strategy == Strategy::NoShard ? g.rep : g.shard).nodes > 1 ||
                    (l.strategy == Strategy::HybridShard && g.rep.nodes > 1);
}

// The experts' gradient all-reduce over the dp / ep ranks holding them times the cp ranks (ep > 1),
// once per step after backward (this engine does not overlap it). With cp the group's shape is
// that of its cp ranks' stride (they are the closest members).
void expert_dp_comm(const Ctx& cx, Comm& cm, Estimate& E) {
  const int ep = cx.ep, cp = cx.cp, t = cx.t;
  if (!(ep > 1 && cx.l.dp() / ep * cp > 1)) return;
  const GroupShape g_edp = group_shape(cx.l.dp() / ep * cp, cp > 1 ? t : t * ep, cx.c.gpus_per_node);
  CollCost ar = collective(Collective::AllReduce, cx.psi_e * cx.rb, g_edp, cx.c);
  cm.per_step = cm.per_step + ar;
  cm.step_edp = ar.time;
  E.group_bytes.edp = ar.intra_bytes + ar.inter_bytes;
}

// ---- optimizer and step ------------------------------------------------------------------------------------

void optimizer_time(const Ctx& cx, Estimate& E) {
  const double adam_bytes = 28.0;  // read+write fp32 master, m, v (24) + read grad + write param
  double opt_s = adam_bytes * cx.psi_opt / cx.bw_rate;
  if (cx.l.offload_optimizer()) {  // CPU Adam bound by host memory bandwidth shared by the node's GPUs
    opt_s = adam_bytes * cx.psi_opt * cx.ranks_per_node / cx.c.host_mem_bw_per_node;
    E.offload_s = (cx.gb + cx.pb) * cx.psi_opt / cx.c.host_link_bw;  // gradient shard down, parameter shard up
  }
  E.optimizer_s = opt_s;
}

// Compute on the critical stage + exposed communication + bubble, and what follows from the step time.
void step_time(const Ctx& cx, const Compute& k, const Comm& cm, Estimate& E) {
  const Cluster& c = cx.c;
  const double M = cx.M;
  const double mb_ep = M > 0 ? E.ep_comm_s / M : 0.0;
  const double slot = k.T_f + k.T_b + cm.mb_tp + cm.mb_pp + cm.mb_dp + mb_ep + cm.mb_cp;  // one micro-batch on the critical stage
  E.time.compute = M * (k.T_f + k.T_b) + E.optimizer_s;
  E.time.exposed_comm =
      M * (cm.mb_tp + cm.mb_pp + cm.mb_dp + mb_ep + cm.mb_cp) + cm.step_dp + cm.step_edp + E.offload_s;
  E.time.bubble = cx.p > 1 ? (cx.p - 1.0) / cx.v * slot : 0.0;
  // Zero-bubble schedules (T_B = T_W = T_b / 2): ZB-H1 fills and drains in (p-1)(T_F + T_B - T_W)
  // = (p-1) T_F; ZB-V in half that (its schedule's simulation: (p-1)/2 forward slots idle per rank).
  if (cx.p > 1 && cx.l.schedule == Schedule::ZeroBubbleH1) E.time.bubble = (cx.p - 1.0) * (slot - k.T_b);
  if (cx.p > 1 && cx.l.schedule == Schedule::ZeroBubbleV) E.time.bubble = (cx.p - 1.0) * (slot - k.T_b) / 2;
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
  E.pp_comm_s = M * cm.mb_pp;
  E.recompute_s = M * k.rc_s;
  E.elementwise_s = M * k.elem_s;
  const double total = E.time.total();
  E.comm.intra_node = M * cm.per_mb.intra_bytes + cm.per_step.intra_bytes;
  E.comm.inter_node = M * cm.per_mb.inter_bytes + cm.per_step.inter_bytes;
  const double global_tokens = static_cast<double>(cx.l.global_batch()) * cx.x.s;
  E.tokens_per_s = global_tokens / total;
  E.mfu = flops_per_token(cx.m, cx.seq) * E.tokens_per_s / (E.world * c.peak_flops(cx.st.fp32));
  E.device = c.device;
}

}  // namespace

Estimate estimate(const ModelConfig& m, const Cluster& cluster_in, const TrainSetup& st, const Layout& l) {
  if (std::string err = check_layout(m, cluster_in, st, l); !err.empty()) throw std::invalid_argument(err);
  Estimate E;
  E.layout = l;
  E.world = l.world();
  const Ctx cx(m, cluster_in, st, l);
  memory(cx, E);
  const Compute k = compute_time(cx);
  const Groups g = groups_of(cx);
  Comm cm;
  tp_comm(cx, g, k, cm, E);
  pp_comm(cx, cm, E);
  ep_comm(cx, k, cm, E);
  cp_comm(cx, g, k, cm, E);
  dp_comm(cx, g, k, cm, E);
  optimizer_time(cx, E);
  expert_dp_comm(cx, cm, E);
  step_time(cx, k, cm, E);
  E.why = why_sentence(E);
  return E;
}

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
