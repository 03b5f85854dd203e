#include "checkpoint/safetensors.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "runtime/crc32c.h"
#include "runtime/strings.h"

namespace mt {

namespace {

size_t dtype_bytes(const std::string& d) {
  if (d == "F32" || d == "I32") return 4;
  if (d == "BF16" || d == "F16" || d == "I16") return 2;
  if (d == "F64" || d == "I64") return 8;
  if (d == "U8" || d == "I8" || d == "BOOL") return 1;
  return 0;
}

uint64_t shape_numel(const std::vector<int64_t>& shape) {
  uint64_t n = 1;
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

// pwrite / pread of a whole range (they may transfer less than asked).
void write_all(int fd, const void* data, uint64_t n, uint64_t off, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t w = ::pwrite(fd, p, n, static_cast<off_t>(off));
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) throw std::runtime_error("error writing " + path + ": " + std::strerror(errno) + " (disk full?)");
    p += w;
    n -= static_cast<uint64_t>(w);
    off += static_cast<uint64_t>(w);
  }
}

void read_all(int fd, void* data, uint64_t n, uint64_t off, const std::string& what) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    ssize_t r = ::pread(fd, p, n, static_cast<off_t>(off));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) throw std::runtime_error(what + ": read error: " + std::strerror(errno));
    if (r == 0) throw std::runtime_error(what + ": truncated data");
    p += r;
    n -= static_cast<uint64_t>(r);
    off += static_cast<uint64_t>(r);
  }
}

}  // namespace

// ---- writer ---------------------------------------------------------------------------------------

SafetensorsWriter::SafetensorsWriter(std::string path, const std::vector<std::pair<std::string, SafeTensorInfo>>& tensors,
                                     const std::map<std::string, std::string>& metadata)
    : path_(std::move(path)), tmp_(path_ + ".tmp") {
  nlohmann::ordered_json h;
  if (!metadata.empty()) h["__metadata__"] = metadata;
  uint64_t off = 0;
  for (const auto& [name, t] : tensors) {
    const size_t eb = dtype_bytes(t.dtype);
    if (eb == 0) throw std::invalid_argument(path_ + ": tensor " + name + ": unsupported dtype " + t.dtype);
    if (info_.count(name)) throw std::invalid_argument(path_ + ": tensor " + name + " listed twice");
    SafeTensorInfo i = t;
    i.begin = off;
    i.end = off + shape_numel(t.shape) * eb;
    off = i.end;
    h[name] = {{"dtype", i.dtype}, {"shape", i.shape}, {"data_offsets", {i.begin, i.end}}};
    info_.emplace(name, i);
    written_.emplace(name, false);
  }
  std::string hs = h.dump();
  while (hs.size() % 8) hs.push_back(' ');
  fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) throw std::runtime_error("cannot write " + tmp_ + ": " + std::strerror(errno));
  const uint64_t n = hs.size();
  write_all(fd_, &n, 8, 0, tmp_);
  write_all(fd_, hs.data(), n, 8, tmp_);
  data_start_ = 8 + n;
  data_bytes_ = off;
  crc_ = crc32c(crc32c(0, &n, 8), hs.data(), n);
}

SafetensorsWriter::~SafetensorsWriter() {
  if (fd_ >= 0) {
    ::close(fd_);
    std::remove(tmp_.c_str());
  }
}

void SafetensorsWriter::write(const std::string& name, const void* data, uint64_t nbytes) {
  auto it = info_.find(name);
  if (it == info_.end()) throw std::logic_error(path_ + ": tensor " + name + " is not in the header");
  if (nbytes != it->second.nbytes())
    throw std::logic_error(path_ + ": tensor " + name + ": " + std::to_string(nbytes) + " bytes given, header says " +
                           std::to_string(it->second.nbytes()));
  if (written_[name]) throw std::logic_error(path_ + ": tensor " + name + " written twice");
  write_all(fd_, data, nbytes, data_start_ + it->second.begin, tmp_);
  written_[name] = true;
  if (it->second.begin == next_begin_ && crc_in_order_) {
    crc_ = crc32c(crc_, data, nbytes);
    next_begin_ = it->second.end;
  } else {
    crc_in_order_ = false;
  }
}

void SafetensorsWriter::finish() {
  for (const auto& [name, done] : written_)
    if (!done) throw std::logic_error(path_ + ": tensor " + name + " was never written");
  if (::fsync(fd_) != 0) throw std::runtime_error("cannot flush " + tmp_ + ": " + std::strerror(errno));
  ::close(fd_);
  fd_ = -1;
  if (std::rename(tmp_.c_str(), path_.c_str()) != 0) {
    std::remove(tmp_.c_str());
    throw std::runtime_error("cannot rename " + tmp_ + " to " + path_);
  }
}

// ---- reader ---------------------------------------------------------------------------------------

