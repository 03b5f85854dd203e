// Command-line flags shared by every subcommand: `--name value`, `--name=value`, bare `--flag`,
// and positional arguments. Unknown flags are an error naming the flag.
#pragma once
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "runtime/strings.h"  // split_list, for the list-valued flags

namespace mt {

class ArgError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class ArgParser {
 public:
  // `value_flags`: flags that take a value; `bool_flags`: flags that do not. A flag name may end in
  // ".*" to accept any `--prefix.key` (used for config overrides like --train.steps).
  ArgParser(std::vector<std::string> value_flags, std::vector<std::string> bool_flags);
  // Parses argv[first..argc). Throws ArgError on an unknown flag or a missing value.
  void parse(int argc, char** argv, int first = 1);

  bool has(const std::string& name) const { return values_.count(name) > 0; }
  std::string get(const std::string& name, const std::string& fallback = "") const;
  std::optional<std::string> maybe(const std::string& name) const;
  long long get_int(const std::string& name, long long fallback) const;
  double get_double(const std::string& name, double fallback) const;
  bool flag(const std::string& name) const { return has(name); }
  const std::vector<std::string>& positional() const { return positional_; }
  // Every --prefix.key given, in order (for config overrides).
  const std::vector<std::pair<std::string, std::string>>& dotted() const { return dotted_; }
  // Arguments after a bare "--" (for `launch`).
  const std::vector<std::string>& rest() const { return rest_; }

 private:
  std::vector<std::string> value_flags_, bool_flags_;
  std::map<std::string, std::string> values_;
  std::vector<std::pair<std::string, std::string>> dotted_;
  std::vector<std::string> positional_, rest_;
};

}  // namespace mt
