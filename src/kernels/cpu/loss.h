// Fused softmax + cross-entropy over a (possibly padded) vocabulary.
#pragma once
#include <cstdint>

namespace mt::kernels::cpu {

// logits [N, Vp], of which the first V columns are real vocabulary (Vp >= V is padding).
// losses[n] = -log softmax(logits[n, :V])[targets[n]]; rows with targets[n] < 0 are ignored
// (loss 0, gradient 0). Then logits is OVERWRITTEN with the gradient of
// dloss * sum_n losses[n] w.r.t. the logits: (softmax - onehot) * dloss, zero in padded columns.
void softmax_cross_entropy(float* logits, float* losses, const int32_t* targets, int64_t N, int64_t V,
                           int64_t Vp, float dloss);
// Forward only (losses), logits untouched: for eval.
void softmax_cross_entropy_forward(const float* logits, float* losses, const int32_t* targets,
                                   int64_t N, int64_t V, int64_t Vp);

}  // namespace mt::kernels::cpu
