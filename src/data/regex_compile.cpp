// Regex patterns parsed (Parser: the Oniguruma subset regex.h lists) and compiled into the
// backtracking machine's instructions (Compiler).
#include <cctype>
#include <stdexcept>
#include <string>

#include "data/regex_program.h"

namespace mt::rx {

namespace {

uint32_t cat_bit(Category c) { return 1u << static_cast<int>(c); }

uint32_t group_mask(char g) {
  using C = Category;
  switch (g) {
    case 'L': return cat_bit(C::Lu) | cat_bit(C::Ll) | cat_bit(C::Lt) | cat_bit(C::Lm) | cat_bit(C::Lo);
    case 'M': return cat_bit(C::Mn) | cat_bit(C::Mc) | cat_bit(C::Me);
    case 'N': return cat_bit(C::Nd) | cat_bit(C::Nl) | cat_bit(C::No);
    case 'P':
      return cat_bit(C::Pc) | cat_bit(C::Pd) | cat_bit(C::Ps) | cat_bit(C::Pe) | cat_bit(C::Pi) | cat_bit(C::Pf) |
             cat_bit(C::Po);
    case 'S': return cat_bit(C::Sm) | cat_bit(C::Sc) | cat_bit(C::Sk) | cat_bit(C::So);
    case 'Z': return cat_bit(C::Zs) | cat_bit(C::Zl) | cat_bit(C::Zp);
    case 'C': return cat_bit(C::Cc) | cat_bit(C::Cf) | cat_bit(C::Cs) | cat_bit(C::Co) | cat_bit(C::Cn);
  }
  return 0;
}

// A \p{..} name -> category mask (0 = unknown).
uint32_t property_mask(std::string_view name) {
  if (name.size() == 1) return group_mask(name[0]);
  if (name == "LC" || name == "L&") return cat_bit(Category::Lu) | cat_bit(Category::Ll) | cat_bit(Category::Lt);
  static const std::pair<const char*, char> long_names[] = {{"Letter", 'L'},      {"Mark", 'M'},   {"Number", 'N'},
                                                            {"Punctuation", 'P'}, {"Symbol", 'S'}, {"Separator", 'Z'},
                                                            {"Other", 'C'}};
  for (const auto& [n, g] : long_names)
    if (name == n) return group_mask(g);
  Category c;
  if (unicode::parse_category(name, &c)) return cat_bit(c);
  return 0;
}

struct Node {
  enum Kind { Empty, Set, Seq, Alt, Repeat, Look, Assert } kind = Empty;
  int set = -1;
  std::vector<Node> kids;
  int min = 0, max = -1;
  Mode mode = Mode::Greedy;
  bool neg = false;
  AssertKind assert_kind = AssertKind::TextStart;
};

bool nullable(const Node& n) {
  switch (n.kind) {
    case Node::Empty:
    case Node::Look:
    case Node::Assert: return true;
    case Node::Set: return false;
    case Node::Seq:
      for (const auto& k : n.kids)
        if (!nullable(k)) return false;
      return true;
    case Node::Alt:
      for (const auto& k : n.kids)
        if (nullable(k)) return true;
      return false;
    case Node::Repeat: return n.min == 0 || nullable(n.kids[0]);
  }
  return true;
}

class Parser {
 public:
  Parser(std::string_view p, std::vector<CharSet>& sets) : p_(p), sets_(sets) {}

  Node parse() {
    Node n = alternation();
    if (i_ < p_.size()) fail(p_[i_] == ')' ? "unmatched ')'" : "unexpected character");
    return n;
  }

 private:
  std::string_view p_;
  size_t i_ = 0;
  bool icase_ = false;
  std::vector<CharSet>& sets_;

  [[noreturn]] void fail(const std::string& what) const {
    throw std::invalid_argument("regex '" + std::string(p_) + "': " + what + " at offset " + std::to_string(i_));
  }
  bool eof() const { return i_ >= p_.size(); }
  char peek() const { return p_[i_]; }

