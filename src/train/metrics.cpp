#include "train/metrics.h"

#include <cmath>
#include <cstdio>
#include <stdexcept>

#include "train/tensorboard.h"

namespace mt {

MetricsWriter::MetricsWriter(const std::string& path) {
  if (path.empty()) return;
  out_.open(path, std::ios::trunc);
  if (!out_) throw std::runtime_error("log.metrics_out: cannot open " + path + " for writing");
}

MetricsWriter::~MetricsWriter() = default;

void MetricsWriter::attach_tensorboard(const std::string& dir, const std::string& config_text) {
  if (dir.empty()) return;
  tb_ = std::make_unique<TensorBoardWriter>(dir);
  tb_->text("config", config_text);
}

void MetricsWriter::step(const StepMetrics& m) {
  if (!out_.is_open() && !tb_) return;
  nlohmann::json j = {{"step", m.step},
                      {"loss", m.loss},
                      {"lr", m.lr},
                      {"tokens_per_s", m.tokens_per_s},
                      {"step_ms", m.step_ms},
                      {"compute_ms", m.compute_ms},
                      {"mfu", m.mfu ? nlohmann::json(*m.mfu) : nlohmann::json(nullptr)},
                      {"mem_peak_bytes", m.mem_peak_bytes},
                      {"comm_ms", m.comm_ms},
                      {"exposed_comm_ms", m.exposed_comm_ms},
                      {"grad_norm", m.grad_norm}};
  if (m.data_wait_ms) j["data_wait_ms"] = *m.data_wait_ms;
  if (m.stragglers.is_object())
    for (const auto& [k, v] : m.stragglers.items()) j[k] = v;
  if (m.val_loss) j["val_loss"] = *m.val_loss;
  if (m.val_bits_per_byte) j["val_bits_per_byte"] = *m.val_bits_per_byte;
  if (m.pp_bubble) j["pp_bubble"] = *m.pp_bubble;
  if (m.pp_bubble_formula) j["pp_bubble_formula"] = *m.pp_bubble_formula;
  if (m.pp_idle_ms) j["pp_idle_ms"] = *m.pp_idle_ms;
  if (!m.data_tokens_by_dataset.is_null()) j["data_tokens_by_dataset"] = m.data_tokens_by_dataset;
  if (m.trained_tokens) j["trained_tokens"] = *m.trained_tokens;
  if (m.padding_share) j["padding_share"] = *m.padding_share;
  if (m.moe.is_object())
    for (const auto& [k, v] : m.moe.items()) j[k] = v;
  last_step_ = m.step;
  if (tb_) tb_->scalars(m.step, j);
  if (!out_.is_open()) return;
  out_ << j.dump() << "\n";
  out_.flush();
}

void MetricsWriter::final(const nlohmann::json& obj) {
  if (tb_) tb_->scalars(last_step_, obj, "final/");
  if (!out_.is_open()) return;
  out_ << obj.dump() << "\n";
  out_.flush();
}

std::string progress_line(const StepMetrics& m, int64_t total_steps) {
  char buf[512];
  char mfu[32] = "";
  if (m.mfu) std::snprintf(mfu, sizeof mfu, " | mfu %.1f%%", *m.mfu * 100.0);
  char val[64] = "";
  if (m.val_loss) std::snprintf(val, sizeof val, " | val %.4f%s", *m.val_loss, bits_per_byte_note(m.val_bits_per_byte).c_str());
  char bubble[48] = "";
  if (m.pp_bubble) std::snprintf(bubble, sizeof bubble, " | bubble %.0f%%", *m.pp_bubble * 100.0);
  char moe[64] = "";
  if (m.moe.is_object())
    std::snprintf(moe, sizeof moe, " | experts max/mean %.2f aux %.3f", m.moe.value("expert_imbalance", 0.0),
                  m.moe.value("moe_aux_loss", 0.0));
  std::snprintf(buf, sizeof buf,
                "step %5lld/%lld | loss %.4f%s | lr %.2e | norm %.3f | %8.0f tok/s | %7.1f ms%s | comm %.1f ms "
                "(exposed %.1f)%s%s | peak %s",
                static_cast<long long>(m.step), static_cast<long long>(total_steps), m.loss, val, m.lr, m.grad_norm,
                m.tokens_per_s, m.step_ms, mfu, m.comm_ms, m.exposed_comm_ms, bubble, moe,
                format_bytes(m.mem_peak_bytes).c_str());
  return buf;
}

std::optional<double> bits_per_byte(double nats_per_token, double bytes_per_token) {
  if (!(bytes_per_token > 0)) return std::nullopt;
  return nats_per_token / std::log(2.0) / bytes_per_token;
}

std::string bits_per_byte_note(const std::optional<double>& bpb) {
  if (!bpb) return "";
  char buf[48];
  std::snprintf(buf, sizeof buf, " (%.3f bits/byte)", *bpb);
  return buf;
}

std::string no_bits_per_byte_note(const std::string& val_spec) {
  return "note: validation in nats per token only, not bits per byte: " + val_spec +
         " does not record how many bytes of text its tokens stand for (shards from llm.c, an older meshtrain or a "
         "blend); run `meshtrain prepare` on the text again to get bits per byte";
}

nlohmann::json category_json(const std::array<int64_t, kNumMemCategories>& v) {
  nlohmann::json j = nlohmann::json::object();
  for (int i = 0; i < kNumMemCategories; ++i) j[mem_category_name(static_cast<MemCategory>(i))] = v[i];
  return j;
}

}  // namespace mt
