#include "checkpoint/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>

#include "checkpoint/safetensors.h"
#include "checkpoint/sharded_checkpoint.h"
#include "runtime/crc32c.h"
#include "runtime/strings.h"

namespace fs = std::filesystem;

namespace mt {

namespace {

// The run's record in a checkpoint directory.
constexpr const char* kConfigToml = "config.toml";
constexpr const char* kHfConfig = "hf_config.json";

// Tables with one row per vocabulary entry (padded rows beyond vocab_size are never saved).
bool is_vocab_table(const ParamInfo& p) {
  return p.name == "wte.weight" || p.name == "model.embed_tokens.weight" || p.name == "lm_head.weight";
}

// Rows and columns of a parameter as saved: real vocabulary rows only.
std::pair<int64_t, int64_t> saved_rows_cols(const ParamInfo& p, const ModelConfig& cfg) {
  const int64_t rows = is_vocab_table(p) ? cfg.vocab_size : p.shape[0];
  const int64_t cols = p.shape.size() == 2 ? p.shape[1] : 1;
  return {rows, cols};
}

// Elements of a parameter without the padded vocabulary rows (those are always zero).
int64_t real_numel(const ParamInfo& p, const ModelConfig& cfg) {
  auto [rows, cols] = saved_rows_cols(p, cfg);
  return rows * cols;
}

// The shape Hugging Face stores: real vocabulary rows, Conv1D weights transposed.
std::vector<int64_t> hf_shape(const ParamInfo& p, const ModelConfig& cfg) {
  auto [rows, cols] = saved_rows_cols(p, cfg);
  if (p.hf_transposed) return {cols, rows};
  std::vector<int64_t> s = p.shape;
  s[0] = rows;
  return s;
}

// One parameter (src: its first element) into Hugging Face layout (dst: real_numel elements).
void to_hf(const ParamInfo& p, const float* src, const ModelConfig& cfg, float* dst) {
  auto [rows, cols] = saved_rows_cols(p, cfg);
  if (p.hf_transposed) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) dst[c * rows + r] = src[r * cols + c];
  } else {
    std::memcpy(dst, src, static_cast<size_t>(rows * cols) * sizeof(float));
  }
}

// The inverse; padded vocabulary rows are set to zero.
void from_hf(const ParamInfo& p, const float* src, const ModelConfig& cfg, float* dst) {
  auto [rows, cols] = saved_rows_cols(p, cfg);
  if (p.hf_transposed) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) dst[r * cols + c] = src[c * rows + r];
  } else {
    std::memcpy(dst, src, static_cast<size_t>(rows * cols) * sizeof(float));
  }
  if (rows < p.shape[0]) std::memset(dst + rows * cols, 0, static_cast<size_t>((p.shape[0] - rows) * cols) * sizeof(float));
}

std::string shape_str(const std::vector<int64_t>& s) {
  std::string o = "[";
  for (size_t i = 0; i < s.size(); ++i) o += (i ? ", " : "") + std::to_string(s[i]);
  return o + "]";
}

// Checks one tensor of a file against what the model expects; returns its entry.
const SafeTensorInfo& expect_tensor(const SafetensorsReader& r, const std::string& name,
                                    const std::vector<int64_t>& shape) {
  const SafeTensorInfo* t = r.find(name);
  if (!t) throw std::runtime_error(r.path() + ": missing tensor " + name);
  if (t->dtype != "F32") throw std::runtime_error(r.path() + ": tensor " + name + " has dtype " + t->dtype + ", expected F32");
  if (t->shape != shape)
    throw std::runtime_error(r.path() + ": tensor " + name + " has shape " + shape_str(t->shape) + ", the model expects " +
                             shape_str(shape));
  return *t;
}

std::map<std::string, std::string> weights_metadata(const ModelConfig& c) {
  return {{"format", "pt"},
          {"arch", arch_name(c.arch)},
          {"n_layer", std::to_string(c.n_layer)},
          {"n_embd", std::to_string(c.n_embd)},
          {"vocab_size", std::to_string(c.vocab_size)}};
}

std::vector<std::pair<std::string, SafeTensorInfo>> weights_header(const Transformer& model) {
  std::vector<std::pair<std::string, SafeTensorInfo>> h;
  for (const auto& p : model.params()) {
    if (!checkpoint_stores(p, model.config())) continue;
    SafeTensorInfo i;
    i.shape = hf_shape(p, model.config());
    h.emplace_back(p.name, i);
  }
  return h;
}

