// The CUDA device's copy stream (implemented in cuda_device.cpp, beside the compute stream): a
// second non-blocking stream for copies that overlap the compute stream - the offloaded
// optimizer's gradients going down (parallel/offload.h) and the next step's batches going up
// (train/device_batches.h). Names no CUDA type.
//
// Device memory a copy on this stream touches is recorded with the allocator (BlockCache::
// record_use): when it is freed it is handed out again only once the copy stream has passed an
// event recorded at the free, so a later allocation cannot overwrite what a pending copy reads.
#pragma once
#include <cstddef>

namespace mt::cuda {

// Queued on the copy stream (created on first use) after the work queued so far on the compute
// stream (an event the copy stream waits for); host_dst is page-locked (host_alloc_pinned).
void copy_to_host_async(void* host_dst, const void* src, size_t bytes);
// Queued on the copy stream at once, not ordered after the compute stream's work: the caller
// guarantees that no queued work still uses dst (and host_src, page-locked, stays unchanged
// until uploads_ready's event has been passed).
void upload_async(void* dst, const void* host_src, size_t bytes);
// The compute stream's later work waits (on the device, not the host) for every upload_async
// queued so far: an event recorded on the copy stream.
void uploads_ready();
// The host waits for the copy stream (one host wait, counted in host_syncs()).
void wait_copies();
// The copy stream (a cudaStream_t), for the emulator's tests.
void* copy_stream();

}  // namespace mt::cuda
