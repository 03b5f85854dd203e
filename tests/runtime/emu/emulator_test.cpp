// The CUDA emulator itself (runtime/cuda/emu, the -DMESHTRAIN_CUDA=EMU build): built-in variables,
// per-block shared memory, warp intrinsics, atomics and launch errors against hand-computed
// results; kernels written to be wrong (a missing barrier that a schedule exposes, a divergent
// barrier, a shuffle with a missing lane, a full mask in a partial warp, a host pointer, an
// out-of-bounds write that AddressSanitizer reports with its line); and the cuBLASLt stand-in
// against a double-precision reference, with its refusals.
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels/cuda/launch.cuh"

namespace {

using mt::emu::Schedule;

// Device memory for n values of T, filled from / read back into host vectors.
template <class T>
struct Dev {
  T* p = nullptr;
  size_t n;
  explicit Dev(size_t count) : n(count) { EXPECT_EQ(cudaMalloc(&p, n * sizeof(T)), cudaSuccess); }
  explicit Dev(const std::vector<T>& h) : Dev(h.size()) { set(h); }
  ~Dev() { cudaFree(p); }
  void set(const std::vector<T>& h) {
    EXPECT_EQ(cudaMemcpy(p, h.data(), n * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  }
  std::vector<T> get() const {
    std::vector<T> h(n);
    EXPECT_EQ(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return h;
  }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
};

// Runs f under one schedule, then restores the default.
template <class F>
void with_schedule(Schedule s, uint64_t seed, F&& f) {
  const Schedule s0 = mt::emu::schedule();
  const uint64_t seed0 = mt::emu::schedule_seed();
  mt::emu::set_schedule(s, seed);
  f();
  mt::emu::set_schedule(s0, seed0);
}
const Schedule kSchedules[] = {Schedule::Forward, Schedule::Reverse, Schedule::Random};

// --- built-in variables and shared memory ---
__global__ void builtins_k(unsigned* out) {
  const unsigned b = blockIdx.x + gridDim.x * blockIdx.y;
  const unsigned t = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  unsigned* o = out + 4 * (b * blockDim.x * blockDim.y * blockDim.z + t);
  o[0] = b;
  o[1] = t;
  o[2] = blockDim.x * 100 + blockDim.y * 10 + blockDim.z;
  o[3] = gridDim.x * 10 + gridDim.y;
}

// first[b]: what thread 0 of block b reads from shared memory before anything was written there;
// sum[b]: the block's sum of (blockIdx.x + threadIdx.x) through shared memory.
__global__ void shared_k(float* first, float* sum) {
  MT_SHARED(tile, float[64]);
  if (threadIdx.x == 0) first[blockIdx.x] = tile[5];
  __syncthreads();
  tile[threadIdx.x] = static_cast<float>(blockIdx.x + threadIdx.x);
  __syncthreads();
  if (threadIdx.x == 0) {
    float s = 0.0f;
    for (int i = 0; i < 64; ++i) s += tile[i];
    sum[blockIdx.x] = s;
  }
}

TEST(Emulator, BuiltinVariablesAndPerBlockSharedMemory) {
  Dev<unsigned> out(4 * 6 * 24);
  MT_LAUNCH(builtins_k, dim3(3, 2), dim3(4, 3, 2), 0, nullptr)(out.p);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  const auto o = out.get();
  for (unsigned b = 0; b < 6; ++b)
    for (unsigned t = 0; t < 24; ++t) {
      const unsigned* r = &o[4 * (b * 24 + t)];
      EXPECT_EQ(r[0], b);
      EXPECT_EQ(r[1], t);
      EXPECT_EQ(r[2], 432u);
      EXPECT_EQ(r[3], 32u);
    }
  for (Schedule s : kSchedules)
    with_schedule(s, 3, [] {
      Dev<float> first(5), sum(5);
      MT_LAUNCH(shared_k, 5, 64, 0, nullptr)(first.p, sum.p);
      const auto f = first.get(), sm = sum.get();
      for (int b = 0; b < 5; ++b) {
        EXPECT_TRUE(std::isnan(f[b])) << "block " << b << " saw another block's shared memory: " << f[b];
        EXPECT_EQ(sm[b], static_cast<float>(64 * b + 63 * 64 / 2)) << "block " << b;
      }
    });
}

// --- warp intrinsics and barriers with values ---
__global__ void warp_k(int* out) {
  const int t = static_cast<int>(threadIdx.x), lane = t & 31;
  int* o = out + 16 * t;
  o[0] = __shfl_sync(0xffffffffu, t * 10, 3);   // lane 3 of the warp
  o[1] = __shfl_up_sync(0xffffffffu, t, 2, 8);  // lane - 2 inside groups of 8, else own
  o[2] = __shfl_down_sync(0xffffffffu, t, 3);   // lane + 3, else own
  o[3] = __shfl_xor_sync(0xffffffffu, t, 5);    // lane ^ 5
  o[4] = static_cast<int>(__ballot_sync(0xffffffffu, lane % 3 == 0));
  o[5] = __all_sync(0xffffffffu, t >= 0);
  o[6] = __any_sync(0xffffffffu, lane == 31 && t > 32);
  o[7] = static_cast<int>(__reduce_add_sync(0xffffffffu, static_cast<unsigned>(lane)));
  o[8] = __reduce_min_sync(0xffffffffu, 100 - t);
  o[9] = __reduce_max_sync(0xffffffffu, t - 40);
  o[10] = __syncthreads_count(t % 4 == 1);
  o[11] = __syncthreads_and(t < 1000);
  o[12] = __syncthreads_or(t == 17);
  o[13] = static_cast<int>(__activemask());
  if (lane < 16) o[14] = __shfl_xor_sync(0x0000ffffu, t, 1);  // a half-warp mask
  else o[14] = __shfl_xor_sync(0xffff0000u, t, 1);
  __syncwarp();
  const double d = __shfl_sync(0xffffffffu, 0.5 + t, 0);  // 8 bytes
  o[15] = static_cast<int>(d * 2.0);
}

TEST(Emulator, WarpIntrinsicsAndCountingBarriers) {
  for (Schedule s : kSchedules)
    with_schedule(s, 5, [] {
      const int n = 64;
      Dev<int> out(16 * n);
      MT_LAUNCH(warp_k, 1, n, 0, nullptr)(out.p);
      const auto o = out.get();
      for (int t = 0; t < n; ++t) {
        const int lane = t & 31, w = t - lane;
        const int* r = &o[16 * t];
        EXPECT_EQ(r[0], (w + 3) * 10) << t;
        EXPECT_EQ(r[1], (lane % 8) >= 2 ? t - 2 : t) << t;
        EXPECT_EQ(r[2], lane + 3 < 32 ? t + 3 : t) << t;
        EXPECT_EQ(r[3], w + (lane ^ 5)) << t;
        EXPECT_EQ(static_cast<unsigned>(r[4]), 0x49249249u) << t;
        EXPECT_EQ(r[5], 1) << t;
        EXPECT_EQ(r[6], w == 32 ? 1 : 0) << t;
        EXPECT_EQ(r[7], 31 * 32 / 2) << t;
        EXPECT_EQ(r[8], 100 - (w + 31)) << t;
        EXPECT_EQ(r[9], w + 31 - 40) << t;
        EXPECT_EQ(r[10], 16) << t;
        EXPECT_EQ(r[11], 1) << t;
        EXPECT_EQ(r[12], 1) << t;
        EXPECT_EQ(static_cast<unsigned>(r[13]), 0xffffffffu) << t;
        EXPECT_EQ(r[14], t ^ 1) << t;
        EXPECT_EQ(r[15], 2 * w + 1) << t;
      }
    });
}

// --- atomics, dynamic shared memory, launch errors ---
__global__ void atomic_k(unsigned* count, float* total, int* maxv) {
  MT_SHARED_DYNAMIC(dyn, int);
  dyn[threadIdx.x] = static_cast<int>(threadIdx.x);
  __syncthreads();
  atomicAdd(count, 1u);
  atomicAdd(total, 0.5f);
  atomicMax(maxv, dyn[blockDim.x - 1 - threadIdx.x] + static_cast<int>(blockIdx.x));
}
__global__ void big_dynamic_k(int* out) {
  MT_SHARED_DYNAMIC(dyn, int);
  dyn[threadIdx.x * 1000] = 7;
  out[threadIdx.x] = dyn[threadIdx.x * 1000];
}

TEST(Emulator, AtomicsDynamicSharedMemoryAndLaunchErrors) {
  Dev<unsigned> count(std::vector<unsigned>{0});
  Dev<float> total(std::vector<float>{0.0f});
  Dev<int> maxv(std::vector<int>{-1});
  MT_LAUNCH(atomic_k, 7, 96, 96 * sizeof(int), nullptr)(count.p, total.p, maxv.p);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_EQ(count.get()[0], 7u * 96u);
  EXPECT_EQ(total.get()[0], 7 * 96 * 0.5f);
  EXPECT_EQ(maxv.get()[0], 95 + 6);

  // Past 48 KiB of dynamic shared memory only after cudaFuncSetAttribute, as on the GPU.
  Dev<int> out(std::vector<int>(16, 0));
  const size_t big = 16 * 1000 * sizeof(int);
  MT_LAUNCH(big_dynamic_k, 1, 16, big, nullptr)(out.p);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidValue);
  EXPECT_EQ(out.get()[3], 0) << "a launch that failed ran";
  ASSERT_EQ(cudaFuncSetAttribute(big_dynamic_k, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(big)),
            cudaSuccess);
  MT_LAUNCH(big_dynamic_k, 1, 16, big, nullptr)(out.p);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_EQ(out.get()[3], 7);

  MT_LAUNCH(builtins_k, 1, 1025, 0, nullptr)(nullptr);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration) << "1025 threads per block";
  MT_LAUNCH(builtins_k, 0, 32, 0, nullptr)(nullptr);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration) << "an empty grid";
  EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "cudaGetLastError clears the error";
}

TEST(Emulator, DeviceMemoryIsNaNFilledAndCopiesAreChecked) {
  Dev<float> d(10);
  for (float v : d.get()) EXPECT_TRUE(std::isnan(v));
  std::vector<float> h(10, 1.0f);
  EXPECT_EQ(cudaMemcpy(h.data(), h.data(), 40, cudaMemcpyHostToDevice), cudaErrorInvalidValue) << "host destination";
  EXPECT_EQ(cudaMemcpy(d.p, h.data(), 44, cudaMemcpyHostToDevice), cudaErrorInvalidValue) << "past the allocation";
  EXPECT_EQ(cudaMemcpy(h.data(), d.p, 40, cudaMemcpyDeviceToDevice), cudaErrorInvalidValue) << "host as device";
  EXPECT_EQ(cudaMemset(d.p + 1, 0, 40), cudaErrorInvalidValue) << "memset past the allocation";
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidValue);
  int n = 0;
  EXPECT_EQ(cudaGetDeviceCount(&n), cudaSuccess);
  EXPECT_EQ(n, 1);
  cudaDeviceProp prop{};
  ASSERT_EQ(cudaGetDeviceProperties(&prop, 0), cudaSuccess);
  EXPECT_NE(std::string(prop.name).find("emulator"), std::string::npos) << prop.name;
}

