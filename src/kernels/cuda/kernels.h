// The CUDA backend's kernels (host entry points with the CPU contracts of kernels/cpu/*.h; each
// queues its work on the CUDA device's compute stream). Pointers are device memory except where
// the contract says host (rope inv_freq). Reductions to a host double synchronise the stream.
#pragma once
#include <cstdint>

#include "kernels/ops.h"
#include "runtime/dtype.h"

namespace mt::kernels::cuda {

// Scratch slots (common.cuh scratch()).
// kScratchHostArgs: a kernel's copy of its small host-memory arguments (positions, chunk modes).
enum ScratchSlot : int {
  kScratchReduce = 0,
  kScratchGemm,
  kScratchRope,
  kScratchTmp,
  kScratchHostArgs,
  kScratchFlashQkv,   // flash_attention.cu: fp32 copies for head dims it hands to attention.cu
  kScratchFlashDout,  // flash_attention.cu: dout rounded to bf16
  kScratchColumnSums,
  kScratchReduceOut,
  kScratchEpilogue,  // gemm.cu: the fp32 GEMM result where an epilogue cannot be fused
  kScratchBgrad,     // gemm.cu: the BGRADB epilogue's bias gradient before it is added
  kNumScratch
};

// elementwise.cu
void gelu_forward(float* out, const float* inp, int64_t n);
void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t n);
void swiglu_forward(float* out, const float* gate, const float* up, int64_t n);
void swiglu_backward(float* dgate, float* dup, const float* dout, const float* gate, const float* up, int64_t n);
void swiglu_forward_bf16(bf16* out, const bf16* gate, const bf16* up, int64_t n);
void swiglu_backward_bf16(bf16* dgate, bf16* dup, const float* dout, const bf16* gate, const bf16* up, int64_t n);
void accumulate(float* y, const float* x, int64_t n);
void scale(float* x, float s, int64_t n);
double sum_squares(const float* x, int64_t n);
double sum(const float* x, int64_t n);
void sum_squares_to(double* out, const float* x, int64_t n);
void sum_to(double* out, const float* x, int64_t n);
void cast_f32_to_bf16(bf16* out, const float* in, int64_t n);
void cast_bf16_to_f32(float* out, const bf16* in, int64_t n);
void add_bias(float* x, const float* b, int64_t N, int64_t C);
void copy_columns(float* out, const float* in, int64_t N, int64_t ld, int64_t c0, int64_t cols);

// reduce.cu: column sums of an [N, C] matrix as a two-stage deterministic reduction (partials
// per slice of rows, then a fixed-order pass per column), added (+=) into the outputs.
// inp null: out_a += sum_n dout[n, :] (out_b unused). Else xhat = (inp - mean) * rstd (mean null:
// RMSNorm): out_a += sum_n dout * xhat, out_b += sum_n dout; either output may be null.
void column_sums(float* out_a, float* out_b, const float* dout, const float* inp, const float* mean, const float* rstd,
                 int64_t N, int64_t C);
// The same with a bf16 inp (the bits as the engine stores them), widened to fp32.
void column_sums_bf16(float* out_a, float* out_b, const float* dout, const uint16_t* inp, const float* mean,
                      const float* rstd, int64_t N, int64_t C);
int64_t column_sum_parts(int64_t N);  // the number of row slices (depends on N only)

// gemm.cu (cuBLASLt)
void linear_forward(float* out, const float* inp, const float* W, const float* bias, int64_t N, int64_t C, int64_t OC);
void linear_backward(float* dinp, float* dW, float* dbias, const float* dout, const float* inp, const float* W,
                     int64_t N, int64_t C, int64_t OC);
void linear_forward_bf16(float* out, const bf16* inp, const bf16* W, const float* bias, int64_t N, int64_t C,
                         int64_t OC);
void linear_forward_bf16_out16(bf16* out, const bf16* inp, const bf16* W, const float* bias, int64_t N, int64_t C,
                               int64_t OC);
void linear_backward_bf16(float* dinp, float* dW, float* dbias, const float* dout, const bf16* inp, const bf16* W,
                          int64_t N, int64_t C, int64_t OC);
