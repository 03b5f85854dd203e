#include "data/token_shards.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <climits>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <stdexcept>

namespace mt {

static_assert(std::endian::native == std::endian::little, "token shards are little-endian");

namespace {

std::runtime_error shard_error(const std::string& path, const std::string& what) {
  return std::runtime_error("token shard " + path + ": " + what);
}

std::string sys_error() { return std::strerror(errno); }

void write_shard_bytes(const std::string& path, size_t count, const void* tokens16) {
  int32_t header[kShardHeaderInts] = {};
  header[0] = kShardMagic;
  header[1] = kShardVersion;  // uint16 tokens
  header[2] = static_cast<int32_t>(count);
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (!f) throw shard_error(path, "cannot open for writing: " + sys_error());
  f.write(reinterpret_cast<const char*>(header), sizeof header);
  f.write(static_cast<const char*>(tokens16), static_cast<std::streamsize>(count * sizeof(uint16_t)));
  f.close();
  if (!f) throw shard_error(path, "write failed (disk full?)");
}

void check_count(const std::string& path, size_t count) {
  if (count > static_cast<size_t>(INT32_MAX))
    throw shard_error(path, std::to_string(count) + " tokens do not fit one shard (at most 2^31-1); split them");
}

struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

// Opens `path`, checks the header and the file size; returns the token count and sets the token
// width (2 for version 1, 4 for version 2) and the header's record of the text.
int64_t check_header(const std::string& path, Fd& fd, size_t& file_bytes, int& token_bytes,
                     TokenShardInfo* info = nullptr) {
  fd.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd.fd < 0) throw shard_error(path, "cannot open: " + sys_error());
  struct stat st{};
  if (::fstat(fd.fd, &st) != 0) throw shard_error(path, "cannot stat: " + sys_error());
  if (!S_ISREG(st.st_mode)) throw shard_error(path, "not a regular file");
  file_bytes = static_cast<size_t>(st.st_size);
  if (file_bytes < kShardHeaderBytes)
    throw shard_error(path, "truncated header at byte offset " + std::to_string(file_bytes) + ": the file has " +
                                std::to_string(file_bytes) + " bytes, the header alone needs " +
                                std::to_string(kShardHeaderBytes));
  int32_t header[kShardHeaderInts];
  size_t got = 0;
  while (got < sizeof header) {
    const ssize_t r = ::pread(fd.fd, reinterpret_cast<char*>(header) + got, sizeof header - got,
                              static_cast<off_t>(got));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) throw shard_error(path, "read failed at byte offset " + std::to_string(got) + ": " + sys_error());
    got += static_cast<size_t>(r);
  }
  if (header[0] != kShardMagic)
    throw shard_error(path, "bad magic at byte offset 0: found " + std::to_string(header[0]) + ", expected " +
                                std::to_string(kShardMagic) + " (not an llm.c token shard)");
  if (header[1] != kShardVersion && header[1] != kShardVersion32)
    throw shard_error(path, "unsupported version at byte offset 4: found " + std::to_string(header[1]) +
                                ", expected " + std::to_string(kShardVersion) + " (uint16 tokens) or " +
                                std::to_string(kShardVersion32) + " (uint32 tokens)");
  token_bytes = header[1] == kShardVersion ? 2 : 4;
  if (info) {
    info->vocab_size = std::max(header[3], 0);
    info->text_bytes = static_cast<int64_t>((static_cast<uint64_t>(static_cast<uint32_t>(header[5])) << 32) |
                                            static_cast<uint32_t>(header[4]));
    if (info->text_bytes < 0) info->text_bytes = 0;
  }
  if (header[2] < 0)
    throw shard_error(path, "bad token count at byte offset 8: found " + std::to_string(header[2]));
  const int64_t count = header[2];
  const size_t expect = kShardHeaderBytes + static_cast<size_t>(token_bytes) * static_cast<size_t>(count);
  if (file_bytes < expect)
    throw shard_error(path, "truncated at byte offset " + std::to_string(file_bytes) + ": the header (count " +
                                std::to_string(count) + " at byte offset 8) needs " + std::to_string(expect) +
                                " bytes, the file has " + std::to_string(file_bytes));
  if (file_bytes > expect)
    throw shard_error(path, "unexpected trailing bytes at byte offset " + std::to_string(expect) + ": the header (count " +
                                std::to_string(count) + " at byte offset 8) needs " + std::to_string(expect) +
                                " bytes, the file has " + std::to_string(file_bytes));
  return count;
}

}  // namespace

