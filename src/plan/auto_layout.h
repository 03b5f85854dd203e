// `meshtrain train --auto`: the planner's choice of layout for the ranks a job was given, among
// data-parallel layouts only (DDP, ZeRO-1/2/3, HSDP; activation checkpointing; gradient
// accumulation). It always answers tp = pp = 1: the engine's tensor and pipeline parallelism are set
// by hand (`meshtrain plan` ranks layouts with them). No CPU offload: the engine offloads on one GPU
// only (train.offload), and `--auto` plans CPU jobs.
//
//   mt::plan::AutoLayout a = mt::plan::auto_layout(model_config, world_size, ranks_per_node,
//                                                  micro_batch * seq_len * grad_accum * world_size);
//   if (!a.fits) ...;  // a.why says by how much it does not
//   cfg.set_parallel_plan(a.plan);  // the trainer's RunConfig (train/config.h)
#pragma once
#include <cstdint>
#include <optional>
#include <string>

#include "model/config/model_config.h"
#include "plan/cost_model.h"

namespace mt::plan {

struct AutoLayoutOptions {
  std::string cluster = "this-cpu";  // cluster preset describing the devices (see cluster.h)
  std::optional<Cluster> cluster_model;  // a measured cluster (measured_cpu_cluster) instead of the preset
  bool fp32 = true;                  // train.dtype fp32; false = bf16 mixed precision (fp32 master)
  int64_t micro_batch = 0;           // sequences per rank per micro-batch; 0 = the planner chooses
  int64_t seq = 0;                   // tokens per sequence; 0 = the model's seq_len
  std::optional<Strategy> strategy;  // pinned by the user (else free)
  std::optional<Checkpointing> checkpointing;  // pinned by the user (else free)
};

struct AutoLayout {
  // The engine's plan (parallel/layout/parallel_plan.h): strategy, dp_replicate x dp_shard = world
  // (dp_replicate > 1 only for HYBRID_SHARD; DDP and ZeRO run over dp_shard = every rank),
  // tp = pp = 1 (--auto chooses data-parallel layouts only), checkpointing, micro_batch and
  // microbatches (train.grad_accum; micro_batch x microbatches x world = global batch).
  ParallelPlan plan;
  int64_t global_batch = 0;           // sequences per step (global_batch_tokens / seq, rounded up)
  bool fits = false;                  // false: nothing fits; this is the layout that misses by the least
  std::string why;                    // the recommendation in plain words (the planner's)
  Estimate estimate;                  // predicted memory, communication, step time
};

// Chooses the layout for `world_size` ranks, `gpus_per_node` of them per node, training
// `global_batch_tokens` tokens per optimizer step. The batch in sequences is
// ceil(global_batch_tokens / seq), rounded up to a multiple of world_size (x micro_batch when it is
// pinned). Throws std::invalid_argument naming the bad input (world_size < 1, gpus_per_node < 1,
// global_batch_tokens < 1, unknown cluster, a pinned strategy that cannot run on world_size ranks).
AutoLayout auto_layout(const ModelConfig& model, int world_size, int gpus_per_node, int64_t global_batch_tokens,
                       const AutoLayoutOptions& opts = {});

}  // namespace mt::plan
