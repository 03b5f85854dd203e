// Devices: where tensor memory lives and kernels run, behind one seam every layer goes through.
//
// A device kind is carried by every Storage. Each device has an allocator that tags every byte
// with a MemCategory and a tracker of its current and peak bytes per category, a default stream,
// and the memory operations below (ggml's buffer interface: memset / set / get / copy). Code
// outside the kernels never touches tensor memory directly: it calls these, or a kernel through
// the device's kernel table (kernels/backend.h).
//
// Devices:
//   CPU  - host memory from the caching allocator (runtime/memory.h); operations run at once on the
//          calling thread (its stream is synchronous).
//   Meta - counts bytes by category without allocating. Pointers lie in a reserved, inaccessible
//          address range (PROT_NONE), so any host access to a Meta tensor's data faults at once -
//          the discipline a GPU backend needs - and is_meta_pointer() can tell them from host
//          pointers. Its operations and kernels do nothing. Used by `train --dry-run`.
//   CUDA - GPU memory from a caching allocator on cudaMalloc (runtime/block_cache.h), counted by the
//          same categories; operations and kernels are queued on one compute stream, host<->device
//          copies are explicit (runtime/cuda/cuda_device.h). Exists only in builds configured with
//          the CUDA backend (MESHTRAIN_CUDA); elsewhere, and on machines without a GPU, every use
//          throws an error naming the cause (device_available() tells beforehand). docs/gpu.md.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include "runtime/memory.h"

namespace mt {

enum class Device : uint8_t { CPU = 0, Meta = 1, CUDA = 2 };
constexpr int kNumDevices = 3;
const char* device_name(Device d);               // "cpu", "meta", "cuda"
bool parse_device(const std::string& s, Device* out);

// True when this binary was built with the CUDA backend.
bool cuda_built();
// True when device d can be used in this process; otherwise false with the reason in *why (no
// CUDA build, no driver, no GPU). CPU and Meta are always available.
bool device_available(Device d, std::string* why = nullptr);

// The device new tensors are allocated on (process-wide; CPU unless set). The dry run sets Meta
// before it builds anything.
Device current_device();
void set_current_device(Device d);

// An ordered queue of work on a device. CPU and Meta work completes when the call returns, so
// their default stream is synchronous; the CUDA device's is its compute stream (native = the
// cudaStream_t), and synchronize() waits for it.
struct Stream {
  Device device = Device::CPU;
  void* native = nullptr;  // backend handle (none for CPU / Meta)
};
Stream default_stream(Device d);
void synchronize(const Stream& s);

// Per-device allocation: `bytes` tagged with category `c`, counted in that device's tracker.
void* device_alloc(Device d, size_t bytes, MemCategory c);
void device_free(Device d, void* p, size_t bytes, MemCategory c);
MemoryTracker& memory_tracker(Device d);

// True for an address handed out by the Meta allocator.
bool is_meta_pointer(const void* p);

// Page-locked host memory for asynchronous uploads to device d (cudaMallocHost on CUDA, ordinary
// host memory on CPU and Meta). Not counted in any tracker; free with host_free_pinned(d, ...).
void* host_alloc_pinned(Device d, size_t bytes);
void host_free_pinned(Device d, void* p);

namespace dev {
// Memory operations on device memory of `d` (byte counts; no-ops on Meta).
void zero(Device d, void* p, size_t bytes);
void copy(Device d, void* dst, const void* src, size_t bytes);  // within device d (may not overlap)
void copy_from_host(Device d, void* dst, const void* host_src, size_t bytes);
// Host destination: on Meta it is zero-filled (the values a count-only device "holds").
void copy_to_host(Device d, void* host_dst, const void* src, size_t bytes);
// Queued on d's stream without waiting: host_src (memory from host_alloc_pinned) must stay
// unchanged until the stream has passed the copy, which any later synchronising call guarantees.
// CPU: copies at once.
void copy_from_host_async(Device d, void* dst, const void* host_src, size_t bytes);
// How often the host has waited for device d so far (stream synchronisations and synchronous
// copies, the kernels' host results included); 0 for CPU and Meta, whose work never runs behind.
uint64_t host_syncs(Device d);
}  // namespace dev

}  // namespace mt
