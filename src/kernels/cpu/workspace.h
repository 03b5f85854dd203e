// Private helpers of the CPU kernels (not part of the kernel interface): cached scratch buffers.
#pragma once
#include <cstddef>

namespace mt::kernels::cpu::detail {

// A grow-only scratch buffer accounted as MemCategory::Scratch (the backend's own). It keeps its memory between
// calls (fresh pages are expensive) and only reallocates when a larger size is asked for; the
// contents are not preserved across a reallocation. Not synchronised: use one per thread
// (thread_local) or per call site.
class Scratch {
 public:
  Scratch() = default;
  ~Scratch();
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;

  void* get(size_t bytes);
  template <class T>
  T* as(size_t count) {
    return static_cast<T*>(get(count * sizeof(T)));
  }
  size_t capacity() const { return cap_; }

 private:
  void* p_ = nullptr;
  size_t cap_ = 0;
};

// Elements below which an elementwise loop runs on the calling thread only (an OpenMP fork/join
// costs a few microseconds).
constexpr long kParallelMin = 1 << 14;

}  // namespace mt::kernels::cpu::detail
