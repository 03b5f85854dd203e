// Per-step metrics: the progress line and the JSON-lines file (--log.metrics_out; keys in docs/training.md).
#pragma once
#include <cstdint>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "runtime/memory.h"

namespace mt {

struct StepMetrics {
  int64_t step = 0;
  double loss = 0, lr = 0, tokens_per_s = 0, step_ms = 0, compute_ms = 0, comm_ms = 0, exposed_comm_ms = 0;
  double grad_norm = 0;
  std::optional<double> mfu, val_loss;
  // The validation loss in bits per byte of text (when the val shards record their bytes).
  std::optional<double> val_bits_per_byte;
  // Pipeline parallelism: idle share of the schedule (mean over the pipeline ranks) and the
  // formula's value for the same schedule.
  std::optional<double> pp_bubble, pp_bubble_formula;
  std::optional<double> pp_idle_ms;  // idle ms in the step's window, mean over the pipeline ranks
  int64_t mem_peak_bytes = 0;
  // Time the step waited for its batch from the loader (this rank).
  std::optional<double> data_wait_ms;
  // On the steps where the ranks compared their times (train/straggler.h): straggler,
  // step_ms_per_rank, busy_ms_per_rank, data_wait_ms_per_rank, idle_ms_per_rank (null otherwise).
  nlohmann::json stragglers;
  // Data with loss masks: the targets the loss trained this step, all ranks (the loss is their mean).
  std::optional<int64_t> trained_tokens;
  // Unpacked data (data.packing = false): padded positions / all positions of the step's micro-batches, all ranks.
  std::optional<double> padding_share;
  // A blended data.train: input tokens seen so far per dataset pattern, all ranks (null otherwise).
  nlohmann::json data_tokens_by_dataset;
  // Mixture of experts (null otherwise): expert_tokens, expert_imbalance, moe_aux_loss, ... (see
  // docs/moe.md), written as top-level keys.
  nlohmann::json moe;
};

class TensorBoardWriter;  // train/tensorboard.h

class MetricsWriter {
 public:
  // Empty path: nothing written.
  explicit MetricsWriter(const std::string& path);
  ~MetricsWriter();
  // log.tensorboard_dir: every step record also goes to TensorBoard event files in `dir` as scalars
  // named by their JSON keys (the final object's under "final/"), and `config_text` as the text
  // "config". Empty dir: nothing.
  void attach_tensorboard(const std::string& dir, const std::string& config_text);
  void step(const StepMetrics& m);
  void final(const nlohmann::json& obj);
  bool enabled() const { return out_.is_open(); }

 private:
  std::ofstream out_;
  std::unique_ptr<TensorBoardWriter> tb_;
  int64_t last_step_ = 0;
};

std::string progress_line(const StepMetrics& m, int64_t total_steps);
// Cross-entropy in nats per token as bits per byte of text; nothing when bytes_per_token <= 0
// (shards without a record of their text).
std::optional<double> bits_per_byte(double nats_per_token, double bytes_per_token);
// " (1.234 bits/byte)" or "" when the value is missing.
std::string bits_per_byte_note(const std::optional<double>& bpb);
// The note printed once when the val shards (`val_spec`) do not record their text's bytes.
std::string no_bits_per_byte_note(const std::string& val_spec);
// {"params": ..., "grads": ..., ...} from per-category byte counts.
nlohmann::json category_json(const std::array<int64_t, kNumMemCategories>& v);

}  // namespace mt
