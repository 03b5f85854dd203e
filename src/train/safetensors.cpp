#include "train/safetensors.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>

namespace mt {

static size_t dtype_bytes(const std::string& d) {
  if (d == "F32" || d == "I32") return 4;
  if (d == "BF16" || d == "F16" || d == "I16") return 2;
  if (d == "F64" || d == "I64") return 8;
  if (d == "U8" || d == "I8" || d == "BOOL") return 1;
  return 0;
}

void write_safetensors(const std::string& path, const std::map<std::string, SafeTensor>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json h;
  if (!metadata.empty()) h["__metadata__"] = metadata;
  uint64_t off = 0;
  for (const auto& [name, t] : tensors) {
    h[name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {off, off + t.bytes.size()}}};
    off += t.bytes.size();
  }
  std::string hs = h.dump();
  while (hs.size() % 8) hs.push_back(' ');
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    if (!f) throw std::runtime_error("cannot write " + tmp);
    uint64_t n = hs.size();
    f.write(reinterpret_cast<const char*>(&n), 8);
    f.write(hs.data(), static_cast<std::streamsize>(hs.size()));
    for (const auto& kv : tensors) f.write(kv.second.bytes.data(), static_cast<std::streamsize>(kv.second.bytes.size()));
    f.flush();
    if (!f) throw std::runtime_error("error writing " + tmp + " (disk full?)");
  }
  int fd = ::open(tmp.c_str(), O_RDONLY);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) throw std::runtime_error("cannot rename " + tmp + " to " + path);
}

std::map<std::string, SafeTensor> read_safetensors(const std::string& path, std::map<std::string, std::string>* metadata) {
  std::ifstream f(path, std::ios::binary | std::ios::ate);
  if (!f) throw std::runtime_error(path + ": cannot open");
  const uint64_t size = static_cast<uint64_t>(f.tellg());
  f.seekg(0);
  uint64_t n = 0;
  if (size < 8 || !f.read(reinterpret_cast<char*>(&n), 8)) throw std::runtime_error(path + ": truncated (no header)");
  if (n > size - 8) throw std::runtime_error(path + ": header length " + std::to_string(n) + " exceeds file size");
  std::string hs(n, '\0');
  f.read(hs.data(), static_cast<std::streamsize>(n));
  nlohmann::json h;
  try {
    h = nlohmann::json::parse(hs);
  } catch (const std::exception& e) {
    throw std::runtime_error(path + ": bad safetensors header: " + e.what());
  }
  const uint64_t data_start = 8 + n, data_size = size - data_start;
  std::map<std::string, SafeTensor> out;
  for (auto it = h.begin(); it != h.end(); ++it) {
    if (it.key() == "__metadata__") {
      if (metadata)
        for (auto m = it->begin(); m != it->end(); ++m) (*metadata)[m.key()] = m->get<std::string>();
      continue;
    }
    SafeTensor t;
    try {
      t.dtype = it->at("dtype").get<std::string>();
      t.shape = it->at("shape").get<std::vector<int64_t>>();
      auto offs = it->at("data_offsets").get<std::vector<uint64_t>>();
      if (offs.size() != 2 || offs[1] < offs[0] || offs[1] > data_size)
        throw std::runtime_error("data_offsets outside the file (truncated?)");
      int64_t numel = 1;
      for (auto d : t.shape) numel *= d;
      size_t eb = dtype_bytes(t.dtype);
      if (eb == 0) throw std::runtime_error("unsupported dtype " + t.dtype);
      if (offs[1] - offs[0] != static_cast<uint64_t>(numel) * eb)
        throw std::runtime_error("byte size does not match its shape");
      t.bytes.resize(offs[1] - offs[0]);
      f.seekg(static_cast<std::streamoff>(data_start + offs[0]));
      if (!f.read(t.bytes.data(), static_cast<std::streamsize>(t.bytes.size())))
        throw std::runtime_error("truncated data");
    } catch (const std::runtime_error& e) {
      throw std::runtime_error(path + ": tensor " + it.key() + ": " + e.what());
    } catch (const std::exception& e) {
      throw std::runtime_error(path + ": tensor " + it.key() + ": malformed entry (" + e.what() + ")");
    }
    out.emplace(it.key(), std::move(t));
  }
  return out;
}

}  // namespace mt
