// The CUDA device as the host sees it: its name, the errors when it cannot be used (no CUDA build,
// no driver, no GPU), the caching block allocator's bookkeeping (run on host memory here), and,
// where a GPU or the emulator (-DMESHTRAIN_CUDA=EMU) is present, the device allocator and copies.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "runtime/block_cache.h"
#include "runtime/device.h"

#ifdef MT_CUDA_EMU
#include "emu.h"
#include "runtime/cuda/copy_stream.h"
#include "runtime/cuda/cuda_device.h"
#include "runtime/host_transfer.h"
#endif

namespace mt {
namespace {

TEST(CudaDevice, NameParsesAndPrints) {
  Device d = Device::CPU;
  ASSERT_TRUE(parse_device("cuda", &d));
  EXPECT_EQ(d, Device::CUDA);
  EXPECT_STREQ(device_name(Device::CUDA), "cuda");
  EXPECT_FALSE(parse_device("gpu", &d));
  EXPECT_TRUE(device_available(Device::CPU));
  EXPECT_TRUE(device_available(Device::Meta));
}

// Where CUDA cannot be used, every use says why instead of touching host memory.
TEST(CudaDevice, UnavailableDeviceGivesAClearError) {
  std::string why;
  if (device_available(Device::CUDA, &why)) GTEST_SKIP() << "a CUDA device is present; this checks machines without one";
  ASSERT_FALSE(why.empty());
  if (!cuda_built()) {
    EXPECT_NE(why.find("built without the CUDA backend"), std::string::npos) << why;
    EXPECT_NE(why.find("MESHTRAIN_CUDA"), std::string::npos) << why;
  } else {
    EXPECT_NE(why.find("CUDA device"), std::string::npos) << why;
  }
  auto expect_error = [&](auto&& f, const char* what) {
    try {
      f();
      ADD_FAILURE() << what << " did not throw";
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find("device cuda"), std::string::npos) << what << ": " << e.what();
      EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << what << ": " << e.what();
    }
  };
  expect_error([] { device_alloc(Device::CUDA, 64, MemCategory::Params); }, "device_alloc");
  expect_error([] { memory_tracker(Device::CUDA); }, "memory_tracker");
  expect_error([] { default_stream(Device::CUDA); }, "default_stream");
  float host[4] = {1, 2, 3, 4};
  expect_error([&] { dev::copy_to_host(Device::CUDA, host, host, sizeof host); }, "copy_to_host");
  expect_error([&] { dev::copy_from_host(Device::CUDA, host, host, sizeof host); }, "copy_from_host");
  expect_error([&] { dev::zero(Device::CUDA, host, sizeof host); }, "zero");
  EXPECT_EQ(host[0], 1.0f);  // nothing fell through to host memory
}

// --- BlockCache on host memory: the allocator logic the CUDA device uses on cudaMalloc. ---
struct HostRaw {
  int64_t budget = INT64_MAX;  // raw allocations fail past this many bytes outstanding
  int64_t outstanding = 0;
  std::vector<std::pair<void*, size_t>> live;
  BlockCache::RawAlloc alloc() {
    return [this](size_t bytes) -> void* {
      if (outstanding + static_cast<int64_t>(bytes) > budget) return nullptr;
      void* p = std::malloc(bytes);
      outstanding += static_cast<int64_t>(bytes);
      live.emplace_back(p, bytes);
      return p;
    };
  }
  BlockCache::RawFree free() {
    return [this](void* p) {
      for (size_t i = 0; i < live.size(); ++i)
        if (live[i].first == p) {
          outstanding -= static_cast<int64_t>(live[i].second);
          live.erase(live.begin() + static_cast<long>(i));
          std::free(p);
          return;
        }
      ADD_FAILURE() << "raw free of a pointer raw alloc did not return";
    };
  }
};

TEST(BlockCache, SizeClasses) {
  EXPECT_EQ(BlockCache::size_class(0), 512u);
  EXPECT_EQ(BlockCache::size_class(1), 512u);
  EXPECT_EQ(BlockCache::size_class(512), 512u);
  EXPECT_EQ(BlockCache::size_class(513), 1024u);
  EXPECT_EQ(BlockCache::size_class((1u << 20) - 1), size_t(1) << 20);
  EXPECT_EQ(BlockCache::size_class(1u << 20), size_t(2) << 20);
  EXPECT_EQ(BlockCache::size_class((2u << 20) + 1), size_t(4) << 20);
}

// A second step with the same shapes makes no raw allocation: freed blocks are reused by class.
TEST(BlockCache, ReusesFreedBlocksWithoutNewRawAllocations) {
  HostRaw raw;
  BlockCache c("test", raw.alloc(), raw.free());
  const std::vector<size_t> step = {100, 3000, 3000, 5u << 20, 700};
  for (int s = 0; s < 3; ++s) {
    std::vector<void*> ps;
    for (size_t b : step) ps.push_back(c.take(b));
    for (size_t i = 0; i < ps.size(); ++i)
      for (size_t j = i + 1; j < ps.size(); ++j) EXPECT_NE(ps[i], ps[j]);
    EXPECT_EQ(c.cached_bytes(), 0);
    for (size_t i = 0; i < ps.size(); ++i) c.give(ps[i], step[i]);
    EXPECT_EQ(c.raw_allocations(), 5) << "step " << s;
  }
  const int64_t want = 512 + 3072 + 3072 + (6 << 20) + 1024;
  EXPECT_EQ(c.reserved_bytes(), want);
  EXPECT_EQ(c.cached_bytes(), want);
  EXPECT_EQ(c.in_use_bytes(), 0);
  c.release();
  EXPECT_EQ(c.reserved_bytes(), 0);
  EXPECT_EQ(c.cached_bytes(), 0);
  EXPECT_EQ(raw.outstanding, 0);
  EXPECT_EQ(c.raw_frees(), 5);
}

// Out of memory with free blocks of another class: they go back to the raw allocator and the
// request succeeds; with everything in use, the error names the sizes.
TEST(BlockCache, OutOfMemoryReleasesTheCacheThenReports) {
  HostRaw raw;
  raw.budget = 8 << 20;
  BlockCache c("test device", raw.alloc(), raw.free());
  void* a = c.take(6 << 20);
  c.give(a, 6 << 20);
  void* b = c.take(4 << 20);  // 6 MiB cached + 4 MiB > budget: cache released, then it fits
  EXPECT_EQ(c.raw_frees(), 1);
  EXPECT_EQ(c.reserved_bytes(), 4 << 20);
  try {
    c.take(6 << 20);
    ADD_FAILURE() << "no out-of-memory error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("test device: out of memory"), std::string::npos) << e.what();
  }
  c.give(b, 4 << 20);
  c.release();
}

TEST(BlockCache, RejectsDoubleFreeAndWrongSize) {
  HostRaw raw;
  BlockCache c("test", raw.alloc(), raw.free());
  void* p = c.take(1000);
  EXPECT_THROW(c.give(p, 5000), std::runtime_error);  // another size class
  c.give(p, 1000);
  EXPECT_THROW(c.give(p, 1000), std::runtime_error);  // twice
  int x = 0;
  EXPECT_THROW(c.give(&x, 4), std::runtime_error);  // never handed out
  c.release();
}

// A block another stream used is not handed out again until that stream's event (recorded when
// the block was freed) has completed, and then only for its own stream; a block only its own stream
// used is reused at once. Fake events: the test says when each completes.
TEST(BlockCache, BlockUsedByAnotherStreamWaitsForItsEvent) {
  HostRaw raw;
  BlockCache c("test", raw.alloc(), raw.free());
  int compute = 0, copies = 0;  // stream handles
  struct Ev {
    void* stream;
    bool done = false;
  };
  std::vector<Ev*> events;
  int destroyed = 0;
  c.set_event_ops(BlockCache::EventOps{[&](void* st) -> void* {
                                         events.push_back(new Ev{st});
                                         return events.back();
                                       },
                                       [](void* e) { return static_cast<Ev*>(e)->done; },
                                       [&](void* e) {
                                         ++destroyed;
                                         delete static_cast<Ev*>(e);
                                       }});
  // Only its own stream: reused at once, no event.
  void* a = c.take(4000, &compute);
  c.give(a, 4000);
  EXPECT_EQ(c.take(4000, &compute), a);
  EXPECT_TRUE(events.empty());
  // A copy on the other stream reads it (an address inside the block), then it is freed.
  c.record_use(static_cast<char*>(a) + 100, &copies);
  c.record_use(static_cast<char*>(a) + 200, &copies);  // the same stream again: one event
  c.give(a, 4000);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0]->stream, &copies);
  EXPECT_EQ(c.pending_bytes(), 4096);
  EXPECT_EQ(c.cached_bytes(), 4096);
  void* b = c.take(4000, &compute);  // the copy has not finished: a new block
  EXPECT_NE(b, a);
  EXPECT_EQ(c.raw_allocations(), 2);
  c.release();  // a pending block is not returned to the raw allocator
  EXPECT_EQ(c.raw_frees(), 0);
  static_cast<Ev*>(events[0])->done = true;
  c.give(b, 4000);
  void* x = c.take(4000, &compute);
  void* y = c.take(4000, &compute);
  EXPECT_TRUE((x == a && y == b) || (x == b && y == a));  // both reused: the event completed
  EXPECT_EQ(destroyed, 1);
  EXPECT_EQ(c.pending_bytes(), 0);
  EXPECT_EQ(c.raw_allocations(), 2);
  // A block freed for one stream is not handed to another.
  c.give(x, 4000);
  void* z = c.take(4000, &copies);
  EXPECT_NE(z, x);
  // Pointers outside every live block are not this cache's: ignored.
  int outside = 0;
  c.record_use(&outside, &copies);
  c.give(y, 4000);
  c.give(z, 4000);
  c.release();
  EXPECT_EQ(c.reserved_bytes(), 0);
  EXPECT_EQ(raw.outstanding, 0);
}

