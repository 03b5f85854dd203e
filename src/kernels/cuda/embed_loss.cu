// Embeddings, softmax cross-entropy (fused and vocab-parallel) and AdamW (contracts:
// kernels/cpu/embedding.h, loss.h, adamw.h).
//
// Embedding and position backward are deterministic without atomics and sum in the CPU's token
// order (bitwise the CPU's sums). The embedding backward splits the table's rows into up to 256
// classes, one grid row each, so C x 256 threads work instead of C.
// Cross-entropy targets live on the device, so they are not validated on the host as the CPU does:
// a target >= V gives a NaN loss for that row (the trainer's finite check reports it).
#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels.h"

namespace mt::kernels::cuda {

namespace {
constexpr int kThreads = 256;
constexpr int64_t kEmbedGroups = 256;  // row classes of the embedding backward

// out[n, :] = table[ids[n] - lo, :] when lo <= ids[n] < lo + rows, else 0; table f32 or bf16.
template <bool kBf16>
__global__ void embed_fwd_k(float* out, const int32_t* ids, const void* table, int64_t lo, int64_t rows, int64_t N,
                            int64_t C) {
  MT_GRID_STRIDE(i, N * C) {
    const int64_t n = i / C, c = i % C;
    const int64_t r = static_cast<int64_t>(ids[n]) - lo;
    float v = 0.0f;
    if (r >= 0 && r < rows) {
      if constexpr (kBf16) v = bf16_bits_to_f32(static_cast<const uint16_t*>(table)[r * C + c]);
      else v = static_cast<const float*>(table)[r * C + c];
    }
    out[i] = v;
  }
}
// Rows of the table are split into `groups` classes (row % groups); block (x, g) owns channels
// [256 x, 256 x + 256) of the rows of class g, and each thread walks the tokens in index order,
// adding only those whose row is in its class. Every table element is written by one thread, in
// the CPU's token order (bitwise the CPU's sums, no atomics), with C x groups threads at work
// instead of C.
__global__ void embed_bwd_k(float* dtable, const float* dout, const int32_t* ids, int64_t lo, int64_t rows, int64_t N,
                            int64_t C, int64_t groups) {
  const int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t g = blockIdx.y;
  if (c >= C) return;
  for (int64_t n = 0; n < N; ++n) {
    const int64_t r = static_cast<int64_t>(ids[n]) - lo;
    if (r >= 0 && r < rows && r % groups == g) dtable[r * C + c] += dout[n * C + c];
  }
}
void embed_backward(float* dtable, const float* dout, const int32_t* ids, int64_t lo, int64_t rows, int64_t N,
                    int64_t C, const char* what) {
  const int64_t groups = rows < kEmbedGroups ? rows : kEmbedGroups;
  const dim3 grid(grid_for(C, kThreads), static_cast<unsigned>(groups));
  MT_LAUNCH(embed_bwd_k, grid, kThreads, 0, stream())(dtable, dout, ids, lo, rows, N, C, groups);
  check_launch(what);
}
__global__ void pos_add_rows_k(float* x, const float* pos, int64_t R, int64_t T, int64_t row0, int64_t C) {
  MT_GRID_STRIDE(i, R * C) {
    const int64_t r = i / C, c = i % C;
    x[i] += pos[((row0 + r) % T) * C + c];
  }
}
__global__ void pos_bwd_k(float* dpos, const float* dout, int64_t B, int64_t T, int64_t C) {
  MT_GRID_STRIDE(i, T * C) {
    float s = 0.0f;
    for (int64_t b = 0; b < B; ++b) s += dout[b * T * C + i];
    dpos[i] += s;
  }
}

// A logit as the loss reads it (fp32, or bf16 widened) and as it writes the gradient back (bf16:
// rounded).
template <class T>
__device__ __forceinline__ float logit_f32(T v) {
  if constexpr (sizeof(T) == sizeof(float))
    return v;
  else
    return bf16_bits_to_f32(v);
}
template <class T>
__device__ __forceinline__ T logit_store(float v) {
  if constexpr (sizeof(T) == sizeof(float))
    return v;
  else
    return f32_to_bf16_bits(v);
}

// One block per row of fp32 logits (T = float) or bf16 ones (T = uint16_t, widened as they are
// read), fp32 arithmetic, the block's reductions in a fixed order. grad: overwrite the row with
// (softmax - onehot) * dloss (0 in padding), in bf16 rounded for bf16 logits; each thread rewrites
// only the values it read itself.
template <bool kGrad, class T>
__global__ void ce_k(T* logits, float* losses, const int32_t* targets, int64_t V, int64_t Vp, float dloss) {
  MT_SHARED(shm, float[32]);
  const int64_t n = blockIdx.x;
  T* x = logits + n * Vp;
  const int32_t tgt = targets[n];
  if (tgt < 0) {
    if constexpr (kGrad)
      for (int64_t j = threadIdx.x; j < Vp; j += blockDim.x) x[j] = T{0};
    if (threadIdx.x == 0) losses[n] = 0.0f;
    return;
  }
  float m = -INFINITY;
  for (int64_t j = threadIdx.x; j < V; j += blockDim.x) m = fmaxf(m, logit_f32(x[j]));
  m = block_max(m, shm);
  float s = 0.0f;
  for (int64_t j = threadIdx.x; j < V; j += blockDim.x) s += expf(logit_f32(x[j]) - m);
  s = block_sum(s, shm);
  const bool bad = tgt >= V;
  if (threadIdx.x == 0) losses[n] = bad ? NAN : logf(s) + m - logit_f32(x[tgt]);
  if constexpr (kGrad) {
    __syncthreads();  // x[tgt] was read above
    const float f = dloss / s;
    for (int64_t j = threadIdx.x; j < Vp; j += blockDim.x)
      x[j] = j < V ? logit_store<T>(expf(logit_f32(x[j]) - m) * f - (j == tgt ? dloss : 0.0f)) : T{0};
  }
}

// Rows [row0, row0 + gridDim.x) of the fp32 gradient rounded to bf16 into a dense [N, Vp] bf16
// matrix over the first half of the logits' storage, a tile of blockDim.x values at a time (every
// thread reads its value, the block syncs, then writes). Row n lands inside row n / 2's storage, so
// the host launches row 0 alone (its tiles land on floats it has read) and then the waves [1, 2),
// [2, 4), ... in stream order, each over rows an earlier launch has finished.
__global__ void grad_rows_to_bf16_k(float* logits, int64_t Vp, int64_t row0) {
  const int64_t n = row0 + blockIdx.x;
  const float* x = logits + n * Vp;
  uint16_t* g = reinterpret_cast<uint16_t*>(logits) + n * Vp;
  for (int64_t j0 = 0; j0 < Vp; j0 += blockDim.x) {
    const int64_t j = j0 + threadIdx.x;
    const float v = j < Vp ? x[j] : 0.0f;
    __syncthreads();
    if (j < Vp) g[j] = f32_to_bf16_bits(v);
    __syncthreads();
  }
}

__global__ void vp_rowmax_k(float* rowmax, const float* lg, int64_t Vl, int64_t valid) {
  MT_SHARED(shm, float[32]);
  const int64_t n = blockIdx.x;
  float m = -INFINITY;
  for (int64_t j = threadIdx.x; j < valid; j += blockDim.x) m = fmaxf(m, lg[n * Vl + j]);
  m = block_max(m, shm);
  if (threadIdx.x == 0) rowmax[n] = m;
}
__global__ void vp_stats_k(float* stats, const float* lg, const float* rowmax, const int32_t* targets, int64_t N,
                           int64_t Vl, int64_t valid, int64_t lo) {
  MT_SHARED(shm, float[32]);
  const int64_t n = blockIdx.x;
  const float m = rowmax[n];
  float s = 0.0f;
  for (int64_t j = threadIdx.x; j < valid; j += blockDim.x) s += expf(lg[n * Vl + j] - m);
  s = block_sum(s, shm);
  if (threadIdx.x == 0) {
    stats[n] = s;
    const int64_t t = static_cast<int64_t>(targets[n]) - lo;
    stats[N + n] = (targets[n] >= 0 && t >= 0 && t < valid) ? lg[n * Vl + t] : 0.0f;
  }
}
__global__ void vp_finish_k(float* lg, float* losses, const float* rowmax, const float* stats, const int32_t* targets,
                            int64_t N, int64_t Vl, int64_t valid, int64_t lo, bool train, float dloss) {
  const int64_t n = blockIdx.x;
  const bool ignore = targets[n] < 0;
  if (threadIdx.x == 0) losses[n] = ignore ? 0.0f : logf(stats[n]) + rowmax[n] - stats[N + n];
  if (!train) return;
  const float inv = 1.0f / stats[n], m = rowmax[n];
  const int64_t t = static_cast<int64_t>(targets[n]) - lo;
  for (int64_t j = threadIdx.x; j < Vl; j += blockDim.x) {
    float g = 0.0f;
    if (!ignore && j < valid) g = (expf(lg[n * Vl + j] - m) * inv - (j == t ? 1.0f : 0.0f)) * dloss;
    lg[n * Vl + j] = g;
  }
}

__global__ void adamw_k(float* param, const float* grad, float* m, float* v, int64_t n, float lr, float beta1,
                        float beta2, float eps, float lr_wd, float inv_bc1, float inv_bc2, float grad_scale,
                        uint16_t* param_bf16) {
  MT_GRID_STRIDE(i, n) {
    adamw_element(param, grad, m, v, i, lr, beta1, beta2, eps, lr_wd, inv_bc1, inv_bc2, grad_scale, param_bf16);
  }
}

void check_vocab(int64_t V, int64_t Vp, const char* fn) {
  if (V <= 0 || Vp < V)
    throw std::invalid_argument(std::string("meshtrain: ") + fn + ": need 0 < V <= Vp (V=" + std::to_string(V) +
                                ", Vp=" + std::to_string(Vp) + ")");
}
}  // namespace

void embedding_forward(float* out, const int32_t* ids, const float* table, int64_t N, int64_t C) {
  if (N <= 0 || C <= 0) return;
  MT_LAUNCH(embed_fwd_k<false>, grid_for(N * C, kThreads), kThreads, 0, stream())(out, ids, table, 0, INT64_MAX, N, C);
  check_launch("embedding_forward");
}
void embedding_backward(float* dtable, const float* dout, const int32_t* ids, int64_t N, int64_t C) {
  if (N <= 0 || C <= 0) return;
  embed_backward(dtable, dout, ids, 0, INT64_MAX, N, C, "embedding_backward");
}
void position_add_forward(float* x, const float* pos, int64_t B, int64_t T, int64_t C) {
  position_add_rows(x, pos, B * T, T, 0, C);
}
void position_add_backward(float* dpos, const float* dout, int64_t B, int64_t T, int64_t C) {
  if (B <= 0 || T <= 0 || C <= 0) return;
  MT_LAUNCH(pos_bwd_k, grid_for(T * C, kThreads), kThreads, 0, stream())(dpos, dout, B, T, C);
  check_launch("position_add_backward");
}
void vocab_embedding_forward(float* out, const int32_t* ids, const void* table, DType dt, int64_t lo, int64_t rows,
                             int64_t N, int64_t C) {
  if (N <= 0 || C <= 0) return;
  if (dt == DType::BF16)
    MT_LAUNCH(embed_fwd_k<true>, grid_for(N * C, kThreads), kThreads, 0, stream())(out, ids, table, lo, rows, N, C);
  else
    MT_LAUNCH(embed_fwd_k<false>, grid_for(N * C, kThreads), kThreads, 0, stream())(out, ids, table, lo, rows, N, C);
  check_launch("vocab_embedding_forward");
}
void vocab_embedding_backward(float* dtable, const float* dout, const int32_t* ids, int64_t lo, int64_t rows, int64_t N,
                              int64_t C) {
  if (N <= 0 || C <= 0) return;
  if (rows <= 0) return;
  embed_backward(dtable, dout, ids, lo, rows, N, C, "vocab_embedding_backward");
}
void position_add_rows(float* x, const float* pos, int64_t R, int64_t T, int64_t row0, int64_t C) {
  if (R <= 0 || C <= 0) return;
  MT_LAUNCH(pos_add_rows_k, grid_for(R * C, kThreads), kThreads, 0, stream())(x, pos, R, T, row0, C);
  check_launch("position_add_rows");
}

void softmax_cross_entropy(float* logits, float* losses, const int32_t* targets, int64_t N, int64_t V, int64_t Vp,
                           float dloss) {
  check_vocab(V, Vp, "softmax_cross_entropy");
  if (N <= 0) return;
  void (*const k)(float*, float*, const int32_t*, int64_t, int64_t, float) = ce_k<true, float>;
  MT_LAUNCH(k, static_cast<unsigned>(N), kThreads, 0, stream())(logits, losses, targets, V, Vp, dloss);
  check_launch("softmax_cross_entropy");
}
void softmax_cross_entropy_bf16(float* logits, float* losses, const int32_t* targets, int64_t N, int64_t V, int64_t Vp,
                                float dloss) {
  softmax_cross_entropy(logits, losses, targets, N, V, Vp, dloss);
  if (N <= 0) return;
  MT_LAUNCH(grad_rows_to_bf16_k, 1, kThreads, 0, stream())(logits, Vp, 0);
  for (int64_t lo = 1; lo < N; lo *= 2)
    MT_LAUNCH(grad_rows_to_bf16_k, static_cast<unsigned>(std::min(2 * lo, N) - lo), kThreads, 0, stream())(logits, Vp,
                                                                                                         lo);
  check_launch("softmax_cross_entropy_bf16");
}
void softmax_cross_entropy_forward(const float* logits, float* losses, const int32_t* targets, int64_t N, int64_t V,
                                   int64_t Vp) {
  check_vocab(V, Vp, "softmax_cross_entropy_forward");
  if (N <= 0) return;
  void (*const k)(float*, float*, const int32_t*, int64_t, int64_t, float) = ce_k<false, float>;
  MT_LAUNCH(k, static_cast<unsigned>(N), kThreads, 0, stream())(const_cast<float*>(logits), losses, targets, V, Vp,
                                                               0.0f);
  check_launch("softmax_cross_entropy_forward");
}
void softmax_cross_entropy_from_bf16(bf16* logits, float* losses, const int32_t* targets, int64_t N, int64_t V,
                                     int64_t Vp, bool train, float dloss) {
  check_vocab(V, Vp, "softmax_cross_entropy_from_bf16");
  if (N <= 0) return;
  uint16_t* x = reinterpret_cast<uint16_t*>(logits);
  void (*const k)(uint16_t*, float*, const int32_t*, int64_t, int64_t, float) =
      train ? ce_k<true, uint16_t> : ce_k<false, uint16_t>;
  MT_LAUNCH(k, static_cast<unsigned>(N), kThreads, 0, stream())(x, losses, targets, V, Vp, train ? dloss : 0.0f);
  check_launch("softmax_cross_entropy_from_bf16");
}
void vp_ce_rowmax(float* rowmax, const float* lg, int64_t N, int64_t Vl, int64_t valid) {
  if (N <= 0) return;
  MT_LAUNCH(vp_rowmax_k, static_cast<unsigned>(N), kThreads, 0, stream())(rowmax, lg, Vl, valid);
  check_launch("vp_ce_rowmax");
}
void vp_ce_stats(float* stats, const float* lg, const float* rowmax, const int32_t* targets, int64_t N, int64_t Vl,
                 int64_t valid, int64_t lo) {
  if (N <= 0) return;
  MT_LAUNCH(vp_stats_k, static_cast<unsigned>(N), kThreads, 0, stream())(stats, lg, rowmax, targets, N, Vl, valid, lo);
  check_launch("vp_ce_stats");
}
void vp_ce_finish(float* lg, float* losses, const float* rowmax, const float* stats, const int32_t* targets, int64_t N,
                  int64_t Vl, int64_t valid, int64_t lo, bool train, float dloss) {
  if (N <= 0) return;
  MT_LAUNCH(vp_finish_k, static_cast<unsigned>(N), kThreads, 0, stream())(lg, losses, rowmax, stats, targets, N, Vl,
                                                                          valid, lo, train, dloss);
  check_launch("vp_ce_finish");
}

void adamw_update(float* param, const float* grad, float* m, float* v, int64_t n, float lr, float beta1, float beta2,
                  float eps, float weight_decay, int64_t step, float grad_scale,
                  bf16* param_bf16) {
  if (n <= 0) return;
  // Bias corrections as the CPU computes them (double, then float).
  const double bc1 = 1.0 - std::pow(static_cast<double>(beta1), static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(static_cast<double>(beta2), static_cast<double>(step));
  MT_LAUNCH(adamw_k, grid_for(n, kThreads), kThreads, 0, stream())(param, grad, m, v, n, lr, beta1, beta2, eps,
                                                                   lr * weight_decay, static_cast<float>(1.0 / bc1),
                                                                   static_cast<float>(1.0 / bc2), grad_scale,
                                                                   reinterpret_cast<uint16_t*>(param_bf16));
  check_launch("adamw_update");
}

}  // namespace mt::kernels::cuda
