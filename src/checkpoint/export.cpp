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

namespace {

// The Hugging Face name of a parameter (GPT-2's carry the "transformer." prefix there).
std::string hf_name(const ModelConfig& mc, const std::string& name) {
  return mc.arch == Arch::GPT2 ? "transformer." + name : name;
}

// w (parameter `base` in Hugging Face layout: GPT-2's Conv1D weights [in, out]) += scale B A for
// every adapter of that weight.
void merge_adapters(const CheckpointReader& in, const Transformer& ref, size_t base, float* w) {
  const ModelConfig& mc = ref.config();
  const ParamInfo& bp = ref.params()[base];
  const int64_t out = bp.shape[0], n_in = bp.numel / out;
  const double s = mc.lora_scale();
  for (size_t a = 0; a < ref.params().size(); ++a) {
    const ParamInfo& pa = ref.params()[a];
    if (pa.lora_kind != 'A') continue;
    // The adapter's rows are rows of the matrix the layer multiplies: Llama's q, k, v weights are
    // one [q + 2 kv, C] matrix there, three parameters here.
    size_t target = static_cast<size_t>(pa.lora_base);
    int64_t row0 = pa.lora_row0;
    while (row0 >= ref.params()[target].shape[0]) row0 -= ref.params()[target++].shape[0];
    if (target != base) continue;
    const int64_t r = pa.shape[0], rows = pa.lora_rows;
    std::vector<float> A(static_cast<size_t>(pa.numel)), B(static_cast<size_t>(rows * r));
    in.read_param_hf(a, A.data());
    in.read_param_hf(a + 1, B.data());
    for (int64_t o = 0; o < rows; ++o)
      for (int64_t i = 0; i < n_in; ++i) {
        double d = 0;
        for (int64_t k = 0; k < r; ++k)
          d += static_cast<double>(B[static_cast<size_t>(o * r + k)]) * static_cast<double>(A[static_cast<size_t>(k * n_in + i)]);
        const int64_t at = bp.hf_transposed ? i * out + (row0 + o) : (row0 + o) * n_in + i;
        w[at] = static_cast<float>(static_cast<double>(w[at]) + s * d);
      }
  }
}

}  // namespace

ExportResult export_adapter(const std::string& checkpoint, const ModelConfig& mc, const std::string& out_dir) {
  if (!mc.lora()) throw std::runtime_error("the checkpoint's run has no LoRA adapters (lora.rank = 0): export it without --adapter");
  if (mc.arch == Arch::GPT2 && (mc.lora_targets & (kLoraQ | kLoraK | kLoraV)))
    throw std::runtime_error("GPT-2 adapters on parts of c_attn (lora.targets q, k, v) have no PEFT layout (PEFT adapts "
                             "whole modules): export without --adapter for merged weights, or train with c_attn");
  const std::string dir = resolve_checkpoint(checkpoint);
  const Transformer ref(mc, ModelOptions{.storage = ModelStorage{.weights = false, .master = false, .grads = false}});
  const CheckpointReader in(dir, ref, false);
  std::vector<std::pair<std::string, SafeTensorInfo>> header;
  std::vector<size_t> which;
  int64_t total = 0;
  for (size_t i = 0; i < ref.params().size(); ++i) {
    const ParamInfo& p = ref.params()[i];
    if (!p.lora_kind) continue;
    const std::string suffix = p.lora_kind == 'A' ? ".lora_A.weight" : ".lora_B.weight";
    const std::string module = p.name.substr(0, p.name.size() - suffix.size());
    SafeTensorInfo t;
    t.shape = p.shape;
    header.push_back({"base_model.model." + hf_name(mc, module) + suffix, t});
    which.push_back(i);
    total += 4 * p.numel;
  }
  fs::create_directories(out_dir);
  SafetensorsWriter w((fs::path(out_dir) / "adapter_model.safetensors").string(), header, {{"format", "pt"}});
  std::vector<float> buf;
  ExportResult res;
  for (size_t k = 0; k < which.size(); ++k) {
    buf.resize(static_cast<size_t>(ref.params()[which[k]].numel));
    in.read_param_hf(which[k], buf.data());
    w.write(header[k].first, buf.data(), buf.size() * sizeof(float));
    ++res.tensors;
  }
  w.finish();
  res.files = 1;
  res.bytes = total;
  nlohmann::json targets = nlohmann::json::array();
  const bool gpt = mc.arch == Arch::GPT2;
  const std::pair<uint32_t, const char*> names[] = {
      {kLoraQkv, "c_attn"},  {kLoraQ, "q_proj"},           {kLoraK, "k_proj"},
      {kLoraV, "v_proj"},    {kLoraO, gpt ? "attn.c_proj" : "o_proj"}, {kLoraGate, "gate_proj"},
      {kLoraUp, gpt ? "c_fc" : "up_proj"}, {kLoraDown, gpt ? "mlp.c_proj" : "down_proj"}};
  for (const auto& [bit, name] : names)
    if (mc.lora_targets & bit) targets.push_back(name);
  const nlohmann::json cfg = {{"peft_type", "LORA"},
                              {"task_type", "CAUSAL_LM"},
                              {"r", mc.lora_rank},
                              {"lora_alpha", mc.lora_alpha > 0 ? static_cast<double>(mc.lora_alpha) : static_cast<double>(mc.lora_rank)},
                              {"lora_dropout", mc.lora_dropout},
                              {"target_modules", targets},
                              {"bias", "none"},
                              {"fan_in_fan_out", gpt},
                              {"inference_mode", true},
                              {"init_lora_weights", true},
                              {"use_rslora", false},
                              {"modules_to_save", nullptr},
                              {"base_model_name_or_path", nullptr}};
  std::ofstream f(fs::path(out_dir) / "adapter_config.json");
  f << cfg.dump(2) << "\n";
  if (!f) throw std::runtime_error("cannot write " + (fs::path(out_dir) / "adapter_config.json").string());
  return res;
}

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
    if (ref.params()[i].lora_kind) continue;  // adapters are merged into their base weights
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
      if (mc.lora()) merge_adapters(in, ref, it.param, buf.data());
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
