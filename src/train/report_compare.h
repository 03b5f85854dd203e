// `meshtrain compare`: two runs of one config, step by step. A step agrees when its loss and its
// gradient norm are equal within the tolerance the precision implies (|a - b| <= rel x max(|a|, |b|)
// + abs): fp32 runs differ only by the order of floating-point sums (another layout reduces in
// another order), bf16 runs by bf16 rounding of the activations on top.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "train/report_data.h"

namespace mt {

struct Tolerance {
  double rel = 0, abs = 0;
  std::string describe() const;  // "relative 1e-04 + absolute 1e-06"
};
// fp32: relative 1e-4 + absolute 1e-6; bf16: relative 2e-2 + absolute 1e-3. Throws
// std::invalid_argument for another dtype.
Tolerance tolerance_for(const std::string& dtype);
// For the final weights: ten times the relative part. Adam divides each update by the root of the
// squared gradient, so a rounding difference in a near-zero gradient moves that parameter by up to
// the learning rate; a tensor's largest value is the scale that difference is judged against.
Tolerance weight_tolerance(const Tolerance& step_tolerance);

struct StepDiff {
  int64_t step = 0;
  double loss_a = 0, loss_b = 0, norm_a = 0, norm_b = 0;
  bool within = true;
};

// The final weights of the two runs, tensor by tensor: a tensor agrees when max |a - b| <= rel x
// max |a| + abs.
struct WeightDiff {
  int64_t tensors = 0;
  double max_rel = 0;        // the largest max |a - b| / max |a| of any tensor
  std::string worst_tensor;  // its name
  std::string mismatch;      // a tensor only one side has, or of another shape
  bool within = true;
};
// Reads two safetensors files (F32 tensors: what `meshtrain export` writes). Throws
// std::runtime_error naming a file that cannot be read.
WeightDiff compare_weights(const std::string& a, const std::string& b, const Tolerance& tol);

struct Comparison {
  std::vector<StepDiff> steps;            // the steps both runs recorded, in order
  std::optional<WeightDiff> weights;      // the final weights, when compared
  std::optional<int64_t> first_diverging;  // first step outside the tolerance
  std::string mismatch;                    // non-empty when the runs recorded different steps
  bool equal() const { return !first_diverging && mismatch.empty() && (!weights || weights->within); }
  // The per-step table and the verdict line.
  std::string text(const Tolerance& tol, const std::string& label_a, const std::string& label_b) const;
  Tolerance weight_tol;  // what `weights` was judged against
};

Comparison compare_runs(const RunMetrics& a, const RunMetrics& b, const Tolerance& tol);

}  // namespace mt
