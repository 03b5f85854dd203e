// Causal attention with grouped-query heads on tensor cores, FlashAttention-2 style (contracts:
// kernels/cpu/attention.h, attention_forward_bf16 / attention_backward_bf16). bf16 q, k, v and
// fp32 accumulation through mma.sync m16n8k16 (kernels/cuda/mma.cuh); no T x T matrix in memory.
//
// Geometry: head_dim hd is padded with zeros to D = 16 * KD (KD = 1..8, so hd <= 128; the kernels
// are instantiated per KD). A block is 4 warps.
// - Forward: a block owns 64 query rows of one (b, head), 16 per warp, and walks the key tiles of
//   64 up to its last row. Q stays in registers as A fragments; K and V tiles go through shared
//   memory. S = Q K^T, the online softmax (running row max m and sum l, the output rescaled by
//   exp(m_old - m_new) whenever the max grows), then P (rounded to bf16, straight from the S
//   accumulators: mma.cuh) times V. Writes the output rounded to bf16 and lse = m + log l per row.
// - Backward, deterministic without atomics, in three launches:
//   1. Dd = rowsum(dout * out) per query row in fp32 from the bf16 out (dout rounded to bf16
//      first, once, into scratch);
//   2. dQ: a block per 64 query rows (16 per warp) walks the key tiles of 32 in order:
//      P = exp(S - lse), dS = P (dO V^T - Dd), dQ += dS K;
//   3. dK, dV: a block per 64 keys of one kv head (16 per warp) walks the query heads of its group
//      and, in each, the query tiles of 32 from its first key on, in order:
//      dV += P^T dO, dK += dS^T Q. Every gradient element has one owner that adds it once.
// Masks: a key s is visible to a query t when s <= t (and both < T), and with document masking
// (doc_start, device [B, T]) when doc_start[b, t] <= s. The starts never decrease along a row, so a
// block's first row has its earliest start: the forward and dQ key loops begin at the tile holding
// it, dQ's warps skip the key tiles before their first row's start (the forward has no registers
// to spare for that at head dim 112), and the dK/dV query loop stops at
// the first query tile whose start lies past the block's last key (fully masked tiles: no work).
//
// head_dim above 128 goes to the simple fp32 kernels (attention.cu) on the bf16 values (their fp32
// output rounded to bf16 after them; the backward widens the bf16 out for them).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

#include "kernels/cuda/attention_common.cuh"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels.h"
#include "kernels/cuda/mma.cuh"

