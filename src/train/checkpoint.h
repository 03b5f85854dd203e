// Checkpoints: CHECKPOINT_DIR/step_NNNNNNNN/ holding
//   model.safetensors      weights with Hugging Face names and layouts (fp32, real vocabulary rows)
//   optimizer.safetensors  AdamW moments over the flat buffer (layout-independent: full, unsharded)
//   trainer.json           step, optimizer step count, data position, format version
//   config.toml            the run configuration (what `sample` rebuilds the model from)
// A checkpoint is written into a hidden temporary directory and renamed into place when complete,
// then CHECKPOINT_DIR/latest is replaced atomically: a crash never leaves a half-written
// checkpoint where a good one was.
#pragma once
#include <cstdint>
#include <string>

#include "model/transformer.h"
#include "train/config.h"

namespace mt {

struct TrainerState {
  int64_t step = 0;            // optimizer steps completed
  int64_t adam_steps = 0;
  int64_t micro_batches = 0;   // micro-batches consumed from the training data (per rank)
};

// Full fp32 weights and moments (already gathered if the run was sharded). m / v may be null.
void save_checkpoint(const std::string& root, const Transformer& model, const float* weights, const float* exp_avg,
                     const float* exp_avg_sq, const TrainerState& st, const RunConfig& cfg);

// Resolves "latest" (or a directory) to a checkpoint directory; throws naming what is missing.
std::string resolve_checkpoint(const std::string& root_or_dir);

// Loads weights (and moments when the pointers are non-null) into full flat buffers of the model's
// layout. Checks every tensor's presence and shape, naming the file and tensor on mismatch.
TrainerState load_checkpoint(const std::string& dir, const Transformer& model, float* weights, float* exp_avg,
                             float* exp_avg_sq);
// The run configuration stored with a checkpoint.
RunConfig load_checkpoint_config(const std::string& dir);

// Weights only, Hugging Face names: export / import.
void export_weights(const std::string& path, const Transformer& model, const float* weights);
void import_weights(const std::string& path, const Transformer& model, float* weights);

}  // namespace mt
