#include "data/regex.h"

#include <stdexcept>

#include "data/regex_program.h"
#include "data/unicode_data.h"

namespace mt {

using namespace rx;

namespace {

// The position of the character boundary before `pos` (> 0): the start of a well-formed sequence
// ending at pos, else pos - 1 (a lone byte).
size_t prev_boundary(std::string_view s, size_t pos) {
  for (size_t len = 4; len >= 2; --len) {
    if (pos < len) continue;
    uint32_t cp;
    if (unicode::utf8_decode(s, pos - len, cp) == len && cp != unicode::kInvalid) return pos - len;
  }
  return pos - 1;
}

enum class Bt : uint8_t { Pc, RepGreedy, RepLazy };
struct Frame {
  Bt kind;
  int pc;
  size_t pos;
  size_t low;  // RepGreedy: the position after the minimum count; RepLazy: the count so far
  int inst;    // RepLazy: the Rep instruction
};

inline bool next_in(const CharSet& set, std::string_view text, size_t pos, size_t& len) {
  const unsigned char b = static_cast<unsigned char>(text[pos]);
  if (b < 0x80) {
    len = 1;
    return set.contains(b);
  }
  uint32_t cp;
  len = unicode::utf8_decode(text, pos, cp);
  return set.contains(cp);
}

}  // namespace

size_t Regex::Program::run(std::string_view text, int pc, size_t pos) const {
  thread_local std::vector<Frame> stack;
  const size_t base = stack.size();
  const size_t n = text.size();
  for (;;) {
    const Inst& in = code[static_cast<size_t>(pc)];
    size_t len;
    switch (in.op) {
      case Op::Set:
        if (pos < n && next_in(sets[static_cast<size_t>(in.set)], text, pos, len)) {
          pos += len;
          ++pc;
          continue;
        }
        goto fail;
      case Op::Split:
        stack.push_back({Bt::Pc, in.y, pos, 0, 0});
        pc = in.x;
        continue;
      case Op::Jmp: pc = in.x; continue;
      case Op::Rep: {
        const CharSet& set = sets[static_cast<size_t>(in.set)];
        int count = 0;
        size_t p = pos;
        while (count < in.min) {
          if (p >= n || !next_in(set, text, p, len)) goto fail;
          p += len;
          ++count;
        }
        if (in.mode == Mode::Lazy) {
          if (in.max < 0 || count < in.max) stack.push_back({Bt::RepLazy, pc + 1, p, static_cast<size_t>(count), pc});
          pos = p;
          ++pc;
          continue;
        }
        const size_t low = p;
        while ((in.max < 0 || count < in.max) && p < n && next_in(set, text, p, len)) {
          p += len;
          ++count;
        }
        if (in.mode == Mode::Greedy && p > low) stack.push_back({Bt::RepGreedy, pc + 1, p, low, 0});
        pos = p;
        ++pc;
        continue;
      }
      case Op::Look: {
        const bool matched = run(text, pc + 1, pos) != std::string_view::npos;
        if (matched == in.neg) goto fail;
        pc = in.x;
        continue;
      }
      case Op::Assert: {
        bool ok = false;
        switch (in.assert_kind) {
          case AssertKind::TextStart: ok = pos == 0; break;
          case AssertKind::TextEnd: ok = pos == n; break;
          case AssertKind::TextEndNewline: ok = pos == n || (pos + 1 == n && text[pos] == '\n'); break;
          case AssertKind::LineStart: ok = pos == 0 || text[pos - 1] == '\n'; break;
          case AssertKind::LineEnd: ok = pos == n || text[pos] == '\n'; break;
        }
        if (!ok) goto fail;
        ++pc;
        continue;
      }
      case Op::Match: stack.resize(base); return pos;
    }
  fail:
    for (;;) {
      if (stack.size() == base) return std::string_view::npos;
      Frame f = stack.back();
      stack.pop_back();
      if (f.kind == Bt::Pc) {
        pc = f.pc;
        pos = f.pos;
        break;
      }
      if (f.kind == Bt::RepGreedy) {
        const size_t q = prev_boundary(text, f.pos);
        if (q > f.low) stack.push_back({Bt::RepGreedy, f.pc, q, f.low, 0});
        pc = f.pc;
        pos = q;
        break;
      }
      const Inst& rep = code[static_cast<size_t>(f.inst)];
      if (f.pos < n && next_in(sets[static_cast<size_t>(rep.set)], text, f.pos, len)) {
        const size_t count = f.low + 1;
        if (rep.max < 0 || count < static_cast<size_t>(rep.max))
          stack.push_back({Bt::RepLazy, f.pc, f.pos + len, count, f.inst});
        pc = f.pc;
        pos = f.pos + len;
        break;
      }
    }
  }
}

Regex::Regex(std::string_view pattern) : pattern_(pattern), prog_(std::make_unique<Program>()) {
  rx::compile(pattern, *prog_);
}

Regex::~Regex() = default;
Regex::Regex(Regex&&) noexcept = default;
Regex& Regex::operator=(Regex&&) noexcept = default;

size_t Regex::match_at(std::string_view text, size_t at) const { return prog_->run(text, 0, at); }

bool Regex::find(std::string_view text, size_t from, size_t* start, size_t* end) const {
  for (size_t pos = from; pos <= text.size();) {
    const size_t e = prog_->run(text, 0, pos);
    if (e != std::string_view::npos) {
      *start = pos;
      *end = e;
      return true;
    }
    if (pos == text.size()) break;
    uint32_t cp;
    pos += unicode::utf8_decode(text, pos, cp);
  }
  return false;
}

}  // namespace mt
