#include "parallel/optimizer.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <vector>

#include "kernels/backend.h"

namespace mt {

AdamW::AdamW(std::vector<AdamSpan> spans, int64_t state_size, AdamWConfig cfg) : spans_(std::move(spans)), cfg_(cfg) {
  for (const auto& sp : spans_)
    if (sp.s_off < 0 || sp.s_off + sp.n > state_size) throw std::out_of_range("AdamW span outside its state");
  m_ = Tensor::zeros({state_size}, DType::F32, MemCategory::Optimizer);
  v_ = Tensor::zeros({state_size}, DType::F32, MemCategory::Optimizer);
}

std::vector<AdamSpan> AdamW::full_spans(const std::vector<ParamInfo>& params) {
  std::vector<AdamSpan> v;
  for (size_t i = 0; i < params.size(); ++i)
    if (params[i].trainable)  // a frozen (LoRA base) parameter is never updated
      v.push_back({params[i].offset, params[i].offset, params[i].numel, params[i].decay, static_cast<int>(i)});
  return v;
}

std::vector<AdamSpan> AdamW::state_spans(const Transformer& model) {
  std::vector<AdamSpan> v;
  const auto& params = model.params();
  for (size_t i = 0; i < params.size(); ++i)
    if (params[i].trainable && model.owns_unit(params[i].unit))
      v.push_back({params[i].offset, model.state_offset(params[i]), params[i].numel, params[i].decay, static_cast<int>(i)});
  return v;
}

void AdamW::step(float* weights, const float* grads, double lr, float grad_scale, bool w_by_state, bool g_by_state,
                 bf16* compute, const double* clip_norm_sq, double clip_max) {
  ++step_;
  std::vector<kernels::AdamWTensor> list;
  list.reserve(spans_.size());
  for (const auto& sp : spans_) {
    const int64_t w = w_by_state ? sp.s_off : sp.w_off;
    list.push_back({weights + w, grads + (g_by_state ? sp.s_off : sp.w_off), m_.f32() + sp.s_off,
                    v_.f32() + sp.s_off, compute ? compute + sp.w_off : nullptr, sp.n,
                    sp.decay ? static_cast<float>(cfg_.weight_decay) : 0.0f});
  }
  kernels::table(m_.device())
      .adamw_update_multi(list.data(), static_cast<int64_t>(list.size()), static_cast<float>(lr),
                          static_cast<float>(cfg_.beta1), static_cast<float>(cfg_.beta2), static_cast<float>(cfg_.eps),
                          step_, grad_scale, clip_norm_sq, clip_max);
}

double lr_at(int64_t step, int64_t total, int64_t warmup, double lr, double min_ratio, const std::string& kind) {
  if (step < warmup) return lr * static_cast<double>(step + 1) / static_cast<double>(warmup);
  if (kind == "constant") return lr;
  const double min_lr = lr * min_ratio;
  const int64_t span = std::max<int64_t>(1, total - warmup);
  double frac = std::clamp(static_cast<double>(step - warmup) / static_cast<double>(span), 0.0, 1.0);
  if (kind == "linear") return lr - (lr - min_lr) * frac;
  if (kind == "cosine") return min_lr + 0.5 * (1.0 + std::cos(M_PI * frac)) * (lr - min_lr);
  throw std::invalid_argument("train.lr_schedule must be cosine, linear or constant, got '" + kind + "'");
}

}  // namespace mt
