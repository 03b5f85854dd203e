// The CPU backend's kernel table of one instruction-set variant (kernels/cpu/isa.h): the functions
// of kernels/cpu/*.h as this variant compiled them. GEMMs are oneDNN's, which dispatches on the
// CPU itself, so both variants share them. cpu_isa.cpp chooses the variant.
#include "kernels/backend.h"
#include "kernels/cpu/activation.h"
#include "kernels/cpu/adamw.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/attention_block.h"
#include "kernels/cpu/embedding.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/loss.h"
#include "kernels/cpu/moe.h"
#include "kernels/cpu/norm.h"

MT_CPU_VARIANT_BEGIN
const KernelTable& isa_table() {
  static const KernelTable t = {
      .device = Device::CPU,
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
      .rope_forward_freq = rope_forward,
      .rope_backward_freq = rope_backward,
      .attention_block_forward = attention_block_forward,
      .attention_block_backward = attention_block_backward,
      .rope_forward_pos = rope_forward_pos,
      .rope_backward_pos = rope_backward_pos,
      .position_add_pos = position_add_pos,
      .position_backward_pos = position_backward_pos,
      .add_columns = add_columns,
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
      .moe_router_forward = moe_router_forward,
      .moe_router_backward = moe_router_backward,
      .moe_balance_probs = moe_balance_probs,
      .moe_gather_rows = moe_gather_rows,
      .moe_combine = moe_combine,
      .moe_combine_backward = moe_combine_backward,
      .adamw_update = adamw_update,
  };
  return t;
}
MT_CPU_VARIANT_END
