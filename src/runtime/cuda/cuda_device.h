// The CUDA device behind runtime/device.h (compiled only with -DMESHTRAIN_CUDA on; this header
// names no CUDA type, so device.cpp and the kernels can include it without the toolkit's headers).
//
// One process uses one GPU (device 0 unless CUDA_VISIBLE_DEVICES says otherwise) and one
// non-blocking compute stream, created on first use; every allocation, synchronous copy and kernel
// of the CUDA device is ordered on that stream (the copies that overlap it run on the copy stream,
// copy_stream.h). Memory comes from a BlockCache (runtime/block_cache.h) on
// cudaMalloc, counted by category in the CUDA tracker. Host<->device copies are explicit and
// synchronous with respect to the host (the call returns when the host buffer may be reused, and
// for copy_to_host when the data has arrived).
#pragma once
#include <functional>
#include <cstddef>
#include <string>

#include "runtime/memory.h"

namespace mt::cuda {

// "" when this process can use a GPU, else why not (driver missing, no device, ...). Cached after
// the first call.
const std::string& unavailable_reason();
// Throws std::runtime_error with unavailable_reason() when it is not "".
void require();

void* alloc(size_t bytes, MemCategory c);
void free(void* p, size_t bytes, MemCategory c);
MemoryTracker& tracker();
// Returns every cached free block to the driver.
void release_cache();

// The compute stream (a cudaStream_t).
void* stream();
void synchronize();

void zero(void* p, size_t bytes);
void copy(void* dst, const void* src, size_t bytes);
void copy_from_host(void* dst, const void* host_src, size_t bytes);
void copy_to_host(void* host_dst, const void* src, size_t bytes);
// Queued on the stream; host_src (page-locked, from host_alloc_pinned) must stay unchanged until
// the stream has passed the copy.
void copy_from_host_async(void* dst, const void* host_src, size_t bytes);
void* host_alloc_pinned(size_t bytes);
void host_free_pinned(void* p);
// Host waits so far: synchronize(), release_cache() and the synchronous copies each count one.
uint64_t host_syncs();

// Milliseconds the compute stream spends on the work f() queues: events recorded before and after
// it, then one wait for the second (counted in host_syncs).
double time_ms(const std::function<void()>& f);

// "cuda NVIDIA H200 (sm_90, 132 SMs, 139.8 GiB), driver 13.0, runtime 13.0".
std::string describe();

// Throws std::runtime_error "meshtrain: cuda: <what>: <error string>" unless err is cudaSuccess (0).
void check(int err, const char* what);

}  // namespace mt::cuda