// --- On a GPU: the device allocator's categories, its reuse, and copies. ---
TEST(CudaDevice, AllocatorCountsByCategoryAndReusesBlocks) {
  std::string why;
  if (!device_available(Device::CUDA, &why)) GTEST_SKIP() << "no CUDA device: " << why;
  MemoryTracker& t = memory_tracker(Device::CUDA);
  const MemStats s0 = t.stats();
  void* p = device_alloc(Device::CUDA, 3 << 20, MemCategory::Params);
  void* g = device_alloc(Device::CUDA, 1000, MemCategory::Grads);
  MemStats s1 = t.stats();
  EXPECT_EQ(s1.current[0] - s0.current[0], 3 << 20);
  EXPECT_EQ(s1.current[1] - s0.current[1], 1000);
  EXPECT_GE(s1.os_reserved, s0.os_reserved);
  std::vector<float> h(1000 / sizeof(float)), back(h.size(), -1.0f);
  for (size_t i = 0; i < h.size(); ++i) h[i] = static_cast<float>(i) * 0.5f;
  dev::copy_from_host(Device::CUDA, g, h.data(), h.size() * sizeof(float));
  dev::copy(Device::CUDA, p, g, h.size() * sizeof(float));
  dev::copy_to_host(Device::CUDA, back.data(), p, back.size() * sizeof(float));
  EXPECT_EQ(back, h);
  dev::zero(Device::CUDA, p, h.size() * sizeof(float));
  dev::copy_to_host(Device::CUDA, back.data(), p, back.size() * sizeof(float));
  EXPECT_EQ(back, std::vector<float>(h.size(), 0.0f));
  device_free(Device::CUDA, g, 1000, MemCategory::Grads);
  device_free(Device::CUDA, p, 3 << 20, MemCategory::Params);
  const MemStats s2 = t.stats();
  EXPECT_EQ(s2.current[0], s0.current[0]);
  EXPECT_EQ(s2.current[1], s0.current[1]);
  EXPECT_EQ(s2.peak[0] - s0.current[0] >= (3 << 20), true);
  // Same sizes again: served from the cache, nothing new reserved.
  void* p2 = device_alloc(Device::CUDA, 3 << 20, MemCategory::Activations);
  EXPECT_EQ(t.stats().os_reserved, s2.os_reserved);
  device_free(Device::CUDA, p2, 3 << 20, MemCategory::Activations);
  synchronize(default_stream(Device::CUDA));
}

