// Reading and writing the safetensors format (8-byte little-endian header length, a JSON header
// of name -> {dtype, shape, data_offsets}, then the raw tensor bytes).
//
// Besides whole-file helpers, a streaming writer and a random-access reader: checkpoints of
// sharded models are written and read one unit at a time, so no rank ever holds a full copy of
// the model's state for them.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace mt {

struct SafeTensor {
  std::string dtype = "F32";  // F32 | BF16 | I64 ...
  std::vector<int64_t> shape;
  std::vector<char> bytes;
};

// A tensor's entry in the header: dtype, shape and its byte range in the data section.
struct SafeTensorInfo {
  std::string dtype = "F32";
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;
  uint64_t nbytes() const { return end - begin; }
};

// Streaming writer. The header (every tensor's name, dtype and shape, in the order given; the data
// is laid out contiguously in that order) is written first; then each tensor's bytes, in any
// order, exactly once. finish() checks that every tensor was written, fsyncs and renames the
// temporary file (path + ".tmp") over `path`. Destroyed unfinished, it removes the temporary file.
class SafetensorsWriter {
 public:
  SafetensorsWriter(std::string path, const std::vector<std::pair<std::string, SafeTensorInfo>>& tensors,
                    const std::map<std::string, std::string>& metadata = {});
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;
  void write(const std::string& name, const void* data, uint64_t nbytes);
  void finish();
  // Where the data section starts (8 + header length): a tensor's bytes lie at data_start() + begin.
  uint64_t data_start() const { return data_start_; }
  const SafeTensorInfo& info(const std::string& name) const { return info_.at(name); }
  // After finish(): the file's size and CRC32C. The CRC is computed as the bytes go out, so the
  // tensors must have been written in header order (file_crc_valid() says whether they were).
  uint64_t file_bytes() const { return data_start_ + data_bytes_; }
  bool file_crc_valid() const { return crc_in_order_; }
  uint32_t file_crc32c() const { return crc_; }

 private:
  std::string path_, tmp_;
  int fd_ = -1;
  uint64_t data_start_ = 0, data_bytes_ = 0, next_begin_ = 0;
  uint32_t crc_ = 0;
  bool crc_in_order_ = true;
  std::map<std::string, SafeTensorInfo> info_;
  std::map<std::string, bool> written_;
};

// Random-access reader: parses and checks the header (every entry's dtype, shape, byte size and
// range inside the file) on construction; read() fetches one tensor's bytes. Errors name the file
// and the tensor.
class SafetensorsReader {
 public:
  explicit SafetensorsReader(std::string path);
  ~SafetensorsReader();
  SafetensorsReader(const SafetensorsReader&) = delete;
  SafetensorsReader& operator=(const SafetensorsReader&) = delete;
  const std::string& path() const { return path_; }
  const std::map<std::string, SafeTensorInfo>& tensors() const { return info_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const SafeTensorInfo* find(const std::string& name) const;
  // Copies the tensor's bytes (info.nbytes()) into dst.
  void read(const std::string& name, void* dst) const;
  uint64_t data_start() const { return data_start_; }
  uint64_t file_size() const { return size_; }
  // n bytes at absolute file offset `off` (errors name `what`).
  void read_at(uint64_t off, void* dst, uint64_t n, const std::string& what) const;

 private:
  std::string path_;
  int fd_ = -1;
  uint64_t data_start_ = 0, size_ = 0;
  std::map<std::string, SafeTensorInfo> info_;
  std::map<std::string, std::string> metadata_;
};

// Writes atomically: into path + ".tmp", fsync, then rename over path.
void write_safetensors(const std::string& path, const std::map<std::string, SafeTensor>& tensors,
                       const std::map<std::string, std::string>& metadata = {});
// Throws std::runtime_error naming the file and what is wrong (truncated, bad header, ...).
std::map<std::string, SafeTensor> read_safetensors(const std::string& path,
                                                   std::map<std::string, std::string>* metadata = nullptr);

// Flushes a directory entry to disk (after renames into it), so a completed rename survives a crash.
void fsync_directory(const std::string& dir);

}  // namespace mt
