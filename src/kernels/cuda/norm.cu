// LayerNorm and RMSNorm (contracts: kernels/cpu/norm.h), alone or after the residual add. One block
// per row for the row statistics and the input gradient; weight/bias gradients as two-stage deterministic column sums
// (reduce.cu: partials per slice of rows, then a fixed-order pass; no atomics).
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels.h"

namespace mt::kernels::cuda {

namespace {
constexpr int kThreads = 256;

// kAdd: inp is the residual stream res, updated first (res += add, each thread its own columns, which
// it reads again in the passes below): the fused residual add; the norm's arithmetic is the same.
template <bool kAdd>
__global__ void layernorm_fwd_k(float* out, float* mean, float* rstd, const float* inp, float* res, const float* add,
                                const float* w, const float* b, int64_t C, float eps) {
  MT_SHARED(shm, float[32]);
  const int64_t n = blockIdx.x;
  const float* x = inp + n * C;
  float s = 0.0f;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    if constexpr (kAdd) {
      const float v = res[n * C + c] + add[n * C + c];
      res[n * C + c] = v;
      s += v;
    } else {
      s += x[c];
    }
  }
  const float m = block_sum(s, shm) / static_cast<float>(C);
  float v = 0.0f;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    const float d = x[c] - m;
    v += d * d;
  }
  const float r = rsqrtf(block_sum(v, shm) / static_cast<float>(C) + eps);
  float* o = out + n * C;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) o[c] = (x[c] - m) * r * w[c] + b[c];
  if (threadIdx.x == 0) {
    mean[n] = m;
    rstd[n] = r;
  }
}

__device__ __forceinline__ float widen(float v) { return v; }
__device__ __forceinline__ float widen(uint16_t v) { return bf16_bits_to_f32(v); }

// In: float, or uint16_t for a bf16 input (widened; the arithmetic is the fp32 kernel's).
template <class In>
__global__ void layernorm_bwd_dinp_k(float* dinp, const float* dout, const In* inp, const float* w, const float* mean,
                                     const float* rstd, int64_t C) {
  MT_SHARED(shm, float[32]);
  const int64_t n = blockIdx.x;
  const In* x = inp + n * C;
  const float* dy = dout + n * C;
  const float m = mean[n], r = rstd[n];
  float a = 0.0f, bsum = 0.0f;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    const float dn = dy[c] * w[c];
    a += dn;
    bsum += dn * (widen(x[c]) - m) * r;
  }
  const float dn_mean = block_sum(a, shm) / static_cast<float>(C);
  const float dnx_mean = block_sum(bsum, shm) / static_cast<float>(C);
  float* dx = dinp + n * C;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    const float xh = (widen(x[c]) - m) * r;
    dx[c] += (dy[c] * w[c] - dn_mean - xh * dnx_mean) * r;
  }
}

template <bool kAdd>
__global__ void rmsnorm_fwd_k(float* out, float* rstd, const float* inp, float* res, const float* add, const float* w,
                              int64_t C, float eps) {
  MT_SHARED(shm, float[32]);
  const int64_t n = blockIdx.x;
  const float* x = inp + n * C;
  float s = 0.0f;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    float v = x[c];
    if constexpr (kAdd) {
      v = res[n * C + c] + add[n * C + c];
      res[n * C + c] = v;
    }
    s += v * v;
  }
  const float r = rsqrtf(block_sum(s, shm) / static_cast<float>(C) + eps);
  float* o = out + n * C;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) o[c] = x[c] * r * w[c];
  if (threadIdx.x == 0) rstd[n] = r;
}

template <class In>
__global__ void rmsnorm_bwd_dinp_k(float* dinp, const float* dout, const In* inp, const float* w, const float* rstd,
                                   int64_t C) {
  MT_SHARED(shm, float[32]);
  const int64_t n = blockIdx.x;
  const In* x = inp + n * C;
  const float* dy = dout + n * C;
  const float r = rstd[n];
  float a = 0.0f;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) a += dy[c] * w[c] * widen(x[c]) * r;
  const float dnx_mean = block_sum(a, shm) / static_cast<float>(C);
  float* dx = dinp + n * C;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) dx[c] += (dy[c] * w[c] - widen(x[c]) * r * dnx_mean) * r;
}

