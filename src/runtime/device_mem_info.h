// Free device memory as the device's driver reports it (the memory preflight, train/preflight.h).
#pragma once
#include <cstdint>

#include "runtime/device.h"

namespace mt {

// Free memory of device d in bytes (CUDA: cudaMemGetInfo); -1 for the CPU and Meta devices (the
// host's free memory is the operating system's figure: /proc/meminfo). Throws as every CUDA use
// does where there is no CUDA device.
int64_t device_free_bytes(Device d);

namespace cuda {
int64_t free_bytes();  // runtime/cuda/cuda_device.cpp (CUDA builds only)
}  // namespace cuda

}  // namespace mt
