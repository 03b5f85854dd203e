// Checkpoints: CHECKPOINT_DIR/step_NNNNNNNN/ holding
//   model.safetensors      weights with Hugging Face names and layouts (fp32, real vocabulary rows)
//   optimizer.safetensors  AdamW moments over the flat buffer (layout-independent: full, unsharded)
//   trainer.json           step, optimizer step count, data position (and a blend's loader state), format version
//   config.toml            the run configuration (what `sample` rebuilds the model from)
// A checkpoint is written into a hidden temporary directory and renamed into place when complete
// (files and directories fsynced), then CHECKPOINT_DIR/latest is replaced atomically: a crash never
// leaves a half-written checkpoint where a good one was.
//
// Checkpoints stream one model unit at a time (CheckpointWriter / CheckpointReader): a sharded run
// gathers, writes, reads and re-shards unit by unit, so saving or loading needs the full state of
// one unit at a time, never of the whole model.
#pragma once
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "data/data_loader.h"
#include "model/transformer.h"

namespace mt {

// A checkpoint whose tensors do not fit the configured model (another model's); the message ends
// with what to do. `meshtrain train` reports it as a configuration error.
struct CheckpointModelMismatch : std::runtime_error {
  explicit CheckpointModelMismatch(const std::string& what)
      : std::runtime_error(what + ": train with the checkpoint's [model] settings (its trainer.json lists them) "
                                  "or another checkpoint") {}
};

// A LoRA checkpoint's adapters do not fit the base model they are loaded onto (its recorded
// train.init_from or seed initialisation holds other weights, or is missing); the message names
// both sources and what to do. Reported as a configuration error (exit code 2).
struct CheckpointBaseMismatch : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Where a LoRA run's frozen base model comes from: train.init_from (a safetensors file or a
// checkpoint of the model without adapters), or, when that is empty, the initialisation of `seed`.
struct LoraBaseSource {
  std::string init_from;
  int64_t seed = 0;
};

struct TrainerState {
  int64_t step = 0;            // optimizer steps completed
  int64_t adam_steps = 0;
  int64_t micro_batches = 0;   // micro-batches consumed from the training data (per rank)
  // A blended data.train: the loader's state (samples drawn in all and per dataset), in
  // trainer.json under "data"; absent for plain data, whose position is micro_batches.
  bool has_blend = false;
  BlendLoader::State blend{};
  // LoRA checkpoints (adapters only): the base's source and fingerprint, in trainer.json under
  // "lora_base": {"init_from": path or "", "seed": N, "crc32c": fingerprint}; null otherwise.
  nlohmann::json lora_base{};  // (empty braces: null)
};

// Whether a checkpoint of `c` stores parameter p: every parameter, except a LoRA model's frozen
// base parameters (a LoRA checkpoint holds the adapters and their optimizer state only).
bool checkpoint_stores(const ParamInfo& p, const ModelConfig& c);
// The base fingerprint of a LoRA model: the CRC32C of unit u's frozen parameters (real rows, fp32,
// in parameter order) from unit_w (the unit's first element, in `ref`'s layout); the fingerprint
// is the CRC32C of every unit's value (uint32, in unit order).
uint32_t lora_base_unit_crc(const Transformer& ref, int u, const float* unit_w);
uint32_t lora_base_fingerprint(const std::vector<uint32_t>& unit_crcs);
// "train.init_from PATH" or "the seed N initialisation".
std::string lora_base_text(const LoraBaseSource& s);
class LoraBase;

// What a checkpoint records of the run besides its state: the run configuration as TOML
// (config.toml: what `sample`, `export` and a resume rebuild the model from), the Hugging Face
// config.json the model was built from ("" = none; copied in as hf_config.json), and how many
// checkpoints the directory keeps (train.checkpoint_keep; 0 = all).
struct RunRecord {
  std::string config_toml;
  std::string hf_config;
  int64_t keep = 0;
};

class SafetensorsWriter;
class SafetensorsReader;
class ShardedCheckpoint;

// Writes CHECKPOINT_DIR/step_NNNNNNNN for `model` (an unsplit layout: every unit, tp = 1). Every
// unit is written once with write_unit, in any order; commit() finishes the files and swaps the
// checkpoint into place. Destroyed without commit (an error on the way), it removes its hidden
// directory and leaves every existing checkpoint as it was.
class CheckpointWriter {
 public:
  CheckpointWriter(const std::string& root, const Transformer& model, bool with_optimizer, int64_t step);
  ~CheckpointWriter();
  // Unit u's full fp32 weights and moments in `model`'s layout, each pointing at the unit's first
  // element (model.unit(u).numel elements); m / v are ignored without optimizer state.
  void write_unit(int u, const float* w, const float* m, const float* v);
  void commit(const TrainerState& st, const RunRecord& run);

