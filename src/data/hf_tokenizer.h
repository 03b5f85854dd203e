// A Hugging Face tokenizer.json of the byte-level BPE family (GPT-2, Llama 3, Qwen 2, Mistral's
// Tekken-style files, and BPE tokenizers trained with the `tokenizers` library's ByteLevel
// pre-tokenizer), encoding and decoding as the `tokenizers` library does:
//
//   added tokens   split out of the text first and never split further (leftmost-longest match;
//                  `lstrip`, `rstrip`, `single_word` and `normalized` as the library applies them)
//   normalizer     none, NFC, or a Sequence of those
//   pre-tokenizer  Split (Regex or String pattern; behaviours Isolated, Removed, MergedWithPrevious,
//                  MergedWithNext, Contiguous; `invert`), Digits, and ByteLevel (`add_prefix_space`,
//                  `use_regex`: the GPT-2 pattern), alone or in a Sequence ending with ByteLevel
//   model          BPE with merges (either serialisation), `ignore_merges`, `unk_token`/`fuse_unk`
//   post-processor TemplateProcessing (the BOS/EOS it adds), ByteLevel, RobertaProcessing,
//                  BertProcessing, or a Sequence of those
//   decoder        ByteLevel (bytes of each token, then UTF-8 with U+FFFD for invalid sequences)
// Any other component (Unigram, WordPiece and WordLevel models, SentencePiece-style BPE with
// byte_fallback, Metaspace or Whitespace pre-tokenizers, other normalizers or decoders, BPE
// dropout) is refused with an error naming the file and the component.
//
// encode(text) is `tokenizer.encode(text, add_special_tokens=False).ids`; encode_with_special(text)
// adds what the post-processor adds (Llama 3's <|begin_of_text|>). decode(ids) is
// `tokenizer.decode(ids, skip_special_tokens=False)`. Both are thread-safe (each thread keeps its
// own cache of encoded words).
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "data/tokenizer.h"

namespace mt {

class HfTokenizer final : public Tokenizer {
 public:
  // Loads `path` (a tokenizer.json). When a tokenizer_config.json lies beside it, its `eos_token`
  // (and `bos_token`) name the end-of-text (and beginning-of-text) tokens the post-processor does
  // not. Throws std::runtime_error naming the file and the component or key at fault.
  explicit HfTokenizer(const std::string& path);
  ~HfTokenizer() override;

  std::vector<int32_t> encode(std::string_view text) const override;
  // Appends the ids of `text` to `out` (no special tokens added).
  void encode_into(std::string_view text, std::vector<int32_t>& out) const;
  std::vector<int32_t> encode_with_special(std::string_view text) const;
  std::string decode(std::span<const int32_t> ids) const override;
  std::string decode(std::span<const int32_t> ids, bool skip_special_tokens) const;
  int32_t vocab_size() const override { return vocab_size_; }
  std::string name() const override { return "hf"; }
  // End of text: the post-processor's trailing special token, else tokenizer_config.json's
  // eos_token, else the first added special token among <|endoftext|>, <|end_of_text|>, </s>,
  // <eos>; -1 when none.
  int32_t eot_token() const override { return eos_; }
  // The post-processor's tokens around the text (encode_with_special).
  void encode_document(std::string_view text, std::vector<int32_t>& out) const override;
  int32_t document_separator() const override {
    return !suffix_.empty() && suffix_.back() == eos_ ? -1 : eos_;
  }
  size_t token_text_bytes(int32_t id) const override;
  // What the post-processor puts before a sequence (Llama 3: <|begin_of_text|>); empty when nothing.
  const std::vector<int32_t>& prefix_tokens() const { return prefix_; }
  const std::vector<int32_t>& suffix_tokens() const { return suffix_; }
  // The id of a model or added token given by its text, or -1.
  int32_t token_id(std::string_view content) const;
  const std::string& path() const { return path_; }

  struct Impl;

 private:
  std::string path_;
  std::unique_ptr<Impl> impl_;
  int32_t vocab_size_ = 0;
  int32_t eos_ = -1;
  std::vector<int32_t> prefix_, suffix_;
};

// Rust's String::from_utf8_lossy (and Python's errors="replace"): each maximal ill-formed
// subsequence becomes U+FFFD.
std::string utf8_lossy(std::string_view bytes);

}  // namespace mt
