// LayerNorm (GPT-2) and RMSNorm (Llama) over the last dimension of a [N,C] tensor.
// Backward functions accumulate (+=) into dinp and the weight/bias gradients.
#pragma once
#include "kernels/cpu/isa.h"
#include <cstdint>

#include "runtime/dtype.h"

MT_CPU_NS_BEGIN

// out = (inp - mean) * rstd * w + b; saves mean[N] and rstd[N] for backward.
void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* w,
                       const float* b, int64_t N, int64_t C, float eps = 1e-5f);
void layernorm_backward(float* dinp, float* dw, float* db, const float* dout, const float* inp,
                        const float* w, const float* mean, const float* rstd, int64_t N, int64_t C);

// out = inp * rstd * w, rstd = 1/sqrt(mean(inp^2) + eps); saves rstd[N].
void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* w, int64_t N, int64_t C,
                     float eps = 1e-5f);
void rmsnorm_backward(float* dinp, float* dw, const float* dout, const float* inp, const float* w,
                      const float* rstd, int64_t N, int64_t C);

// res += x, then the norm of res (the residual add and the norm of a block in one call; the same
// arithmetic as accumulate followed by the norm).
void residual_layernorm_forward(float* out, float* mean, float* rstd, float* res, const float* x, const float* w,
                                const float* b, int64_t N, int64_t C, float eps = 1e-5f);
void residual_rmsnorm_forward(float* out, float* rstd, float* res, const float* x, const float* w, int64_t N,
                              int64_t C, float eps = 1e-5f);

// The residual stream in bf16 (contracts: kernels/ops.def). out = bf16(res + x).
void residual_add_bf16(bf16* out, const bf16* res, const float* x, int64_t n);
// x non-null: res_out = bf16(res + x), then the norm of res_out; x null: the norm of res. The norm
// is the fp32 kernel's on the widened values (bits of a widening followed by the fp32 norm).
void residual_layernorm_forward_bf16(float* out, float* mean, float* rstd, bf16* res_out, const bf16* res,
                                     const float* x, const float* w, const float* b, int64_t N, int64_t C,
                                     float eps = 1e-5f);
void residual_rmsnorm_forward_bf16(float* out, float* rstd, bf16* res_out, const bf16* res, const float* x,
                                   const float* w, int64_t N, int64_t C, float eps = 1e-5f);
// The fp32 backward on the widened bf16 input.
void layernorm_backward_bf16(float* dinp, float* dw, float* db, const float* dout, const bf16* inp, const float* w,
                             const float* mean, const float* rstd, int64_t N, int64_t C);
void rmsnorm_backward_bf16(float* dinp, float* dw, const float* dout, const bf16* inp, const float* w,
                           const float* rstd, int64_t N, int64_t C);

MT_CPU_NS_END  // namespace mt::kernels::cpu
