// `train --auto`: the planner's parallel plan for this job's ranks, written into the config.
#pragma once
#include "train/config.h"

namespace mt {

// The planner picks the data-parallel layout for this job's ranks (same global batch): the plan's
// strategy, degrees, recompute and batch split replace those of `cfg` (RunConfig::set_parallel_plan).
// Collective over the world (the ranks agree on one measurement of this machine).
void choose_layout(RunConfig& cfg);
// The machine's hardware threads (1 when unknown).
int hardware_threads();

}  // namespace mt
