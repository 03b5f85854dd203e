// Process groups: asynchronous collectives and point-to-point transfers between the ranks of one
// communicator, with per-group accounting and the debugging aids described in docs/comm.md.
//
// Every call returns at once with a WorkHandle; the operation runs on the group's own communication
// thread, which drives MPI while the caller computes (OpenMPI has no background progress). Within
// a group, collectives run one after another in the order they were called; send/recv are posted
// as soon as the communication thread sees them and run concurrently with each other and with the
// collectives. Different groups (tp, dp, ...) have their own thread and communicators and run at
// the same time.
//
// Buffers must stay alive and unchanged (inputs) or untouched (outputs) until the handle finished.
// Ranks (root, dst, src) are ranks within the group.
#pragma once
#include <array>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "runtime/dtype.h"

namespace mt::comm {

enum class ReduceOp : uint8_t { Sum = 0, Avg = 1, Max = 2 };
const char* reduce_op_name(ReduceOp op);

// The kinds of operation a group counts separately.
enum class OpKind : uint8_t { AllReduce = 0, ReduceScatter, AllGather, Broadcast, Send, Recv, Barrier, AllToAllV };
constexpr int kNumOpKinds = 8;
const char* op_kind_name(OpKind k);  // "all_reduce", "reduce_scatter", ...

// A communication failure: desynchronised ranks, a watchdog timeout, an MPI error, a finalized world.
class CommError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Completion handle of one operation.
namespace detail {
struct Waker;
}

class Work {
 public:
  // True once the operation finished. Throws CommError if it failed.
  bool test();
  // Blocks until the operation finished. Throws CommError if it failed (including a watchdog
  // timeout, after which the job is being ended).
  void wait();
  // Milliseconds the operation ran on the communication thread (start to completion); 0 until done.
  double elapsed_ms() const;
  // Milliseconds between the call and the start (waiting behind earlier collectives of the group).
  double queued_ms() const;
  // Steady-clock nanoseconds of the call, the start on the communication thread and the
  // completion (0 while not reached).
  void times_ns(int64_t* issued, int64_t* started, int64_t* ended) const;

  // Internal: created and completed by the process group.
  explicit Work(int64_t issued_ns, std::shared_ptr<detail::Waker> waker = nullptr);
  void mark_started(int64_t ns);
  void finish(int64_t ns, const std::string* error);

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<int> state_{0};  // 0 pending, 1 done, 2 failed
  std::string error_;
  int64_t t_issue_ = 0, t_start_ = 0, t_end_ = 0;
  std::shared_ptr<detail::Waker> waker_;  // the group's: wait() asks its thread to poll promptly
};
using WorkHandle = std::shared_ptr<Work>;

// Waits for every handle (null entries skipped).
void wait_all(const std::vector<WorkHandle>& works);

// Counters of one kind of operation.
struct KindStats {
  uint64_t calls = 0;
  // Algorithm volume per rank, in bytes (see docs/comm.md):
  //   all_reduce      2(n-1)/n x buffer          (ring / reduce-scatter + all-gather)
  //   reduce_scatter  (n-1)/n x full input buffer (n x recv_count elements)
  //   all_gather      (n-1)/n x full output buffer
  //   broadcast       buffer
  //   send, recv      buffer
  //   all_to_all_v    the elements sent to the other ranks
  //   barrier         0
  // For the algorithms this layer uses, this is also what the rank sends (up to the rounding of
  // uneven segments); for a group of size 1 it is 0.
  uint64_t bytes = 0;
  double ms = 0;  // sum of operation durations (start to completion on the communication thread)
};

struct CommStats {
  std::array<KindStats, kNumOpKinds> kinds{};
  KindStats& operator[](OpKind k) { return kinds[static_cast<int>(k)]; }
  const KindStats& operator[](OpKind k) const { return kinds[static_cast<int>(k)]; }
  uint64_t total_calls() const;
  uint64_t total_bytes() const;
  double total_ms() const;
  CommStats& operator+=(const CommStats& o);
};

namespace detail {
struct GroupImpl;
}

// One communicator. Create through World (world(), split()) or DeviceMesh.
class ProcessGroup {
 public:
  explicit ProcessGroup(std::shared_ptr<detail::GroupImpl> impl);
  ~ProcessGroup();
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  int rank() const;
  int size() const;
  const std::string& name() const;
  // World rank of each group rank, in group-rank order.
  std::vector<int> global_ranks() const;