namespace mt::kernels::cuda {

namespace {

using mma::FragA;
using mma::FragB;
using mma::FragC;

constexpr int kThreads = 128;   // 4 warps
constexpr int kRowsPerBlock = 64;  // forward and dQ: query rows per block; dK/dV: keys per block
constexpr int kFwdKeys = 64;    // forward key tile
constexpr int kDqKeys = 32;     // dQ key tile
constexpr int kDkvQueries = 32; // dK/dV query tile

struct FlashArgs {
  const uint16_t* qkv;  // bf16 bits, [B, T, (nh + 2 nkv) hd]
  int64_t B, T, nh, nkv, hd, ld;
  float scale;
  bool vec;  // 16-byte loads: hd == D, hd % 8 == 0, qkv 16-byte aligned
  const int32_t* ds;  // document starts [B, T] (device), null: causal only
};

// Row t of sequence b's document start (0 without document masking or past T).
__device__ __forceinline__ int doc_start(const FlashArgs& f, int64_t b, int64_t t) {
  return f.ds && t < f.T ? f.ds[b * f.T + t] : 0;
}

struct alignas(16) Vec16 {
  uint32_t x[4];
};

__device__ __forceinline__ uint32_t ld_pair(const uint16_t* p) {
#ifdef MT_CUDA_EMU
  uint32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
#else
  return *reinterpret_cast<const uint32_t*>(p);
#endif
}
__device__ __forceinline__ void copy16(uint16_t* dst, const uint16_t* src) {
#ifdef MT_CUDA_EMU
  std::memcpy(dst, src, 16);
#else
  *reinterpret_cast<Vec16*>(dst) = *reinterpret_cast<const Vec16*>(src);
#endif
}

// Rows [0, R) of a head (src: its row 0, rows ld apart) into a shared tile [R][D + 8], zeros for
// rows >= valid and columns >= hd. The whole block calls it.
template <int D>
__device__ __forceinline__ void load_tile(uint16_t* sm, const uint16_t* src, int64_t ld, int64_t valid, int R,
                                          int64_t hd, bool vec) {
  constexpr int S = D + 8;
  if (vec) {
    constexpr int per_row = D / 8;
    for (int i = threadIdx.x; i < R * per_row; i += kThreads) {
      const int r = i / per_row, c = (i % per_row) * 8;
      if (r < valid) {
        copy16(sm + r * S + c, src + r * ld + c);
      } else {
        for (int e = 0; e < 8; ++e) sm[r * S + c + e] = 0;
      }
    }
  } else {
    for (int i = threadIdx.x; i < R * D; i += kThreads) {
      const int r = i / D, c = i % D;
      sm[r * S + c] = (r < valid && c < hd) ? src[r * ld + c] : static_cast<uint16_t>(0);
    }
  }
}

// Two consecutive elements (row, col), (row, col + 1) of a head in global memory, zero outside
// rows < T and columns < hd.
__device__ __forceinline__ uint32_t gl_pair(const uint16_t* p, int64_t ld, int64_t row, int64_t col, int64_t T,
                                            int64_t hd) {
  if (row >= T) return 0;
  const uint16_t lo = col < hd ? p[row * ld + col] : static_cast<uint16_t>(0);
  const uint16_t hi = col + 1 < hd ? p[row * ld + col + 1] : static_cast<uint16_t>(0);
  return mma::pack_bits(lo, hi);
}

// The A fragments of 16 rows (r0 = base row + g, r1 = r0 + 8) of a head over D columns.
template <int KD>
__device__ __forceinline__ void load_a_rows(FragA (&f)[KD], const uint16_t* p, int64_t ld, int64_t r0, int64_t T,
                                            int64_t hd, int t) {
#pragma unroll
  for (int kk = 0; kk < KD; ++kk) {
    const int64_t c = kk * 16 + 2 * t;
    f[kk].x[0] = gl_pair(p, ld, r0, c, T, hd);
    f[kk].x[1] = gl_pair(p, ld, r0 + 8, c, T, hd);
    f[kk].x[2] = gl_pair(p, ld, r0, c + 8, T, hd);
    f[kk].x[3] = gl_pair(p, ld, r0 + 8, c + 8, T, hd);
  }
}

// B fragment with B[k][n] = tile[n0 + n][k0 + k] (a row-major tile read as its transpose: pairs
// along a row, the usual K of Q K^T).
__device__ __forceinline__ FragB b_rows(const uint16_t* sm, int S, int n0, int k0, int g, int t) {
  const uint16_t* p = sm + (n0 + g) * S + k0 + 2 * t;
  FragB b;
  b.x[0] = ld_pair(p);
  b.x[1] = ld_pair(p + 8);
  return b;
}
// B fragment with B[k][n] = tile[k0 + k][n0 + n] (pairs down a column, the V of P V).
__device__ __forceinline__ FragB b_cols(const uint16_t* sm, int S, int k0, int n0, int g, int t) {
  const uint16_t* p = sm + (k0 + 2 * t) * S + n0 + g;
  FragB b;
  b.x[0] = mma::pack_bits(p[0], p[S]);
  b.x[1] = mma::pack_bits(p[8 * S], p[9 * S]);
  return b;
}
// A fragment of rows r0..r0+15 of a shared tile, columns k0..k0+15.
__device__ __forceinline__ FragA a_rows(const uint16_t* sm, int S, int r0, int k0, int g, int t) {
  const uint16_t* p = sm + (r0 + g) * S + k0 + 2 * t;
  FragA a;
  a.x[0] = ld_pair(p);
  a.x[1] = ld_pair(p + 8 * S);
  a.x[2] = ld_pair(p + 8);
  a.x[3] = ld_pair(p + 8 * S + 8);
  return a;
}

__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// Key s visible to query t (causal, and from the query's document start d on).
__device__ __forceinline__ bool visible(int64_t t, int64_t s, int64_t T, int d) { return s <= t && t < T && s >= d; }

// ---- forward ----
template <int KD>
__global__ void __launch_bounds__(kThreads) flash_fwd_k(uint16_t* out, float* lse, FlashArgs f) {
  constexpr int D = 16 * KD, S = D + 8, NT = 2 * KD;
  MT_SHARED_DYNAMIC(smem, Vec16);
  uint16_t* sk = reinterpret_cast<uint16_t*>(smem);
  uint16_t* sv = sk + kFwdKeys * S;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int64_t b = blockIdx.z, h = blockIdx.y, q0 = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock;
  const int64_t kvh = h / (f.nh / f.nkv), T = f.T, ld = f.ld;
  const uint16_t* base = f.qkv + b * T * ld;
  const uint16_t* kp = base + (f.nh + kvh) * f.hd;
  const uint16_t* vp = base + (f.nh + f.nkv + kvh) * f.hd;
  const int64_t wrow = q0 + 16 * warp, r0 = wrow + g, r1 = r0 + 8;

  FragA qf[KD];
  load_a_rows<KD>(qf, base + h * f.hd, ld, r0, T, f.hd, t);
  FragC o[NT];
#pragma unroll
  for (int n = 0; n < NT; ++n) mma::zero(o[n]);
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;
  const int d0 = doc_start(f, b, r0), d1 = doc_start(f, b, r1);

  const int64_t kend = T < q0 + kRowsPerBlock ? T : q0 + kRowsPerBlock;
  for (int64_t k0 = doc_start(f, b, q0) / kFwdKeys * kFwdKeys; k0 < kend; k0 += kFwdKeys) {
    __syncthreads();  // every warp is done with the previous tile
    load_tile<D>(sk, kp + k0 * ld, ld, T - k0, kFwdKeys, f.hd, f.vec);
    load_tile<D>(sv, vp + k0 * ld, ld, T - k0, kFwdKeys, f.hd, f.vec);
    __syncthreads();
    FragC s[kFwdKeys / 8];
#pragma unroll
    for (int n = 0; n < kFwdKeys / 8; ++n) {
      mma::zero(s[n]);
      if (k0 + n * 8 > wrow + 15) continue;  // every key of the n-tile is after the warp's rows
#pragma unroll
      for (int kk = 0; kk < KD; ++kk) mma::mma(s[n], qf[kk], b_rows(sk, S, n * 8, kk * 16, g, t));
    }
    float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
    for (int n = 0; n < kFwdKeys / 8; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int64_t key = k0 + n * 8 + 2 * t + (i & 1), row = i < 2 ? r0 : r1;
        const float v = visible(row, key, T, i < 2 ? d0 : d1) ? s[n].x[i] * f.scale : -INFINITY;
        s[n].x[i] = v;
        if (i < 2) mx0 = fmaxf(mx0, v);
        else mx1 = fmaxf(mx1, v);
      }
    mx0 = quad_max(mx0);
    mx1 = quad_max(mx1);
    const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
    // A row that has seen no key yet (only rows past T) keeps m = -inf: exponents against 0.
    const float e0 = mn0 == -INFINITY ? 0.0f : mn0, e1 = mn1 == -INFINITY ? 0.0f : mn1;
    const float c0 = expf(m0 - e0), c1 = expf(m1 - e1);  // the rescale of what came before
    l0 *= c0;
    l1 *= c1;
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      o[n].x[0] *= c0;
      o[n].x[1] *= c0;
      o[n].x[2] *= c1;
      o[n].x[3] *= c1;
    }
#pragma unroll
    for (int n = 0; n < kFwdKeys / 8; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float p = expf(s[n].x[i] - (i < 2 ? e0 : e1));
        s[n].x[i] = p;
        if (i < 2) l0 += p;
        else l1 += p;
      }
    m0 = mn0;
    m1 = mn1;
#pragma unroll
    for (int j = 0; j < kFwdKeys / 16; ++j) {
      if (k0 + j * 16 > wrow + 15) continue;
      const FragA pa = mma::a_from_c(s[2 * j], s[2 * j + 1]);
#pragma unroll
      for (int n = 0; n < NT; ++n) mma::mma(o[n], pa, b_cols(sv, S, j * 16, n * 8, g, t));
    }
  }
  l0 = quad_sum(l0);
  l1 = quad_sum(l1);
  const int64_t od = f.nh * f.hd;
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t row = i < 2 ? r0 : r1, col = n * 8 + 2 * t + (i & 1);
      if (row < T && col < f.hd)
        out[(b * T + row) * od + h * f.hd + col] = f32_to_bf16_bits(o[n].x[i] / (i < 2 ? l0 : l1));
    }
  if (t == 0) {
    if (r0 < T) lse[(b * f.nh + h) * T + r0] = m0 + logf(l0);
    if (r1 < T) lse[(b * f.nh + h) * T + r1] = m1 + logf(l1);
  }
}

