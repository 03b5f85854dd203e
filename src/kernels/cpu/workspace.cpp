#include "kernels/cpu/workspace.h"

#include "runtime/memory.h"

namespace mt::kernels::cpu::detail {

Scratch::~Scratch() {
  if (p_) mem_free(p_, cap_, MemCategory::Scratch);
}

void* Scratch::get(size_t bytes) {
  if (bytes <= cap_ && p_) return p_;
  if (p_) mem_free(p_, cap_, MemCategory::Scratch);
  p_ = nullptr;
  cap_ = 0;
  size_t want = bytes < 64 ? 64 : bytes;
  p_ = mem_alloc(want, MemCategory::Scratch);
  cap_ = want;
  return p_;
}

}  // namespace mt::kernels::cpu::detail
