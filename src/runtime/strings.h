// Small string helpers shared by the layers (environment knobs, command-line lists).
#pragma once
#include <string>
#include <vector>

namespace mt {

// The items of a comma-separated list ("a,b,,c" -> a, b, c: empty items dropped).
std::vector<std::string> split_list(const std::string& s, char sep = ',');

// The candidate nearest to `name` by edit distance (case-insensitive; swapping two neighbouring
// letters is one edit), when it is near enough to be a likely typo (at most a third of the longer
// name's letters, rounded, and at least 1, differ); else "".
std::string closest_name(const std::string& name, const std::vector<std::string>& candidates);

// An nlohmann::json exception's message without the library's error id ("[json.exception.parse_error.101]
// parse error at line 1, ..." -> "parse error at line 1, ..."), for errors that name the file themselves.
inline std::string json_error_text(const std::string& what) {
  if (what.rfind("[json.exception.", 0) == 0) {
    const size_t end = what.find("] ");
    if (end != std::string::npos) return what.substr(end + 2);
  }
  return what;
}

}  // namespace mt
