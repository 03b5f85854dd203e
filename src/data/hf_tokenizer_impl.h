// The Hugging Face tokenizer's insides (private to hf_tokenizer.cpp, which encodes and decodes, and
// hf_tokenizer_load.cpp, which reads tokenizer.json into them).
#pragma once
#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "data/bpe.h"
#include "data/hf_tokenizer.h"
#include "data/regex.h"
#include "data/unicode_data.h"

namespace mt {

namespace hf {

struct StrHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
using StrMap = std::unordered_map<std::string, int32_t, StrHash, std::equal_to<>>;

// GPT-2's bytes_to_unicode(): byte -> code point of the alphabet byte-level vocabularies are written in.
struct ByteAlphabet {
  uint32_t byte_to_cp[256];
  std::unordered_map<uint32_t, uint8_t> cp_to_byte;
  ByteAlphabet() {
    auto printable = [](int b) {
      return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    };
    int extra = 0;
    for (int b = 0; b < 256; ++b) {
      byte_to_cp[b] = printable(b) ? static_cast<uint32_t>(b) : static_cast<uint32_t>(256 + extra++);
      cp_to_byte[byte_to_cp[b]] = static_cast<uint8_t>(b);
    }
  }
  // The bytes a token written in the alphabet stands for; false when a character is outside it.
  bool to_bytes(std::string_view s, std::string& out) const {
    out.clear();
    for (size_t i = 0; i < s.size();) {
      uint32_t cp;
      i += unicode::utf8_decode(s, i, cp);
      auto it = cp_to_byte.find(cp);
      if (it == cp_to_byte.end()) return false;
      out.push_back(static_cast<char>(it->second));
    }
    return true;
  }
};

inline const ByteAlphabet& alphabet() {
  static const ByteAlphabet a;
  return a;
}

enum class Behavior { Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous };

struct PreStep {
  enum Kind { Split, Digits, ByteLevel } kind;
  // Split
  std::unique_ptr<Regex> regex;
  std::string literal;
  Behavior behavior = Behavior::Isolated;
  bool invert = false;
  // Digits
  bool individual_digits = false;
  // ByteLevel
  bool add_prefix_space = false;
  bool use_regex = true;
};

struct Added {
  int32_t id;
  std::string content;
  bool single_word, lstrip, rstrip, normalized, special;
};

// Leftmost-longest matching of a set of added tokens (the library's Aho-Corasick
// LeftmostLongest): candidates are bucketed by first byte, longest first.
struct AddedMatcher {
  std::vector<const Added*> by_byte[256];
  bool empty = true;
  void add(const Added* a) {
    if (a->content.empty()) return;
    by_byte[static_cast<unsigned char>(a->content[0])].push_back(a);
    empty = false;
  }
  void finish() {
    for (auto& v : by_byte)
      std::stable_sort(v.begin(), v.end(), [](const Added* x, const Added* y) { return x->content.size() > y->content.size(); });
  }
  // The first match at or after `from`: its token and start, or null.
  const Added* find(std::string_view s, size_t from, size_t* at) const {
    if (empty) return nullptr;
    for (size_t i = from; i < s.size(); ++i) {
      const auto& cands = by_byte[static_cast<unsigned char>(s[i])];
      for (const Added* a : cands)
        if (s.compare(i, a->content.size(), a->content) == 0) {
          *at = i;
          return a;
        }
    }
    return nullptr;
  }
};

// A number no other tokenizer of this process has.
uint64_t next_serial();

}  // namespace hf

struct HfTokenizer::Impl {
  std::string where;  // file name for messages
  uint64_t serial = hf::next_serial();  // tells the threads' word caches apart
  // Model
  hf::StrMap bytes_to_id;                                // token bytes -> id (tokens written in the alphabet)
  std::vector<std::string> id_to_token;              // model tokens as written in the file
  int32_t byte_id[256];                              // -1: the byte is not in the vocabulary
  BpeMerges merges;
  bool ignore_merges = false;
  int32_t unk = -1;
  bool fuse_unk = false;
  // Added tokens
  std::vector<hf::Added> added;
  std::unordered_map<int32_t, const hf::Added*> added_by_id;
  hf::AddedMatcher raw_matcher, normalized_matcher;
  // Normalizer and pre-tokenizer
  bool nfc = false;
  std::vector<hf::PreStep> steps;

  void split_added(std::string_view text, const hf::AddedMatcher& m, std::vector<std::pair<const hf::Added*, std::string_view>>& out) const;
  void encode_text(std::string_view text, std::vector<int32_t>& out) const;
  void encode_normalized(std::string_view text, std::vector<int32_t>& out) const;
  void pre_tokenize(std::string_view piece, size_t step, std::vector<int32_t>& out) const;
  void bpe_word(std::string_view word, std::vector<int32_t>& out) const;
  void bpe_uncached(std::string_view word, std::vector<int32_t>& out) const;
  std::string token_text(int32_t id) const;
};

}  // namespace mt
