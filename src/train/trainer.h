// The training loop behind `meshtrain train`.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "train/config.h"

namespace mt {

struct TrainResult {
  std::vector<double> losses;      // per step (mean over the global batch)
  std::vector<double> val_losses;  // per eval
  double final_val_loss = 0;
  double tokens_per_s = 0;          // mean over steps after the first
};

// Runs a whole training job described by `cfg` (this process is one rank when launched by mpirun).
TrainResult train(const RunConfig& cfg);

// `train --dry-run --world N --rank R`: makes the Meta device current and a Meta world of N ranks
// seen from R (before anything else initialises the world), and trims `cfg` to one step with
// nothing read or written but the metrics. Throws ConfigError for a bad world or rank.
void prepare_dry_run(RunConfig& cfg, int world, int rank);

}  // namespace mt
