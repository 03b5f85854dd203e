// The emulated CUDA runtime (cuda_runtime.h): one device whose memory is exact-size host
// allocations filled with NaN bytes, copies that check their direction and bounds against those
// allocations, and streams and events on which every operation has completed when it is issued.
#include <sys/sysinfo.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <string>

#include "cuda_runtime.h"
#include "internal.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#define MT_EMU_POISON(p, n) __asan_poison_memory_region((p), (n))
#define MT_EMU_UNPOISON(p, n) __asan_unpoison_memory_region((p), (n))
#else
#define MT_EMU_POISON(p, n) ((void)(p), (void)(n))
#define MT_EMU_UNPOISON(p, n) ((void)(p), (void)(n))
#endif

struct CUstream_st {
  unsigned flags;
};
struct CUevent_st {
  unsigned flags;
  bool recorded;
  std::chrono::steady_clock::time_point when;
  cudaStream_t stream = nullptr;  // of the latest record
};

namespace mt::emu {
namespace {

constexpr size_t kAlign = 256;  // cudaMalloc's alignment

struct Allocation {
  size_t bytes;
  bool pinned_host;  // cudaMallocHost: host memory kernels may also reach
};

struct Runtime {
  std::mutex mu;
  std::map<uintptr_t, Allocation> allocs;  // by base address
  std::set<cudaStream_t> streams;
  std::set<cudaEvent_t> events;
  std::map<const void*, size_t> dynamic_limits;
  std::vector<mt::emu::StreamOp>* op_log = nullptr;
  std::set<cudaStream_t> held;
};
Runtime& rt() {
  static Runtime* r = new Runtime();  // never destroyed: device memory may be freed during static teardown
  return *r;
}
thread_local cudaError_t g_last = cudaSuccess;

// The allocation holding [p, p + bytes), or nullptr (rt().mu held).
const Allocation* find(const void* p, size_t bytes) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  auto it = rt().allocs.upper_bound(a);
  if (it == rt().allocs.begin()) return nullptr;
  --it;
  const uintptr_t base = it->first;
  return a >= base && a - base <= it->second.bytes && bytes <= it->second.bytes - (a - base) ? &it->second : nullptr;
}
bool in_device(const void* p, size_t bytes) {
  std::lock_guard<std::mutex> lk(rt().mu);
  const Allocation* a = find(p, bytes);
  return a && !a->pinned_host;
}

cudaError_t ok() { return cudaSuccess; }
cudaError_t err(cudaError_t e) { return record_error(e); }

cudaError_t host_alloc(void** p, size_t bytes, bool pinned) {
  if (!p) return err(cudaErrorInvalidValue);
  *p = nullptr;
  if (bytes == 0) return ok();
  void* m = nullptr;
  if (posix_memalign(&m, kAlign, bytes) != 0) return err(cudaErrorMemoryAllocation);
  std::memset(m, 0xFF, bytes);  // NaN in every float format: reads of unwritten memory show
  std::lock_guard<std::mutex> lk(rt().mu);
  rt().allocs[reinterpret_cast<uintptr_t>(m)] = Allocation{bytes, pinned};
  *p = m;
  return ok();
}
cudaError_t host_free(void* p, bool pinned) {
  if (!p) return ok();
  {
    std::lock_guard<std::mutex> lk(rt().mu);
    auto it = rt().allocs.find(reinterpret_cast<uintptr_t>(p));
    if (it == rt().allocs.end() || it->second.pinned_host != pinned) return err(cudaErrorInvalidValue);
    MT_EMU_UNPOISON(p, it->second.bytes);
    rt().allocs.erase(it);
  }
  std::free(p);
  return ok();
}

// Whether a copy of `bytes` from src to dst is what `kind` says (device side inside one
// allocation, host side outside any).
bool copy_ok(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  const bool dd = in_device(dst, bytes), sd = in_device(src, bytes);
  switch (kind) {
    case cudaMemcpyHostToHost: return true;
    case cudaMemcpyHostToDevice: return dd && !in_device(src, 0);
    case cudaMemcpyDeviceToHost: return sd && !in_device(dst, 0);
    case cudaMemcpyDeviceToDevice: return dd && sd;
    case cudaMemcpyDefault: return (dd || !in_device(dst, 0)) && (sd || !in_device(src, 0));
  }
  return false;
}

bool device_visible() {
  const char* v = std::getenv("CUDA_VISIBLE_DEVICES");
  if (!v) return true;
  return v[0] == '0' && (v[1] == '\0' || v[1] == ',');
}

}  // namespace