// ---- backward ----
// Dd[b, h, t] = bf16(dout) . out over the row (both bf16, the sum fp32); one warp per row.
__global__ void flash_delta_k(float* Dd, const uint16_t* dob, const uint16_t* out, FlashArgs f) {
  const int lane = threadIdx.x & 31;
  const int64_t row = attn::warp_row();
  if (row >= f.B * f.nh * f.T) return;
  const int64_t t = row % f.T, h = (row / f.T) % f.nh, b = row / (f.T * f.nh);
  const int64_t off = (b * f.T + t) * (f.nh * f.hd) + h * f.hd;
  float s = 0.0f;
  for (int64_t d = lane; d < f.hd; d += 32) s += bf16_bits_to_f32(dob[off + d]) * bf16_bits_to_f32(out[off + d]);
  s = warp_sum(s);
  if (lane == 0) Dd[row] = s;
}

template <int KD>
__global__ void __launch_bounds__(kThreads)
    flash_dq_k(float* dqkv, const uint16_t* dob, const float* lse, const float* Dd, FlashArgs f) {
  constexpr int D = 16 * KD, S = D + 8, NT = 2 * KD;
  MT_SHARED_DYNAMIC(smem, Vec16);
  uint16_t* sk = reinterpret_cast<uint16_t*>(smem);
  uint16_t* sv = sk + kDqKeys * S;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int64_t b = blockIdx.z, h = blockIdx.y, q0 = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock;
  const int64_t kvh = h / (f.nh / f.nkv), T = f.T, ld = f.ld, od = f.nh * f.hd;
  const uint16_t* base = f.qkv + b * T * ld;
  const uint16_t* kp = base + (f.nh + kvh) * f.hd;
  const uint16_t* vp = base + (f.nh + f.nkv + kvh) * f.hd;
  const int64_t wrow = q0 + 16 * warp, r0 = wrow + g, r1 = r0 + 8;

  FragA qf[KD], df[KD];
  load_a_rows<KD>(qf, base + h * f.hd, ld, r0, T, f.hd, t);
  load_a_rows<KD>(df, dob + b * T * od + h * f.hd, od, r0, T, f.hd, t);
  const float L0 = r0 < T ? lse[(b * f.nh + h) * T + r0] : 0.0f, L1 = r1 < T ? lse[(b * f.nh + h) * T + r1] : 0.0f;
  const float D0 = r0 < T ? Dd[(b * f.nh + h) * T + r0] : 0.0f, D1 = r1 < T ? Dd[(b * f.nh + h) * T + r1] : 0.0f;
  FragC dq[NT];
#pragma unroll
  for (int n = 0; n < NT; ++n) mma::zero(dq[n]);
  const int d0 = doc_start(f, b, r0), d1 = doc_start(f, b, r1), dw = doc_start(f, b, wrow);

  const int64_t kend = T < q0 + kRowsPerBlock ? T : q0 + kRowsPerBlock;
  for (int64_t k0 = doc_start(f, b, q0) / kDqKeys * kDqKeys; k0 < kend; k0 += kDqKeys) {
    __syncthreads();
    load_tile<D>(sk, kp + k0 * ld, ld, T - k0, kDqKeys, f.hd, f.vec);
    load_tile<D>(sv, vp + k0 * ld, ld, T - k0, kDqKeys, f.hd, f.vec);
    __syncthreads();
    FragC s[kDqKeys / 8], dp[kDqKeys / 8];
#pragma unroll
    for (int n = 0; n < kDqKeys / 8; ++n) {
      mma::zero(s[n]);
      mma::zero(dp[n]);
      if (k0 + n * 8 > wrow + 15 || k0 + n * 8 + 7 < dw) continue;
#pragma unroll
      for (int kk = 0; kk < KD; ++kk) {
        mma::mma(s[n], qf[kk], b_rows(sk, S, n * 8, kk * 16, g, t));
        mma::mma(dp[n], df[kk], b_rows(sv, S, n * 8, kk * 16, g, t));
      }
    }
#pragma unroll
    for (int n = 0; n < kDqKeys / 8; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int64_t key = k0 + n * 8 + 2 * t + (i & 1), row = i < 2 ? r0 : r1;
        const float p = visible(row, key, T, i < 2 ? d0 : d1) ? expf(s[n].x[i] * f.scale - (i < 2 ? L0 : L1)) : 0.0f;
        s[n].x[i] = p * (dp[n].x[i] - (i < 2 ? D0 : D1));  // dS
      }
#pragma unroll
    for (int j = 0; j < kDqKeys / 16; ++j) {
      if (k0 + j * 16 > wrow + 15 || k0 + j * 16 + 15 < dw) continue;
      const FragA da = mma::a_from_c(s[2 * j], s[2 * j + 1]);
#pragma unroll
      for (int n = 0; n < NT; ++n) mma::mma(dq[n], da, b_cols(sk, S, j * 16, n * 8, g, t));
    }
  }
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t row = i < 2 ? r0 : r1, col = n * 8 + 2 * t + (i & 1);
      if (row < T && col < f.hd) dqkv[(b * T + row) * ld + h * f.hd + col] += dq[n].x[i] * f.scale;
    }
}

