// Context parallelism's transfers for the model (CpComm) over the mesh's cp process group: the
// ring's asynchronous point-to-point exchanges (send to the next cp rank, receive from the
// previous) and, for parallel.cp_mode = allgather, one all-gather and one reduce-scatter per layer
// and direction. take_times() hands the step's communication time and the part the compute thread
// waited for (exposed) to the step's accounting.
#pragma once
#include <memory>
#include <vector>

#include "comm/process_group.h"
#include "model/context_parallel.h"

namespace mt::parallel {

class ProcessGroupCpComm final : public CpComm {
 public:
  explicit ProcessGroupCpComm(std::shared_ptr<comm::ProcessGroup> group) : g_(std::move(group)) {}
  int rank() const override { return g_->rank(); }
  int size() const override { return g_->size(); }
  int start_ring_exchange(const float* send, float* recv, int64_t n, int tag) override;
  void wait(int handle) override;
  void all_gather(const float* in, float* out, int64_t n) override;
  void reduce_scatter_sum(const float* in, float* out, int64_t n) override;
  // Since the last call: milliseconds the cp transfers ran (communication thread; a ring exchange
  // counts as the longer of its send and receive) and the milliseconds the compute thread waited
  // for them.
  void take_times(double* comm_ms, double* exposed_ms) {
    *comm_ms = comm_ms_;
    *exposed_ms = exposed_ms_;
    comm_ms_ = exposed_ms_ = 0;
  }

 private:
  struct Pending {
    comm::WorkHandle send, recv;
    bool active = false;
  };
  std::shared_ptr<comm::ProcessGroup> g_;
  std::vector<Pending> pending_;
  double comm_ms_ = 0, exposed_ms_ = 0;
};

}  // namespace mt::parallel