void log_op(uint8_t kind, cudaStream_t s, cudaEvent_t e) {
  std::lock_guard<std::mutex> lk(rt().mu);
  if (rt().op_log) rt().op_log->push_back(StreamOp{static_cast<StreamOp::Kind>(kind), s, e});
}
void set_op_log(std::vector<StreamOp>* log) {
  std::lock_guard<std::mutex> lk(rt().mu);
  rt().op_log = log;
}
void hold_stream(cudaStream_t s, bool held) {
  std::lock_guard<std::mutex> lk(rt().mu);
  if (held) rt().held.insert(s);
  else rt().held.erase(s);
}

bool valid_stream(cudaStream_t s) {
  if (s == nullptr || s == cudaStreamLegacy || s == cudaStreamPerThread) return true;
  std::lock_guard<std::mutex> lk(rt().mu);
  return rt().streams.count(s) != 0;
}
cudaError_t record_error(cudaError_t e) {
  if (e != cudaSuccess) g_last = e;
  return e;
}
size_t dynamic_shared_limit(const void* fn) {
  std::lock_guard<std::mutex> lk(rt().mu);
  auto it = rt().dynamic_limits.find(fn);
  return it == rt().dynamic_limits.end() ? 0 : it->second;
}
float bf16_to_float(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

bool is_device_range(const void* p, size_t bytes) { return in_device(p, bytes); }

void check_kernel_pointer(const char* kernel, int index, const void* p) {
  if (!p) return;
  {
    std::lock_guard<std::mutex> lk(rt().mu);
    if (find(p, 0)) return;
  }
  std::fprintf(stderr,
               "meshtrain cuda emulator: kernel %s: argument %d (%p) is not device memory; a kernel can only reach "
               "memory from cudaMalloc (device_alloc(Device::CUDA, ...)) or cudaMallocHost\n",
               kernel, index, p);
  std::fflush(stderr);
  std::abort();
}

void device_lend(void* p, size_t bytes, size_t block_bytes) {
  MT_EMU_UNPOISON(p, block_bytes);
  std::memset(p, 0xFF, bytes);
  MT_EMU_POISON(static_cast<char*>(p) + bytes, block_bytes - bytes);
}
void device_return(void* p, size_t block_bytes) { MT_EMU_POISON(p, block_bytes); }

}  // namespace mt::emu

using mt::emu::err;
using mt::emu::ok;
using mt::emu::rt;

const char* cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInitializationError: return "cudaErrorInitializationError";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidDevicePointer: return "cudaErrorInvalidDevicePointer";
    case cudaErrorInvalidMemcpyDirection: return "cudaErrorInvalidMemcpyDirection";
    case cudaErrorNoDevice: return "cudaErrorNoDevice";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case cudaErrorNotReady: return "cudaErrorNotReady";
  }
  return "cudaErrorUnknown";
}
const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInitializationError: return "initialization error";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidDevicePointer: return "invalid device pointer";
    case cudaErrorInvalidMemcpyDirection: return "invalid copy direction for memcpy";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorNotReady: return "device not ready";
  }
  return "unknown error";
}
cudaError_t cudaGetLastError() {
  const cudaError_t e = mt::emu::g_last;
  mt::emu::g_last = cudaSuccess;
  return e;
}
cudaError_t cudaPeekAtLastError() { return mt::emu::g_last; }

