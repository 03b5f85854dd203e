// Tokenizers: text <-> token ids.
//
//   ByteTokenizer  ids 0..255 are the bytes of the text; vocabulary 256; no end-of-text token.
//   Gpt2Tokenizer  OpenAI GPT-2 byte-level BPE, loaded from a directory holding encoder.json and
//                  vocab.bpe (the files of the GPT-2 release, shipped in assets/gpt2); 50,257
//                  tokens, <|endoftext|> = 50256; or cut to its N most frequent tokens ("gpt2:N":
//                  the bytes, the first N - 257 merges, <|endoftext|> = N - 1).
//   HfTokenizer    a Hugging Face tokenizer.json of the byte-level BPE family (hf_tokenizer.h).
//
// encode() works on raw bytes: text that is not valid UTF-8 still round-trips exactly through
// decode(encode(text)) (each invalid byte is treated as one "other" character by the GPT-2
// pre-tokeniser). encode() never produces the end-of-text token: "<|endoftext|>" in the text is
// ordinary text (like tiktoken's encode_ordinary); callers insert eot_token() between documents.
#pragma once
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "data/bpe.h"

namespace mt {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  virtual std::vector<int32_t> encode(std::string_view text) const = 0;
  // Concatenates the bytes of each id; throws std::out_of_range for an id outside [0, vocab_size()).
  virtual std::string decode(std::span<const int32_t> ids) const = 0;
  virtual int32_t vocab_size() const = 0;
  virtual std::string name() const = 0;  // "byte", "gpt2" or "hf"
  virtual int32_t eot_token() const = 0;  // the end-of-text id, or -1 when there is none
  // Appends the tokens of one document of a corpus to `out`: what the tokenizer's post-processor
  // puts around a text (Llama 3's <|begin_of_text|>) and the text. Corpus preparation puts
  // document_separator() between documents.
  virtual void encode_document(std::string_view text, std::vector<int32_t>& out) const;
  // The token between two documents: the end-of-text token unless the document already ends
  // with it; -1 for none.
  virtual int32_t document_separator() const { return eot_token(); }
  // The bytes of text one id stands for: its decoded length, 0 for the end-of-text and other
  // special tokens and ids outside the vocabulary (what bits per byte divides by).
  virtual size_t token_text_bytes(int32_t id) const;
};

class ByteTokenizer final : public Tokenizer {
 public:
  std::vector<int32_t> encode(std::string_view text) const override;
  std::string decode(std::span<const int32_t> ids) const override;
  int32_t vocab_size() const override { return 256; }
  std::string name() const override { return "byte"; }
  int32_t eot_token() const override { return -1; }
  int32_t document_separator() const override { return '\n'; }  // documents are joined by a newline
};

class Gpt2Tokenizer final : public Tokenizer {
 public:
  // Loads `dir`/encoder.json and `dir`/vocab.bpe. Throws std::runtime_error naming the file (and
  // line or key) when a file is missing or malformed.
  // vocab_size > 0 cuts the vocabulary to that many tokens: the 256 byte tokens, the
  // vocab_size - 257 most frequent merges and <|endoftext|> as id vocab_size - 1 (name "gpt2:N").
  explicit Gpt2Tokenizer(const std::string& dir, int32_t vocab_size = 0);

  // Thread-safe (calls share a per-word BPE cache behind a mutex).
  std::vector<int32_t> encode(std::string_view text) const override;
  std::string decode(std::span<const int32_t> ids) const override;
  int32_t vocab_size() const override { return static_cast<int32_t>(id_to_bytes_.size()); }
  std::string name() const override { return cut_ ? "gpt2:" + std::to_string(vocab_size()) : "gpt2"; }
  int32_t eot_token() const override { return eot_; }

  // The raw bytes of one token (throws std::out_of_range).
  const std::string& token_bytes(int32_t id) const;
  // GPT-2 pre-tokenisation: splits `text` into the pieces BPE runs on (views into `text`).
  static std::vector<std::string_view> pretokenize(std::string_view text);

 private:
  void cut_vocabulary(int32_t vocab_size);
  void bpe(std::string_view word, std::vector<int32_t>& out) const;
  void bpe_uncached(std::string_view word, std::vector<int32_t>& out) const;

  struct StrHash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };
  std::vector<std::string> id_to_bytes_;
  int32_t byte_id_[256];
  BpeMerges merges_;
  int32_t eot_ = -1;
  bool cut_ = false;

  mutable std::mutex cache_mu_;
  mutable std::unordered_map<std::string, std::vector<int32_t>, StrHash, std::equal_to<>> cache_;
};

// The directory of the GPT-2 files when none is given: $MESHTRAIN_GPT2_DIR, else the repository's
// assets/gpt2 (found beside the binary's build tree, or at the path compiled in).
std::string default_gpt2_dir();

// "byte", "gpt2", "gpt2:N" (GPT-2's BPE cut to N tokens) or "hf". For gpt2 an empty `gpt2_dir` falls back to default_gpt2_dir(); hf needs
// `tokenizer_file` (a tokenizer.json). Throws std::runtime_error for an unknown name, a missing
// directory or file, or a file that cannot be used (naming it).
std::unique_ptr<Tokenizer> make_tokenizer(const std::string& name, const std::string& gpt2_dir = "",
                                          const std::string& tokenizer_file = "");

}  // namespace mt
