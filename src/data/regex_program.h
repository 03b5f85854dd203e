// The compiled form of a Regex (private to regex.cpp, which runs it, and regex_compile.cpp, which
// parses a pattern into it): character sets and the instructions of a backtracking machine.
#pragma once
#include <cstdint>
#include <string_view>
#include <utility>
#include <vector>

#include "data/regex.h"
#include "data/unicode_data.h"

namespace mt {

namespace rx {

using unicode::Category;

// One member of a character class: ranges of code points, general categories and White_Space,
// possibly negated (\S, \P{L} inside [...]).
struct ClassItem {
  std::vector<std::pair<uint32_t, uint32_t>> ranges;
  uint32_t cats = 0;  // bit per unicode::Category
  bool space = false;
  bool negated = false;
  bool contains(uint32_t cp) const {
    bool in = false;
    if (space && cp != unicode::kInvalid && unicode::is_white_space(cp)) in = true;
    if (!in && cats) {
      const Category c = cp == unicode::kInvalid ? Category::Cn : unicode::category(cp);
      in = (cats >> static_cast<int>(c)) & 1u;
    }
    if (!in)
      for (const auto& [lo, hi] : ranges)
        if (cp >= lo && cp <= hi) {
          in = true;
          break;
        }
    return in != negated;
  }
};

struct CharSet {
  std::vector<ClassItem> items;
  bool negated = false;
  uint64_t ascii[2] = {0, 0};  // membership of U+0000..U+007F, negation applied
  bool slow(uint32_t cp) const {
    bool in = false;
    for (const auto& it : items)
      if (it.contains(cp)) {
        in = true;
        break;
      }
    return in != negated;
  }
  void finish() {
    for (uint32_t c = 0; c < 128; ++c)
      if (slow(c)) ascii[c >> 6] |= uint64_t{1} << (c & 63);
  }
  bool contains(uint32_t cp) const {
    if (cp < 128) return (ascii[cp >> 6] >> (cp & 63)) & 1u;
    return slow(cp);
  }
};

enum class Op : uint8_t { Set, Split, Jmp, Rep, Look, Assert, Match };
enum class Mode : uint8_t { Greedy, Lazy, Possessive };
enum class AssertKind : uint8_t { LineStart, LineEnd, TextStart, TextEnd, TextEndNewline };

struct Inst {
  Op op;
  Mode mode = Mode::Greedy;
  bool neg = false;
  AssertKind assert_kind = AssertKind::TextStart;
  int x = 0, y = 0;  // jump targets (Split: preferred x, then y; Look: continue at x)
  int set = -1;
  int min = 0, max = -1;  // Rep: max -1 = unbounded
};

}  // namespace rx

struct Regex::Program {
  std::vector<rx::Inst> code;
  std::vector<rx::CharSet> sets;
  size_t run(std::string_view text, int pc, size_t pos) const;
};

namespace rx {
// Parses `pattern` into `prog` (its sets, then its code ending in Match); throws
// std::invalid_argument("regex '<pattern>': <what> at offset N").
void compile(std::string_view pattern, Regex::Program& prog);
}  // namespace rx

}  // namespace mt
