// AdamW over a range of the model's flat parameter buffer, and the learning-rate schedule.
//
// The optimizer owns fp32 moments for the elements [begin, end) of the flat buffer (the whole
// model for DDP; one rank's shard for ZeRO). Weight decay applies per parameter (ParamInfo::decay).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "model/parameters.h"
#include "runtime/tensor.h"

namespace mt {

struct AdamWConfig {
  double lr = 6e-4, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0.1;
};

class AdamW {
 public:
  AdamW(const std::vector<ParamInfo>& params, int64_t begin, int64_t end, AdamWConfig cfg);
  // One update of weights[begin, end) from grads (both indexed like the flat buffer, i.e. the
  // pointers address element 0 of the flat buffer). grad_scale multiplies every gradient (clipping).
  void step(float* weights, const float* grads, double lr, float grad_scale);
  int64_t step_count() const { return step_; }
  void set_step_count(int64_t s) { step_ = s; }
  Tensor& exp_avg() { return m_; }
  Tensor& exp_avg_sq() { return v_; }
  int64_t begin() const { return begin_; }
  int64_t end() const { return end_; }

 private:
  struct Range {
    int64_t begin, end;
    bool decay;
  };
  std::vector<Range> ranges_;
  int64_t begin_, end_, step_ = 0;
  AdamWConfig cfg_;
  Tensor m_, v_;
};

// Linear warm-up to `lr` over `warmup` steps, then cosine / linear decay to lr * min_ratio at
// `total` steps, or constant. step is 0-based.
double lr_at(int64_t step, int64_t total, int64_t warmup, double lr, double min_ratio, const std::string& kind);

}  // namespace mt