TEST(Emulator, StreamsAndEventsAreCheckedHandles) {
  cudaStream_t st = nullptr;
  cudaEvent_t a = nullptr, b = nullptr, untimed = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaEventCreate(&a), cudaSuccess);
  ASSERT_EQ(cudaEventCreate(&b), cudaSuccess);
  ASSERT_EQ(cudaEventCreateWithFlags(&untimed, cudaEventDisableTiming), cudaSuccess);
  float ms = -1.0f;
  EXPECT_EQ(cudaEventElapsedTime(&ms, a, b), cudaErrorNotReady) << "before either was recorded";
  Dev<unsigned> out(64);
  EXPECT_EQ(cudaEventRecord(a, st), cudaSuccess);
  MT_LAUNCH(builtins_k, 1, 16, 0, st)(out.p);
  EXPECT_EQ(cudaEventRecord(b, st), cudaSuccess);
  EXPECT_EQ(cudaStreamWaitEvent(st, b), cudaSuccess);
  EXPECT_EQ(cudaStreamSynchronize(st), cudaSuccess);
  EXPECT_EQ(cudaEventElapsedTime(&ms, a, b), cudaSuccess);
  EXPECT_GE(ms, 0.0f);
  EXPECT_EQ(cudaEventRecord(untimed, st), cudaSuccess);
  EXPECT_EQ(cudaEventElapsedTime(&ms, a, untimed), cudaErrorInvalidResourceHandle) << "timing disabled";
  EXPECT_EQ(cudaStreamDestroy(st), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(st), cudaErrorInvalidResourceHandle) << "destroyed twice";
  EXPECT_EQ(cudaStreamSynchronize(st), cudaErrorInvalidResourceHandle);
  MT_LAUNCH(builtins_k, 1, 16, 0, st)(out.p);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidResourceHandle) << "a launch on a destroyed stream";
  for (cudaEvent_t e : {a, b, untimed}) EXPECT_EQ(cudaEventDestroy(e), cudaSuccess);
  EXPECT_EQ(cudaEventDestroy(a), cudaErrorInvalidResourceHandle);
}

