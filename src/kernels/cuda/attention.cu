// Causal attention with grouped-query heads and rotary embedding (contracts:
// kernels/cpu/attention.h), with optional document masking (doc_start: the first key each query sees). A simple, correct baseline, NOT the performance kernel: one warp per
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

#include "kernels/cuda/attention_common.cuh"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels.h"

namespace mt::kernels::cuda {

namespace {
using attn::Geo;
using attn::kWarpsPerBlock;
using attn::warp_dot;
using attn::warp_blocks;

// One warp per (b, h, t).
__global__ void attn_fwd_k(float* out, float* lse, const float* qkv, const int32_t* ds, Geo g) {
  const int lane = threadIdx.x & 31;
  const int64_t row = attn::warp_row();
  if (row >= g.B * g.nh * g.T) return;
  const int64_t t = row % g.T, h = (row / g.T) % g.nh, b = row / (g.T * g.nh);
  const int64_t kvh = h / (g.nh / g.nkv);
  const float* q = qkv + (b * g.T + t) * g.ld + h * g.hd;
  attn::Online on;
  for (int64_t s = ds ? ds[b * g.T + t] : 0; s <= t; ++s) {
    const float* kr = qkv + (b * g.T + s) * g.ld + (g.nh + kvh) * g.hd;
    const float* vr = qkv + (b * g.T + s) * g.ld + (g.nh + g.nkv + kvh) * g.hd;
    on.add(warp_dot(q, kr, g.hd, lane) * g.scale, vr, g.hd, lane);
  }
  attn::store(out + (b * g.T + t) * (g.nh * g.hd) + h * g.hd, on.acc, 1.0f / on.l, g.hd, lane);
  if (lane == 0) lse[(b * g.nh + h) * g.T + t] = on.m + logf(on.l);
}

// Dd[b, h, t] = dout_row . out_row (0 where lse is -inf).
__global__ void attn_bwd_delta_k(float* Dd, const float* dout, const float* out, const float* lse, Geo g) {
  const int lane = threadIdx.x & 31;
  const int64_t row = attn::warp_row();
  if (row >= g.B * g.nh * g.T) return;
  const int64_t t = row % g.T, h = (row / g.T) % g.nh, b = row / (g.T * g.nh);
  const int64_t off = (b * g.T + t) * (g.nh * g.hd) + h * g.hd;
  const float s = warp_dot(dout + off, out + off, g.hd, lane);
  if (lane == 0) Dd[row] = lse[row] == -INFINITY ? 0.0f : s;
}

// dq[i] += scale * sum_{j<=i} p_ij (dout_i . v_j - D_i) k_j; one warp per (b, h, i).
__global__ void attn_bwd_dq_k(float* dqkv, const float* dout, const float* qkv, const float* lse, const float* Dd,
                              const int32_t* ds, Geo g) {
  const int lane = threadIdx.x & 31;
  const int64_t row = attn::warp_row();
  if (row >= g.B * g.nh * g.T) return;
  const int64_t t = row % g.T, h = (row / g.T) % g.nh, b = row / (g.T * g.nh);
  const int64_t kvh = h / (g.nh / g.nkv);
  const float* q = qkv + (b * g.T + t) * g.ld + h * g.hd;
  const float* dy = dout + (b * g.T + t) * (g.nh * g.hd) + h * g.hd;
  const float L = lse[row], D = Dd[row];
  attn::Row acc = attn::zero_row();
  for (int64_t s = ds ? ds[b * g.T + t] : 0; s <= t; ++s) {
    const float* kr = qkv + (b * g.T + s) * g.ld + (g.nh + kvh) * g.hd;
    const float* vr = qkv + (b * g.T + s) * g.ld + (g.nh + g.nkv + kvh) * g.hd;
    const float p = expf(warp_dot(q, kr, g.hd, lane) * g.scale - L);
    attn::add_scaled(acc, p * (warp_dot(dy, vr, g.hd, lane) - D), kr, g.hd, lane);
  }
  attn::store_add(dqkv + (b * g.T + t) * g.ld + h * g.hd, acc, g.scale, g.hd, lane);
}

// dk[j] += scale * sum_{h in group} sum_{i>=j} ds_ij q_i; dv[j] += sum p_ij dout_i; one warp per
// (b, kv head, j).
__global__ void attn_bwd_dkv_k(float* dqkv, const float* dout, const float* qkv, const float* lse, const float* Dd,
                               const int32_t* ds, Geo g) {
  const int lane = threadIdx.x & 31;
  const int64_t row = attn::warp_row();
  if (row >= g.B * g.nkv * g.T) return;
  const int64_t j = row % g.T, kvh = (row / g.T) % g.nkv, b = row / (g.T * g.nkv);
  const int64_t group = g.nh / g.nkv;
  const float* kr = qkv + (b * g.T + j) * g.ld + (g.nh + kvh) * g.hd;
  const float* vr = qkv + (b * g.T + j) * g.ld + (g.nh + g.nkv + kvh) * g.hd;
  attn::Row ak = attn::zero_row(), av = attn::zero_row();
  for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h) {
    for (int64_t i = j; i < g.T; ++i) {
      if (ds && ds[b * g.T + i] > j) continue;  // document masking: query i does not see key j
      const float* q = qkv + (b * g.T + i) * g.ld + h * g.hd;
      const float* dy = dout + (b * g.T + i) * (g.nh * g.hd) + h * g.hd;
      const int64_t r = (b * g.nh + h) * g.T + i;
      const float p = expf(warp_dot(q, kr, g.hd, lane) * g.scale - lse[r]);
      attn::add_scaled(ak, p * (warp_dot(dy, vr, g.hd, lane) - Dd[r]), q, g.hd, lane);
      attn::add_scaled(av, p, dy, g.hd, lane);
    }
  }
  attn::store_add(dqkv + (b * g.T + j) * g.ld + (g.nh + kvh) * g.hd, ak, g.scale, g.hd, lane);
  attn::store_add(dqkv + (b * g.T + j) * g.ld + (g.nh + g.nkv + kvh) * g.hd, av, 1.0f, g.hd, lane);
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

// The device copy of the rotary table for (T, hd, theta or inv_freq, positions: pos[T] on the
// host, null for 0..T-1), rebuilt when any of them changes.
const float* rope_table(int64_t T, int64_t hd, float theta, const float* inv_freq, const int32_t* pos) {
  static std::mutex mu;
  static int64_t cT = -1, chd = -1;
  static float ctheta = 0.0f;
  static std::vector<float> cfreq, host;
  static std::vector<int32_t> cpos;
  std::lock_guard<std::mutex> lk(mu);
  const int64_t half = hd / 2;
  const bool same = T == cT && hd == chd &&
                    (inv_freq ? cfreq.size() == static_cast<size_t>(half) && std::equal(cfreq.begin(), cfreq.end(), inv_freq)
                              : cfreq.empty() && ctheta == theta) &&
                    (pos ? cpos.size() == static_cast<size_t>(T) && std::equal(cpos.begin(), cpos.end(), pos)
                         : cpos.empty());
  float* dev = static_cast<float*>(scratch(kScratchRope, static_cast<size_t>(2 * T * half) * sizeof(float)));
  if (!same) {
    host.assign(static_cast<size_t>(2 * T * half), 0.0f);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t i = 0; i < half; ++i) {
        const double inv = inv_freq ? static_cast<double>(inv_freq[i])
                                    : std::pow(static_cast<double>(theta), -2.0 * static_cast<double>(i) /
                                                                               static_cast<double>(hd));
        const double a = static_cast<double>(pos ? pos[t] : t) * inv;
        host[t * half + i] = static_cast<float>(std::cos(a));
        host[T * half + t * half + i] = static_cast<float>(std::sin(a));
      }
    mt::cuda::copy_from_host(dev, host.data(), host.size() * sizeof(float));
    cT = T;
    chd = hd;
    ctheta = theta;
    if (inv_freq) cfreq.assign(inv_freq, inv_freq + half);
    else cfreq.clear();
    if (pos) cpos.assign(pos, pos + T);
    else cpos.clear();
  }
  return dev;
}

// host_freq and pos: the contracts' host arrays (null: theta, positions 0..T-1).
void rope(float* qkv, int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd, float theta, const float* host_freq,
          const int32_t* pos, float sign, const char* fn) {
  const Geo g = attn::geo(B, T, nh, nkv, hd, fn);
  if (hd % 2 != 0)
    throw std::invalid_argument(std::string("meshtrain: ") + fn + ": head_dim (" + std::to_string(hd) +
                                ") must be even for rotary embedding");
  if (B <= 0 || T <= 0 || hd <= 0) return;
  const float* cs = rope_table(T, hd, theta, host_freq, pos);
  MT_LAUNCH(rope_k, grid_for(B * T * (nh + nkv) * (hd / 2), 256), 256, 0, stream())(qkv, g, cs, cs + T * (hd / 2),
                                                                                   sign);
  check_launch(fn);
}
}  // namespace

