// The pipeline's stage cut: the model's units (embedding, blocks, head) as pp * v contiguous
// virtual stages, balanced by cost or as the user lists them. Part of the layout library
// (mt_layout: no MPI, no kernels), so the planner can cut a model exactly as the engine does.
#pragma once
#include <string>
#include <utility>
#include <vector>

#include "model/config/model_config.h"

namespace mt::parallel {

// Units [first, last] of each virtual stage, in stage order.
struct StagePartition {
  std::vector<std::pair<int, int>> stages;
  std::string describe() const;  // "0-2 | 3-4 | 5-7" with unit names' short form
};

// Relative cost (forward + backward FLOPs per token) of each unit: the embedding is a lookup, a block
// its matmuls and attention, the head its final norm and the [C x V] output projection.
std::vector<double> unit_costs(const ModelConfig& c);
// Contiguous stages that minimise the most expensive stage (every stage gets at least one unit).
// `manual`: blocks per stage ("3,3,2"; the embedding joins the first stage, the head the last),
// overriding the cost model. Throws std::invalid_argument naming the problem.
StagePartition partition_stages(const ModelConfig& c, int num_stages, const std::string& manual = "");
// The owned-unit flags (for the Transformer constructor) of pipeline rank r: stages r, r + pp, ...,
// or with the V placement (zbv) stages r and 2*pp-1-r.
std::vector<char> stage_units_of_rank(const StagePartition& p, int pp, int r, int num_units, bool vshape = false);

}  // namespace mt::parallel