  Node alternation() {
    Node alt;
    alt.kind = Node::Alt;
    alt.kids.push_back(sequence());
    while (!eof() && peek() == '|') {
      ++i_;
      alt.kids.push_back(sequence());
    }
    if (alt.kids.size() == 1) return std::move(alt.kids[0]);
    return alt;
  }

  Node sequence() {
    Node seq;
    seq.kind = Node::Seq;
    const bool saved_icase = icase_;
    while (!eof() && peek() != '|' && peek() != ')') {
      Node a;
      if (!atom(a)) continue;  // an inline flag group: nothing to match
      quantifier(a);
      seq.kids.push_back(std::move(a));
    }
    (void)saved_icase;
    if (seq.kids.size() == 1) return std::move(seq.kids[0]);
    if (seq.kids.empty()) seq.kind = Node::Empty;
    return seq;
  }

  int add_set(CharSet s) {
    s.finish();
    sets_.push_back(std::move(s));
    return static_cast<int>(sets_.size() - 1);
  }

  Node set_node(CharSet s) {
    Node n;
    n.kind = Node::Set;
    n.set = add_set(std::move(s));
    return n;
  }

  // Adds code point `c` (with its case variants when case-insensitive) to `item`.
  void add_char(ClassItem& item, uint32_t c) const {
    item.ranges.emplace_back(c, c);
    if (!icase_) return;
    if (c < 128 && ((c | 0x20) >= 'a' && (c | 0x20) <= 'z')) {
      const uint32_t lo = c | 0x20, up = lo & ~0x20u;
      item.ranges.emplace_back(lo == c ? up : lo, lo == c ? up : lo);
      if (lo == 's') item.ranges.emplace_back(0x17F, 0x17F);
      if (lo == 'k') item.ranges.emplace_back(0x212A, 0x212A);
    }
  }

  void add_range(ClassItem& item, uint32_t lo, uint32_t hi) const {
    if (lo > hi) fail("character range out of order");
    item.ranges.emplace_back(lo, hi);
    if (!icase_) return;
    for (uint32_t c = lo; c <= hi && c < 128; ++c)
      if ((c | 0x20) >= 'a' && (c | 0x20) <= 'z') add_char(item, c);
  }

  uint32_t hex(size_t max_digits, bool braced) {
    uint32_t v = 0;
    size_t n = 0;
    while (!eof() && n < max_digits && std::isxdigit(static_cast<unsigned char>(peek()))) {
      const char c = peek();
      v = v * 16 + static_cast<uint32_t>(c <= '9' ? c - '0' : (c | 0x20) - 'a' + 10);
      ++i_;
      ++n;
    }
    if (n == 0 || (!braced && n != max_digits && max_digits == 4)) fail("bad hexadecimal escape");
    if (v > 0x10FFFF) fail("code point above U+10FFFF");
    return v;
  }

  uint32_t literal_cp() {
    uint32_t cp;
    const size_t n = unicode::utf8_decode(p_, i_, cp);
    if (cp == unicode::kInvalid) fail("pattern is not valid UTF-8");
    i_ += n;
    return cp;
  }

