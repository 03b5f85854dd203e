// What `meshtrain plot` (cli/plot.cpp) draws: loss, throughput and exposed communication per step from one or more
// JSON-lines metrics files (--log.metrics_out), drawn as a self-contained SVG (no plotting
// library needed; opens in any browser), with runs overlaid for comparison.
#pragma once
#include <optional>
#include <string>
#include <vector>

namespace mt {

struct MetricsSeries {
  std::string label;
  std::vector<double> step, loss, tokens_per_s, exposed_comm_ms;
  std::vector<double> val_step, val_loss;  // evaluation steps only
};

// Reads the per-step records of a metrics file (the final summary object is skipped). Throws
// std::runtime_error naming the file and line when it cannot be read or has no step records.
MetricsSeries read_metrics_series(const std::string& path, const std::string& label);

// The SVG document: one panel each for loss (validation loss as dots), tokens/s and exposed
// communication ms, every run in its own colour with a legend.
std::string metrics_svg(const std::vector<MetricsSeries>& runs, const std::string& title);

// "Nice" axis ticks covering [lo, hi] (about `target` of them, steps of 1, 2 or 5 x 10^k).
std::vector<double> nice_ticks(double lo, double hi, int target = 5);

}  // namespace mt