void attn::launch_delta(float* Dd, const float* dout, const float* out, const float* lse, const Geo& g,
                        const char* fn) {
  MT_LAUNCH(attn_bwd_delta_k, warp_blocks(g.B * g.nh * g.T), 32 * kWarpsPerBlock, 0, stream())(Dd, dout, out, lse, g);
  check_launch(fn);
}

void attention_forward(float* out, float* lse, const float* qkv, int64_t B, int64_t T, int64_t nh, int64_t nkv,
                       int64_t hd, const int32_t* doc_start) {
  const Geo g = attn::geo(B, T, nh, nkv, hd, "attention_forward");
  if (B <= 0 || T <= 0 || hd <= 0) return;
  MT_LAUNCH(attn_fwd_k, warp_blocks(B * nh * T), 32 * kWarpsPerBlock, 0, stream())(out, lse, qkv, doc_start, g);
  check_launch("attention_forward");
}

void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse, int64_t B,
                        int64_t T, int64_t nh, int64_t nkv, int64_t hd, const int32_t* doc_start) {
  const Geo g = attn::geo(B, T, nh, nkv, hd, "attention_backward");
  if (B <= 0 || T <= 0 || hd <= 0) return;
  float* Dd = static_cast<float*>(scratch(kScratchTmp, static_cast<size_t>(B * nh * T) * sizeof(float)));
  attn::launch_delta(Dd, dout, out, lse, g, "attention_backward (delta)");
  MT_LAUNCH(attn_bwd_dq_k, warp_blocks(B * nh * T), 32 * kWarpsPerBlock, 0, stream())(dqkv, dout, qkv, lse, Dd, doc_start, g);
  check_launch("attention_backward (dq)");
  MT_LAUNCH(attn_bwd_dkv_k, warp_blocks(B * nkv * T), 32 * kWarpsPerBlock, 0, stream())(dqkv, dout, qkv, lse, Dd, doc_start, g);
  check_launch("attention_backward (dk, dv)");
}

