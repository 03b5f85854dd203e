// Memory accounting and the caching host allocator (the CPU device's; runtime/device.h has the
// per-device view).
//
// Every byte the engine allocates carries a category. The tracker keeps the bytes currently
// handed out and the peak per category (and of their sum); these are the figures reported as
// "memory per rank by category". The allocator keeps freed blocks in a size-keyed cache and hands
// them out again, because touching fresh pages is very slow on the target machines
// (see docs/design.md); cached-but-free bytes are not counted as in use.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace mt {

// Scratch: buffers a backend's kernels keep for themselves (the CPU GEMM's packing and widening
// blocks, attention tiles, per thread; a GPU library's workspace). Everything else is the engine's
// own and is the same on every backend (what `train --dry-run` reproduces byte for byte).
enum class MemCategory : uint8_t { Params = 0, Grads, Optimizer, Activations, Comm, Workspace, Scratch };
constexpr int kNumMemCategories = 7;
const char* mem_category_name(MemCategory c);

struct MemStats {
  std::array<int64_t, kNumMemCategories> current{};
  std::array<int64_t, kNumMemCategories> peak{};
  int64_t total_current = 0;
  int64_t total_peak = 0;
  int64_t cached_free = 0;   // bytes held by the cache, not in use
  int64_t os_reserved = 0;   // bytes obtained from the OS in total
};

class MemoryTracker {
 public:
  // The tracker of the current device (runtime/device.h): the host's unless a dry run set Meta.
  static MemoryTracker& instance();
  void on_alloc(MemCategory c, int64_t bytes);
  void on_free(MemCategory c, int64_t bytes);
  MemStats stats() const;
  // Peaks restart from the current values (e.g. to measure one step).
  void reset_peaks();
  // A device allocator's own figures (cached free bytes, bytes obtained from the device), reported
  // in stats(); the host tracker takes them from the host allocator instead.
  void set_pool(int64_t cached_free, int64_t reserved);

 private:
  MemStats s_;
};

// The host (CPU device) tracker, whatever the current device.
MemoryTracker& host_memory_tracker();

// Host memory: allocates `bytes` (64-byte aligned, contents unspecified) tagged with category `c`.
void* mem_alloc(size_t bytes, MemCategory c);
void mem_free(void* p, size_t bytes, MemCategory c);
// Returns every cached free block to the OS.
void mem_release_cache();

// Human-readable byte count ("12.3 MiB").
std::string format_bytes(int64_t bytes);

}  // namespace mt