void linear_backward_bf16_dy(float* dinp, float* dW, const bf16* dout, const bf16* inp, const bf16* W, int64_t N,
                             int64_t C, int64_t OC);
void linear_gelu_forward_bf16(bf16* act, bf16* pre, const bf16* inp, const bf16* W, const float* bias, int64_t N,
                              int64_t C, int64_t OC);
void linear_backward_dgelu_bf16(bf16* dpre, float* dW, float* dbias, const float* dout, const bf16* inp,
                                const bf16* W, const bf16* pre, int64_t N, int64_t C, int64_t OC);
void linear_backward_bf16_dy_bias(float* dinp, float* dW, float* dbias, const bf16* dout, const bf16* inp,
                                  const bf16* W, int64_t N, int64_t C, int64_t OC);

// norm.cu
void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* w, const float* b,
                       int64_t N, int64_t C, float eps);
void layernorm_backward(float* dinp, float* dw, float* db, const float* dout, const float* inp, const float* w,
                        const float* mean, const float* rstd, int64_t N, int64_t C);
void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* w, int64_t N, int64_t C, float eps);
void rmsnorm_backward(float* dinp, float* dw, const float* dout, const float* inp, const float* w, const float* rstd,
                      int64_t N, int64_t C);
void residual_layernorm_forward(float* out, float* mean, float* rstd, float* res, const float* x, const float* w,
                                const float* b, int64_t N, int64_t C, float eps);
void residual_rmsnorm_forward(float* out, float* rstd, float* res, const float* x, const float* w, int64_t N,
                              int64_t C, float eps);
void residual_add_bf16(bf16* out, const bf16* res, const float* x, int64_t n);
void residual_layernorm_forward_bf16(float* out, float* mean, float* rstd, bf16* res_out, const bf16* res,
                                     const float* x, const float* w, const float* b, int64_t N, int64_t C, float eps);
void residual_rmsnorm_forward_bf16(float* out, float* rstd, bf16* res_out, const bf16* res, const float* x,
                                   const float* w, int64_t N, int64_t C, float eps);
void layernorm_backward_bf16(float* dinp, float* dw, float* db, const float* dout, const bf16* inp, const float* w,
                             const float* mean, const float* rstd, int64_t N, int64_t C);
void rmsnorm_backward_bf16(float* dinp, float* dw, const float* dout, const bf16* inp, const float* w,
                           const float* rstd, int64_t N, int64_t C);

// embed_loss.cu
void embedding_forward(float* out, const int32_t* ids, const float* table, int64_t N, int64_t C);
void embedding_backward(float* dtable, const float* dout, const int32_t* ids, int64_t N, int64_t C);
void position_add_forward(float* x, const float* pos, int64_t B, int64_t T, int64_t C);
void position_add_backward(float* dpos, const float* dout, int64_t B, int64_t T, int64_t C);
void vocab_embedding_forward(float* out, const int32_t* ids, const void* table, DType dt, int64_t lo, int64_t rows,
                             int64_t N, int64_t C);
void vocab_embedding_backward(float* dtable, const float* dout, const int32_t* ids, int64_t lo, int64_t rows, int64_t N,
                              int64_t C);
void position_add_rows(float* x, const float* pos, int64_t R, int64_t T, int64_t row0, int64_t C);
void softmax_cross_entropy(float* logits, float* losses, const int32_t* targets, int64_t N, int64_t V, int64_t Vp,
                           float dloss);
void softmax_cross_entropy_bf16(float* logits, float* losses, const int32_t* targets, int64_t N, int64_t V, int64_t Vp,
                                float dloss);
void softmax_cross_entropy_forward(const float* logits, float* losses, const int32_t* targets, int64_t N, int64_t V,
                                   int64_t Vp);
void softmax_cross_entropy_from_bf16(bf16* logits, float* losses, const int32_t* targets, int64_t N, int64_t V,
                                     int64_t Vp, bool train, float dloss);
void vp_ce_rowmax(float* rowmax, const float* lg, int64_t N, int64_t Vl, int64_t valid);
void vp_ce_stats(float* stats, const float* lg, const float* rowmax, const int32_t* targets, int64_t N, int64_t Vl,
                 int64_t valid, int64_t lo);
