#include "data/hf_tokenizer.h"

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <queue>
#include <stdexcept>

#include "data/regex.h"
#include "data/unicode_data.h"

namespace mt {

namespace {

using json = nlohmann::json;

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

const ByteAlphabet& alphabet() {
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

bool is_word_char(uint32_t cp) {  // \w of Rust's regex crate (single_word): letters, marks, Nd, Nl, Pc
  if (cp == unicode::kInvalid) return false;
  using C = unicode::Category;
  const C c = unicode::category(cp);
  return c == C::Lu || c == C::Ll || c == C::Lt || c == C::Lm || c == C::Lo || c == C::Mn || c == C::Mc ||
         c == C::Me || c == C::Nd || c == C::Nl || c == C::Pc;
}

uint32_t last_cp(std::string_view s) {
  if (s.empty()) return unicode::kInvalid;
  size_t i = s.size() - 1;
  while (i > 0 && (static_cast<unsigned char>(s[i]) & 0xC0) == 0x80 && s.size() - i < 4) --i;
  uint32_t cp;
  if (unicode::utf8_decode(s, i, cp) != s.size() - i) return unicode::kInvalid;
  return cp;
}

uint32_t first_cp(std::string_view s) {
  if (s.empty()) return unicode::kInvalid;
  uint32_t cp;
  unicode::utf8_decode(s, 0, cp);
  return cp;
}

std::atomic<uint64_t> g_serial{1};

}  // namespace

struct HfTokenizer::Impl {
  std::string where;  // file name for messages
  uint64_t serial = g_serial.fetch_add(1);
  // Model
  StrMap bytes_to_id;                                // token bytes -> id (tokens written in the alphabet)
  std::vector<std::string> id_to_token;              // model tokens as written in the file
  int32_t byte_id[256];                              // -1: the byte is not in the vocabulary
  std::unordered_map<uint64_t, std::pair<int32_t, int32_t>> merges;  // (left, right) -> (rank, merged id)
  bool ignore_merges = false;
  int32_t unk = -1;
  bool fuse_unk = false;
  // Added tokens
  std::vector<Added> added;
  std::unordered_map<int32_t, const Added*> added_by_id;
  AddedMatcher raw_matcher, normalized_matcher;
  // Normalizer and pre-tokenizer
  bool nfc = false;
  std::vector<PreStep> steps;

