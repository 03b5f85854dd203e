// The CUDA backend's kernel table (generated from the op registry, kernels/ops.def: every op has
// its kernel, declared in kernels/cuda/kernels.h) and its scratch buffers.
#include <mutex>

#include "kernels/backend.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels.h"
#include "kernels/table_builder.h"

namespace mt::kernels::cuda {

void* scratch(int slot, size_t bytes) {
  struct Slot {
    void* p = nullptr;
    size_t bytes = 0;
  };
  static Slot slots[kNumScratch];
  static std::mutex mu;
  std::lock_guard<std::mutex> lk(mu);
  Slot& s = slots[slot];
  if (s.bytes < bytes) {
    // Work queued earlier on the (single) compute stream may still read the old buffer; the
    // allocator hands it out again only to work queued after this point, so freeing is safe.
    if (s.p) mt::cuda::free(s.p, s.bytes, MemCategory::Scratch);
    s.p = mt::cuda::alloc(bytes, MemCategory::Scratch);
    s.bytes = bytes;
  }
  return s.p;
}

const KernelTable& cuda_table() {
#define MT_TABLE_DEVICE_ Device::CUDA
  static const KernelTable t =
#include "kernels/table_init.inc"
      ;
#undef MT_TABLE_DEVICE_
  return t;
}

}  // namespace mt::kernels::cuda
