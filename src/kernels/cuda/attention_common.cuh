// Pieces shared by the warp-per-row attention kernels: causal attention (attention.cu) and context
// parallelism's block attention (block_attention.cu). A warp holds one row of head_dim <= 256
// floats, kMaxPerLane per lane (lane + 32 k); blocks hold kWarpsPerBlock warps.
#pragma once
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "kernels/cuda/common.cuh"

namespace mt::kernels::cuda::attn {

constexpr int kMaxPerLane = 8;  // head_dim <= 32 * 8
constexpr int kWarpsPerBlock = 4;

// Batch, tokens, query heads, kv heads, head_dim, floats per qkv row, 1/sqrt(head_dim).
struct Geo {
  int64_t B, T, nh, nkv, hd, ld;
  float scale;
};

// a . b over hd floats, every lane of the warp gets it.
__device__ __forceinline__ float warp_dot(const float* a, const float* b, int64_t hd, int lane) {
  float s = 0.0f;
#pragma unroll
  for (int k = 0; k < kMaxPerLane; ++k) {
    const int64_t d = lane + 32 * k;
    if (d < hd) s += a[d] * b[d];
  }
  return warp_sum(s);
}

// A row of head_dim floats held by a warp: element lane + 32 d in v[d].
struct Row {
  float v[kMaxPerLane];
};
__device__ __forceinline__ Row zero_row() {
  Row r;
#pragma unroll
  for (int d = 0; d < kMaxPerLane; ++d) r.v[d] = 0.0f;
  return r;
}
// r = r * keep + p * x (x: hd floats in memory).
__device__ __forceinline__ void scale_add(Row& r, float keep, float p, const float* x, int64_t hd, int lane) {
#pragma unroll
  for (int d = 0; d < kMaxPerLane; ++d)
    if (lane + 32 * d < hd) r.v[d] = r.v[d] * keep + p * x[lane + 32 * d];
}
// r += p * x.
__device__ __forceinline__ void add_scaled(Row& r, float p, const float* x, int64_t hd, int lane) {
#pragma unroll
  for (int d = 0; d < kMaxPerLane; ++d)
    if (lane + 32 * d < hd) r.v[d] += p * x[lane + 32 * d];
}
// y = r * s (y: hd floats in memory).
__device__ __forceinline__ void store(float* y, const Row& r, float s, int64_t hd, int lane) {
#pragma unroll
  for (int d = 0; d < kMaxPerLane; ++d)
    if (lane + 32 * d < hd) y[lane + 32 * d] = r.v[d] * s;
}
// y += r * s.
__device__ __forceinline__ void store_add(float* y, const Row& r, float s, int64_t hd, int lane) {
#pragma unroll
  for (int d = 0; d < kMaxPerLane; ++d)
    if (lane + 32 * d < hd) y[lane + 32 * d] += r.v[d] * s;
}

// The online softmax of one query row over keys given one at a time: running max m, sum l of
// exp(score - m), and acc = sum exp(score - m) v.
struct Online {
  Row acc = zero_row();
  float m = -INFINITY, l = 0.0f;
  __device__ __forceinline__ void add(float score, const float* v, int64_t hd, int lane) {
    const float mn = fmaxf(m, score);
    const float corr = expf(m - mn);  // 0 on the first key (m = -inf)
    const float p = expf(score - mn);
    l = l * corr + p;
    scale_add(acc, corr, p, v, hd, lane);
    m = mn;
  }
};

// The warp's row of a one-warp-per-row launch (rows past n: the whole warp returns).
__device__ __forceinline__ int64_t warp_row() {
  return blockIdx.x * static_cast<int64_t>(kWarpsPerBlock) + (threadIdx.x >> 5);
}

// Checks the heads (std::invalid_argument naming fn) and the head_dim limit.
inline Geo geo(int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd, const char* fn) {
  if (nh <= 0 || nkv <= 0 || nh % nkv != 0)
    throw std::invalid_argument(std::string("meshtrain: ") + fn + ": n_head (" + std::to_string(nh) +
                                ") must be a positive multiple of n_kv_head (" + std::to_string(nkv) + ")");
  if (hd > 32 * kMaxPerLane)
    throw std::invalid_argument(std::string("meshtrain: ") + fn + ": head_dim " + std::to_string(hd) +
                                " > 256 is not implemented on CUDA yet");
  return Geo{B, T, nh, nkv, hd, (nh + 2 * nkv) * hd, static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd)))};
}

// Queues Dd[b, h, t] = dout_row . out_row for every query row (0 where lse is -inf: a row that saw
// no key), on the compute stream (attention.cu).
void launch_delta(float* Dd, const float* dout, const float* out, const float* lse, const Geo& g, const char* fn);

// Blocks for one warp per row.
inline unsigned warp_blocks(int64_t rows) {
  return static_cast<unsigned>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock);
}

}  // namespace mt::kernels::cuda::attn
