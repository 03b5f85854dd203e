// Tensor parallelism's collectives for the model (TpComm) over the mesh's tp process group.
// Most sit on the critical path (the next op needs the result); the input-gradient reductions of
// the column-parallel layers and the head are started asynchronously and overlap the weight-
// gradient matmuls (Megatron's async tensor-parallel all-reduce). take_times() hands the step's
// communication time and the part of it the compute thread waited for to the step's accounting.
#pragma once
#include <chrono>
#include <memory>
#include <vector>

#include "comm/process_group.h"
#include "model/transformer.h"

namespace mt::parallel {

class ProcessGroupTpComm final : public TpComm {
 public:
  explicit ProcessGroupTpComm(std::shared_ptr<comm::ProcessGroup> group) : g_(std::move(group)) {}
  int rank() const override { return g_->rank(); }
  int size() const override { return g_->size(); }
  void all_reduce_sum(float* x, int64_t n) override;
  void all_reduce_max(float* x, int64_t n) override;
  void all_gather(const float* in, float* out, int64_t n) override;
  void reduce_scatter_sum(const float* in, float* out, int64_t n) override;
  // Activations travel in `dt` (BF16 in bf16 runs: half the bytes; the sums are formed in fp32 and
  // rounded once). F32 (the default) makes them the same as the calls above.
  void set_activation_dtype(DType dt) { act_dt_ = dt; }
  // The blocking forms are started and waited for at once, so they run on this thread like the
  // fp32 ones above (comm::InlineScope): no hand-off to the communication thread and back.
  void all_reduce_activations(float* x, int64_t n) override;
  void all_gather_activations(const float* in, float* out, int64_t n) override;
  void reduce_scatter_activations(const float* in, float* out, int64_t n) override;
  void all_gather_bf16(const bf16* in, bf16* out, int64_t n) override;
  int start_all_reduce_activations(float* x, int64_t n) override;
  int start_all_gather_activations(const float* in, float* out, int64_t n) override;
  int start_reduce_scatter_activations(const float* in, float* out, int64_t n) override;
  int start_all_gather_bf16(const bf16* in, bf16* out, int64_t n) override;
  void wait(int handle) override;
  // Since the last call: milliseconds the tp collectives ran (communication thread) and the
  // milliseconds the compute thread waited for them (exposed).
  void take_times(double* comm_ms, double* exposed_ms) {
    *comm_ms = comm_ms_;
    *exposed_ms = exposed_ms_;
    comm_ms_ = exposed_ms_ = 0;
  }

 private:
  // An operation in flight: its work, and for bf16 transfers the staging buffer and where the
  // widened result goes when it completes.
  struct Pending {
    comm::WorkHandle work;
    Tensor staging;  // bf16 (comm category); kept for reuse
    bf16* result = nullptr;
    float* out = nullptr;
    int64_t n = 0;
    bool active = false;
  };
  int slot();
  bf16* staging(Pending& p, int64_t n);
  template <class Issue>
  int start_two_buffers(const float* in, int64_t n_in, float* out, int64_t n_out, Issue issue);
  void blocking(const comm::WorkHandle& w);
  template <class Issue>
  void blocking_now(Issue issue);
  template <class Start>
  void now(Start start);
  double cast_ms_ = 0;  // the last start_*'s cast of its input to bf16 (compute, not communication)
  std::shared_ptr<comm::ProcessGroup> g_;
  double comm_ms_ = 0, exposed_ms_ = 0;
  DType act_dt_ = DType::F32;
  std::vector<Pending> pending_;
};

}  // namespace mt::parallel