// The bf16 residual stream: with add, res_out = bf16(res + add) first (each thread its own columns,
// which it reads again below), then the norm of res_out; without, the norm of res. kRms: RMSNorm
// (mean and b unused), else LayerNorm.
template <bool kRms>
__global__ void norm_fwd_bf16_k(float* out, float* mean, float* rstd, uint16_t* res_out, const uint16_t* res,
                                const float* add, const float* w, const float* b, int64_t C, float eps) {
  MT_SHARED(shm, float[32]);
  const int64_t n = blockIdx.x;
  const uint16_t* x = (add ? res_out : res) + n * C;
  float s = 0.0f;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    float v;
    if (add) {
      const uint16_t u = f32_to_bf16_bits(bf16_bits_to_f32(res[n * C + c]) + add[n * C + c]);
      res_out[n * C + c] = u;
      v = bf16_bits_to_f32(u);
    } else {
      v = bf16_bits_to_f32(x[c]);
    }
    s += kRms ? v * v : v;
  }
  float* o = out + n * C;
  if constexpr (kRms) {
    const float r = rsqrtf(block_sum(s, shm) / static_cast<float>(C) + eps);
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) o[c] = bf16_bits_to_f32(x[c]) * r * w[c];
    if (threadIdx.x == 0) rstd[n] = r;
  } else {
    const float m = block_sum(s, shm) / static_cast<float>(C);
    float v = 0.0f;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
      const float d = bf16_bits_to_f32(x[c]) - m;
      v += d * d;
    }
    const float r = rsqrtf(block_sum(v, shm) / static_cast<float>(C) + eps);
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) o[c] = (bf16_bits_to_f32(x[c]) - m) * r * w[c] + b[c];
    if (threadIdx.x == 0) {
      mean[n] = m;
      rstd[n] = r;
    }
  }
}

// out = bf16(res + x), eight elements per step where the pointers allow (launch8).
struct ResidualAddBf16 {
  uint16_t* out;
  const uint16_t* res;
  const float* x;
  __device__ void one(int64_t j) const { out[j] = f32_to_bf16_bits(bf16_bits_to_f32(res[j]) + x[j]); }
  __device__ void vec(int64_t i) const {
    P8 r = load8(res, i);
    const P8 v = load8(x, i);
    for (int k = 0; k < 8; ++k) r.v[k] += v.v[k];
    store8(out, i, r);
  }
};
}  // namespace

void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* w, const float* b,
                       int64_t N, int64_t C, float eps) {
  if (N <= 0 || C <= 0) return;
  void (*const k)(float*, float*, float*, const float*, float*, const float*, const float*, const float*, int64_t,
                  float) = layernorm_fwd_k<false>;
  MT_LAUNCH(k, static_cast<unsigned>(N), kThreads, 0, stream())(out, mean, rstd, inp, nullptr, nullptr, w, b, C, eps);
  check_launch("layernorm_forward");
}
void residual_layernorm_forward(float* out, float* mean, float* rstd, float* res, const float* x, const float* w,
                                const float* b, int64_t N, int64_t C, float eps) {
  if (N <= 0 || C <= 0) return;
  void (*const k)(float*, float*, float*, const float*, float*, const float*, const float*, const float*, int64_t,
                  float) = layernorm_fwd_k<true>;
  MT_LAUNCH(k, static_cast<unsigned>(N), kThreads, 0, stream())(out, mean, rstd, res, res, x, w, b, C, eps);
  check_launch("residual_layernorm_forward");
}
void layernorm_backward(float* dinp, float* dw, float* db, const float* dout, const float* inp, const float* w,
                        const float* mean, const float* rstd, int64_t N, int64_t C) {
  if (N <= 0 || C <= 0) return;
  if (dinp) {
    void (*const k)(float*, const float*, const float*, const float*, const float*, const float*, int64_t) =
        layernorm_bwd_dinp_k<float>;
    MT_LAUNCH(k, static_cast<unsigned>(N), kThreads, 0, stream())(dinp, dout, inp, w, mean, rstd, C);
    check_launch("layernorm_backward");
  }
  if (dw || db) {
    column_sums(dw, db, dout, inp, mean, rstd, N, C);
  }
}
void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* w, int64_t N, int64_t C, float eps) {
  if (N <= 0 || C <= 0) return;
  void (*const k)(float*, float*, const float*, float*, const float*, const float*, int64_t, float) =
      rmsnorm_fwd_k<false>;
  MT_LAUNCH(k, static_cast<unsigned>(N), kThreads, 0, stream())(out, rstd, inp, nullptr, nullptr, w, C, eps);
  check_launch("rmsnorm_forward");
}
void residual_rmsnorm_forward(float* out, float* rstd, float* res, const float* x, const float* w, int64_t N,
                              int64_t C, float eps) {
  if (N <= 0 || C <= 0) return;
  void (*const k)(float*, float*, const float*, float*, const float*, const float*, int64_t, float) =
      rmsnorm_fwd_k<true>;
  MT_LAUNCH(k, static_cast<unsigned>(N), kThreads, 0, stream())(out, rstd, res, res, x, w, C, eps);
  check_launch("residual_rmsnorm_forward");
}
void rmsnorm_backward(float* dinp, float* dw, const float* dout, const float* inp, const float* w, const float* rstd,
                      int64_t N, int64_t C) {
  if (N <= 0 || C <= 0) return;
  if (dinp) {
    void (*const k)(float*, const float*, const float*, const float*, const float*, int64_t) =
        rmsnorm_bwd_dinp_k<float>;
    MT_LAUNCH(k, static_cast<unsigned>(N), kThreads, 0, stream())(dinp, dout, inp, w, rstd, C);
    check_launch("rmsnorm_backward");
  }
  if (dw) {
    column_sums(dw, nullptr, dout, inp, nullptr, rstd, N, C);
  }
}


