// `meshtrain export`: a checkpoint as a Hugging Face model directory (config.json and HF-named
// safetensors, sharded with model.safetensors.index.json above --max-shard-mb), and
// `meshtrain model-info`: what the engine makes of a preset or a Hugging Face config.json.
#pragma once
#include <cstdint>
#include <string>

namespace mt {

struct ExportResult {
  int files = 0;            // safetensors files written
  int64_t tensors = 0, bytes = 0;
};
// Writes out_dir/config.json and the weights of checkpoint `checkpoint` (a step_* directory or a
// checkpoint_dir, meaning its latest). Throws std::runtime_error naming what is wrong.
ExportResult export_checkpoint(const std::string& checkpoint, const std::string& out_dir, int64_t max_shard_bytes);

int run_export_command(int argc, char** argv);
int run_model_info_command(int argc, char** argv);

}  // namespace mt
