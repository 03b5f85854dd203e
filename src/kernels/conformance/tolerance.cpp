// The stated tolerance of every op (kernels/conformance/check.h): what a correct kernel on another
// backend may differ from the CPU baseline by, and why. The cases keep outputs of order 1 (inputs
// of a few units, weights scaled by 1/sqrt(fan-in)), so one bound per op fits every shape.
// docs/kernels.md repeats this table.
#include "kernels/conformance/check.h"

namespace mt::kernels::conformance {

Tolerance tolerance(Op op, DType) {
  switch (op) {
    // Exact by construction: copies, gathers, one rounding of the same operands (the casts round to
    // nearest even everywhere), token-order additions, a maximum.
    case Op::accumulate:
    case Op::scale:
    case Op::cast_f32_to_bf16:
    case Op::cast_bf16_to_f32:
    case Op::residual_add_bf16:
    case Op::add_bias:
    case Op::copy_columns:
    case Op::add_columns:
    case Op::embedding_forward:
    case Op::embedding_backward:
    case Op::vocab_embedding_forward:
    case Op::vocab_embedding_backward:
    case Op::position_add_forward:
    case Op::position_add_rows:
    case Op::position_add_pos:
    case Op::moe_gather_rows:
    case Op::vp_ce_rowmax:
      return {0.0, 0.0};

    // Sums over the batch in order: exact on the CPU; a device may add pairs in another order.
    case Op::position_add_backward:
    case Op::position_backward_pos:
      return {1e-6, 1e-6};
    // A weighted sum of k rows: FMA contraction may change the last bit of each term.
    case Op::moe_combine:
      return {1e-6, 1e-6};

    // Double-precision accumulation in a different order: the order changes digits far below float.
    case Op::sum:
    case Op::sum_squares:
    case Op::sum_to:
    case Op::sum_squares_to:
      return {1e-10, 1e-10};

    // tanh / exp of the device's math library (a few ulp apart from glibc's and the vector ones).
    case Op::gelu_forward:
    case Op::swiglu_forward:
      return {1e-5, 1e-6};
    case Op::gelu_backward:
    case Op::swiglu_backward:
      return {1e-5, 1e-5};
    // The same arithmetic on bf16 operands, each result rounded once to bf16: an fp32 value a few
    // ulp apart may round to the neighbouring bf16 value (the runner widens bf16 outputs' relative
    // bound to 2^-7).
    case Op::swiglu_forward_bf16:
    case Op::swiglu_backward_bf16:
      return {1e-5, 1e-6};

    // One rotation per pair (cos / sin tables computed in double on the host by every backend):
    // FMA contraction moves the last bit.
    case Op::rope_forward:
    case Op::rope_backward:
    case Op::rope_forward_freq:
    case Op::rope_backward_freq:
    case Op::rope_forward_pos:
    case Op::rope_backward_pos:
      return {1e-6, 1e-6};

    // GEMMs: sums of up to 50304 products in another order (blocking, threads, split K). bf16
    // operands are the same bf16 values on both sides and the products exact in fp32, but tensor
    // cores do not round each addition to nearest, so bf16 GEMMs get ten times the fp32 bound.
    case Op::linear_forward:
    case Op::linear_backward:
      return {1e-4, 1e-5};
    case Op::linear_forward_bf16:
    case Op::linear_backward_bf16:
    case Op::linear_backward_bf16_dy:
      return {1e-3, 1e-4};
    // The same GEMMs with GELU (forward) or its derivative (backward) applied to the fp32 result
    // before it is rounded to bf16: a result within the GEMM bound may round to the neighbouring
    // bf16 value (the runner widens bf16 outputs' relative bound to 2^-7); tanh of the device's
    // math library moves the fp32 value by a few ulp more. The bias gradient sums bf16 values in fp32.
    case Op::linear_forward_bf16_out16:  // the GEMM rounded to bf16 (no GELU)
    case Op::linear_gelu_forward_bf16:
    case Op::linear_backward_dgelu_bf16:
    case Op::linear_backward_bf16_dy_bias:
      return {1e-3, 1e-4};

    // Row statistics (mean, rsqrt of the variance) reduced in another order; the backward's two
    // row sums compound it.
    case Op::layernorm_forward:
    case Op::rmsnorm_forward:
    case Op::residual_layernorm_forward:  // the add itself is exact
    case Op::residual_rmsnorm_forward:
    case Op::residual_layernorm_forward_bf16:  // the add rounds the same fp32 sum to bf16 on both
    case Op::residual_rmsnorm_forward_bf16:
      return {1e-5, 1e-5};
    case Op::layernorm_backward:
    case Op::rmsnorm_backward:
    case Op::layernorm_backward_bf16:  // the fp32 backward of the same widened values
    case Op::rmsnorm_backward_bf16:
      return {1e-4, 1e-4};

    // Tiled softmax (online rescaling on a device, exact rows on the CPU) and dot products of hd
    // terms; the backward recomputes the probabilities from lse.
    case Op::attention_forward:
    case Op::attention_block_forward:
      return {1e-4, 1e-5};
    case Op::attention_backward:
    case Op::attention_block_backward:
      return {1e-4, 1e-4};

    // The bf16 attention against the exact attention of the same bf16 values: a tensor-core kernel
    // rounds the probabilities (forward: P V; backward: P^T dO) and dS to bf16 before multiplying,
    // which moves each term by up to 2^-9 relative. A key seen by few queries takes large
    // probabilities (up to 1), so its dV terms carry absolute errors of up to 2^-9 each; the
    // emulator's worst elements at the small shapes are off by 2.8e-3
    // (forward) and 6e-3 (backward).
    case Op::attention_forward_bf16:
      return {1e-2, 5e-3};
    case Op::attention_backward_bf16:
      return {1e-2, 1e-2};

    // exp / log over a vocabulary row reduced in another order. The gradients are softmax values
    // of order 1/V (down to 1e-9), so the absolute slack is small.
    case Op::softmax_cross_entropy:
    case Op::softmax_cross_entropy_bf16:
    case Op::softmax_cross_entropy_forward:
    case Op::softmax_cross_entropy_from_bf16:
    case Op::vp_ce_stats:
    case Op::vp_ce_finish:
      return {1e-5, 1e-8};

    // Router softmax / sigmoid over E experts and its backward; a dot product of C terms for the
    // combine's weight gradient.
    case Op::moe_router_forward:
    case Op::moe_router_backward:
    case Op::moe_combine_backward:
      return {1e-5, 1e-6};
    case Op::moe_balance_probs:
      return {1e-5, 1e-7};

    // One update per element: FMA contraction and the device's sqrt / division may move the last
    // bit of the parameter and the moments. m = beta1 m + (1 - beta1) g cancels: a device that
    // fuses one of the two products differs by up to half an ulp of the larger term (|beta1 m| <=
    // 0.09 in the cases: 3.7e-9), a large relative error when m is small, hence the absolute term.
    case Op::adamw_update:
    case Op::adamw_update_multi:
      return {1e-6, 1e-8};
  }
  return {0.0, 0.0};
}

}  // namespace mt::kernels::conformance
