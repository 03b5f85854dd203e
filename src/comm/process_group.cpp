// ProcessGroup over MPI: a communication thread per group drives the operations with
// non-blocking MPI point-to-point calls, polling with exponential back-off so that an idle or
// waiting thread sleeps instead of taking a core from compute.
//
// Algorithms (n ranks, buffer of B bytes; see docs/comm.md):
//   all_reduce      up to MESHTRAIN_COMM_ONESHOT_KB: one round, every rank sends B to every peer
//                   and reduces all n itself. Larger: direct reduce-scatter then direct
//                   all-gather, in slices of at most MESHTRAIN_COMM_SLICE_KB: rank r owns segment
//                   r of each slice, receives the n-1 other contributions to it, reduces all n in
//                   rank order in fp32, and sends the result to every peer. Each rank sends
//                   (n-1)/n B twice = the ring volume, in 2 steps instead of 2(n-1).
//                   Groups spanning several nodes (same number >= 2 of ranks on each): two-level,
//                   intra-node reduce-scatter -> inter-node reduce-scatter + all-gather of fp32
//                   partials -> intra-node all-gather.
//   reduce_scatter  the first half of the direct all_reduce.
//   all_gather      every rank sends its part to every peer.
//   broadcast       binomial tree.
//   barrier         MPI_Ibarrier.

#include <pthread.h>
#include <sched.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstring>

#include "comm/detail.h"
#include "runtime/device.h"
#include "runtime/memory.h"

namespace mt::comm {

namespace {
// The source pointers of a local reduction: on the stack up to 64 ranks, on the heap beyond.
struct SourceList {
  const void* small[64];
  std::vector<const void*> big;
  const void** data = small;
  explicit SourceList(size_t n) {
    if (n > 64) {
      big.resize(n);
      data = big.data();
    }
  }
  SourceList(const SourceList&) = delete;
  SourceList& operator=(const SourceList&) = delete;
};
}  // namespace

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return "sum";
    case ReduceOp::Avg: return "avg";
    case ReduceOp::Max: return "max";
  }
  return "?";
}

const char* op_kind_name(OpKind k) {
  static const char* names[kNumOpKinds] = {"all_reduce", "reduce_scatter", "all_gather",
                                           "broadcast",  "send",           "recv",
                                           "barrier"};
  return names[static_cast<int>(k)];
}

// ---------------------------------------------------------------------------------------------
// Work

Work::Work(int64_t issued_ns) : t_issue_(issued_ns) {}

void Work::mark_started(int64_t ns) {
  std::lock_guard<std::mutex> lk(mu_);
  t_start_ = ns;
}

void Work::finish(int64_t ns, const std::string* error) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (state_.load() != 0) return;
    if (!t_start_) t_start_ = ns;
    t_end_ = ns;
    if (error) error_ = *error;
    state_.store(error ? 2 : 1, std::memory_order_release);
  }
  cv_.notify_all();
}

bool Work::test() {
  int s = state_.load(std::memory_order_acquire);
  if (s == 2) {
    std::lock_guard<std::mutex> lk(mu_);
    throw CommError(error_);
  }
  return s == 1;
}

void Work::wait() {
  if (state_.load(std::memory_order_acquire) == 0) {
    // Short operations finish within microseconds: poll (yielding the core) before sleeping.
    const int64_t until = detail::now_ns() + int64_t(detail::config().spin_us) * 1000;
    while (state_.load(std::memory_order_acquire) == 0 && detail::now_ns() < until) sched_yield();
  }
  if (state_.load(std::memory_order_acquire) == 0) {
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait(lk, [&] { return state_.load() != 0; });
  }
  test();
}

double Work::elapsed_ms() const {
  std::lock_guard<std::mutex> lk(mu_);
  return t_end_ ? static_cast<double>(t_end_ - t_start_) / 1e6 : 0.0;
}

double Work::queued_ms() const {
  std::lock_guard<std::mutex> lk(mu_);
  return t_start_ ? static_cast<double>(t_start_ - t_issue_) / 1e6 : 0.0;
}

void wait_all(const std::vector<WorkHandle>& works) {
  for (const auto& w : works)
    if (w) w->wait();
}

// ---------------------------------------------------------------------------------------------
// Stats

uint64_t CommStats::total_calls() const {
  uint64_t t = 0;
  for (const auto& k : kinds) t += k.calls;
  return t;
}
uint64_t CommStats::total_bytes() const {
  uint64_t t = 0;
  for (const auto& k : kinds) t += k.bytes;
  return t;
}
double CommStats::total_ms() const {
  double t = 0;
  for (const auto& k : kinds) t += k.ms;
  return t;
}
CommStats& CommStats::operator+=(const CommStats& o) {
  for (int i = 0; i < kNumOpKinds; ++i) {
    kinds[i].calls += o.kinds[i].calls;
    kinds[i].bytes += o.kinds[i].bytes;
    kinds[i].ms += o.kinds[i].ms;
  }
  return *this;
}

std::map<std::string, CommStats> comm_stats_by_group() {
  std::map<std::string, CommStats> out;
  for (const auto& sb : detail::all_stats()) {
    std::lock_guard<std::mutex> lk(sb->mu);
    out[sb->name] += sb->s;
  }
  return out;
}

std::map<std::string, uint64_t> comm_bytes_by_group() {
  std::map<std::string, uint64_t> out;
  for (const auto& [name, s] : comm_stats_by_group()) out[name] = s.total_bytes();
  return out;
}

std::string comm_summary_table() {
  std::string s;
  char line[256];
  std::snprintf(line, sizeof line, "%-16s %-15s %10s %12s %12s %12s\n", "group", "operation",
                "calls", "bytes/rank", "time ms", "ms/call");
  s += line;
  for (const auto& [name, st] : comm_stats_by_group()) {
    for (int k = 0; k < kNumOpKinds; ++k) {
      const KindStats& ks = st.kinds[k];
      if (!ks.calls) continue;
      std::snprintf(line, sizeof line, "%-16s %-15s %10llu %12s %12.3f %12.4f\n", name.c_str(),
                    op_kind_name(static_cast<OpKind>(k)),
                    static_cast<unsigned long long>(ks.calls),
                    format_bytes(static_cast<int64_t>(ks.bytes)).c_str(), ks.ms,
                    ks.ms / static_cast<double>(ks.calls));
      s += line;
    }
  }
  s += "(bytes: algorithm volume per rank, e.g. 2(n-1)/n x buffer for all_reduce; time: from start "
       "to completion on the communication thread)\n";
  return s;
}

