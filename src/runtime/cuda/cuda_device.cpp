#include "runtime/cuda/cuda_device.h"
#include "runtime/device_mem_info.h"

#include "runtime/cuda/copy_stream.h"

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>

#include "runtime/block_cache.h"

#ifdef MT_CUDA_EMU
#include "emu.h"  // runtime/cuda/emu: exact-size, NaN-filled views of the cached blocks
#endif

namespace mt::cuda {

void check(int err, const char* what) {
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("meshtrain: cuda: ") + what + ": " +
                             cudaGetErrorString(static_cast<cudaError_t>(err)));
}

const std::string& unavailable_reason() {
  static const std::string why = [] {
    int n = 0;
    const cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess)
      return std::string("no usable CUDA device: cudaGetDeviceCount failed (") + cudaGetErrorString(e) +
             "); is an NVIDIA driver installed and a GPU visible (CUDA_VISIBLE_DEVICES)?";
    if (n == 0) return std::string("no CUDA device is present (cudaGetDeviceCount found 0 GPUs)");
    return std::string();
  }();
  return why;
}

void require() {
  if (!unavailable_reason().empty()) throw std::runtime_error("meshtrain: device cuda: " + unavailable_reason());
}

namespace {
struct State {
  std::mutex mu;
  cudaStream_t stream = nullptr;
  MemoryTracker tracker;
  BlockCache cache{"cuda allocator",
                   [](size_t bytes) -> void* {
                     void* p = nullptr;
                     const cudaError_t e = cudaMalloc(&p, bytes);
                     if (e == cudaErrorMemoryAllocation) {
                       (void)cudaGetLastError();  // clear the sticky-free error so a retry can succeed
                       return nullptr;
                     }
                     check(e, "cudaMalloc");
                     return p;
                   },
                   [](void* p) { check(cudaFree(p), "cudaFree"); }};
  State() {
    require();
    check(cudaSetDevice(0), "cudaSetDevice");
    check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    // A block another stream used (the copy stream's copies) is reused once that stream has passed
    // an event recorded when the block was freed.
    cache.set_event_ops(BlockCache::EventOps{
        [](void* st) -> void* {
          cudaEvent_t e = nullptr;
          check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreateWithFlags (allocator)");
          check(cudaEventRecord(e, static_cast<cudaStream_t>(st)), "cudaEventRecord (allocator)");
          return e;
        },
        [](void* e) {
          const cudaError_t r = cudaEventQuery(static_cast<cudaEvent_t>(e));
          if (r == cudaErrorNotReady) {
            (void)cudaGetLastError();
            return false;
          }
          check(r, "cudaEventQuery (allocator)");
          return true;
        },
        [](void* e) { check(cudaEventDestroy(static_cast<cudaEvent_t>(e)), "cudaEventDestroy (allocator)"); }});
  }
};
std::atomic<uint64_t> g_host_syncs{0};
State& state() {
  static State* s = new State();  // never destroyed: tensors may outlive static teardown
  return *s;
}
cudaStream_t st() { return state().stream; }
}  // namespace

void* alloc(size_t bytes, MemCategory c) {
  State& s = state();
  void* p = nullptr;
  {
    std::lock_guard<std::mutex> lk(s.mu);
    p = s.cache.take(bytes, s.stream);
    s.tracker.set_pool(s.cache.cached_bytes(), s.cache.reserved_bytes());
  }
#ifdef MT_CUDA_EMU
  mt::emu::device_lend(p, bytes, BlockCache::size_class(bytes));
#endif
  s.tracker.on_alloc(c, static_cast<int64_t>(bytes));
  return p;
}

void free(void* p, size_t bytes, MemCategory c) {
  if (!p) return;
  State& s = state();
  {
    std::lock_guard<std::mutex> lk(s.mu);
    s.cache.give(p, bytes);
#ifdef MT_CUDA_EMU
    mt::emu::device_return(p, BlockCache::size_class(bytes));
#endif
    s.tracker.set_pool(s.cache.cached_bytes(), s.cache.reserved_bytes());
  }
  s.tracker.on_free(c, static_cast<int64_t>(bytes));
}

MemoryTracker& tracker() { return state().tracker; }

int64_t free_bytes() {
  require();
  size_t free_b = 0, total_b = 0;
  check(cudaMemGetInfo(&free_b, &total_b), "cudaMemGetInfo");
  return static_cast<int64_t>(free_b);
}

void release_cache() {
  State& s = state();
  ++g_host_syncs;
  check(cudaStreamSynchronize(s.stream), "cudaStreamSynchronize");
  std::lock_guard<std::mutex> lk(s.mu);
  s.cache.release();
  s.tracker.set_pool(s.cache.cached_bytes(), s.cache.reserved_bytes());
}

void* stream() { return st(); }
void synchronize() {
  ++g_host_syncs;
  check(cudaStreamSynchronize(st()), "cudaStreamSynchronize");
}

uint64_t host_syncs() { return g_host_syncs.load(std::memory_order_relaxed); }

