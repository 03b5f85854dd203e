#include "train/optimizer.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "kernels/adamw.h"

namespace mt {

AdamW::AdamW(const std::vector<ParamInfo>& params, int64_t begin, int64_t end, AdamWConfig cfg)
    : begin_(begin), end_(end), cfg_(cfg) {
  for (const auto& p : params) {
    int64_t b = std::max(begin, p.offset), e = std::min(end, p.offset + p.numel);
    if (b >= e) continue;
    if (!ranges_.empty() && ranges_.back().end == b && ranges_.back().decay == p.decay)
      ranges_.back().end = e;  // merge neighbours with the same decay setting
    else
      ranges_.push_back({b, e, p.decay});
  }
  m_ = Tensor::zeros({end - begin}, DType::F32, MemCategory::Optimizer);
  v_ = Tensor::zeros({end - begin}, DType::F32, MemCategory::Optimizer);
}

void AdamW::step(float* weights, const float* grads, double lr, float grad_scale) {
  ++step_;
  for (const auto& r : ranges_) {
    kernels::adamw_update(weights + r.begin, grads + r.begin, m_.f32() + (r.begin - begin_),
                          v_.f32() + (r.begin - begin_), r.end - r.begin, static_cast<float>(lr),
                          static_cast<float>(cfg_.beta1), static_cast<float>(cfg_.beta2), static_cast<float>(cfg_.eps),
                          r.decay ? static_cast<float>(cfg_.weight_decay) : 0.0f, step_, grad_scale);
  }
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
