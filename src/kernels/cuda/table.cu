// The CUDA backend's kernel table (kernels/backend.h) and its scratch buffers.
#include <mutex>
#include <stdexcept>
#include <string>

#include "kernels/backend.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels.h"

namespace mt::kernels::cuda {

void* scratch(int slot, size_t bytes) {
  struct Slot {
    void* p = nullptr;
    size_t bytes = 0;
  };
  static Slot slots[kNumScratch];
  static std::mutex mu;
  std::lock_guard<std::mutex> lk(mu);
  Slot& s = slots[slot];
  if (s.bytes < bytes) {
    // Work queued earlier on the (single) compute stream may still read the old buffer; the
    // allocator hands it out again only to work queued after this point, so freeing is safe.
    if (s.p) mt::cuda::free(s.p, s.bytes, MemCategory::Scratch);
    s.p = mt::cuda::alloc(bytes, MemCategory::Scratch);
    s.bytes = bytes;
  }
  return s.p;
}

namespace {

// Entries added for context parallelism and mixtures of experts after the CUDA table was
// written: no CUDA kernel yet, and training on the GPU is not wired, so nothing calls them; a call
// says what is missing instead of touching device memory with a host kernel.
[[noreturn]] void missing(const char* what) {
  throw std::runtime_error(std::string("meshtrain: device cuda: kernel ") + what +
                           " is not implemented on CUDA yet (context parallelism and mixtures of experts run on "
                           "the CPU only)");
}
void add_columns_missing(float*, const float*, int64_t, int64_t, int64_t, int64_t) { missing("add_columns"); }
void attention_block_forward_missing(float*, float*, const float*, const float*, int64_t, int64_t, int64_t, int64_t,
                                     int64_t, int64_t, const int8_t*, bool) {
  missing("attention_block_forward");
}
void attention_block_backward_missing(float*, float*, const float*, const float*, const float*, const float*,
                                      const float*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                                      const int8_t*) {
  missing("attention_block_backward");
}
void rope_pos_missing(float*, int64_t, int64_t, int64_t, int64_t, int64_t, float, const float*, const int32_t*) {
  missing("rope_forward_pos / rope_backward_pos");
}
void position_add_pos_missing(float*, const float*, const int32_t*, int64_t, int64_t, int64_t, int64_t) {
  missing("position_add_pos");
}
void position_backward_pos_missing(float*, const float*, const int32_t*, int64_t, int64_t, int64_t) {
  missing("position_backward_pos");
}
void moe_router_forward_missing(float*, int32_t*, float*, float*, const float*, int64_t, int64_t, int64_t, int) {
  missing("moe_router_forward");
}
void moe_router_backward_missing(float*, const float*, const float*, const int32_t*, const float*, const float*,
                                 const float*, const float*, float, int64_t, int64_t, int64_t, int) {
  missing("moe_router_backward");
}
void moe_balance_probs_missing(float*, const float*, int64_t, int64_t, int) { missing("moe_balance_probs"); }
void moe_gather_rows_missing(void*, const void*, const int32_t*, int64_t, int64_t) { missing("moe_gather_rows"); }
void moe_combine_missing(float*, const float*, const int32_t*, const float*, int64_t, int64_t, int64_t) {
  missing("moe_combine");
}
void moe_combine_backward_missing(float*, float*, const float*, const float*, const int32_t*, const float*, int64_t,
                                  int64_t, int64_t) {
  missing("moe_combine_backward");
}

}  // namespace

// The table below leaves the entries without a CUDA kernel out (set in `full`).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"
const KernelTable& cuda_table() {
  static const KernelTable t = {
      .device = Device::CUDA,
      .gelu_forward = gelu_forward,
      .gelu_backward = gelu_backward,
      .swiglu_forward = swiglu_forward,
      .swiglu_backward = swiglu_backward,
      .accumulate = accumulate,
      .scale = scale,
      .sum_squares = sum_squares,
      .sum = sum,
      .cast_f32_to_bf16 = cast_f32_to_bf16,
      .cast_bf16_to_f32 = cast_bf16_to_f32,
      .add_bias = add_bias,
      .copy_columns = copy_columns,
      .linear_forward = linear_forward,
      .linear_backward = linear_backward,
      .linear_forward_bf16 = linear_forward_bf16,
      .linear_backward_bf16 = linear_backward_bf16,
      .linear_backward_bf16_dy = linear_backward_bf16_dy,
      .layernorm_forward = layernorm_forward,
      .layernorm_backward = layernorm_backward,
      .rmsnorm_forward = rmsnorm_forward,
      .rmsnorm_backward = rmsnorm_backward,
      .attention_forward = attention_forward,
      .attention_backward = attention_backward,
      .rope_forward = rope_forward,
      .rope_backward = rope_backward,
      .rope_forward_freq = rope_forward_freq,
      .rope_backward_freq = rope_backward_freq,
      .embedding_forward = embedding_forward,
      .embedding_backward = embedding_backward,
      .position_add_forward = position_add_forward,
      .position_add_backward = position_add_backward,
      .vocab_embedding_forward = vocab_embedding_forward,
      .vocab_embedding_backward = vocab_embedding_backward,
      .position_add_rows = position_add_rows,
      .softmax_cross_entropy = softmax_cross_entropy,
      .softmax_cross_entropy_bf16 = softmax_cross_entropy_bf16,
      .softmax_cross_entropy_forward = softmax_cross_entropy_forward,
      .vp_ce_rowmax = vp_ce_rowmax,
      .vp_ce_stats = vp_ce_stats,
      .vp_ce_finish = vp_ce_finish,
      .adamw_update = adamw_update,
  };
  // Entries without a CUDA kernel yet (see missing()); designated initializers above must stay in
  // declaration order, so these are set afterwards.
  static const KernelTable full = [] {
    KernelTable k = t;
    k.add_columns = add_columns_missing;
    k.attention_block_forward = attention_block_forward_missing;
    k.attention_block_backward = attention_block_backward_missing;
    k.rope_forward_pos = rope_pos_missing;
    k.rope_backward_pos = rope_pos_missing;
    k.position_add_pos = position_add_pos_missing;
    k.position_backward_pos = position_backward_pos_missing;
    k.moe_router_forward = moe_router_forward_missing;
    k.moe_router_backward = moe_router_backward_missing;
    k.moe_balance_probs = moe_balance_probs_missing;
    k.moe_gather_rows = moe_gather_rows_missing;
    k.moe_combine = moe_combine_missing;
    k.moe_combine_backward = moe_combine_backward_missing;
    return k;
  }();
  return full;
}
#pragma GCC diagnostic pop

}  // namespace mt::kernels::cuda