 private:
  const Transformer& model_;
  std::string root_, name_, tmp_dir_;
  bool with_opt_;
  std::unique_ptr<SafetensorsWriter> weights_, moments_;
  std::vector<char> unit_done_;
  std::vector<float> scratch_;  // one parameter in Hugging Face layout
};

// Opens a checkpoint for `model` (an unsplit layout) and checks, before anything is read, the step
// file, the parameter count and every tensor's presence and shape (errors name file and tensor).
class CheckpointReader {
 public:
  // A LoRA checkpoint that holds adapters only takes the base parameters from `base` (resume: the
  // run's own source) or, when null, from the source it records (export, sample); either way the
  // base's fingerprint must equal the recorded one (CheckpointBaseMismatch otherwise).
  CheckpointReader(const std::string& dir, const Transformer& model, bool with_optimizer,
                   const LoraBaseSource* base = nullptr);
  // Weights only, from one safetensors file with Hugging Face names (a checkpoint's
  // model.safetensors, or an exported / Hugging Face GPT-2 file; "transformer."-prefixed names are
  // accepted): state() is all zero and there are no moments.
  CheckpointReader(const Transformer& model, const std::string& weights_file);
  ~CheckpointReader();
  const TrainerState& state() const { return st_; }
  bool has_moments() const { return moments_ != nullptr || sharded_moments_; }
  // A sharded checkpoint (format 2) or a format-1 one.
  bool sharded() const { return sharded_ != nullptr; }
  // Parameter i of the model in Hugging Face layout (hf_shape elements: real vocabulary rows,
  // Conv1D weights transposed): what export writes.
  void read_param_hf(size_t i, float* dst) const;
  // Unit u's weights (and moments when opened with_optimizer and m / v are non-null), pointers to
  // the unit's first element; padding (vocabulary rows past vocab_size, unit alignment) is zero.
  void read_unit(int u, float* w, float* m, float* v) const;

 private:
  const Transformer& model_;
  std::string dir_;
  TrainerState st_;
  std::unique_ptr<SafetensorsReader> weights_, moments_;
  std::vector<std::string> weight_names_;  // per parameter: its name in model.safetensors
  std::unique_ptr<ShardedCheckpoint> sharded_;
  bool sharded_moments_ = false;
  bool adapters_only_ = false;     // a LoRA checkpoint without its base: base_ supplies it
  std::unique_ptr<LoraBase> base_;
  void open_weights(const std::string& file);
};

// A parameter's shape as Hugging Face stores it (real vocabulary rows, Conv1D weights transposed).
std::vector<int64_t> hf_param_shape(const ParamInfo& p, const ModelConfig& cfg);

// trainer.json of a checkpoint; `format` is "full" (format 1) or "sharded" (format 2).
std::string checkpoint_trainer_json(const TrainerState& st, int64_t num_params, bool has_optimizer,
                                    const std::string& format);
// trainer.json read back (errors name the file).
TrainerState read_trainer_state(const std::string& dir, nlohmann::json* whole = nullptr);
// Finishes a checkpoint written into `tmp_dir`: trainer.json, config.toml (and hf_config.json),
// fsync, rename to root/name (an existing one of that name is replaced only once the new one is
// in place), then root/latest, then pruning (train.checkpoint_keep).
void finish_checkpoint_dir(const std::string& root, const std::string& tmp_dir, const std::string& name,
                           const std::string& trainer_json, const RunRecord& run);
// Writes a small file durably: temporary file, fsync, rename over `path`.
void write_text_file_atomic(const std::string& path, const std::string& text);

// Full fp32 weights and moments (already gathered if the run was sharded). m / v may be null.
void save_checkpoint(const std::string& root, const Transformer& model, const float* weights, const float* exp_avg,
                     const float* exp_avg_sq, const TrainerState& st, const RunRecord& run);

// Removes all but the `keep` newest step_NNNNNNNN checkpoints of `root` (by step number). Commit
// calls it after `latest` names the new checkpoint when train.checkpoint_keep > 0.
void prune_checkpoints(const std::string& root, int64_t keep);

// Resolves "latest" (or a directory) to a checkpoint directory; throws naming what is missing.
std::string resolve_checkpoint(const std::string& root_or_dir);

// Loads weights (and moments when the pointers are non-null) into full flat buffers of the model's
// layout. Checks every tensor's presence and shape, naming the file and tensor on mismatch.
TrainerState load_checkpoint(const std::string& dir, const Transformer& model, float* weights, float* exp_avg,
                             float* exp_avg_sq);
// The files in checkpoint `dir` that hold its RunRecord: config.toml, and hf_config.json ("" when
// the checkpoint has none).
std::string checkpoint_config_toml(const std::string& dir);
std::string checkpoint_hf_config(const std::string& dir);

// Weights only, from a safetensors file with Hugging Face names, into a full flat buffer of `model`
// (checked as CheckpointReader does).
void import_weights(const std::string& path, const Transformer& model, float* weights);

}  // namespace mt
