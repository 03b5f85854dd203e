// One run's metrics file (train --log.metrics_out) as `meshtrain report`, `diagnose` and `compare`
// read it: the per-step records and the final summary object, with helpers for the figures they
// share (means after the warm-up step, series of one key).
#pragma once
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "train/metrics_plot.h"

namespace mt {

struct RunMetrics {
  std::string label, path;
  MetricsSeries series;               // loss, tokens/s, exposed comm and validation (metrics_plot.h)
  std::vector<nlohmann::json> steps;  // every per-step record, in file order
  nlohmann::json final;               // the "final": true object; null when the run did not finish

  // Mean of the numeric `key` over the steps after the first (the first includes warm-up), or over
  // the only step; nullopt when no step has it as a number.
  std::optional<double> mean(const std::string& key) const;
  // (step, value) for every step where `key` is a number.
  std::vector<std::pair<double, double>> series_of(const std::string& key) const;
  // A number from the final object, nullopt when absent.
  std::optional<double> final_number(const std::string& key) const;
};

// Reads `path` (std::runtime_error naming the file and line when it cannot be read or holds no step
// records). `label` empty: the file name.
RunMetrics read_run_metrics(const std::string& path, const std::string& label = "");

}  // namespace mt