cudaError_t cudaGetDeviceCount(int* count) {
  if (!count) return err(cudaErrorInvalidValue);
  *count = mt::emu::device_visible() ? 1 : 0;
  return *count ? ok() : err(cudaErrorNoDevice);
}
cudaError_t cudaSetDevice(int device) {
  return device == 0 && mt::emu::device_visible() ? ok() : err(cudaErrorInvalidDevice);
}
cudaError_t cudaGetDevice(int* device) {
  if (!device) return err(cudaErrorInvalidValue);
  *device = 0;
  return ok();
}
cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total_bytes) {
  struct sysinfo si {};
  if (!free_bytes || !total_bytes || sysinfo(&si) != 0) return err(cudaErrorInvalidValue);
  *free_bytes = static_cast<size_t>(si.freeram) * si.mem_unit;
  *total_bytes = static_cast<size_t>(si.totalram) * si.mem_unit;
  return ok();
}
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* p, int device) {
  if (!p) return err(cudaErrorInvalidValue);
  if (device != 0 || !mt::emu::device_visible()) return err(cudaErrorInvalidDevice);
  *p = cudaDeviceProp{};
  std::snprintf(p->name, sizeof p->name, "CUDA emulator on the host CPU (meshtrain EMU build)");
  size_t free_bytes = 0;
  cudaMemGetInfo(&free_bytes, &p->totalGlobalMem);
  p->sharedMemPerBlock = size_t(48) << 10;
  p->sharedMemPerBlockOptin = size_t(227) << 10;
  p->regsPerBlock = 65536;
  p->warpSize = 32;
  p->maxThreadsPerBlock = 1024;
  p->maxThreadsDim[0] = p->maxThreadsDim[1] = 1024;
  p->maxThreadsDim[2] = 64;
  p->maxGridSize[0] = 0x7fffffff;
  p->maxGridSize[1] = p->maxGridSize[2] = 65535;
  p->multiProcessorCount = 1;  // one block at a time
  p->major = 9;
  p->minor = 0;
  p->l2CacheSize = 0;
  p->maxThreadsPerMultiProcessor = 1024;
  return ok();
}
cudaError_t cudaDriverGetVersion(int* v) {
  if (!v) return err(cudaErrorInvalidValue);
  *v = 0;
  return ok();
}
cudaError_t cudaRuntimeGetVersion(int* v) {
  if (!v) return err(cudaErrorInvalidValue);
  *v = 13000;
  return ok();
}
cudaError_t cudaDeviceSynchronize() { return ok(); }

cudaError_t cudaMalloc(void** p, size_t bytes) { return mt::emu::host_alloc(p, bytes, false); }
cudaError_t cudaFree(void* p) { return mt::emu::host_free(p, false); }
cudaError_t cudaMallocHost(void** p, size_t bytes) { return mt::emu::host_alloc(p, bytes, true); }
cudaError_t cudaHostAlloc(void** p, size_t bytes, unsigned) { return mt::emu::host_alloc(p, bytes, true); }
cudaError_t cudaFreeHost(void* p) { return mt::emu::host_free(p, true); }

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, cudaStream_t s) {
  if (!mt::emu::valid_stream(s)) return err(cudaErrorInvalidResourceHandle);
  if (bytes == 0) return ok();
  if (!dst || !src || !mt::emu::copy_ok(dst, src, bytes, kind)) return err(cudaErrorInvalidValue);
  mt::emu::log_op(kind == cudaMemcpyHostToDevice   ? mt::emu::StreamOp::CopyH2D
                  : kind == cudaMemcpyDeviceToHost ? mt::emu::StreamOp::CopyD2H
                                                   : mt::emu::StreamOp::CopyD2D,
                  s, nullptr);
  std::memcpy(dst, src, bytes);
  return ok();
}
cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  return cudaMemcpyAsync(dst, src, bytes, kind, nullptr);
}
cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t s) {
  if (!mt::emu::valid_stream(s)) return err(cudaErrorInvalidResourceHandle);
  if (bytes == 0) return ok();
  if (!mt::emu::in_device(p, bytes)) return err(cudaErrorInvalidValue);
  mt::emu::log_op(mt::emu::StreamOp::Memset, s, nullptr);
  std::memset(p, value, bytes);
  return ok();
}
cudaError_t cudaMemset(void* p, int value, size_t bytes) { return cudaMemsetAsync(p, value, bytes, nullptr); }

