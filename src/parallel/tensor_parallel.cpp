#include "parallel/tensor_parallel.h"

#include <algorithm>
#include <chrono>
#include <stdexcept>

#include "kernels/backend.h"
#include "runtime/clock.h"

namespace mt::parallel {

void ProcessGroupTpComm::blocking(const comm::WorkHandle& w) {
  const auto t0 = std::chrono::steady_clock::now();
  w->wait();
  exposed_ms_ += ms_since(t0);
  comm_ms_ += w->elapsed_ms();
}

// The blocking collectives are waited for at once: they run on this thread when the group is
// idle (comm::InlineScope), and all of their time is exposed.
template <class Issue>
void ProcessGroupTpComm::blocking_now(Issue issue) {
  const auto t0 = std::chrono::steady_clock::now();
  comm::WorkHandle w;
  {
    comm::InlineScope inline_scope;
    w = issue();
  }
  w->wait();
  exposed_ms_ += ms_since(t0);
  comm_ms_ += w->elapsed_ms();
}

// A start_* waited for at once: issued inside an InlineScope (it runs here when the group has
// nothing else in flight), and exposed from the issue on, less the cast to bf16 before it.
template <class Start>
void ProcessGroupTpComm::now(Start start) {
  const auto t0 = std::chrono::steady_clock::now();
  int h;
  cast_ms_ = 0;
  {
    comm::InlineScope inline_scope;
    h = start();
  }
  exposed_ms_ += std::max(0.0, ms_since(t0) - cast_ms_);
  wait(h);
}

void ProcessGroupTpComm::all_reduce_activations(float* x, int64_t n) {
  now([&] { return start_all_reduce_activations(x, n); });
}

void ProcessGroupTpComm::all_gather_activations(const float* in, float* out, int64_t n) {
  now([&] { return start_all_gather_activations(in, out, n); });
}

void ProcessGroupTpComm::reduce_scatter_activations(const float* in, float* out, int64_t n) {
  now([&] { return start_reduce_scatter_activations(in, out, n); });
}

void ProcessGroupTpComm::all_gather_bf16(const bf16* in, bf16* out, int64_t n) {
  now([&] { return start_all_gather_bf16(in, out, n); });
}

void ProcessGroupTpComm::all_reduce_sum(float* x, int64_t n) {
  if (g_->size() > 1)
    blocking_now([&] { return g_->all_reduce(x, static_cast<size_t>(n), DType::F32, comm::ReduceOp::Sum); });
}

void ProcessGroupTpComm::all_reduce_max(float* x, int64_t n) {
  if (g_->size() > 1)
    blocking_now([&] { return g_->all_reduce(x, static_cast<size_t>(n), DType::F32, comm::ReduceOp::Max); });
}

void ProcessGroupTpComm::all_gather(const float* in, float* out, int64_t n) {
  blocking_now([&] { return g_->all_gather(in, out, static_cast<size_t>(n), DType::F32); });
}

void ProcessGroupTpComm::reduce_scatter_sum(const float* in, float* out, int64_t n) {
  blocking_now([&] { return g_->reduce_scatter(in, out, static_cast<size_t>(n), DType::F32, comm::ReduceOp::Sum); });
}

int ProcessGroupTpComm::slot() {
  for (size_t i = 0; i < pending_.size(); ++i)
    if (!pending_[i].active) return static_cast<int>(i);
  pending_.emplace_back();
  return static_cast<int>(pending_.size()) - 1;
}

bf16* ProcessGroupTpComm::staging(Pending& p, int64_t n) {
  if (p.staging.numel() < n) p.staging = Tensor::empty({n}, DType::BF16, MemCategory::Comm);
  return p.staging.bf();
}

// The all-reduce works in place (in bf16: on the staging buffer).
int ProcessGroupTpComm::start_all_reduce_activations(float* x, int64_t n) {
  if (g_->size() == 1) return -1;
  const int h = slot();
  Pending& p = pending_[static_cast<size_t>(h)];
  if (act_dt_ == DType::BF16) {
    bf16* b = staging(p, n);
    const auto c0 = std::chrono::steady_clock::now();
    kernels::table(current_device()).cast_f32_to_bf16(b, x, n);
    cast_ms_ = ms_since(c0);
    p.work = g_->all_reduce(b, static_cast<size_t>(n), DType::BF16, comm::ReduceOp::Sum);
    p.result = b;
    p.out = x;
    p.n = n;
  } else {
    p.work = g_->all_reduce(x, static_cast<size_t>(n), DType::F32, comm::ReduceOp::Sum);
    p.out = nullptr;
  }
  p.active = true;
  return h;
}

// Collectives with separate send (n_in elements) and receive (n_out) buffers: in bf16 the input is
// cast to the front of the staging buffer and the result lands behind it.
template <class Issue>
int ProcessGroupTpComm::start_two_buffers(const float* in, int64_t n_in, float* out, int64_t n_out, Issue issue) {
  const int h = slot();
  Pending& p = pending_[static_cast<size_t>(h)];
  if (act_dt_ == DType::BF16) {
    bf16* b = staging(p, n_in + n_out);
    const auto c0 = std::chrono::steady_clock::now();
    kernels::table(current_device()).cast_f32_to_bf16(b, in, n_in);
    cast_ms_ = ms_since(c0);
    p.work = issue(b, b + n_in, DType::BF16);
    p.result = b + n_in;
    p.out = out;
    p.n = n_out;
  } else {
    p.work = issue(in, out, DType::F32);
    p.out = nullptr;
  }
  p.active = true;
  return h;
}

int ProcessGroupTpComm::start_all_gather_activations(const float* in, float* out, int64_t n) {
  return start_two_buffers(in, n, out, n * g_->size(), [&](const void* send, void* recv, DType dt) {
    return g_->all_gather(send, recv, static_cast<size_t>(n), dt);
  });
}

int ProcessGroupTpComm::start_reduce_scatter_activations(const float* in, float* out, int64_t n) {
  return start_two_buffers(in, n * g_->size(), out, n, [&](const void* send, void* recv, DType dt) {
    return g_->reduce_scatter(send, recv, static_cast<size_t>(n), dt, comm::ReduceOp::Sum);
  });
}

int ProcessGroupTpComm::start_all_gather_bf16(const bf16* in, bf16* out, int64_t n) {
  const int h = slot();
  Pending& p = pending_[static_cast<size_t>(h)];
  p.work = g_->all_gather(in, out, static_cast<size_t>(n), DType::BF16);
  p.out = nullptr;
  p.active = true;
  return h;
}

void ProcessGroupTpComm::wait(int handle) {
  if (handle < 0) return;
  if (static_cast<size_t>(handle) >= pending_.size() || !pending_[static_cast<size_t>(handle)].active)
    throw std::logic_error("ProcessGroupTpComm::wait: no such operation in flight");
  Pending& p = pending_[static_cast<size_t>(handle)];
  blocking(p.work);
  if (p.out) kernels::table(current_device()).cast_bf16_to_f32(p.out, p.result, p.n);
  p.work.reset();
  p.active = false;
}

}  // namespace mt::parallel
