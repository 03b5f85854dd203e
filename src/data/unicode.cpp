// Lookups over the generated tables of unicode_data.cpp, UTF-8 helpers, and NFC.
#include <algorithm>
#include <array>
#include <memory>
#include <unordered_map>
#include <vector>

#include "data/unicode_data.h"

namespace mt::unicode {

namespace {

// Category of every BMP code point, filled once from the segments (the common case of a lookup).
struct BmpCategories {
  std::array<uint8_t, 0x10000> cat{};
  BmpCategories() {
    for (size_t i = 0; i < kCategorySegmentsCount; ++i) {
      const uint32_t first = kCategorySegments[i] >> 5;
      if (first >= 0x10000) break;
      const uint32_t last = i + 1 < kCategorySegmentsCount ? std::min<uint32_t>(kCategorySegments[i + 1] >> 5, 0x10000)
                                                           : 0x10000;
      std::fill(cat.begin() + first, cat.begin() + last, static_cast<uint8_t>(kCategorySegments[i] & 31u));
    }
  }
};

const BmpCategories& bmp() {
  static const BmpCategories t;
  return t;
}

uint32_t segment_value(const uint32_t* seg, size_t n, int shift, uint32_t cp) {
  const uint32_t key = (cp << shift) | ((1u << shift) - 1);
  const uint32_t* it = std::upper_bound(seg, seg + n, key);
  if (it == seg) return 0;
  return *(it - 1) & ((1u << shift) - 1);
}

}  // namespace

Category category(uint32_t cp) {
  if (cp < 0x10000) return static_cast<Category>(bmp().cat[cp]);
  if (cp > 0x10FFFF) return Category::Cn;
  return static_cast<Category>(segment_value(kCategorySegments, kCategorySegmentsCount, 5, cp));
}

bool is_white_space(uint32_t cp) {
  if (cp < 0x80) return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20;
  return cp == 0x85 || cp == 0xA0 || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 ||
         cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

uint8_t combining_class(uint32_t cp) {
  if (cp < 0x300 || cp > 0x10FFFF) return 0;
  return static_cast<uint8_t>(segment_value(kCombiningSegments, kCombiningSegmentsCount, 8, cp));
}

bool parse_category(std::string_view name, Category* out) {
  static const char* names[kNumCategories] = {"Cn", "Lu", "Ll", "Lt", "Lm", "Lo", "Mn", "Mc", "Me", "Nd",
                                              "Nl", "No", "Pc", "Pd", "Ps", "Pe", "Pi", "Pf", "Po", "Sm",
                                              "Sc", "Sk", "So", "Zs", "Zl", "Zp", "Cc", "Cf", "Cs", "Co"};
  for (int i = 0; i < kNumCategories; ++i)
    if (name == names[i]) {
      *out = static_cast<Category>(i);
      return true;
    }
  return false;
}

void utf8_append(uint32_t cp, std::string& out) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

bool utf8_valid(std::string_view s, size_t* bad) {
  for (size_t i = 0; i < s.size();) {
    if (static_cast<unsigned char>(s[i]) < 0x80) {
      ++i;
      continue;
    }
    uint32_t cp;
    const size_t n = utf8_decode(s, i, cp);
    if (cp == kInvalid) {
      if (bad) *bad = i;
      return false;
    }
    i += n;
  }
  return true;
}

// ---------------------------------------------------------------------------------------------
// NFC (Unicode Standard Annex #15): full canonical decomposition, canonical ordering of combining
// marks, then canonical composition of unblocked pairs.

namespace {

constexpr uint32_t SBase = 0xAC00, LBase = 0x1100, VBase = 0x1161, TBase = 0x11A7;
constexpr uint32_t LCount = 19, VCount = 21, TCount = 28, NCount = VCount * TCount, SCount = LCount * NCount;
// Bytes that are not UTF-8 travel as these values (starters that neither decompose nor compose).
constexpr uint32_t kRawByte = 0x200000;

const Decomposition* find_decomposition(uint32_t cp) {
  const Decomposition* end = kDecompositions + kDecompositionsCount;
  const Decomposition* it =
      std::lower_bound(kDecompositions, end, cp, [](const Decomposition& d, uint32_t c) { return d.cp < c; });
  return it != end && it->cp == cp ? it : nullptr;
}

void decompose(uint32_t cp, std::vector<uint32_t>& out) {
  if (cp >= SBase && cp < SBase + SCount) {
    const uint32_t s = cp - SBase;
    out.push_back(LBase + s / NCount);
    out.push_back(VBase + (s % NCount) / TCount);
    if (s % TCount) out.push_back(TBase + s % TCount);
    return;
  }
  const Decomposition* d = cp < 0xC0 || cp >= kRawByte ? nullptr : find_decomposition(cp);
  if (!d) {
    out.push_back(cp);
    return;
  }
  decompose(d->first, out);
  if (d->second) decompose(d->second, out);
}

const std::unordered_map<uint64_t, uint32_t>& compositions() {
  static const auto* m = [] {
    auto* t = new std::unordered_map<uint64_t, uint32_t>();
    for (size_t i = 0; i < kDecompositionsCount; ++i)
      if (kDecompositions[i].composes)
        t->emplace((uint64_t{kDecompositions[i].first} << 32) | kDecompositions[i].second, kDecompositions[i].cp);
    return t;
  }();
  return *m;
}

uint32_t compose(uint32_t a, uint32_t b) {
  if (a >= LBase && a < LBase + LCount && b >= VBase && b < VBase + VCount)
    return SBase + ((a - LBase) * VCount + (b - VBase)) * TCount;
  if (a >= SBase && a < SBase + SCount && (a - SBase) % TCount == 0 && b > TBase && b < TBase + TCount)
    return a + (b - TBase);
  const auto& m = compositions();
  auto it = m.find((uint64_t{a} << 32) | b);
  return it == m.end() ? 0 : it->second;
}

uint8_t ccc_of(uint32_t cp) { return cp >= kRawByte ? 0 : combining_class(cp); }

}  // namespace

std::string nfc(std::string_view s) {
  // Fast path: ASCII text is already NFC.
  size_t i = 0;
  while (i < s.size() && static_cast<unsigned char>(s[i]) < 0x80) ++i;
  if (i == s.size()) return std::string(s);
  std::vector<uint32_t> d;
  d.reserve(s.size());
  for (size_t k = 0; k < s.size();) {
    uint32_t cp;
    const size_t n = utf8_decode(s, k, cp);
    if (cp == kInvalid) cp = kRawByte + static_cast<unsigned char>(s[k]);
    decompose(cp, d);
    k += n;
  }
  // Canonical ordering: stable sort of each run of non-starters by combining class.
  for (size_t a = 0; a < d.size();) {
    if (ccc_of(d[a]) == 0) {
      ++a;
      continue;
    }
    size_t b = a;
    while (b < d.size() && ccc_of(d[b]) != 0) ++b;
    std::stable_sort(d.begin() + static_cast<std::ptrdiff_t>(a), d.begin() + static_cast<std::ptrdiff_t>(b),
                     [](uint32_t x, uint32_t y) { return ccc_of(x) < ccc_of(y); });
    a = b;
  }
  // Composition: a character combines with the last starter unless a character between them is a
  // starter or has a combining class >= its own (blocked).
  std::vector<uint32_t> out;
  out.reserve(d.size());
  ptrdiff_t starter = -1;
  uint8_t last_cc = 0;
  for (uint32_t c : d) {
    const uint8_t cc = ccc_of(c);
    if (starter >= 0 && c < kRawByte && out[static_cast<size_t>(starter)] < kRawByte) {
      const bool adjacent = static_cast<size_t>(starter) + 1 == out.size();
      if (adjacent || (last_cc != 0 && last_cc < cc)) {
        if (const uint32_t p = compose(out[static_cast<size_t>(starter)], c)) {
          out[static_cast<size_t>(starter)] = p;
          continue;
        }
      }
    }
    if (cc == 0) starter = static_cast<ptrdiff_t>(out.size());
    last_cc = cc;
    out.push_back(c);
  }
  std::string r;
  r.reserve(s.size());
  for (uint32_t c : out) {
    if (c >= kRawByte)
      r.push_back(static_cast<char>(c - kRawByte));
    else
      utf8_append(c, r);
  }
  return r;
}

}  // namespace mt::unicode
