// The device side of CUDA C++ for the emulator (emu.h): qualifiers, built-in variables,
// synchronising intrinsics, atomics and math intrinsics, as host C++. Included by the shim's
// cuda_runtime.h, as nvcc makes them visible in every .cu.
#pragma once
#include <math.h>

#include <bit>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "emu.h"

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __launch_bounds__(...)
#define __constant__
#define __align__(n) alignas(n)
// Shared memory is per block: declare it with MT_SHARED / MT_SHARED_DYNAMIC (kernels/cuda/launch.cuh).
#define __shared__ MT_EMU_declare_shared_memory_with_MT_SHARED_from_kernels_cuda_launch_cuh

#define threadIdx (::mt::emu::g_thread_idx)
#define blockIdx (::mt::emu::g_block_idx)
#define blockDim (::mt::emu::g_block_dim)
#define gridDim (::mt::emu::g_grid_dim)
constexpr int warpSize = 32;

// --- barriers ---
#define __syncthreads() ((void)::mt::emu::barrier(MT_EMU_SITE, ::mt::emu::BarrierKind::Plain, 0))
#define __syncthreads_count(p) ::mt::emu::barrier(MT_EMU_SITE, ::mt::emu::BarrierKind::Count, (p) ? 1 : 0)
#define __syncthreads_and(p) ::mt::emu::barrier(MT_EMU_SITE, ::mt::emu::BarrierKind::And, (p) ? 1 : 0)
#define __syncthreads_or(p) ::mt::emu::barrier(MT_EMU_SITE, ::mt::emu::BarrierKind::Or, (p) ? 1 : 0)
// Memory fences order nothing here: blocks run one at a time and threads switch only at the points above.
inline void __threadfence() {}
inline void __threadfence_block() {}
inline void __threadfence_system() {}

// --- warp operations ---
namespace mt::emu {
template <class T>
T shuffle(Site s, WarpOp op, const char* what, unsigned mask, T v, int arg, int width = 32) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>, "a shuffle moves at most 8 bytes");
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  bits = warp_op(s, op, what, mask, bits, arg, width);
  T r;
  std::memcpy(&r, &bits, sizeof(T));
  return r;
}
inline unsigned vote(Site s, WarpOp op, const char* what, unsigned mask, int pred) {
  return static_cast<unsigned>(warp_op(s, op, what, mask, pred ? 1u : 0u, 0, 32));
}
inline void syncwarp(Site s, unsigned mask = 0xffffffffu) { warp_op(s, WarpOp::Sync, "__syncwarp", mask, 0, 0, 32); }
template <class T>
T reduce(Site s, WarpOp op, const char* what, unsigned mask, T v) {
  static_assert(std::is_same_v<T, unsigned> || std::is_same_v<T, int>, "__reduce_*_sync takes unsigned or int");
  return static_cast<T>(warp_op(s, op, what, mask, static_cast<uint32_t>(v), 0, 32));
}
}  // namespace mt::emu

#define __shfl_sync(mask, ...) ::mt::emu::shuffle(MT_EMU_SITE, ::mt::emu::WarpOp::Idx, "__shfl_sync", mask, __VA_ARGS__)
#define __shfl_up_sync(mask, ...) \
  ::mt::emu::shuffle(MT_EMU_SITE, ::mt::emu::WarpOp::Up, "__shfl_up_sync", mask, __VA_ARGS__)
#define __shfl_down_sync(mask, ...) \
  ::mt::emu::shuffle(MT_EMU_SITE, ::mt::emu::WarpOp::Down, "__shfl_down_sync", mask, __VA_ARGS__)
#define __shfl_xor_sync(mask, ...) \
  ::mt::emu::shuffle(MT_EMU_SITE, ::mt::emu::WarpOp::Xor, "__shfl_xor_sync", mask, __VA_ARGS__)
