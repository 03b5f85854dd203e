#include "cli/arg_parser.h"

#include <algorithm>

namespace mt {

ArgParser::ArgParser(std::vector<std::string> value_flags, std::vector<std::string> bool_flags)
    : value_flags_(std::move(value_flags)), bool_flags_(std::move(bool_flags)) {}

static bool contains(const std::vector<std::string>& v, const std::string& s) {
  return std::find(v.begin(), v.end(), s) != v.end();
}

void ArgParser::parse(int argc, char** argv, int first) {
  for (int i = first; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--") {
      for (int j = i + 1; j < argc; ++j) rest_.emplace_back(argv[j]);
      return;
    }
    if (a.size() < 3 || a.compare(0, 2, "--") != 0) {
      positional_.push_back(a);
      continue;
    }
    std::string name = a.substr(2), value;
    bool has_value = false;
    if (auto eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      has_value = true;
    }
    bool dotted = false;
    if (auto dot = name.find('.'); dot != std::string::npos)
      dotted = contains(value_flags_, name.substr(0, dot) + ".*");
    if (contains(bool_flags_, name)) {
      if (has_value) throw ArgError("flag --" + name + " takes no value");
      values_[name] = "1";
      continue;
    }
    if (!dotted && !contains(value_flags_, name)) {
      std::vector<std::string> known;
      for (const auto& f : value_flags_)
        if (f.size() < 2 || f.compare(f.size() - 2, 2, ".*") != 0) known.push_back(f);
      known.insert(known.end(), bool_flags_.begin(), bool_flags_.end());
      const std::string near = closest_name(name, known);
      throw ArgError("unknown option --" + name + (near.empty() ? "" : " (did you mean --" + near + "?)"));
    }
    if (!has_value) {
      if (i + 1 >= argc) throw ArgError("option --" + name + " needs a value");
      value = argv[++i];
    }
    if (dotted)
      dotted_.emplace_back(name, value);
    else
      values_[name] = value;
  }
}

std::string ArgParser::get(const std::string& name, const std::string& fallback) const {
  auto it = values_.find(name);
  return it == values_.end() ? fallback : it->second;
}

std::optional<std::string> ArgParser::maybe(const std::string& name) const {
  auto it = values_.find(name);
  if (it == values_.end()) return std::nullopt;
  return it->second;
}

long long ArgParser::get_int(const std::string& name, long long fallback) const {
  auto it = values_.find(name);
  if (it == values_.end()) return fallback;
  try {
    size_t pos = 0;
    long long v = std::stoll(it->second, &pos);
    if (pos != it->second.size()) throw std::invalid_argument("");
    return v;
  } catch (const std::exception&) {
    throw ArgError("option --" + name + " expects an integer, got '" + it->second + "'");
  }
}

double ArgParser::get_double(const std::string& name, double fallback) const {
  auto it = values_.find(name);
  if (it == values_.end()) return fallback;
  try {
    size_t pos = 0;
    double v = std::stod(it->second, &pos);
    if (pos != it->second.size()) throw std::invalid_argument("");
    return v;
  } catch (const std::exception&) {
    throw ArgError("option --" + name + " expects a number, got '" + it->second + "'");
  }
}

}  // namespace mt
