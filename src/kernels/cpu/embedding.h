// Token and learned-position embeddings.
#pragma once
#include "kernels/cpu/isa.h"
#include <cstdint>

#include "runtime/dtype.h"

MT_CPU_NS_BEGIN

// out[n, :] = table[ids[n], :] for n < N (overwrites out).
void embedding_forward(float* out, const int32_t* ids, const float* table, int64_t N, int64_t C);
// dtable[ids[n], :] += dout[n, :]; deterministic (same result whatever the thread count).
void embedding_backward(float* dtable, const float* dout, const int32_t* ids, int64_t N, int64_t C);

// x[b, t, :] += pos[t, :] for x [B, T, C].
void position_add_forward(float* x, const float* pos, int64_t B, int64_t T, int64_t C);
// dpos[t, :] += sum_b dout[b, t, :].
void position_add_backward(float* dpos, const float* dout, int64_t B, int64_t T, int64_t C);

// Vocab-parallel lookup of a rank's table rows [lo, lo + rows) (`table` f32 or bf16): out[n, :] =
// table[ids[n] - lo, :] widened to fp32 when this rank holds that row, else 0 (overwrites out).
void vocab_embedding_forward(float* out, const int32_t* ids, const void* table, DType dt, int64_t lo, int64_t rows,
                             int64_t N, int64_t C);
// dtable[ids[n] - lo, :] += dout[n, :] for the ids this rank holds, in token order.
void vocab_embedding_backward(float* dtable, const float* dout, const int32_t* ids, int64_t lo, int64_t rows,
                              int64_t N, int64_t C);
// x[i, :] += pos[(row0 + i) % T, :] for i < R (a rank's rows of the flattened [B, T] tokens).
void position_add_rows(float* x, const float* pos, int64_t R, int64_t T, int64_t row0, int64_t C);

MT_CPU_NS_END  // namespace mt::kernels::cpu