namespace {
// A new stream or event handle, counted as live until destroyed.
template <class H>
cudaError_t create_handle(std::set<H*>& live, H** out, H* made) {
  if (!out) {
    delete made;
    return err(cudaErrorInvalidValue);
  }
  std::lock_guard<std::mutex> lk(rt().mu);
  live.insert(made);
  *out = made;
  return ok();
}
template <class H>
cudaError_t destroy_handle(std::set<H*>& live, H* h) {
  std::lock_guard<std::mutex> lk(rt().mu);
  if (!live.erase(h)) return err(cudaErrorInvalidResourceHandle);
  delete h;
  return ok();
}
}  // namespace

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned flags) {
  return create_handle(rt().streams, s, new CUstream_st{flags});
}
cudaError_t cudaStreamCreate(cudaStream_t* s) { return cudaStreamCreateWithFlags(s, cudaStreamDefault); }
cudaError_t cudaStreamDestroy(cudaStream_t s) { return destroy_handle(rt().streams, s); }
cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  if (!mt::emu::valid_stream(s)) return err(cudaErrorInvalidResourceHandle);
  mt::emu::log_op(mt::emu::StreamOp::Sync, s, nullptr);
  mt::emu::hold_stream(s, false);
  return ok();
}
cudaError_t cudaStreamQuery(cudaStream_t s) {
  if (!mt::emu::valid_stream(s)) return err(cudaErrorInvalidResourceHandle);
  std::lock_guard<std::mutex> lk(rt().mu);
  return rt().held.count(s) ? cudaErrorNotReady : cudaSuccess;
}

namespace {
bool valid_event(cudaEvent_t e) {
  std::lock_guard<std::mutex> lk(rt().mu);
  return rt().events.count(e) != 0;
}
}  // namespace
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned) {
  if (!mt::emu::valid_stream(s) || !valid_event(e)) return err(cudaErrorInvalidResourceHandle);
  mt::emu::log_op(mt::emu::StreamOp::WaitEvent, s, e);
  return ok();
}
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned flags) {
  return create_handle(rt().events, e, new CUevent_st{flags, false, {}, nullptr});
}
cudaError_t cudaEventCreate(cudaEvent_t* e) { return cudaEventCreateWithFlags(e, cudaEventDefault); }
cudaError_t cudaEventDestroy(cudaEvent_t e) { return destroy_handle(rt().events, e); }
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
  if (!valid_event(e) || !mt::emu::valid_stream(s)) return err(cudaErrorInvalidResourceHandle);
  mt::emu::log_op(mt::emu::StreamOp::Record, s, e);
  e->recorded = true;
  e->when = std::chrono::steady_clock::now();
  e->stream = s;
  return ok();
}
cudaError_t cudaEventSynchronize(cudaEvent_t e) {
  if (!valid_event(e)) return err(cudaErrorInvalidResourceHandle);
  mt::emu::log_op(mt::emu::StreamOp::Sync, nullptr, e);
  if (e->recorded) mt::emu::hold_stream(e->stream, false);
  return ok();
}
cudaError_t cudaEventQuery(cudaEvent_t e) {
  if (!valid_event(e)) return err(cudaErrorInvalidResourceHandle);
  std::lock_guard<std::mutex> lk(rt().mu);
  return e->recorded && rt().held.count(e->stream) ? cudaErrorNotReady : cudaSuccess;
}
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  if (!ms) return err(cudaErrorInvalidValue);
  if (!valid_event(start) || !valid_event(end) || ((start->flags | end->flags) & cudaEventDisableTiming))
    return err(cudaErrorInvalidResourceHandle);
  if (!start->recorded || !end->recorded) return err(cudaErrorNotReady);
  *ms = std::chrono::duration<float, std::milli>(end->when - start->when).count();
  return ok();
}

cudaError_t cudaFuncSetAttribute(const void* func, cudaFuncAttribute attr, int value) {
  if (!func) return err(cudaErrorInvalidValue);
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize) return ok();
  if (value < 0 || static_cast<size_t>(value) > (size_t(227) << 10)) return err(cudaErrorInvalidValue);
  std::lock_guard<std::mutex> lk(rt().mu);
  rt().dynamic_limits[func] = static_cast<size_t>(value);
  return ok();
}
