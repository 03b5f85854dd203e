// Column-aligned text tables for the planner's command-line output.
#pragma once
#include <string>
#include <vector>

namespace mt::plan {

// One line per row, columns padded to their widest cell and separated by two spaces; a column
// with right[i] set is right-aligned. Trailing spaces are trimmed.
std::string format_table(const std::vector<std::string>& head, const std::vector<std::vector<std::string>>& rows,
                         const std::vector<bool>& right);

// One number through a printf format: fmt("%.1f GiB", x).
std::string fmt(const char* f, double v);

// The items separated by `sep`: "a, b, c".
std::string join(const std::vector<std::string>& items, const std::string& sep);

}  // namespace mt::plan
