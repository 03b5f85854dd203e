// Host memory kept for device work, and the device-to-host copies that overlap compute (runtime/
// device.h has the synchronous copies and the asynchronous upload).
#pragma once
#include <cstddef>

#include "runtime/device.h"
#include "runtime/memory.h"

namespace mt {

// Page-locked host memory kept for a device's work - the offloaded optimizer state and its
// transfer buffers (train.offload) - by category. Counted by the code that allocates it (a dry
// run counts it here without allocating); host_alloc_pinned itself counts nothing.
MemoryTracker& pinned_memory_tracker();

namespace dev {
// Queued on d's copy stream behind everything queued so far on its compute stream, without
// waiting: host_dst (from host_alloc_pinned) holds the bytes once wait_copies(d) has returned, and
// src must not change before then. CPU: copies at once; Meta: zero-fills host_dst.
void copy_to_host_async(Device d, void* host_dst, const void* src, size_t bytes);
// The host waits for every copy_to_host_async and upload_async queued so far (one host wait on
// CUDA).
void wait_copies(Device d);
// Queued on d's copy stream at once (not behind the compute stream's work, which may still be
// running): an upload that overlaps compute. The caller guarantees that no queued work still
// reads or writes dst, and keeps host_src (from host_alloc_pinned) unchanged until the compute
// stream has passed the uploads_ready() that follows. CPU: copies at once; Meta: nothing.
void upload_async(Device d, void* dst, const void* host_src, size_t bytes);
// The compute stream's later work waits for every upload_async queued so far (an event on the
// device: the host does not wait). CPU and Meta: nothing to do.
void uploads_ready(Device d);
}  // namespace dev

}  // namespace mt
