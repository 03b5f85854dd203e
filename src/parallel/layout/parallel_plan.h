// One parallel plan: the layout of a training job on its ranks. The trainer builds it once from the
// config (RunConfig::parallel_plan, which checks it against the world and the model), `train
// --auto` from the planner's choice, and the planner (src/plan, where it is `plan::Layout`)
// enumerates, costs and prints it; parallelize() (parallel/parallelize.h) applies it to a model.
//
// The mesh is pp x dp_replicate x dp_shard x cp x tp (torchtitan's order, tp fastest); expert
// parallelism borrows blocks of ep consecutive data-parallel ranks. Part of the layout library
// (no MPI, no kernels).
#pragma once
#include <cstdint>
#include <string>

#include "parallel/layout/parallel_config.h"

namespace mt {

struct ParallelPlan {
  ShardingStrategy strategy = ShardingStrategy::NoShard;
  int dp_replicate = 1;  // replicas (DDP, and HSDP's outer dimension)
  int dp_shard = 1;      // shard group size (ZeRO-1/2/3, HSDP's inner dimension); resolved (never -1)
  int tp = 1;
  int pp = 1;
  int cp = 1;            // context parallelism: each sequence's tokens over cp ranks (ring attention)
  PipelineSchedule schedule = PipelineSchedule::None;  // None: no pipeline (pp = 1)
  int virtual_stages = 1;    // interleaved 1F1B: model chunks per pipeline rank
  int64_t micro_batch = 1;   // sequences per micro-batch per data-parallel rank
  int64_t microbatches = 1;  // micro-batches per step (gradient accumulation / the pipeline's)
  Recompute checkpointing = Recompute::None;  // activation recomputation
  Offload offload = Offload::None;
  // Expert parallelism (MoE models): routed experts split over blocks of `ep` data-parallel ranks
  // (ep divides dp and the expert count); tokens move by all-to-all inside a block.
  int ep = 1;
  bool sequence_parallel = false;  // Megatron SP inside the tp group (the engine's parallel.sequence_parallel)
  std::string cp_mode = "ring";    // ring | allgather

  // Data-parallel ranks (different data). Gradients are reduced, and FSDP / ZeRO shard, over these
  // times the cp ranks (which hold the same weights and see different tokens of the same sequences).
  int dp() const { return dp_replicate * dp_shard; }
  int world() const { return dp() * cp * tp * pp; }
  int64_t global_batch() const { return static_cast<int64_t>(dp()) * microbatches * micro_batch; }
  bool cp_enabled() const { return cp > 1; }
  bool hybrid() const { return is_hybrid(strategy); }
  bool tp_enabled() const { return tp > 1; }
  bool pp_enabled() const { return pp > 1; }
  bool ep_enabled() const { return ep > 1; }
  bool offload_optimizer() const { return offload == Offload::Optimizer; }
  std::string describe() const;  // "ZeRO-3 dp_replicate=1 dp_shard=8 tp=1 pp=1 mb=2x4 ac=full"
};

}  // namespace mt