// Writes a small file durably: temporary file, fsync, rename over `path`.
void write_text_atomic(const fs::path& path, const std::string& text) {
  fs::path tmp = path;
  tmp += ".tmp";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw std::runtime_error("cannot write " + tmp.string() + ": " + std::strerror(errno));
  const char* p = text.data();
  size_t left = text.size();
  while (left > 0) {
    ssize_t w = ::write(fd, p, left);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      ::close(fd);
      throw std::runtime_error("error writing " + tmp.string() + ": " + std::strerror(errno));
    }
    p += w;
    left -= static_cast<size_t>(w);
  }
  const bool synced = ::fsync(fd) == 0;
  ::close(fd);
  if (!synced) throw std::runtime_error("cannot flush " + tmp.string() + ": " + std::strerror(errno));
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

// ---- writing --------------------------------------------------------------------------------------

CheckpointWriter::CheckpointWriter(const std::string& root, const Transformer& model, bool with_optimizer, int64_t step)
    : model_(model), root_(root), with_opt_(with_optimizer), unit_done_(static_cast<size_t>(model.num_units()), 0) {
  if (model.tp_size() != 1) throw std::logic_error("CheckpointWriter needs an unsplit (tp = 1) model layout");
  fs::create_directories(root);
  char name[32];
  std::snprintf(name, sizeof name, "step_%08lld", static_cast<long long>(step));
  name_ = name;
  tmp_dir_ = (fs::path(root) / (".tmp-" + name_)).string();
  fs::remove_all(tmp_dir_);
  fs::create_directories(tmp_dir_);
  weights_ = std::make_unique<SafetensorsWriter>((fs::path(tmp_dir_) / "model.safetensors").string(),
                                                 weights_header(model), weights_metadata(model.config()));
  if (with_opt_) {
    // Moments per parameter in the internal [out, in] layout: independent of padding and sharding.
    std::vector<std::pair<std::string, SafeTensorInfo>> h;
    for (const auto& p : model.params()) {
      if (!checkpoint_stores(p, model.config())) continue;
      SafeTensorInfo i;
      i.shape = {real_numel(p, model.config())};
      h.emplace_back("exp_avg." + p.name, i);
      h.emplace_back("exp_avg_sq." + p.name, i);
    }
    moments_ = std::make_unique<SafetensorsWriter>((fs::path(tmp_dir_) / "optimizer.safetensors").string(), h);
  }
}

CheckpointWriter::~CheckpointWriter() {
  weights_.reset();  // an unfinished writer removes its temporary file
  moments_.reset();
  if (!tmp_dir_.empty()) {
    std::error_code ec;
    fs::remove_all(tmp_dir_, ec);
  }
}

void CheckpointWriter::write_unit(int u, const float* w, const float* m, const float* v) {
  if (unit_done_.at(static_cast<size_t>(u))) throw std::logic_error("CheckpointWriter: unit written twice");
  const int64_t base = model_.unit(u).offset;
  for (const auto& p : model_.params()) {
    if (p.unit != u || !checkpoint_stores(p, model_.config())) continue;
    const int64_t n = real_numel(p, model_.config());
    const uint64_t bytes = static_cast<uint64_t>(n) * sizeof(float);
    scratch_.resize(static_cast<size_t>(n));
    to_hf(p, w + (p.offset - base), model_.config(), scratch_.data());
    weights_->write(p.name, scratch_.data(), bytes);
    if (with_opt_) {
      if (!m || !v) throw std::logic_error("CheckpointWriter: moments missing for a checkpoint with optimizer state");
      moments_->write("exp_avg." + p.name, m + (p.offset - base), bytes);
      moments_->write("exp_avg_sq." + p.name, v + (p.offset - base), bytes);
    }
  }
  unit_done_[static_cast<size_t>(u)] = 1;
}

void CheckpointWriter::commit(const TrainerState& st, const RunRecord& run) {
  if (model_.config().lora() && st.lora_base.is_null())
    throw std::logic_error("CheckpointWriter: a LoRA checkpoint (adapters only) needs its base's record");
  weights_->finish();
  if (moments_) moments_->finish();
  finish_checkpoint_dir(root_, tmp_dir_, name_, checkpoint_trainer_json(st, model_.num_params(), with_opt_, "full"), run);
  tmp_dir_.clear();  // committed: nothing to clean up
}