template <int KD>
// (kThreads, 1): lets ptxas use up to 255 registers; its own choice for head dim 64 on sm_80 spilled.
__global__ void __launch_bounds__(kThreads, 1)
    flash_dkv_k(float* dqkv, const uint16_t* dob, const float* lse, const float* Dd, FlashArgs f) {
  constexpr int D = 16 * KD, S = D + 8, NT = 2 * KD, QN = kDkvQueries / 8;
  MT_SHARED_DYNAMIC(smem, Vec16);
  uint16_t* sk = reinterpret_cast<uint16_t*>(smem);
  uint16_t* sv = sk + kRowsPerBlock * S;
  uint16_t* sq = sv + kRowsPerBlock * S;
  uint16_t* sd = sq + kDkvQueries * S;
  float* sL = reinterpret_cast<float*>(sd + kDkvQueries * S);
  float* sD = sL + kDkvQueries;
  int32_t* sS = reinterpret_cast<int32_t*>(sD + kDkvQueries);  // the query tile's document starts
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int64_t b = blockIdx.z, kvh = blockIdx.y, k0 = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock;
  const int64_t T = f.T, ld = f.ld, od = f.nh * f.hd, group = f.nh / f.nkv;
  const uint16_t* base = f.qkv + b * T * ld;
  const int64_t wkey = k0 + 16 * warp, c0 = wkey + g, c1 = c0 + 8;  // this lane's two keys

  load_tile<D>(sk, base + (f.nh + kvh) * f.hd + k0 * ld, ld, T - k0, kRowsPerBlock, f.hd, f.vec);
  load_tile<D>(sv, base + (f.nh + f.nkv + kvh) * f.hd + k0 * ld, ld, T - k0, kRowsPerBlock, f.hd, f.vec);
  FragC dk[NT], dv[NT];
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    mma::zero(dk[n]);
    mma::zero(dv[n]);
  }
  for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h) {
    const uint16_t* qp = base + h * f.hd;
    const uint16_t* dp_src = dob + b * T * od + h * f.hd;
    const float* Lr = lse + (b * f.nh + h) * T;
    const float* Dr = Dd + (b * f.nh + h) * T;
    for (int64_t q0 = k0; q0 < T; q0 += kDkvQueries) {
      // Document masking: this query tile and every later one start after the block's last key.
      if (doc_start(f, b, q0) >= k0 + kRowsPerBlock) break;
      __syncthreads();  // the K / V tiles are loaded; the previous query tile is done
      load_tile<D>(sq, qp + q0 * ld, ld, T - q0, kDkvQueries, f.hd, f.vec && od % 8 == 0);
      load_tile<D>(sd, dp_src + q0 * od, od, T - q0, kDkvQueries, f.hd, f.vec && od % 8 == 0);
      if (threadIdx.x < kDkvQueries) {
        const int64_t q = q0 + threadIdx.x;
        sL[threadIdx.x] = q < T ? Lr[q] : 0.0f;
        sD[threadIdx.x] = q < T ? Dr[q] : 0.0f;
        sS[threadIdx.x] = static_cast<int32_t>(doc_start(f, b, q));
      }
      __syncthreads();
      // S^T = K Q^T and dP^T = V dO^T: this warp's 16 keys by the tile's 32 queries.
      FragC s[QN], dp[QN];
#pragma unroll
      for (int n = 0; n < QN; ++n) {
        mma::zero(s[n]);
        mma::zero(dp[n]);
      }
#pragma unroll
      for (int kk = 0; kk < KD; ++kk) {
        const FragA ka = a_rows(sk, S, 16 * warp, kk * 16, g, t);
        const FragA va = a_rows(sv, S, 16 * warp, kk * 16, g, t);
#pragma unroll
        for (int n = 0; n < QN; ++n) {
          if (q0 + n * 8 + 7 < wkey) continue;  // every query of the n-tile is before the warp's keys
          mma::mma(s[n], ka, b_rows(sq, S, n * 8, kk * 16, g, t));
          mma::mma(dp[n], va, b_rows(sd, S, n * 8, kk * 16, g, t));
        }
      }
#pragma unroll
      for (int n = 0; n < QN; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int qi = n * 8 + 2 * t + (i & 1);
          const int64_t query = q0 + qi, key = i < 2 ? c0 : c1;
          const float p = visible(query, key, T, sS[qi]) ? expf(s[n].x[i] * f.scale - sL[qi]) : 0.0f;
          s[n].x[i] = p;
          dp[n].x[i] = p * (dp[n].x[i] - sD[qi]);  // dS^T
        }
#pragma unroll
      for (int j = 0; j < QN / 2; ++j) {
        if (q0 + j * 16 + 15 < wkey) continue;
        const FragA pa = mma::a_from_c(s[2 * j], s[2 * j + 1]);
        const FragA da = mma::a_from_c(dp[2 * j], dp[2 * j + 1]);
#pragma unroll
        for (int n = 0; n < NT; ++n) {
          mma::mma(dv[n], pa, b_cols(sd, S, j * 16, n * 8, g, t));
          mma::mma(dk[n], da, b_cols(sq, S, j * 16, n * 8, g, t));
        }
      }
    }
  }
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t key = i < 2 ? c0 : c1, col = n * 8 + 2 * t + (i & 1);
      if (key < T && col < f.hd) {
        float* row = dqkv + (b * T + key) * ld;
        row[(f.nh + kvh) * f.hd + col] += dk[n].x[i] * f.scale;
        row[(f.nh + f.nkv + kvh) * f.hd + col] += dv[n].x[i];
      }
    }
}

