// Internals of the comm layer shared between its source files (not for other layers).
#pragma once
#include "comm/mpi_include.h"

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "comm/process_group.h"

namespace mt::comm::detail {

int64_t now_ns();  // steady clock

// Environment knobs, read once (see docs/comm.md).
struct Config {
  bool trace = false;        // MESHTRAIN_DEBUG contains "trace"
  bool desync = false;       // MESHTRAIN_DEBUG contains "desync"
  double timeout_s = 300;    // MESHTRAIN_TIMEOUT_S; 0 disables the watchdog
  int flight_recorder = 64;  // MESHTRAIN_FLIGHT_RECORDER: operations kept per rank
  int poll_max_us = 50;      // MESHTRAIN_COMM_POLL_US: longest sleep between polls of MPI
  size_t slice_bytes = 16u << 20;  // MESHTRAIN_COMM_SLICE_KB: pipelining slice of reductions
  size_t oneshot_bytes = 16u << 10;  // MESHTRAIN_COMM_ONESHOT_KB: one-round all_reduce up to this
  bool hierarchical = true;  // MESHTRAIN_COMM_HIER=0 turns the two-level all_reduce off
  int fake_node_size = 0;   // MESHTRAIN_COMM_FAKE_NODE_SIZE: pretend nodes of k world ranks (tests)
  int nice = -10;    // MESHTRAIN_COMM_NICE: nice value of communication threads (if permitted)
  int spin_us = 20;  // MESHTRAIN_COMM_SPIN_US: idle thread / wait() poll (yielding) before sleeping
};
const Config& config();
// Re-reads the environment (tests).
void reload_config();

// The world rank of this process for messages (0 before World::init).
int log_rank();
void set_log_rank(int rank, int size);
// Prints one line "meshtrain[rank R]: <msg>" to stderr in a single write.
void log_line(const std::string& msg);

// What an operation is: kind, dtype, count and the extras that must agree across ranks.
struct OpDesc {
  OpKind kind = OpKind::Barrier;
  DType dt = DType::F32;
  ReduceOp op = ReduceOp::Sum;
  uint64_t count = 0;
  int peer = -1;       // root (broadcast) or peer (send/recv), group rank
  int tag = 0;         // send/recv
  uint64_t seq = 0;    // collective number in the group (1-based); p2p: p2p number
};
bool is_p2p(OpKind k);
// "all_reduce(f32, 4096)"; with extras "all_reduce(f32, 4096, sum)", "broadcast(f32, 8, root 0)",
// "send(f32, 8) to rank 3 tag 1" (p2p always include the peer).
std::string describe(const OpDesc& d, bool extras, const std::vector<int>* granks = nullptr);

// Flight recorder: the last K operations of this process, all groups.
uint64_t fr_issue(const std::string& group, const OpDesc& d, int64_t t);
void fr_start(uint64_t id, int64_t t);
void fr_end(uint64_t id, int64_t t, bool ok);
void fr_dump(FILE* f, const std::string& reason);

// A fatal communication error: prints `msg` (and, the first time, the flight recorder), fails every
// group (pending and future operations throw CommError) and ends the job after `grace_s` seconds
// unless the process exits first.
void report_fatal(const std::string& msg, double grace_s);
[[noreturn]] void abort_job(int code);
bool job_failed();

// Balanced partition of `count` elements into n segments; segment i.
struct Seg {
  size_t off, len;
};
inline Seg segment(size_t count, int n, int i) {
  size_t base = count / n, rem = count % n;
  size_t ui = static_cast<size_t>(i);
  return {ui * base + (ui < rem ? ui : rem), base + (ui < rem ? 1 : 0)};
}

// out[i] = op over q = 0..n-1 (in that order) of srcs[q][i], accumulated in fp32 for both dtypes
// (bf16 inputs widened, result rounded to nearest even once). Avg divides the sum by n.
// `out` may alias srcs[q] exactly.
void reduce_into(DType dt, ReduceOp op, int n, const void* const* srcs, void* out, size_t len);
// The same with sources of `in_dt` and output of `out_dt`; Avg divides by `divisor` (Sum and Max
// ignore it). Used for the fp32 partial sums of the two-level all_reduce.
void reduce_mixed(DType in_dt, DType out_dt, ReduceOp op, int n, const void* const* srcs,
                  void* out, size_t len, int divisor);

struct Op;

struct StatsBlock {
  std::string name;
  mutable std::mutex mu;
  CommStats s;
};

// One group: its communicators, its queue and communication thread.
struct GroupImpl {
  GroupImpl(std::string name, int uid, MPI_Comm comm /* owned; MPI_COMM_NULL for size 1 */,
            int world_rank);
  // A Meta group (count-only backend, see World::init_meta): rank `rank` of members `granks`.
  GroupImpl(std::string name, int uid, int rank, std::vector<int> granks);
  ~GroupImpl();

