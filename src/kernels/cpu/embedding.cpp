// Token and position embeddings. The token-embedding backward is parallel over blocks of
// channels: every thread walks all N tokens in order for its own channels, so each dtable element
// receives its updates in token order whatever the thread count (deterministic, no atomics).
#include "kernels/cpu/embedding.h"

#include <algorithm>
#include <cstring>

#include "kernels/cpu/activation.h"
#include "kernels/cpu/workspace.h"

MT_CPU_VARIANT_BEGIN

void embedding_forward(float* out, const int32_t* ids, const float* table, int64_t N, int64_t C) {
#pragma omp parallel for schedule(static) if (N * C > detail::kParallelMin)
  for (int64_t n = 0; n < N; ++n) {
    std::memcpy(out + n * C, table + static_cast<int64_t>(ids[n]) * C,
                static_cast<size_t>(C) * sizeof(float));
  }
}

void embedding_backward(float* dtable, const float* dout, const int32_t* ids, int64_t N, int64_t C) {
  constexpr int64_t kCb = 32;  // channels per block (two cache lines)
  const int64_t nblk = (C + kCb - 1) / kCb;
#pragma omp parallel for schedule(static) if (N * C > detail::kParallelMin)
  for (int64_t blk = 0; blk < nblk; ++blk) {
    const int64_t c0 = blk * kCb;
    const int64_t cl = std::min(kCb, C - c0);
    for (int64_t n = 0; n < N; ++n) {
      float* dst = dtable + static_cast<int64_t>(ids[n]) * C + c0;
      const float* src = dout + n * C + c0;
#pragma omp simd
      for (int64_t c = 0; c < cl; ++c) dst[c] += src[c];
    }
  }
}

void position_add_forward(float* x, const float* pos, int64_t B, int64_t T, int64_t C) {
#pragma omp parallel for collapse(2) schedule(static) if (B * T * C > detail::kParallelMin)
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < T; ++t) {
      float* xr = x + (b * T + t) * C;
      const float* pr = pos + t * C;
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) xr[c] += pr[c];
    }
  }
}

void position_add_backward(float* dpos, const float* dout, int64_t B, int64_t T, int64_t C) {
#pragma omp parallel for schedule(static) if (B * T * C > detail::kParallelMin)
  for (int64_t t = 0; t < T; ++t) {
    float* dp = dpos + t * C;
    for (int64_t b = 0; b < B; ++b) {
      const float* src = dout + (b * T + t) * C;
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) dp[c] += src[c];
    }
  }
}

void vocab_embedding_forward(float* out, const int32_t* ids, const void* table, DType dt, int64_t lo, int64_t rows,
                             int64_t N, int64_t C) {
  for (int64_t i = 0; i < N; ++i) {
    const int64_t row = ids[i] - lo;
    float* o = out + i * C;
    if (row < 0 || row >= rows)
      std::memset(o, 0, static_cast<size_t>(C) * sizeof(float));
    else if (dt == DType::BF16)
      cast_bf16_to_f32(o, static_cast<const bf16*>(table) + row * C, C);
    else
      std::memcpy(o, static_cast<const float*>(table) + row * C, static_cast<size_t>(C) * sizeof(float));
  }
}

void vocab_embedding_backward(float* dtable, const float* dout, const int32_t* ids, int64_t lo, int64_t rows,
                              int64_t N, int64_t C) {
  for (int64_t i = 0; i < N; ++i) {
    const int64_t row = ids[i] - lo;
    if (row >= 0 && row < rows) accumulate(dtable + row * C, dout + i * C, C);
  }
}

void position_add_rows(float* x, const float* pos, int64_t R, int64_t T, int64_t row0, int64_t C) {
  for (int64_t i = 0; i < R; ++i) accumulate(x + i * C, pos + ((row0 + i) % T) * C, C);
}

MT_CPU_VARIANT_END  // namespace mt::kernels::cpu