std::string checkpoint_trainer_json(const TrainerState& st, int64_t num_params, bool has_optimizer,
                                    const std::string& format) {
  nlohmann::json j = {{"format_version", format == "sharded" ? 2 : 1},
                      {"format", format},
                      {"step", st.step},
                      {"adam_steps", st.adam_steps},
                      {"micro_batches", st.micro_batches},
                      {"num_params", num_params},
                      {"has_optimizer", has_optimizer}};
  if (st.has_blend) {
    nlohmann::json ds = nlohmann::json::array();
    for (size_t d = 0; d < st.blend.patterns.size(); ++d)
      ds.push_back({{"pattern", st.blend.patterns[d]}, {"samples", st.blend.dataset_samples[d]}});
    j["data"] = {{"samples", st.blend.samples}, {"datasets", ds}};
  }
  if (!st.lora_base.is_null()) j["lora_base"] = st.lora_base;
  return j.dump(2) + "\n";
}

void write_text_file_atomic(const std::string& path, const std::string& text) { write_text_atomic(path, text); }

void finish_checkpoint_dir(const std::string& root_s, const std::string& tmp_dir, const std::string& name,
                           const std::string& trainer_json, const RunRecord& run) {
  const fs::path tmp(tmp_dir), root(root_s);
  write_text_atomic(tmp / "trainer.json", trainer_json);
  write_text_atomic(tmp / kConfigToml, run.config_toml);
  // The Hugging Face config the model came from travels with the checkpoint (sample, export and
  // resume do not depend on the original file staying where it was).
  if (!run.hf_config.empty()) write_text_atomic(tmp / kHfConfig, read_text(run.hf_config));
  fsync_directory(tmp_dir);
  // Swap into place: an existing checkpoint of the same step is removed only after the new one is complete.
  const fs::path final_dir = root / name;
  if (fs::exists(final_dir)) {
    const fs::path old = root / (".old-" + name);
    fs::remove_all(old);
    fs::rename(final_dir, old);
    fs::rename(tmp, final_dir);
    fs::remove_all(old);
  } else {
    fs::rename(tmp, final_dir);
  }
  fsync_directory(root_s);
  write_text_atomic(root / "latest", name + "\n");
  fsync_directory(root_s);
  if (run.keep > 0) prune_checkpoints(root_s, run.keep);
}

void prune_checkpoints(const std::string& root, int64_t keep) {
  // step_NNNNNNNN directories, newest first by step number; `latest` is already the newest.
  std::vector<std::pair<int64_t, fs::path>> steps;
  for (const auto& e : fs::directory_iterator(root)) {
    const std::string n = e.path().filename().string();
    if (!e.is_directory() || n.rfind("step_", 0) != 0 || n.size() <= 5) continue;
    if (n.find_first_not_of("0123456789", 5) != std::string::npos) continue;
    steps.push_back({std::stoll(n.substr(5)), e.path()});
  }
  std::sort(steps.begin(), steps.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  for (size_t i = static_cast<size_t>(std::max<int64_t>(keep, 1)); i < steps.size(); ++i) {
    std::error_code ec;
    fs::remove_all(steps[i].second, ec);
    if (ec) std::fprintf(stderr, "warning: could not remove old checkpoint %s: %s\n", steps[i].second.c_str(),
                         ec.message().c_str());
  }
}

// ---- reading --------------------------------------------------------------------------------------

TrainerState read_trainer_state(const std::string& dir, nlohmann::json* whole) {
  const fs::path d(dir);
  TrainerState st;
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(read_text(d / "trainer.json"));
    // Integers only: nlohmann converts a floating-point value to an integer type with a cast that
    // is undefined out of range.
    auto integer = [](const nlohmann::json& v, const char* key) {
      if (!v.is_number_integer()) throw std::runtime_error(std::string(key) + " must be an integer");
      return v.get<int64_t>();
    };
    st.step = integer(j.at("step"), "step");
    st.adam_steps = integer(j.at("adam_steps"), "adam_steps");
    st.micro_batches = integer(j.at("micro_batches"), "micro_batches");
    if (j.contains("has_optimizer") && !j.at("has_optimizer").is_boolean())  // read by CheckpointReader
      throw std::runtime_error("has_optimizer is not true or false");
    if (j.contains("data")) {
      const auto& dj = j.at("data");
      st.has_blend = true;
      st.blend.samples = integer(dj.at("samples"), "data.samples");
      for (const auto& e : dj.at("datasets")) {
        st.blend.patterns.push_back(e.at("pattern").get<std::string>());
        st.blend.dataset_samples.push_back(integer(e.at("samples"), "data.datasets samples"));
      }
    }
    if (j.contains("lora_base")) {
      const auto& lb = j.at("lora_base");
      if (!lb.at("init_from").is_string()) throw std::runtime_error("lora_base.init_from must be a string");
      integer(lb.at("seed"), "lora_base.seed");
      integer(lb.at("crc32c"), "lora_base.crc32c");
      st.lora_base = lb;
    }
  } catch (const nlohmann::json::exception& e) {
    throw std::runtime_error((d / "trainer.json").string() + ": " + json_error_text(e.what()));
  } catch (const std::runtime_error& e) {
    throw std::runtime_error((d / "trainer.json").string() + ": " + e.what());
  }
  if (whole) *whole = j;
  return st;
}

