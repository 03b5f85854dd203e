#include "parallel/context_parallel.h"

#include <algorithm>
#include <stdexcept>

#include "runtime/clock.h"

namespace mt::parallel {

int ProcessGroupCpComm::start_ring_exchange(const float* send, float* recv, int64_t n, int tag) {
  const int sz = g_->size(), r = g_->rank();
  size_t slot = 0;
  while (slot < pending_.size() && pending_[slot].active) ++slot;
  if (slot == pending_.size()) pending_.emplace_back();
  Pending& p = pending_[slot];
  p.recv = g_->recv(recv, static_cast<size_t>(n), DType::F32, (r - 1 + sz) % sz, tag);
  p.send = g_->send(send, static_cast<size_t>(n), DType::F32, (r + 1) % sz, tag);
  p.active = true;
  return static_cast<int>(slot);
}

void ProcessGroupCpComm::wait(int handle) {
  if (handle < 0 || handle >= static_cast<int>(pending_.size()) || !pending_[static_cast<size_t>(handle)].active)
    throw std::logic_error("context parallelism: wait on a transfer that is not in flight");
  Pending& p = pending_[static_cast<size_t>(handle)];
  const auto t0 = Clock::now();
  p.recv->wait();
  p.send->wait();
  exposed_ms_ += ms_since(t0);
  comm_ms_ += std::max(p.recv->elapsed_ms(), p.send->elapsed_ms());
  p.send.reset();
  p.recv.reset();
  p.active = false;
}

void ProcessGroupCpComm::all_gather(const float* in, float* out, int64_t n) {
  const auto t0 = Clock::now();
  comm::WorkHandle w = g_->all_gather(in, out, static_cast<size_t>(n), DType::F32);
  w->wait();
  exposed_ms_ += ms_since(t0);
  comm_ms_ += w->elapsed_ms();
}

void ProcessGroupCpComm::reduce_scatter_sum(const float* in, float* out, int64_t n) {
  const auto t0 = Clock::now();
  comm::WorkHandle w = g_->reduce_scatter(in, out, static_cast<size_t>(n), DType::F32, comm::ReduceOp::Sum);
  w->wait();
  exposed_ms_ += ms_since(t0);
  comm_ms_ += w->elapsed_ms();
}

}  // namespace mt::parallel
