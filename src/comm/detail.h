// Internals of the comm layer shared between its source files (not for other layers).
#pragma once
#include "comm/mpi_include.h"

#include <atomic>
#include <chrono>
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
#include "runtime/clock.h"

namespace mt::comm::detail {

using mt::now_ns;  // steady clock, nanoseconds

// Environment knobs, read once (see docs/comm.md).
struct Config {
  bool trace = false;        // MESHTRAIN_DEBUG contains "trace"
  bool desync = false;       // MESHTRAIN_DEBUG contains "desync"
  double timeout_s = 300;    // MESHTRAIN_TIMEOUT_S; 0 disables the watchdog
  int flight_recorder = 64;  // MESHTRAIN_FLIGHT_RECORDER: operations kept per rank
  int poll_max_us = 50;      // MESHTRAIN_COMM_POLL_US: longest sleep between polls of MPI
  // MESHTRAIN_COMM_POLL_IDLE_US: longest sleep while only point-to-point transfers that nobody
  // waits for are in flight (groups within one node); 0 = poll_max_us as for everything else.
  int poll_idle_us = 1000;
  size_t slice_bytes = 16u << 20;  // MESHTRAIN_COMM_SLICE_KB: pipelining slice of reductions
  size_t oneshot_bytes = 16u << 10;  // MESHTRAIN_COMM_ONESHOT_KB: one-round all_reduce up to this
  bool hierarchical = true;  // MESHTRAIN_COMM_HIER=0 turns the two-level all_reduce off
  int fake_node_size = 0;   // MESHTRAIN_COMM_FAKE_NODE_SIZE: pretend nodes of k world ranks (tests)
  int nice = -10;    // MESHTRAIN_COMM_NICE: nice value of communication threads (if permitted)
  int spin_us = 20;  // MESHTRAIN_COMM_SPIN_US: idle thread / wait() poll (yielding) before sleeping
  size_t inline_bytes = 1u << 20;  // MESHTRAIN_COMM_INLINE_KB: InlineScope runs collectives up to this on the caller
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

// out[i] = op over q = 0..n-1 (in that order) of srcs[q][i], accumulated in fp32 for f32 and bf16
// (bf16 inputs widened, result rounded to nearest even once), in their own type for i32 and i64
// (exact; sums wrap around on overflow, Avg is refused). Avg divides the sum by n. `out` may
// alias srcs[q] exactly.
void reduce_into(DType dt, ReduceOp op, int n, const void* const* srcs, void* out, size_t len);
// The same with sources of `in_dt` and output of `out_dt` (equal for integers); Avg divides by
// `divisor` (Sum and Max ignore it). Used for the partial sums of the two-level all_reduce.
void reduce_mixed(DType in_dt, DType out_dt, ReduceOp op, int n, const void* const* srcs,
                  void* out, size_t len, int divisor);
// The type of the two-level all_reduce's partial sums of `dt`: fp32 for the floating types (bf16
// rounded once, at the end), the type itself for integers.
inline DType partial_dtype(DType dt) { return is_integer(dt) ? dt : DType::F32; }

struct Fingerprint {
  uint64_t seq, count;
  int32_t kind, dt, op, root;
  bool operator==(const Fingerprint& o) const {
    return seq == o.seq && count == o.count && kind == o.kind && dt == o.dt && op == o.op &&
           root == o.root;
  }
  bool same_basic(const Fingerprint& o) const {
    return seq == o.seq && count == o.count && kind == o.kind && dt == o.dt;
  }
  // What the desync check compares of a collective: sequence number, kind, dtype, count, op, root.
  static Fingerprint of(const OpDesc& d) {
    return {d.seq, d.count, static_cast<int32_t>(d.kind), static_cast<int32_t>(d.dt), static_cast<int32_t>(d.op),
            static_cast<int32_t>(d.peer)};
  }
  OpDesc desc() const {
    OpDesc d;
    d.kind = static_cast<OpKind>(kind);
    d.dt = static_cast<DType>(dt);
    d.op = static_cast<ReduceOp>(op);
    d.count = count;
    d.peer = root;
    d.seq = seq;
    return d;
  }
};
static_assert(sizeof(Fingerprint) == 32);

// The desync check of collective #seq of `group`: throws CommError("collective desync: rank R
// called X as collective #seq of group G while rank R0 called Y; ...") naming every member whose
// fingerprint differs from group rank 0's (`fps` in group-rank order, `granks` their world ranks).
void check_fingerprints(const std::vector<Fingerprint>& fps, uint64_t seq, const std::string& group,
                        const std::vector<int>& granks);

// One operation of a group, from issue to completion. `phase`, `pos`, `len` and `reqs` are the
// threaded backend's progress state; `fp`, `fps` and `fp_wait` the desync check's (GroupImpl).
struct Op {
  OpDesc d;
  const void* sbuf = nullptr;
  void* rbuf = nullptr;
  WorkHandle work;
  uint64_t fr_id = 0;
  int64_t t_issue = 0, t_start = 0;
  int phase = 0;
  size_t pos = 0, len = 0;  // current slice
  std::vector<MPI_Request> reqs;
  Fingerprint fp{};              // this rank's fingerprint of the collective
  std::vector<Fingerprint> fps;  // every member's (group-rank order), filled by the backend's exchange
  bool fp_wait = false;          // the fingerprint exchange is running; the backend has not started
  bool queued = false;  // handed to the communication thread (counted in GroupImpl::pending)
  bool started = false;  // point-to-point posted by its caller (GroupImpl::issue), polled by the thread
  std::vector<size_t> scounts, rcounts;  // all_to_all_v: elements to / from each group rank
};

// Lets the communication thread sleep longer while only point-to-point transfers are in flight
// that no caller waits for, and wakes it early: a caller starts waiting (waiters > 0) or issues
// something new.
struct Waker {
  std::mutex mu;
  std::condition_variable cv;
  std::atomic<int> waiters{0};
  bool flag = false;  // under mu: woken since the last sleep
  void wake() {
    {
      std::lock_guard<std::mutex> lk(mu);
      flag = true;
    }
    cv.notify_one();
  }
  // Sleeps up to `us` microseconds unless woken; true when woken.
  bool sleep_for(long us) {
    std::unique_lock<std::mutex> lk(mu);
    const bool woken = cv.wait_for(lk, std::chrono::microseconds(us), [&] { return flag; });
    flag = false;
    return woken;
  }
};

// How a group's operations move bytes. The front end (GroupImpl: issue, per-group accounting,
// the flight recorder, the watchdog's view, the desync check, completion, groups of one) is the
// same for every backend. A threaded backend's operations run on the group's communication
// thread: start() once, then progress() until it returns 2 (collectives; in issue order), or
// p2p_done() until true (send / recv, concurrently). Other backends complete an operation inside run(), on the
// calling thread. Backends: MPI (threaded), threads (threaded), Meta (count-only, see
// World::init_meta).
//
// The desync check (MESHTRAIN_DEBUG=desync) is the front end's: before a collective starts it makes
// this rank's fingerprint (op.fp), has the backend exchange it, compares every member's
// (check_fingerprints) and only then calls start(). A backend only carries the fingerprints:
// post_fingerprints(op) starts the exchange of op.fp, fingerprints_ready(op) is true once op.fps
// holds every member's. A backend with no other members to ask (Meta) exchanges none.
class CommBackend {
 public:
  virtual ~CommBackend() = default;
  // Every member runs on this node: a point-to-point transfer here needs no prompt polling by a
  // sender (the receiver copies from shared memory), so a thread with only such transfers in
  // flight and nobody waiting may poll lazily (Config::poll_idle_us).
  virtual bool node_local() const { return false; }
  virtual const char* kind() const = 0;  // "mpi", "meta", "threads"
  virtual bool threaded() const = 0;
  virtual bool exchanges_fingerprints() const { return false; }
  // The exchange costs nothing (shared memory): the check runs before every collective, not only
  // under MESHTRAIN_DEBUG=desync.
  virtual bool fingerprints_free() const { return false; }
  virtual void post_fingerprints(Op& op) { (void)op; }
  virtual bool fingerprints_ready(Op& op) { (void)op; return true; }
  virtual void run(Op& op) { (void)op; }
  virtual void start(Op& op) { (void)op; }
  virtual int progress(Op& op) { (void)op; return 2; }  // 0 waiting, 1 advanced, 2 done
  virtual bool p2p_done(Op& op) { (void)op; return true; }
  // After a failure: forget outstanding requests (the job is ending).
  virtual void abandon() {}
  // Frees communicators and buffers; called once, after the communication thread stopped.
  virtual void shutdown() {}
};

// The MPI backend (mpi_backend.cpp): direct and two-level algorithms over non-blocking MPI
// point-to-point, driven by the communication thread. The desync check's fingerprints travel on its
// control communicator (MPI_Iallgather).
class MpiBackend final : public CommBackend {
 public:
  // Takes ownership of `comm` (size >= 2) and duplicates it for point-to-point and control traffic.
  // Collective over the group (the two-level set-up splits it).
  MpiBackend(const std::string& group_name, MPI_Comm comm);
  const char* kind() const override { return "mpi"; }
  bool threaded() const override { return true; }
  bool node_local() const override { return node_local_; }
  bool exchanges_fingerprints() const override { return true; }
  void post_fingerprints(Op& op) override;
  bool fingerprints_ready(Op& op) override;
  void start(Op& op) override;
  int progress(Op& op) override;
  bool p2p_done(Op& op) override;
  void abandon() override { reqs.clear(); }
  void shutdown() override;
  // The staging buffer (bytes) the algorithms need for `d` on rank r of n; the group's staging
  // grows to the largest (grow-only). The Meta backend accounts the same amount. The two-level
  // all_reduce (groups spanning nodes) is not covered: a Meta world is one node.
  static size_t staging_bytes(const OpDesc& d, int n, int r);

