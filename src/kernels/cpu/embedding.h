// Token and learned-position embeddings.
#pragma once
#include <cstdint>

namespace mt::kernels::cpu {

// out[n, :] = table[ids[n], :] for n < N (overwrites out).
void embedding_forward(float* out, const int32_t* ids, const float* table, int64_t N, int64_t C);
// dtable[ids[n], :] += dout[n, :]; deterministic (same result whatever the thread count).
void embedding_backward(float* dtable, const float* dout, const int32_t* ids, int64_t N, int64_t C);

// x[b, t, :] += pos[t, :] for x [B, T, C].
void position_add_forward(float* x, const float* pos, int64_t B, int64_t T, int64_t C);
// dpos[t, :] += sum_b dout[b, t, :].
void position_add_backward(float* dpos, const float* dout, int64_t B, int64_t T, int64_t C);

}  // namespace mt::kernels::cpu
