// What the emulator's runtime (runtime.cpp) tells its grid runner (scheduler.cpp) and its
// cuBLASLt (cublaslt.cpp).
#pragma once
#include <cstddef>

#include "cuda_runtime.h"

namespace mt::emu {

// A stream the runtime handed out and has not destroyed, or one of the built-in streams.
bool valid_stream(cudaStream_t s);
// Records err as the error cudaGetLastError returns next; returns it.
cudaError_t record_error(cudaError_t err);
// The dynamic shared memory a kernel may ask for, set by cudaFuncSetAttribute (0: not raised).
size_t dynamic_shared_limit(const void* fn);
// bf16 (the high half of an IEEE float, rounded to nearest even as the engine does) and back.
float bf16_to_float(uint16_t b);
uint16_t float_to_bf16(float f);
// Appends to the test's operation log (set_op_log), if any.
void log_op(uint8_t kind, cudaStream_t s, cudaEvent_t e);

}  // namespace mt::emu
