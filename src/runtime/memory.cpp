#include "runtime/memory.h"

#include "runtime/host_transfer.h"

#include <sys/mman.h>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <new>
#include <vector>

namespace mt {

namespace {
std::mutex g_mu;

struct Cache {
  std::multimap<size_t, void*> free_blocks;  // rounded size -> block
  int64_t cached = 0;
  int64_t reserved = 0;
};
Cache& cache() {
  static Cache* c = new Cache();  // never destroyed: blocks may be freed during static teardown
  return *c;
}

size_t round_size(size_t bytes) {
  if (bytes == 0) bytes = 1;
  if (bytes <= (1u << 20)) return (bytes + 4095) & ~size_t(4095);
  return (bytes + (1u << 20) - 1) & ~size_t((1u << 20) - 1);
}
}  // namespace

const char* mem_category_name(MemCategory c) {
  static const char* names[kNumMemCategories] = {"params", "grads",     "optimizer", "activations",
                                                 "comm",   "workspace", "scratch"};
  return names[static_cast<int>(c)];
}

MemoryTracker& host_memory_tracker() {
  static MemoryTracker* t = new MemoryTracker();
  return *t;
}

MemoryTracker& pinned_memory_tracker() {
  static MemoryTracker* t = new MemoryTracker();
  return *t;
}

void MemoryTracker::on_alloc(MemCategory c, int64_t bytes) {
  std::lock_guard<std::mutex> lk(g_mu);
  int i = static_cast<int>(c);
  s_.current[i] += bytes;
  if (s_.current[i] > s_.peak[i]) s_.peak[i] = s_.current[i];
  s_.total_current += bytes;
  if (s_.total_current > s_.total_peak) s_.total_peak = s_.total_current;
}

void MemoryTracker::on_free(MemCategory c, int64_t bytes) {
  std::lock_guard<std::mutex> lk(g_mu);
  s_.current[static_cast<int>(c)] -= bytes;
  s_.total_current -= bytes;
}

MemStats MemoryTracker::stats() const {
  std::lock_guard<std::mutex> lk(g_mu);
  MemStats s = s_;
  if (this == &host_memory_tracker()) {  // the caching allocator's figures belong to the host
    s.cached_free = cache().cached;
    s.os_reserved = cache().reserved;
  }
  return s;
}

void MemoryTracker::set_pool(int64_t cached_free, int64_t reserved) {
  std::lock_guard<std::mutex> lk(g_mu);
  s_.cached_free = cached_free;
  s_.os_reserved = reserved;
}

void MemoryTracker::reset_peaks() {
  std::lock_guard<std::mutex> lk(g_mu);
  s_.peak = s_.current;
  s_.total_peak = s_.total_current;
}

void* mem_alloc(size_t bytes, MemCategory c) {
  size_t rs = round_size(bytes);
  void* p = nullptr;
  {
    std::lock_guard<std::mutex> lk(g_mu);
    Cache& ca = cache();
    auto it = ca.free_blocks.find(rs);
    if (it != ca.free_blocks.end()) {
      p = it->second;
      ca.free_blocks.erase(it);
      ca.cached -= static_cast<int64_t>(rs);
    }
  }
  if (!p) {
    p = std::aligned_alloc(4096, rs);
    if (!p) {
      std::fprintf(stderr, "meshtrain: out of host memory allocating %zu bytes for %s\n", bytes,
                   mem_category_name(c));
      throw std::bad_alloc();
    }
    if (rs >= (2u << 20)) madvise(p, rs, MADV_HUGEPAGE);
    std::lock_guard<std::mutex> lk(g_mu);
    cache().reserved += static_cast<int64_t>(rs);
  }
  host_memory_tracker().on_alloc(c, static_cast<int64_t>(bytes));
  return p;
}

void mem_free(void* p, size_t bytes, MemCategory c) {
  if (!p) return;
  host_memory_tracker().on_free(c, static_cast<int64_t>(bytes));
  size_t rs = round_size(bytes);
  std::lock_guard<std::mutex> lk(g_mu);
  cache().free_blocks.emplace(rs, p);
  cache().cached += static_cast<int64_t>(rs);
}

void mem_release_cache() {
  std::lock_guard<std::mutex> lk(g_mu);
  Cache& ca = cache();
  for (auto& kv : ca.free_blocks) {
    std::free(kv.second);
    ca.reserved -= static_cast<int64_t>(kv.first);
  }
  ca.free_blocks.clear();
  ca.cached = 0;
}

std::string format_bytes(int64_t bytes) {
  char buf[64];
  double b = static_cast<double>(bytes);
  const char* unit = "B";
  if (std::abs(b) >= 1024.0 * 1024 * 1024) {
    b /= 1024.0 * 1024 * 1024;
    unit = "GiB";
  } else if (std::abs(b) >= 1024.0 * 1024) {
    b /= 1024.0 * 1024;
    unit = "MiB";
  } else if (std::abs(b) >= 1024.0) {
    b /= 1024.0;
    unit = "KiB";
  }
  std::snprintf(buf, sizeof buf, unit[0] == 'B' ? "%.0f %s" : "%.2f %s", b, unit);
  return buf;
}

}  // namespace mt
