// A small backtracking regular-expression engine for tokenizer pre-tokenization patterns.
//
// Hugging Face tokenizers run the Split pre-tokenizer's pattern through Oniguruma; this engine
// implements the subset those patterns use, with Oniguruma's semantics (leftmost match, the first
// alternative that matches, greedy quantifiers that give back as needed, atomic look-ahead):
//   literals and escapes (\n \r \t \f \v \e \a \0 \xHH \x{H..} \uHHHH, escaped punctuation), `.`
//   (any character but \n), classes [...] with ranges, negation and nested escapes, \s \S (White_Space),
//   \d \D (Nd), \w \W (letters, marks, numbers, Pc), \h \H (hex digits), \p{..} \P{..} \p{^..} and \pX
//   over general categories (L Lu Ll Lt Lm Lo LC M Mn Mc Me N Nd Nl No P.. S.. Z.. C.. and the long
//   names Letter, Mark, Number, Punctuation, Symbol, Separator, Other), groups (...) (?:...),
//   (?<name>...), inline flags (?i) (?-i) (?i:...), look-ahead (?=...) (?!...), alternation,
//   quantifiers ? * + {n} {n,} {n,m} {,m} with lazy (?) and possessive (+) forms, anchors ^ $ \A \z \Z.
// Anything else (look-behind, back-references, \b, (?m), ...) is refused with an error naming the
// construct and its offset. Matching works on bytes: a byte that is not well-formed UTF-8 is one
// character of category Cn (matched only by negated classes). Case-insensitive matching folds ASCII
// letters (plus U+017F for s and U+212A for k, as Unicode case folding does).
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace mt {

class Regex {
 public:
  // Throws std::invalid_argument("regex '<pattern>': <what> at offset N").
  explicit Regex(std::string_view pattern);
  ~Regex();
  Regex(Regex&&) noexcept;
  Regex& operator=(Regex&&) noexcept;

  // The leftmost match starting at or after `from` (a character boundary): true with [start, end).
  // Thread-safe.
  bool find(std::string_view text, size_t from, size_t* start, size_t* end) const;
  // The end of the match anchored at `at`, or npos.
  size_t match_at(std::string_view text, size_t at) const;
  const std::string& pattern() const { return pattern_; }

  struct Program;

 private:
  std::string pattern_;
  std::unique_ptr<Program> prog_;
};

}  // namespace mt
