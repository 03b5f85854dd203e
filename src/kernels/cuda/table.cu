// The CUDA backend's kernel table (kernels/backend.h) and its scratch buffers.
#include <mutex>

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
      .softmax_cross_entropy_forward = softmax_cross_entropy_forward,
      .vp_ce_rowmax = vp_ce_rowmax,
      .vp_ce_stats = vp_ce_stats,
      .vp_ce_finish = vp_ce_finish,
      .adamw_update = adamw_update,
  };
  return t;
}

}  // namespace mt::kernels::cuda
