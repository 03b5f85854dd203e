// Causal multi-head self-attention with grouped-query support, and rotary position embedding.
//
// Layout: the fused projection output qkv is [B, T, (nh + 2*nkv) * hd] with, per token, the nh
// query heads first, then nkv key heads, then nkv value heads (each head hd contiguous floats).
// Query head h uses key/value head h / (nh / nkv). Scale 1/sqrt(hd).
// Forward saves only the per-row log-sum-exp of the scaled scores (lse [B, nh, T]); backward
// recomputes the probabilities from q, k and lse (flash-attention style) so no T x T buffer is kept.
#pragma once
#include "kernels/cpu/isa.h"
#include <cstdint>

#include "runtime/dtype.h"

MT_CPU_NS_BEGIN

// out [B, T, nh*hd] (overwritten), lse [B, nh, T] (overwritten).
// Document masking: with doc_start ([B*T], doc_start[b*T + t] in [0, t]) query t of row b sees only
// the keys doc_start[b*T + t] .. t of its row (a direct per-query loop, not the blocked kernel);
// null is plain causal attention (the blocked kernel, results unchanged).
void attention_forward(float* out, float* lse, const float* qkv, int64_t B, int64_t T, int64_t nh,
                       int64_t nkv, int64_t hd, const int32_t* doc_start = nullptr);
// dqkv (same layout as qkv) accumulates (+=) the gradient w.r.t. qkv.
void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out,
                        const float* lse, int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd,
                        const int32_t* doc_start = nullptr);
// bf16 q, k, v (the layout above): the same attention on their values, out rounded to bf16 (nearest
// even), fp32 lse. Backward reads that bf16 out, rounds dout to bf16 first (nearest even) and
// accumulates into the fp32 dqkv. doc_start as above (the CUDA flash kernels also need it
// non-decreasing along each row, as document starts are).
void attention_forward_bf16(bf16* out, float* lse, const bf16* qkv, int64_t B, int64_t T, int64_t nh,
                            int64_t nkv, int64_t hd, const int32_t* doc_start = nullptr);
void attention_backward_bf16(float* dqkv, const float* dout, const bf16* qkv, const bf16* out,
                             const float* lse, int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd,
                             const int32_t* doc_start = nullptr);

// Rotary embedding applied in place to the q and k heads inside a fused qkv buffer (layout above),
// Hugging Face Llama convention (rotate_half: dimension i pairs with i + hd/2),
// angle = pos * theta^(-2i/hd), pos = t. rope_backward applies the inverse rotation in place to
// the matching gradient (the gradient of a rotation is the opposite rotation).
void rope_forward(float* qkv, int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd, float theta);
void rope_backward(float* dqkv, int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd, float theta);
// The same with explicit inverse frequencies inv_freq[hd / 2] (angle = pos * inv_freq[i]), e.g.
// Llama 3.1's scaled ones (ModelConfig::rope_inv_freq).
void rope_forward(float* qkv, int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd, const float* inv_freq);
void rope_backward(float* dqkv, int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd, const float* inv_freq);

MT_CPU_NS_END  // namespace mt::kernels::cpu
