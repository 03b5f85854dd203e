#include "train/report_data.h"

#include <fstream>
#include <stdexcept>

namespace mt {

RunMetrics read_run_metrics(const std::string& path, const std::string& label) {
  RunMetrics r;
  r.path = path;
  r.label = label.empty() ? path.substr(path.find_last_of('/') + 1) : label;
  r.series = read_metrics_series(path, r.label);  // validates the file and its step records
  std::ifstream f(path);
  std::string line;
  while (std::getline(f, line)) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    if (!j.is_object()) continue;
    if (j.value("final", false))
      r.final = std::move(j);
    else if (j.contains("step") && j.contains("loss"))
      r.steps.push_back(std::move(j));
  }
  return r;
}

std::optional<double> RunMetrics::mean(const std::string& key) const {
  const auto v = series_of(key);
  if (v.empty()) return std::nullopt;
  const size_t first = v.size() > 1 ? 1 : 0;
  double s = 0;
  for (size_t i = first; i < v.size(); ++i) s += v[i].second;
  return s / static_cast<double>(v.size() - first);
}

std::vector<std::pair<double, double>> RunMetrics::series_of(const std::string& key) const {
  std::vector<std::pair<double, double>> out;
  for (const auto& j : steps)
    if (j.contains(key) && j[key].is_number()) out.emplace_back(j["step"].get<double>(), j[key].get<double>());
  return out;
}

std::optional<double> RunMetrics::final_number(const std::string& key) const {
  if (final.is_object() && final.contains(key) && final[key].is_number()) return final[key].get<double>();
  return std::nullopt;
}

}  // namespace mt
