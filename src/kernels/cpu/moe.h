// Mixture-of-experts kernels: the router (scores, top-k, normalised weights and their backward),
// the row gathers that sort tokens by expert, and the weighted combine of the experts' outputs.
// Every function is deterministic: reductions run in a fixed order whatever the thread count.
#pragma once
#include <cstdint>

namespace mt::kernels::cpu {

// Router forward for N tokens over E experts, k of them per token.
// scores [N, E]: softmax(logits) (sigmoid = 0, Mixtral) or sigmoid(logits) (sigmoid = 1, DeepSeek-V3).
// idx [N, k]: the k highest scores in descending order (ties: the lower expert index first).
// w [N, k]: the chosen scores normalised to sum 1 per token. lse [N]: logsumexp of the logits (z-loss).
void moe_router_forward(float* scores, int32_t* idx, float* w, float* lse, const float* logits, int64_t N, int64_t E,
                        int64_t k, int sigmoid);
// Router backward: dlogits [N, E] (written, not accumulated) from the gradient of the weights dw [N, k],
// of the load-balancing loss with respect to each token's balance probabilities (aux [E]: the same for
// every token; the balance probabilities are the softmax for sigmoid = 0, the scores normalised over
// all experts for sigmoid = 1), and of the z-loss (z_scale: d loss / d (lse^2) per token).
void moe_router_backward(float* dlogits, const float* dw, const float* scores, const int32_t* idx, const float* w,
                         const float* lse, const float* logits, const float* aux, float z_scale, int64_t N, int64_t E,
                         int64_t k, int sigmoid);
// The mean over tokens of the balance probabilities (see above) per expert: P [E].
void moe_balance_probs(float* P, const float* scores, int64_t N, int64_t E, int sigmoid);
// out row i = in row rows[i] (rows of row_bytes bytes; any element type); a negative rows[i] writes
// a zero row (padding).
void moe_gather_rows(void* out, const void* in, const int32_t* rows, int64_t n, int64_t row_bytes);
// out[t] += sum_j w[t, j] * y[pos[t, j]] over j < k with pos >= 0 (w null: weight 1), j in order.
void moe_combine(float* out, const float* y, const int32_t* pos, const float* w, int64_t N, int64_t k, int64_t C);
// The combine's backward: dy[pos[t, j]] = w[t, j] * dout[t] (written), dw[t, j] = <dout[t], y[pos[t, j]]>
// (written; 0 for a dropped pos < 0).
void moe_combine_backward(float* dy, float* dw, const float* dout, const float* y, const int32_t* pos, const float* w,
                          int64_t N, int64_t k, int64_t C);

}  // namespace mt::kernels::cpu
