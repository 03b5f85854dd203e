// The Meta backend's kernel table: every kernel accepts its arguments and does nothing (a dry run
// counts memory and communication, not values); reductions to the host return 0.
#include "kernels/backend.h"

namespace mt::kernels::meta {

namespace {
// A no-op with any signature (returns a value-initialised result).
template <typename R, typename... A>
R nop(A...) {
  return R();
}
template <typename R, typename... A>
constexpr auto as_nop(R (*)(A...)) -> R (*)(A...) {
  return &nop<R, A...>;
}
}  // namespace

const KernelTable& meta_table() {
  static const KernelTable t = [] {
    KernelTable k{};
    k.device = Device::Meta;
    k.gelu_forward = as_nop(k.gelu_forward);
    k.gelu_backward = as_nop(k.gelu_backward);
    k.swiglu_forward = as_nop(k.swiglu_forward);
    k.swiglu_backward = as_nop(k.swiglu_backward);
    k.accumulate = as_nop(k.accumulate);
    k.scale = as_nop(k.scale);
    k.sum_squares = as_nop(k.sum_squares);
    k.sum = as_nop(k.sum);
    k.cast_f32_to_bf16 = as_nop(k.cast_f32_to_bf16);
    k.cast_bf16_to_f32 = as_nop(k.cast_bf16_to_f32);
    k.add_bias = as_nop(k.add_bias);
    k.copy_columns = as_nop(k.copy_columns);
    k.linear_forward = as_nop(k.linear_forward);
    k.linear_backward = as_nop(k.linear_backward);
    k.linear_forward_bf16 = as_nop(k.linear_forward_bf16);
    k.linear_backward_bf16 = as_nop(k.linear_backward_bf16);
    k.linear_backward_bf16_dy = as_nop(k.linear_backward_bf16_dy);
    k.layernorm_forward = as_nop(k.layernorm_forward);
    k.layernorm_backward = as_nop(k.layernorm_backward);
    k.rmsnorm_forward = as_nop(k.rmsnorm_forward);
    k.rmsnorm_backward = as_nop(k.rmsnorm_backward);
    k.attention_forward = as_nop(k.attention_forward);
    k.attention_backward = as_nop(k.attention_backward);
    k.rope_forward = as_nop(k.rope_forward);
    k.rope_backward = as_nop(k.rope_backward);
    k.rope_forward_freq = as_nop(k.rope_forward_freq);
    k.rope_backward_freq = as_nop(k.rope_backward_freq);
    k.attention_block_forward = as_nop(k.attention_block_forward);
    k.attention_block_backward = as_nop(k.attention_block_backward);
    k.rope_forward_pos = as_nop(k.rope_forward_pos);
    k.rope_backward_pos = as_nop(k.rope_backward_pos);
    k.position_add_pos = as_nop(k.position_add_pos);
    k.position_backward_pos = as_nop(k.position_backward_pos);
    k.add_columns = as_nop(k.add_columns);
    k.embedding_forward = as_nop(k.embedding_forward);
    k.embedding_backward = as_nop(k.embedding_backward);
    k.position_add_forward = as_nop(k.position_add_forward);
    k.position_add_backward = as_nop(k.position_add_backward);
    k.vocab_embedding_forward = as_nop(k.vocab_embedding_forward);
    k.vocab_embedding_backward = as_nop(k.vocab_embedding_backward);
    k.position_add_rows = as_nop(k.position_add_rows);
    k.softmax_cross_entropy = as_nop(k.softmax_cross_entropy);
    k.softmax_cross_entropy_bf16 = as_nop(k.softmax_cross_entropy_bf16);
    k.softmax_cross_entropy_forward = as_nop(k.softmax_cross_entropy_forward);
    k.vp_ce_rowmax = as_nop(k.vp_ce_rowmax);
    k.vp_ce_stats = as_nop(k.vp_ce_stats);
    k.vp_ce_finish = as_nop(k.vp_ce_finish);
    k.moe_router_forward = as_nop(k.moe_router_forward);
    k.moe_router_backward = as_nop(k.moe_router_backward);
    k.moe_balance_probs = as_nop(k.moe_balance_probs);
    k.moe_gather_rows = as_nop(k.moe_gather_rows);
    k.moe_combine = as_nop(k.moe_combine);
    k.moe_combine_backward = as_nop(k.moe_combine_backward);
    k.adamw_update = as_nop(k.adamw_update);
    return k;
  }();
  return t;
}

}  // namespace mt::kernels::meta