void write_token_shard(const std::string& path, std::span<const int32_t> tokens) {
  check_count(path, tokens.size());
  std::vector<uint16_t> t16(tokens.size());
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0 || tokens[i] > 65535)
      throw shard_error(path, "token " + std::to_string(i) + " has id " + std::to_string(tokens[i]) +
                                  ", which does not fit uint16 (shards hold ids 0..65535)");
    t16[i] = static_cast<uint16_t>(tokens[i]);
  }
  write_shard_bytes(path, t16.size(), t16.data());
}

void write_token_shard(const std::string& path, std::span<const uint16_t> tokens) {
  check_count(path, tokens.size());
  write_shard_bytes(path, tokens.size(), tokens.data());
}

int64_t read_token_shard_header(const std::string& path) {
  Fd fd;
  size_t bytes = 0;
  int width = 2;
  return check_header(path, fd, bytes, width);
}

TokenShardInfo read_token_shard_info(const std::string& path) {
  Fd fd;
  size_t bytes = 0;
  int width = 2;
  TokenShardInfo info;
  info.tokens = check_header(path, fd, bytes, width, &info);
  return info;
}

TokenShardWriter::TokenShardWriter(const std::string& path, int64_t count, int token_bytes)
    : path_(path), count_(count), token_bytes_(token_bytes) {
  if (token_bytes != 2 && token_bytes != 4) throw std::invalid_argument("token shard: token_bytes must be 2 or 4");
  check_count(path, static_cast<size_t>(count));
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) throw shard_error(path, "cannot open for writing: " + sys_error());
  f_ = f;
  int32_t header[kShardHeaderInts] = {};
  header[0] = kShardMagic;
  header[1] = token_bytes == 2 ? kShardVersion : kShardVersion32;
  header[2] = static_cast<int32_t>(count);
  if (std::fwrite(header, sizeof header, 1, f) != 1) throw shard_error(path, "write failed (disk full?)");
}

TokenShardWriter::~TokenShardWriter() {
  if (f_) std::fclose(static_cast<std::FILE*>(f_));
}

void TokenShardWriter::write(std::span<const uint32_t> tokens) {
  if (written_ + static_cast<int64_t>(tokens.size()) > count_)
    throw shard_error(path_, "more tokens written than the header's count " + std::to_string(count_));
  buf_.resize(tokens.size() * static_cast<size_t>(token_bytes_));
  if (token_bytes_ == 2) {
    auto* d = reinterpret_cast<uint16_t*>(buf_.data());
    for (size_t i = 0; i < tokens.size(); ++i) {
      if (tokens[i] > 65535)
        throw shard_error(path_, "token " + std::to_string(written_ + static_cast<int64_t>(i)) + " has id " +
                                     std::to_string(tokens[i]) + ", which does not fit uint16");
      d[i] = static_cast<uint16_t>(tokens[i]);
    }
  } else {
    std::memcpy(buf_.data(), tokens.data(), buf_.size());
  }
  for (uint32_t t : tokens)
    if (t < text_bytes_of_id_.size()) text_bytes_ += text_bytes_of_id_[t];
  if (!buf_.empty() && std::fwrite(buf_.data(), 1, buf_.size(), static_cast<std::FILE*>(f_)) != buf_.size())
    throw shard_error(path_, "write failed (disk full?)");
  written_ += static_cast<int64_t>(tokens.size());
}

void TokenShardWriter::describe_text(int32_t vocab_size, std::span<const uint16_t> text_bytes_of_id) {
  vocab_size_ = vocab_size;
  text_bytes_of_id_ = text_bytes_of_id;
}

void TokenShardWriter::close() {
  if (!f_) return;
  if (written_ != count_)
    throw shard_error(path_, std::to_string(written_) + " tokens written, the header says " + std::to_string(count_));
  if (vocab_size_ > 0) {
    auto* f = static_cast<std::FILE*>(f_);
    const int32_t words[3] = {vocab_size_, static_cast<int32_t>(static_cast<uint32_t>(text_bytes_)),
                              static_cast<int32_t>(static_cast<uint32_t>(static_cast<uint64_t>(text_bytes_) >> 32))};
    if (std::fseek(f, 3 * sizeof(int32_t), SEEK_SET) != 0 || std::fwrite(words, sizeof words, 1, f) != 1)
      throw shard_error(path_, "write failed (disk full?)");
  }
  const int rc = std::fclose(static_cast<std::FILE*>(f_));
  f_ = nullptr;
  if (rc != 0) throw shard_error(path_, "write failed (disk full?)");
}

