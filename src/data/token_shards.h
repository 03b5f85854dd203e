// Token shards in llm.c's layout: a header of 256 little-endian int32 (header[0] = 20240520 magic,
// header[1] = 1 version, header[2] = number of tokens, the rest 0) followed by the tokens as uint16.
// A shard is exactly 1024 + 2 * count bytes. Vocabularies above 65536 tokens (Llama 3, Qwen 2) use
// version 2 of this project: the same header with version 2, then the tokens as uint32 (exactly
// 1024 + 4 * count bytes).
//
// Shards written by `meshtrain prepare` also describe their text in header words llm.c leaves at
// zero: header[3] = the tokenizer's vocabulary size, header[4] and header[5] = the low and high
// 32 bits of the number of bytes of text the tokens stand for (special tokens count 0), which is
// what bits per byte divides by. Zero means unknown (shards from llm.c or older versions).
//
// Loss masks (instruction and chat data): a shard PATH may have a mask shard PATH.mask beside it,
// a header of 256 int32 (header[0] = 20240522 magic, header[1] = 1 version, header[2] = number of
// tokens, the rest 0) followed by one byte per token: 1 when the model is trained to predict that
// token, 0 when not (a prompt's tokens). Exactly 1024 + count bytes, count equal to the token
// shard's.
#pragma once
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace mt {

inline constexpr int32_t kShardMagic = 20240520;
inline constexpr int32_t kShardVersion = 1;
inline constexpr int32_t kShardVersion32 = 2;
inline constexpr size_t kShardHeaderInts = 256;
inline constexpr size_t kShardHeaderBytes = kShardHeaderInts * sizeof(int32_t);  // 1024
inline constexpr int32_t kMaskShardMagic = 20240522;

// The loss-mask file of a token shard (`path` + ".mask").
std::string mask_shard_path(const std::string& path);
// Writes a mask shard (bytes 0 or 1). Throws std::runtime_error naming the file.
void write_mask_shard(const std::string& path, std::span<const uint8_t> mask);
// Reads and checks a mask shard: its count must be `tokens`, every byte 0 or 1. Throws
// std::runtime_error naming the file, the byte offset and the value found.
std::vector<uint8_t> read_mask_shard(const std::string& path, int64_t tokens);

// Writes `tokens` to `path` (replacing it). Throws std::runtime_error naming the file when it cannot
// be written, or naming the position and value of a token outside [0, 65535].
void write_token_shard(const std::string& path, std::span<const int32_t> tokens);
void write_token_shard(const std::string& path, std::span<const uint16_t> tokens);

// Writes a shard of `count` tokens of `token_bytes` (2: version 1, 4: version 2) piece by piece.
class TokenShardWriter {
 public:
  TokenShardWriter(const std::string& path, int64_t count, int token_bytes);
  ~TokenShardWriter();
  // Appends tokens; throws naming the file and the token for an id that does not fit.
  void write(std::span<const uint32_t> tokens);
  // Records the tokenizer's vocabulary size and, per token id, the bytes of text it stands for:
  // close() writes the vocabulary and the sum over the written tokens into the header.
  void describe_text(int32_t vocab_size, std::span<const uint16_t> text_bytes_of_id);
  // Checks that `count` tokens were written and flushes; throws on a short or failed write.
  void close();

 private:
  std::string path_;
  int64_t count_, written_ = 0;
  int token_bytes_;
  int32_t vocab_size_ = 0;
  std::span<const uint16_t> text_bytes_of_id_;
  int64_t text_bytes_ = 0;
  void* f_ = nullptr;
  std::vector<char> buf_;
};

// Reads and checks the header only; returns the token count. Throws like TokenShard.
int64_t read_token_shard_header(const std::string& path);

// What a checked header says.
struct TokenShardInfo {
  int64_t tokens = 0;
  int32_t vocab_size = 0;   // the tokenizer's vocabulary; 0 = not recorded
  int64_t text_bytes = 0;   // bytes of text the tokens stand for; 0 = not recorded
};
TokenShardInfo read_token_shard_info(const std::string& path);

// A validated, read-only, memory-mapped shard. The constructor throws std::runtime_error naming the
// file, the byte offset and the value found for: a file shorter than the header, a wrong magic
// (offset 0), a wrong version (offset 4), a negative count (offset 8), a size other than
// 1024 + 2 * count (truncated or trailing bytes), and - when vocab_size > 0 - the first token id
// >= vocab_size (offset 1024 + 2 * index), or a recorded tokenizer vocabulary larger than vocab_size.
class TokenShard {
 public:
  explicit TokenShard(const std::string& path, int64_t vocab_size = 0);
  ~TokenShard();
  TokenShard(TokenShard&& other) noexcept;
  TokenShard& operator=(TokenShard&& other) noexcept;
  TokenShard(const TokenShard&) = delete;
  TokenShard& operator=(const TokenShard&) = delete;

  const std::string& path() const { return path_; }
  size_t size() const { return count_; }
  // 2 (version 1, uint16) or 4 (version 2, uint32).
  int token_bytes() const { return token_bytes_; }
  // The header's record of the text (0 = not recorded; see the top of this file).
  int32_t tokenizer_vocab_size() const { return vocab_size_; }
  int64_t text_bytes() const { return text_bytes_; }
  // The uint16 tokens of a version-1 shard (std::logic_error for a version-2 shard).
  const uint16_t* data() const;
  std::span<const uint16_t> tokens() const { return {data(), count_}; }
  uint32_t operator[](size_t i) const {
    return token_bytes_ == 2 ? tokens_[i] : reinterpret_cast<const uint32_t*>(tokens_)[i];
  }
  // Copies tokens [from, from + n) as int32 into `out`.
  void copy(size_t from, size_t n, int32_t* out) const;
  // True when the shard has a loss mask (PATH.mask beside it, read and checked by the constructor).
  bool has_mask() const { return !mask_.empty(); }
  // Targets: copy(), then -1 (ignored by the loss) for every token the mask does not train.
  void copy_targets(size_t from, size_t n, int32_t* out) const;

 private:
  void release();
  std::string path_;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  const uint16_t* tokens_ = nullptr;
  size_t count_ = 0;
  int token_bytes_ = 2;
  int32_t vocab_size_ = 0;
  int64_t text_bytes_ = 0;
  std::vector<uint8_t> mask_;
};

// Convenience: the validated tokens of one version-1 shard, copied into a vector.
std::vector<uint16_t> read_token_shard(const std::string& path, int64_t vocab_size = 0);
// The tokens of a shard of either version.
std::vector<uint32_t> read_token_shard32(const std::string& path, int64_t vocab_size = 0);

}  // namespace mt
