// The trainer's metrics: each step's StepMetrics assembled from the step's figures (and the
// mixture-of-experts statistics, reduced over the world), the run's totals, the progress line and
// the metrics file (keys in docs/training.md), the job's header and the final report.
#pragma once
#include <array>
#include <cstdint>
#include <optional>
#include <vector>

#include <nlohmann/json.hpp>

#include "checkpoint/checkpoint_saver.h"
#include "data/data_loader.h"
#include "parallel/parallelize.h"
#include "runtime/clock.h"
#include "train/config.h"
#include "train/metrics.h"
#include "train/straggler.h"

namespace mt {

// {pattern: input tokens seen so far by all data-parallel ranks together}.
nlohmann::json tokens_by_dataset(const BlendLoader& blend);

// What the final report needs from the rest of the run.
struct RunOutcome {
  int64_t steps = 0;
  std::vector<double> val_losses;
  double final_val_loss = 0;
  std::optional<double> val_start;     // train.eval_at_start
  double val_bytes_per_token = 0;      // 0: the val shards do not record their text (no bits per byte)
  nlohmann::json load_info;            // how the resumed checkpoint was loaded (null: not resumed)
  const CheckpointSaver* saver = nullptr;  // sharded checkpoints
  int64_t full_saves = 0;              // train.checkpoint_format = full
  double full_save_ms = 0;
  const BlendLoader* blend = nullptr;  // a blended data.train
  std::optional<int64_t> trained_tokens;  // data with loss masks: targets trained by this run's steps
};

class MetricsProcessor {
 public:
  // Writes the metrics file on rank 0 (every rank of a dry run). `first_step`: the step the run
  // starts from (its first step pays warm-up costs and is left out of the means).
  MetricsProcessor(const RunConfig& cfg, const ModelConfig& mc, const ParallelGroups& groups,
                   parallel::ParallelModel& pm, DType dtype, int rank, int world, bool dry, int64_t first_step);

  // The job's description (model, data, batch, device, layout, pipeline), on the printing rank.
  void print_header(int64_t params, int64_t data_tokens, int threads) const;
  // Step `step` (0-based) done: its figures since `t0` (the step's start; `data_ms` of it waiting for
  // the batch) into StepMetrics and the run's totals. Collective over the world for a mixture of
  // experts, and every log.straggler_every steps (the ranks compare their times).
  StepMetrics step(int64_t step, const parallel::StepResult& r, double lr, Clock::time_point t0, parallel::StepComm cs,
                   double data_ms);
  // The progress line (every log.print_every steps, the last and those with a validation loss) and
  // the metrics file's line.
  void emit(const StepMetrics& m);
  // Unpacked data: the next step's tokens (the samples' real tokens, all ranks) for tokens_per_s and
  // MFU, instead of micro_batch x seq_len per micro-batch.
  void set_step_tokens(int64_t tokens) { step_tokens_ = tokens; }
  double tokens_per_s() const { return tps_n_ ? tps_sum_ / static_cast<double>(tps_n_) : 0.0; }
  // Memory, model state, throughput, experts, pipeline, communication and checkpoints; the metrics
  // file's final line. Collective over the world (every rank's memory).
  void report(const RunOutcome& o);
  // TensorBoard event files in `dir` (empty: none) beside the metrics file; `config_toml` as text.
  void attach_tensorboard(const std::string& dir, const std::string& config_toml) {
    writer_.attach_tensorboard(dir, config_toml);
  }

 private:
  nlohmann::json moe_step_metrics(double* a2a_ms, int64_t* a2a_bytes);
  std::vector<int64_t> gather_memory(const MemStats& ms);
  void print_memory(const MemStats& ms) const;
  void print_run_summary() const;
  nlohmann::json final_json(const MemStats& ms, const std::vector<int64_t>& every) const;
  void add_checkpoints(nlohmann::json& fin, const RunOutcome& o) const;

  const RunConfig& cfg_;
  const RunConfig::Train& tc_;
  const ModelConfig& mc_;
  const ParallelPlan& plan_;
  const ParallelGroups& groups_;
  parallel::ParallelModel& pm_;
  DType dt_;
  int rank_ = 0, world_ = 1;
  bool dry_ = false, log_ = false;
  int64_t first_step_ = 0;
  MetricsWriter writer_;
  StragglerMonitor stragglers_;

  // Over the run (steps after the first).
  double tps_sum_ = 0, comm_ms_total_ = 0, exposed_ms_total_ = 0, bubble_sum_ = 0, data_ms_total_ = 0;
  int64_t straggler_checks_ = 0, straggler_named_ = 0;
  double cp_comm_ms_total_ = 0, cp_exposed_ms_total_ = 0;
  int64_t tps_n_ = 0;
  int peak_slots_ = 0;
  std::vector<double> stage_ms_sum_;  // pp > 1: StepResult::stage_ms summed over the counted steps
  std::vector<double> idle_ms_;       // pp > 1: StepResult::idle_ms of each counted step
  double window_ms_sum_ = 0;          // pp > 1: StepResult::window_ms summed over the counted steps
  double idle_ms_mean() const;
  // The median: one slow step on a shared machine (a preempted rank) moves the mean, not this.
  double idle_ms_median() const;
  // The mean per-micro-batch costs {F, B, W} of each stage (wall time, or the compute thread's CPU
  // time) and the schedule's simulated bubble with the CPU-time costs (pp > 1, after a counted step).
  std::vector<std::array<double, 3>> stage_costs(bool cpu = false) const;
  double costed_bubble() const;
  std::array<int64_t, kNumMemCategories> resident_{};
  // Mixture of experts: imbalance, all-to-all bytes and ms, the last aux loss, dropped choices.
  double moe_imb_sum_ = 0, a2a_ms_sum_ = 0, moe_aux_last_ = 0;
  int64_t a2a_bytes_sum_ = 0, moe_dropped_ = 0;
  std::vector<double> moe_tokens_total_;  // per MoE layer x expert, the whole run
  std::optional<int64_t> step_tokens_;  // set_step_tokens
};

}  // namespace mt
