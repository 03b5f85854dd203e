// A parallel plan on the world: its check against the world and the model (the degrees resolved),
// and every process group a rank uses, built once in one order (group creation is collective).
// The mesh is pp x dp_replicate x dp_shard x cp x tp (torchtitan's order; cp joins the mesh only
// when > 1).
#pragma once
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>

#include "comm/world.h"
#include "model/config/model_config.h"
#include "parallel/layout/parallel_plan.h"

namespace mt {

// A parallel plan the world, the model or the pipeline refuses (the config layer reports it as a
// ConfigError).
class PlanError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// Checks `plan` for a world of `world` ranks and the resolved model (its padded vocabulary already a
// multiple of 64 x tp) and resolves dp_shard = -1 (the ranks left over). Throws
// PlanError with one message naming the config key and the degree at fault.
void check_plan(ParallelPlan& plan, const ModelConfig& model, int world);

// The vocabulary padded so every tensor-parallel rank holds whole 64-row blocks (64 x tp).
int64_t padded_vocab_for_tp(int64_t vocab, int tp);

// Expert parallelism: {colour, key} of world rank r in the ep group (a block of ep consecutive
// data-parallel ranks of one stage, cp rank and tp rank; key = place in the block) and in the edp
// group (the data-parallel ranks of one stage and tp rank at the same place in their blocks, with
// every cp rank; key = block x cp + cp rank).
std::pair<int, int> ep_color_key(const ParallelPlan& d, int world_rank);
std::pair<int, int> edp_color_key(const ParallelPlan& d, int world_rank);

// Every group of this rank. Collective over the world: all ranks build it at the same point.
struct ParallelGroups {
  std::unique_ptr<comm::DeviceMesh> mesh;
  std::shared_ptr<comm::ProcessGroup> dp;         // dp_replicate x dp_shard (x cp: "dp_cp") (losses, DDP, ZeRO)
  std::shared_ptr<comm::ProcessGroup> shard;      // what the strategy shards over (dp, or dp_shard (x cp) when hybrid)
  std::shared_ptr<comm::ProcessGroup> replicate;  // across replicas (dp_replicate when hybrid, else a group of one)
  std::shared_ptr<comm::ProcessGroup> tp;         // the model's tensor-parallel collectives
  std::shared_ptr<comm::ProcessGroup> tp_aux;     // same members: gradient norms, checkpoint gathers
  std::shared_ptr<comm::ProcessGroup> pp;         // activations and gradients between stages
  std::shared_ptr<comm::ProcessGroup> pp_aux;     // same members: loss and norm sums (null when pp = 1)
  std::shared_ptr<comm::ProcessGroup> metrics;    // the whole world: losses and summaries
  std::shared_ptr<comm::ProcessGroup> grad_norm;  // the shard group's members: sharded gradient norms (null for DDP)
  // Expert parallelism (null when ep = 1): `ep` = the dp ranks that share out the experts (token
  // all-to-alls), `ep_aux` its members on their own communicator (expert norms, checkpoint
  // gathers), `edp` = the dp ranks that hold the same experts (their gradients' reduction).
  std::shared_ptr<comm::ProcessGroup> ep, ep_aux, edp;
  std::shared_ptr<comm::ProcessGroup> cp;         // ring attention's transfers (null when cp = 1)
  int pp_rank = 0;
  int data_rank = 0, data_world = 1;  // this rank's batch: its place among dp_replicate x dp_shard

  static ParallelGroups build(comm::World& w, const ParallelPlan& d);
};

}  // namespace mt