  // After a backslash: fills `item` for class escapes (returns true) or sets `cp` for a single
  // character (returns false).
  bool escape(ClassItem& item, uint32_t& cp, bool in_class) {
    if (eof()) fail("pattern ends with a backslash");
    const char c = p_[i_++];
    switch (c) {
      case 's': item.space = true; return true;
      case 'S': item.space = true; item.negated = true; return true;
      case 'd': item.cats = cat_bit(Category::Nd); return true;
      case 'D': item.cats = cat_bit(Category::Nd); item.negated = true; return true;
      case 'w':
      case 'W':
        // Oniguruma's Unicode \w: letters, marks, numbers (all of N, ½ included) and connectors.
        item.cats = group_mask('L') | group_mask('M') | group_mask('N') | cat_bit(Category::Pc);
        item.negated = c == 'W';
        return true;
      case 'h':
      case 'H':
        item.ranges = {{'0', '9'}, {'a', 'f'}, {'A', 'F'}};
        item.negated = c == 'H';
        return true;
      case 'p':
      case 'P': {
        bool neg = c == 'P';
        std::string name;
        if (!eof() && peek() == '{') {
          const size_t close = p_.find('}', i_);
          if (close == std::string_view::npos) fail("unterminated \\p{");
          name = std::string(p_.substr(i_ + 1, close - i_ - 1));
          i_ = close + 1;
          if (!name.empty() && name[0] == '^') {
            neg = !neg;
            name.erase(0, 1);
          }
        } else {
          if (eof()) fail("\\p needs a property name");
          name = std::string(1, p_[i_++]);
        }
        const uint32_t m = property_mask(name);
        if (!m) fail("unsupported property \\p{" + name + "}");
        item.cats = m;
        item.negated = neg;
        return true;
      }
      case 'n': cp = '\n'; return false;
      case 'r': cp = '\r'; return false;
      case 't': cp = '\t'; return false;
      case 'f': cp = '\f'; return false;
      case 'v': cp = '\v'; return false;
      case 'a': cp = 0x07; return false;
      case 'e': cp = 0x1B; return false;
      case '0': cp = 0; return false;
      case 'x':
        if (!eof() && peek() == '{') {
          ++i_;
          cp = hex(8, true);
          if (eof() || peek() != '}') fail("unterminated \\x{");
          ++i_;
        } else {
          cp = hex(2, false);
        }
        return false;
      case 'u': cp = hex(4, false); return false;
      default: break;
    }
    if (std::isalnum(static_cast<unsigned char>(c)))
      fail(std::string("unsupported escape \\") + c + (in_class ? " in a class" : ""));
    --i_;
    cp = literal_cp();
    return false;
  }

  CharSet bracket() {
    // At the character after '['.
    CharSet s;
    if (!eof() && peek() == '^') {
      s.negated = true;
      ++i_;
    }
    ClassItem lits;
    bool first = true;
    for (;;) {
      if (eof()) fail("unterminated character class");
      if (peek() == ']' && !first) {
        ++i_;
        break;
      }
      if (peek() == '[') fail("nested character classes are not supported");
      if (p_.compare(i_, 2, "&&") == 0) fail("class intersection (&&) is not supported");
      first = false;
      uint32_t lo;
      if (peek() == '\\') {
        ++i_;
        ClassItem item;
        if (escape(item, lo, true)) {
          s.items.push_back(std::move(item));
          continue;
        }
      } else {
        lo = literal_cp();
      }
      if (i_ + 1 < p_.size() && peek() == '-' && p_[i_ + 1] != ']') {
        ++i_;
        uint32_t hi;
        if (peek() == '\\') {
          ++i_;
          ClassItem item;
          if (escape(item, hi, true)) fail("a class escape cannot end a range");
        } else {
          hi = literal_cp();
        }
        add_range(lits, lo, hi);
      } else {
        add_char(lits, lo);
      }
    }
    if (!lits.ranges.empty()) s.items.push_back(std::move(lits));
    return s;
  }