  // Stops the thread after the queued operations completed, frees the communicators.
  void shutdown();
  // Fails pending and future operations with `msg`.
  void fail(const std::string& msg);

  WorkHandle issue(OpDesc d, const void* sbuf, void* rbuf);

  std::string name;
  int uid = 0;
  int rank = 0, size = 1;
  bool meta = false;  // count-only backend: operations complete in the caller, no data moves
  void* meta_staging = nullptr;  // Meta device address range of the staging the MPI backend would hold
  size_t meta_staging_bytes = 0;
  std::vector<int> granks;
  MPI_Comm coll = MPI_COMM_NULL, p2p = MPI_COMM_NULL, ctrl = MPI_COMM_NULL;
  // Two-level all_reduce for a group spanning several nodes with the same number (>= 2) of its
  // ranks on each: `intra` holds this node's members, `inter` the members with the same local
  // index on every node.
  bool hier = false;
  MPI_Comm intra = MPI_COMM_NULL, inter = MPI_COMM_NULL;
  int local_n = 1, local_r = 0, nodes_n = 1, node_r = 0;
  std::shared_ptr<StatsBlock> stats;
  int tag_bits = 20;  // collective tags: (seq mod 2^tag_bits) * 4 + phase

  // Caller side.
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::unique_ptr<Op>> queue;
  std::atomic<bool> has_work{false};  // queue not empty (read without the lock while spinning)
  std::thread thr;
  bool stop = false, down = false;
  uint64_t coll_issued = 0, p2p_issued = 0;  // under mu
  std::atomic<uint64_t> issued{0}, started{0}, completed{0};
  std::atomic<bool> failed{false};
  std::string fail_msg;  // under mu

  // Watchdog view: operations running now.
  struct Active {
    OpDesc d;
    int64_t t_start;
    const Op* op;
  };
  std::mutex act_mu;
  std::vector<Active> active;

  // Size-1 groups: unmatched self send/recv.
  std::deque<std::unique_ptr<Op>> self_sends, self_recvs;

  // Communication-thread state.
  std::vector<MPI_Request> reqs;
  std::vector<MPI_Status> statuses;
  void* staging = nullptr;
  size_t staging_bytes = 0;
  std::vector<unsigned char> fp_all;

 private:
  void thread_main();
  void start(Op& op);
  int step(Op& op);  // 0 waiting, 1 advanced, 2 done
  void complete(std::unique_ptr<Op> op, const std::string* err);
  void run_local(std::unique_ptr<Op> op);
  void run_meta(std::unique_ptr<Op> op);
  void post(bool is_send, void* buf, size_t bytes, int peer, int tag, MPI_Comm comm,
            std::vector<MPI_Request>& into);
  // Direct all-gather step over `n` peers of `comm`: the `len` elements at `base` (`es` bytes
  // each) are cut with segment(); this rank (`me`) sends its segment to every peer and receives
  // every peer's segment in place.
  void post_allgather(char* base, size_t len, size_t es, int n, int me, int tag, MPI_Comm comm,
                      std::vector<MPI_Request>& into);
  bool test_all(std::vector<MPI_Request>& r, const char* what, Op& op);
  void* ensure_staging(size_t bytes);
  void desync_check(Op& op);
  int coll_tag(const Op& op, int phase) const;
  void setup_hierarchy();
};

// Registry of groups (watchdog, finalize) and of their stats (kept after a group is destroyed).
int next_group_uid();
void register_group(const std::shared_ptr<GroupImpl>& g);
std::vector<std::shared_ptr<GroupImpl>> live_groups();
std::shared_ptr<GroupImpl> find_group(int uid);
std::vector<std::shared_ptr<StatsBlock>> all_stats();
void register_stats(const std::shared_ptr<StatsBlock>& s);

// Watchdog: started by World::init on a duplicate of the world communicator (MPI_COMM_NULL
// without MPI), stopped by finalize.
void watchdog_start(MPI_Comm wd_comm);
void watchdog_stop();

}  // namespace mt::comm::detail