// ---- host side ----
constexpr size_t fwd_smem(int D) { return static_cast<size_t>(2 * kFwdKeys * (D + 8)) * 2; }
constexpr size_t dq_smem(int D) { return static_cast<size_t>(2 * kDqKeys * (D + 8)) * 2; }
constexpr size_t dkv_smem(int D) {
  return static_cast<size_t>(2 * (kRowsPerBlock + kDkvQueries) * (D + 8)) * 2 + 3 * kDkvQueries * sizeof(float);
}

template <class K>
void allow_smem(K kernel, size_t bytes, const char* fn) {
  if (bytes > 48 * 1024)
    mt::cuda::check(static_cast<int>(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                          static_cast<int>(bytes))),
                    fn);
}

FlashArgs flash_args(const bf16* qkv, const attn::Geo& g, const int32_t* doc_start) {
  const int64_t D = (g.hd + 15) / 16 * 16;
  const bool vec = g.hd == D && g.hd % 8 == 0 && reinterpret_cast<uintptr_t>(qkv) % 16 == 0;
  return FlashArgs{reinterpret_cast<const uint16_t*>(qkv), g.B, g.T, g.nh, g.nkv, g.hd, g.ld, g.scale, vec, doc_start};
}

dim3 flash_grid(int64_t T, int64_t heads, int64_t B) {
  return dim3(static_cast<unsigned>((T + kRowsPerBlock - 1) / kRowsPerBlock), static_cast<unsigned>(heads),
              static_cast<unsigned>(B));
}