TokenShard::TokenShard(const std::string& path, int64_t vocab_size) : path_(path) {
  Fd fd;
  size_t bytes = 0;
  TokenShardInfo info;
  count_ = static_cast<size_t>(check_header(path, fd, bytes, token_bytes_, &info));
  vocab_size_ = info.vocab_size;
  text_bytes_ = info.text_bytes;
  if (vocab_size > 0 && vocab_size_ > vocab_size)
    throw shard_error(path, "prepared with a tokenizer of " + std::to_string(vocab_size_) +
                                " tokens, more than the model's vocab_size " + std::to_string(vocab_size) +
                                ": set [model] vocab_size = " + std::to_string(vocab_size_) +
                                " or prepare the data with the model's tokenizer");
  {
    const std::string mp = mask_shard_path(path);
    std::error_code ec;
    if (std::filesystem::exists(mp, ec)) mask_ = read_mask_shard(mp, static_cast<int64_t>(count_));
  }
  if (count_ == 0) return;
  map_ = ::mmap(nullptr, bytes, PROT_READ, MAP_PRIVATE, fd.fd, 0);
  if (map_ == MAP_FAILED) {
    map_ = nullptr;
    throw shard_error(path, "mmap failed: " + sys_error());
  }
  map_bytes_ = bytes;
  tokens_ = reinterpret_cast<const uint16_t*>(static_cast<const char*>(map_) + kShardHeaderBytes);
  if (token_bytes_ == 4 && vocab_size > 0) {
    const auto* t = reinterpret_cast<const uint32_t*>(tokens_);
    const auto limit = static_cast<uint32_t>(vocab_size);
    uint32_t max_id = 0;
    for (size_t i = 0; i < count_; ++i) max_id = t[i] > max_id ? t[i] : max_id;
    if (max_id >= limit) {
      size_t i = 0;
      while (t[i] < limit) ++i;
      const std::string msg = "token id " + std::to_string(t[i]) + " at byte offset " +
                              std::to_string(kShardHeaderBytes + 4 * i) + " (token " + std::to_string(i) +
                              ") is >= the vocabulary size " + std::to_string(vocab_size) +
                              " (data prepared with another tokenizer?)";
      release();
      throw shard_error(path, msg);
    }
  } else if (vocab_size > 0 && vocab_size < 65536) {
    const auto limit = static_cast<uint16_t>(vocab_size);
    uint16_t max_id = 0;
    for (size_t i = 0; i < count_; ++i) max_id = tokens_[i] > max_id ? tokens_[i] : max_id;
    if (max_id >= limit) {
      size_t i = 0;
      while (tokens_[i] < limit) ++i;
      const std::string msg = "token id " + std::to_string(tokens_[i]) + " at byte offset " +
                              std::to_string(kShardHeaderBytes + 2 * i) + " (token " + std::to_string(i) +
                              ") is >= the vocabulary size " + std::to_string(vocab_size) +
                              " (data prepared with another tokenizer?)";
      release();
      throw shard_error(path, msg);
    }
  }
}

std::string mask_shard_path(const std::string& path) { return path + ".mask"; }

void write_mask_shard(const std::string& path, std::span<const uint8_t> mask) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) throw shard_error(path, "cannot create: " + sys_error());
  int32_t header[kShardHeaderInts] = {};
  header[0] = kMaskShardMagic;
  header[1] = 1;
  header[2] = static_cast<int32_t>(mask.size());
  bool ok = mask.size() <= static_cast<size_t>(INT32_MAX) && std::fwrite(header, sizeof header, 1, f) == 1 &&
            (mask.empty() || std::fwrite(mask.data(), 1, mask.size(), f) == mask.size());
  ok = std::fclose(f) == 0 && ok;
  if (!ok) throw shard_error(path, "write failed (disk full?)");
}

