// AdamW over spans of the model's parameters, and the learning-rate schedule.
//
// The optimizer owns fp32 moments for `state_size` elements. Each span maps n elements at
// w_off of a weight buffer to n elements at s_off of the state (and gradient) buffers: for DDP the
// spans are the parameters and the state is laid out like the flat buffer; for ZeRO a rank's spans
// are its shard of each unit. Weight decay applies per span (ParamInfo::decay); padding is in no
// span, so it is never touched.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "model/parameters.h"
#include "model/transformer.h"
#include "runtime/tensor.h"

namespace mt {

struct AdamWConfig {
  double lr = 6e-4, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0.1;
};

struct AdamSpan {
  int64_t w_off = 0, s_off = 0, n = 0;
  bool decay = true;
  int param = -1;  // index into the model's params (spans never cross parameters)
};

class AdamW {
 public:
  AdamW(std::vector<AdamSpan> spans, int64_t state_size, AdamWConfig cfg);
  // Spans for a full (unsharded) flat buffer: one per parameter, state offsets = flat offsets.
  // (Not merged across parameters, so norms can be weighted per parameter.)
  static std::vector<AdamSpan> full_spans(const std::vector<ParamInfo>& params);
  // Spans for a model's own buffers: w_off the flat offset, s_off the state offset
  // (Transformer::state_offset: equal without a compact state), trainable parameters only.
  static std::vector<AdamSpan> state_spans(const Transformer& model);
  // One update. `weights` is indexed by w_off (or by s_off when w_by_state), `grads` by w_off
  // (or s_off when g_by_state). grad_scale multiplies every gradient (clipping). compute (may be
  // null): a bf16 copy of the weights, indexed by w_off, refreshed in the same pass.
  // clip_norm_sq (may be null): the squared gradient norm in the device's memory; the scale then
  // comes from it on the device (kernels/ops.def adamw_update_multi) where it exceeds clip_max.
  // Every span goes to one multi-tensor call (one pass over the list; a few launches on a GPU).
  void step(float* weights, const float* grads, double lr, float grad_scale, bool w_by_state = false,
            bool g_by_state = false, bf16* compute = nullptr, const double* clip_norm_sq = nullptr,
            double clip_max = 0.0);
  int64_t step_count() const { return step_; }
  void set_step_count(int64_t s) { step_ = s; }
  Tensor& exp_avg() { return m_; }
  Tensor& exp_avg_sq() { return v_; }
  const std::vector<AdamSpan>& spans() const { return spans_; }

 private:
  std::vector<AdamSpan> spans_;
  int64_t step_ = 0;
  AdamWConfig cfg_;
  Tensor m_, v_;
};

// Linear warm-up to `lr` over `warmup` steps, then cosine / linear decay to lr * min_ratio at
// `total` steps, or constant. step is 0-based.
double lr_at(int64_t step, int64_t total, int64_t warmup, double lr, double min_ratio, const std::string& kind);

}  // namespace mt
