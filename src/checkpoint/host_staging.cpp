#include "checkpoint/host_staging.h"

namespace mt {

float* HostStaging::in(float* dst, int64_t n) {
  if (!dst || dev_ == Device::CPU) return dst;
  bufs_.emplace_back(static_cast<size_t>(n));
  dsts_.push_back(dst);
  return bufs_.back().data();
}

void HostStaging::upload() {
  for (size_t i = 0; i < bufs_.size(); ++i)
    if (dsts_[i]) dev::copy_from_host(dev_, dsts_[i], bufs_[i].data(), bufs_[i].size() * sizeof(float));
}

const float* HostStaging::out(const float* src, int64_t n) {
  if (!src || dev_ == Device::CPU) return src;
  bufs_.emplace_back(static_cast<size_t>(n));
  dsts_.push_back(nullptr);
  dev::copy_to_host(dev_, bufs_.back().data(), src, static_cast<size_t>(n) * sizeof(float));
  return bufs_.back().data();
}

}  // namespace mt
