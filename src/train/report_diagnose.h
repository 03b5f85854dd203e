// `meshtrain diagnose`: what limits a run, from its metrics file alone — the checklist of "profile
// before guessing": is it communication-bound (exposed communication's share of the step, and the
// group that moves the most bytes), memory-bound (peak against the capacity; allocator retries when
// recorded), compute-bound (MFU against the measured ceiling when recorded, else the compute share),
// stalled on data (data_wait_ms) or held back by a straggler (straggler) — and the change most
// likely to help. Where the answer is a layout change and the run's model is known, the planner
// (plan/planner.h) ranks the layouts for the same ranks and the suggestion quotes its prediction.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "model/config/model_config.h"
#include "plan/cost_model.h"
#include "train/report_data.h"

namespace mt {

struct Finding {
  std::string check;     // "communication", "memory", "compute", "data", "straggler"
  bool recorded = true;  // false: the metrics do not hold what the check needs
  bool flagged = false;  // this limits the run
  double share = 0;      // the check's figure (share of the step, of the capacity, ...)
  std::string evidence;  // one line with the numbers
};

struct Diagnosis {
  std::string verdict;  // "communication-bound", "memory-bound", "compute-bound", "data-stalled", "straggling"
  std::string advice;   // the change most likely to help
  std::vector<Finding> findings;  // every check, in checklist order
  std::string text() const;       // the report diagnose prints
};

// What the run ran on, for the checks the metrics alone cannot do.
struct DiagnoseContext {
  int64_t capacity_bytes = 0;         // memory one rank may use (0: unknown, the memory check says so)
  std::optional<double> mfu_ceiling;  // the best MFU measured on this machine for the model's shapes
  // The run's model and layout (known when diagnose is given its config): the planner then backs the
  // advice for a communication- or memory-bound run.
  std::optional<ModelConfig> model;
  plan::TrainSetup setup;
  plan::Layout layout;
};

// Thresholds: exposed communication >= 25% of the step; peak >= 85% of the capacity; data wait
// >= 10% of the step; a straggler named in >= 20% of the records that hold the ranks' comparison
// (`straggler`, every log.straggler_every steps).
Diagnosis diagnose(const RunMetrics& run, const DiagnoseContext& ctx);

// The planner's best layout for `ctx` next to the current one on the this-cpu model, as one sentence.
// goal "time": the fastest fitting layout ("... predicts 31% shorter steps than the current ..."), or
// that the current one is already the fastest, with its predicted exposed communication next to
// `measured_exposed_ms`. goal "memory": the layout needing the least memory per rank, or empty.
// Empty when ctx has no model.
std::string planner_advice(const DiagnoseContext& ctx, const std::string& goal, double measured_exposed_ms);

}  // namespace mt
