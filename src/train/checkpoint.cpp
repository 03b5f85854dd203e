#include "train/checkpoint.h"

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>

#include "train/safetensors.h"

namespace fs = std::filesystem;

namespace mt {

namespace {

// Tables with one row per vocabulary entry (padded rows beyond vocab_size are never saved).
bool is_vocab_table(const ParamInfo& p) {
  return p.name == "wte.weight" || p.name == "model.embed_tokens.weight" || p.name == "lm_head.weight";
}

// A parameter's tensor as Hugging Face stores it: real vocabulary rows only, Conv1D transposed.
SafeTensor to_hf(const ParamInfo& p, const float* flat, const ModelConfig& cfg) {
  SafeTensor t;
  t.dtype = "F32";
  const float* src = flat + p.offset;
  std::vector<int64_t> shape = p.shape;
  bool vocab = is_vocab_table(p);
  if (vocab) shape[0] = cfg.vocab_size;
  int64_t rows = shape[0], cols = shape.size() == 2 ? shape[1] : 1;
  t.bytes.resize(static_cast<size_t>(rows * cols) * 4);
  float* dst = reinterpret_cast<float*>(t.bytes.data());
  if (p.hf_transposed) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) dst[c * rows + r] = src[r * cols + c];
    t.shape = {cols, rows};
  } else {
    std::memcpy(dst, src, t.bytes.size());
    t.shape = shape;
  }
  return t;
}

void from_hf(const ParamInfo& p, const SafeTensor& t, float* flat, const ModelConfig& cfg, const std::string& file) {
  std::vector<int64_t> shape = p.shape;
  bool vocab = is_vocab_table(p);
  if (vocab) shape[0] = cfg.vocab_size;
  int64_t rows = shape[0], cols = shape.size() == 2 ? shape[1] : 1;
  std::vector<int64_t> want = p.hf_transposed ? std::vector<int64_t>{cols, rows} : shape;
  auto str = [](const std::vector<int64_t>& s) {
    std::string o = "[";
    for (size_t i = 0; i < s.size(); ++i) o += (i ? ", " : "") + std::to_string(s[i]);
    return o + "]";
  };
  if (t.dtype != "F32") throw std::runtime_error(file + ": tensor " + p.name + " has dtype " + t.dtype + ", expected F32");
  if (t.shape != want)
    throw std::runtime_error(file + ": tensor " + p.name + " has shape " + str(t.shape) + ", the model expects " + str(want));
  const float* src = reinterpret_cast<const float*>(t.bytes.data());
  float* dst = flat + p.offset;
  if (p.hf_transposed) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) dst[r * cols + c] = src[c * rows + r];
  } else {
    std::memcpy(dst, src, static_cast<size_t>(rows * cols) * 4);
  }
  if (vocab) std::memset(dst + rows * cols, 0, static_cast<size_t>((p.shape[0] - rows) * cols) * 4);
}

// Elements of a parameter without the padded vocabulary rows (those are always zero).
int64_t real_numel(const ParamInfo& p, const ModelConfig& cfg) {
  bool vocab = is_vocab_table(p);
  return vocab ? cfg.vocab_size * p.shape[1] : p.numel;
}

SafeTensor flat_tensor(const float* data, int64_t n) {
  SafeTensor t;
  t.dtype = "F32";
  t.shape = {n};
  t.bytes.resize(static_cast<size_t>(n) * 4);
  std::memcpy(t.bytes.data(), data, t.bytes.size());
  return t;
}

void write_text_atomic(const fs::path& path, const std::string& text) {
  fs::path tmp = path;
  tmp += ".tmp";
  {
    std::ofstream f(tmp, std::ios::trunc);
    f << text;
    f.flush();
    if (!f) throw std::runtime_error("cannot write " + tmp.string());
  }
  fs::rename(tmp, path);
}

std::string read_text(const fs::path& p) {
  std::ifstream f(p);
  if (!f) throw std::runtime_error("cannot read " + p.string());
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

}  // namespace

void export_weights(const std::string& path, const Transformer& model, const float* weights) {
  std::map<std::string, SafeTensor> ts;
  for (const auto& p : model.params()) ts.emplace(p.name, to_hf(p, weights, model.config()));
  const ModelConfig& c = model.config();
  write_safetensors(path, ts,
                    {{"format", "pt"},
                     {"arch", arch_name(c.arch)},
                     {"n_layer", std::to_string(c.n_layer)},
                     {"n_embd", std::to_string(c.n_embd)},
                     {"vocab_size", std::to_string(c.vocab_size)}});
}

void import_weights(const std::string& path, const Transformer& model, float* weights) {
  auto ts = read_safetensors(path);
  for (const auto& p : model.params()) {
    auto it = ts.find(p.name);
    if (it == ts.end()) it = ts.find("transformer." + p.name);  // GPT2LMHeadModel state-dict spelling
    if (it == ts.end()) throw std::runtime_error(path + ": missing tensor " + p.name);
    from_hf(p, it->second, weights, model.config(), path);
  }
}