  std::string name;
  int rank = 0, size = 1;
  std::vector<int> granks;
  MPI_Comm coll = MPI_COMM_NULL, p2p = MPI_COMM_NULL, ctrl = MPI_COMM_NULL;
  // Two-level all_reduce for a group spanning several nodes with the same number (>= 2) of its
  // ranks on each: `intra` holds this node's members, `inter` the members with the same local
  // index on every node.
  bool hier = false;
  bool node_local_ = false;  // every member on this node (MPI_COMM_TYPE_SHARED, or the fake nodes)
  MPI_Comm intra = MPI_COMM_NULL, inter = MPI_COMM_NULL;
  int local_n = 1, local_r = 0, nodes_n = 1, node_r = 0;
  int tag_bits = 20;  // collective tags: (seq mod 2^tag_bits) * 4 + phase

 private:
  // What one step of progress() did: posted requests (test them next), finished waiting and
  // moved on, is still waiting on MPI, or completed the operation.
  enum class Step { Posted, Advanced, Waiting, Done };
  struct Block {  // a message's bytes; empty ones are not sent
    char* p;
    size_t bytes;
  };

  void setup_hierarchy();
  void post(bool is_send, void* buf, size_t bytes, int peer, int tag, MPI_Comm comm,
            std::vector<MPI_Request>& into);
  // One direct exchange over the `n` peers of `comm` (this rank is `me`): receives
  // `recv_block(src)` from every peer, then sends `send_block(dst)` to every peer, nearest first.
  template <class RecvBlock, class SendBlock>
  void post_exchange(int n, int me, int tag, MPI_Comm comm, RecvBlock recv_block, SendBlock send_block);
  // Direct all-gather step over `n` peers of `comm`: the `len` elements at `base` (`es` bytes
  // each) are cut with segment(); this rank (`me`) sends its segment to every peer and receives
  // every peer's segment in place.
  void post_allgather(char* base, size_t len, size_t es, int n, int me, int tag, MPI_Comm comm);
  // Direct reduce-scatter step: this rank receives every peer's `slot` bytes of its own segment
  // into the staging buffer (packed in rank order without itself) and sends each peer its
  // segment of the `len` elements at `base`.
  void post_reduce_scatter(char* base, size_t len, size_t es, char* stage, size_t slot, int n, int me, int tag,
                           MPI_Comm comm);
  bool test_all(std::vector<MPI_Request>& r, const char* what, Op& op);
  void* ensure_staging(size_t bytes);
  int coll_tag(const Op& op, int phase) const;

