#include "checkpoint/export.h"

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "checkpoint/safetensors.h"
#include "model/config/hf_config.h"
#include "model/transformer.h"

namespace fs = std::filesystem;

namespace mt {

ExportResult export_checkpoint(const std::string& checkpoint, const ModelConfig& mc, const std::string& out_dir,
                               int64_t max_shard_bytes) {
  if (max_shard_bytes <= 0)
    throw std::runtime_error("the largest shard must be positive, got " + std::to_string(max_shard_bytes) + " bytes");
  const std::string dir = resolve_checkpoint(checkpoint);
  // A layout without storage: only names and shapes. The reader checks the checkpoint against it
  // (a sharded checkpoint also every file's CRC32C) and assembles each tensor from its pieces.
  const Transformer ref(mc, ModelOptions{.storage = ModelStorage{.weights = false, .master = false, .grads = false}});
  const CheckpointReader in(dir, ref, false);
  // The model's tensors in its own order, cut into shards of at most max_shard_bytes (one tensor
  // larger than that gets a shard of its own).
  struct Item {
    size_t param;
    SafeTensorInfo info;
  };
  std::vector<std::vector<Item>> shards(1);
  int64_t in_shard = 0, total = 0;
  for (size_t i = 0; i < ref.params().size(); ++i) {
    SafeTensorInfo t;
    t.shape = hf_param_shape(ref.params()[i], mc);
    int64_t n = 4;
    for (int64_t d : t.shape) n *= d;
    if (in_shard > 0 && in_shard + n > max_shard_bytes) {
      shards.emplace_back();
      in_shard = 0;
    }
    shards.back().push_back({i, t});
    in_shard += n;
    total += n;
  }
  fs::create_directories(out_dir);
  const int N = static_cast<int>(shards.size());
  auto shard_name = [&](int i) {
    if (N == 1) return std::string("model.safetensors");
    char buf[64];
    std::snprintf(buf, sizeof buf, "model-%05d-of-%05d.safetensors", i + 1, N);
    return std::string(buf);
  };
  ExportResult res;
  nlohmann::json weight_map = nlohmann::json::object();
  std::vector<float> buf;
  for (int i = 0; i < N; ++i) {
    const std::string path = (fs::path(out_dir) / shard_name(i)).string();
    std::vector<std::pair<std::string, SafeTensorInfo>> header;
    for (const Item& it : shards[static_cast<size_t>(i)]) header.push_back({ref.params()[it.param].name, it.info});
    SafetensorsWriter w(path, header, {{"format", "pt"}});
    for (const Item& it : shards[static_cast<size_t>(i)]) {
      const std::string& name = ref.params()[it.param].name;
      const uint64_t bytes = w.info(name).nbytes();
      buf.resize(bytes / sizeof(float));
      in.read_param_hf(it.param, buf.data());
      w.write(name, buf.data(), bytes);
      weight_map[name] = shard_name(i);
      ++res.tensors;
    }
    w.finish();
    ++res.files;
  }
  res.bytes = total;
  const fs::path index = fs::path(out_dir) / "model.safetensors.index.json";
  if (N > 1) {
    nlohmann::json j = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    std::ofstream(index) << j.dump(2) << "\n";
  } else {
    fs::remove(index);  // a stale index would point transformers at shards that are not there
  }
  std::ofstream cfg(fs::path(out_dir) / "config.json");
  cfg << hf_config_json(mc);
  if (!cfg) throw std::runtime_error("cannot write " + (fs::path(out_dir) / "config.json").string());
  return res;
}

nlohmann::json model_info_json(const ModelConfig& m) {
  nlohmann::json j = {{"arch", arch_name(m.arch)},
                      {"n_layer", m.n_layer},
                      {"n_head", m.n_head},
                      {"n_kv_head", m.n_kv_head},
                      {"n_embd", m.n_embd},
                      {"ffn_hidden", m.ffn_hidden},
                      {"vocab_size", m.vocab_size},
                      {"seq_len", m.seq_len},
                      {"max_position", m.max_position},
                      {"norm_eps", m.norm_eps},
                      {"tied_embeddings", m.tied_embeddings},
                      {"num_params", m.num_params()}};
  if (m.arch == Arch::Llama) {
    j["rope_theta"] = m.rope_theta;
    if (m.rope_scaled())
      j["rope_scaling"] = {{"rope_type", "llama3"},
                           {"factor", m.rope_scaling_factor},
                           {"low_freq_factor", m.rope_low_freq_factor},
                           {"high_freq_factor", m.rope_high_freq_factor},
                           {"original_max_position_embeddings", m.rope_original_max_position}};
    j["rope_inv_freq"] = m.rope_inv_freq();
    if (m.sliding_window > 0) j["sliding_window"] = m.sliding_window;
  }
  return j;
}

}  // namespace mt