#ifdef MT_CUDA_EMU
// The emulated device: every allocation reads as NaN until written (also when the cache hands a
// block out again), copies with a host pointer on the device side fail, and it says what it is.
TEST(CudaDevice, EmulatedMemoryIsNaNUntilWrittenAndCopiesAreChecked) {
  std::string why;
  if (!device_available(Device::CUDA, &why)) GTEST_SKIP() << "the emulated device is hidden: " << why;
  EXPECT_NE(cuda::describe().find("emulator"), std::string::npos) << cuda::describe();
  const size_t n = 1000;
  std::vector<unsigned char> h(n, 0), back(n, 0);
  for (int round = 0; round < 2; ++round) {  // the second allocation is the cached block again
    void* p = device_alloc(Device::CUDA, n, MemCategory::Activations);
    dev::copy_to_host(Device::CUDA, back.data(), p, n);
    EXPECT_EQ(back, std::vector<unsigned char>(n, 0xFF)) << "round " << round;
    dev::copy_from_host(Device::CUDA, p, h.data(), n);
    dev::copy_to_host(Device::CUDA, back.data(), p, n);
    EXPECT_EQ(back, h);
    device_free(Device::CUDA, p, n, MemCategory::Activations);
  }
  try {
    dev::copy_from_host(Device::CUDA, back.data(), h.data(), n);  // a host destination
    ADD_FAILURE() << "copy_from_host into host memory did not throw";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("H2D: invalid argument"), std::string::npos) << e.what();
  }
}

