#include "data/tokenizer.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "data/bpe.h"
#include "data/hf_tokenizer.h"
#include "data/unicode_data.h"
#include "data/unicode_tables.h"
#include "runtime/strings.h"

namespace mt {

using unicode::CharClass;

// ---------------------------------------------------------------------------------------------
// ByteTokenizer

std::vector<int32_t> ByteTokenizer::encode(std::string_view text) const {
  std::vector<int32_t> ids(text.size());
  for (size_t i = 0; i < text.size(); ++i) ids[i] = static_cast<unsigned char>(text[i]);
  return ids;
}

std::string ByteTokenizer::decode(std::span<const int32_t> ids) const {
  std::string out(ids.size(), '\0');
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] > 255)
      throw std::out_of_range("byte tokenizer: cannot decode id " + std::to_string(ids[i]) +
                              " (position " + std::to_string(i) + "); ids must be in [0, 256)");
    out[i] = static_cast<char>(ids[i]);
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// UTF-8 and character classes

namespace {

struct AsciiClasses {
  CharClass cls[128];
  AsciiClasses() {
    for (uint32_t c = 0; c < 128; ++c) cls[c] = unicode::char_class(c);
  }
};

inline CharClass class_of(uint32_t cp) {
  static const AsciiClasses ascii;
  if (cp < 128) return ascii.cls[cp];
  return unicode::char_class(cp);  // unicode::kInvalid -> Other
}

// GPT-2's bytes_to_unicode(): printable bytes map to themselves, the other 68 bytes to U+0100.. in
// byte order. Returns the inverse (code point -> byte, -1 when the code point is not used).
std::vector<int> unicode_to_byte_table() {
  std::vector<int> inv(324, -1);
  auto printable = [](int b) {
    return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
  };
  int extra = 0;
  for (int b = 0; b < 256; ++b) {
    if (printable(b))
      inv[b] = b;
    else
      inv[256 + extra++] = b;
  }
  return inv;
}

// Maps a string written in GPT-2's byte alphabet (as in encoder.json / vocab.bpe) back to bytes.
bool alphabet_to_bytes(std::string_view s, const std::vector<int>& inv, std::string& out) {
  out.clear();
  for (size_t i = 0; i < s.size();) {
    uint32_t cp;
    i += unicode::utf8_decode(s, i, cp);
    if (cp >= inv.size() || inv[cp] < 0) return false;
    out.push_back(static_cast<char>(inv[cp]));
  }
  return true;
}

constexpr size_t kMaxCacheEntries = size_t{1} << 20;

}  // namespace

// ---------------------------------------------------------------------------------------------
// Gpt2Tokenizer: loading