  void split_added(std::string_view text, const AddedMatcher& m, std::vector<std::pair<const Added*, std::string_view>>& out) const;
  void encode_text(std::string_view text, std::vector<int32_t>& out) const;
  void encode_normalized(std::string_view text, std::vector<int32_t>& out) const;
  void pre_tokenize(std::string_view piece, size_t step, std::vector<int32_t>& out) const;
  void bpe_word(std::string_view word, std::vector<int32_t>& out) const;
  void bpe_uncached(std::string_view word, std::vector<int32_t>& out) const;
  std::string token_text(int32_t id) const;
};

// ---------------------------------------------------------------------------------------------
// Loading

namespace {

[[noreturn]] void refuse(const std::string& where, const std::string& what) {
  throw std::runtime_error("hf tokenizer " + where + ": " + what);
}

std::string type_of(const json& j) { return j.is_object() && j.contains("type") && j["type"].is_string() ? j["type"].get<std::string>() : ""; }

bool get_bool(const json& j, const char* key, bool dflt) {
  if (!j.contains(key) || j[key].is_null()) return dflt;
  return j[key].get<bool>();
}

Behavior parse_behavior(const std::string& where, const json& j) {
  const std::string b = j.value("behavior", std::string("Isolated"));
  if (b == "Removed") return Behavior::Removed;
  if (b == "Isolated") return Behavior::Isolated;
  if (b == "MergedWithPrevious") return Behavior::MergedWithPrevious;
  if (b == "MergedWithNext") return Behavior::MergedWithNext;
  if (b == "Contiguous") return Behavior::Contiguous;
  refuse(where, "pre_tokenizer Split: unknown behavior '" + b + "'");
}

void parse_pre_tokenizer(const std::string& where, const json& j, std::vector<PreStep>& steps) {
  if (j.is_null()) return;
  const std::string t = type_of(j);
  if (t == "Sequence") {
    for (const auto& s : j.at("pretokenizers")) parse_pre_tokenizer(where, s, steps);
    return;
  }
  PreStep s;
  if (t == "Split") {
    s.kind = PreStep::Split;
    const json& p = j.at("pattern");
    if (p.contains("Regex")) {
      try {
        s.regex = std::make_unique<Regex>(p["Regex"].get<std::string>());
      } catch (const std::invalid_argument& e) {
        refuse(where, std::string("pre_tokenizer Split: ") + e.what());
      }
    } else if (p.contains("String")) {
      s.literal = p["String"].get<std::string>();
      if (s.literal.empty()) refuse(where, "pre_tokenizer Split: empty String pattern");
    } else {
      refuse(where, "pre_tokenizer Split: pattern must hold Regex or String");
    }
    s.behavior = parse_behavior(where, j);
    s.invert = get_bool(j, "invert", false);
  } else if (t == "Digits") {
    s.kind = PreStep::Digits;
    s.individual_digits = get_bool(j, "individual_digits", false);
  } else if (t == "ByteLevel") {
    s.kind = PreStep::ByteLevel;
    s.add_prefix_space = get_bool(j, "add_prefix_space", true);
    s.use_regex = get_bool(j, "use_regex", true);
  } else {
    refuse(where, "pre_tokenizer type '" + t +
                      "' is not supported (supported: Split, Digits, ByteLevel and a Sequence of them: the byte-level "
                      "BPE family)");
  }
  steps.push_back(std::move(s));
}

void parse_normalizer(const std::string& where, const json& j, bool& nfc) {
  if (j.is_null()) return;
  const std::string t = type_of(j);
  if (t == "Sequence") {
    for (const auto& n : j.at("normalizers")) parse_normalizer(where, n, nfc);
    return;
  }
  if (t == "NFC") {
    nfc = true;
    return;
  }
  refuse(where, "normalizer type '" + t + "' is not supported (supported: none, NFC)");
}

}  // namespace

HfTokenizer::HfTokenizer(const std::string& path) : path_(path), impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.where = path;
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("hf tokenizer: cannot open " + path + " (pass the tokenizer.json of the model)");
  json j;
  try {
    j = json::parse(f);
  } catch (const json::exception& e) {
    refuse(path, std::string("not valid JSON: ") + e.what());
  }
  if (!j.is_object() || !j.contains("model")) refuse(path, "no \"model\" object (is this a Hugging Face tokenizer.json?)");
  try {
    // ---- model
    const json& model = j["model"];
    std::string mt = type_of(model);
    if (mt.empty() && model.contains("merges")) mt = "BPE";  // old files omit the type
    if (mt != "BPE")
      refuse(path, "model type '" + mt + "' is not supported (only byte-level BPE; Unigram/SentencePiece, WordPiece "
                   "and WordLevel models are not)");
    if (get_bool(model, "byte_fallback", false))
      refuse(path, "model BPE with byte_fallback (SentencePiece-style BPE, as Llama 2 and Mistral v1 use) is not "
                   "supported; only byte-level BPE");
    for (const char* k : {"continuing_subword_prefix", "end_of_word_suffix"})
      if (model.contains(k) && !model[k].is_null() && !model[k].get<std::string>().empty())
        refuse(path, std::string("model BPE with ") + k + " is not supported (not a byte-level BPE)");
    if (model.contains("dropout") && !model["dropout"].is_null() && model["dropout"].get<double>() > 0)
      refuse(path, "model BPE with dropout > 0 (training-time randomness) is not supported");
    m.ignore_merges = get_bool(model, "ignore_merges", false);
    m.fuse_unk = get_bool(model, "fuse_unk", false);
    const json& vocab = model.at("vocab");
    if (!vocab.is_object() || vocab.empty()) refuse(path, "model.vocab must be a non-empty object");
    int64_t max_id = -1;
    for (auto it = vocab.begin(); it != vocab.end(); ++it) {
      if (!it.value().is_number_integer() || it.value().get<int64_t>() < 0 || it.value().get<int64_t>() >= (1 << 26))
        refuse(path, "model.vocab: token \"" + it.key() + "\" must map to a non-negative id");
      max_id = std::max(max_id, it.value().get<int64_t>());
    }
    m.id_to_token.assign(static_cast<size_t>(max_id + 1), std::string());
    const ByteAlphabet& ab = alphabet();
    std::string bytes;
    m.bytes_to_id.reserve(vocab.size());
    for (auto it = vocab.begin(); it != vocab.end(); ++it) {
      const auto id = static_cast<int32_t>(it.value().get<int64_t>());
      m.id_to_token[static_cast<size_t>(id)] = it.key();
      if (ab.to_bytes(it.key(), bytes)) m.bytes_to_id[bytes] = id;
    }
    for (int b = 0; b < 256; ++b) {
      auto it = m.bytes_to_id.find(std::string(1, static_cast<char>(b)));
      m.byte_id[b] = it == m.bytes_to_id.end() ? -1 : it->second;
    }
    if (model.contains("unk_token") && model["unk_token"].is_string()) {
      const std::string u = model["unk_token"].get<std::string>();
      auto it = vocab.find(u);
      if (it == vocab.end()) refuse(path, "model.unk_token \"" + u + "\" is not in model.vocab");
      m.unk = static_cast<int32_t>(it->get<int64_t>());
    }
    const json& merges = model.at("merges");
    m.merges.reserve(merges.size());
    std::string lb, rb;
    int32_t rank = 0;
    for (const auto& mg : merges) {
      std::string l, r;
      if (mg.is_string()) {
        const std::string s = mg.get<std::string>();
        const size_t sp = s.find(' ');
        if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos)
          refuse(path, "model.merges[" + std::to_string(rank) + "]: \"" + s + "\" is not two tokens separated by a space");
        l = s.substr(0, sp);
        r = s.substr(sp + 1);
      } else if (mg.is_array() && mg.size() == 2) {
        l = mg[0].get<std::string>();
        r = mg[1].get<std::string>();
      } else {
        refuse(path, "model.merges[" + std::to_string(rank) + "] must be \"a b\" or [\"a\", \"b\"]");
      }
      auto li = vocab.find(l), ri = vocab.find(r), mi = vocab.find(l + r);
      if (li == vocab.end() || ri == vocab.end() || mi == vocab.end())
        refuse(path, "model.merges[" + std::to_string(rank) + "]: \"" + l + "\" + \"" + r +
                         "\" or their merge is not in model.vocab");
      const uint64_t key = (static_cast<uint64_t>(li->get<int64_t>()) << 32) | static_cast<uint32_t>(ri->get<int64_t>());
      m.merges[key] = {rank, static_cast<int32_t>(mi->get<int64_t>())};  // a repeated pair: the last wins, as in the library
      ++rank;
    }
    // ---- added tokens
    if (j.contains("added_tokens") && j["added_tokens"].is_array()) {
      m.added.reserve(j["added_tokens"].size());
      for (const auto& a : j["added_tokens"]) {
        Added t;
        t.id = static_cast<int32_t>(a.at("id").get<int64_t>());
        t.content = a.at("content").get<std::string>();
        t.single_word = get_bool(a, "single_word", false);
        t.lstrip = get_bool(a, "lstrip", false);
        t.rstrip = get_bool(a, "rstrip", false);
        t.normalized = get_bool(a, "normalized", false);
        t.special = get_bool(a, "special", false);
        if (t.id < 0) refuse(path, "added token \"" + t.content + "\" has a negative id");
        // A token the model's vocabulary already holds keeps the model's id (the library resolves
        // added tokens through the model first).
        if (auto mv = vocab.find(t.content); mv != vocab.end()) t.id = static_cast<int32_t>(mv->get<int64_t>());
        max_id = std::max<int64_t>(max_id, t.id);
        m.added.push_back(std::move(t));
      }
      for (const Added& a : m.added) {
        m.added_by_id[a.id] = &a;
        (a.normalized && !a.special ? m.normalized_matcher : m.raw_matcher).add(&a);
      }
      m.raw_matcher.finish();
      m.normalized_matcher.finish();
    }
    vocab_size_ = static_cast<int32_t>(max_id + 1);
    // ---- normalizer, pre-tokenizer
    if (j.contains("normalizer")) parse_normalizer(path, j["normalizer"], m.nfc);
    if (j.contains("pre_tokenizer")) parse_pre_tokenizer(path, j["pre_tokenizer"], m.steps);
    size_t byte_level = m.steps.size();
    for (size_t i = 0; i < m.steps.size(); ++i)
      if (m.steps[i].kind == PreStep::ByteLevel) byte_level = i;
    if (byte_level == m.steps.size())
      refuse(path, "pre_tokenizer has no ByteLevel step: not a byte-level BPE tokenizer (not supported)");
    if (byte_level + 1 != m.steps.size())
      refuse(path, "pre_tokenizer: a step after ByteLevel is not supported (ByteLevel must come last)");
    for (size_t i = 0; i < byte_level; ++i)
      if (m.steps[i].kind == PreStep::ByteLevel) refuse(path, "pre_tokenizer: more than one ByteLevel step");
    // ---- decoder
    if (j.contains("decoder") && !j["decoder"].is_null()) {
      const json& d = j["decoder"];
      std::string t = type_of(d);
      if (t == "Sequence" && d.contains("decoders") && d["decoders"].size() == 1) t = type_of(d["decoders"][0]);
      if (t != "ByteLevel") refuse(path, "decoder type '" + t + "' is not supported (only ByteLevel)");
    } else {
      refuse(path, "no decoder (a byte-level BPE tokenizer.json has a ByteLevel decoder)");
    }
    // ---- post-processor: what encode_with_special adds
    std::vector<const json*> procs;
    if (j.contains("post_processor") && !j["post_processor"].is_null()) {
      const json& p = j["post_processor"];
      if (type_of(p) == "Sequence")
        for (const auto& q : p.at("processors")) procs.push_back(&q);
      else
        procs.push_back(&p);
    }
    for (const json* pp : procs) {
      const std::string t = type_of(*pp);
      if (t == "ByteLevel") continue;
      if (t == "TemplateProcessing") {
        bool seen_a = false;
        for (const auto& item : pp->at("single")) {
          if (item.contains("Sequence")) {
            seen_a = true;
            continue;
          }
          const std::string name = item.at("SpecialToken").at("id").get<std::string>();
          const json& st = pp->at("special_tokens").at(name);
          for (const auto& id : st.at("ids")) (seen_a ? suffix_ : prefix_).push_back(static_cast<int32_t>(id.get<int64_t>()));
        }
      } else if (t == "RobertaProcessing" || t == "BertProcessing") {
        prefix_.push_back(static_cast<int32_t>(pp->at("cls").at(1).get<int64_t>()));
        suffix_.push_back(static_cast<int32_t>(pp->at("sep").at(1).get<int64_t>()));
      } else {
        refuse(path, "post_processor type '" + t + "' is not supported");
      }
    }
  } catch (const json::exception& e) {
    refuse(path, std::string("unexpected layout: ") + e.what());
  }
  // ---- end of text
  if (!suffix_.empty()) eos_ = suffix_.back();
  const std::filesystem::path cfg = std::filesystem::path(path).parent_path() / "tokenizer_config.json";
  if (eos_ < 0 && std::filesystem::is_regular_file(cfg)) {
    std::ifstream cf(cfg);
    try {
      const json c = json::parse(cf);
      if (c.contains("eos_token")) {
        const json& e = c["eos_token"];
        const std::string s = e.is_string() ? e.get<std::string>() : e.is_object() ? e.value("content", "") : "";
        if (!s.empty()) eos_ = token_id(s);
      }
    } catch (const json::exception& e) {
      refuse(cfg.string(), std::string("not valid JSON: ") + e.what());
    }
  }
  if (eos_ < 0)
    for (const char* n : {"<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>"}) {
      for (const Added& a : m.added)
        if (a.special && a.content == n) eos_ = a.id;
      if (eos_ >= 0) break;
    }
}