namespace detail {

// Algorithm volume per rank (KindStats::bytes).
static uint64_t algo_bytes(const OpDesc& d, int n) {
  if (n <= 1) return 0;
  const uint64_t es = dtype_size(d.dt), un = static_cast<uint64_t>(n);
  const uint64_t b = d.count * es;
  switch (d.kind) {
    case OpKind::AllReduce: return 2 * (un - 1) * b / un;
    case OpKind::ReduceScatter:  // full input buffer n*count
    case OpKind::AllGather:      // full output buffer n*count
      return (un - 1) * b;
    case OpKind::Broadcast:
    case OpKind::Send:
    case OpKind::Recv: return b;
    case OpKind::Barrier: return 0;
  }
  return 0;
}

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
  Fingerprint fp{};
};

enum Phase : int {
  kDesyncWait = -1,
  kStart = 0,
  kRsWait = 1,
  kAgPost = 2,
  kAgWait = 3,
  kBcRecvWait = 4,
  kBcSendWait = 5,
  kBarrierWait = 6,
  kOneShotWait = 7,
  kHStart = 8,
  kHIntraRsWait = 9,
  kHInterRsWait = 10,
  kHInterAgWait = 11,
  kHIntraAgWait = 12,
};

static std::string mpi_error_string(int rc) {
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, buf, &len) != MPI_SUCCESS) return "MPI error " + std::to_string(rc);
  return std::string(buf, static_cast<size_t>(len));
}

GroupImpl::GroupImpl(std::string name_, int uid_, MPI_Comm comm, int world_rank)
    : name(std::move(name_)), uid(uid_) {
  stats = std::make_shared<StatsBlock>();
  stats->name = name;
  register_stats(stats);
  if (comm == MPI_COMM_NULL) {
    rank = 0;
    size = 1;
    granks = {world_rank};
    return;
  }
  coll = comm;
  MPI_Comm_set_errhandler(coll, MPI_ERRORS_RETURN);
  MPI_Comm_rank(coll, &rank);
  MPI_Comm_size(coll, &size);
  MPI_Comm_dup(coll, &p2p);
  MPI_Comm_dup(coll, &ctrl);
  MPI_Comm_set_errhandler(p2p, MPI_ERRORS_RETURN);
  MPI_Comm_set_errhandler(ctrl, MPI_ERRORS_RETURN);
  MPI_Group g, wg;
  MPI_Comm_group(coll, &g);
  MPI_Comm_group(MPI_COMM_WORLD, &wg);
  std::vector<int> mine(size);
  for (int i = 0; i < size; ++i) mine[i] = i;
  granks.resize(size);
  MPI_Group_translate_ranks(g, size, mine.data(), wg, granks.data());
  MPI_Group_free(&g);
  MPI_Group_free(&wg);
  int* ub = nullptr;
  int flag = 0;
  MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &ub, &flag);
  long tag_ub = (flag && ub) ? *ub : 32767;
  int bits = 0;
  while (bits < 20 && ((1L << (bits + 3)) - 1) <= tag_ub) ++bits;
  tag_bits = bits;
  setup_hierarchy();
}

GroupImpl::GroupImpl(std::string name_, int uid_, int rank_, std::vector<int> granks_)
    : name(std::move(name_)), uid(uid_) {
  stats = std::make_shared<StatsBlock>();
  stats->name = name;
  register_stats(stats);
  meta = true;
  rank = rank_;
  size = static_cast<int>(granks_.size());
  granks = std::move(granks_);
}

// Collective over the group (part of its creation).
void GroupImpl::setup_hierarchy() {
  if (size < 4 || !config().hierarchical) return;
  MPI_Comm local = MPI_COMM_NULL;
  const int fake = config().fake_node_size;
  if (fake > 0)
    MPI_Comm_split(coll, granks[rank] / fake, rank, &local);
  else
    MPI_Comm_split_type(coll, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &local);
  int l = 0, nl = 1;
  MPI_Comm_rank(local, &l);
  MPI_Comm_size(local, &nl);
  int mn = nl, mx = nl;
  MPI_Allreduce(MPI_IN_PLACE, &mn, 1, MPI_INT, MPI_MIN, coll);
  MPI_Allreduce(MPI_IN_PLACE, &mx, 1, MPI_INT, MPI_MAX, coll);
  if (mn != mx || nl < 2 || size / nl < 2) {
    MPI_Comm_free(&local);
    return;
  }
  intra = local;
  MPI_Comm_split(coll, l, rank, &inter);
  MPI_Comm_set_errhandler(intra, MPI_ERRORS_RETURN);
  MPI_Comm_set_errhandler(inter, MPI_ERRORS_RETURN);
  local_n = nl;
  local_r = l;
  MPI_Comm_size(inter, &nodes_n);
  MPI_Comm_rank(inter, &node_r);
  hier = true;
}

GroupImpl::~GroupImpl() { shutdown(); }

void GroupImpl::shutdown() {
  {
    std::lock_guard<std::mutex> lk(mu);
    if (down) return;
    stop = true;
  }
  cv.notify_all();
  if (thr.joinable()) thr.join();
  std::lock_guard<std::mutex> lk(mu);
  down = true;
  int fin = 0;
  MPI_Finalized(&fin);
  if (!fin) {
    for (MPI_Comm* c : {&coll, &p2p, &ctrl, &intra, &inter})
      if (*c != MPI_COMM_NULL) MPI_Comm_free(c);
  }
  if (staging) {
    mem_free(staging, staging_bytes, MemCategory::Comm);
    staging = nullptr;
    staging_bytes = 0;
  }
  if (meta_staging) {
    device_free(Device::Meta, meta_staging, meta_staging_bytes, MemCategory::Comm);
    meta_staging = nullptr;
    meta_staging_bytes = 0;
  }
}

