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
  // Activations travel in `dt` (BF16 in bf16 runs: half the bytes; the sums are formed in fp32 and
  // rounded once). F32 (the default) makes them the same as the calls above.
  void set_activation_dtype(DType dt) { act_dt_ = dt; }
  void all_reduce_activations(float* x, int64_t n) override;
  void all_gather_activations(const float* in, float* out, int64_t n) override;
  void reduce_scatter_activations(const float* in, float* out, int64_t n) override;
  // Milliseconds spent in tp collectives since the last call.
  double take_ms() {
    double v = ms_;
    ms_ = 0;
    return v;
  }

 private:
  void run(float* x, int64_t n, comm::ReduceOp op);
  void timed(const comm::WorkHandle& w, std::chrono::steady_clock::time_point t0);
  bf16* staging(Tensor& t, int64_t n);
  std::shared_ptr<comm::ProcessGroup> g_;
  double ms_ = 0;
  DType act_dt_ = DType::F32;
  Tensor in16_, out16_;  // bf16 staging (comm category), grown to the largest message
};

}  // namespace mt::parallel