bool checkpoint_stores(const ParamInfo& p, const ModelConfig& c) { return !c.lora() || p.trainable; }

uint32_t lora_base_unit_crc(const Transformer& ref, int u, const float* unit_w) {
  uint32_t crc = 0;
  for (const ParamInfo& p : ref.params())
    if (p.unit == u && !p.trainable)
      crc = crc32c(crc, unit_w + (p.offset - ref.unit(u).offset),
                   static_cast<size_t>(real_numel(p, ref.config())) * sizeof(float));
  return crc;
}

uint32_t lora_base_fingerprint(const std::vector<uint32_t>& unit_crcs) {
  return crc32c(0, unit_crcs.data(), unit_crcs.size() * sizeof(uint32_t));
}

std::string lora_base_text(const LoraBaseSource& s) {
  return s.init_from.empty() ? "the seed " + std::to_string(s.seed) + " initialisation" : "train.init_from " + s.init_from;
}

// The frozen base of a LoRA model (`ref`, with adapters) from its source: a base model file or
// checkpoint read with the layout without adapters (parameters matched by name), or the seed's
// initial weights of the whole model (which are the base's: LoRA leaves them as without it).
class LoraBase {
 public:
  LoraBase(const Transformer& ref, const LoraBaseSource& src) : ref_(ref) {
    if (src.init_from.empty()) {
      seed_w_.assign(static_cast<size_t>(ref.flat_size()), 0.0f);
      ref.init_weights_into(static_cast<uint64_t>(src.seed), seed_w_.data());
      return;
    }
    ModelConfig bc = ref.config();
    bc.lora_rank = 0;
    bc.lora_targets = 0;
    layout_ = std::make_unique<Transformer>(bc, ModelOptions{.storage = {.weights = false, .master = false, .grads = false}});
    for (size_t i = 0; i < layout_->params().size(); ++i) index_[layout_->params()[i].name] = i;
    if (fs::is_directory(src.init_from))
      reader_ = std::make_unique<CheckpointReader>(resolve_checkpoint(src.init_from), *layout_, false);
    else
      reader_ = std::make_unique<CheckpointReader>(*layout_, src.init_from);
  }
  // Unit u's frozen parameters into unit_w (ref's layout, the unit's first element); the rest is untouched.
  void fill_unit(int u, float* unit_w) const {
    if (!reader_) {
      for (const ParamInfo& p : ref_.params())
        if (p.unit == u && !p.trainable)
          std::memcpy(unit_w + (p.offset - ref_.unit(u).offset), seed_w_.data() + p.offset,
                      static_cast<size_t>(p.numel) * sizeof(float));
      return;
    }
    std::vector<float> base(static_cast<size_t>(layout_->unit(u).numel));
    reader_->read_unit(u, base.data(), nullptr, nullptr);
    for (const ParamInfo& p : layout_->params()) {
      if (p.unit != u) continue;
      const ParamInfo& q = ref_.param(p.name);
      std::memcpy(unit_w + (q.offset - ref_.unit(u).offset), base.data() + (p.offset - layout_->unit(u).offset),
                  static_cast<size_t>(p.numel) * sizeof(float));
    }
  }
  // Frozen parameter i of ref in Hugging Face layout.
  void read_param_hf(size_t i, float* dst) const {
    const ParamInfo& p = ref_.params().at(i);
    if (reader_)
      reader_->read_param_hf(index_.at(p.name), dst);
    else
      to_hf(p, seed_w_.data() + p.offset, ref_.config(), dst);
  }
  uint32_t fingerprint() const {
    std::vector<uint32_t> crcs;
    std::vector<float> w;
    for (int u = 0; u < ref_.num_units(); ++u) {
      w.assign(static_cast<size_t>(ref_.unit(u).numel), 0.0f);
      fill_unit(u, w.data());
      crcs.push_back(lora_base_unit_crc(ref_, u, w.data()));
    }
    return lora_base_fingerprint(crcs);
  }