void rope_forward(float* qkv, int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd, float theta) {
  rope(qkv, B, T, nh, nkv, hd, theta, nullptr, nullptr, 1.0f, "rope_forward");
}
void rope_backward(float* dqkv, int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd, float theta) {
  rope(dqkv, B, T, nh, nkv, hd, theta, nullptr, nullptr, -1.0f, "rope_backward");
}
void rope_forward_freq(float* qkv, int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd, const float* inv_freq) {
  rope(qkv, B, T, nh, nkv, hd, 0.0f, inv_freq, nullptr, 1.0f, "rope_forward");
}
void rope_backward_freq(float* dqkv, int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd, const float* inv_freq) {
  rope(dqkv, B, T, nh, nkv, hd, 0.0f, inv_freq, nullptr, -1.0f, "rope_backward");
}

void rope_forward_pos(float* qkv, int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd, float theta,
                      const float* inv_freq, const int32_t* pos) {
  rope(qkv, B, T, nh, nkv, hd, theta, inv_freq, pos, 1.0f, "rope_forward_pos");
}
void rope_backward_pos(float* dqkv, int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd, float theta,
                       const float* inv_freq, const int32_t* pos) {
  rope(dqkv, B, T, nh, nkv, hd, theta, inv_freq, pos, -1.0f, "rope_backward_pos");
}

}  // namespace mt::kernels::cuda