  // In place over `count` elements. Avg divides the sum by size(). bf16 sums accumulate in fp32;
  // i32 and i64 reduce exactly in their own type with Sum or Max (Avg throws CommError), and so
  // does reduce_scatter. Every collective carries every dtype.
  WorkHandle all_reduce(void* buf, size_t count, DType dt, ReduceOp op = ReduceOp::Sum);
  // `send` holds size() x recv_count elements; group rank r receives the reduction of segment r.
  // `recv` may be send + rank() x recv_count (in place).
  WorkHandle reduce_scatter(const void* send, void* recv, size_t recv_count, DType dt,
                            ReduceOp op = ReduceOp::Sum);
  // `recv` receives size() x send_count elements in group-rank order. `send` may be
  // recv + rank() x send_count (in place).
  WorkHandle all_gather(const void* send, void* recv, size_t send_count, DType dt);
  WorkHandle broadcast(void* buf, size_t count, DType dt, int root);
  // Variable-size all-to-all: send_counts[r] elements (contiguous in `send`, in rank order) go to
  // group rank r; recv_counts[r] arrive from r (contiguous in `recv`, in rank order). Every rank
  // must pass counts that agree with its peers' (recv_counts[r] here = send_counts[me] on r);
  // exchange them first (all_gather). The arrays are copied; the buffers belong to the operation
  // until it completes.
  WorkHandle all_to_all_v(const void* send, const size_t* send_counts, void* recv, const size_t* recv_counts,
                          DType dt);
  // Point-to-point; a send matches the recv with the same (source, tag) in posting order.
  // Tags are 0 .. 32767 (the smallest MPI_TAG_UB the MPI standard allows); others are refused.
  WorkHandle send(const void* buf, size_t count, DType dt, int dst, int tag = 0);
  WorkHandle recv(void* buf, size_t count, DType dt, int src, int tag = 0);
  WorkHandle barrier();

  // Accounting of this group (this rank).
  CommStats stats() const;
  // Collectives called on this group so far (the number of the last one).
  uint64_t collectives_called() const;
  // Times the communication thread has polled operations in flight without completing any
  // (diagnostics; lazy point-to-point polling, docs/comm.md).
  uint64_t idle_polls() const;

  detail::GroupImpl& impl() { return *impl_; }

 private:
  std::shared_ptr<detail::GroupImpl> impl_;
};

// While an InlineScope lives on a thread, that thread's collectives of at most
// MESHTRAIN_COMM_INLINE_KB (default 1024 KiB) run on the thread itself, inside the call, when
// their group has nothing else in flight (otherwise they queue as usual). Meant for operations the
// caller waits for at once (tensor parallelism's): it saves the hand-off to the group's
// communication thread and back (two wake-ups, tens of microseconds each on a busy machine). The
// operation is the same - same algorithm, sequence number, accounting, flight recorder entry,
// watchdog view and desync check - only the thread that drives it differs.
class InlineScope {
 public:
  InlineScope();
  ~InlineScope();
  InlineScope(const InlineScope&) = delete;
  InlineScope& operator=(const InlineScope&) = delete;

 private:
  bool prev_;
};

// A group of `n` ranks that are threads of this process (in-process tests and tools): element r is
// rank r's handle, to be used from one thread per rank. Semantics as an MPI group's (asynchronous,
// collectives in call order, rank-order fp32 reductions: the same results bit for bit), with the
// same accounting; no MPI and no World needed.
std::vector<std::shared_ptr<ProcessGroup>> make_thread_group(const std::string& name, int n);

// Accounting of every group this process created, merged by group name (groups with the same name,
// e.g. "dp" of two meshes, add up). Includes groups already destroyed.
std::map<std::string, CommStats> comm_stats_by_group();
// Bytes (algorithm volume, as above) per group name, for the metrics key `comm_bytes_by_group`.
std::map<std::string, uint64_t> comm_bytes_by_group();
// A table (one line per group and kind with calls, bytes, ms) for the run summary.
std::string comm_summary_table();

}  // namespace mt::comm