  // Parses one atom into `out`; false for an inline flag group such as (?i).
  bool atom(Node& out) {
    const char c = peek();
    if (c == '(') {
      ++i_;
      bool look = false, neg = false;
      const bool saved = icase_;
      if (!eof() && peek() == '?') {
        ++i_;
        if (eof()) fail("unterminated group");
        const char k = peek();
        if (k == ':') {
          ++i_;
        } else if (k == '=' || k == '!') {
          look = true;
          neg = k == '!';
          ++i_;
        } else if (k == '<' && i_ + 1 < p_.size() && (p_[i_ + 1] == '=' || p_[i_ + 1] == '!')) {
          fail("look-behind is not supported");
        } else if (k == '<' || k == '\'') {
          const char close = k == '<' ? '>' : '\'';
          const size_t e = p_.find(close, i_ + 1);
          if (e == std::string_view::npos) fail("unterminated group name");
          i_ = e + 1;
        } else if (k == 'i' || k == '-' || k == 'm' || k == 'x') {
          bool on = true, icase = icase_;
          while (!eof() && peek() != ':' && peek() != ')') {
            const char f = peek();
            if (f == '-') on = false;
            else if (f == 'i') icase = on;
            else fail(std::string("unsupported inline flag '") + f + "'");
            ++i_;
          }
          if (eof()) fail("unterminated group");
          if (peek() == ')') {  // (?i): applies to the rest of the enclosing group
            ++i_;
            icase_ = icase;
            return false;
          }
          ++i_;
          icase_ = icase;
        } else {
          fail(std::string("unsupported group (?") + k);
        }
      }
      Node inner = alternation();
      icase_ = saved;
      if (eof() || peek() != ')') fail("missing ')'");
      ++i_;
      if (look) {
        out.kind = Node::Look;
        out.neg = neg;
        out.kids.push_back(std::move(inner));
      } else {
        out = std::move(inner);
      }
      return true;
    }
    if (c == '[') {
      ++i_;
      out = set_node(bracket());
      return true;
    }
    if (c == '.') {
      ++i_;
      CharSet s;
      s.negated = true;
      ClassItem nl;
      nl.ranges.emplace_back('\n', '\n');
      s.items.push_back(nl);
      out = set_node(std::move(s));
      return true;
    }
    if (c == '^' || c == '$') {
      ++i_;
      out.kind = Node::Assert;
      out.assert_kind = c == '^' ? AssertKind::LineStart : AssertKind::LineEnd;
      return true;
    }
    if (c == '*' || c == '+' || c == '?') fail("nothing to repeat");
    if (c == '\\') {
      if (i_ + 1 < p_.size()) {
        const char e = p_[i_ + 1];
        if (e == 'A' || e == 'z' || e == 'Z') {
          i_ += 2;
          out.kind = Node::Assert;
          out.assert_kind = e == 'A' ? AssertKind::TextStart : e == 'z' ? AssertKind::TextEnd : AssertKind::TextEndNewline;
          return true;
        }
        if (e == 'b' || e == 'B' || e == 'G' || e == 'K' || (e >= '1' && e <= '9') || e == 'k' || e == 'g' ||
            e == 'X' || e == 'R')
          fail(std::string("unsupported escape \\") + e);
      }
      ++i_;
      ClassItem item;
      uint32_t cp = 0;
      CharSet s;
      if (!escape(item, cp, false)) add_char(item, cp);
      s.items.push_back(std::move(item));
      out = set_node(std::move(s));
      return true;
    }
    CharSet s;
    ClassItem item;
    add_char(item, literal_cp());
    s.items.push_back(std::move(item));
    out = set_node(std::move(s));
    return true;
  }

  bool number(int& v) {
    size_t n = 0;
    v = 0;
    while (!eof() && std::isdigit(static_cast<unsigned char>(peek()))) {
      v = v * 10 + (peek() - '0');
      if (v > 100000) fail("repeat count too large");
      ++i_;
      ++n;
    }
    return n > 0;
  }

