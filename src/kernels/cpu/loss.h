// Fused softmax + cross-entropy over a (possibly padded) vocabulary.
#pragma once
#include "kernels/cpu/isa.h"
#include <cstdint>

#include "runtime/dtype.h"

MT_CPU_NS_BEGIN

// logits [N, Vp], of which the first V columns are real vocabulary (Vp >= V is padding).
// losses[n] = -log softmax(logits[n, :V])[targets[n]]; rows with targets[n] < 0 are ignored
// (loss 0, gradient 0). Then logits is OVERWRITTEN with the gradient of
// dloss * sum_n losses[n] w.r.t. the logits: (softmax - onehot) * dloss, zero in padded columns.
void softmax_cross_entropy(float* logits, float* losses, const int32_t* targets, int64_t N, int64_t V,
                           int64_t Vp, float dloss);
// The same loss, with the gradient rounded to bf16 (round to nearest even, as cast_f32_to_bf16)
// and written as a dense [N, Vp] bf16 matrix over the first half of the logits' storage: equal,
// bit for bit, to softmax_cross_entropy followed by a cast into a separate buffer, without the
// fp32 gradient's write and the cast's pass (the bf16 LM head's backward reads it directly).
void softmax_cross_entropy_bf16(float* logits, float* losses, const int32_t* targets, int64_t N, int64_t V,
                                int64_t Vp, float dloss);
// Forward only (losses), logits untouched: for eval.
void softmax_cross_entropy_forward(const float* logits, float* losses, const int32_t* targets,
                                   int64_t N, int64_t V, int64_t Vp);
// The loss from bf16 logits [N, Vp]: each row widened exactly to fp32 (into per-thread scratch),
// then softmax_cross_entropy's row arithmetic on it. With train the row is overwritten in place by
// its gradient rounded to bf16 (as softmax_cross_entropy_bf16 rounds it; 0 in the padded columns
// and in ignored rows); without, the logits are untouched.
void softmax_cross_entropy_from_bf16(bf16* logits, float* losses, const int32_t* targets, int64_t N, int64_t V,
                                     int64_t Vp, bool train, float dloss);

// Vocab-parallel softmax cross-entropy in three passes around two reductions over the ranks that
// hold the other columns (see kernels/backend.h): rowmax, then [sum of exp | target logit] per
// row, then losses (and with train the logits' gradient in place).
void vp_ce_rowmax(float* rowmax, const float* lg, int64_t N, int64_t Vl, int64_t valid);
void vp_ce_stats(float* stats, const float* lg, const float* rowmax, const int32_t* targets, int64_t N, int64_t Vl,
                 int64_t valid, int64_t lo);
void vp_ce_finish(float* lg, float* losses, const float* rowmax, const float* stats, const int32_t* targets, int64_t N,
                  int64_t Vl, int64_t valid, int64_t lo, bool train, float dloss);

MT_CPU_NS_END  // namespace mt::kernels::cpu
