// The cost model's view of a model (private to the planner's sources): its dimensions as doubles
// and the parameter counts the formulas of cost_model.cpp and estimate.cpp share.
#pragma once
#include <cstdint>

#include "model/config/model_config.h"

namespace mt::plan {

struct Shape {
  double L, h, a, hk, f, V, s, wpe, norm_block, norm_final, block, block_mm;
  // MoE: share of layers that are MoE layers, routed-expert parameters of one MoE layer, tokens'
  // expert choices k, and the width the activations see per token ((k + shared) x expert width).
  double moe_frac = 0, expert_layer = 0, k = 0, moe_f = 0;
  bool gpt2, tied;
};

// `seq` tokens per sequence.
Shape shape_of(const ModelConfig& m, int64_t seq);

}  // namespace mt::plan
