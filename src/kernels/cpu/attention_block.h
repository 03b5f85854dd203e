// Context parallelism's attention pieces (docs/context_parallel.md): attention of a rank's queries
// against one block of keys and values held apart from them (another rank's), merged into a running
// result with the flash-attention log-sum-exp rule, its backward, and the position-indexed rotary
// and learned position embeddings of a rank's tokens.
//
// Layouts. qkv [B, T, (nh + 2*nkv)*hd] as in attention.h (queries first); kv [B, T, 2*nkv*hd]: the
// key heads then the value heads of T tokens (qkv's last 2*nkv*hd columns). Both hold `chunks`
// equal chunks of T / chunks tokens per sequence. modes[a * chunks + b] says how query chunk a sees
// key chunk b: 0 not at all (entirely masked: skipped, no work), 1 every key, 2 causally (the two
// chunks cover the same positions: query i sees keys 0..i of the chunk). Scale 1/sqrt(hd).
//
// Document masking (doc_start non-null): doc_start [B*T] (device memory) holds, for each query row,
// the global position of the first key it may see (its document's start), and key_start [chunks]
// (host memory) the global position of each key chunk's first token: query row i sees key j of
// chunk b (allowed by the modes) only when key_start[b] + j >= doc_start[i]. Keys before every
// row's start are skipped (no work); a row that sees no key of the block is left as an entirely
// masked row is. Null doc_start: plain modes (key_start unused).
#pragma once
#include "kernels/cpu/isa.h"
#include <cstdint>

MT_CPU_NS_BEGIN

// out [B, T, nh*hd] and lse [B, nh, T] hold the attention over the key blocks seen so far (`first`:
// none; they are overwritten, rows that see no key of this block get out 0 and lse -inf). The
// block's partial result is merged in: lse' = log(e^lse + e^lse_blk), out' = out e^(lse - lse') +
// out_blk e^(lse_blk - lse'). No T x T buffer: one row of scores per thread.
void attention_block_forward(float* out, float* lse, const float* qkv, const float* kv, int64_t B, int64_t T,
                             int64_t nh, int64_t nkv, int64_t hd, int64_t chunks, const int8_t* modes, bool first,
                             const int32_t* doc_start, const int32_t* key_start);
// With the final out and lse of every block (the probabilities of this block are exp(s - lse)):
// accumulates (+=) the queries' gradient into dqkv's query columns and this block's key and value
// gradients into dkv (layout of kv). Deterministic (one task per sequence and kv head).
void attention_block_backward(float* dqkv, float* dkv, const float* dout, const float* qkv, const float* kv,
                              const float* out, const float* lse, int64_t B, int64_t T, int64_t nh, int64_t nkv,
                              int64_t hd, int64_t chunks, const int8_t* modes, const int32_t* doc_start,
                              const int32_t* key_start);

// Rotary embedding (as rope_forward in attention.h) at explicit positions: token t of every
// sequence sits at position pos[t] (host memory, T entries). inv_freq (hd/2, host) or null for
// theta^(-2i/hd). Backward applies the inverse rotation to the gradient.
void rope_forward_pos(float* qkv, int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd, float theta,
                      const float* inv_freq, const int32_t* pos);
void rope_backward_pos(float* dqkv, int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd, float theta,
                       const float* inv_freq, const int32_t* pos);
// Learned positions at explicit positions: x[i, :] += table[pos[(row0 + i) % T], :] for i < R (R rows
// of the flattened [B, T] tokens starting at row0), and the gradient dtable[pos[t], :] += sum over b
// (in order) of dout[b * T + t, :].
void position_add_pos(float* x, const float* table, const int32_t* pos, int64_t R, int64_t T, int64_t row0,
                      int64_t C);
void position_backward_pos(float* dtable, const float* dout, const int32_t* pos, int64_t B, int64_t T, int64_t C);
// out[n, c0 + j] += in[n, j] for a [N, ld] `out` and a dense [N, cols] `in`.
void add_columns(float* out, const float* in, int64_t N, int64_t ld, int64_t c0, int64_t cols);

MT_CPU_NS_END  // namespace mt::kernels::cpu