template <int KD>
void fwd(uint16_t* out, float* lse, const FlashArgs& f) {
  const size_t sm = fwd_smem(16 * KD);
  allow_smem(flash_fwd_k<KD>, sm, "attention_forward_bf16");
  MT_LAUNCH(flash_fwd_k<KD>, flash_grid(f.T, f.nh, f.B), kThreads, sm, stream())(out, lse, f);
  check_launch("attention_forward_bf16");
}

template <int KD>
void bwd(float* dqkv, const uint16_t* dob, const float* lse, const float* Dd, const FlashArgs& f) {
  const size_t sq = dq_smem(16 * KD), skv = dkv_smem(16 * KD);
  allow_smem(flash_dq_k<KD>, sq, "attention_backward_bf16");
  allow_smem(flash_dkv_k<KD>, skv, "attention_backward_bf16");
  MT_LAUNCH(flash_dq_k<KD>, flash_grid(f.T, f.nh, f.B), kThreads, sq, stream())(dqkv, dob, lse, Dd, f);
  check_launch("attention_backward_bf16 (dq)");
  MT_LAUNCH(flash_dkv_k<KD>, flash_grid(f.T, f.nkv, f.B), kThreads, skv, stream())(dqkv, dob, lse, Dd, f);
  check_launch("attention_backward_bf16 (dk, dv)");
}