void save_checkpoint(const std::string& root, const Transformer& model, const float* weights, const float* exp_avg,
                     const float* exp_avg_sq, const TrainerState& st, const RunConfig& cfg) {
  fs::create_directories(root);
  char name[32];
  std::snprintf(name, sizeof name, "step_%08lld", static_cast<long long>(st.step));
  const fs::path final_dir = fs::path(root) / name;
  const fs::path tmp_dir = fs::path(root) / (std::string(".tmp-") + name);
  fs::remove_all(tmp_dir);
  fs::create_directories(tmp_dir);
  export_weights((tmp_dir / "model.safetensors").string(), model, weights);
  if (exp_avg && exp_avg_sq) {
    // Moments per parameter (internal [out, in] layout): independent of padding and sharding.
    std::map<std::string, SafeTensor> opt;
    for (const auto& p : model.params()) {
      opt.emplace("exp_avg." + p.name, flat_tensor(exp_avg + p.offset, real_numel(p, model.config())));
      opt.emplace("exp_avg_sq." + p.name, flat_tensor(exp_avg_sq + p.offset, real_numel(p, model.config())));
    }
    write_safetensors((tmp_dir / "optimizer.safetensors").string(), opt);
  }
  nlohmann::json j = {{"format_version", 1},
                      {"step", st.step},
                      {"adam_steps", st.adam_steps},
                      {"micro_batches", st.micro_batches},
                      {"num_params", model.num_params()},
                      {"has_optimizer", exp_avg != nullptr}};
  write_text_atomic(tmp_dir / "trainer.json", j.dump(2) + "\n");
  write_text_atomic(tmp_dir / "config.toml", cfg.to_toml());
  // Swap into place: an existing checkpoint of the same step is removed only after the new one is complete.
  if (fs::exists(final_dir)) {
    fs::path old = fs::path(root) / (std::string(".old-") + name);
    fs::remove_all(old);
    fs::rename(final_dir, old);
    fs::rename(tmp_dir, final_dir);
    fs::remove_all(old);
  } else {
    fs::rename(tmp_dir, final_dir);
  }
  write_text_atomic(fs::path(root) / "latest", std::string(name) + "\n");
}

std::string resolve_checkpoint(const std::string& root_or_dir) {
  fs::path p(root_or_dir);
  if (fs::exists(p / "trainer.json")) return p.string();
  if (fs::exists(p / "latest")) {
    std::string n = read_text(p / "latest");
    while (!n.empty() && (n.back() == '\n' || n.back() == ' ')) n.pop_back();
    fs::path d = p / n;
    if (!fs::exists(d / "trainer.json"))
      throw std::runtime_error((p / "latest").string() + " names " + n + ", which is not a complete checkpoint");
    return d.string();
  }
  throw std::runtime_error(root_or_dir + " is not a checkpoint (no trainer.json) nor a checkpoint directory (no latest)");
}

TrainerState load_checkpoint(const std::string& dir, const Transformer& model, float* weights, float* exp_avg,
                             float* exp_avg_sq) {
  fs::path d(dir);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(read_text(d / "trainer.json"));
  } catch (const nlohmann::json::exception& e) {
    throw std::runtime_error((d / "trainer.json").string() + ": " + e.what());
  }
  if (j.value("num_params", int64_t{-1}) != model.num_params())
    throw std::runtime_error(dir + ": checkpoint has " + std::to_string(j.value("num_params", int64_t{-1})) +
                             " parameters, the configured model has " + std::to_string(model.num_params()));
  import_weights((d / "model.safetensors").string(), model, weights);
  if (exp_avg && exp_avg_sq) {
    if (!j.value("has_optimizer", false)) throw std::runtime_error(dir + ": checkpoint has no optimizer state");
    const std::string of = (d / "optimizer.safetensors").string();
    auto ts = read_safetensors(of);
    for (auto [prefix, dst] : {std::pair<const char*, float*>{"exp_avg.", exp_avg}, {"exp_avg_sq.", exp_avg_sq}}) {
      for (const auto& p : model.params()) {
        const std::string name = prefix + p.name;
        auto it = ts.find(name);
        if (it == ts.end()) throw std::runtime_error(of + ": missing tensor " + name);
        if (it->second.shape != std::vector<int64_t>{real_numel(p, model.config())})
          throw std::runtime_error(of + ": tensor " + name + " does not match the model's parameter size");
        std::memcpy(dst + p.offset, it->second.bytes.data(), it->second.bytes.size());  // padding rows stay 0
      }
    }
  }
  TrainerState st;
  st.step = j.at("step").get<int64_t>();
  st.adam_steps = j.at("adam_steps").get<int64_t>();
  st.micro_batches = j.at("micro_batches").get<int64_t>();
  return st;
}

RunConfig load_checkpoint_config(const std::string& dir) {
  return RunConfig::load((fs::path(dir) / "config.toml").string(), {});
}

}  // namespace mt