HfTokenizer::~HfTokenizer() = default;

int32_t HfTokenizer::token_id(std::string_view content) const {
  for (const Added& a : impl_->added)
    if (a.content == content) return a.id;
  for (size_t i = 0; i < impl_->id_to_token.size(); ++i)
    if (impl_->id_to_token[i] == content) return static_cast<int32_t>(i);
  return -1;
}

// ---------------------------------------------------------------------------------------------
// Encoding

void HfTokenizer::Impl::split_added(std::string_view s, const AddedMatcher& matcher,
                                    std::vector<std::pair<const Added*, std::string_view>>& out) const {
  size_t start_offset = 0, from = 0, at = 0;
  while (const Added* a = matcher.find(s, from, &at)) {
    size_t start = at, stop = at + a->content.size();
    from = stop;  // the next search starts after this match, whether it is used or not
    if (a->single_word) {
      const bool start_space = start == 0 || !is_word_char(last_cp(s.substr(0, start)));
      const bool stop_space = stop == s.size() || !is_word_char(first_cp(s.substr(stop)));
      if (!start_space || !stop_space) continue;
    }
    if (a->lstrip) {
      size_t ns = start;
      while (ns > 0) {
        const uint32_t cp = last_cp(s.substr(0, ns));
        if (cp == unicode::kInvalid || !unicode::is_white_space(cp)) break;
        size_t len = 1;
        while (len < 4 && ns >= len && (static_cast<unsigned char>(s[ns - len]) & 0xC0) == 0x80) ++len;
        ns -= cp < 0x80 ? 1 : len;
      }
      start = std::max(ns, start_offset);
    }
    if (a->rstrip) {
      while (stop < s.size()) {
        uint32_t cp;
        const size_t len = unicode::utf8_decode(s, stop, cp);
        if (cp == unicode::kInvalid || !unicode::is_white_space(cp)) break;
        stop += len;
      }
    }
    if (start_offset < start) out.emplace_back(nullptr, s.substr(start_offset, start - start_offset));
    out.emplace_back(a, s.substr(start, stop - start));
    start_offset = stop;
  }
  if (start_offset < s.size()) out.emplace_back(nullptr, s.substr(start_offset));
}