  void quantifier(Node& a) {
    if (eof()) return;
    int min, max;
    const char c = peek();
    if (c == '?' || c == '*' || c == '+') {
      ++i_;
      min = c == '+' ? 1 : 0;
      max = c == '?' ? 1 : -1;
    } else if (c == '{') {
      const size_t save = i_;
      ++i_;
      int lo = 0, hi = -1;
      const bool has_lo = number(lo);
      bool ok = true;
      if (!eof() && peek() == ',') {
        ++i_;
        if (!number(hi)) hi = -1;
        if (!has_lo && hi < 0) ok = false;
      } else {
        hi = lo;
        ok = has_lo;
      }
      if (!ok || eof() || peek() != '}') {  // not a quantifier: '{' is a literal (Oniguruma)
        i_ = save;
        return;
      }
      ++i_;
      min = lo;
      max = hi;
      if (max >= 0 && max < min) fail("repeat range out of order");
    } else {
      return;
    }
    Mode mode = Mode::Greedy;
    if (!eof() && peek() == '?') {
      mode = Mode::Lazy;
      ++i_;
    } else if (!eof() && peek() == '+' && c != '{') {
      mode = Mode::Possessive;
      ++i_;
    }
    if (a.kind == Node::Look || a.kind == Node::Assert) fail("cannot repeat an assertion");
    Node r;
    r.kind = Node::Repeat;
    r.min = min;
    r.max = max;
    r.mode = mode;
    r.kids.push_back(std::move(a));
    a = std::move(r);
    if (!eof() && (peek() == '*' || peek() == '+' || peek() == '?')) fail("nested quantifier");
  }
};

class Compiler {
 public:
  Compiler(std::vector<Inst>& code, const std::string& pattern) : code_(code), pattern_(pattern) {}
  void compile(const Node& n) {
    switch (n.kind) {
      case Node::Empty: return;
      case Node::Set: emit({Op::Set, Mode::Greedy, false, AssertKind::TextStart, 0, 0, n.set}); return;
      case Node::Assert: {
        Inst in{Op::Assert};
        in.assert_kind = n.assert_kind;
        emit(in);
        return;
      }
      case Node::Seq:
        for (const auto& k : n.kids) compile(k);
        return;
      case Node::Alt: {
        std::vector<int> jumps;
        for (size_t a = 0; a < n.kids.size(); ++a) {
          if (a + 1 < n.kids.size()) {
            const int split = emit({Op::Split});
            code_[split].x = here();
            compile(n.kids[a]);
            jumps.push_back(emit({Op::Jmp}));
            code_[split].y = here();
          } else {
            compile(n.kids[a]);
          }
        }
        for (int j : jumps) code_[j].x = here();
        return;
      }
      case Node::Look: {
        const int look = emit({Op::Look});
        code_[look].neg = n.neg;
        compile(n.kids[0]);
        emit({Op::Match});
        code_[look].x = here();
        return;
      }
      case Node::Repeat: repeat(n); return;
    }
  }

 private:
  std::vector<Inst>& code_;
  const std::string& pattern_;
  int here() const { return static_cast<int>(code_.size()); }
  int emit(Inst in) {
    code_.push_back(in);
    if (code_.size() > 200000) fail("pattern too large after expanding its repeats");
    return here() - 1;
  }
  [[noreturn]] void fail(const std::string& what) const {
    throw std::invalid_argument("regex '" + pattern_ + "': " + what);
  }

  void repeat(const Node& n) {
    const Node& body = n.kids[0];
    if (body.kind == Node::Set) {
      Inst in{Op::Rep};
      in.set = body.set;
      in.min = n.min;
      in.max = n.max;
      in.mode = n.mode;
      emit(in);
      return;
    }
    if (n.mode == Mode::Possessive) fail("possessive repeat of a group is not supported");
    if (nullable(body) && n.max != n.min) fail("a repeated group that can match the empty string is not supported");
    for (int k = 0; k < n.min; ++k) compile(body);
    const bool greedy = n.mode == Mode::Greedy;
    if (n.max < 0) {
      const int split = emit({Op::Split});
      const int body_at = here();
      compile(body);
      const int jmp = emit({Op::Jmp});
      code_[jmp].x = split;
      code_[split].x = greedy ? body_at : here();
      code_[split].y = greedy ? here() : body_at;
      return;
    }
    std::vector<int> splits;
    for (int k = n.min; k < n.max; ++k) {
      const int split = emit({Op::Split});
      splits.push_back(split);
      code_[split].x = here();  // body; patched below for lazy
      compile(body);
    }
    for (int s : splits) {
      const int body_at = s + 1;
      code_[s].x = greedy ? body_at : here();
      code_[s].y = greedy ? here() : body_at;
    }
  }
};

}  // namespace

void compile(std::string_view pattern, Regex::Program& prog) {
  Parser parser(pattern, prog.sets);
  const Node root = parser.parse();
  const std::string pat(pattern);
  Compiler c(prog.code, pat);
  c.compile(root);
  prog.code.push_back({Op::Match});
}

}  // namespace mt::rx