void GroupImpl::fail(const std::string& msg) {
  std::vector<std::unique_ptr<Op>> pending;
  {
    std::lock_guard<std::mutex> lk(mu);
    if (!failed.load()) {
      fail_msg = msg;
      failed = true;
    }
    for (auto& o : self_sends) pending.push_back(std::move(o));
    for (auto& o : self_recvs) pending.push_back(std::move(o));
    self_sends.clear();
    self_recvs.clear();
  }
  cv.notify_all();
  for (auto& o : pending) complete(std::move(o), &msg);
}

WorkHandle GroupImpl::issue(OpDesc d, const void* sbuf, void* rbuf) {
  if ((d.kind == OpKind::Broadcast || is_p2p(d.kind)) && (d.peer < 0 || d.peer >= size)) {
    throw CommError("group " + name + ": " + op_kind_name(d.kind) + " " +
                    (d.kind == OpKind::Broadcast ? "root " : "peer ") + std::to_string(d.peer) +
                    " is not a rank of the group (size " + std::to_string(size) + ")");
  }
  if (is_p2p(d.kind) && (d.tag < 0 || d.tag > 32767))
    throw CommError("group " + name + ": tag " + std::to_string(d.tag) + " outside 0..32767");
  if (d.count && !rbuf && !sbuf) throw CommError("group " + name + ": null buffer");

  auto op = std::make_unique<Op>();
  op->t_issue = now_ns();
  op->work = std::make_shared<Work>(op->t_issue);
  op->sbuf = sbuf;
  op->rbuf = rbuf;
  WorkHandle w = op->work;
  {
    std::lock_guard<std::mutex> lk(mu);
    if (down) throw CommError("group " + name + " used after World::finalize()");
    if (failed.load()) throw CommError(fail_msg);
    if (is_p2p(d.kind)) {
      d.seq = ++p2p_issued;
    } else {
      d.seq = ++coll_issued;
      issued.store(d.seq);
    }
    op->d = d;
    {
      std::lock_guard<std::mutex> sl(stats->mu);
      KindStats& ks = stats->s[d.kind];
      ks.calls++;
      ks.bytes += algo_bytes(d, size);
    }
    op->fr_id = fr_issue(name, d, op->t_issue);
    if (size > 1 && !meta) {
      queue.push_back(std::move(op));
      has_work.store(true, std::memory_order_release);
      if (!thr.joinable()) thr = std::thread([this] { thread_main(); });
    }
  }
  if (op && meta) {
    run_meta(std::move(op));
  } else if (op) {
    run_local(std::move(op));
  } else {
    cv.notify_one();
  }
  return w;
}

// Groups of one rank: everything completes in the caller, without MPI.
void GroupImpl::run_local(std::unique_ptr<Op> op) {
  const size_t bytes = op->d.count * dtype_size(op->d.dt);
  op->t_start = now_ns();
  op->work->mark_started(op->t_start);
  fr_start(op->fr_id, op->t_start);
  switch (op->d.kind) {
    case OpKind::ReduceScatter:
    case OpKind::AllGather:
      if (bytes && op->sbuf != op->rbuf) std::memmove(op->rbuf, op->sbuf, bytes);
      break;
    case OpKind::Send:
    case OpKind::Recv: {
      std::unique_ptr<Op> other;
      {
        std::lock_guard<std::mutex> lk(mu);
        auto& match_q = op->d.kind == OpKind::Send ? self_recvs : self_sends;
        auto& wait_q = op->d.kind == OpKind::Send ? self_sends : self_recvs;
        for (auto it = match_q.begin(); it != match_q.end(); ++it) {
          if ((*it)->d.tag == op->d.tag) {
            other = std::move(*it);
            match_q.erase(it);
            break;
          }
        }
        if (!other) {
          wait_q.push_back(std::move(op));
          return;
        }
      }
      Op* s = op->d.kind == OpKind::Send ? op.get() : other.get();
      Op* r = op->d.kind == OpKind::Send ? other.get() : op.get();
      if (s->d.count != r->d.count || s->d.dt != r->d.dt) {
        std::string err = "group " + name + ": self " + describe(s->d, true) +
                          " does not match " + describe(r->d, true);
        complete(std::move(other), &err);
        complete(std::move(op), &err);
        return;
      }
      if (bytes) std::memcpy(r->rbuf, s->sbuf, bytes);
      complete(std::move(other), nullptr);
      break;
    }
    default:  // all_reduce (sum/avg/max over one rank), broadcast, barrier: nothing to do
      break;
  }
  complete(std::move(op), nullptr);
}

// The staging buffer the MPI backend's algorithms need for `d` on rank r of n (grow-only per
// group): the one-shot all_reduce receives every peer's whole buffer, the ring all_reduce and the
// reduce_scatter one segment of a slice from each peer. The two-level all_reduce (groups spanning
// nodes) is not modelled: a Meta world is one node.
static size_t mpi_staging_bytes(const OpDesc& d, int n, int r) {
  if (n <= 1 || d.count == 0) return 0;
  const size_t es = dtype_size(d.dt);
  const size_t slice_elems = std::max<size_t>(config().slice_bytes / es, size_t(n));
  if (d.kind == OpKind::AllReduce) {
    if (d.count * es <= config().oneshot_bytes && n <= 16) return static_cast<size_t>(n - 1) * d.count * es;
    const size_t len = std::min(slice_elems, static_cast<size_t>(d.count));
    return static_cast<size_t>(n - 1) * segment(len, n, r).len * es;
  }
  if (d.kind == OpKind::ReduceScatter) {
    const size_t len = std::min(std::max<size_t>(slice_elems / n, 1), static_cast<size_t>(d.count));
    return static_cast<size_t>(n - 1) * len * es;
  }
  return 0;
}