 private:
  const Transformer& ref_;
  std::unique_ptr<Transformer> layout_;
  std::unique_ptr<CheckpointReader> reader_;
  std::map<std::string, size_t> index_;
  std::vector<float> seed_w_;
};

CheckpointReader::CheckpointReader(const std::string& dir, const Transformer& model, bool with_optimizer,
                                   const LoraBaseSource* base)
    : model_(model), dir_(dir) {
  if (model.tp_size() != 1) throw std::logic_error("CheckpointReader needs an unsplit (tp = 1) model layout");
  const fs::path d(dir);
  nlohmann::json j;
  st_ = read_trainer_state(dir, &j);
  if (!j.value("has_optimizer", false) && with_optimizer) throw std::runtime_error(dir + ": checkpoint has no optimizer state");
  adapters_only_ = model.config().lora() && !st_.lora_base.is_null();
  if (adapters_only_) {
    const LoraBaseSource rec{st_.lora_base.at("init_from").get<std::string>(), st_.lora_base.at("seed").get<int64_t>()};
    const auto want = static_cast<uint32_t>(st_.lora_base.at("crc32c").get<int64_t>());
    const LoraBaseSource src = base ? *base : rec;
    auto hex = [](uint32_t v) {
      char b[16];
      std::snprintf(b, sizeof b, "%08x", v);
      return std::string(b);
    };
    const std::string trained = dir + " holds LoRA adapters only, trained on " + lora_base_text(rec) +
                                " (base crc32c " + hex(want) + ")";
    const std::string use = rec.init_from.empty() ? "train.seed " + std::to_string(rec.seed) + " and no train.init_from"
                                                  : "train.init_from " + rec.init_from;
    if (!src.init_from.empty() && !fs::exists(src.init_from))
      throw CheckpointBaseMismatch(trained + ", and the base " + src.init_from + " does not exist: " +
                                   (base ? "resume with " + use : "put that base model back at its path"));
    base_ = std::make_unique<LoraBase>(model, src);
    const uint32_t got = base_->fingerprint();
    if (got != want) {
      if (base)
        throw CheckpointBaseMismatch(trained + ", and this run's base is " + lora_base_text(src) + " (base crc32c " +
                                     hex(got) + "): resume with " + use + ", or start a new run on this base without train.resume");
      throw CheckpointBaseMismatch(trained + ", which now holds other weights (base crc32c " + hex(got) +
                                   "): put that base model back at its path");
    }
  }
  if (ShardedCheckpoint::is_sharded(dir)) {
    sharded_ = std::make_unique<ShardedCheckpoint>(dir);
    sharded_->check_model(model, with_optimizer, adapters_only_);
    const std::string err = sharded_->check_files(0, 1, true);
    if (!err.empty()) throw std::runtime_error(err);
    sharded_moments_ = with_optimizer;
    return;
  }
  if (j.value("num_params", int64_t{-1}) != model.num_params())
    throw CheckpointModelMismatch(dir + ": checkpoint has " + std::to_string(j.value("num_params", int64_t{-1})) +
                                  " parameters, the configured model has " + std::to_string(model.num_params()));
  open_weights((d / "model.safetensors").string());
  if (with_optimizer) {
    moments_ = std::make_unique<SafetensorsReader>((d / "optimizer.safetensors").string());
    for (const auto& p : model.params())
      if (!adapters_only_ || p.trainable)
        for (const char* prefix : {"exp_avg.", "exp_avg_sq."})
        expect_tensor(*moments_, prefix + p.name, {real_numel(p, model.config())});
  }
}

CheckpointReader::CheckpointReader(const Transformer& model, const std::string& weights_file)
    : model_(model), dir_(weights_file) {
  if (model.tp_size() != 1) throw std::logic_error("CheckpointReader needs an unsplit (tp = 1) model layout");
  open_weights(weights_file);
}

void CheckpointReader::open_weights(const std::string& file) {
  weights_ = std::make_unique<SafetensorsReader>(file);
  for (const auto& p : model_.params()) {
    if (adapters_only_ && !p.trainable) {  // from the base
      weight_names_.emplace_back();
      continue;
    }
    std::string name = p.name;
    if (!weights_->find(name) && weights_->find("transformer." + name)) name = "transformer." + name;  // GPT2LMHeadModel spelling
    expect_tensor(*weights_, name, hf_shape(p, model_.config()));
    weight_names_.push_back(name);
  }
}

CheckpointReader::~CheckpointReader() = default;