Gpt2Tokenizer::Gpt2Tokenizer(const std::string& dir, int32_t vocab_size) {
  namespace fs = std::filesystem;
  const fs::path enc_path = fs::path(dir) / "encoder.json";
  const fs::path bpe_path = fs::path(dir) / "vocab.bpe";
  for (const auto& p : {enc_path, bpe_path})
    if (!fs::is_regular_file(p))
      throw std::runtime_error("gpt2 tokenizer: missing file " + p.string() +
                               " (the directory must hold the GPT-2 files encoder.json and vocab.bpe)");
  const std::vector<int> inv = unicode_to_byte_table();

  // encoder.json: {"token in the byte alphabet": id, ...}
  nlohmann::json enc;
  {
    std::ifstream f(enc_path);
    if (!f) throw std::runtime_error("gpt2 tokenizer: cannot open " + enc_path.string());
    try {
      enc = nlohmann::json::parse(f);
    } catch (const nlohmann::json::exception& e) {
      throw std::runtime_error("gpt2 tokenizer: " + enc_path.string() + " is not valid JSON: " + json_error_text(e.what()));
    }
  }
  if (!enc.is_object() || enc.empty())
    throw std::runtime_error("gpt2 tokenizer: " + enc_path.string() + " must be a non-empty JSON object");
  std::unordered_map<std::string, int32_t> bytes_to_id;
  bytes_to_id.reserve(enc.size());
  int64_t max_id = -1;
  for (auto it = enc.begin(); it != enc.end(); ++it)
    if (it.value().is_number_integer()) max_id = std::max<int64_t>(max_id, it.value().get<int64_t>());
  if (max_id < 0 || max_id >= (int64_t{1} << 24))
    throw std::runtime_error("gpt2 tokenizer: " + enc_path.string() + " has no usable token ids");
  id_to_bytes_.assign(static_cast<size_t>(max_id + 1), std::string());
  std::vector<bool> used(id_to_bytes_.size(), false);
  std::string bytes;
  for (auto it = enc.begin(); it != enc.end(); ++it) {
    const std::string& key = it.key();
    if (!it.value().is_number_integer() || it.value().get<int64_t>() < 0)
      throw std::runtime_error("gpt2 tokenizer: " + enc_path.string() + ": key \"" + key +
                               "\" must map to a non-negative integer id");
    const auto id = static_cast<int32_t>(it.value().get<int64_t>());
    if (used[static_cast<size_t>(id)])
      throw std::runtime_error("gpt2 tokenizer: " + enc_path.string() + ": id " + std::to_string(id) +
                               " is used twice (key \"" + key + "\")");
    used[static_cast<size_t>(id)] = true;
    if (key == "<|endoftext|>") eot_ = id;
    if (!alphabet_to_bytes(key, inv, bytes))
      throw std::runtime_error("gpt2 tokenizer: " + enc_path.string() + ": key \"" + key +
                               "\" has a character outside GPT-2's byte alphabet");
    id_to_bytes_[static_cast<size_t>(id)] = bytes;
    if (id != eot_) bytes_to_id.emplace(bytes, id);
  }
  for (int b = 0; b < 256; ++b) {
    auto it = bytes_to_id.find(std::string(1, static_cast<char>(b)));
    if (it == bytes_to_id.end())
      throw std::runtime_error("gpt2 tokenizer: " + enc_path.string() + " has no token for byte " +
                               std::to_string(b) + " (a byte-level BPE vocabulary needs all 256)");
    byte_id_[b] = it->second;
  }

  // vocab.bpe: "#version: ..." then one merge "left right" per line, best (lowest rank) first.
  std::ifstream f(bpe_path);
  if (!f) throw std::runtime_error("gpt2 tokenizer: cannot open " + bpe_path.string());
  std::string line, left, right;
  int32_t rank = 0;
  merges_.reserve(60000);
  for (size_t lineno = 1; std::getline(f, line); ++lineno) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty() || (lineno == 1 && line.rfind("#version", 0) == 0)) continue;
    const size_t sp = line.find(' ');
    auto bad = [&](const std::string& why) {
      return std::runtime_error("gpt2 tokenizer: " + bpe_path.string() + " line " + std::to_string(lineno) +
                                ": " + why + ": \"" + line + "\"");
    };
    if (sp == std::string::npos || sp == 0 || sp + 1 >= line.size() || line.find(' ', sp + 1) != std::string::npos)
      throw bad("expected two tokens separated by one space");
    if (!alphabet_to_bytes(std::string_view(line).substr(0, sp), inv, left) ||
        !alphabet_to_bytes(std::string_view(line).substr(sp + 1), inv, right))
      throw bad("character outside GPT-2's byte alphabet");
    auto l = bytes_to_id.find(left), r = bytes_to_id.find(right), m = bytes_to_id.find(left + right);
    if (l == bytes_to_id.end() || r == bytes_to_id.end() || m == bytes_to_id.end())
      throw bad("merge whose parts or result are not in encoder.json");
    merges_.emplace(bpe_pair(l->second, r->second), BpeMerge{rank, m->second});  // a repeated pair keeps its first (best) rank
    ++rank;
  }
  if (merges_.empty()) throw std::runtime_error("gpt2 tokenizer: " + bpe_path.string() + " holds no merges");
  if (vocab_size > 0) cut_vocabulary(vocab_size);
}