// Meta groups: the operation is counted (issue did that), its staging is accounted on the Meta
// device as the MPI backend would hold it, host buffers get their as-if-replicated values (see
// World::init_meta), and it completes at once.
void GroupImpl::run_meta(std::unique_ptr<Op> op) {
  op->t_start = now_ns();
  op->work->mark_started(op->t_start);
  fr_start(op->fr_id, op->t_start);
  const size_t need = mpi_staging_bytes(op->d, size, rank);
  if (need > meta_staging_bytes) {
    if (meta_staging) device_free(Device::Meta, meta_staging, meta_staging_bytes, MemCategory::Comm);
    meta_staging = device_alloc(Device::Meta, need, MemCategory::Comm);
    meta_staging_bytes = need;
  }
  const size_t es = dtype_size(op->d.dt), part = op->d.count * es;
  const bool host_recv = op->rbuf && !is_meta_pointer(op->rbuf);
  auto times_n = [&](void* buf, size_t count) {
    if (op->d.op != ReduceOp::Sum || op->d.dt != DType::F32) return;
    float* f = static_cast<float*>(buf);
    for (size_t i = 0; i < count; ++i) f[i] *= static_cast<float>(size);
  };
  if (host_recv && part) {
    switch (op->d.kind) {
      case OpKind::AllGather: {
        char* recv = static_cast<char*>(op->rbuf);
        const char* mine = recv + static_cast<size_t>(rank) * part;
        if (op->sbuf != mine) std::memmove(recv + static_cast<size_t>(rank) * part, op->sbuf, part);
        for (int q = 0; q < size; ++q)
          if (q != rank) std::memcpy(recv + static_cast<size_t>(q) * part, recv + static_cast<size_t>(rank) * part, part);
        break;
      }
      case OpKind::ReduceScatter: {
        const char* seg = static_cast<const char*>(op->sbuf) + static_cast<size_t>(rank) * part;
        if (seg != op->rbuf) std::memmove(op->rbuf, seg, part);
        times_n(op->rbuf, op->d.count);
        break;
      }
      case OpKind::AllReduce:
        times_n(op->rbuf, op->d.count);
        break;
      case OpKind::Recv:
        std::memset(op->rbuf, 0, part);
        break;
      default:
        break;
    }
  }
  complete(std::move(op), nullptr);
}

void GroupImpl::complete(std::unique_ptr<Op> op, const std::string* err) {
  const int64_t t = now_ns();
  if (!op->t_start) op->t_start = t;
  {
    std::lock_guard<std::mutex> lk(act_mu);
    for (size_t i = 0; i < active.size(); ++i) {
      if (active[i].op == op.get()) {
        active.erase(active.begin() + static_cast<long>(i));
        break;
      }
    }
  }
  if (!is_p2p(op->d.kind) && !err) completed.store(op->d.seq);
  const double ms = static_cast<double>(t - op->t_start) / 1e6;
  {
    std::lock_guard<std::mutex> lk(stats->mu);
    stats->s[op->d.kind].ms += ms;
  }
  fr_end(op->fr_id, t, err == nullptr);
  if (config().trace) {
    char buf[96];
    std::snprintf(buf, sizeof buf, ": %.3f ms (queued %.3f ms)%s", ms,
                  static_cast<double>(op->t_start - op->t_issue) / 1e6, err ? " FAILED" : "");
    std::string seq = is_p2p(op->d.kind) ? "p" : "#";
    log_line("trace group " + name + " " + seq + std::to_string(op->d.seq) + " " +
             describe(op->d, true, &granks) + buf);
  }
  op->work->finish(t, err);
}

// ---------------------------------------------------------------------------------------------
// Communication thread

void* GroupImpl::ensure_staging(size_t bytes) {
  if (bytes > staging_bytes) {
    if (staging) mem_free(staging, staging_bytes, MemCategory::Comm);
    staging = mem_alloc(bytes, MemCategory::Comm);
    staging_bytes = bytes;
  }
  return staging;
}

void GroupImpl::post(bool is_send, void* buf, size_t bytes, int peer, int tag, MPI_Comm comm,
                     std::vector<MPI_Request>& into) {
  // Messages over 1 GiB go as several (MPI counts are int); the receiver splits identically.
  constexpr size_t kMax = size_t(1) << 30;
  char* p = static_cast<char*>(buf);
  do {
    const size_t n = std::min(bytes, kMax);
    MPI_Request r;
    int rc = is_send ? MPI_Isend(p, static_cast<int>(n), MPI_BYTE, peer, tag, comm, &r)
                     : MPI_Irecv(p, static_cast<int>(n), MPI_BYTE, peer, tag, comm, &r);
    if (rc != MPI_SUCCESS)
      throw CommError("group " + name + ": " + (is_send ? "MPI_Isend" : "MPI_Irecv") +
                      " failed: " + mpi_error_string(rc));
    into.push_back(r);
    p += n;
    bytes -= n;
  } while (bytes > 0);
}

void GroupImpl::post_allgather(char* base, size_t len, size_t es, int n, int me, int tag, MPI_Comm comm,
                               std::vector<MPI_Request>& into) {
  for (int k = 1; k < n; ++k) {
    const int src = (me - k + n) % n;
    const Seg s = segment(len, n, src);
    if (s.len) post(false, base + s.off * es, s.len * es, src, tag, comm, into);
  }
  const Seg mine = segment(len, n, me);
  if (mine.len)
    for (int k = 1; k < n; ++k) post(true, base + mine.off * es, mine.len * es, (me + k) % n, tag, comm, into);
}

bool GroupImpl::test_all(std::vector<MPI_Request>& r, const char* what, Op& op) {
  if (r.empty()) return true;
  int flag = 0;
  statuses.resize(r.size());
  int rc = MPI_Testall(static_cast<int>(r.size()), r.data(), &flag, statuses.data());
  if (rc != MPI_SUCCESS) {
    int code = rc;
    if (rc == MPI_ERR_IN_STATUS) {
      for (auto& s : statuses)
        if (s.MPI_ERROR != MPI_SUCCESS && s.MPI_ERROR != MPI_ERR_PENDING) code = s.MPI_ERROR;
    }
    throw CommError("group " + name + ": " + what + " of " + describe(op.d, true, &granks) +
                    (is_p2p(op.d.kind) ? "" : " (collective #" + std::to_string(op.d.seq) + ")") +
                    " failed: " + mpi_error_string(code));
  }
  if (flag) r.clear();
  return flag != 0;
}

