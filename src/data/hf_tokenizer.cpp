// Encoding and decoding with a Hugging Face tokenizer.json (hf_tokenizer.h); hf_tokenizer_load.cpp
// reads the file.
#include "data/hf_tokenizer.h"

#include <algorithm>
#include <stdexcept>

#include "data/hf_tokenizer_impl.h"
#include "data/regex.h"
#include "data/unicode_data.h"

namespace mt {

using namespace hf;

namespace {

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

}  // namespace

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
  // Bytes missing from the vocabulary become the unknown token (fused when fuse_unk) or are
  // dropped, as the library does.
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
  bpe_merge(std::move(id), merges, out);
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

size_t HfTokenizer::token_text_bytes(int32_t id) const {
  try {
    return decode(std::span<const int32_t>(&id, 1), true).size();
  } catch (const std::exception&) {
    return 0;  // an id outside the vocabulary (a gap in its ids) stands for no text
  }
}

}  // namespace mt
