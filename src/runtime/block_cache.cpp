#include "runtime/block_cache.h"

#include <algorithm>
#include <stdexcept>
#include <utility>

#include "runtime/memory.h"

namespace mt {

BlockCache::BlockCache(std::string name, RawAlloc raw_alloc, RawFree raw_free)
    : name_(std::move(name)), raw_alloc_(std::move(raw_alloc)), raw_free_(std::move(raw_free)) {}

size_t BlockCache::size_class(size_t bytes) {
  bytes = std::max<size_t>(bytes, 1);
  constexpr size_t kSmall = size_t(1) << 20, kSmallStep = 512, kLargeStep = size_t(2) << 20;
  if (bytes < kSmall) return (bytes + kSmallStep - 1) & ~(kSmallStep - 1);
  return (bytes + kLargeStep - 1) & ~(kLargeStep - 1);
}

void* BlockCache::take(size_t bytes) {
  const size_t sc = size_class(bytes);
  auto it = free_.find(sc);
  if (it != free_.end() && !it->second.empty()) {
    void* p = it->second.back();
    it->second.pop_back();
    cached_ -= static_cast<int64_t>(sc);
    live_.emplace(p, sc);
    return p;
  }
  void* p = raw_alloc_(sc);
  if (!p && cached_ > 0) {  // out of memory with free blocks of other classes: return them, retry
    release();
    p = raw_alloc_(sc);
  }
  if (!p)
    throw std::runtime_error(name_ + ": out of memory allocating " + format_bytes(static_cast<int64_t>(sc)) + " (" +
                             format_bytes(reserved_) + " already reserved, all in use)");
  ++raw_allocs_;
  reserved_ += static_cast<int64_t>(sc);
  live_.emplace(p, sc);
  return p;
}

void BlockCache::give(void* p, size_t bytes) {
  if (!p) return;
  auto it = live_.find(p);
  if (it == live_.end())
    throw std::runtime_error(name_ + ": free of a pointer this allocator did not hand out (or freed twice)");
  const size_t sc = size_class(bytes);
  if (it->second != sc)
    throw std::runtime_error(name_ + ": free of a " + format_bytes(static_cast<int64_t>(it->second)) +
                             " block with a byte count of another size class (" +
                             format_bytes(static_cast<int64_t>(bytes)) + ")");
  live_.erase(it);
  free_[sc].push_back(p);
  cached_ += static_cast<int64_t>(sc);
}

void BlockCache::release() {
  for (auto& [sc, blocks] : free_) {
    for (void* p : blocks) {
      raw_free_(p);
      ++raw_frees_;
      reserved_ -= static_cast<int64_t>(sc);
      cached_ -= static_cast<int64_t>(sc);
    }
    blocks.clear();
  }
}

}  // namespace mt
