#include "parallel/tensor_parallel.h"

#include <chrono>

#include "kernels/activation.h"

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

bf16* ProcessGroupTpComm::staging(Tensor& t, int64_t n) {
  if (t.numel() < n) t = Tensor::empty({n}, DType::BF16, MemCategory::Comm);
  return t.bf();
}

void ProcessGroupTpComm::all_reduce_activations(float* x, int64_t n) {
  if (act_dt_ != DType::BF16 || g_->size() == 1) return all_reduce_sum(x, n);
  bf16* b = staging(in16_, n);
  kernels::cast_f32_to_bf16(b, x, n);
  const auto t0 = std::chrono::steady_clock::now();  // the collective only, not the casts
  timed(g_->all_reduce(b, static_cast<size_t>(n), DType::BF16, comm::ReduceOp::Sum), t0);
  kernels::cast_bf16_to_f32(x, b, n);
}

void ProcessGroupTpComm::all_gather_activations(const float* in, float* out, int64_t n) {
  if (act_dt_ != DType::BF16) return all_gather(in, out, n);
  const int64_t all = n * g_->size();
  bf16* a = staging(in16_, n);
  bf16* b = staging(out16_, all);
  kernels::cast_f32_to_bf16(a, in, n);
  const auto t0 = std::chrono::steady_clock::now();  // the collective only, not the casts
  timed(g_->all_gather(a, b, static_cast<size_t>(n), DType::BF16), t0);
  kernels::cast_bf16_to_f32(out, b, all);
}

void ProcessGroupTpComm::reduce_scatter_activations(const float* in, float* out, int64_t n) {
  if (act_dt_ != DType::BF16) return reduce_scatter_sum(in, out, n);
  const int64_t all = n * g_->size();
  bf16* a = staging(in16_, all);
  bf16* b = staging(out16_, n);
  kernels::cast_f32_to_bf16(a, in, all);
  const auto t0 = std::chrono::steady_clock::now();  // the collective only, not the casts
  timed(g_->reduce_scatter(a, b, static_cast<size_t>(n), DType::BF16, comm::ReduceOp::Sum), t0);
  kernels::cast_bf16_to_f32(out, b, n);
}

}  // namespace mt::parallel
