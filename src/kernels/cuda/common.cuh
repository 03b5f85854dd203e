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
