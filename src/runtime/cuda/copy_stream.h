// The CUDA device's copy stream (implemented in cuda_device.cpp, beside the compute stream): a
// second non-blocking stream for device-to-host copies that overlap the compute stream (the
// offloaded optimizer's gradients, parallel/offload.h). Names no CUDA type.
#pragma once
#include <cstddef>

namespace mt::cuda {

// Queued on the copy stream (created on first use) after the work queued so far on the compute
// stream (an event the copy stream waits for); host_dst is page-locked (host_alloc_pinned).
void copy_to_host_async(void* host_dst, const void* src, size_t bytes);
// The host waits for the copy stream (one host wait, counted in host_syncs()).
void wait_copies();

}  // namespace mt::cuda