// --- the order in which threads and blocks run (no switch point: each thread runs to its end) ---
__global__ void order_k(unsigned* counter, unsigned* out) {
  out[blockIdx.x * blockDim.x + threadIdx.x] = atomicAdd(counter, 1u);
}
std::vector<unsigned> run_order(Schedule s, uint64_t seed) {
  std::vector<unsigned> o;
  with_schedule(s, seed, [&] {
    Dev<unsigned> counter(std::vector<unsigned>{0}), out(256);
    MT_LAUNCH(order_k, 4, 64, 0, nullptr)(counter.p, out.p);
    o = out.get();
  });
  return o;
}

TEST(Emulator, SchedulesOrderThreadsAndBlocks) {
  const auto fwd = run_order(Schedule::Forward, 1), rev = run_order(Schedule::Reverse, 1);
  const auto r5 = run_order(Schedule::Random, 5), r5b = run_order(Schedule::Random, 5),
             r6 = run_order(Schedule::Random, 6);
  for (unsigned i = 0; i < 256; ++i) {
    EXPECT_EQ(fwd[i], i);
    EXPECT_EQ(rev[i], 255 - i);
  }
  EXPECT_EQ(r5, r5b) << "the same seed gives the same order";
  EXPECT_NE(r5, r6) << "another seed gives another order";
  EXPECT_NE(r5, fwd);
  EXPECT_NE(r5, rev);
  for (unsigned b = 0; b < 4; ++b) {  // blocks run one at a time: each takes 64 consecutive turns
    const auto lo = std::min_element(r5.begin() + 64 * b, r5.begin() + 64 * (b + 1));
    const auto hi = std::max_element(r5.begin() + 64 * b, r5.begin() + 64 * (b + 1));
    EXPECT_EQ(*hi - *lo, 63u) << "block " << b;
    EXPECT_EQ(*lo % 64, 0u) << "block " << b;
    EXPECT_FALSE(std::is_sorted(r5.begin() + 64 * b, r5.begin() + 64 * (b + 1)))
        << "threads in index order, block " << b;
  }
}

