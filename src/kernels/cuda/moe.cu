// Mixture-of-experts kernels (contracts: kernels/cpu/moe.h): the router and its backward, the
// balance probabilities, the row gathers and the weighted combine. Simple first versions written
// for correctness: the router works one thread per token (E and k are small), with the CPU's
// arithmetic (softmax in double, top-k ties to the lower expert); every sum runs in a fixed order
// (double where the CPU sums in double), so results never depend on timing and no atomics are used.
#include <cstdint>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels.h"

namespace mt::kernels::cuda {

namespace {
constexpr int kThreads = 256;
constexpr int kWarps = 4;  // warps per block of the warp-per-pair kernels

// The k largest of s[0..E) into idx (descending, ties to the lower index), as the CPU picks them.
__device__ void top_k(const float* s, int64_t E, int64_t k, int32_t* idx) {
  for (int64_t j = 0; j < k; ++j) {
    int64_t best = -1;
    for (int64_t e = 0; e < E; ++e) {
      bool taken = false;
      for (int64_t i = 0; i < j; ++i) taken = taken || idx[i] == e;
      if (taken) continue;
      if (best < 0 || s[e] > s[best]) best = e;
    }
    idx[j] = static_cast<int32_t>(best);
  }
}

__global__ void router_fwd_k(float* scores, int32_t* idx, float* w, float* lse, const float* logits, int64_t N,
                             int64_t E, int64_t k, int sigmoid) {
  MT_GRID_STRIDE(t, N) {
    const float* l = logits + t * E;
    float* s = scores + t * E;
    float mx = l[0];
    for (int64_t e = 1; e < E; ++e) mx = fmaxf(mx, l[e]);
    double z = 0;
    for (int64_t e = 0; e < E; ++e) z += exp(static_cast<double>(l[e] - mx));
    lse[t] = mx + static_cast<float>(log(z));
    for (int64_t e = 0; e < E; ++e)
      s[e] = sigmoid ? 1.0f / (1.0f + expf(-l[e])) : static_cast<float>(exp(static_cast<double>(l[e] - mx)) / z);
    int32_t* id = idx + t * k;
    top_k(s, E, k, id);
    double S = 0;
    for (int64_t j = 0; j < k; ++j) S += s[id[j]];
    for (int64_t j = 0; j < k; ++j) w[t * k + j] = static_cast<float>(s[id[j]] / S);
  }
}

// The gradient with respect to the scores, then through the softmax or the sigmoid (cpu/moe.cpp).
__global__ void router_bwd_k(float* dlogits, const float* dw, const float* scores, const int32_t* idx, const float* w,
                             const float* lse, const float* logits, const float* aux, float z_scale, int64_t N,
                             int64_t E, int64_t k, int sigmoid) {
  MT_GRID_STRIDE(t, N) {
    const float* s = scores + t * E;
    const float* l = logits + t * E;
    float* dl = dlogits + t * E;
    const int32_t* id = idx + t * k;
    double S = 0, wdw = 0;
    for (int64_t j = 0; j < k; ++j) {
      S += s[id[j]];
      wdw += static_cast<double>(w[t * k + j]) * dw[t * k + j];
    }
    for (int64_t e = 0; e < E; ++e) dl[e] = 0.0f;
    for (int64_t j = 0; j < k; ++j) dl[id[j]] += static_cast<float>((dw[t * k + j] - wdw) / S);
    if (sigmoid) {
      if (aux) {
        double tot = 0, qa = 0;
        for (int64_t e = 0; e < E; ++e) tot += s[e];
        for (int64_t e = 0; e < E; ++e) qa += s[e] / tot * aux[e];
        for (int64_t e = 0; e < E; ++e) dl[e] += static_cast<float>((aux[e] - qa) / tot);
      }
      for (int64_t e = 0; e < E; ++e) dl[e] *= s[e] * (1.0f - s[e]);
      if (z_scale != 0.0f) {
        const float g = 2.0f * z_scale * lse[t];
        for (int64_t e = 0; e < E; ++e) dl[e] += g * expf(l[e] - lse[t]);
      }
    } else {
      if (aux)
        for (int64_t e = 0; e < E; ++e) dl[e] += aux[e];
      double pd = 0;
      for (int64_t e = 0; e < E; ++e) pd += static_cast<double>(s[e]) * dl[e];
      const float g = 2.0f * z_scale * lse[t];
      for (int64_t e = 0; e < E; ++e) dl[e] = s[e] * (dl[e] - static_cast<float>(pd)) + g * s[e];
    }
  }
}

// tot[t]: what token t's balance probabilities divide its scores by: their sum (sigmoid), or 1.
__global__ void balance_norm_k(double* tot, const float* scores, int64_t N, int64_t E, int sigmoid) {
  MT_GRID_STRIDE(t, N) {
    double sum = 1.0;
    if (sigmoid) {
      sum = 0;
      for (int64_t e = 0; e < E; ++e) sum += scores[t * E + e];
    }
    tot[t] = sum;
  }
}

// One block per expert: each thread sums a fixed strided subset of the tokens in double, then a
// fixed tree over the block; P[e] = sum / N.
__global__ void balance_k(float* P, const float* scores, const double* tot, int64_t N, int64_t E) {
  MT_SHARED(part, double[kThreads]);
  const int64_t e = blockIdx.x;
  double acc = 0;
  for (int64_t t = threadIdx.x; t < N; t += blockDim.x) acc += scores[t * E + e] / tot[t];
  part[threadIdx.x] = acc;
  __syncthreads();
  for (int o = kThreads / 2; o > 0; o >>= 1) {
    if (static_cast<int>(threadIdx.x) < o) part[threadIdx.x] += part[threadIdx.x + o];
    __syncthreads();
  }
  if (threadIdx.x == 0) P[e] = static_cast<float>(part[0] / static_cast<double>(N));
}

// Rows of `words` elements of W: out row i = in row rows[i], or zeros for rows[i] < 0.
template <class W>
__global__ void gather_k(W* out, const W* in, const int32_t* rows, int64_t n, int64_t words) {
  MT_GRID_STRIDE(e, n * words) {
    const int64_t i = e / words, c = e % words;
    const int32_t r = rows[i];
    out[e] = r < 0 ? W(0) : in[static_cast<int64_t>(r) * words + c];
  }
}

// out[t, c] += w[t, j] y[pos[t, j], c] for j in order; one thread per (t, c).
__global__ void combine_k(float* out, const float* y, const int32_t* pos, const float* w, int64_t N, int64_t k,
                          int64_t C) {
  MT_GRID_STRIDE(e, N * C) {
    const int64_t t = e / C, c = e % C;
    float o = out[e];
    for (int64_t j = 0; j < k; ++j) {
      const int32_t p = pos[t * k + j];
      if (p < 0) continue;
      o += (w ? w[t * k + j] : 1.0f) * y[static_cast<int64_t>(p) * C + c];
    }
    out[e] = o;
  }
}

// One warp per (t, j): dy[pos] = w dout[t] (written), dw = <dout[t], y[pos]> summed in double, each
// lane a fixed strided subset, then a fixed butterfly over the warp.
__global__ void combine_bwd_k(float* dy, float* dw, const float* dout, const float* y, const int32_t* pos,
                              const float* w, int64_t N, int64_t k, int64_t C) {
  const int lane = threadIdx.x & 31;
  const int64_t pair = blockIdx.x * static_cast<int64_t>(kWarps) + (threadIdx.x >> 5);
  if (pair >= N * k) return;
  const int32_t p = pos[pair];
  if (p < 0) {
    if (lane == 0) dw[pair] = 0.0f;
    return;
  }
  const float g = w[pair];
  const float* d = dout + (pair / k) * C;
  float* r = dy + static_cast<int64_t>(p) * C;
  const float* yr = y + static_cast<int64_t>(p) * C;
  double dot = 0;
  for (int64_t c = lane; c < C; c += 32) {
    r[c] = g * d[c];
    dot += static_cast<double>(d[c]) * yr[c];
  }
  dot = warp_sum_d(dot);
  if (lane == 0) dw[pair] = static_cast<float>(dot);
}
}  // namespace

void moe_router_forward(float* scores, int32_t* idx, float* w, float* lse, const float* logits, int64_t N, int64_t E,
                        int64_t k, int sigmoid) {
  if (N <= 0 || E <= 0) return;
  MT_LAUNCH(router_fwd_k, grid_for(N, 128), 128, 0, stream())(scores, idx, w, lse, logits, N, E, k, sigmoid);
  check_launch("moe_router_forward");
}

void moe_router_backward(float* dlogits, const float* dw, const float* scores, const int32_t* idx, const float* w,
                         const float* lse, const float* logits, const float* aux, float z_scale, int64_t N, int64_t E,
                         int64_t k, int sigmoid) {
  if (N <= 0 || E <= 0) return;
  MT_LAUNCH(router_bwd_k, grid_for(N, 128), 128, 0, stream())(dlogits, dw, scores, idx, w, lse, logits, aux, z_scale,
                                                              N, E, k, sigmoid);
  check_launch("moe_router_backward");
}

void moe_balance_probs(float* P, const float* scores, int64_t N, int64_t E, int sigmoid) {
  if (E <= 0) return;  // N = 0 gives 0 / 0 as on the CPU
  auto* tot = static_cast<double*>(scratch(kScratchTmp, static_cast<size_t>(N > 0 ? N : 1) * sizeof(double)));
  MT_LAUNCH(balance_norm_k, grid_for(N, kThreads), kThreads, 0, stream())(tot, scores, N, E, sigmoid);
  check_launch("moe_balance_probs (norms)");
  MT_LAUNCH(balance_k, static_cast<unsigned>(E), kThreads, 0, stream())(P, scores, tot, N, E);
  check_launch("moe_balance_probs");
}

void moe_gather_rows(void* out, const void* in, const int32_t* rows, int64_t n, int64_t row_bytes) {
  if (n <= 0 || row_bytes <= 0) return;
  const bool words = (static_cast<uintptr_t>(row_bytes) | reinterpret_cast<uintptr_t>(out) | reinterpret_cast<uintptr_t>(in)) % 4 == 0;
  if (words)
    MT_LAUNCH(gather_k<uint32_t>, grid_for(n * (row_bytes / 4), kThreads), kThreads, 0, stream())(
        static_cast<uint32_t*>(out), static_cast<const uint32_t*>(in), rows, n, row_bytes / 4);
  else
    MT_LAUNCH(gather_k<uint8_t>, grid_for(n * row_bytes, kThreads), kThreads, 0, stream())(
        static_cast<uint8_t*>(out), static_cast<const uint8_t*>(in), rows, n, row_bytes);
  check_launch("moe_gather_rows");
}

void moe_combine(float* out, const float* y, const int32_t* pos, const float* w, int64_t N, int64_t k, int64_t C) {
  if (N <= 0 || C <= 0 || k <= 0) return;
  MT_LAUNCH(combine_k, grid_for(N * C, kThreads), kThreads, 0, stream())(out, y, pos, w, N, k, C);
  check_launch("moe_combine");
}

void moe_combine_backward(float* dy, float* dw, const float* dout, const float* y, const int32_t* pos, const float* w,
                          int64_t N, int64_t k, int64_t C) {
  if (N <= 0 || k <= 0) return;
  MT_LAUNCH(combine_bwd_k, static_cast<unsigned>((N * k + kWarps - 1) / kWarps), 32 * kWarps, 0, stream())(
      dy, dw, dout, y, pos, w, N, k, C);
  check_launch("moe_combine_backward");
}

}  // namespace mt::kernels::cuda
