// Shared pieces of the CUDA kernels: the compute stream, error checks, launch shapes, bf16 bits.
// Kernels are launched with MT_LAUNCH and declare shared memory with MT_SHARED (launch.cuh), so that
// every .cu also compiles for the CPU emulator.
// Every kernel of the CUDA table runs on the device's one compute stream (runtime/cuda/cuda_device.h).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "kernels/cuda/launch.cuh"
#include "runtime/cuda/cuda_device.h"
#include "runtime/dtype.h"

namespace mt::kernels::cuda {

inline cudaStream_t stream() { return static_cast<cudaStream_t>(mt::cuda::stream()); }

// After a launch: configuration errors surface at once (execution errors surface at the next
// synchronising call, which checks too).
inline void check_launch(const char* kernel) { mt::cuda::check(static_cast<int>(cudaGetLastError()), kernel); }

// for (i = this thread's first index; i < n; i += every thread of the grid): one element per
// thread and step.
#define MT_GRID_STRIDE(i, n) \
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < (n); \
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)

inline unsigned grid_for(int64_t n, int threads, int64_t max_blocks = 65535LL * 16) {
  int64_t b = (n + threads - 1) / threads;
  if (b < 1) b = 1;
  if (b > max_blocks) b = max_blocks;
  return static_cast<unsigned>(b);
}

[[noreturn]] inline void not_implemented(const char* op) {
  throw std::runtime_error(std::string("meshtrain: kernel ") + op + " is not implemented on CUDA yet (docs/gpu.md)");
}

// bf16 as the engine stores it (runtime/dtype.h: the high 16 bits of an IEEE float), converted
// exactly as the CPU does (round to nearest even, NaN kept quiet).
__device__ __forceinline__ float bf16_bits_to_f32(uint16_t b) { return __uint_as_float(static_cast<uint32_t>(b) << 16); }
__device__ __forceinline__ uint16_t f32_to_bf16_bits(float f) {
  const uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// 16-byte accesses for elementwise kernels. A kernel that moves eight elements per step loads and
// stores them as two 16-byte accesses of fp32 (F4) or one of bf16 (H8), then the last n % 8 elements
// one by one; every element gets the arithmetic of the scalar form, so the results are bitwise the
// same. Use it only where every pointer is 16-byte aligned (aligned16).
struct alignas(16) F4 {
  float v[4];
};
struct alignas(16) H8 {
  uint16_t v[8];
};
struct P8 {  // eight fp32 values in registers
  float v[8];
};
__host__ __device__ inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }
template <class... P>
__host__ __device__ inline bool all_aligned16(const P*... p) {
  return (aligned16(p) && ...);
}
// Elements 8i .. 8i+7 of p.
__device__ __forceinline__ P8 load8(const float* p, int64_t i) {
  const F4 a = reinterpret_cast<const F4*>(p)[2 * i], b = reinterpret_cast<const F4*>(p)[2 * i + 1];
  P8 r;
  for (int k = 0; k < 4; ++k) r.v[k] = a.v[k], r.v[4 + k] = b.v[k];
  return r;
}
__device__ __forceinline__ P8 load8(const uint16_t* p, int64_t i) {
  const H8 h = reinterpret_cast<const H8*>(p)[i];
  P8 r;
  for (int k = 0; k < 8; ++k) r.v[k] = bf16_bits_to_f32(h.v[k]);
  return r;
}
__device__ __forceinline__ void store8(float* p, int64_t i, const P8& r) {
  F4 a, b;
  for (int k = 0; k < 4; ++k) a.v[k] = r.v[k], b.v[k] = r.v[4 + k];
  reinterpret_cast<F4*>(p)[2 * i] = a;
  reinterpret_cast<F4*>(p)[2 * i + 1] = b;
}
__device__ __forceinline__ void store8(uint16_t* p, int64_t i, const P8& r) {  // rounded to bf16
  H8 h;
  for (int k = 0; k < 8; ++k) h.v[k] = f32_to_bf16_bits(r.v[k]);
  reinterpret_cast<H8*>(p)[i] = h;
}

// An elementwise kernel over n elements: Body::vec(i) does elements 8i .. 8i+7 with 16-byte
// accesses (load8 / store8) and Body::one(j) element j; vec8_k<true> runs vec over the n / 8 full
// groups and one over the rest, vec8_k<false> runs one over everything (a pointer not 16-byte
// aligned). launch8 picks by `vec`.
template <bool kVec, class Body>
__global__ void vec8_k(Body b, int64_t n) {
  const int64_t n8 = kVec ? n / 8 : 0;
  MT_GRID_STRIDE(i, n8) b.vec(i);
  MT_GRID_STRIDE(t, n - 8 * n8) b.one(8 * n8 + t);
}
template <class Body>
void launch8(const char* what, const Body& b, int64_t n, bool vec, int threads = 256) {
  if (n <= 0) return;
  void (*const kvec)(Body, int64_t) = vec8_k<true, Body>;
  void (*const kone)(Body, int64_t) = vec8_k<false, Body>;
  if (vec)
    MT_LAUNCH(kvec, grid_for((n + 7) / 8, threads), threads, 0, stream())(b, n);
  else
    MT_LAUNCH(kone, grid_for(n, threads), threads, 0, stream())(b, n);
  check_launch(what);
}

// Block-wide sum of a float (blockDim.x a multiple of 32, at most 1024); every thread gets it.
__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ float block_sum(float v, float* shm /* >= 32 floats */) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  v = warp_sum(v);
  __syncthreads();  // shm may still be read from a previous call
  if (lane == 0) shm[warp] = v;
  __syncthreads();
  v = lane < nw ? shm[lane] : 0.0f;
  return warp_sum(v);
}
__device__ __forceinline__ float block_max(float v, float* shm) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) shm[warp] = v;
  __syncthreads();
  v = lane < nw ? shm[lane] : -INFINITY;
  return warp_max(v);
}
__device__ __forceinline__ double warp_sum_d(double v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Scratch device memory a kernel keeps between calls (grows, never shrinks; category Scratch).
void* scratch(int slot, size_t bytes);

// A device copy of a kernel's small host-memory argument (n elements of T) in scratch slot
// `slot`: the copy is queued on the compute stream, so work queued before it still sees the old
// contents, and the host array may be reused when this returns.
template <class T>
const T* upload(int slot, const T* host, int64_t n) {
  void* d = scratch(slot, static_cast<size_t>(n > 0 ? n : 1) * sizeof(T));
  if (n > 0) mt::cuda::copy_from_host(d, host, static_cast<size_t>(n) * sizeof(T));
  return static_cast<const T*>(d);
}

// One AdamW element update (contract: kernels/ops.def adamw_update; the CPU's cpu/adamw.h term for
// term), shared by the per-tensor and the multi-tensor kernels so both stay bitwise equal.
__device__ __forceinline__ void adamw_element(float* param, const float* grad, float* m, float* v, int64_t i, float lr,
                                              float beta1, float beta2, float eps, float lr_wd, float inv_bc1,
                                              float inv_bc2, float scale, uint16_t* param_bf16) {
  const float g = grad[i] * scale;
  const float mi = beta1 * m[i] + (1.0f - beta1) * g;
  const float vi = beta2 * v[i] + (1.0f - beta2) * g * g;
  m[i] = mi;
  v[i] = vi;
  const float den = sqrtf(vi * inv_bc2);
  const float p = param[i];
  const float np = p - (lr * ((mi * inv_bc1) / (den + eps)) + lr_wd * p);
  param[i] = np;
  if (param_bf16) param_bf16[i] = f32_to_bf16_bits(np);
}

}  // namespace mt::kernels::cuda
