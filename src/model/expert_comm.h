// Expert parallelism's token exchange as the model sees it: the ranks that hold different experts
// of the same MoE layers (the ep group). The implementation over a process group lives in
// parallel/expert_parallel.h.
#pragma once
#include <cstdint>

#include "runtime/dtype.h"

namespace mt {

class ExpertComm {
 public:
  virtual ~ExpertComm() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // `all` receives every rank's n values, in rank order (size() x n).
  virtual void all_gather_counts(const int64_t* mine, int64_t* all, int64_t n) = 0;
  // Variable-size all-to-all of rows of `row_elems` elements of `dt`: send_rows[r] rows (contiguous,
  // in rank order) go to rank r; recv_rows[r] rows arrive from rank r (contiguous, in rank order).
  // Every rank knows both counts (they come from all_gather_counts), so nothing else is exchanged.
  virtual void all_to_all_v(const void* send, const int64_t* send_rows, void* recv, const int64_t* recv_rows,
                            int64_t row_elems, DType dt) = 0;
};

}  // namespace mt