// --- a missing barrier: each thread publishes a value and reads its neighbour's (its own at the ends) ---
template <bool kBarrier, int kNeighbour>
__global__ void neighbour_k(int* out) {
  MT_SHARED(v, int[64]);
  const int t = static_cast<int>(threadIdx.x), u = t + kNeighbour;
  v[t] = t + 1;
  if (kBarrier) __syncthreads();
  out[t] = v[u >= 0 && u < 64 ? u : t];
}
template <bool kBarrier, int kNeighbour>
bool neighbour_right() {
  Dev<int> out(64);
  MT_LAUNCH((neighbour_k<kBarrier, kNeighbour>), 1, 64, 0, nullptr)(out.p);
  const auto o = out.get();
  for (int t = 0; t < 64; ++t) {
    const int u = t + kNeighbour;
    if (o[t] != (u >= 0 && u < 64 ? u : t) + 1) return false;
  }
  return true;
}

TEST(Emulator, SchedulesExposeAMissingBarrier) {
  bool next_wrong = false, prev_wrong = false, random_wrong = false;
  for (Schedule s : kSchedules)
    with_schedule(s, 11, [&] {
      EXPECT_TRUE((neighbour_right<true, 1>())) << mt::emu::schedule_name(s);
      EXPECT_TRUE((neighbour_right<true, -1>())) << mt::emu::schedule_name(s);
      const bool n = !neighbour_right<false, 1>(), p = !neighbour_right<false, -1>();
      next_wrong |= n;
      prev_wrong |= p;
      if (s == Schedule::Random) random_wrong = n || p;
      if (s == Schedule::Forward) {  // thread t runs after t - 1 and before t + 1
        EXPECT_TRUE(n && !p) << "forward";
      }
      if (s == Schedule::Reverse) {  // thread t runs after t + 1 and before t - 1
        EXPECT_TRUE(p && !n) << "reverse";
      }
    });
  EXPECT_TRUE(next_wrong && prev_wrong && random_wrong);
}

// --- misuse the emulator reports ---
__global__ void divergent_barrier_k(int* out) {
  if (threadIdx.x < 16) __syncthreads();
  out[threadIdx.x] = 1;
}
__global__ void two_barriers_k(int* out) {
  if (threadIdx.x < 32) __syncthreads();
  else __syncthreads();
  out[threadIdx.x] = 1;
}
__global__ void missing_lane_k(int* out) {
  int v = static_cast<int>(threadIdx.x);
  if (threadIdx.x != 5) v = __shfl_xor_sync(0xffffffffu, v, 1);
  out[threadIdx.x] = v;
}
__global__ void two_shuffles_k(int* out) {
  int v = static_cast<int>(threadIdx.x);
  if (threadIdx.x < 16) v = __shfl_xor_sync(0xffffffffu, v, 1);
  else v = __shfl_xor_sync(0xffffffffu, v, 2);
  out[threadIdx.x] = v;
}
__global__ void lane_at_barrier_k(int* out) {
  int v = static_cast<int>(threadIdx.x);
  if (threadIdx.x == 5) __syncthreads();
  else v = __shfl_xor_sync(0xffffffffu, v, 1);
  out[threadIdx.x] = v;
}
__global__ void full_mask_partial_warp_k(float* out) {
  float v = 1.0f;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  out[threadIdx.x] = v;
}