// Keeps the byte tokens and the merges whose parts and result have ids below vocab_size - 1 (in
// GPT-2's files the ids follow the merge ranks, so these are the vocab_size - 257 most frequent
// merges); <|endoftext|> becomes the last id.
void Gpt2Tokenizer::cut_vocabulary(int32_t vocab_size) {
  const auto full = static_cast<int32_t>(id_to_bytes_.size());
  if (vocab_size >= full) {
    if (vocab_size == full) return;
    throw std::runtime_error("gpt2 tokenizer: --vocab-size " + std::to_string(vocab_size) + " exceeds GPT-2's " +
                             std::to_string(full) + " tokens (choose 257.." + std::to_string(full) + ")");
  }
  const int32_t limit = vocab_size - 1;  // ids kept as they are; the last one is <|endoftext|>
  for (int b = 0; b < 256; ++b)
    if (byte_id_[b] >= limit || vocab_size < 257)
      throw std::runtime_error("gpt2 tokenizer: --vocab-size " + std::to_string(vocab_size) +
                               " is too small: the 256 byte tokens and <|endoftext|> need at least 257");
  for (auto it = merges_.begin(); it != merges_.end();) {
    const auto l = static_cast<int32_t>(it->first >> 32), r = static_cast<int32_t>(it->first & 0xffffffffu);
    it = it->second.id >= limit || l >= limit || r >= limit ? merges_.erase(it) : std::next(it);
  }
  std::string eot = eot_ >= 0 ? id_to_bytes_[static_cast<size_t>(eot_)] : std::string("<|endoftext|>");
  id_to_bytes_.resize(static_cast<size_t>(vocab_size));
  id_to_bytes_.back() = std::move(eot);
  eot_ = limit;
  cut_ = true;
}

const std::string& Gpt2Tokenizer::token_bytes(int32_t id) const {
  if (id < 0 || static_cast<size_t>(id) >= id_to_bytes_.size())
    throw std::out_of_range("gpt2 tokenizer: token id " + std::to_string(id) + " is outside [0, " +
                            std::to_string(id_to_bytes_.size()) + ")");
  return id_to_bytes_[static_cast<size_t>(id)];
}

std::string Gpt2Tokenizer::decode(std::span<const int32_t> ids) const {
  std::string out;
  out.reserve(ids.size() * 4);
  for (int32_t id : ids) out += token_bytes(id);
  return out;
}

// ---------------------------------------------------------------------------------------------
// Pre-tokenisation: 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// A match always starts where the previous one ended (the last alternatives accept any character),
// so the regex reduces to a left-to-right scan that tries the alternatives in order.

std::vector<std::string_view> Gpt2Tokenizer::pretokenize(std::string_view s) {
  std::vector<std::string_view> pieces;
  const size_t n = s.size();
  size_t i = 0;
  while (i < n) {
    // 's 't 're 've 'm 'll 'd (case-sensitive, as in GPT-2).
    if (s[i] == '\'' && i + 1 < n) {
      const char c = s[i + 1];
      if (c == 's' || c == 't' || c == 'm' || c == 'd') {
        pieces.push_back(s.substr(i, 2));
        i += 2;
        continue;
      }
      if (i + 2 < n) {
        const char d = s[i + 2];
        if ((c == 'r' && d == 'e') || (c == 'v' && d == 'e') || (c == 'l' && d == 'l')) {
          pieces.push_back(s.substr(i, 3));
          i += 3;
          continue;
        }
      }
    }
    uint32_t cp;
    size_t len = unicode::utf8_decode(s, i, cp);
    CharClass cls = class_of(cp);
    size_t j = i;  // where the run of letters / numbers / others starts
    if (s[i] == ' ' && i + 1 < n) {
      uint32_t cp2;
      const size_t len2 = unicode::utf8_decode(s, i + 1, cp2);
      const CharClass cls2 = class_of(cp2);
      if (cls2 != CharClass::Space) {  // " ?\p{L}+", " ?\p{N}+", " ?[^\s\p{L}\p{N}]+"
        j = i + 1;
        len = len2;
        cls = cls2;
      }
    }
    if (cls != CharClass::Space) {
      size_t e = j + len;
      while (e < n) {
        const size_t l = unicode::utf8_decode(s, e, cp);
        if (class_of(cp) != cls) break;
        e += l;
      }
      pieces.push_back(s.substr(i, e - i));
      i = e;
      continue;
    }
    // A run of white space. "\s+(?!\S)" takes all of it at the end of the text, or all but its last
    // character when a non-space follows; a single space before a non-space falls to "\s+".
    size_t e = i, last = i;
    while (e < n) {
      const size_t l = unicode::utf8_decode(s, e, cp);
      if (class_of(cp) != CharClass::Space) break;
      last = e;
      e += l;
    }
    const size_t end = (e < n && last > i) ? last : e;
    pieces.push_back(s.substr(i, end - i));
    i = end;
  }
  return pieces;
}

// ---------------------------------------------------------------------------------------------
// BPE

