// Reading and writing the safetensors format (8-byte little-endian header length, a JSON header
// of name -> {dtype, shape, data_offsets}, then the raw tensor bytes).
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace mt {

struct SafeTensor {
  std::string dtype = "F32";  // F32 | BF16 | I64 ...
  std::vector<int64_t> shape;
  std::vector<char> bytes;
};

// Writes atomically: into path + ".tmp", fsync, then rename over path.
void write_safetensors(const std::string& path, const std::map<std::string, SafeTensor>& tensors,
                       const std::map<std::string, std::string>& metadata = {});
// Throws std::runtime_error naming the file and what is wrong (truncated, bad header, ...).
std::map<std::string, SafeTensor> read_safetensors(const std::string& path,
                                                   std::map<std::string, std::string>* metadata = nullptr);

}  // namespace mt