// The padded head dim's 16-column steps (1..8), 0 when the tensor-core kernel does not take hd.
int flash_kd(int64_t hd) { return hd >= 1 && hd <= kFlashMaxHeadDim ? static_cast<int>((hd + 15) / 16) : 0; }

}  // namespace

void attention_forward_bf16(bf16* out, float* lse, const bf16* qkv, int64_t B, int64_t T, int64_t nh, int64_t nkv,
                            int64_t hd, const int32_t* doc_start) {
  const attn::Geo g = attn::geo(B, T, nh, nkv, hd, "attention_forward_bf16");
  if (B <= 0 || T <= 0 || hd <= 0) return;
  const int kd = flash_kd(hd);
  if (kd == 0) {  // the simple fp32 kernel on the same bf16 values, its output rounded after it
    const int64_t n = B * T * g.ld, no = B * T * nh * hd;
    float* q32 = static_cast<float*>(scratch(kScratchFlashQkv, static_cast<size_t>(n + no) * sizeof(float)));
    cast_bf16_to_f32(q32, qkv, n);
    attention_forward(q32 + n, lse, q32, B, T, nh, nkv, hd, doc_start);
    cast_f32_to_bf16(out, q32 + n, no);
    return;
  }
  const FlashArgs f = flash_args(qkv, g, doc_start);
  uint16_t* ob = reinterpret_cast<uint16_t*>(out);
  switch (kd) {
    case 1: fwd<1>(ob, lse, f); break;
    case 2: fwd<2>(ob, lse, f); break;
    case 3: fwd<3>(ob, lse, f); break;
    case 4: fwd<4>(ob, lse, f); break;
    case 5: fwd<5>(ob, lse, f); break;
    case 6: fwd<6>(ob, lse, f); break;
    case 7: fwd<7>(ob, lse, f); break;
    default: fwd<8>(ob, lse, f); break;
  }
}

