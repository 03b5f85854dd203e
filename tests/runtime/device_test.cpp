// The device seam: per-device allocators and trackers, the Meta device's count-only memory.
#include <gtest/gtest.h>

#include <vector>

#include "runtime/device.h"
#include "runtime/tensor.h"

namespace mt {
namespace {

// Restores the current device when a test ends.
struct DeviceGuard {
  Device saved = current_device();
  ~DeviceGuard() { set_current_device(saved); }
};

TEST(Device, NamesParse) {
  Device d;
  ASSERT_TRUE(parse_device("meta", &d));
  EXPECT_EQ(d, Device::Meta);
  ASSERT_TRUE(parse_device("cpu", &d));
  EXPECT_EQ(d, Device::CPU);
  EXPECT_FALSE(parse_device("gpu", &d));
  EXPECT_STREQ(device_name(Device::Meta), "meta");
}

TEST(Device, MetaTensorsAreCountedNotAllocated) {
  DeviceGuard g;
  MemoryTracker& meta = memory_tracker(Device::Meta);
  MemoryTracker& host = memory_tracker(Device::CPU);
  const MemStats m0 = meta.stats(), h0 = host.stats();
  set_current_device(Device::Meta);
  EXPECT_EQ(&MemoryTracker::instance(), &meta);
  {
    // 64 GiB of "parameters": nothing is touched, so this costs no memory.
    Tensor big = Tensor::empty({int64_t(16) << 30}, DType::F32, MemCategory::Params);
    Tensor act = Tensor::zeros({1000}, DType::BF16, MemCategory::Activations);
    EXPECT_EQ(big.device(), Device::Meta);
    EXPECT_TRUE(is_meta_pointer(big.raw()));
    EXPECT_TRUE(is_meta_pointer(act.view(10, {5}).raw()));
    const MemStats m1 = meta.stats();
    EXPECT_EQ(m1.current[0] - m0.current[0], int64_t(64) << 30);
    EXPECT_EQ(m1.current[static_cast<int>(MemCategory::Activations)] - m0.current[static_cast<int>(MemCategory::Activations)],
              2000);
    EXPECT_EQ(host.stats().total_current, h0.total_current);  // the host saw none of it
  }
  EXPECT_EQ(meta.stats().total_current, m0.total_current);  // freed again
  EXPECT_GE(meta.stats().peak[0], int64_t(64) << 30);
  set_current_device(Device::CPU);
  Tensor h = Tensor::zeros({16}, DType::F32, MemCategory::Workspace);
  EXPECT_EQ(h.device(), Device::CPU);
  EXPECT_FALSE(is_meta_pointer(h.raw()));
  EXPECT_EQ(h.f32()[15], 0.0f);
}

TEST(Device, MetaOperationsMoveNothingAndReadAsZero) {
  DeviceGuard g;
  set_current_device(Device::Meta);
  Tensor t = Tensor::empty({8}, DType::F32, MemCategory::Workspace);
  std::vector<float> host = {1, 2, 3, 4, 5, 6, 7, 8};
  dev::copy_from_host(Device::Meta, t.raw(), host.data(), 32);  // no fault: nothing is written
  dev::zero(Device::Meta, t.raw(), 32);
  dev::copy(Device::Meta, t.raw(), t.raw(), 32);
  dev::copy_to_host(Device::Meta, host.data(), t.raw(), 32);
  for (float v : host) EXPECT_EQ(v, 0.0f);
}

TEST(Device, CpuOperationsCopy) {
  std::vector<float> a = {1, 2, 3}, b(3, -1.0f);
  dev::copy(Device::CPU, b.data(), a.data(), 12);
  EXPECT_EQ(b, a);
  dev::zero(Device::CPU, b.data(), 8);
  EXPECT_EQ(b[0], 0.0f);
  EXPECT_EQ(b[1], 0.0f);
  EXPECT_EQ(b[2], 3.0f);
  synchronize(default_stream(Device::CPU));
}

}  // namespace
}  // namespace mt
