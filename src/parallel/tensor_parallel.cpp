#include "parallel/tensor_parallel.h"

#include <chrono>

namespace mt::parallel {

void ProcessGroupTpComm::run(float* x, int64_t n, comm::ReduceOp op) {
  if (g_->size() == 1) return;
  auto t0 = std::chrono::steady_clock::now();
  g_->all_reduce(x, static_cast<size_t>(n), DType::F32, op)->wait();
  ms_ += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace mt::parallel
