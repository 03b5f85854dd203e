// Host memory standing in for device memory where checkpoint code needs host pointers: the
// initial weights (computed on the host), full-format checkpoint units and Hugging Face weights
// (read from and written to files). On the CPU the staging is the device memory itself, so
// nothing is copied; on a GPU it is a host buffer copied to or from the device.
#pragma once
#include <cstdint>
#include <vector>

#include "runtime/device.h"

namespace mt {

class HostStaging {
 public:
  explicit HostStaging(Device d) : dev_(d) {}
  // Host memory for the n floats that go to device memory dst (nullptr for a null dst): dst itself
  // on the CPU, a host buffer elsewhere, which upload() copies to dst.
  float* in(float* dst, int64_t n);
  void upload();
  // Host memory holding the n floats at device memory src (nullptr for a null src): src itself on
  // the CPU, a host copy elsewhere, valid while this object lives.
  const float* out(const float* src, int64_t n);

 private:
  Device dev_;
  std::vector<std::vector<float>> bufs_;
  std::vector<float*> dsts_;  // where in() buffers go (nullptr for out() buffers)
};

}  // namespace mt