TEST(EmulatorDeathTest, ReportsMisuseWithTheKernelAndLine) {
  Dev<int> out(64);
  Dev<float> fout(64);
  EXPECT_DEATH(
      MT_LAUNCH(divergent_barrier_k, 1, 64, 0, nullptr)(out.p),
      "kernel divergent_barrier_k.*__syncthreads at .*emulator_test.cpp:[0-9]+ reached by 16 of 64 threads.*exited");
  EXPECT_DEATH(MT_LAUNCH(two_barriers_k, 1, 64, 0, nullptr)(out.p), "kernel two_barriers_k.*different barriers");
  EXPECT_DEATH(MT_LAUNCH(missing_lane_k, 1, 32, 0, nullptr)(out.p),
               "kernel missing_lane_k.*__shfl_xor_sync at .*emulator_test.cpp:[0-9]+.*lane(s)? 5.*exited");
  EXPECT_DEATH(MT_LAUNCH(two_shuffles_k, 1, 32, 0, nullptr)(out.p),
               "lanes of warp 0 meet at different warp operations");
  EXPECT_DEATH(MT_LAUNCH(lane_at_barrier_k, 1, 32, 0, nullptr)(out.p),
               "reached by 1 of 32 threads; 31 wait at __shfl_xor_sync at .*emulator_test.cpp:[0-9]+");
  EXPECT_DEATH(MT_LAUNCH(full_mask_partial_warp_k, 1, 40, 0, nullptr)(fout.p),
               "kernel full_mask_partial_warp_k.*names lanes 8-31, which do not exist");
  std::vector<float> host(64);
  EXPECT_DEATH(MT_LAUNCH(full_mask_partial_warp_k, 1, 32, 0, nullptr)(host.data()),
               "kernel full_mask_partial_warp_k: argument 0 .* is not device memory");
}

// --- out of bounds, caught by AddressSanitizer with the line ---
#if defined(__SANITIZE_ADDRESS__)
__global__ void off_by_one_k(float* out, int n) {
  for (int i = static_cast<int>(threadIdx.x); i <= n; i += static_cast<int>(blockDim.x)) out[i] = 1.0f;
}
__global__ void shared_overrun_k(float* out) {
  MT_SHARED(tile, float[32]);
  tile[threadIdx.x] = 1.0f;  // 33 threads
  __syncthreads();
  out[threadIdx.x] = tile[0];
}

TEST(EmulatorDeathTest, AddressSanitizerReportsOutOfBoundsAccessesWithTheLine) {
  Dev<float> out(100);
  EXPECT_DEATH(MT_LAUNCH(off_by_one_k, 1, 64, 0, nullptr)(out.p, 100),
               "heap-buffer-overflow.*emulator_test.cpp:[0-9]+");
  Dev<float> out33(33);
  EXPECT_DEATH(MT_LAUNCH(shared_overrun_k, 1, 33, 0, nullptr)(out33.p),
               "heap-buffer-overflow.*emulator_test.cpp:[0-9]+");
  // A block of the caching allocator lent for fewer bytes than it holds: the rest is out of bounds.
  float* p = nullptr;
  ASSERT_EQ(cudaMalloc(&p, 512), cudaSuccess);
  mt::emu::device_lend(p, 100 * sizeof(float), 512);
  EXPECT_DEATH(MT_LAUNCH(off_by_one_k, 1, 64, 0, nullptr)(p, 100), "use-after-poison.*emulator_test.cpp:[0-9]+");
  mt::emu::device_return(p, 512);
  EXPECT_DEATH(MT_LAUNCH(off_by_one_k, 1, 64, 0, nullptr)(p, 10), "use-after-poison");
  cudaFree(p);
}
#else
TEST(EmulatorDeathTest, AddressSanitizerReportsOutOfBoundsAccessesWithTheLine) {
  GTEST_SKIP() << "needs the AddressSanitizer build (-DMESHTRAIN_EMU_ASAN=ON)";
}
#endif

}  // namespace