int GroupImpl::coll_tag(const Op& op, int phase) const {
  const uint64_t mask = (uint64_t(1) << tag_bits) - 1;
  return static_cast<int>(((op.d.seq & mask) << 2) | static_cast<uint64_t>(phase));
}

void GroupImpl::start(Op& op) {
  op.t_start = now_ns();
  op.work->mark_started(op.t_start);
  fr_start(op.fr_id, op.t_start);
  {
    std::lock_guard<std::mutex> lk(act_mu);
    active.push_back({op.d, op.t_start, &op});
  }
  if (is_p2p(op.d.kind)) {
    const size_t bytes = op.d.count * dtype_size(op.d.dt);
    if (op.d.kind == OpKind::Send)
      post(true, const_cast<void*>(op.sbuf), bytes, op.d.peer, op.d.tag, p2p, op.reqs);
    else
      post(false, op.rbuf, bytes, op.d.peer, op.d.tag, p2p, op.reqs);
    return;
  }
  started.store(op.d.seq);
  op.phase = kStart;
  if (config().desync) {
    op.fp = Fingerprint{op.d.seq, op.d.count, static_cast<int32_t>(op.d.kind),
                        static_cast<int32_t>(op.d.dt), static_cast<int32_t>(op.d.op),
                        static_cast<int32_t>(op.d.peer)};
    fp_all.resize(sizeof(Fingerprint) * static_cast<size_t>(size));
    MPI_Request r;
    int rc = MPI_Iallgather(&op.fp, sizeof(Fingerprint), MPI_BYTE, fp_all.data(),
                            sizeof(Fingerprint), MPI_BYTE, ctrl, &r);
    if (rc != MPI_SUCCESS)
      throw CommError("group " + name + ": fingerprint exchange failed: " + mpi_error_string(rc));
    reqs.push_back(r);
    op.phase = kDesyncWait;
  }
}

void GroupImpl::desync_check(Op& op) {
  std::vector<Fingerprint> fps(static_cast<size_t>(size));
  std::memcpy(fps.data(), fp_all.data(), fp_all.size());
  std::string msg;
  int bad = 0;
  for (int q = 1; q < size; ++q) {
    if (fps[q] == fps[0]) continue;
    const bool extras = fps[q].same_basic(fps[0]);
    std::string line = "rank " + std::to_string(granks[q]) + " called " +
                       describe(fps[q].desc(), extras) + " as collective #" +
                       std::to_string(op.d.seq) + " of group " + name + " while rank " +
                       std::to_string(granks[0]) + " called " + describe(fps[0].desc(), extras);
    if (bad == 0) msg = "collective desync: " + line;
    else msg += "; " + line;
    ++bad;
  }
  if (bad) throw CommError(msg);
}

