// Timing of the work a device's kernels queue: CUDA events around it on the CUDA device (the
// compute stream's time, not the host's), the host clock on the CPU. For benchmarks only.
#pragma once
#include "runtime/device.h"

namespace mt::kernels {

// Milliseconds device d spends on the work fn(ctx) queues; returns when that work has finished.
double time_ms(Device d, void (*fn)(void*), void* ctx);

}  // namespace mt::kernels