#define __syncwarp(...) ::mt::emu::syncwarp(MT_EMU_SITE __VA_OPT__(, ) __VA_ARGS__)
#define __ballot_sync(mask, p) \
  ::mt::emu::vote(MT_EMU_SITE, ::mt::emu::WarpOp::Ballot, "__ballot_sync", mask, (p) ? 1 : 0)
#define __all_sync(mask, p) \
  static_cast<int>(::mt::emu::vote(MT_EMU_SITE, ::mt::emu::WarpOp::All, "__all_sync", mask, (p) ? 1 : 0))
#define __any_sync(mask, p) \
  static_cast<int>(::mt::emu::vote(MT_EMU_SITE, ::mt::emu::WarpOp::Any, "__any_sync", mask, (p) ? 1 : 0))
#define __activemask() (::mt::emu::active_mask())
#define __reduce_add_sync(mask, v) ::mt::emu::reduce(MT_EMU_SITE, ::mt::emu::WarpOp::AddU, "__reduce_add_sync", mask, v)
#define __reduce_min_sync(mask, v)                                                                                  \
  ::mt::emu::reduce(MT_EMU_SITE, std::is_signed_v<decltype(v)> ? ::mt::emu::WarpOp::MinI : ::mt::emu::WarpOp::MinU, \
                    "__reduce_min_sync", mask, v)
#define __reduce_max_sync(mask, v)                                                                                  \
  ::mt::emu::reduce(MT_EMU_SITE, std::is_signed_v<decltype(v)> ? ::mt::emu::WarpOp::MaxI : ::mt::emu::WarpOp::MaxU, \
                    "__reduce_max_sync", mask, v)

// --- atomics: indivisible by construction (one block at a time; no switch point inside) ---
template <class T>
concept EmuAtomicValue = std::is_same_v<T, int> || std::is_same_v<T, unsigned> ||
    std::is_same_v<T, unsigned long long> || std::is_same_v<T, float> || std::is_same_v<T, double>;
template <class T>
concept EmuAtomicInt = std::is_same_v<T, int> || std::is_same_v<T, unsigned> || std::is_same_v<T, unsigned long long>;
namespace mt::emu {
template <class T, class F>
T read_modify_write(T* p, F f) {
  const T old = *p;
  *p = f(old);
  return old;
}
}  // namespace mt::emu
template <EmuAtomicValue T>
T atomicAdd(T* p, std::type_identity_t<T> v) {
  return ::mt::emu::read_modify_write(p, [v](T o) { return static_cast<T>(o + v); });
}
template <EmuAtomicValue T>
T atomicExch(T* p, std::type_identity_t<T> v) {
  return ::mt::emu::read_modify_write(p, [v](T) { return v; });
}
template <EmuAtomicInt T>
T atomicSub(T* p, std::type_identity_t<T> v) {
  return ::mt::emu::read_modify_write(p, [v](T o) { return static_cast<T>(o - v); });
}
template <EmuAtomicInt T>
T atomicMax(T* p, std::type_identity_t<T> v) {
  return ::mt::emu::read_modify_write(p, [v](T o) { return o < v ? v : o; });
}
template <EmuAtomicInt T>
T atomicMin(T* p, std::type_identity_t<T> v) {
  return ::mt::emu::read_modify_write(p, [v](T o) { return v < o ? v : o; });
}
template <EmuAtomicInt T>
T atomicCAS(T* p, std::type_identity_t<T> compare, std::type_identity_t<T> v) {
  return ::mt::emu::read_modify_write(p, [compare, v](T o) { return o == compare ? v : o; });
}
template <EmuAtomicInt T>
T atomicAnd(T* p, std::type_identity_t<T> v) {
  return ::mt::emu::read_modify_write(p, [v](T o) { return static_cast<T>(o & v); });
}
template <EmuAtomicInt T>
T atomicOr(T* p, std::type_identity_t<T> v) {
  return ::mt::emu::read_modify_write(p, [v](T o) { return static_cast<T>(o | v); });
}
template <EmuAtomicInt T>
T atomicXor(T* p, std::type_identity_t<T> v) {
  return ::mt::emu::read_modify_write(p, [v](T o) { return static_cast<T>(o ^ v); });
}
inline unsigned atomicInc(unsigned* p, unsigned limit) {
  return ::mt::emu::read_modify_write(p, [limit](unsigned o) { return o >= limit ? 0u : o + 1u; });
}
inline unsigned atomicDec(unsigned* p, unsigned limit) {
  return ::mt::emu::read_modify_write(p, [limit](unsigned o) { return (o == 0u || o > limit) ? limit : o - 1u; });
}