  // The two-level all_reduce's slice at op.pos on this rank: its local segment ls of the slice,
  // its node's sub-segment ss of ls, and in the staging buffer (after the node peers'
  // contributions) the partial sums of ls (in partial_dtype: fp32, or the integer type) and the
  // other nodes' contributions to ss.
  struct TwoLevelSlice {
    size_t es;  // element bytes
    Seg ls, ss;
    DType pdt;  // partial sums' type
    size_t ps;  // and bytes
    char* part;
    char* recv_part;
  };
  TwoLevelSlice two_level_slice(const Op& op) const;

  // The steps of progress(), one per phase (and per kind for the first).
  Step step(Op& op);
  // Waits for the posted requests (`what` names them in errors), then takes step `next`.
  Step when_done(Op& op, const char* what, Step (MpiBackend::*next)(Op&));
  Step start_barrier(Op& op);
  Step start_broadcast(Op& op);
  Step start_all_to_all(Op& op);
  Step start_all_gather(Op& op);
  Step start_one_shot(Op& op);
  Step start_all_reduce_slice(Op& op);
  Step start_reduce_scatter_slice(Op& op);
  Step reduce_own_segment(Op& op);
  Step forward_broadcast(Op& op);
  Step finish_one_shot(Op& op);
  Step start_two_level_slice(Op& op);
  Step reduce_inside_node(Op& op);
  Step reduce_across_nodes(Op& op);
  Step gather_inside_node(Op& op);