// Advances `op`; returns 0 when waiting on MPI, 1 when it moved to a later phase, 2 when done.
int GroupImpl::step(Op& op) {
  const int n = size, r = rank;
  const size_t es = dtype_size(op.d.dt);
  const OpKind kind = op.d.kind;
  int advanced = 0;
  for (;;) {
    switch (op.phase) {
      case kDesyncWait:
        if (!test_all(reqs, "fingerprint exchange", op)) return advanced;
        desync_check(op);
        op.phase = kStart;
        advanced = 1;
        break;

      case kStart: {
        if (kind == OpKind::Barrier) {
          MPI_Request req;
          int rc = MPI_Ibarrier(coll, &req);
          if (rc != MPI_SUCCESS)
            throw CommError("group " + name + ": MPI_Ibarrier failed: " + mpi_error_string(rc));
          reqs.push_back(req);
          op.phase = kBarrierWait;
          break;
        }
        if (kind == OpKind::Broadcast) {
          const int vr = (r - static_cast<int>(op.d.peer) + n) % n;
          if (vr != 0 && op.d.count) {
            int mask = 1;
            while (!(vr & mask)) mask <<= 1;
            const int parent = (vr - mask + static_cast<int>(op.d.peer)) % n;
            post(false, op.rbuf, op.d.count * es, parent, coll_tag(op, 2), coll, reqs);
          }
          op.phase = kBcRecvWait;
          break;
        }
        if (kind == OpKind::AllGather) {
          char* recv = static_cast<char*>(op.rbuf);
          const size_t part = op.d.count * es;
          if (part && op.sbuf != recv + static_cast<size_t>(r) * part)
            std::memcpy(recv + static_cast<size_t>(r) * part, op.sbuf, part);
          if (part) {
            for (int k = 1; k < n; ++k) {
              const int src = (r - k + n) % n;
              post(false, recv + static_cast<size_t>(src) * part, part, src, coll_tag(op, 1), coll,
                   reqs);
            }
            for (int k = 1; k < n; ++k) {
              const int dst = (r + k) % n;
              post(true, recv + static_cast<size_t>(r) * part, part, dst, coll_tag(op, 1), coll,
                   reqs);
            }
          }
          op.phase = kAgWait;
          break;
        }
        // all_reduce / reduce_scatter: reduce-scatter step of the slice at op.pos.
        const size_t slice_elems = std::max<size_t>(config().slice_bytes / es, size_t(n));
        if (kind == OpKind::AllReduce && op.pos == 0 && op.d.count &&
            op.d.count * es <= config().oneshot_bytes && n <= 16) {
          // Small: one round. Every rank sends its whole buffer to every peer and reduces all n
          // in rank order itself (the same inputs in the same order on every rank).
          const size_t bytes = op.d.count * es;
          char* stage =
              static_cast<char*>(ensure_staging(static_cast<size_t>(n - 1) * bytes));
          for (int k = 1; k < n; ++k) {
            const int src = (r - k + n) % n;
            post(false, stage + (src < r ? src : src - 1) * bytes, bytes, src, coll_tag(op, 3),
                 coll, reqs);
          }
          for (int k = 1; k < n; ++k)
            post(true, op.rbuf, bytes, (r + k) % n, coll_tag(op, 3), coll, reqs);
          op.phase = kOneShotWait;
          break;
        }
        if (kind == OpKind::AllReduce && hier) {
          op.phase = kHStart;
          break;
        }
        if (kind == OpKind::AllReduce) {
          if (op.pos >= op.d.count) return 2;
          op.len = std::min(slice_elems, op.d.count - op.pos);
          const Seg mine = segment(op.len, n, r);
          char* base = static_cast<char*>(op.rbuf) + op.pos * es;
          const size_t slot = mine.len * es;
          char* stage = static_cast<char*>(ensure_staging(static_cast<size_t>(n - 1) * slot));
          if (slot) {
            for (int k = 1; k < n; ++k) {
              const int src = (r - k + n) % n;
              const int idx = src < r ? src : src - 1;
              post(false, stage + idx * slot, slot, src, coll_tag(op, 0), coll, reqs);
            }
          }
          for (int k = 1; k < n; ++k) {
            const int dst = (r + k) % n;
            const Seg s = segment(op.len, n, dst);
            if (s.len) post(true, base + s.off * es, s.len * es, dst, coll_tag(op, 0), coll, reqs);
          }
        } else {  // reduce_scatter: slice [pos, pos+len) of every segment
          const size_t rc = op.d.count;
          if (op.pos >= rc) return 2;
          const size_t seg_slice = std::max<size_t>(slice_elems / n, 1);
          op.len = std::min(seg_slice, rc - op.pos);
          const size_t slot = op.len * es;
          char* stage = static_cast<char*>(ensure_staging(static_cast<size_t>(n - 1) * slot));
          const char* send = static_cast<const char*>(op.sbuf);
          for (int k = 1; k < n; ++k) {
            const int src = (r - k + n) % n;
            const int idx = src < r ? src : src - 1;
            post(false, stage + idx * slot, slot, src, coll_tag(op, 0), coll, reqs);
          }
          for (int k = 1; k < n; ++k) {
            const int dst = (r + k) % n;
            post(true, const_cast<char*>(send) + (dst * rc + op.pos) * es, slot, dst,
                 coll_tag(op, 0), coll, reqs);
          }
        }
        op.phase = kRsWait;
        break;
      }

      case kRsWait: {
        if (!test_all(reqs, "reduce-scatter step", op)) return advanced;
        SourceList srcs(n);
        const void** sp = srcs.data;
        const char* stage = static_cast<const char*>(staging);
        if (kind == OpKind::AllReduce) {
          const Seg mine = segment(op.len, n, r);
          char* own = static_cast<char*>(op.rbuf) + (op.pos + mine.off) * es;
          const size_t slot = mine.len * es;
          for (int q = 0; q < n; ++q) sp[q] = q == r ? own : stage + (q < r ? q : q - 1) * slot;
          reduce_into(op.d.dt, op.d.op, n, sp, own, mine.len);
          op.phase = kAgPost;
        } else {
          const size_t rc = op.d.count, slot = op.len * es;
          const char* send = static_cast<const char*>(op.sbuf);
          for (int q = 0; q < n; ++q)
            sp[q] = q == r ? send + (r * rc + op.pos) * es : stage + (q < r ? q : q - 1) * slot;
          reduce_into(op.d.dt, op.d.op, n, sp, static_cast<char*>(op.rbuf) + op.pos * es, op.len);
          op.pos += op.len;
          if (op.pos >= rc) return 2;
          op.phase = kStart;
        }
        advanced = 1;
        break;
      }

      case kAgPost: {  // all_reduce: send the reduced segment to every peer
        post_allgather(static_cast<char*>(op.rbuf) + op.pos * es, op.len, es, n, r, coll_tag(op, 1), coll, reqs);
        op.phase = kAgWait;
        break;
      }

      case kAgWait:
        if (!test_all(reqs, "all-gather step", op)) return advanced;
        if (kind == OpKind::AllGather) return 2;
        op.pos += op.len;
        if (op.pos >= op.d.count) return 2;
        op.phase = kStart;
        advanced = 1;
        break;

      case kBcRecvWait: {
        if (!test_all(reqs, "broadcast receive", op)) return advanced;
        const int root = op.d.peer;
        const int vr = (r - root + n) % n;
        int mask = 1;
        while (mask < n && !(vr & mask)) mask <<= 1;
        for (mask >>= 1; mask > 0; mask >>= 1) {
          if (vr + mask < n && op.d.count)
            post(true, op.rbuf, op.d.count * es, (vr + mask + root) % n, coll_tag(op, 2), coll,
                 reqs);
        }
        op.phase = kBcSendWait;
        advanced = 1;
        break;
      }

      case kBcSendWait:
        if (!test_all(reqs, "broadcast send", op)) return advanced;
        return 2;

      case kBarrierWait:
        if (!test_all(reqs, "barrier", op)) return advanced;
        return 2;

      // Two-level all_reduce, per slice [pos, pos+len): (1) reduce-scatter inside the node: local
      // rank l owns local segment ls; (2) its fp32 partial sums are reduce-scattered and
      // all-gathered across nodes among the ranks with local index l (sub-segment ss per node),
      // the final values rounded once; (3) all-gather inside the node.
      case kHStart: {
        if (op.pos >= op.d.count) return 2;
        const size_t slice_elems = std::max<size_t>(config().slice_bytes / es, size_t(n));
        op.len = std::min(slice_elems, op.d.count - op.pos);
        const int L = local_n, l = local_r;
        const Seg ls = segment(op.len, L, l);
        const Seg ss = segment(ls.len, nodes_n, node_r);
        const size_t a_bytes = static_cast<size_t>(L - 1) * ls.len * es;
        const size_t p_bytes = ls.len * 4;
        const size_t b_bytes = static_cast<size_t>(nodes_n - 1) * ss.len * 4;
        char* stage = static_cast<char*>(ensure_staging(a_bytes + p_bytes + b_bytes));
        char* base = static_cast<char*>(op.rbuf) + op.pos * es;
        if (ls.len) {
          for (int k = 1; k < L; ++k) {
            const int src = (l - k + L) % L;
            post(false, stage + (src < l ? src : src - 1) * ls.len * es, ls.len * es, src,
                 coll_tag(op, 0), intra, reqs);
          }
        }
        for (int k = 1; k < L; ++k) {
          const int dst = (l + k) % L;
          const Seg s2 = segment(op.len, L, dst);
          if (s2.len) post(true, base + s2.off * es, s2.len * es, dst, coll_tag(op, 0), intra, reqs);
        }
        op.phase = kHIntraRsWait;
        break;
      }

      case kHIntraRsWait: {
        if (!test_all(reqs, "intra-node reduce-scatter step", op)) return advanced;
        const int L = local_n, l = local_r, N = nodes_n, k0 = node_r;
        const Seg ls = segment(op.len, L, l);
        const Seg ss = segment(ls.len, N, k0);
        char* stage = static_cast<char*>(staging);
        char* part = stage + static_cast<size_t>(L - 1) * ls.len * es;  // fp32 partial sums
        char* recv32 = part + ls.len * 4;
        char* base = static_cast<char*>(op.rbuf) + op.pos * es;
        SourceList srcs(std::max(L, N));
        const void** sp = srcs.data;
        for (int q = 0; q < L; ++q)
          sp[q] = q == l ? base + ls.off * es : stage + (q < l ? q : q - 1) * ls.len * es;
        const ReduceOp partial = op.d.op == ReduceOp::Max ? ReduceOp::Max : ReduceOp::Sum;
        reduce_mixed(op.d.dt, DType::F32, partial, L, sp, part, ls.len, 1);
        if (ss.len) {
          for (int k = 1; k < N; ++k) {
            const int src = (k0 - k + N) % N;
            post(false, recv32 + (src < k0 ? src : src - 1) * ss.len * 4, ss.len * 4, src,
                 coll_tag(op, 1), inter, reqs);
          }
        }
        for (int k = 1; k < N; ++k) {
          const int dst = (k0 + k) % N;
          const Seg s2 = segment(ls.len, N, dst);
          if (s2.len) post(true, part + s2.off * 4, s2.len * 4, dst, coll_tag(op, 1), inter, reqs);
        }
        op.phase = kHInterRsWait;
        advanced = 1;
        break;
      }

      case kHInterRsWait: {
        if (!test_all(reqs, "inter-node reduce-scatter step", op)) return advanced;
        const int L = local_n, l = local_r, N = nodes_n, k0 = node_r;
        const Seg ls = segment(op.len, L, l);
        const Seg ss = segment(ls.len, N, k0);
        char* part = static_cast<char*>(staging) + static_cast<size_t>(L - 1) * ls.len * es;
        char* recv32 = part + ls.len * 4;
        char* seg = static_cast<char*>(op.rbuf) + (op.pos + ls.off) * es;
        SourceList srcs(N);
        const void** sp = srcs.data;
        for (int q = 0; q < N; ++q)
          sp[q] = q == k0 ? part + ss.off * 4 : recv32 + (q < k0 ? q : q - 1) * ss.len * 4;
        reduce_mixed(DType::F32, op.d.dt, op.d.op, N, sp, seg + ss.off * es, ss.len, n);
        post_allgather(seg, ls.len, es, N, k0, coll_tag(op, 2), inter, reqs);
        op.phase = kHInterAgWait;
        advanced = 1;
        break;
      }

      case kHInterAgWait: {
        if (!test_all(reqs, "inter-node all-gather step", op)) return advanced;
        const int L = local_n, l = local_r;
        post_allgather(static_cast<char*>(op.rbuf) + op.pos * es, op.len, es, L, l, coll_tag(op, 3), intra, reqs);
        op.phase = kHIntraAgWait;
        advanced = 1;
        break;
      }

      case kHIntraAgWait:
        if (!test_all(reqs, "intra-node all-gather step", op)) return advanced;
        op.pos += op.len;
        op.phase = kHStart;
        advanced = 1;
        break;

      case kOneShotWait: {
        if (!test_all(reqs, "all-reduce exchange", op)) return advanced;
        SourceList srcs(n);
        const void** sp = srcs.data;
        const size_t bytes = op.d.count * es;
        const char* stage = static_cast<const char*>(staging);
        for (int q = 0; q < n; ++q) sp[q] = q == r ? op.rbuf : stage + (q < r ? q : q - 1) * bytes;
        reduce_into(op.d.dt, op.d.op, n, sp, op.rbuf, op.d.count);
        return 2;
      }

      default:
        throw CommError("group " + name + ": internal error (phase " + std::to_string(op.phase) +
                        ")");
    }
  }
}

