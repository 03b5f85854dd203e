// AdamW with bias correction and decoupled weight decay (Loshchilov & Hutter), as torch.optim.AdamW.
#pragma once
#include "kernels/cpu/isa.h"
#include <cstdint>

#include "kernels/ops.h"
#include "runtime/dtype.h"

MT_CPU_NS_BEGIN

// step is 1-based. grad is multiplied by grad_scale first (used for clipping).
// m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2; mhat = m/(1-b1^step); vhat = v/(1-b2^step);
// p -= lr * (mhat / (sqrt(vhat) + eps) + weight_decay * p).
// param_bf16 (may be null): also receives the updated p rounded to bf16 (as cast_f32_to_bf16), in
// the same pass: a bf16 run's compute copy of the weights without a second pass over them.
void adamw_update(float* param, const float* grad, float* m, float* v, int64_t n, float lr, float beta1,
                  float beta2, float eps, float weight_decay, int64_t step, float grad_scale = 1.0f,
                  bf16* param_bf16 = nullptr);

// adamw_update over a list of tensors (kernels/ops.def adamw_update_multi): each tensor in turn,
// so the results are adamw_update's bit for bit. clip_norm_sq is host memory here.
void adamw_update_multi(const AdamWTensor* tensors, int64_t count, float lr, float beta1, float beta2, float eps,
                        int64_t step, float grad_scale, const double* clip_norm_sq, double clip_max);

MT_CPU_NS_END  // namespace mt::kernels::cpu
