#include "runtime/block_cache.h"

#include <algorithm>
#include <stdexcept>
#include <utility>

#include "runtime/memory.h"

namespace mt {

BlockCache::BlockCache(std::string name, RawAlloc raw_alloc, RawFree raw_free)
    : name_(std::move(name)), raw_alloc_(std::move(raw_alloc)), raw_free_(std::move(raw_free)) {}

BlockCache::~BlockCache() {
  if (events_.destroy)
    for (Pending& b : pending_)
      for (void* e : b.events) events_.destroy(e);
}

size_t BlockCache::size_class(size_t bytes) {
  bytes = std::max<size_t>(bytes, 1);
  constexpr size_t kSmall = size_t(1) << 20, kSmallStep = 512, kLargeStep = size_t(2) << 20;
  if (bytes < kSmall) return (bytes + kSmallStep - 1) & ~(kSmallStep - 1);
  return (bytes + kLargeStep - 1) & ~(kLargeStep - 1);
}

void BlockCache::collect_pending() {
  for (size_t i = 0; i < pending_.size();) {
    Pending& b = pending_[i];
    while (!b.events.empty() && events_.done(b.events.back())) {
      events_.destroy(b.events.back());
      b.events.pop_back();
    }
    if (!b.events.empty()) {
      ++i;
      continue;
    }
    free_[b.sc].push_back({b.p, b.stream});
    pending_bytes_ -= static_cast<int64_t>(b.sc);
    pending_[i] = std::move(pending_.back());
    pending_.pop_back();
  }
}

void* BlockCache::take(size_t bytes, void* stream) {
  const size_t sc = size_class(bytes);
  if (!pending_.empty()) collect_pending();
  auto it = free_.find(sc);
  if (it != free_.end()) {
    std::vector<Free>& bin = it->second;
    for (size_t i = bin.size(); i-- > 0;) {
      if (bin[i].stream != stream) continue;
      void* p = bin[i].p;
      bin.erase(bin.begin() + static_cast<std::ptrdiff_t>(i));
      cached_ -= static_cast<int64_t>(sc);
      live_.emplace(p, Live{sc, stream, {}});
      return p;
    }
  }
  void* p = raw_alloc_(sc);
  if (!p && cached_ > pending_bytes_) {  // out of memory with free blocks of other classes: return them, retry
    release();
    p = raw_alloc_(sc);
  }
  if (!p)
    throw std::runtime_error(name_ + ": out of memory allocating " + format_bytes(static_cast<int64_t>(sc)) + " (" +
                             format_bytes(reserved_) + " already reserved, all in use)");
  ++raw_allocs_;
  reserved_ += static_cast<int64_t>(sc);
  live_.emplace(p, Live{sc, stream, {}});
  return p;
}

void BlockCache::record_use(const void* p, void* stream) {
  auto it = live_.upper_bound(p);
  if (it == live_.begin()) return;
  --it;
  const auto* base = static_cast<const char*>(it->first);
  if (static_cast<const char*>(p) >= base + it->second.sc) return;  // not inside this block
  Live& b = it->second;
  if (stream == b.stream || std::find(b.users.begin(), b.users.end(), stream) != b.users.end()) return;
  if (!events_.record)
    throw std::logic_error(name_ + ": a block is used by a second stream but the cache has no events");
  b.users.push_back(stream);
}

void BlockCache::give(void* p, size_t bytes) {
  if (!p) return;
  auto it = live_.find(p);
  if (it == live_.end())
    throw std::runtime_error(name_ + ": free of a pointer this allocator did not hand out (or freed twice)");
  const size_t sc = size_class(bytes);
  if (it->second.sc != sc)
    throw std::runtime_error(name_ + ": free of a " + format_bytes(static_cast<int64_t>(it->second.sc)) +
                             " block with a byte count of another size class (" +
                             format_bytes(static_cast<int64_t>(bytes)) + ")");
  Live b = std::move(it->second);
  live_.erase(it);
  cached_ += static_cast<int64_t>(sc);
  if (b.users.empty()) {
    free_[sc].push_back({p, b.stream});
    return;
  }
  Pending pend{p, sc, b.stream, {}};
  for (void* s : b.users) pend.events.push_back(events_.record(s));
  pending_.push_back(std::move(pend));
  pending_bytes_ += static_cast<int64_t>(sc);
}

void BlockCache::release() {
  if (!pending_.empty()) collect_pending();
  for (auto& [sc, blocks] : free_) {
    for (const Free& f : blocks) {
      raw_free_(f.p);
      ++raw_frees_;
      reserved_ -= static_cast<int64_t>(sc);
      cached_ -= static_cast<int64_t>(sc);
    }
    blocks.clear();
  }
}

}  // namespace mt