// The hazard of a second stream: a device buffer that a copy on the copy stream still reads is
// freed, and the next allocation of its size must not get it (the copy would read what the new
// owner writes). The emulator runs each copy when it is issued, so the test holds the copy stream
// (emu::hold_stream: its events report "not ready", as a busy stream's would) and checks which
// block the allocator hands out; once the host has waited for the copies, the block is reused.
TEST(CudaDevice, AllocatorWaitsForTheCopyStreamBeforeReusingABlock) {
  std::string why;
  if (!device_available(Device::CUDA, &why)) GTEST_SKIP() << "the emulated device is hidden: " << why;
  const size_t bytes = 3000;
  float* a = static_cast<float*>(device_alloc(Device::CUDA, bytes, MemCategory::Grads));
  float* h = static_cast<float*>(host_alloc_pinned(Device::CUDA, bytes));
  dev::zero(Device::CUDA, a, bytes);
  auto* copies = static_cast<cudaStream_t>(cuda::copy_stream());
  emu::hold_stream(copies, true);
  dev::copy_to_host_async(Device::CUDA, h, a + 10, bytes / 2);  // reads inside the block
  device_free(Device::CUDA, a, bytes, MemCategory::Grads);
  float* b = static_cast<float*>(device_alloc(Device::CUDA, bytes, MemCategory::Activations));
  EXPECT_NE(b, a) << "a block the copy stream still reads was handed out again";
  dev::wait_copies(Device::CUDA);  // the host waited: the copy has finished, the hold ends
  float* c = static_cast<float*>(device_alloc(Device::CUDA, bytes, MemCategory::Activations));
  EXPECT_EQ(c, a) << "the block was not reused once the copy stream had passed it";
  // An upload on the copy stream into a buffer counts as a use too.
  emu::hold_stream(copies, true);
  dev::upload_async(Device::CUDA, c, h, bytes);
  device_free(Device::CUDA, c, bytes, MemCategory::Activations);
  float* d = static_cast<float*>(device_alloc(Device::CUDA, bytes, MemCategory::Activations));
  EXPECT_NE(d, c) << "a block an upload still writes was handed out again";
  emu::hold_stream(copies, false);
  device_free(Device::CUDA, d, bytes, MemCategory::Activations);
  device_free(Device::CUDA, b, bytes, MemCategory::Activations);
  host_free_pinned(Device::CUDA, h);
}
#endif

}  // namespace
}  // namespace mt