SafetensorsReader::SafetensorsReader(std::string path) : path_(std::move(path)) {
  fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) throw std::runtime_error(path_ + ": cannot open");
  const off_t end = ::lseek(fd_, 0, SEEK_END);
  const uint64_t size = end < 0 ? 0 : static_cast<uint64_t>(end);
  size_ = size;
  uint64_t n = 0;
  if (size < 8) {
    ::close(fd_);
    throw std::runtime_error(path_ + ": truncated (no header)");
  }
  try {
    read_all(fd_, &n, 8, 0, path_);
    if (n > size - 8) throw std::runtime_error(path_ + ": header length " + std::to_string(n) + " exceeds file size");
    std::string hs(n, '\0');
    read_all(fd_, hs.data(), n, 8, path_);
    nlohmann::json h;
    try {
      h = nlohmann::json::parse(hs);
    } catch (const std::exception& e) {
      throw std::runtime_error(path_ + ": bad safetensors header: " + json_error_text(e.what()));
    }
    if (!h.is_object())
      throw std::runtime_error(path_ + ": bad safetensors header: expected a JSON object of tensors, found a " +
                               std::string(h.type_name()));
    data_start_ = 8 + n;
    const uint64_t data_size = size - data_start_;
    for (auto it = h.begin(); it != h.end(); ++it) {
      if (it.key() == "__metadata__") {
        if (!it->is_object())
          throw std::runtime_error(path_ + ": bad safetensors header: __metadata__ must be an object of strings");
        for (auto m = it->begin(); m != it->end(); ++m) {
          if (!m->is_string())
            throw std::runtime_error(path_ + ": bad safetensors header: __metadata__ value of " + m.key() +
                                     " must be a string");
          metadata_[m.key()] = m->get<std::string>();
        }
        continue;
      }
      SafeTensorInfo t;
      try {
        t.dtype = it->at("dtype").get<std::string>();
        // Integers only: nlohmann converts a floating-point value to an integer type with a cast
        // that is undefined out of range.
        if (!it->at("shape").is_array() || !it->at("data_offsets").is_array())
          throw std::runtime_error("shape and data_offsets must be lists");
        for (const auto& d : it->at("shape")) {
          if (!d.is_number_integer()) throw std::runtime_error("shape must be a list of integers");
          t.shape.push_back(d.get<int64_t>());
        }
        std::vector<uint64_t> offs;
        for (const auto& o : it->at("data_offsets")) {
          if (!o.is_number_unsigned()) throw std::runtime_error("data_offsets must be two non-negative integers");
          offs.push_back(o.get<uint64_t>());
        }
        if (offs.size() != 2 || offs[1] < offs[0] || offs[1] > data_size)
          throw std::runtime_error("data_offsets outside the file (truncated?)");
        const size_t eb = dtype_bytes(t.dtype);
        if (eb == 0) throw std::runtime_error("unsupported dtype " + t.dtype);
        // The element count, without overflow: a shape larger than the file cannot match.
        uint64_t numel = 1;
        bool zero = false, larger = false;
        for (int64_t d : t.shape) {
          if (d < 0) throw std::runtime_error("negative dimension in its shape");
          if (d == 0) zero = true;
          else if (numel > data_size / static_cast<uint64_t>(d)) larger = true;
          else numel *= static_cast<uint64_t>(d);
        }
        if (zero) numel = 0;
        if ((larger && !zero) || offs[1] - offs[0] != numel * eb)
          throw std::runtime_error("byte size does not match its shape");
        t.begin = offs[0];
        t.end = offs[1];
      } catch (const std::runtime_error& e) {
        throw std::runtime_error(path_ + ": tensor " + it.key() + ": " + e.what());
      } catch (const std::exception& e) {
        throw std::runtime_error(path_ + ": tensor " + it.key() + ": malformed entry (" + json_error_text(e.what()) + ")");
      }
      info_.emplace(it.key(), std::move(t));
    }
  } catch (...) {
    ::close(fd_);
    throw;
  }
}

SafetensorsReader::~SafetensorsReader() {
  if (fd_ >= 0) ::close(fd_);
}

const SafeTensorInfo* SafetensorsReader::find(const std::string& name) const {
  auto it = info_.find(name);
  return it == info_.end() ? nullptr : &it->second;
}

void SafetensorsReader::read(const std::string& name, void* dst) const {
  const SafeTensorInfo* t = find(name);
  if (!t) throw std::runtime_error(path_ + ": missing tensor " + name);
  read_all(fd_, dst, t->nbytes(), data_start_ + t->begin, path_ + ": tensor " + name);
}

void SafetensorsReader::read_at(uint64_t off, void* dst, uint64_t n, const std::string& what) const {
  read_all(fd_, dst, n, off, what);
}

// ---- whole-file helpers ---------------------------------------------------------------------------

void write_safetensors(const std::string& path, const std::map<std::string, SafeTensor>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  std::vector<std::pair<std::string, SafeTensorInfo>> header;
  for (const auto& [name, t] : tensors) {
    SafeTensorInfo i;
    i.dtype = t.dtype;
    i.shape = t.shape;
    header.emplace_back(name, i);
  }
  SafetensorsWriter w(path, header, metadata);
  for (const auto& [name, t] : tensors) w.write(name, t.bytes.data(), t.bytes.size());
  w.finish();
}

std::map<std::string, SafeTensor> read_safetensors(const std::string& path, std::map<std::string, std::string>* metadata) {
  SafetensorsReader r(path);
  if (metadata) *metadata = r.metadata();
  std::map<std::string, SafeTensor> out;
  for (const auto& [name, info] : r.tensors()) {
    SafeTensor t;
    t.dtype = info.dtype;
    t.shape = info.shape;
    t.bytes.resize(info.nbytes());
    r.read(name, t.bytes.data());
    out.emplace(name, std::move(t));
  }
  return out;
}

void fsync_directory(const std::string& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;  // best effort: some filesystems do not allow opening directories
  ::fsync(fd);
  ::close(fd);
}

}  // namespace mt
