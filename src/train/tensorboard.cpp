#include "train/tensorboard.h"

#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <stdexcept>

#include "runtime/crc32c.h"

namespace mt {

namespace {

// Protocol-buffer wire format: varints, tags, fixed-width numbers and length-delimited fields.
void put_varint(std::string& s, uint64_t v) {
  while (v >= 0x80) {
    s.push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  s.push_back(static_cast<char>(v));
}
void put_tag(std::string& s, int field, int wire) { put_varint(s, (static_cast<uint64_t>(field) << 3) | wire); }
void put_bytes(std::string& s, int field, const std::string& v) {
  put_tag(s, field, 2);
  put_varint(s, v.size());
  s += v;
}
template <class T>
void put_fixed(std::string& s, int field, T v) {
  put_tag(s, field, sizeof(T) == 8 ? 1 : 5);
  char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));  // x86-64 and aarch64 are little-endian, as the format is
  s.append(b, sizeof(T));
}

double wall_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// Event { wall_time = 1 (double); step = 2 (int64); file_version = 3; summary = 5 }.
std::string event(int64_t step, const std::string* file_version, const std::string* summary) {
  std::string e;
  put_fixed(e, 1, wall_seconds());
  put_tag(e, 2, 0);
  put_varint(e, static_cast<uint64_t>(step));
  if (file_version) put_bytes(e, 3, *file_version);
  if (summary) put_bytes(e, 5, *summary);
  return e;
}

// Summary.Value { tag = 1; simple_value = 2 (float) }.
std::string scalar_value(const std::string& tag, double value) {
  std::string v;
  put_bytes(v, 1, tag);
  put_fixed(v, 2, static_cast<float>(value));
  return v;
}

void flatten(const nlohmann::json& j, const std::string& prefix, std::vector<std::pair<std::string, double>>& out) {
  for (const auto& [k, v] : j.items()) {
    if (k == "step" || v.is_boolean()) continue;
    if (v.is_number()) out.emplace_back(prefix + k, v.get<double>());
    if (v.is_object()) flatten(v, prefix + k + "/", out);
  }
}

}  // namespace

uint32_t tfrecord_masked_crc(const void* data, size_t n) {
  const uint32_t c = crc32c(0, data, n);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

std::string tfrecord(const std::string& payload) {
  std::string r;
  const uint64_t len = payload.size();
  char b[8];
  std::memcpy(b, &len, 8);
  r.append(b, 8);
  uint32_t crc = tfrecord_masked_crc(b, 8);
  std::memcpy(b, &crc, 4);
  r.append(b, 4);
  r += payload;
  crc = tfrecord_masked_crc(payload.data(), payload.size());
  std::memcpy(b, &crc, 4);
  r.append(b, 4);
  return r;
}

TensorBoardWriter::TensorBoardWriter(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  char host[256] = "localhost";
  gethostname(host, sizeof host - 1);
  path_ = dir + "/events.out.tfevents." + std::to_string(static_cast<long long>(wall_seconds())) + "." + host + "." +
          std::to_string(getpid());
  out_.open(path_, std::ios::binary | std::ios::trunc);
  if (!out_) throw std::runtime_error("log.tensorboard_dir: cannot create an event file in " + dir);
  const std::string version = "brain.Event:2";
  out_ << tfrecord(event(0, &version, nullptr));
  out_.flush();
}

void TensorBoardWriter::write_event(int64_t step, const std::string& summary_value) {
  std::string summary;  // Summary { repeated Value value = 1 }
  put_bytes(summary, 1, summary_value);
  out_ << tfrecord(event(step, nullptr, &summary));
}

void TensorBoardWriter::scalar(const std::string& tag, int64_t step, double value) {
  write_event(step, scalar_value(tag, value));
  out_.flush();
}

void TensorBoardWriter::scalars(int64_t step, const nlohmann::json& record, const std::string& prefix) {
  std::vector<std::pair<std::string, double>> values;
  flatten(record, prefix, values);
  for (const auto& [tag, value] : values) write_event(step, scalar_value(tag, value));
  out_.flush();  // once per record: TensorBoard sees whole steps
}

void TensorBoardWriter::text(const std::string& tag, const std::string& body, int64_t step) {
  std::string md;
  size_t start = 0;
  while (start < body.size()) {
    size_t end = body.find('\n', start);
    if (end == std::string::npos) end = body.size();
    md += "    " + body.substr(start, end - start) + "\n";
    start = end + 1;
  }
  std::string plugin, meta, shape, tensor, v;
  put_bytes(plugin, 1, "text");  // PluginData { plugin_name = 1 }
  put_bytes(meta, 1, plugin);    // SummaryMetadata { plugin_data = 1 }
  put_tag(tensor, 1, 0);         // TensorProto { dtype = 1 (DT_STRING = 7); tensor_shape = 2; string_val = 8 }
  put_varint(tensor, 7);
  put_bytes(tensor, 2, shape);
  put_bytes(tensor, 8, md);
  put_bytes(v, 1, tag);  // Value { tag = 1; tensor = 8; metadata = 9 }
  put_bytes(v, 8, tensor);
  put_bytes(v, 9, meta);
  write_event(step, v);
  out_.flush();
}

}  // namespace mt