void attention_backward_bf16(float* dqkv, const float* dout, const bf16* qkv, const bf16* out, const float* lse,
                             int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd, const int32_t* doc_start) {
  const attn::Geo g = attn::geo(B, T, nh, nkv, hd, "attention_backward_bf16");
  if (B <= 0 || T <= 0 || hd <= 0) return;
  const int64_t no = B * T * nh * hd;
  bf16* dob = static_cast<bf16*>(scratch(kScratchFlashDout, static_cast<size_t>(no) * sizeof(bf16)));
  cast_f32_to_bf16(dob, dout, no);  // dout rounded to bf16 once, as the contract says
  const int kd = flash_kd(hd);
  if (kd == 0) {
    const int64_t n = B * T * g.ld;
    float* buf = static_cast<float*>(scratch(kScratchFlashQkv, static_cast<size_t>(n + 2 * no) * sizeof(float)));
    cast_bf16_to_f32(buf, qkv, n);
    cast_bf16_to_f32(buf + n, dob, no);
    cast_bf16_to_f32(buf + n + no, out, no);
    attention_backward(dqkv, buf + n, buf, buf + n + no, lse, B, T, nh, nkv, hd, doc_start);
    return;
  }
  const FlashArgs f = flash_args(qkv, g, doc_start);
  float* Dd = static_cast<float*>(scratch(kScratchTmp, static_cast<size_t>(B * nh * T) * sizeof(float)));
  const uint16_t* db = reinterpret_cast<const uint16_t*>(dob);
  MT_LAUNCH(flash_delta_k, attn::warp_blocks(B * nh * T), 32 * attn::kWarpsPerBlock, 0, stream())(Dd, db, reinterpret_cast<const uint16_t*>(out), f);
  check_launch("attention_backward_bf16 (delta)");
  switch (kd) {
    case 1: bwd<1>(dqkv, db, lse, Dd, f); break;
    case 2: bwd<2>(dqkv, db, lse, Dd, f); break;
    case 3: bwd<3>(dqkv, db, lse, Dd, f); break;
    case 4: bwd<4>(dqkv, db, lse, Dd, f); break;
    case 5: bwd<5>(dqkv, db, lse, Dd, f); break;
    case 6: bwd<6>(dqkv, db, lse, Dd, f); break;
    case 7: bwd<7>(dqkv, db, lse, Dd, f); break;
    default: bwd<8>(dqkv, db, lse, Dd, f); break;
  }
}

}  // namespace mt::kernels::cuda
