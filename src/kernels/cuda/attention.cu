// Causal attention with grouped-query heads and rotary embedding (contracts:
// kernels/cpu/attention.h). A simple, correct baseline, NOT the performance kernel: one warp per
// query row with an online softmax over the keys (no T x T matrix, only lse saved), fp32
// throughout, head_dim <= 256. Backward recomputes the probabilities from q, k and lse and is
// deterministic without atomics: one warp per query row for dq, one warp per key row (summing its
// query-head group in order) for dk and dv. O(T^2 hd) per head with no tiling or tensor cores; a
// FlashAttention-2 style kernel replaces it in the performance work (docs/gpu.md).
#include <algorithm>
#include <cmath>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels.h"

namespace mt::kernels::cuda {

namespace {
constexpr int kMaxPerLane = 8;  // head_dim <= 32 * 8
constexpr int kWarpsPerBlock = 4;

struct Geo {
  int64_t B, T, nh, nkv, hd, ld;
  float scale;
};

__device__ __forceinline__ float warp_dot(const float* a, const float* b, int64_t hd, int lane) {
  float s = 0.0f;
#pragma unroll
  for (int k = 0; k < kMaxPerLane; ++k) {
    const int64_t d = lane + 32 * k;
    if (d < hd) s += a[d] * b[d];
  }
  return warp_sum(s);
}

// One warp per (b, h, t).
__global__ void attn_fwd_k(float* out, float* lse, const float* qkv, Geo g) {
  const int lane = threadIdx.x & 31;
  const int64_t row = blockIdx.x * static_cast<int64_t>(kWarpsPerBlock) + (threadIdx.x >> 5);
  if (row >= g.B * g.nh * g.T) return;
  const int64_t t = row % g.T, h = (row / g.T) % g.nh, b = row / (g.T * g.nh);
  const int64_t kvh = h / (g.nh / g.nkv);
  const float* q = qkv + (b * g.T + t) * g.ld + h * g.hd;
  float acc[kMaxPerLane];
#pragma unroll
  for (int k = 0; k < kMaxPerLane; ++k) acc[k] = 0.0f;
  float m = -INFINITY, l = 0.0f;
  for (int64_t s = 0; s <= t; ++s) {
    const float* kr = qkv + (b * g.T + s) * g.ld + (g.nh + kvh) * g.hd;
    const float* vr = qkv + (b * g.T + s) * g.ld + (g.nh + g.nkv + kvh) * g.hd;
    const float sc = warp_dot(q, kr, g.hd, lane) * g.scale;
    const float mn = fmaxf(m, sc);
    const float corr = expf(m - mn);  // 0 on the first key (m = -inf)
    const float p = expf(sc - mn);
    l = l * corr + p;
#pragma unroll
    for (int k = 0; k < kMaxPerLane; ++k) {
      const int64_t d = lane + 32 * k;
      if (d < g.hd) acc[k] = acc[k] * corr + p * vr[d];
    }
    m = mn;
  }
  float* o = out + (b * g.T + t) * (g.nh * g.hd) + h * g.hd;
  const float inv = 1.0f / l;
#pragma unroll
  for (int k = 0; k < kMaxPerLane; ++k) {
    const int64_t d = lane + 32 * k;
    if (d < g.hd) o[d] = acc[k] * inv;
  }
  if (lane == 0) lse[(b * g.nh + h) * g.T + t] = m + logf(l);
}

// Dd[b, h, t] = dout_row . out_row.
__global__ void attn_bwd_delta_k(float* Dd, const float* dout, const float* out, Geo g) {
  const int lane = threadIdx.x & 31;
  const int64_t row = blockIdx.x * static_cast<int64_t>(kWarpsPerBlock) + (threadIdx.x >> 5);
  if (row >= g.B * g.nh * g.T) return;
  const int64_t t = row % g.T, h = (row / g.T) % g.nh, b = row / (g.T * g.nh);
  const int64_t off = (b * g.T + t) * (g.nh * g.hd) + h * g.hd;
  const float s = warp_dot(dout + off, out + off, g.hd, lane);
  if (lane == 0) Dd[row] = s;
}

// dq[i] += scale * sum_{j<=i} p_ij (dout_i . v_j - D_i) k_j; one warp per (b, h, i).
__global__ void attn_bwd_dq_k(float* dqkv, const float* dout, const float* qkv, const float* lse, const float* Dd,
                              Geo g) {
  const int lane = threadIdx.x & 31;
  const int64_t row = blockIdx.x * static_cast<int64_t>(kWarpsPerBlock) + (threadIdx.x >> 5);
  if (row >= g.B * g.nh * g.T) return;
  const int64_t t = row % g.T, h = (row / g.T) % g.nh, b = row / (g.T * g.nh);
  const int64_t kvh = h / (g.nh / g.nkv);
  const float* q = qkv + (b * g.T + t) * g.ld + h * g.hd;
  const float* dy = dout + (b * g.T + t) * (g.nh * g.hd) + h * g.hd;
  const float L = lse[row], D = Dd[row];
  float acc[kMaxPerLane];
#pragma unroll
  for (int k = 0; k < kMaxPerLane; ++k) acc[k] = 0.0f;
  for (int64_t s = 0; s <= t; ++s) {
    const float* kr = qkv + (b * g.T + s) * g.ld + (g.nh + kvh) * g.hd;
    const float* vr = qkv + (b * g.T + s) * g.ld + (g.nh + g.nkv + kvh) * g.hd;
    const float p = expf(warp_dot(q, kr, g.hd, lane) * g.scale - L);
    const float ds = p * (warp_dot(dy, vr, g.hd, lane) - D);
#pragma unroll
    for (int k = 0; k < kMaxPerLane; ++k) {
      const int64_t d = lane + 32 * k;
      if (d < g.hd) acc[k] += ds * kr[d];
    }
  }
  float* dq = dqkv + (b * g.T + t) * g.ld + h * g.hd;
#pragma unroll
  for (int k = 0; k < kMaxPerLane; ++k) {
    const int64_t d = lane + 32 * k;
    if (d < g.hd) dq[d] += acc[k] * g.scale;
  }
}

// dk[j] += scale * sum_{h in group} sum_{i>=j} ds_ij q_i; dv[j] += sum p_ij dout_i; one warp per
// (b, kv head, j).
__global__ void attn_bwd_dkv_k(float* dqkv, const float* dout, const float* qkv, const float* lse, const float* Dd,
                               Geo g) {
  const int lane = threadIdx.x & 31;
  const int64_t row = blockIdx.x * static_cast<int64_t>(kWarpsPerBlock) + (threadIdx.x >> 5);
  if (row >= g.B * g.nkv * g.T) return;
  const int64_t j = row % g.T, kvh = (row / g.T) % g.nkv, b = row / (g.T * g.nkv);
  const int64_t group = g.nh / g.nkv;
  const float* kr = qkv + (b * g.T + j) * g.ld + (g.nh + kvh) * g.hd;
  const float* vr = qkv + (b * g.T + j) * g.ld + (g.nh + g.nkv + kvh) * g.hd;
  float ak[kMaxPerLane], av[kMaxPerLane];
#pragma unroll
  for (int k = 0; k < kMaxPerLane; ++k) ak[k] = av[k] = 0.0f;
  for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h) {
    for (int64_t i = j; i < g.T; ++i) {
      const float* q = qkv + (b * g.T + i) * g.ld + h * g.hd;
      const float* dy = dout + (b * g.T + i) * (g.nh * g.hd) + h * g.hd;
      const int64_t r = (b * g.nh + h) * g.T + i;
      const float p = expf(warp_dot(q, kr, g.hd, lane) * g.scale - lse[r]);
      const float ds = p * (warp_dot(dy, vr, g.hd, lane) - Dd[r]);
#pragma unroll
      for (int k = 0; k < kMaxPerLane; ++k) {
        const int64_t d = lane + 32 * k;
        if (d < g.hd) {
          ak[k] += ds * q[d];
          av[k] += p * dy[d];
        }
      }
    }
  }
  float* dk = dqkv + (b * g.T + j) * g.ld + (g.nh + kvh) * g.hd;
  float* dv = dqkv + (b * g.T + j) * g.ld + (g.nh + g.nkv + kvh) * g.hd;
#pragma unroll
  for (int k = 0; k < kMaxPerLane; ++k) {
    const int64_t d = lane + 32 * k;
    if (d < g.hd) {
      dk[d] += ak[k] * g.scale;
      dv[d] += av[k];
    }
  }
}

// Rotation of the q and k heads: one thread per (b, t, head, i < hd/2), with the cos/sin table
// [T, hd/2] computed on the host exactly as the CPU computes it (double, rounded to float).
__global__ void rope_k(float* qkv, Geo g, const float* cs, const float* sn, float sign) {
  const int64_t half = g.hd / 2, heads = g.nh + g.nkv;
  const int64_t n = g.B * g.T * heads * half;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = e % half, hh = (e / half) % heads, bt = e / (half * heads);
    const int64_t t = bt % g.T;
    const float c = cs[t * half + i], s = sign * sn[t * half + i];
    float* x = qkv + bt * g.ld + hh * g.hd;
    const float x1 = x[i], x2 = x[i + half];
    x[i] = x1 * c - x2 * s;
    x[i + half] = x2 * c + x1 * s;
  }
}