void HfTokenizer::Impl::encode_text(std::string_view text, std::vector<int32_t>& out) const {
  std::vector<std::pair<const Added*, std::string_view>> parts;
  split_added(text, raw_matcher, parts);
  for (const auto& [a, piece] : parts) {
    if (a) {
      out.push_back(a->id);
      continue;
    }
    if (nfc) {
      const std::string n = unicode::nfc(piece);
      encode_normalized(n, out);
    } else {
      encode_normalized(piece, out);
    }
  }
}

void HfTokenizer::Impl::encode_normalized(std::string_view text, std::vector<int32_t>& out) const {
  if (normalized_matcher.empty) {
    pre_tokenize(text, 0, out);
    return;
  }
  std::vector<std::pair<const Added*, std::string_view>> parts;
  split_added(text, normalized_matcher, parts);
  for (const auto& [a, piece] : parts) {
    if (a)
      out.push_back(a->id);
    else
      pre_tokenize(piece, 0, out);
  }
}

namespace {

// The pieces of `s` for a Split step: matches and the text between them, as (view, is_match).
template <class Fn>
void split_by_matches(std::string_view s, const PreStep& st, Fn&& emit) {
  std::vector<std::pair<std::string_view, bool>> parts;
  size_t prev = 0, pos = 0;
  while (pos <= s.size()) {
    size_t a, b;
    if (st.regex) {
      if (!st.regex->find(s, pos, &a, &b)) break;
    } else {
      a = s.find(st.literal, pos);
      if (a == std::string_view::npos) break;
      b = a + st.literal.size();
    }
    if (b == a) {  // an empty match splits nothing; search again one character on
      if (a >= s.size()) break;
      uint32_t cp;
      pos = a + unicode::utf8_decode(s, a, cp);
      continue;
    }
    if (prev != a) parts.emplace_back(s.substr(prev, a - prev), false);
    parts.emplace_back(s.substr(a, b - a), true);
    prev = pos = b;
  }
  if (prev < s.size()) parts.emplace_back(s.substr(prev), false);
  if (st.invert)
    for (auto& p : parts) p.second = !p.second;
  switch (st.behavior) {
    case Behavior::Removed:
      for (const auto& [v, m] : parts)
        if (!m) emit(v);
      break;
    case Behavior::Isolated:
      for (const auto& [v, m] : parts) emit(v);
      break;
    case Behavior::MergedWithPrevious:
    case Behavior::Contiguous: {
      // The library's folds: MergedWithPrevious appends a match to the piece before it unless that
      // piece was itself a match; Contiguous joins neighbours of the same kind (runs of matches).
      std::vector<std::string_view> acc;
      bool previous_match = false;
      for (const auto& [v, m] : parts) {
        const bool join = st.behavior == Behavior::Contiguous ? m == previous_match : (m && !previous_match);
        if (join && !acc.empty())
          acc.back() = std::string_view(acc.back().data(), acc.back().size() + v.size());
        else
          acc.push_back(v);
        previous_match = m;
      }
      for (auto v : acc) emit(v);
      break;
    }
    case Behavior::MergedWithNext: {
      // The same fold from the end: a match is prepended to the piece after it unless that piece
      // was itself a match.
      std::vector<std::string_view> acc;
      bool previous_match = false;
      for (auto it = parts.rbegin(); it != parts.rend(); ++it) {
        const auto& [v, m] = *it;
        if (m && !previous_match && !acc.empty())
          acc.back() = std::string_view(v.data(), v.size() + acc.back().size());
        else
          acc.push_back(v);
        previous_match = m;
      }
      for (auto it = acc.rbegin(); it != acc.rend(); ++it) emit(*it);
      break;
    }
  }
}

bool is_numeric(uint32_t cp) {
  if (cp < 0x80) return cp >= '0' && cp <= '9';
  if (cp == unicode::kInvalid) return false;
  const auto c = unicode::category(cp);
  return c == unicode::Category::Nd || c == unicode::Category::Nl || c == unicode::Category::No;
}

}  // namespace

