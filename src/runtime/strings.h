// Small string helpers shared by the layers (environment knobs, command-line lists).
#pragma once
#include <string>
#include <vector>

namespace mt {

// The items of a comma-separated list ("a,b,,c" -> a, b, c: empty items dropped).
std::vector<std::string> split_list(const std::string& s, char sep = ',');

}  // namespace mt