void zero(void* p, size_t bytes) {
  if (bytes) check(cudaMemsetAsync(p, 0, bytes, st()), "cudaMemsetAsync");
}
void copy(void* dst, const void* src, size_t bytes) {
  if (bytes && dst != src) check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, st()), "cudaMemcpyAsync D2D");
}
void copy_from_host(void* dst, const void* host_src, size_t bytes) {
  if (!bytes) return;
  check(cudaMemcpyAsync(dst, host_src, bytes, cudaMemcpyHostToDevice, st()), "cudaMemcpyAsync H2D");
  synchronize();  // the host buffer may be reused (or freed) when this returns, pinned or not
}
void copy_to_host(void* host_dst, const void* src, size_t bytes) {
  if (!bytes) return;
  check(cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDeviceToHost, st()), "cudaMemcpyAsync D2H");
  synchronize();
}

void copy_from_host_async(void* dst, const void* host_src, size_t bytes) {
  if (bytes) check(cudaMemcpyAsync(dst, host_src, bytes, cudaMemcpyHostToDevice, st()), "cudaMemcpyAsync H2D");
}
namespace {
struct CopyStream {
  cudaStream_t stream = nullptr;
  cudaEvent_t ready = nullptr;     // recorded on the compute stream before each device-to-host copy
  cudaEvent_t uploaded = nullptr;  // recorded on the copy stream after the uploads (uploads_ready)
  CopyStream() {
    check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags (copy stream)");
    check(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    check(cudaEventCreateWithFlags(&uploaded, cudaEventDisableTiming), "cudaEventCreateWithFlags");
  }
};
CopyStream& copies() {
  static CopyStream* c = new CopyStream();  // never destroyed, like the compute stream
  return *c;
}
// The block holding p (device memory of this allocator) is also used by the copy stream: when it
// is freed, it is not handed out again before the copy stream has passed the copies queued so far.
void used_by_copy_stream(const void* p) {
  State& s = state();
  std::lock_guard<std::mutex> lk(s.mu);
  s.cache.record_use(p, copies().stream);
}
}  // namespace

void* copy_stream() { return copies().stream; }

void copy_to_host_async(void* host_dst, const void* src, size_t bytes) {
  if (!bytes) return;
  CopyStream& c = copies();
  used_by_copy_stream(src);
  // cudaStreamWaitEvent waits for the event's latest record at the time of the call, so one event
  // serves every copy.
  check(cudaEventRecord(c.ready, st()), "cudaEventRecord");
  check(cudaStreamWaitEvent(c.stream, c.ready, 0), "cudaStreamWaitEvent");
  check(cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDeviceToHost, c.stream), "cudaMemcpyAsync D2H (copy stream)");
}
void upload_async(void* dst, const void* host_src, size_t bytes) {
  if (!bytes) return;
  CopyStream& c = copies();
  used_by_copy_stream(dst);
  check(cudaMemcpyAsync(dst, host_src, bytes, cudaMemcpyHostToDevice, c.stream), "cudaMemcpyAsync H2D (copy stream)");
}
void uploads_ready() {
  CopyStream& c = copies();
  check(cudaEventRecord(c.uploaded, c.stream), "cudaEventRecord (uploads)");
  check(cudaStreamWaitEvent(st(), c.uploaded, 0), "cudaStreamWaitEvent (uploads)");
}
void wait_copies() {
  ++g_host_syncs;
  check(cudaStreamSynchronize(copies().stream), "cudaStreamSynchronize (copy stream)");
}

void* host_alloc_pinned(size_t bytes) {
  require();
  void* p = nullptr;
  check(cudaMallocHost(&p, bytes), "cudaMallocHost");
  return p;
}
void host_free_pinned(void* p) {
  if (p) check(cudaFreeHost(p), "cudaFreeHost");
}

double time_ms(const std::function<void()>& f) {
  cudaEvent_t a = nullptr, b = nullptr;
  check(cudaEventCreate(&a), "cudaEventCreate");
  check(cudaEventCreate(&b), "cudaEventCreate");
  float ms = 0;
  try {
    check(cudaEventRecord(a, st()), "cudaEventRecord");
    f();
    check(cudaEventRecord(b, st()), "cudaEventRecord");
    ++g_host_syncs;
    check(cudaEventSynchronize(b), "cudaEventSynchronize");
    check(cudaEventElapsedTime(&ms, a, b), "cudaEventElapsedTime");
  } catch (...) {
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    throw;
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return ms;
}

std::string describe() {
  require();
  cudaDeviceProp p{};
  int dev = 0, drv = 0, rt = 0;
  check(cudaGetDevice(&dev), "cudaGetDevice");
  check(cudaGetDeviceProperties(&p, dev), "cudaGetDeviceProperties");
  check(cudaDriverGetVersion(&drv), "cudaDriverGetVersion");
  check(cudaRuntimeGetVersion(&rt), "cudaRuntimeGetVersion");
  auto ver = [](int v) { return std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10); };
  return std::string("cuda ") + p.name + " (sm_" + std::to_string(p.major) + std::to_string(p.minor) + ", " +
         std::to_string(p.multiProcessorCount) + " SMs, " + format_bytes(static_cast<int64_t>(p.totalGlobalMem)) +
         "), driver " + ver(drv) + ", runtime " + ver(rt);
}

}  // namespace mt::cuda