void HfTokenizer::Impl::pre_tokenize(std::string_view piece, size_t step, std::vector<int32_t>& out) const {
  if (piece.empty()) return;
  const PreStep& st = steps[step];
  switch (st.kind) {
    case PreStep::Split:
      split_by_matches(piece, st, [&](std::string_view v) { pre_tokenize(v, step + 1, out); });
      return;
    case PreStep::Digits: {
      // Digits: each digit (individual_digits) or each run of digits is its own piece.
      size_t i = 0, run_start = 0;
      bool in_digits = false;
      while (i < piece.size()) {
        uint32_t cp;
        const size_t len = unicode::utf8_decode(piece, i, cp);
        const bool d = is_numeric(cp);
        if (d && st.individual_digits) {
          if (i > run_start) pre_tokenize(piece.substr(run_start, i - run_start), step + 1, out);
          pre_tokenize(piece.substr(i, len), step + 1, out);
          run_start = i + len;
        } else if (i > run_start && d != in_digits) {
          pre_tokenize(piece.substr(run_start, i - run_start), step + 1, out);
          run_start = i;
        }
        in_digits = d;
        i += len;
      }
      if (run_start < piece.size()) pre_tokenize(piece.substr(run_start), step + 1, out);
      return;
    }
    case PreStep::ByteLevel: {
      std::string prefixed;
      std::string_view p = piece;
      if (st.add_prefix_space && piece[0] != ' ') {
        prefixed.reserve(piece.size() + 1);
        prefixed.push_back(' ');
        prefixed.append(piece);
        p = prefixed;
      }
      if (st.use_regex)
        for (std::string_view w : Gpt2Tokenizer::pretokenize(p)) bpe_word(w, out);
      else
        bpe_word(p, out);
      return;
    }
  }
}

