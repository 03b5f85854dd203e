#include "train/report_compare.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <stdexcept>

#include "checkpoint/safetensors.h"

namespace mt {

namespace {

bool close(double a, double b, const Tolerance& t) {
  return std::abs(a - b) <= t.rel * std::max(std::abs(a), std::abs(b)) + t.abs;
}

double rel_diff(double a, double b) {
  const double m = std::max(std::abs(a), std::abs(b));
  return m > 0 ? std::abs(a - b) / m : 0.0;
}

}  // namespace

std::string Tolerance::describe() const {
  char b[96];
  std::snprintf(b, sizeof b, "relative %.0e + absolute %.0e", rel, abs);
  return b;
}

Tolerance tolerance_for(const std::string& dtype) {
  if (dtype == "fp32") return {1e-4, 1e-6};
  if (dtype == "bf16") return {2e-2, 1e-3};
  throw std::invalid_argument("no comparison tolerance for train.dtype '" + dtype + "' (fp32 or bf16)");
}

WeightDiff compare_weights(const std::string& a_path, const std::string& b_path, const Tolerance& tol) {
  const auto a = read_safetensors(a_path), b = read_safetensors(b_path);
  WeightDiff w;
  for (const auto& [name, ta] : a) {
    auto it = b.find(name);
    if (it == b.end() || it->second.shape != ta.shape || ta.dtype != "F32" || it->second.dtype != "F32") {
      w.mismatch = "tensor " + name + (it == b.end() ? " only in run A" : " differs in shape or is not F32");
      w.within = false;
      continue;
    }
    const size_t n = ta.bytes.size() / sizeof(float);
    const float* x = reinterpret_cast<const float*>(ta.bytes.data());
    const float* y = reinterpret_cast<const float*>(it->second.bytes.data());
    double diff = 0, mag = 0;
    for (size_t i = 0; i < n; ++i) {
      diff = std::max(diff, static_cast<double>(std::abs(x[i] - y[i])));
      mag = std::max(mag, static_cast<double>(std::abs(x[i])));
    }
    ++w.tensors;
    const double rel = mag > 0 ? diff / mag : diff;
    if (rel >= w.max_rel) {
      w.max_rel = rel;
      w.worst_tensor = name;
    }
    if (diff > tol.rel * mag + tol.abs) w.within = false;
  }
  if (b.size() > a.size() && w.mismatch.empty()) {
    w.mismatch = "run B has " + std::to_string(b.size() - a.size()) + " tensors more";
    w.within = false;
  }
  return w;
}

Tolerance weight_tolerance(const Tolerance& t) { return {t.rel * 10, t.abs}; }

Comparison compare_runs(const RunMetrics& a, const RunMetrics& b, const Tolerance& tol) {
  Comparison c;
  std::map<int64_t, const nlohmann::json*> bs;
  for (const auto& j : b.steps) bs[j["step"].get<int64_t>()] = &j;
  for (const auto& ja : a.steps) {
    const int64_t step = ja["step"].get<int64_t>();
    auto it = bs.find(step);
    if (it == bs.end()) continue;
    const nlohmann::json& jb = *it->second;
    StepDiff d{step, ja.value("loss", 0.0), jb.value("loss", 0.0), ja.value("grad_norm", 0.0),
               jb.value("grad_norm", 0.0), true};
    d.within = close(d.loss_a, d.loss_b, tol) && close(d.norm_a, d.norm_b, tol);
    if (!d.within && !c.first_diverging) c.first_diverging = step;
    c.steps.push_back(d);
  }
  if (c.steps.size() != a.steps.size() || c.steps.size() != b.steps.size())
    c.mismatch = "run A recorded " + std::to_string(a.steps.size()) + " steps, run B " + std::to_string(b.steps.size()) +
                 ", " + std::to_string(c.steps.size()) + " in common";
  return c;
}

std::string Comparison::text(const Tolerance& tol, const std::string& label_a, const std::string& label_b) const {
  std::string s = "A: " + label_a + "\nB: " + label_b + "\n";
  char line[256];
  std::snprintf(line, sizeof line, "%6s  %12s %12s %9s  %12s %12s %9s\n", "step", "loss A", "loss B", "rel diff",
                "grad_norm A", "grad_norm B", "rel diff");
  s += line;
  for (const auto& d : steps) {
    std::snprintf(line, sizeof line, "%6lld  %12.6f %12.6f %9.1e  %12.6f %12.6f %9.1e%s\n",
                  static_cast<long long>(d.step), d.loss_a, d.loss_b, rel_diff(d.loss_a, d.loss_b), d.norm_a, d.norm_b,
                  rel_diff(d.norm_a, d.norm_b), d.within ? "" : "  <- outside the tolerance");
    s += line;
  }
  s += "tolerance per step: " + tol.describe() + "\n";
  if (weights) {
    char w[256];
    std::snprintf(w, sizeof w,
                  "final weights: %lld tensors, largest difference %.1e of the tensor's largest value (%s; "
                  "tolerance %s)%s\n",
                  static_cast<long long>(weights->tensors), weights->max_rel, weights->worst_tensor.c_str(),
                  weight_tol.describe().c_str(), weights->within ? "" : "  <- outside the tolerance");
    s += w;
    if (!weights->mismatch.empty()) s += "final weights: " + weights->mismatch + "\n";
  }
  if (!mismatch.empty()) s += "verdict: DIFFERENT (" + mismatch + ")\n";
  if (first_diverging)
    s += "verdict: DIFFERENT, first diverging at step " + std::to_string(*first_diverging) + "\n";
  else if (mismatch.empty() && weights && !weights->within)
    s += "verdict: DIFFERENT final weights, every step's loss and gradient norm within the tolerance\n";
  else if (mismatch.empty())
    s += "verdict: EQUAL within the tolerance over " + std::to_string(steps.size()) + " steps" +
         (weights ? " and the final weights\n" : "\n");
  return s;
}

}  // namespace mt