// ---- the bf16 residual stream ----

void residual_add_bf16(bf16* out, const bf16* res, const float* x, int64_t n) {
  const ResidualAddBf16 b{reinterpret_cast<uint16_t*>(out), reinterpret_cast<const uint16_t*>(res), x};
  launch8("residual_add_bf16", b, n, all_aligned16(out, res, x), kThreads);
}
void residual_layernorm_forward_bf16(float* out, float* mean, float* rstd, bf16* res_out, const bf16* res,
                                     const float* x, const float* w, const float* b, int64_t N, int64_t C, float eps) {
  if (N <= 0 || C <= 0) return;
  void (*const k)(float*, float*, float*, uint16_t*, const uint16_t*, const float*, const float*, const float*, int64_t,
                  float) = norm_fwd_bf16_k<false>;
  MT_LAUNCH(k, static_cast<unsigned>(N), kThreads, 0, stream())(
      out, mean, rstd, reinterpret_cast<uint16_t*>(res_out), reinterpret_cast<const uint16_t*>(res), x, w, b, C, eps);
  check_launch("residual_layernorm_forward_bf16");
}
void residual_rmsnorm_forward_bf16(float* out, float* rstd, bf16* res_out, const bf16* res, const float* x,
                                   const float* w, int64_t N, int64_t C, float eps) {
  if (N <= 0 || C <= 0) return;
  void (*const k)(float*, float*, float*, uint16_t*, const uint16_t*, const float*, const float*, const float*, int64_t,
                  float) = norm_fwd_bf16_k<true>;
  MT_LAUNCH(k, static_cast<unsigned>(N), kThreads, 0, stream())(
      out, nullptr, rstd, reinterpret_cast<uint16_t*>(res_out), reinterpret_cast<const uint16_t*>(res), x, w, nullptr, C,
      eps);
  check_launch("residual_rmsnorm_forward_bf16");
}
void layernorm_backward_bf16(float* dinp, float* dw, float* db, const float* dout, const bf16* inp, const float* w,
                             const float* mean, const float* rstd, int64_t N, int64_t C) {
  if (N <= 0 || C <= 0) return;
  const uint16_t* x = reinterpret_cast<const uint16_t*>(inp);
  if (dinp) {
    void (*const k)(float*, const float*, const uint16_t*, const float*, const float*, const float*, int64_t) =
        layernorm_bwd_dinp_k<uint16_t>;
    MT_LAUNCH(k, static_cast<unsigned>(N), kThreads, 0, stream())(dinp, dout, x, w, mean, rstd, C);
    check_launch("layernorm_backward_bf16");
  }
  if (dw || db) column_sums_bf16(dw, db, dout, x, mean, rstd, N, C);
}
void rmsnorm_backward_bf16(float* dinp, float* dw, const float* dout, const bf16* inp, const float* w,
                           const float* rstd, int64_t N, int64_t C) {
  if (N <= 0 || C <= 0) return;
  const uint16_t* x = reinterpret_cast<const uint16_t*>(inp);
  if (dinp) {
    void (*const k)(float*, const float*, const uint16_t*, const float*, const float*, int64_t) =
        rmsnorm_bwd_dinp_k<uint16_t>;
    MT_LAUNCH(k, static_cast<unsigned>(N), kThreads, 0, stream())(dinp, dout, x, w, rstd, C);
    check_launch("rmsnorm_backward_bf16");
  }
  if (dw) column_sums_bf16(dw, nullptr, dout, x, nullptr, rstd, N, C);
}

}  // namespace mt::kernels::cuda