std::vector<uint8_t> read_mask_shard(const std::string& path, int64_t tokens) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) throw shard_error(path, "cannot open the loss mask: " + sys_error());
  int32_t header[kShardHeaderInts] = {};
  std::vector<uint8_t> mask;
  std::string err;
  if (std::fread(header, sizeof header, 1, f) != 1) {
    err = "shorter than the 1024-byte header";
  } else if (header[0] != kMaskShardMagic) {
    err = "byte offset 0: magic " + std::to_string(header[0]) + ", expected " + std::to_string(kMaskShardMagic) +
          " (not a loss-mask shard)";
  } else if (header[1] != 1) {
    err = "byte offset 4: version " + std::to_string(header[1]) + ", expected 1";
  } else if (header[2] != tokens) {
    err = "byte offset 8: " + std::to_string(header[2]) + " mask bytes for a token shard of " + std::to_string(tokens) +
          " tokens (prepare the data again)";
  } else {
    mask.resize(static_cast<size_t>(tokens));
    if (!mask.empty() && std::fread(mask.data(), 1, mask.size(), f) != mask.size()) err = "truncated";
    else if (std::fgetc(f) != EOF) err = "trailing bytes after " + std::to_string(tokens) + " mask bytes";
    for (size_t i = 0; err.empty() && i < mask.size(); ++i)
      if (mask[i] > 1)
        err = "byte offset " + std::to_string(kShardHeaderBytes + i) + ": value " + std::to_string(mask[i]) +
              " (a mask byte is 0 or 1)";
  }
  std::fclose(f);
  if (!err.empty()) throw shard_error(path, err);
  return mask;
}

void TokenShard::copy_targets(size_t from, size_t n, int32_t* out) const {
  copy(from, n, out);
  if (mask_.empty()) return;
  for (size_t i = 0; i < n; ++i)
    if (!mask_[from + i]) out[i] = -1;
}

const uint16_t* TokenShard::data() const {
  if (token_bytes_ != 2)
    throw std::logic_error("token shard " + path_ + " holds uint32 tokens (version 2): read it with copy() or []");
  return tokens_;
}

void TokenShard::copy(size_t from, size_t n, int32_t* out) const {
  if (token_bytes_ == 2) {
    for (size_t i = 0; i < n; ++i) out[i] = tokens_[from + i];
  } else {
    const auto* t = reinterpret_cast<const uint32_t*>(tokens_) + from;
    for (size_t i = 0; i < n; ++i) out[i] = static_cast<int32_t>(t[i]);
  }
}

void TokenShard::release() {
  if (map_) ::munmap(map_, map_bytes_);
  map_ = nullptr;
  map_bytes_ = 0;
  tokens_ = nullptr;
  count_ = 0;
}

TokenShard::~TokenShard() { release(); }

TokenShard::TokenShard(TokenShard&& o) noexcept
    : path_(std::move(o.path_)), map_(o.map_), map_bytes_(o.map_bytes_), tokens_(o.tokens_), count_(o.count_),
      token_bytes_(o.token_bytes_), vocab_size_(o.vocab_size_), text_bytes_(o.text_bytes_), mask_(std::move(o.mask_)) {
  o.map_ = nullptr;
  o.map_bytes_ = 0;
  o.tokens_ = nullptr;
  o.count_ = 0;
}

TokenShard& TokenShard::operator=(TokenShard&& o) noexcept {
  if (this != &o) {
    release();
    path_ = std::move(o.path_);
    map_ = o.map_;
    map_bytes_ = o.map_bytes_;
    tokens_ = o.tokens_;
    count_ = o.count_;
    token_bytes_ = o.token_bytes_;
    vocab_size_ = o.vocab_size_;
    text_bytes_ = o.text_bytes_;
    mask_ = std::move(o.mask_);
    o.map_ = nullptr;
    o.map_bytes_ = 0;
    o.tokens_ = nullptr;
    o.count_ = 0;
  }
  return *this;
}

std::vector<uint16_t> read_token_shard(const std::string& path, int64_t vocab_size) {
  TokenShard s(path, vocab_size);
  if (s.token_bytes() != 2)
    throw shard_error(path, "holds uint32 tokens (version 2 at byte offset 4) where uint16 tokens (version 1) "
                            "are read; read it with read_token_shard32");
  if (s.size() == 0) return {};
  return std::vector<uint16_t>(s.tokens().begin(), s.tokens().end());
}

std::vector<uint32_t> read_token_shard32(const std::string& path, int64_t vocab_size) {
  TokenShard s(path, vocab_size);
  std::vector<uint32_t> v(s.size());
  for (size_t i = 0; i < s.size(); ++i) v[i] = s[i];
  return v;
}

}  // namespace mt
