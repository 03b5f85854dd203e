// `plan --validate`'s layouts: an engine layout as `meshtrain train` arguments and as the planner's
// layout and setup, the default layout lists, and the planner's figures against the engine's.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

#include "validate/plan_validate.h"
#include "plan/planner.h"
#include "plan/text_table.h"
#include "parallel/mesh.h"

namespace mt::validate {

using namespace mt::plan;

namespace {

// The planner does not model HYBRID_SHARD_ZERO2: it predicts it as ZeRO-2.
Strategy planner_strategy(ShardingStrategy s) {
  return s == ShardingStrategy::HybridShardZero2 ? Strategy::ShardGradOp : s;
}

}  // namespace

// ---- the engine layout ----------------------------------------------------------------------------------

int EngineLayout::dp_ranks() const { return ranks / (std::max(1, tp) * std::max(1, pp) * std::max(1, cp)); }

int EngineLayout::pp_rank_of(int rank) const { return rank / std::max(1, ranks / std::max(1, pp)); }

int EngineLayout::virtual_stages() const {
  return pp > 1 && pp_schedule == PipelineSchedule::Interleaved ? std::max(1, pp_virtual_stages) : 1;
}

int EngineLayout::shard_size() const {
  if (!is_sharded(strategy)) return 1;
  return (hybrid() ? dp_ranks() / std::max(1, dp_replicate) : dp_ranks()) * std::max(1, cp);
}

int EngineLayout::replicas() const { return hybrid() ? std::max(1, dp_replicate) : 1; }

std::string EngineLayout::label() const {
  std::string s;
  if (strategy == ShardingStrategy::NoShard) s = "DDP x" + std::to_string(dp_ranks());
  else if (strategy == ShardingStrategy::HybridShard)
    s = "HSDP " + std::to_string(replicas()) + "x" + std::to_string(shard_size());
  else if (strategy == ShardingStrategy::HybridShardZero2)
    s = "HSDP-ZeRO-2 " + std::to_string(replicas()) + "x" + std::to_string(shard_size());
  else s = std::string(strategy_label(planner_strategy(strategy))) + " x" + std::to_string(dp_ranks());
  if (cp > 1) s += " cp" + std::to_string(cp);
  if (tp > 1) s += " tp" + std::to_string(tp) + (sequence_parallel ? " sp" : "");
  if (pp > 1) s += " pp" + std::to_string(pp) + " " + to_string(pp_schedule);
  if (virtual_stages() > 1) s += " v" + std::to_string(virtual_stages());
  s += bf16 ? " bf16" : " fp32";
  if (grad_accum > 1) s += " accum" + std::to_string(grad_accum);
  if (checkpointing != Checkpointing::None) s += std::string(" ac:") + to_string(checkpointing);
  if (moe_experts > 0) s += " moe" + std::to_string(moe_experts) + "k" + std::to_string(moe_top_k);
  if (moe_capacity_factor > 0) s += fmt(" cap%g", moe_capacity_factor) + (moe_pad_to_capacity ? " padded" : "");
  if (ep > 1) s += " ep" + std::to_string(ep);
  return s + " " + model;
}

ModelConfig engine_model(const EngineLayout& e) {
  ModelConfig m = plan_model_preset(e.model);
  if (e.moe_experts > 0) {
    m.moe_experts = e.moe_experts;
    m.moe_top_k = e.moe_top_k;
    m.moe_capacity_factor = static_cast<float>(e.moe_capacity_factor);
    m.moe_pad_to_capacity = e.moe_pad_to_capacity;
    m.resolve();
  }
  return m;
}

std::vector<std::string> EngineLayout::train_args() const {
  std::vector<std::string> a = {"--model.preset", model,
          "--train.micro_batch", std::to_string(micro_batch),
          "--train.grad_accum", std::to_string(grad_accum),
          "--train.dtype", bf16 ? "bf16" : "fp32",
          "--train.activation_checkpointing", to_string(checkpointing),
          "--parallel.strategy", to_string(strategy),
          "--parallel.dp_replicate", std::to_string(replicas()),
          "--parallel.dp_shard", "-1",
          "--parallel.tp", std::to_string(tp),
          "--parallel.reduce_every_microbatch", reduce_every_microbatch ? "true" : "false",
          "--parallel.reshard_after_forward", reshard_after_forward ? "true" : "false",
          "--parallel.bucket_mb", fmt("%g", bucket_mb)};
  if (sequence_parallel) a.insert(a.end(), {"--parallel.sequence_parallel", "true"});
  if (cp > 1) a.insert(a.end(), {"--parallel.cp", std::to_string(cp)});
  if (pp > 1) a.insert(a.end(), {"--parallel.pp", std::to_string(pp), "--parallel.pp_schedule", to_string(pp_schedule)});
  if (virtual_stages() > 1) a.insert(a.end(), {"--parallel.pp_virtual_stages", std::to_string(virtual_stages())});
  if (moe_experts > 0)
    a.insert(a.end(), {"--model.moe_experts", std::to_string(moe_experts), "--model.moe_top_k", std::to_string(moe_top_k)});
  if (moe_capacity_factor > 0) a.insert(a.end(), {"--model.moe_capacity_factor", fmt("%g", moe_capacity_factor)});
  if (moe_pad_to_capacity) a.insert(a.end(), {"--model.moe_pad_to_capacity", "true"});
  if (ep > 1) a.insert(a.end(), {"--parallel.ep", std::to_string(ep)});
  return a;
}

ParallelPlan EngineLayout::plan() const {
  ParallelPlan p;
  p.strategy = strategy;
  p.dp_replicate = dp_replicate;
  p.dp_shard = -1;  // the ranks left over, as the engine resolves it (check_plan)
  p.tp = tp;
  p.pp = pp;
  p.cp = cp;
  p.ep = ep;
  p.schedule = pp > 1 ? pp_schedule : PipelineSchedule::None;
  p.virtual_stages = virtual_stages();
  p.micro_batch = micro_batch;
  p.microbatches = grad_accum;
  p.checkpointing = checkpointing;
  p.sequence_parallel = sequence_parallel;
  return p;
}

void check_engine_layout(const EngineLayout& e) {
  if (e.ranks < 1) throw std::invalid_argument("ranks must be >= 1");
  if (e.micro_batch < 1 || e.grad_accum < 1) throw std::invalid_argument("micro_batch and grad_accum must be >= 1");
  ModelConfig m = engine_model(e);
  m.resolve();
  // The engine's own checks of the plan against the world and the model (a PlanError is an
  // invalid_argument): the mesh, tp against the heads and widths, cp, sequence and expert parallelism.
  ParallelPlan p = e.plan();
  check_plan(p, m, e.ranks);
  if (e.pp > 1 && e.pp_schedule == PipelineSchedule::None)
    throw std::invalid_argument("pipeline schedule 'none': the validation predicts gpipe, 1f1b and interleaved_1f1b");
  if (e.pp > 1 && e.pp_schedule == PipelineSchedule::Interleaved && (e.pp_virtual_stages < 2 || e.grad_accum % e.pp != 0))
    throw std::invalid_argument("interleaved_1f1b needs pp_virtual_stages >= 2 and micro-batches a multiple of pp");
  if (e.moe_pad_to_capacity && (e.moe_experts < 1 || e.moe_capacity_factor <= 0))
    throw std::invalid_argument("padding to capacity needs MoE experts and a capacity factor > 0");
  if (e.pp > 1) {
    if (e.pp > m.n_layer + 2) throw std::invalid_argument("pp " + std::to_string(e.pp) + " exceeds the model's units");
    if (m.tied_embeddings && shards_parameters(e.strategy))
      throw std::invalid_argument("pp > 1 with " + std::string(to_string(e.strategy)) +
                                  " on a tied-embedding model: the engine refuses it");
  }
}

Layout planner_layout(const EngineLayout& e) {
  // The engine's plan under the planner's conventions: DDP as dp_replicate replicas, a hybrid
  // over one replica as plain sharding, no schedule without a pipeline.
  Layout l = e.plan();
  l.strategy = planner_strategy(e.strategy);
  if (l.strategy == Strategy::NoShard) {
    l.dp_replicate = e.dp_ranks();
    l.dp_shard = 1;
  } else if (e.hybrid()) {
    l.dp_replicate = e.replicas();
    l.dp_shard = e.dp_ranks() / e.replicas();  // the planner multiplies by cp itself
    if (e.replicas() == 1) l.strategy = Strategy::FullShard;  // a hybrid over one replica is plain sharding
  } else {
    l.dp_replicate = 1;
    l.dp_shard = e.dp_ranks();
  }
  l.sequence_parallel = false;  // the planner's is TrainSetup::sequence_parallel (planner_setup)
  if (e.pp > 1) {
    l.schedule = e.pp_schedule == PipelineSchedule::GPipe ? Schedule::GPipe
                 : e.virtual_stages() > 1   ? Schedule::Interleaved
                                            : Schedule::OneFOneB;
  }
  return l;
}

TrainSetup planner_setup(const ModelConfig& m, const EngineLayout& e) {
  TrainSetup st;
  st.fp32 = !e.bf16;
  st.grad_bytes = 4;     // this engine keeps fp32 gradients
  st.reduce_bytes = 4;   // and reduces in fp32
  st.seq = m.seq_len;    // it trains at the model's full context
  st.global_batch = static_cast<int64_t>(e.dp_ranks()) * e.micro_batch * e.grad_accum;
  st.micro_batch = e.micro_batch;
  st.attention = AttentionImpl::Flash;  // kernels/attention.h keeps only the log-sum-exp
  st.dropout = false;
  st.sequence_parallel = e.sequence_parallel && e.tp > 1;  // as the model does (ModelOptions::sequence_parallel)
  st.bucket_bytes = e.bucket_mb * 1e6;
  return st;
}

PlannerGaps compare_with_planner(const ModelConfig& m_in, const EngineLayout& e, const std::vector<EngineFigures>& dry) {
  ModelConfig m = m_in;
  m.resolve();
  PlannerGaps g;
  // The planner's cluster only sizes memory (fits) and time; the bytes and memory compared here do
  // not depend on it as long as every layout is valid on it.
  Cluster c = cluster_preset("h100-80g-ib400");
  c.gpus = e.ranks;
  const Estimate est = estimate(m, c, planner_setup(m, e), planner_layout(e));
  g.psi_planner = est.psi_stage;
  auto engine_peak = [&](const std::string& cat) {
    int64_t v = 0;
    for (const EngineFigures& f : dry) v = std::max(v, f.peak.count(cat) ? f.peak.at(cat) : 0);
    return static_cast<double>(v);
  };
  for (const EngineFigures& f : dry) {
    g.ranks.push_back(f.rank);
    g.flat_engine = std::max(g.flat_engine, f.flat_size);
  }
  const std::pair<const char*, double> mem[] = {{"params", est.mem.params},         {"grads", est.mem.grads},
                                                {"optimizer", est.mem.optimizer},   {"activations", est.mem.activations},
                                                {"comm", est.mem.comm}};
  for (const auto& [cat, v] : mem) g.rows.push_back({cat, v, engine_peak(cat), true});
  for (const auto& [cat, unused] : dry.front().peak) {
    bool known = false;
    for (const auto& [k, v] : mem) known |= cat == k;
    if (!known) g.rows.push_back({cat, 0, engine_peak(cat), false});
  }
  // Bytes by group: rank 0's counters against estimate()'s per-step volume on the same group.
  const std::map<std::string, double> planned = {
      // the engine's names: the cp ranks reduce with the data-parallel ones (dp_cp, dp_shard_cp)
      {e.cp > 1 ? (e.hybrid() ? "dp_shard_cp" : "dp_cp") : (e.hybrid() ? "dp_shard" : "dp"), est.group_bytes.dp},
      {"dp_replicate", est.group_bytes.dp_replicate},
      {"tp", est.group_bytes.tp},
      {"pp", est.group_bytes.pp},
      {"ep", est.group_bytes.ep},
      {"edp", est.group_bytes.edp},
      {"cp", est.group_bytes.cp}};
  std::vector<std::string> groups;
  for (const auto& [k, v] : planned)
    if (v > 0) groups.push_back(k);
  for (const auto& [k, v] : dry.front().comm)  // the groups the planner has no volume for
    if (v > 0 && (!planned.count(k) || planned.at(k) == 0)) groups.push_back(k);
  for (const std::string& k : groups) {
    const double eng = dry.front().comm.count(k) ? static_cast<double>(dry.front().comm.at(k)) : 0.0;
    const bool modelled = planned.count(k) > 0 && planned.at(k) > 0;
    g.rows.push_back({"bytes " + k, modelled ? planned.at(k) : 0.0, eng, modelled});
  }
  return g;
}

std::vector<EngineLayout> default_validation_layouts() {
  using S = ShardingStrategy;
  auto mk = [](S strategy, int ranks, int rep = 1) {
    EngineLayout e;
    e.strategy = strategy;
    e.ranks = ranks;
    e.dp_replicate = rep;
    return e;
  };
  std::vector<EngineLayout> v = {mk(S::NoShard, 2), mk(S::Zero1, 2), mk(S::ShardGradOp, 2), mk(S::FullShard, 2),
                                 mk(S::FullShard, 4), mk(S::HybridShard, 4, 2)};
  v[2].grad_accum = 2;  // ZeRO-2 reduce-scatters every micro-batch
  EngineLayout ddp_bf16 = mk(S::NoShard, 2);
  ddp_bf16.bf16 = true;
  v.push_back(ddp_bf16);
  EngineLayout llama = mk(S::FullShard, 2);
  llama.model = "llama-mini";
  llama.bf16 = true;
  llama.checkpointing = Checkpointing::Selective;
  v.push_back(llama);
  // Tensor parallelism: tp = 2 alone (one data-parallel rank), and tp = 2 inside ZeRO-3 over two
  // data-parallel ranks (mesh dp_shard = 2 x tp = 2).
  EngineLayout tp2 = mk(S::NoShard, 2);
  tp2.tp = 2;
  v.push_back(tp2);
  EngineLayout tp2z3 = mk(S::FullShard, 4);
  tp2z3.tp = 2;
  v.push_back(tp2z3);
  // Sequence parallelism: tp = 2 with the residual stream split over the tp ranks.
  EngineLayout sp = tp2;
  sp.sequence_parallel = true;
  v.push_back(sp);
  // ... in bf16: activations cross the tp group in bf16, gradients and statistics in fp32.
  EngineLayout sp_bf16 = sp;
  sp_bf16.bf16 = true;
  v.push_back(sp_bf16);
  // Pipelines: pp = 2 with 4 micro-batches (GPT-2's tied embedding cut apart), 1F1B and GPipe, and
  // 1F1B x DDP over 2 data-parallel ranks (mesh pp = 2 x dp_shard = 2).
  EngineLayout pp2 = mk(S::NoShard, 2);
  pp2.pp = 2;
  pp2.grad_accum = 4;
  v.push_back(pp2);
  EngineLayout gpipe = pp2;
  gpipe.pp_schedule = PipelineSchedule::GPipe;
  v.push_back(gpipe);
  EngineLayout ppdp = pp2;
  ppdp.ranks = 4;
  v.push_back(ppdp);
  // Interleaved 1F1B: two model chunks per rank (4 stages over 2 ranks).
  EngineLayout inter = pp2;
  inter.pp_schedule = PipelineSchedule::Interleaved;
  inter.pp_virtual_stages = 2;
  v.push_back(inter);
  // A mixture of experts (4 experts, top-2) with its experts split over both ranks (ep = 2).
  EngineLayout moe = mk(S::NoShard, 2);
  moe.model = "llama-mini";
  moe.moe_experts = 4;
  moe.ep = 2;
  v.push_back(moe);
  // The same padded to a capacity (factor 1.25): sizes independent of the routing, so activations,
  // workspace and the ep all-to-all's bytes are checked exactly too.
  EngineLayout moe_pad = moe;
  moe_pad.moe_capacity_factor = 1.25;
  moe_pad.moe_pad_to_capacity = true;
  v.push_back(moe_pad);
  // Context parallelism: cp = 2 alone (ring attention; the two ranks reduce gradients as DDP), and
  // inside ZeRO-3 over dp_shard 2 x cp 2, on Llama (RoPE, grouped-query attention).
  EngineLayout cp2 = mk(S::NoShard, 2);
  cp2.model = "llama-mini";
  cp2.cp = 2;
  v.push_back(cp2);
  EngineLayout cp2z3 = mk(S::FullShard, 4);
  cp2z3.model = "llama-mini";
  cp2z3.cp = 2;
  v.push_back(cp2z3);
  return v;
}

std::vector<std::string> validation_layout_names() {
  return {"ddp", "zero1",       "zero2",  "zero3", "zero3x4",   "hsdp",   "ddp-bf16",
          "llama-zero3-bf16", "tp2", "tp2-zero3x4", "tp2-sp", "tp2-sp-bf16", "pp2", "pp2-gpipe", "pp2-dp2", "pp2-interleaved",
          "moe-ep2", "moe-ep2-pad", "cp2", "cp2-zero3x4"};
}

std::vector<EngineLayout> default_scale_layouts() {
  using S = ShardingStrategy;
  auto mk = [](const char* model, S strategy, int ranks, int tp, int pp, int64_t accum) {
    EngineLayout e;
    e.model = model;
    e.strategy = strategy;
    e.ranks = ranks;
    e.tp = tp;
    e.sequence_parallel = tp > 1;
    e.pp = pp;
    e.grad_accum = accum;
    e.bf16 = true;
    e.checkpointing = Checkpointing::Full;
    e.micro_batch = 1;
    return e;
  };
  EngineLayout hsdp = mk("llama3-70b", S::HybridShard, 128, 8, 1, 1);
  hsdp.dp_replicate = 2;
  return {mk("llama3-70b", S::FullShard, 64, 8, 1, 1), hsdp, mk("llama3-70b", S::FullShard, 512, 8, 4, 8),
          mk("llama3-405b", S::FullShard, 512, 8, 8, 16), mk("llama3-405b", S::Zero1, 256, 8, 16, 16)};
}

std::vector<std::string> scale_layout_names() {
  return {"70b-zero3-tp8", "70b-hsdp-tp8", "70b-zero3-tp8-pp4", "405b-zero3-tp8-pp8", "405b-zero1-tp8-pp16"};
}

}  // namespace mt::validate