// Waiting for MPI with nothing to do: 24 tight polls, 24 yielding polls, then sleeps of 1, 2, 4,
// ... us up to max_us (reset by the caller whenever something completes). (Sleeps proportional to
// the time already waited were tried: more wake-ups, no gain for all_reduce and less bandwidth for
// all_gather on the shared 2-core machine, where they compete with the peer thread's copy.)
static void backoff(unsigned idle, int max_us) {
  constexpr unsigned kSpins = 48;
  if (idle < kSpins) {
    if (idle >= kSpins / 2) sched_yield();
    return;
  }
  if (max_us <= 0) {
    sched_yield();
    return;
  }
  const unsigned k = std::min(idle - kSpins, 16u);
  const long us = std::min<long>(max_us, 1L << k);
  struct timespec ts {
    0, us * 1000
  };
  nanosleep(&ts, nullptr);
}

void GroupImpl::thread_main() {
  prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);  // 1 us: short sleeps stay short
  // A higher scheduling weight than the compute threads (like a high-priority stream): when a
  // message arrives the thread preempts compute at once instead of after a scheduler slice. It
  // sleeps whenever it waits, so it takes only the CPU the transfers need. Needs CAP_SYS_NICE
  // for negative values; otherwise the default priority stays.
  if (config().nice != 0) setpriority(PRIO_PROCESS, static_cast<id_t>(gettid()), config().nice);
  std::string tname = ("mt-" + name).substr(0, 15);
  pthread_setname_np(pthread_self(), tname.c_str());

  std::deque<std::unique_ptr<Op>> colls;
  std::unique_ptr<Op> cur;
  std::vector<std::unique_ptr<Op>> p2ps;
  unsigned idle = 0;
  const int max_us = config().poll_max_us;
  const int spin_us = config().spin_us;

  for (;;) {
    std::deque<std::unique_ptr<Op>> incoming;
    {
      std::unique_lock<std::mutex> lk(mu);
      if (queue.empty() && !cur && colls.empty() && p2ps.empty()) {
        if (stop) break;
        // Idle: poll for new work for a little while (yielding), then sleep.
        lk.unlock();
        const int64_t until = now_ns() + int64_t(spin_us) * 1000;
        while (!has_work.load(std::memory_order_acquire) && now_ns() < until) sched_yield();
        lk.lock();
        cv.wait(lk, [&] { return stop || !queue.empty(); });
        idle = 0;
        if (queue.empty()) continue;
      }
      incoming.swap(queue);
      has_work.store(false, std::memory_order_relaxed);
    }
    if (failed.load()) {
      std::string msg;
      {
        std::lock_guard<std::mutex> lk(mu);
        msg = fail_msg;
      }
      if (cur) complete(std::move(cur), &msg);
      cur.reset();
      for (auto* q : {&colls, &incoming}) {
        for (auto& o : *q) complete(std::move(o), &msg);
        q->clear();
      }
      for (auto& o : p2ps) complete(std::move(o), &msg);
      p2ps.clear();
      reqs.clear();  // abandoned: the job is ending
      continue;
    }
    bool progressed = !incoming.empty();
    try {
      for (auto& o : incoming) {
        if (is_p2p(o->d.kind)) {
          start(*o);
          p2ps.push_back(std::move(o));
        } else {
          colls.push_back(std::move(o));
        }
      }
      for (;;) {
        if (!cur) {
          if (colls.empty()) break;
          cur = std::move(colls.front());
          colls.pop_front();
          start(*cur);
          progressed = true;
        }
        int s = step(*cur);
        if (s == 2) {
          complete(std::move(cur), nullptr);
          cur.reset();
          progressed = true;
          continue;
        }
        if (s == 1) progressed = true;
        break;
      }
      for (size_t i = 0; i < p2ps.size();) {
        if (test_all(p2ps[i]->reqs, "transfer", *p2ps[i])) {
          complete(std::move(p2ps[i]), nullptr);
          p2ps.erase(p2ps.begin() + static_cast<long>(i));
          progressed = true;
        } else {
          ++i;
        }
      }
    } catch (const CommError& e) {
      report_fatal(e.what(), 2.0);
      continue;
    }
    if (progressed) {
      idle = 0;
    } else {
      backoff(idle++, max_us);
    }
  }
}

}  // namespace detail