  std::vector<MPI_Request> reqs;
  std::vector<MPI_Status> statuses;
  void* staging = nullptr;
  size_t staging_bytes_ = 0;
  std::vector<Fingerprint> fp_all;  // the fingerprint exchange's receive buffer (outlives a failed op)
};

// The Meta backend (meta_backend.cpp): counts, moves nothing; see World::init_meta.
class MetaBackend final : public CommBackend {
 public:
  MetaBackend(int rank_, int size_) : rank(rank_), size(size_) {}
  const char* kind() const override { return "meta"; }
  bool threaded() const override { return false; }
  void run(Op& op) override;
  void shutdown() override;

 private:
  int rank, size;
  void* staging = nullptr;  // Meta device address range of the staging the MPI backend would hold
  size_t staging_bytes = 0;
};

// The thread backend (thread_backend.cpp): the ranks of a group are threads of one process that
// share memory (make_thread_group). Threaded like MPI: a collective completes on each member's
// communication thread once every member has called it (each rank reduces all inputs in rank
// order in fp32, so results equal the MPI backend's direct algorithms bit for bit); send copies
// into the group's mailbox, recv completes when a matching message is there. Its fingerprints
// for the desync check go through shared memory, so the check runs before every collective.
struct ThreadShared;
class ThreadBackend final : public CommBackend {
 public:
  ThreadBackend(std::shared_ptr<ThreadShared> shared, int rank_, int size_)
      : shared_(std::move(shared)), rank(rank_), size(size_) {}
  const char* kind() const override { return "threads"; }
  bool threaded() const override { return true; }
  bool exchanges_fingerprints() const override { return true; }
  bool fingerprints_free() const override { return true; }
  void post_fingerprints(Op& op) override;
  bool fingerprints_ready(Op& op) override;
  void start(Op& op) override;
  int progress(Op& op) override;
  bool p2p_done(Op& op) override;

 private:
  std::shared_ptr<ThreadShared> shared_;
  int rank, size;
  std::vector<unsigned char> result_;  // this rank's output, written once every member has read
};

struct StatsBlock {
  std::string name;
  mutable std::mutex mu;
  CommStats s;
};

// One group: its members, backend, queue and communication thread.
struct GroupImpl {
  GroupImpl(std::string name, int uid, MPI_Comm comm /* owned; MPI_COMM_NULL for size 1 */,
            int world_rank);
  // A group on another backend (Meta, threads): rank `rank` of members `granks`.
  GroupImpl(std::string name, int uid, int rank, std::vector<int> granks, std::unique_ptr<CommBackend> backend);
  ~GroupImpl();

  // Stops the thread after the queued operations completed, frees the communicators.
  void shutdown();
  // Fails pending and future operations with `msg`.
  void fail(const std::string& msg);

  WorkHandle issue(OpDesc d, const void* sbuf, void* rbuf, std::vector<size_t> scounts = {},
                   std::vector<size_t> rcounts = {});

  std::string name;
  int uid = 0;
  int rank = 0, size = 1;
  std::vector<int> granks;
  std::unique_ptr<CommBackend> backend;  // null for a group of one
  std::shared_ptr<StatsBlock> stats;

  // Caller side.
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::unique_ptr<Op>> queue;
  std::atomic<bool> has_work{false};  // queue not empty (read without the lock while spinning)
  std::shared_ptr<Waker> waker = std::make_shared<Waker>();  // shared with the group's Works
  std::thread thr;
  bool stop = false, down = false;
  uint64_t coll_issued = 0, p2p_issued = 0;  // under mu
  std::atomic<uint64_t> issued{0}, started{0}, completed{0};
  std::atomic<uint64_t> idle_polls{0};  // thread_main's polls that completed nothing
  std::atomic<bool> failed{false};
  std::string fail_msg;  // under mu
  // Operations handed to the communication thread and not completed yet (incremented under mu).
  std::atomic<int64_t> pending{0};
  // A collective is running on its caller's thread (InlineScope; under mu): the communication
  // thread starts nothing meanwhile, so the backend is never driven by two threads at once.
  bool inline_busy = false;
  // The communication thread is blocked with nothing in flight (under mu): only then does a
  // send / receive that its caller posted itself need to wake it.
  bool thread_idle = false;
  // Queued sends / receives the thread has not posted yet: while there are any, a caller does not
  // post its own (MPI's order of posting between two ranks is kept).
  std::atomic<int> unposted_p2p{0};

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

 private:
  void thread_main();
  void begin(Op& op);
  void complete(std::unique_ptr<Op> op, const std::string* err);
  void run_local(std::unique_ptr<Op> op);
  void run_inline(std::unique_ptr<Op> op);
  // A collective on a threaded backend, after begin(): the desync check first when it is on (the
  // backend's start only once every member's fingerprint is in and agrees), then the backend's
  // start / progress. progress_collective returns as CommBackend::progress does.
  void start_collective(Op& op);
  int progress_collective(Op& op);
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