namespace {

constexpr size_t kMaxCacheEntries = size_t{1} << 18;
constexpr size_t kMaxCachedWord = 256;

struct ThreadCache {
  uint64_t owner = 0;
  std::unordered_map<std::string, std::vector<int32_t>, StrHash, std::equal_to<>> words;
};

}  // namespace

void HfTokenizer::Impl::bpe_word(std::string_view word, std::vector<int32_t>& out) const {
  if (word.size() == 1 && byte_id[static_cast<unsigned char>(word[0])] >= 0) {
    out.push_back(byte_id[static_cast<unsigned char>(word[0])]);
    return;
  }
  if (ignore_merges) {
    auto it = bytes_to_id.find(word);
    if (it != bytes_to_id.end()) {
      out.push_back(it->second);
      return;
    }
  }
  if (word.size() > kMaxCachedWord) {
    bpe_uncached(word, out);
    return;
  }
  thread_local ThreadCache cache;
  if (cache.owner != serial) {
    cache.words.clear();
    cache.owner = serial;
  }
  auto it = cache.words.find(word);
  if (it != cache.words.end()) {
    out.insert(out.end(), it->second.begin(), it->second.end());
    return;
  }
  const size_t before = out.size();
  bpe_uncached(word, out);
  if (cache.words.size() >= kMaxCacheEntries) cache.words.clear();
  cache.words.emplace(std::string(word), std::vector<int32_t>(out.begin() + static_cast<ptrdiff_t>(before), out.end()));
}