// --- bit reinterpretation and integer intrinsics ---
inline float __int_as_float(int v) { return std::bit_cast<float>(v); }
inline int __float_as_int(float v) { return std::bit_cast<int>(v); }
inline float __uint_as_float(unsigned v) { return std::bit_cast<float>(v); }
inline unsigned __float_as_uint(float v) { return std::bit_cast<unsigned>(v); }
inline double __longlong_as_double(long long v) { return std::bit_cast<double>(v); }
inline long long __double_as_longlong(double v) { return std::bit_cast<long long>(v); }
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline int __popcll(unsigned long long v) { return __builtin_popcountll(v); }
inline int __clz(int v) { return v == 0 ? 32 : __builtin_clz(static_cast<unsigned>(v)); }
inline int __clzll(long long v) { return v == 0 ? 64 : __builtin_clzll(static_cast<unsigned long long>(v)); }
inline int __ffs(int v) { return __builtin_ffs(v); }
inline int __ffsll(long long v) { return __builtin_ffsll(v); }
inline unsigned __brev(unsigned v) {
  unsigned r = 0;
  for (int i = 0; i < 32; ++i) r |= ((v >> i) & 1u) << (31 - i);
  return r;
}

// --- math intrinsics: the fast ones are the accurate host functions here (GPU results differ by
// a few ulps; docs/gpu.md states the tolerances) ---
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline double rsqrt(double x) { return 1.0 / sqrt(x); }
inline float __expf(float x) { return expf(x); }
inline float __exp10f(float x) { return exp10f(x); }
inline float __logf(float x) { return logf(x); }
inline float __log2f(float x) { return log2f(x); }
inline float __log10f(float x) { return log10f(x); }
inline float __powf(float x, float y) { return powf(x, y); }
inline float __sinf(float x) { return sinf(x); }
inline float __cosf(float x) { return cosf(x); }
inline float __tanf(float x) { return tanf(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __saturatef(float x) { return x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : (x == x ? x : 0.0f)); }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return sqrtf(x); }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline double __fma_rn(double a, double b, double c) { return fma(a, b, c); }
// The _rn arithmetic intrinsics are never contracted into an FMA (as on the GPU): the empty asm
// hides the rounded product or sum from the optimiser.
template <class T>
inline T mt_emu_rounded(T v) {
#if defined(__x86_64__)
  __asm__("" : "+x"(v));
  return v;
#else
  volatile T r = v;
  return r;
#endif
}
inline float __fmul_rn(float a, float b) { return mt_emu_rounded(a * b); }
inline float __fadd_rn(float a, float b) { return mt_emu_rounded(a + b); }
inline float __fsub_rn(float a, float b) { return mt_emu_rounded(a - b); }
inline double __dmul_rn(double a, double b) { return mt_emu_rounded(a * b); }
inline double __dadd_rn(double a, double b) { return mt_emu_rounded(a + b); }
inline int __float2int_rn(float x) { return static_cast<int>(nearbyintf(x)); }
inline int __float2int_rz(float x) { return static_cast<int>(x); }
inline int __float2int_rd(float x) { return static_cast<int>(floorf(x)); }
inline int __float2int_ru(float x) { return static_cast<int>(ceilf(x)); }
inline float __int2float_rn(int x) { return static_cast<float>(x); }
template <class T>
inline T __ldg(const T* p) {
  return *p;
}
