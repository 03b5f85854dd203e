// The job's parallel layout (torchtitan's ParallelDims): the degrees of the mesh
// pp x dp_replicate x dp_shard x cp x tp (torchtitan's order; cp joins the mesh only when > 1), validated once against the world and the model, and every
// process group a rank uses, built once in one order (group creation is collective).
#pragma once
#include <memory>
#include <string>
#include <utility>

#include "comm/world.h"
#include "model/config/model_config.h"
#include "parallel/layout/parallel_config.h"
#include "train/config.h"

namespace mt {

struct ParallelDims {
  int world = 1;
  int pp = 1, dp_replicate = 1, dp_shard = 1, cp = 1, tp = 1;  // dp_shard resolved (never -1)
  std::string cp_mode = "ring";  // ring | allgather
  int pp_virtual_stages = 1;
  int ep = 1;  // expert parallelism: blocks of ep consecutive data-parallel ranks share out the routed experts
  ShardingStrategy strategy = ShardingStrategy::NoShard;
  bool sequence_parallel = false;

  // Checks the [parallel] section (and what it needs of [model] and [train]) for a world of
  // `world` ranks; throws ConfigError with one message naming the key and the degree at fault.
  // `model`: the resolved model (its padded vocabulary already a multiple of 64 x tp).
  static ParallelDims from_config(const RunConfig& cfg, const ModelConfig& model, int world);

  // Data-parallel ranks (different data). Gradients are reduced, and FSDP / ZeRO shard, over these
  // times the cp ranks (which hold the same weights and see different tokens of the same sequences).
  int dp() const { return dp_replicate * dp_shard; }
  bool cp_enabled() const { return cp > 1; }
  bool hybrid() const { return is_hybrid(strategy); }
  bool tp_enabled() const { return tp > 1; }
  bool pp_enabled() const { return pp > 1; }
  bool ep_enabled() const { return ep > 1; }
};

// The vocabulary padded so every tensor-parallel rank holds whole 64-row blocks (64 x tp).
int64_t padded_vocab_for_tp(int64_t vocab, int tp);

// Expert parallelism: {colour, key} of world rank r in the ep group (a block of ep consecutive
// data-parallel ranks of one stage, cp rank and tp rank; key = place in the block) and in the edp
// group (the data-parallel ranks of one stage and tp rank at the same place in their blocks, with
// every cp rank; key = block x cp + cp rank).
std::pair<int, int> ep_color_key(const ParallelDims& d, int world_rank);
std::pair<int, int> edp_color_key(const ParallelDims& d, int world_rank);

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

  static ParallelGroups build(comm::World& w, const ParallelDims& d);
};

}  // namespace mt
