// A caching block allocator over a raw allocator (cudaMalloc / cudaFree for the CUDA device, see
// runtime/cuda/cuda_device.cpp): freed blocks are kept in bins by size class and handed out again,
// so a training step that allocates the same shapes as the last one makes no raw allocation at all.
//
// Size classes: requests are rounded up to a multiple of 512 bytes below 1 MiB and of 2 MiB from
// 1 MiB up, and a block is reused only for a request of the same class (no splitting, so no
// fragmentation bookkeeping; the rounding bounds the waste). When the raw allocator fails, every
// cached block is returned to it and the request is tried once more.
//
// Ordering: the cache does not know about streams. The CUDA device runs all its work on one stream,
// so a block freed by the host and handed out again is only touched by work queued after the work
// that used it: reuse is stream-ordered. A second stream needs events per block (docs/gpu.md).
// Not thread-safe by itself: the owner holds a lock.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <unordered_map>
#include <vector>

namespace mt {

class BlockCache {
 public:
  // raw_alloc returns nullptr when out of memory; raw_free gets only pointers raw_alloc returned.
  using RawAlloc = std::function<void*(size_t bytes)>;
  using RawFree = std::function<void(void* p)>;
  BlockCache(std::string name, RawAlloc raw_alloc, RawFree raw_free);
  BlockCache(const BlockCache&) = delete;
  BlockCache& operator=(const BlockCache&) = delete;

  // The size class of a request (what a block for it occupies).
  static size_t size_class(size_t bytes);

  // A block of at least `bytes` (0 is treated as 1); throws std::runtime_error naming the device
  // and the sizes when the raw allocator fails even after the cache was emptied.
  void* take(size_t bytes);
  // Returns a block from take(bytes) (the same byte count) to the cache. Throws on a pointer this
  // cache did not hand out or a byte count of another size class (double free, wrong size).
  void give(void* p, size_t bytes);
  // Hands every cached block back to the raw allocator.
  void release();

  int64_t cached_bytes() const { return cached_; }       // free blocks held
  int64_t reserved_bytes() const { return reserved_; }   // obtained from the raw allocator, in total
  int64_t in_use_bytes() const { return reserved_ - cached_; }
  int64_t raw_allocations() const { return raw_allocs_; }  // calls to raw_alloc that succeeded
  int64_t raw_frees() const { return raw_frees_; }

 private:
  std::string name_;
  RawAlloc raw_alloc_;
  RawFree raw_free_;
  std::unordered_map<size_t, std::vector<void*>> free_;  // size class -> free blocks
  std::unordered_map<void*, size_t> live_;               // handed-out block -> size class
  int64_t cached_ = 0, reserved_ = 0, raw_allocs_ = 0, raw_frees_ = 0;
};

}  // namespace mt