// ---------------------------------------------------------------------------------------------
// ProcessGroup

using detail::OpDesc;

ProcessGroup::ProcessGroup(std::shared_ptr<detail::GroupImpl> impl) : impl_(std::move(impl)) {}
ProcessGroup::~ProcessGroup() = default;

int ProcessGroup::rank() const { return impl_->rank; }
int ProcessGroup::size() const { return impl_->size; }
const std::string& ProcessGroup::name() const { return impl_->name; }
std::vector<int> ProcessGroup::global_ranks() const { return impl_->granks; }

WorkHandle ProcessGroup::all_reduce(void* buf, size_t count, DType dt, ReduceOp op) {
  OpDesc d;
  d.kind = OpKind::AllReduce;
  d.dt = dt;
  d.op = op;
  d.count = count;
  return impl_->issue(d, buf, buf);
}

WorkHandle ProcessGroup::reduce_scatter(const void* send, void* recv, size_t recv_count, DType dt,
                                        ReduceOp op) {
  OpDesc d;
  d.kind = OpKind::ReduceScatter;
  d.dt = dt;
  d.op = op;
  d.count = recv_count;
  return impl_->issue(d, send, recv);
}

WorkHandle ProcessGroup::all_gather(const void* send, void* recv, size_t send_count, DType dt) {
  OpDesc d;
  d.kind = OpKind::AllGather;
  d.dt = dt;
  d.count = send_count;
  return impl_->issue(d, send, recv);
}

WorkHandle ProcessGroup::broadcast(void* buf, size_t count, DType dt, int root) {
  OpDesc d;
  d.kind = OpKind::Broadcast;
  d.dt = dt;
  d.count = count;
  d.peer = root;
  return impl_->issue(d, buf, buf);
}

WorkHandle ProcessGroup::send(const void* buf, size_t count, DType dt, int dst, int tag) {
  OpDesc d;
  d.kind = OpKind::Send;
  d.dt = dt;
  d.count = count;
  d.peer = dst;
  d.tag = tag;
  return impl_->issue(d, buf, nullptr);
}

WorkHandle ProcessGroup::recv(void* buf, size_t count, DType dt, int src, int tag) {
  OpDesc d;
  d.kind = OpKind::Recv;
  d.dt = dt;
  d.count = count;
  d.peer = src;
  d.tag = tag;
  return impl_->issue(d, nullptr, buf);
}

WorkHandle ProcessGroup::barrier() {
  OpDesc d;
  d.kind = OpKind::Barrier;
  return impl_->issue(d, nullptr, nullptr);
}

CommStats ProcessGroup::stats() const {
  std::lock_guard<std::mutex> lk(impl_->stats->mu);
  return impl_->stats->s;
}

uint64_t ProcessGroup::collectives_called() const { return impl_->issued.load(); }

}  // namespace mt::comm