// The device copy of the rotary table for (T, hd, theta or inv_freq), rebuilt when they change.
const float* rope_table(int64_t T, int64_t hd, float theta, const float* inv_freq) {
  static std::mutex mu;
  static int64_t cT = -1, chd = -1;
  static float ctheta = 0.0f;
  static std::vector<float> cfreq, host;
  std::lock_guard<std::mutex> lk(mu);
  const int64_t half = hd / 2;
  const bool same = T == cT && hd == chd &&
                    (inv_freq ? cfreq.size() == static_cast<size_t>(half) && std::equal(cfreq.begin(), cfreq.end(), inv_freq)
                              : cfreq.empty() && ctheta == theta);
  float* dev = static_cast<float*>(scratch(kScratchRope, static_cast<size_t>(2 * T * half) * sizeof(float)));
  if (!same) {
    host.assign(static_cast<size_t>(2 * T * half), 0.0f);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t i = 0; i < half; ++i) {
        const double inv = inv_freq ? static_cast<double>(inv_freq[i])
                                    : std::pow(static_cast<double>(theta), -2.0 * static_cast<double>(i) /
                                                                               static_cast<double>(hd));
        const double a = static_cast<double>(t) * inv;
        host[t * half + i] = static_cast<float>(std::cos(a));
        host[T * half + t * half + i] = static_cast<float>(std::sin(a));
      }
    mt::cuda::copy_from_host(dev, host.data(), host.size() * sizeof(float));
    cT = T;
    chd = hd;
    ctheta = theta;
    if (inv_freq) cfreq.assign(inv_freq, inv_freq + half);
    else cfreq.clear();
  }
  return dev;
}