void HfTokenizer::Impl::bpe_uncached(std::string_view word, std::vector<int32_t>& out) const {
  // Symbols form a linked list over byte positions; a merged symbol lives at its first byte. Bytes
  // missing from the vocabulary become the unknown token (fused when fuse_unk) or are dropped, as
  // the library does.
  const int n = static_cast<int>(word.size());
  std::vector<int32_t> id;
  id.reserve(static_cast<size_t>(n));
  for (int k = 0; k < n; ++k) {
    const int32_t b = byte_id[static_cast<unsigned char>(word[static_cast<size_t>(k)])];
    if (b >= 0) {
      id.push_back(b);
    } else if (unk >= 0) {
      if (!(fuse_unk && !id.empty() && id.back() == unk)) id.push_back(unk);
    }
  }
  const int m = static_cast<int>(id.size());
  if (m == 0) return;
  std::vector<int> next(static_cast<size_t>(m)), prev(static_cast<size_t>(m));
  std::vector<char> alive(static_cast<size_t>(m), 1);
  for (int k = 0; k < m; ++k) {
    next[k] = k + 1 < m ? k + 1 : -1;
    prev[k] = k - 1;
  }
  struct Cand {
    int32_t rank, left, right, left_id, right_id, merged;
    bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : left > o.left; }
  };
  std::priority_queue<Cand, std::vector<Cand>, std::greater<Cand>> heap;
  auto push = [&](int l) {
    if (l < 0 || next[l] < 0) return;
    const int r = next[l];
    const uint64_t key = (static_cast<uint64_t>(id[l]) << 32) | static_cast<uint32_t>(id[r]);
    auto it = merges.find(key);
    if (it != merges.end()) heap.push(Cand{it->second.first, l, r, id[l], id[r], it->second.second});
  };
  for (int k = 0; k + 1 < m; ++k) push(k);
  while (!heap.empty()) {
    const Cand c = heap.top();
    heap.pop();
    if (!alive[c.left] || !alive[c.right] || next[c.left] != c.right || id[c.left] != c.left_id ||
        id[c.right] != c.right_id)
      continue;
    id[c.left] = c.merged;
    alive[c.right] = 0;
    next[c.left] = next[c.right];
    if (next[c.right] >= 0) prev[next[c.right]] = c.left;
    push(prev[c.left]);
    push(c.left);
  }
  for (int k = 0; k >= 0; k = next[k]) out.push_back(id[k]);
}

