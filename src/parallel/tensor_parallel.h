// Tensor parallelism's collectives for the model (TpComm) over the mesh's tp process group.
// They sit on the critical path (the next op needs the result), so their whole duration is
// exposed communication; take_ms() hands the accumulated time to the step's accounting.
#pragma once
#include <chrono>
#include <memory>

#include "comm/process_group.h"
#include "model/transformer.h"

namespace mt::parallel {

class ProcessGroupTpComm final : public TpComm {
 public:
  explicit ProcessGroupTpComm(std::shared_ptr<comm::ProcessGroup> group) : g_(std::move(group)) {}
  int rank() const override { return g_->rank(); }
  int size() const override { return g_->size(); }
  void all_reduce_sum(float* x, int64_t n) override { run(x, n, comm::ReduceOp::Sum); }
  void all_reduce_max(float* x, int64_t n) override { run(x, n, comm::ReduceOp::Max); }
  void all_gather(const float* in, float* out, int64_t n) override;
  void reduce_scatter_sum(const float* in, float* out, int64_t n) override;
  // Milliseconds spent in tp collectives since the last call.
  double take_ms() {
    double v = ms_;
    ms_ = 0;
    return v;
  }

 private:
  void run(float* x, int64_t n, comm::ReduceOp op);
  void timed(const comm::WorkHandle& w, std::chrono::steady_clock::time_point t0);
  std::shared_ptr<comm::ProcessGroup> g_;
  double ms_ = 0;
};

}  // namespace mt::parallel
