// The kernel table: every op the model, the strategies and the optimizer run on tensor data, one
// table per device (ggml's backend interface, llm.c's kernel signatures). Callers pick the table of
// the device their tensors live on (`kernels::table(d)`) and never include a backend's headers.
//
// Conventions (as kernels/cpu/*.h): output first, then inputs, then dimensions (B T C N ...);
// row-major; backward functions ACCUMULATE (+=) into their gradient outputs. Each entry's contract
// is the CPU backend's header named beside it; the entries added for the seam are documented here.
// A new backend fills every entry (tests/kernels/backend_test.cpp checks that every table is
// complete; a backend that computes adds its kernels to a comparison against the CPU table there).
#pragma once
#include <cstdint>
#include <string>

#include "runtime/device.h"
#include "runtime/dtype.h"

namespace mt::kernels {

struct KernelTable {
  Device device;
  // --- elementwise (cpu/activation.h) ---
  void (*gelu_forward)(float* out, const float* inp, int64_t n);
  void (*gelu_backward)(float* dinp, const float* inp, const float* dout, int64_t n);
  void (*swiglu_forward)(float* out, const float* gate, const float* up, int64_t n);
  void (*swiglu_backward)(float* dgate, float* dup, const float* dout, const float* gate, const float* up, int64_t n);
  void (*accumulate)(float* y, const float* x, int64_t n);  // y += x
  void (*scale)(float* x, float s, int64_t n);
  double (*sum_squares)(const float* x, int64_t n);  // host result (0 on Meta)
  double (*sum)(const float* x, int64_t n);          // host result, double accumulation (0 on Meta)
  void (*cast_f32_to_bf16)(bf16* out, const float* in, int64_t n);
  void (*cast_bf16_to_f32)(float* out, const bf16* in, int64_t n);
  // x[n, :] += b for x [N, C].
  void (*add_bias)(float* x, const float* b, int64_t N, int64_t C);
  // Columns [c0, c0 + cols) of a [N, ld] matrix into a dense [N, cols] one.
  void (*copy_columns)(float* out, const float* in, int64_t N, int64_t ld, int64_t c0, int64_t cols);
  // --- linear layers (cpu/gemm.h) ---
  void (*linear_forward)(float* out, const float* inp, const float* W, const float* bias, int64_t N, int64_t C,
                         int64_t OC);
  void (*linear_backward)(float* dinp, float* dW, float* dbias, const float* dout, const float* inp, const float* W,
                          int64_t N, int64_t C, int64_t OC);
  void (*linear_forward_bf16)(float* out, const bf16* inp, const bf16* W, const float* bias, int64_t N, int64_t C,
                              int64_t OC);
  void (*linear_backward_bf16)(float* dinp, float* dW, float* dbias, const float* dout, const bf16* inp,
                               const bf16* W, int64_t N, int64_t C, int64_t OC);
  // The same two GEMMs (no bias) from an output gradient that is already bf16 (cpu/gemm.h).
  void (*linear_backward_bf16_dy)(float* dinp, float* dW, const bf16* dout, const bf16* inp, const bf16* W, int64_t N,
                                  int64_t C, int64_t OC);
  // --- norms (cpu/norm.h) ---
  void (*layernorm_forward)(float* out, float* mean, float* rstd, const float* inp, const float* w, const float* b,
                            int64_t N, int64_t C, float eps);
  void (*layernorm_backward)(float* dinp, float* dw, float* db, const float* dout, const float* inp, const float* w,
                             const float* mean, const float* rstd, int64_t N, int64_t C);
  void (*rmsnorm_forward)(float* out, float* rstd, const float* inp, const float* w, int64_t N, int64_t C, float eps);
  void (*rmsnorm_backward)(float* dinp, float* dw, const float* dout, const float* inp, const float* w,
                           const float* rstd, int64_t N, int64_t C);
  // --- attention (cpu/attention.h) ---
  void (*attention_forward)(float* out, float* lse, const float* qkv, int64_t B, int64_t T, int64_t nh, int64_t nkv,
                            int64_t hd);
  void (*attention_backward)(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse,
                             int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd);
  void (*rope_forward)(float* qkv, int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd, float theta);
  void (*rope_backward)(float* dqkv, int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd, float theta);
  // The same with explicit per-pair inverse frequencies (hd/2 of them, host memory; Llama 3.1's
  // scaled rotary embedding).
  void (*rope_forward_freq)(float* qkv, int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd, const float* inv_freq);
  void (*rope_backward_freq)(float* dqkv, int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd,
                             const float* inv_freq);
  // --- context parallelism (cpu/attention_block.h) ---
  // A rank's queries against one block of keys / values ([B, T, 2*nkv*hd]) in `chunks` chunks per
  // sequence, modes[a * chunks + b] = 0 skip / 1 full / 2 causal; merged into out / lse by log-sum-exp.
  void (*attention_block_forward)(float* out, float* lse, const float* qkv, const float* kv, int64_t B, int64_t T,
                                  int64_t nh, int64_t nkv, int64_t hd, int64_t chunks, const int8_t* modes, bool first);
  void (*attention_block_backward)(float* dqkv, float* dkv, const float* dout, const float* qkv, const float* kv,
                                   const float* out, const float* lse, int64_t B, int64_t T, int64_t nh, int64_t nkv,
                                   int64_t hd, int64_t chunks, const int8_t* modes);
  // Rotary embedding at explicit token positions (pos[T], host; inv_freq host or null for theta).
  void (*rope_forward_pos)(float* qkv, int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd, float theta,
                           const float* inv_freq, const int32_t* pos);
  void (*rope_backward_pos)(float* dqkv, int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd, float theta,
                            const float* inv_freq, const int32_t* pos);
  // x[i] += table[pos[(row0 + i) % T]] for R rows; dtable[pos[t]] += sum_b dout[b * T + t].
  void (*position_add_pos)(float* x, const float* table, const int32_t* pos, int64_t R, int64_t T, int64_t row0,
                           int64_t C);
  void (*position_backward_pos)(float* dtable, const float* dout, const int32_t* pos, int64_t B, int64_t T, int64_t C);
  // out[n, c0 + j] += in[n, j] ([N, ld] out, dense [N, cols] in).
  void (*add_columns)(float* out, const float* in, int64_t N, int64_t ld, int64_t c0, int64_t cols);
  // --- embeddings (cpu/embedding.h) ---
  void (*embedding_forward)(float* out, const int32_t* ids, const float* table, int64_t N, int64_t C);
  void (*embedding_backward)(float* dtable, const float* dout, const int32_t* ids, int64_t N, int64_t C);
  void (*position_add_forward)(float* x, const float* pos, int64_t B, int64_t T, int64_t C);
  void (*position_add_backward)(float* dpos, const float* dout, int64_t B, int64_t T, int64_t C);
  // Rows [lo, lo + rows) of a vocabulary table (this rank's share of a vocab-parallel embedding):
  // out[n] = table[ids[n] - lo] when ids[n] is one of them, else 0. `table` in `dt` (f32 or bf16),
  // out fp32. With lo = 0 and rows = the vocabulary this is the plain lookup.
  void (*vocab_embedding_forward)(float* out, const int32_t* ids, const void* table, DType dt, int64_t lo,
                                  int64_t rows, int64_t N, int64_t C);
  // dtable[ids[n] - lo] += dout[n] for the ids in [lo, lo + rows); deterministic.
  void (*vocab_embedding_backward)(float* dtable, const float* dout, const int32_t* ids, int64_t lo, int64_t rows,
                                   int64_t N, int64_t C);
  // x[i, :] += pos[(row0 + i) % T, :] for i < R: this rank's R rows of the flattened [B, T] tokens
  // (sequence parallelism starts at row0 = rank x R).
  void (*position_add_rows)(float* x, const float* pos, int64_t R, int64_t T, int64_t row0, int64_t C);
  // --- loss (cpu/loss.h) ---
  void (*softmax_cross_entropy)(float* logits, float* losses, const int32_t* targets, int64_t N, int64_t V,
                                int64_t Vp, float dloss);
  // softmax_cross_entropy with the gradient left in bf16 over the logits' storage (cpu/loss.h).
  void (*softmax_cross_entropy_bf16)(float* logits, float* losses, const int32_t* targets, int64_t N, int64_t V,
                                     int64_t Vp, float dloss);
  void (*softmax_cross_entropy_forward)(const float* logits, float* losses, const int32_t* targets, int64_t N,
                                        int64_t V, int64_t Vp);
  // Vocab-parallel cross-entropy (Megatron) over a rank's `Vl` logit columns of which the first
  // `valid` are real vocabulary, global column = lo + j. Three passes around two reductions over
  // the tp ranks: (1) rowmax[n] = max_j lg[n, j]; all-reduce max. (2) stats[n] = sum_j
  // exp(lg - rowmax), stats[N + n] = the target's logit if this rank holds it, else 0; all-reduce
  // sum. (3) losses[n] = log(stats[n]) + rowmax[n] - stats[N + n] (0 for targets < 0) and, with
  // train, lg becomes its gradient (softmax - onehot) * dloss (0 in padded columns).
  void (*vp_ce_rowmax)(float* rowmax, const float* lg, int64_t N, int64_t Vl, int64_t valid);
  void (*vp_ce_stats)(float* stats, const float* lg, const float* rowmax, const int32_t* targets, int64_t N,
                      int64_t Vl, int64_t valid, int64_t lo);
  void (*vp_ce_finish)(float* lg, float* losses, const float* rowmax, const float* stats, const int32_t* targets,
                       int64_t N, int64_t Vl, int64_t valid, int64_t lo, bool train, float dloss);
  // --- mixture of experts (cpu/moe.h) ---
  void (*moe_router_forward)(float* scores, int32_t* idx, float* w, float* lse, const float* logits, int64_t N,
                             int64_t E, int64_t k, int sigmoid);
  void (*moe_router_backward)(float* dlogits, const float* dw, const float* scores, const int32_t* idx, const float* w,
                              const float* lse, const float* logits, const float* aux, float z_scale, int64_t N,
                              int64_t E, int64_t k, int sigmoid);
  void (*moe_balance_probs)(float* P, const float* scores, int64_t N, int64_t E, int sigmoid);
  void (*moe_gather_rows)(void* out, const void* in, const int32_t* rows, int64_t n, int64_t row_bytes);
  void (*moe_combine)(float* out, const float* y, const int32_t* pos, const float* w, int64_t N, int64_t k, int64_t C);
  void (*moe_combine_backward)(float* dy, float* dw, const float* dout, const float* y, const int32_t* pos,
                               const float* w, int64_t N, int64_t k, int64_t C);
  // --- optimizer (cpu/adamw.h) ---
  void (*adamw_update)(float* param, const float* grad, float* m, float* v, int64_t n, float lr, float beta1,
                       float beta2, float eps, float weight_decay, int64_t step, float grad_scale, bf16* param_bf16);
};

// The table of device d. For Device::CUDA in a build without the CUDA backend this throws an error
// saying so; in a CUDA build it returns the table even without a GPU (its kernels then throw the
// device's "no usable CUDA device" error on first use).
const KernelTable& table(Device d);
// One line naming what runs device d's kernels (for run headers and benchmarks), e.g. "cpu AMD
// EPYC 9B14 (family 25 model 17), isa avx512_bf16, kernels avx512, oneDNN avx512_core_bf16".
std::string describe(Device d);

namespace cpu {
const KernelTable& cpu_table();
}
namespace meta {
const KernelTable& meta_table();
}
namespace cuda {  // defined only in CUDA builds (kernels/cuda/)
const KernelTable& cuda_table();
}

}  // namespace mt::kernels
