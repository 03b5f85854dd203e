// Device-to-host copies on the copy stream (runtime/host_transfer.h): they arrive after the work
// queued before them on the compute stream, the host waits for them once, and pinned host memory is
// counted by category only where its owner counts it. On the CPU the copy is immediate.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "runtime/device.h"
#include "runtime/host_transfer.h"

namespace mt {
namespace {

TEST(CudaDevice, CopyStreamCopiesAfterTheComputeStreamsWork) {
  if (!device_available(Device::CUDA)) GTEST_SKIP() << "no usable CUDA device";
  const size_t n = 1000, bytes = n * sizeof(float);
  std::vector<float> src(n);
  for (size_t i = 0; i < n; ++i) src[i] = static_cast<float>(i) + 0.5f;
  float* d = static_cast<float*>(device_alloc(Device::CUDA, bytes, MemCategory::Grads));
  float* h = static_cast<float*>(host_alloc_pinned(Device::CUDA, bytes));
  std::memset(h, 0xFF, bytes);  // NaN: every value checked below must have been copied
  // Queued on the compute stream: an upload, then a zeroing of the second half.
  dev::copy_from_host_async(Device::CUDA, d, src.data(), bytes);
  dev::zero(Device::CUDA, d + n / 2, bytes / 2);
  dev::copy_to_host_async(Device::CUDA, h, d, bytes);
  const uint64_t before = dev::host_syncs(Device::CUDA);
  dev::wait_copies(Device::CUDA);
  EXPECT_EQ(dev::host_syncs(Device::CUDA) - before, 1u);
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(h[i], i < n / 2 ? src[i] : 0.0f) << i;
  host_free_pinned(Device::CUDA, h);
  device_free(Device::CUDA, d, bytes, MemCategory::Grads);
}

TEST(HostTransfer, CpuCopiesAtOnceAndPinnedBytesAreCountedByTheirOwner) {
  std::vector<float> a = {1, 2, 3}, b(3, 0.0f);
  dev::copy_to_host_async(Device::CPU, b.data(), a.data(), 3 * sizeof(float));
  EXPECT_EQ(b, a);  // before any wait
  dev::wait_copies(Device::CPU);
  MemoryTracker& t = pinned_memory_tracker();
  const int64_t before = t.stats().current[static_cast<int>(MemCategory::Optimizer)];
  void* p = host_alloc_pinned(Device::CPU, 4096);
  EXPECT_EQ(t.stats().current[static_cast<int>(MemCategory::Optimizer)], before);  // allocation alone counts nothing
  t.on_alloc(MemCategory::Optimizer, 4096);
  EXPECT_EQ(t.stats().current[static_cast<int>(MemCategory::Optimizer)], before + 4096);
  t.on_free(MemCategory::Optimizer, 4096);
  host_free_pinned(Device::CPU, p);
}

}  // namespace
}  // namespace mt
