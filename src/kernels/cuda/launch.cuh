// How the CUDA sources launch kernels and declare shared memory, written once for both builds:
// with nvcc they are the CUDA syntax itself; in the emulator build (-DMESHTRAIN_CUDA=EMU, which
// compiles the same .cu files as host C++, docs/gpu.md) they go to runtime/cuda/emu.
//
//   MT_LAUNCH(kernel, grid, block, smem, stream)(args...)   kernel<<<grid, block, smem, stream>>>(args...)
//   MT_SHARED(name, float[32]);                              __shared__ float name[32];
//   MT_SHARED_DYNAMIC(name, float);                          extern __shared__ float name[];
//
// In the emulator a launch runs the whole grid before it returns, and shared memory is storage of
// the running block, NaN-filled when the block starts.
#pragma once

namespace mt::kernels::cuda {
template <class T>
using shared_type = T;  // lets a declaration name an array type before the variable
}

#ifdef MT_CUDA_EMU
#define MT_LAUNCH(kernel, grid, block, smem, stream) ::mt::emu::launch(#kernel, kernel, grid, block, smem, stream)
#define MT_SHARED(name, ...) \
  ::mt::kernels::cuda::shared_type<__VA_ARGS__>& name = ::mt::emu::shared_var<__VA_ARGS__>([] {})
#define MT_SHARED_DYNAMIC(name, type) type* const name = static_cast<type*>(::mt::emu::dynamic_shared())
#else
#define MT_LAUNCH(kernel, grid, block, smem, stream) kernel<<<grid, block, smem, stream>>>
#define MT_SHARED(name, ...) __shared__ ::mt::kernels::cuda::shared_type<__VA_ARGS__> name
#define MT_SHARED_DYNAMIC(name, type) extern __shared__ type name[]
#endif
