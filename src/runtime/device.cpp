#include "runtime/device.h"
#include "runtime/device_mem_info.h"
#include "runtime/host_transfer.h"

#include <omp.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <stdexcept>

#ifdef MT_HAVE_CUDA
#include "runtime/cuda/copy_stream.h"
#include "runtime/cuda/cuda_device.h"
#endif

namespace mt {

const char* device_name(Device d) {
  switch (d) {
    case Device::CPU: return "cpu";
    case Device::Meta: return "meta";
    case Device::CUDA: return "cuda";
  }
  return "unknown";
}

bool parse_device(const std::string& s, Device* out) {
  if (s == "cpu") *out = Device::CPU;
  else if (s == "meta") *out = Device::Meta;
  else if (s == "cuda") *out = Device::CUDA;
  else return false;
  return true;
}

#ifdef MT_HAVE_CUDA
bool cuda_built() { return true; }
#else
bool cuda_built() { return false; }
#endif

bool device_available(Device d, std::string* why) {
  std::string reason;
  if (d == Device::CUDA) {
#ifdef MT_HAVE_CUDA
    reason = cuda::unavailable_reason();
#else
    reason = "this meshtrain was built without the CUDA backend (configure with -DMESHTRAIN_CUDA=ON on a machine with "
             "the CUDA toolkit)";
#endif
  }
  if (why) *why = reason;
  return reason.empty();
}

namespace {
#ifndef MT_HAVE_CUDA
// Every CUDA operation of a build without the backend.
[[noreturn]] void no_cuda() {
  std::string why;
  device_available(Device::CUDA, &why);
  throw std::runtime_error("meshtrain: device cuda: " + why);
}
#endif

std::atomic<Device> g_current{Device::CPU};

// The Meta allocator: a bump pointer through a reserved, never-accessible range of address space.
// Addresses are not reused (a dry run allocates for one step; 64 TiB of range covers any model).
struct MetaArena {
  char* base = nullptr;
  size_t size = 0;
  size_t next = 0;
  std::mutex mu;
  MetaArena() {
    for (size_t sz = size_t(1) << 46; sz >= (size_t(1) << 36) && !base; sz >>= 1) {
      void* p = mmap(nullptr, sz, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (p != MAP_FAILED) {
        base = static_cast<char*>(p);
        size = sz;
      }
    }
  }
  void* take(size_t bytes) {
    std::lock_guard<std::mutex> lk(mu);
    if (!base) throw std::runtime_error("meta device: could not reserve address space for the count-only allocator");
    const size_t rounded = (std::max<size_t>(bytes, 1) + 4095) & ~size_t(4095);
    if (next + rounded > size)
      throw std::runtime_error("meta device: the dry run allocated more than " + format_bytes(static_cast<int64_t>(size)) +
                               " in total (address range exhausted)");
    void* p = base + next;
    next += rounded;
    return p;
  }
};
MetaArena& meta_arena() {
  static MetaArena* a = new MetaArena();  // never destroyed (tensors may outlive static teardown)
  return *a;
}
MemoryTracker& meta_tracker() {
  static MemoryTracker* t = new MemoryTracker();
  return *t;
}
}  // namespace

Device current_device() { return g_current.load(std::memory_order_relaxed); }
void set_current_device(Device d) { g_current.store(d, std::memory_order_relaxed); }

// A CUDA request goes to the cuda:: functions in a CUDA build and throws (no_cuda) in others;
// either way it never falls through to the host code below it.
#ifdef MT_HAVE_CUDA
#define MT_CUDA_OR_THROW(expr) return expr
#else
#define MT_CUDA_OR_THROW(expr) no_cuda()
#endif

Stream default_stream(Device d) {
  if (d == Device::CUDA) {
    MT_CUDA_OR_THROW((Stream{d, cuda::stream()}));
  }
  return Stream{d, nullptr};
}
void synchronize(const Stream& s) {  // CPU and Meta work is complete when the call returns
  if (s.device == Device::CUDA) {
    MT_CUDA_OR_THROW(cuda::synchronize());
  }
}

MemoryTracker& MemoryTracker::instance() { return memory_tracker(current_device()); }

MemoryTracker& memory_tracker(Device d) {
  if (d == Device::CUDA) {
    MT_CUDA_OR_THROW(cuda::tracker());
  }
  return d == Device::CPU ? host_memory_tracker() : meta_tracker();
}

int64_t device_free_bytes(Device d) {
  if (d == Device::CUDA) {
    MT_CUDA_OR_THROW(cuda::free_bytes());
  }
  return -1;
}

void* device_alloc(Device d, size_t bytes, MemCategory c) {
  if (d == Device::CPU) return mem_alloc(bytes, c);
  if (d == Device::CUDA) {
    MT_CUDA_OR_THROW(cuda::alloc(bytes, c));
  }
  void* p = meta_arena().take(bytes);
  meta_tracker().on_alloc(c, static_cast<int64_t>(bytes));
  return p;
}

void device_free(Device d, void* p, size_t bytes, MemCategory c) {
  if (d == Device::CPU) return mem_free(p, bytes, c);
  if (d == Device::CUDA) {
    MT_CUDA_OR_THROW(cuda::free(p, bytes, c));
  }
  if (p) meta_tracker().on_free(c, static_cast<int64_t>(bytes));
}

bool is_meta_pointer(const void* p) {
  const MetaArena& a = meta_arena();
  const char* c = static_cast<const char*>(p);
  return a.base && c >= a.base && c < a.base + a.size;
}

void* host_alloc_pinned(Device d, size_t bytes) {
  if (d == Device::CUDA) {
    MT_CUDA_OR_THROW(cuda::host_alloc_pinned(bytes));
  }
  void* p = std::malloc(std::max<size_t>(bytes, 1));
  if (!p) throw std::bad_alloc();
  return p;
}
void host_free_pinned(Device d, void* p) {
  if (d == Device::CUDA) {
    MT_CUDA_OR_THROW(cuda::host_free_pinned(p));
  }
  std::free(p);
}

namespace dev {
namespace {
// Host memset / memcpy of large buffers on every compute thread: one core's stores reach only
// part of the bandwidth all cores do, and a step zeroes every gradient once (figures:
// docs/cpu.md, "Large GEMMs: the LM head in bf16"). Contiguous, 4 KiB-aligned pieces.
constexpr size_t kParallelBytes = size_t(4) << 20;
template <class F>
void host_parallel(size_t bytes, F&& piece) {
  const int nt = omp_in_parallel() ? 1 : omp_get_max_threads();
  if (bytes < kParallelBytes || nt <= 1) {
    piece(size_t(0), bytes);
    return;
  }
#pragma omp parallel num_threads(nt)
  {
    const size_t t = static_cast<size_t>(omp_get_thread_num()), T = static_cast<size_t>(omp_get_num_threads());
    const size_t per = (bytes / T + 4095) & ~size_t(4095);
    const size_t lo = std::min(bytes, t * per), hi = std::min(bytes, lo + per);
    if (hi > lo) piece(lo, hi - lo);
  }
}
}  // namespace

void zero(Device d, void* p, size_t bytes) {
  if (d == Device::CUDA) {
    MT_CUDA_OR_THROW(cuda::zero(p, bytes));
  }
  if (d == Device::CPU && bytes)
    host_parallel(bytes, [p](size_t off, size_t n) { std::memset(static_cast<char*>(p) + off, 0, n); });
}
void copy(Device d, void* dst, const void* src, size_t bytes) {
  if (d == Device::CUDA) {
    MT_CUDA_OR_THROW(cuda::copy(dst, src, bytes));
  }
  if (d == Device::CPU && bytes && dst != src)
    host_parallel(bytes, [dst, src](size_t off, size_t n) {
      std::memcpy(static_cast<char*>(dst) + off, static_cast<const char*>(src) + off, n);
    });
}
void copy_from_host(Device d, void* dst, const void* host_src, size_t bytes) {
  if (d == Device::CUDA) {
    MT_CUDA_OR_THROW(cuda::copy_from_host(dst, host_src, bytes));
  }
  if (d == Device::CPU && bytes && dst != host_src) std::memcpy(dst, host_src, bytes);
}
void copy_to_host(Device d, void* host_dst, const void* src, size_t bytes) {
  if (!bytes) return;
  if (d == Device::CUDA) {
    MT_CUDA_OR_THROW(cuda::copy_to_host(host_dst, src, bytes));
  }
  if (d == Device::CPU) {
    if (host_dst != src) std::memcpy(host_dst, src, bytes);
  } else {
    std::memset(host_dst, 0, bytes);
  }
}
void copy_from_host_async(Device d, void* dst, const void* host_src, size_t bytes) {
  if (d == Device::CUDA) {
    MT_CUDA_OR_THROW(cuda::copy_from_host_async(dst, host_src, bytes));
  }
  copy_from_host(d, dst, host_src, bytes);
}
void copy_to_host_async(Device d, void* host_dst, const void* src, size_t bytes) {
  if (d == Device::CUDA) {
    MT_CUDA_OR_THROW(cuda::copy_to_host_async(host_dst, src, bytes));
  }
  copy_to_host(d, host_dst, src, bytes);
}
void wait_copies(Device d) {
  if (d == Device::CUDA) {
    MT_CUDA_OR_THROW(cuda::wait_copies());
  }
}
void upload_async(Device d, void* dst, const void* host_src, size_t bytes) {
  if (d == Device::CUDA) {
    MT_CUDA_OR_THROW(cuda::upload_async(dst, host_src, bytes));
  }
  if (d == Device::CPU && bytes && dst != host_src) std::memcpy(dst, host_src, bytes);
}
void uploads_ready(Device d) {
  if (d == Device::CUDA) {
    MT_CUDA_OR_THROW(cuda::uploads_ready());
  }
}
uint64_t host_syncs(Device d) {
#ifdef MT_HAVE_CUDA
  if (d == Device::CUDA) return cuda::host_syncs();
#endif
  (void)d;
  return 0;
}
}  // namespace dev

}  // namespace mt
