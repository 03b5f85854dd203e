#include "parallel/mesh.h"

#include <array>
#include <stdexcept>
#include <utility>
#include <vector>

namespace mt {

int64_t padded_vocab_for_tp(int64_t vocab, int tp) {
  const int64_t q = 64 * static_cast<int64_t>(tp);
  return (vocab + q - 1) / q * q;
}

namespace {
// Expert parallelism and the mixture of experts against the other degrees.
void check_expert_plan(const ParallelPlan& d, const ModelConfig& mc) {
  using E = PlanError;
  if (d.ep < 1) throw E("parallel.ep must be >= 1, got " + std::to_string(d.ep));
  if (d.ep > 1) {
    if (!mc.moe())
      throw E("parallel.ep = " + std::to_string(d.ep) + " needs a mixture-of-experts model (model.moe_experts > 0)");
    if (mc.moe_experts % d.ep != 0)
      throw E("model.moe_experts (" + std::to_string(mc.moe_experts) + ") must be divisible by parallel.ep (" +
              std::to_string(d.ep) + ")");
    if (d.dp() % d.ep != 0)
      throw E("parallel.ep = " + std::to_string(d.ep) + " must divide the data-parallel degree (" +
              std::to_string(d.dp()) + " = dp_replicate x dp_shard): expert parallelism borrows its ranks from it");
  }
  if (mc.moe() && d.cp > 1 && mc.moe_capacity_factor > 0)
    throw E("model.moe_capacity_factor > 0 with parallel.cp = " + std::to_string(d.cp) +
            " is not supported: which token choices an expert drops depends on the order of the whole "
            "micro-batch's tokens, and each cp rank routes only its chunks of every sequence (the drops "
            "would differ from a run without cp); use a dropless MoE (model.moe_capacity_factor = 0)");
  if (mc.moe() && d.tp > 1 && mc.expert_ffn() % d.tp != 0)
    throw E("the expert width (model.moe_ffn_hidden or model.ffn_hidden, " + std::to_string(mc.expert_ffn()) +
            ") must be divisible by parallel.tp (" + std::to_string(d.tp) + ")");
}
}  // namespace

void check_plan(ParallelPlan& d, const ModelConfig& mc, int world) {
  using E = PlanError;
  if (!d.hybrid() && d.dp_replicate > 1)
    throw E("parallel.dp_replicate = " + std::to_string(d.dp_replicate) + " needs a HYBRID_* strategy (" +
            to_string(d.strategy) + " shards or replicates over every data-parallel rank; set dp_shard instead)");
  std::vector<std::pair<std::string, int>> dims;
  try {
    dims = comm::DeviceMesh::resolve(
        {{"pp", d.pp}, {"dp_replicate", d.dp_replicate}, {"dp_shard", d.dp_shard}, {"cp", d.cp}, {"tp", d.tp}}, world);
  } catch (const std::exception& e) {
    throw E(std::string("parallel mesh: ") + e.what());
  }
  d.pp = dims[0].second;
  d.dp_replicate = dims[1].second;
  d.dp_shard = dims[2].second;
  d.cp = dims[3].second;
  d.tp = dims[4].second;
  if (d.cp_mode != "ring" && d.cp_mode != "allgather")
    throw E("parallel.cp_mode must be ring or allgather, got '" + d.cp_mode + "'");
  // Two equal chunks per cp rank (load balance under the causal mask).
  if (d.cp > 1 && mc.seq_len % (2 * d.cp) != 0)
    throw E("parallel.cp = " + std::to_string(d.cp) + ": model.seq_len (" + std::to_string(mc.seq_len) +
            ") must be divisible by 2 x cp = " + std::to_string(2 * d.cp) + " (each sequence is cut into 2 x cp equal chunks)");
  if (d.tp > 1)
    for (auto [v, what] : {std::pair<int64_t, const char*>{mc.n_head, "model.n_head"}, {mc.n_kv_head, "model.n_kv_head"},
                           {mc.ffn_hidden, "model.ffn_hidden"}})
      if (v % d.tp != 0)
        throw E(std::string(what) + " (" + std::to_string(v) + ") must be divisible by parallel.tp (" +
                std::to_string(d.tp) + ")");
  if (d.pp == 1 && d.virtual_stages != 1)
    throw E("parallel.pp_virtual_stages = " + std::to_string(d.virtual_stages) + " needs parallel.pp > 1");
  if (d.sequence_parallel) {
    if (d.tp == 1) throw E("parallel.sequence_parallel needs parallel.tp > 1 (it splits the tensor-parallel group's rows)");
    const int64_t tokens = d.micro_batch * mc.seq_len / d.cp;
    if (tokens % d.tp != 0)
      throw E("parallel.sequence_parallel: micro_batch x seq_len" + std::string(d.cp > 1 ? " / cp" : "") + " = " +
              std::to_string(tokens) + " tokens is not divisible by parallel.tp = " + std::to_string(d.tp));
  }
  check_expert_plan(d, mc);
}

// World rank r = (((pp * dp) + dp_rank) * cp + cp_rank) * tp + tp_rank (the mesh's order, tp
// fastest). The ep group is a block of ep consecutive dp ranks among the ranks of one stage, cp rank
// and tp rank (Megatron's expert-tensor-parallel = tp: every tp rank of an ep rank holds its tp
// slice of that ep rank's experts and exchanges tokens with the ep peers that share its tp rank;
// the cp ranks route different tokens, so each exchanges with the peers holding its own chunks).
// edp holds the same experts and slice: the dp ranks at the same place in their blocks, times the
// cp ranks (which see other tokens of the same sequences), of one stage and tp rank.
namespace {
std::array<int, 4> stage_dp_cp_tp(const ParallelPlan& d, int r) {
  const int dp = d.dp(), cp = d.cp, tp = d.tp;
  return {r / (tp * cp * dp), (r / (tp * cp)) % dp, (r / tp) % cp, r % tp};
}
}  // namespace

std::pair<int, int> ep_color_key(const ParallelPlan& d, int r) {
  const auto c = stage_dp_cp_tp(d, r);
  return {((c[0] * d.cp + c[2]) * d.tp + c[3]) * (d.dp() / d.ep) + c[1] / d.ep, c[1] % d.ep};
}

std::pair<int, int> edp_color_key(const ParallelPlan& d, int r) {
  const auto c = stage_dp_cp_tp(d, r);
  return {(c[0] * d.tp + c[3]) * d.ep + c[1] % d.ep, (c[1] / d.ep) * d.cp + c[2]};
}

ParallelGroups ParallelGroups::build(comm::World& w, const ParallelPlan& d) {
  ParallelGroups g;
  // cp joins the mesh only when it is > 1 (every layout without it keeps its groups and names).
  std::vector<std::pair<std::string, int>> dims{{"pp", d.pp}, {"dp_replicate", d.dp_replicate}, {"dp_shard", d.dp_shard}};
  if (d.cp > 1) dims.emplace_back("cp", d.cp);
  dims.emplace_back("tp", d.tp);
  g.mesh = std::make_unique<comm::DeviceMesh>(w, dims);
  // The cp ranks hold the same weights and see different tokens: their gradients are reduced (and
  // the sharded strategies shard) together with the data-parallel ranks', as torchtitan's
  // dp_shard_cp / dp_cp meshes do.
  g.dp = d.cp > 1 ? g.mesh->group(std::vector<std::string>{"dp_replicate", "dp_shard", "cp"})
                  : g.mesh->group(std::vector<std::string>{"dp_replicate", "dp_shard"});
  g.data_rank = g.mesh->coord("dp_replicate") * d.dp_shard + g.mesh->coord("dp_shard");
  g.data_world = d.dp();
  if (d.cp > 1) g.cp = g.mesh->group("cp");
  // Losses and summaries travel on their own group so the dp group's counters hold only gradients.
  g.metrics = w.split_like(*w.world(), "metrics");
  // Non-hybrid strategies shard over every data-parallel rank; hybrid ones shard inside dp_shard
  // and replicate across dp_replicate.
  g.shard = d.hybrid() ? (d.cp > 1 ? g.mesh->group(std::vector<std::string>{"dp_shard", "cp"}) : g.mesh->group("dp_shard"))
                       : g.dp;
  g.replicate = d.hybrid() ? g.mesh->group("dp_replicate")
                           : w.split_by([](int r) { return std::pair<int, int>{r, 0}; }, "replicate_none");
  g.tp = g.mesh->group("tp");
  // A second communicator over the tp ranks carries gradient norms and checkpoint gathers,
  // keeping the tp counters to the model.
  g.tp_aux = w.split_like(*g.tp, "tp_aux");
  g.pp_rank = g.mesh->coord("pp");
  g.pp = g.mesh->group("pp");
  // Same members as the pp group, for loss and gradient-norm sums (keeps the pp counters to
  // activations and gradients).
  if (d.pp > 1) g.pp_aux = w.split_like(*g.pp, "pp_aux");
  if (is_sharded(d.strategy)) g.grad_norm = w.split_like(*g.shard, "grad_norm");
  if (d.ep > 1) {
    g.ep = w.split_by([d](int r) { return ep_color_key(d, r); }, "ep");
    g.ep_aux = w.split_like(*g.ep, "ep_aux");
    g.edp = w.split_by([d](int r) { return edp_color_key(d, r); }, "edp");
  }
  return g;
}

}  // namespace mt