void vp_ce_finish(float* lg, float* losses, const float* rowmax, const float* stats, const int32_t* targets, int64_t N,
                  int64_t Vl, int64_t valid, int64_t lo, bool train, float dloss);
void adamw_update(float* param, const float* grad, float* m, float* v, int64_t n, float lr, float beta1, float beta2,
                  float eps, float weight_decay, int64_t step, float grad_scale, bf16* param_bf16);

// adamw_multi.cu
void adamw_update_multi(const AdamWTensor* tensors, int64_t count, float lr, float beta1, float beta2, float eps,
                        int64_t step, float grad_scale, const double* clip_norm_sq, double clip_max);

// attention.cu
void attention_forward(float* out, float* lse, const float* qkv, int64_t B, int64_t T, int64_t nh, int64_t nkv,
                       int64_t hd, const int32_t* doc_start);
void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse, int64_t B,
                        int64_t T, int64_t nh, int64_t nkv, int64_t hd, const int32_t* doc_start);
void rope_forward(float* qkv, int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd, float theta);
void rope_backward(float* dqkv, int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd, float theta);
void rope_forward_freq(float* qkv, int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd, const float* inv_freq);
void rope_backward_freq(float* dqkv, int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd, const float* inv_freq);
void rope_forward_pos(float* qkv, int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd, float theta,
                      const float* inv_freq, const int32_t* pos);
void rope_backward_pos(float* dqkv, int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd, float theta,
                       const float* inv_freq, const int32_t* pos);

// flash_attention.cu: the tensor-core kernels (bf16 in, fp32 accumulation) for head_dim <=
// kFlashMaxHeadDim; larger head dims run attention.cu's kernels on the same bf16 values.
constexpr int64_t kFlashMaxHeadDim = 128;
void attention_forward_bf16(bf16* out, float* lse, const bf16* qkv, int64_t B, int64_t T, int64_t nh, int64_t nkv,
                            int64_t hd, const int32_t* doc_start);
void attention_backward_bf16(float* dqkv, const float* dout, const bf16* qkv, const bf16* out, const float* lse,
                             int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd, const int32_t* doc_start);

// block_attention.cu (context parallelism: cpu/attention_block.h)
void attention_block_forward(float* out, float* lse, const float* qkv, const float* kv, int64_t B, int64_t T,
                             int64_t nh, int64_t nkv, int64_t hd, int64_t chunks, const int8_t* modes, bool first,
                             const int32_t* doc_start, const int32_t* key_start);
void attention_block_backward(float* dqkv, float* dkv, const float* dout, const float* qkv, const float* kv,
                              const float* out, const float* lse, int64_t B, int64_t T, int64_t nh, int64_t nkv,
                              int64_t hd, int64_t chunks, const int8_t* modes, const int32_t* doc_start,
                              const int32_t* key_start);

// positions.cu (cpu/attention_block.h): learned positions at explicit positions, column adds
void position_add_pos(float* x, const float* table, const int32_t* pos, int64_t R, int64_t T, int64_t row0,
                      int64_t C);
void position_backward_pos(float* dtable, const float* dout, const int32_t* pos, int64_t B, int64_t T, int64_t C);
void add_columns(float* out, const float* in, int64_t N, int64_t ld, int64_t c0, int64_t cols);

// moe.cu (cpu/moe.h)
void moe_router_forward(float* scores, int32_t* idx, float* w, float* lse, const float* logits, int64_t N, int64_t E,
                        int64_t k, int sigmoid);
void moe_router_backward(float* dlogits, const float* dw, const float* scores, const int32_t* idx, const float* w,
                         const float* lse, const float* logits, const float* aux, float z_scale, int64_t N, int64_t E,
                         int64_t k, int sigmoid);
void moe_balance_probs(float* P, const float* scores, int64_t N, int64_t E, int sigmoid);
void moe_gather_rows(void* out, const void* in, const int32_t* rows, int64_t n, int64_t row_bytes);
void moe_combine(float* out, const float* y, const int32_t* pos, const float* w, int64_t N, int64_t k, int64_t C);
void moe_combine_backward(float* dy, float* dw, const float* dout, const float* y, const int32_t* pos, const float* w,
                          int64_t N, int64_t k, int64_t C);

}  // namespace mt::kernels::cuda