void Gpt2Tokenizer::bpe_uncached(std::string_view word, std::vector<int32_t>& out) const {
  std::vector<int32_t> id(word.size());
  for (size_t k = 0; k < word.size(); ++k) id[k] = byte_id_[static_cast<unsigned char>(word[k])];
  bpe_merge(std::move(id), merges_, out);
}

void Gpt2Tokenizer::bpe(std::string_view word, std::vector<int32_t>& out) const {
  if (word.size() == 1) {
    out.push_back(byte_id_[static_cast<unsigned char>(word[0])]);
    return;
  }
  auto it = cache_.find(word);
  if (it != cache_.end()) {
    out.insert(out.end(), it->second.begin(), it->second.end());
    return;
  }
  const size_t before = out.size();
  bpe_uncached(word, out);
  if (cache_.size() >= kMaxCacheEntries) cache_.clear();
  cache_.emplace(std::string(word), std::vector<int32_t>(out.begin() + static_cast<ptrdiff_t>(before), out.end()));
}

std::vector<int32_t> Gpt2Tokenizer::encode(std::string_view text) const {
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 16);
  std::lock_guard<std::mutex> lock(cache_mu_);
  for (std::string_view piece : pretokenize(text)) bpe(piece, out);
  return out;
}

// ---------------------------------------------------------------------------------------------

size_t Tokenizer::token_text_bytes(int32_t id) const {
  if (id == eot_token()) return 0;
  try {
    return decode(std::span<const int32_t>(&id, 1)).size();
  } catch (const std::out_of_range&) {
    return 0;
  }
}

void Tokenizer::encode_document(std::string_view text, std::vector<int32_t>& out) const {
  const std::vector<int32_t> ids = encode(text);
  out.insert(out.end(), ids.begin(), ids.end());
}

std::string default_gpt2_dir() {
  namespace fs = std::filesystem;
  if (const char* env = std::getenv("MESHTRAIN_GPT2_DIR"); env && *env) return env;
  std::error_code ec;
  // A build tree inside the repository (build/meshtrain -> ../assets/gpt2), then the source tree
  // this binary was built from.
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec)
    for (const fs::path& d : {exe.parent_path().parent_path() / "assets" / "gpt2",
                              exe.parent_path().parent_path().parent_path() / "assets" / "gpt2"})
      if (fs::is_regular_file(d / "encoder.json", ec)) return d.string();
#ifdef MT_ASSET_DIR
  return std::string(MT_ASSET_DIR) + "/gpt2";
#else
  return "";
#endif
}

std::unique_ptr<Tokenizer> make_tokenizer(const std::string& name, const std::string& gpt2_dir,
                                          const std::string& tokenizer_file) {
  if (name == "byte") return std::make_unique<ByteTokenizer>();
  int32_t gpt2_vocab = 0;
  if (name.rfind("gpt2:", 0) == 0) {  // gpt2:N, GPT-2's BPE cut to N tokens
    char* end = nullptr;
    const long n = std::strtol(name.c_str() + 5, &end, 10);
    if (end == name.c_str() + 5 || *end != '\0' || n < 257 || n > 50257)
      throw std::runtime_error("tokenizer '" + name + "': write gpt2:N with N in 257..50257 (GPT-2's BPE cut to N tokens)");
    gpt2_vocab = static_cast<int32_t>(n);
  }
  if (name == "gpt2" || gpt2_vocab > 0) {
    const std::string dir = gpt2_dir.empty() ? default_gpt2_dir() : gpt2_dir;
    if (dir.empty() || !std::filesystem::is_directory(dir))
      throw std::runtime_error("gpt2 tokenizer: directory '" + dir +
                               "' does not exist (pass --gpt2-dir DIR holding encoder.json and vocab.bpe, or set "
                               "MESHTRAIN_GPT2_DIR; the repository ships them in assets/gpt2)");
    return std::make_unique<Gpt2Tokenizer>(dir, gpt2_vocab);
  }
  if (name == "hf") {
    if (tokenizer_file.empty())
      throw std::runtime_error("the hf tokenizer needs --tokenizer-file PATH (a Hugging Face tokenizer.json)");
    return std::make_unique<HfTokenizer>(tokenizer_file);
  }
  throw std::runtime_error("unknown tokenizer '" + name + "' (choose byte, gpt2, gpt2:N or hf)");
}

}  // namespace mt
