// The library side of `meshtrain export` and `meshtrain model-info` (the commands are
// src/cli/export.cpp): a checkpoint as a Hugging Face model directory (config.json and HF-named
// safetensors, sharded with model.safetensors.index.json above a size), and what the engine makes
// of a model config.
#pragma once
#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>

#include "model/config/model_config.h"

namespace mt {

struct ExportResult {
  int files = 0;            // safetensors files written
  int64_t tensors = 0, bytes = 0;
};
// Writes out_dir/config.json and the weights of checkpoint `checkpoint` (a step_* directory or a
// checkpoint_dir, meaning its latest) of model `mc` (what the checkpoint's config.toml resolves
// to), no safetensors file above max_shard_bytes (> 0) unless one tensor is larger. Throws
// std::runtime_error naming what is wrong.
// With LoRA (mc.lora_rank > 0) the weights written are merged: every adapted weight is
// W + (alpha / rank) B A (accumulated in double, rounded once), and the adapters themselves are
// not written.
ExportResult export_checkpoint(const std::string& checkpoint, const ModelConfig& mc, const std::string& out_dir,
                               int64_t max_shard_bytes);
// A LoRA checkpoint's adapters in PEFT's layout: out_dir/adapter_config.json and
// adapter_model.safetensors (base_model.model.<Hugging Face module>.lora_A.weight / lora_B.weight),
// which peft.PeftModel.from_pretrained loads onto the base model. Throws std::runtime_error when
// the checkpoint has no adapters, or for GPT-2 adapters on parts of c_attn (PEFT adapts whole
// modules: export merged instead).
ExportResult export_adapter(const std::string& checkpoint, const ModelConfig& mc, const std::string& out_dir);

// The resolved model: architecture, dimensions, norm epsilon, tied head, position-table rows,
// parameter count; for Llama also rope_theta, rope_scaling (when scaled), the rotary inverse
// frequencies (rope_inv_freq) and the sliding window (when there is one).
nlohmann::json model_info_json(const ModelConfig& m);

}  // namespace mt
