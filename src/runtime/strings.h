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

}  // namespace mt
