#include "parallel/tensor_parallel.h"

#include <chrono>

namespace mt::parallel {

void ProcessGroupTpComm::timed(const comm::WorkHandle& w, std::chrono::steady_clock::time_point t0) {
  w->wait();
  ms_ += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

void ProcessGroupTpComm::run(float* x, int64_t n, comm::ReduceOp op) {
  if (g_->size() == 1) return;
  auto t0 = std::chrono::steady_clock::now();
  timed(g_->all_reduce(x, static_cast<size_t>(n), DType::F32, op), t0);
}

void ProcessGroupTpComm::all_gather(const float* in, float* out, int64_t n) {
  auto t0 = std::chrono::steady_clock::now();
  timed(g_->all_gather(in, out, static_cast<size_t>(n), DType::F32), t0);
}

void ProcessGroupTpComm::reduce_scatter_sum(const float* in, float* out, int64_t n) {
  auto t0 = std::chrono::steady_clock::now();
  timed(g_->reduce_scatter(in, out, static_cast<size_t>(n), DType::F32, comm::ReduceOp::Sum), t0);
}

}  // namespace mt::parallel
