// Dense matrix multiply on the CPU (oneDNN, chosen by measurement: docs/benchmarks.md) and the
// linear layer built on it. Row-major throughout. Backward functions ACCUMULATE (+=) into every
// gradient output so callers zero once per step and residual branches add up naturally.
#pragma once
#include <cstdint>

#include "runtime/dtype.h"

namespace mt::kernels::cpu {

// C[M,N] = alpha * op(A) @ op(B) + beta * C, op(X) = X^T when the flag is set.
// A is [M,K] (or [K,M] if ta), B is [K,N] (or [N,K] if tb); all dense, row-major.
void gemm_f32(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
              const float* B, float beta, float* C);
// Same with bf16 inputs, fp32 accumulation and fp32 output.
void gemm_bf16(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const bf16* A,
               const bf16* B, float beta, float* C);

// out[N,OC] = inp[N,C] @ W[OC,C]^T (+ bias[OC] when bias != nullptr). Overwrites out.
void linear_forward(float* out, const float* inp, const float* W, const float* bias, int64_t N,
                    int64_t C, int64_t OC);
// dinp[N,C] += dout @ W (skipped when dinp == nullptr); dW[OC,C] += dout^T @ inp;
// dbias[OC] += column sums of dout (skipped when dbias == nullptr).
void linear_backward(float* dinp, float* dW, float* dbias, const float* dout, const float* inp,
                     const float* W, int64_t N, int64_t C, int64_t OC);

// Mixed precision: bf16 input and weight, fp32 output; the bias stays fp32.
void linear_forward_bf16(float* out, const bf16* inp, const bf16* W, const float* bias, int64_t N,
                         int64_t C, int64_t OC);
// The same rounded to bf16 (nearest even): out = bf16(inp W^T + bias).
void linear_forward_bf16_out16(bf16* out, const bf16* inp, const bf16* W, const float* bias, int64_t N, int64_t C,
                               int64_t OC);
// dout is fp32 (it is rounded to bf16 internally for the two GEMMs); gradients are fp32 and
// accumulated as in linear_backward.
void linear_backward_bf16(float* dinp, float* dW, float* dbias, const float* dout, const bf16* inp,
                          const bf16* W, int64_t N, int64_t C, int64_t OC);
// The same two GEMMs (no bias) from an output gradient that is already bf16, dout [N, OC] (the LM
// head's, as softmax_cross_entropy_bf16 leaves it). Dense on purpose: oneDNN's bf16 matmul with a
// strided operand splits the sum differently on 1 and 2 threads.
void linear_backward_bf16_dy(float* dinp, float* dW, const bf16* dout, const bf16* inp, const bf16* W,
                             int64_t N, int64_t C, int64_t OC);

// GPT-2's MLP with fused epilogues (the CUDA backend's cuBLASLt GELU_AUX_BIAS / DGELU / BGRADB; here
// the same arithmetic in separate passes). gelu is the tanh form of gelu_forward (x sigmoid(2u)).
// Up projection: y = inp W^T + bias (fp32), pre = bf16(y), act = bf16(gelu(y)).
void linear_gelu_forward_bf16(bf16* act, bf16* pre, const bf16* inp, const bf16* W, const float* bias, int64_t N,
                              int64_t C, int64_t OC);
// Down projection's backward through the GELU (inp = gelu(pre)): dW += dout16^T inp, dbias +=
// column sums of dout, dpre = bf16(gelu'(pre) * (dout16 W)) written; dout16 = bf16(dout).
void linear_backward_dgelu_bf16(bf16* dpre, float* dW, float* dbias, const float* dout, const bf16* inp,
                                const bf16* W, const bf16* pre, int64_t N, int64_t C, int64_t OC);
// linear_backward_bf16_dy plus dbias += column sums of the bf16 dout (fp32, rows in order).
void linear_backward_bf16_dy_bias(float* dinp, float* dW, float* dbias, const bf16* dout, const bf16* inp,
                                  const bf16* W, int64_t N, int64_t C, int64_t OC);

}  // namespace mt::kernels::cpu
