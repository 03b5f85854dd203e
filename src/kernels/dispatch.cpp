// kernels::table(d) and describe(d): which backend's table serves a device.
#include <chrono>
#include <stdexcept>
#include <string>

#include "kernels/backend.h"
#include "kernels/conformance/check.h"
#include "kernels/cpu/cpu_isa.h"
#include "kernels/timing.h"

#ifdef MT_HAVE_CUDA
#include "runtime/cuda/cuda_device.h"
#endif

namespace mt::kernels {

const KernelTable& table(Device d) {
  switch (d) {
    case Device::Meta: return meta::meta_table();
    case Device::CUDA: {
#ifdef MT_HAVE_CUDA
      return cuda::cuda_table();
#else
      std::string why;
      device_available(Device::CUDA, &why);
      throw std::runtime_error("meshtrain: kernels for device cuda: " + why);
#endif
    }
    case Device::CPU: break;
  }
  return cpu::cpu_table();
}

std::string describe(Device d) {
  switch (d) {
    case Device::Meta: return "meta (counts bytes, runs no kernel)";
    case Device::CUDA: {
#ifdef MT_HAVE_CUDA
      return mt::cuda::describe();
#else
      std::string why;
      device_available(Device::CUDA, &why);
      return "cuda unavailable: " + why;
#endif
    }
    case Device::CPU: break;
  }
  return cpu::isa_summary();
}

double time_ms(Device d, void (*fn)(void*), void* ctx) {
  if (d == Device::CUDA) {
#ifdef MT_HAVE_CUDA
    return mt::cuda::time_ms([&] { fn(ctx); });
#else
    table(d);  // throws the reason
#endif
  }
  const auto t0 = std::chrono::steady_clock::now();
  fn(ctx);
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace mt::kernels

namespace mt::kernels::conformance {

double device_ms(Device d, const std::function<void()>& f) {
#ifdef MT_HAVE_CUDA
  if (d == Device::CUDA) return mt::cuda::time_ms(f);
#endif
  (void)d;
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace mt::kernels::conformance