void CheckpointReader::read_unit(int u, float* w, float* m, float* v) const {
  const UnitRange& ur = model_.unit(u);
  std::memset(w, 0, static_cast<size_t>(ur.numel) * sizeof(float));
  const bool moments = has_moments() && m && v;
  if (moments) {
    std::memset(m, 0, static_cast<size_t>(ur.numel) * sizeof(float));
    std::memset(v, 0, static_cast<size_t>(ur.numel) * sizeof(float));
  }
  if (base_) base_->fill_unit(u, w);  // adapters only: the base's parameters (moments zero: frozen)
  std::vector<float> tmp;
  for (size_t i = 0; i < model_.params().size(); ++i) {
    const ParamInfo& p = model_.params()[i];
    if (p.unit != u || (adapters_only_ && !p.trainable)) continue;
    if (sharded_) {  // the engine's layout: row-major real rows, padding rows stay zero
      auto [rows, cols] = saved_rows_cols(p, model_.config());
      float* dst[3] = {w, m, v};
      for (int k = 0; k < (moments ? 3 : 1); ++k)
        sharded_->read_box(logical_name(p, k), Box{0, rows, 0, cols}, dst[k] + (p.offset - ur.offset));
      continue;
    }
    tmp.resize(static_cast<size_t>(real_numel(p, model_.config())));
    weights_->read(weight_names_[i], tmp.data());
    from_hf(p, tmp.data(), model_.config(), w + (p.offset - ur.offset));
    if (moments) {  // padding rows stay zero
      moments_->read("exp_avg." + p.name, m + (p.offset - ur.offset));
      moments_->read("exp_avg_sq." + p.name, v + (p.offset - ur.offset));
    }
  }
}

void CheckpointReader::read_param_hf(size_t i, float* dst) const {
  const ParamInfo& p = model_.params().at(i);
  if (adapters_only_ && !p.trainable) {
    base_->read_param_hf(i, dst);
    return;
  }
  if (!sharded_) {
    weights_->read(weight_names_[i], dst);
    return;
  }
  auto [rows, cols] = saved_rows_cols(p, model_.config());
  std::vector<float> tmp(static_cast<size_t>(rows * cols));
  sharded_->read_box(logical_name(p, 0), Box{0, rows, 0, cols}, tmp.data());
  to_hf(p, tmp.data(), model_.config(), dst);
}

std::vector<int64_t> hf_param_shape(const ParamInfo& p, const ModelConfig& cfg) { return hf_shape(p, cfg); }

// ---- whole-model helpers --------------------------------------------------------------------------

namespace {
// Every unit of `model` from `r` into full flat buffers (m / v null: weights only); anything
// between units stays zero.
void read_all_units(const CheckpointReader& r, const Transformer& model, float* w, float* m, float* v) {
  const size_t bytes = static_cast<size_t>(model.flat_size()) * sizeof(float);
  for (float* p : {w, m, v})
    if (p) std::memset(p, 0, bytes);
  for (int u = 0; u < model.num_units(); ++u) {
    const int64_t o = model.unit(u).offset;
    r.read_unit(u, w + o, m ? m + o : nullptr, v ? v + o : nullptr);
  }
}
}  // namespace

void import_weights(const std::string& path, const Transformer& model, float* weights) {
  read_all_units(CheckpointReader(model, path), model, weights, nullptr, nullptr);
}

void save_checkpoint(const std::string& root, const Transformer& model, const float* weights, const float* exp_avg,
                     const float* exp_avg_sq, const TrainerState& st, const RunRecord& run) {
  const bool opt = exp_avg && exp_avg_sq;
  CheckpointWriter w(root, model, opt, st.step);
  for (int u = 0; u < model.num_units(); ++u) {
    const int64_t o = model.unit(u).offset;
    w.write_unit(u, weights + o, opt ? exp_avg + o : nullptr, opt ? exp_avg_sq + o : nullptr);
  }
  w.commit(st, run);
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
  const bool opt = exp_avg && exp_avg_sq;
  CheckpointReader r(dir, model, opt);
  read_all_units(r, model, weights, opt ? exp_avg : nullptr, opt ? exp_avg_sq : nullptr);
  return r.state();
}

std::string checkpoint_config_toml(const std::string& dir) { return (fs::path(dir) / kConfigToml).string(); }

std::string checkpoint_hf_config(const std::string& dir) {
  const fs::path p = fs::path(dir) / kHfConfig;
  return fs::exists(p) ? p.string() : std::string();
}

}  // namespace mt