void HfTokenizer::encode_into(std::string_view text, std::vector<int32_t>& out) const { impl_->encode_text(text, out); }

std::vector<int32_t> HfTokenizer::encode(std::string_view text) const {
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 8);
  impl_->encode_text(text, out);
  return out;
}

std::vector<int32_t> HfTokenizer::encode_with_special(std::string_view text) const {
  std::vector<int32_t> out(prefix_);
  impl_->encode_text(text, out);
  out.insert(out.end(), suffix_.begin(), suffix_.end());
  return out;
}

void HfTokenizer::encode_document(std::string_view text, std::vector<int32_t>& out) const {
  out.insert(out.end(), prefix_.begin(), prefix_.end());
  impl_->encode_text(text, out);
  out.insert(out.end(), suffix_.begin(), suffix_.end());
}

// ---------------------------------------------------------------------------------------------
// Decoding

std::string utf8_lossy(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  size_t i = 0;
  while (i < n) {
    const unsigned b0 = p[i];
    if (b0 < 0x80) {
      out.push_back(static_cast<char>(b0));
      ++i;
      continue;
    }
    // Expected length and the allowed range of the second byte (Unicode Table 3-7).
    size_t need = 0;
    unsigned lo = 0x80, hi = 0xBF;
    if (b0 >= 0xC2 && b0 <= 0xDF) need = 2;
    else if (b0 == 0xE0) need = 3, lo = 0xA0;
    else if ((b0 >= 0xE1 && b0 <= 0xEC) || b0 == 0xEE || b0 == 0xEF) need = 3;
    else if (b0 == 0xED) need = 3, hi = 0x9F;
    else if (b0 == 0xF0) need = 4, lo = 0x90;
    else if (b0 >= 0xF1 && b0 <= 0xF3) need = 4;
    else if (b0 == 0xF4) need = 4, hi = 0x8F;
    size_t k = 1;
    if (need) {
      for (; k < need && i + k < n; ++k) {
        const unsigned b = p[i + k];
        const bool ok = k == 1 ? (b >= lo && b <= hi) : (b >= 0x80 && b <= 0xBF);
        if (!ok) break;
      }
    }
    if (need && k == need) {
      out.append(s.substr(i, need));
      i += need;
    } else {
      out.append("\xEF\xBF\xBD");  // U+FFFD for the maximal ill-formed subpart
      i += std::max<size_t>(k, 1);
    }
  }
  return out;
}

std::string HfTokenizer::decode(std::span<const int32_t> ids) const { return decode(ids, false); }

std::string HfTokenizer::decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
  const Impl& m = *impl_;
  const ByteAlphabet& ab = alphabet();
  std::string bytes, tmp;
  bytes.reserve(ids.size() * 4);
  for (size_t i = 0; i < ids.size(); ++i) {
    const int32_t id = ids[i];
    const std::string* text = nullptr;
    auto a = m.added_by_id.find(id);
    if (a != m.added_by_id.end()) {
      if (skip_special_tokens && a->second->special) continue;
      text = &a->second->content;
    } else if (id >= 0 && static_cast<size_t>(id) < m.id_to_token.size() && !m.id_to_token[static_cast<size_t>(id)].empty()) {
      text = &m.id_to_token[static_cast<size_t>(id)];
    } else {
      throw std::out_of_range("hf tokenizer " + m.where + ": cannot decode id " + std::to_string(id) + " (position " +
                              std::to_string(i) + "): not in the vocabulary");
    }
    // ByteLevel decoder: a token all of whose characters are in the byte alphabet becomes those
    // bytes; any other token keeps its own UTF-8 bytes.
    if (ab.to_bytes(*text, tmp))
      bytes += tmp;
    else
      bytes += *text;
  }
  return utf8_lossy(bytes);
}

}  // namespace mt