Geo geo(int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd, const char* fn) {
  if (nh <= 0 || nkv <= 0 || nh % nkv != 0)
    throw std::invalid_argument(std::string("meshtrain: ") + fn + ": n_head (" + std::to_string(nh) +
                                ") must be a positive multiple of n_kv_head (" + std::to_string(nkv) + ")");
  if (hd > 32 * kMaxPerLane)
    throw std::invalid_argument(std::string("meshtrain: ") + fn + ": head_dim " + std::to_string(hd) +
                                " > 256 is not implemented on CUDA yet");
  return Geo{B, T, nh, nkv, hd, (nh + 2 * nkv) * hd, static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd)))};
}

unsigned warp_blocks(int64_t rows) { return static_cast<unsigned>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock); }

void rope(float* qkv, int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd, float theta, const float* host_freq,
          float sign, const char* fn) {
  const Geo g = geo(B, T, nh, nkv, hd, fn);
  if (hd % 2 != 0)
    throw std::invalid_argument(std::string("meshtrain: ") + fn + ": head_dim (" + std::to_string(hd) +
                                ") must be even for rotary embedding");
  if (B <= 0 || T <= 0 || hd <= 0) return;
  const float* cs = rope_table(T, hd, theta, host_freq);  // host_freq: the contract's host array
  MT_LAUNCH(rope_k, grid_for(B * T * (nh + nkv) * (hd / 2), 256), 256, 0, stream())(qkv, g, cs, cs + T * (hd / 2),
                                                                                   sign);
  check_launch(fn);
}
}  // namespace

void attention_forward(float* out, float* lse, const float* qkv, int64_t B, int64_t T, int64_t nh, int64_t nkv,
                       int64_t hd) {
  const Geo g = geo(B, T, nh, nkv, hd, "attention_forward");
  if (B <= 0 || T <= 0 || hd <= 0) return;
  MT_LAUNCH(attn_fwd_k, warp_blocks(B * nh * T), 32 * kWarpsPerBlock, 0, stream())(out, lse, qkv, g);
  check_launch("attention_forward");
}

void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse, int64_t B,
                        int64_t T, int64_t nh, int64_t nkv, int64_t hd) {
  const Geo g = geo(B, T, nh, nkv, hd, "attention_backward");
  if (B <= 0 || T <= 0 || hd <= 0) return;
  float* Dd = static_cast<float*>(scratch(kScratchTmp, static_cast<size_t>(B * nh * T) * sizeof(float)));
  MT_LAUNCH(attn_bwd_delta_k, warp_blocks(B * nh * T), 32 * kWarpsPerBlock, 0, stream())(Dd, dout, out, g);
  check_launch("attention_backward (delta)");
  MT_LAUNCH(attn_bwd_dq_k, warp_blocks(B * nh * T), 32 * kWarpsPerBlock, 0, stream())(dqkv, dout, qkv, lse, Dd, g);
  check_launch("attention_backward (dq)");
  MT_LAUNCH(attn_bwd_dkv_k, warp_blocks(B * nkv * T), 32 * kWarpsPerBlock, 0, stream())(dqkv, dout, qkv, lse, Dd, g);
  check_launch("attention_backward (dk, dv)");
}

void rope_forward(float* qkv, int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd, float theta) {
  rope(qkv, B, T, nh, nkv, hd, theta, nullptr, 1.0f, "rope_forward");
}
void rope_backward(float* dqkv, int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd, float theta) {
  rope(dqkv, B, T, nh, nkv, hd, theta, nullptr, -1.0f, "rope_backward");
}
void rope_forward_freq(float* qkv, int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd, const float* inv_freq) {
  rope(qkv, B, T, nh, nkv, hd, 0.0f, inv_freq, 1.0f, "rope_forward");
}
void rope_backward_freq(float* dqkv, int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd, const float* inv_freq) {
  rope(dqkv, B, T, nh, nkv, hd, 0.0f, inv_freq, -1.0f, "rope_backward");
}

}  // namespace mt::kernels::cuda
