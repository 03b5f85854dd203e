// TensorBoard event files written by the engine itself (log.tensorboard_dir): the TFRecord framing
// (little-endian length, masked CRC32C of the length, payload, masked CRC32C of the payload) around
// hand-encoded `Event` protocol buffers. Scalars are `simple_value` summaries; text is a string
// tensor tagged for TensorBoard's text plugin.
#pragma once
#include <cstdint>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

namespace mt {

class TensorBoardWriter {
 public:
  // Creates `dir` (and its parents) and a new events.out.tfevents.<seconds>.<host>.<pid> file in it,
  // starting with the file-version record. Throws std::runtime_error naming the directory.
  explicit TensorBoardWriter(const std::string& dir);
  // One scalar per number of `record` at `step`, tagged with its key; members of nested objects are
  // tagged "key/member". Booleans, strings, arrays and the key "step" are skipped. `prefix` (e.g.
  // "final/") goes before every tag.
  void scalars(int64_t step, const nlohmann::json& record, const std::string& prefix = "");
  void scalar(const std::string& tag, int64_t step, double value);
  // Text shown by TensorBoard's text plugin (markdown; each line is indented so it shows verbatim).
  void text(const std::string& tag, const std::string& body, int64_t step = 0);
  const std::string& path() const { return path_; }

 private:
  void write_event(int64_t step, const std::string& summary_value);
  std::string path_;
  std::ofstream out_;
};

// The masked CRC32C TFRecord uses: ((crc >> 15) | (crc << 17)) + 0xa282ead8.
uint32_t tfrecord_masked_crc(const void* data, size_t n);
// One TFRecord: framing around `payload`.
std::string tfrecord(const std::string& payload);

}  // namespace mt
