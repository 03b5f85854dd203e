// Process groups: the operations' front end (issue, accounting, flight recorder, the watchdog's
// view, the desync check, completion) and the communication thread that drives a threaded backend
// (MPI, threads); the backends themselves are in mpi_backend.cpp, thread_backend.cpp and
// meta_backend.cpp (see detail.h's CommBackend).

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
                                           "barrier",    "all_to_all_v"};
  return names[static_cast<int>(k)];
}

// ---------------------------------------------------------------------------------------------
// Work

Work::Work(int64_t issued_ns, std::shared_ptr<detail::Waker> waker) : t_issue_(issued_ns), waker_(std::move(waker)) {}

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
  // A waiter: the communication thread polls promptly until it is done (it may poll lazily while
  // nobody waits, see thread_main).
  const bool nudge = waker_ && state_.load(std::memory_order_acquire) == 0;
  if (nudge) {
    waker_->waiters.fetch_add(1);
    waker_->wake();
  }
  if (state_.load(std::memory_order_acquire) == 0) {
    // Short operations finish within microseconds: poll (yielding the core) before sleeping.
    const int64_t until = detail::now_ns() + int64_t(detail::config().spin_us) * 1000;
    while (state_.load(std::memory_order_acquire) == 0 && detail::now_ns() < until) sched_yield();
  }
  if (state_.load(std::memory_order_acquire) == 0) {
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait(lk, [&] { return state_.load() != 0; });
  }
  if (nudge) waker_->waiters.fetch_sub(1);
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

void Work::times_ns(int64_t* issued, int64_t* started, int64_t* ended) const {
  std::lock_guard<std::mutex> lk(mu_);
  *issued = t_issue_;
  *started = t_start_;
  *ended = t_end_;
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
    case OpKind::AllToAllV: return 0;  // counted from its send counts in issue()
  }
  return 0;
}

GroupImpl::GroupImpl(std::string name_, int uid_, MPI_Comm comm, int world_rank)
    : name(std::move(name_)), uid(uid_) {
  stats = std::make_shared<StatsBlock>();
  stats->name = name;
  register_stats(stats);
  if (comm == MPI_COMM_NULL) {  // a group of one: no backend, everything completes in the caller
    rank = 0;
    size = 1;
    granks = {world_rank};
    return;
  }
  auto mpi = std::make_unique<MpiBackend>(name, comm);
  rank = mpi->rank;
  size = mpi->size;
  granks = mpi->granks;
  backend = std::move(mpi);
}

GroupImpl::GroupImpl(std::string name_, int uid_, int rank_, std::vector<int> granks_,
                     std::unique_ptr<CommBackend> backend_)
    : name(std::move(name_)), uid(uid_) {
  stats = std::make_shared<StatsBlock>();
  stats->name = name;
  register_stats(stats);
  rank = rank_;
  size = static_cast<int>(granks_.size());
  granks = std::move(granks_);
  backend = std::move(backend_);
}

GroupImpl::~GroupImpl() { shutdown(); }

void GroupImpl::shutdown() {
  {
    std::lock_guard<std::mutex> lk(mu);
    if (down) return;
    stop = true;
  }
  cv.notify_all();
  waker->wake();
  if (thr.joinable()) thr.join();
  std::lock_guard<std::mutex> lk(mu);
  down = true;
  if (backend) backend->shutdown();
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
  waker->wake();
  for (auto& o : pending) complete(std::move(o), &msg);
}

namespace {
thread_local bool t_inline_scope = false;
}  // namespace

static void backoff(unsigned idle, int max_us);

WorkHandle GroupImpl::issue(OpDesc d, const void* sbuf, void* rbuf, std::vector<size_t> scounts,
                            std::vector<size_t> rcounts) {
  if ((d.kind == OpKind::Broadcast || is_p2p(d.kind)) && (d.peer < 0 || d.peer >= size)) {
    throw CommError("group " + name + ": " + op_kind_name(d.kind) + " " +
                    (d.kind == OpKind::Broadcast ? "root " : "peer ") + std::to_string(d.peer) +
                    " is not a rank of the group (size " + std::to_string(size) + ")");
  }
  if (is_p2p(d.kind) && (d.tag < 0 || d.tag > 32767))
    throw CommError("group " + name + ": tag " + std::to_string(d.tag) + " outside 0..32767");
  if (d.count && !rbuf && !sbuf) throw CommError("group " + name + ": null buffer");
  if ((d.kind == OpKind::AllReduce || d.kind == OpKind::ReduceScatter) && d.op == ReduceOp::Avg && is_integer(d.dt))
    throw CommError("group " + name + ": " + op_kind_name(d.kind) + " cannot average " + dtype_name(d.dt) +
                    " values: integers reduce with sum or max (divide the sum where it is read)");

  auto op = std::make_unique<Op>();
  op->t_issue = now_ns();
  op->work = std::make_shared<Work>(op->t_issue, waker);
  op->sbuf = sbuf;
  op->rbuf = rbuf;
  uint64_t a2a_bytes = 0;
  if (d.kind == OpKind::AllToAllV) {
    if (scounts.size() != static_cast<size_t>(size) || rcounts.size() != static_cast<size_t>(size))
      throw CommError("group " + name + ": all_to_all_v needs one send and one receive count per rank");
    if (scounts[static_cast<size_t>(rank)] != rcounts[static_cast<size_t>(rank)])
      throw CommError("group " + name + ": all_to_all_v sends " + std::to_string(scounts[static_cast<size_t>(rank)]) +
                      " elements to itself but expects " + std::to_string(rcounts[static_cast<size_t>(rank)]));
    for (int q = 0; q < size; ++q)
      if (q != rank) a2a_bytes += scounts[static_cast<size_t>(q)] * dtype_size(d.dt);
    op->scounts = std::move(scounts);
    op->rcounts = std::move(rcounts);
  }
  WorkHandle w = op->work;
  std::unique_ptr<Op> inl;  // runs on this thread (InlineScope)
  bool wake_thread = true;
  std::string post_error;  // the caller's own posting failed
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
      ks.bytes += algo_bytes(d, size) + a2a_bytes;
    }
    op->fr_id = fr_issue(name, d, op->t_issue);
    if (size > 1 && backend && backend->threaded()) {
      if (t_inline_scope && !is_p2p(d.kind) && d.count * dtype_size(d.dt) <= config().inline_bytes &&
          queue.empty() && pending.load() == 0 && !inline_busy) {
        inline_busy = true;
        inl = std::move(op);
      } else {
        // Lazily polled (node-local) groups: the caller posts a send or receive itself
        // (MPI_THREAD_MULTIPLE) when everything issued before it has been posted (the queue may
        // still hold transfers posted this way that the sleeping thread has not taken yet), and
        // hands it to the thread only to be polled - without waking it unless it is blocked with
        // nothing in flight. A wake-up costs the compute thread the core (the thread runs at a
        // higher priority); the receiver copies the data in its own polls, so the send needs
        // nothing more from us.
        const auto all_posted = [&] {
          for (const auto& q : queue)
            if (!q->started) return false;
          return unposted_p2p.load() == 0;
        };
        if (is_p2p(d.kind) && backend->node_local() && config().poll_idle_us > config().poll_max_us &&
            !inline_busy && thr.joinable() && all_posted()) {
          begin(*op);
          try {
            backend->start(*op);
          } catch (const CommError& e) {
            post_error = e.what();
          }
          op->started = true;
          wake_thread = thread_idle;
        } else if (is_p2p(d.kind)) {
          unposted_p2p.fetch_add(1);
        }
        if (post_error.empty()) {  // else completed (failed) below, outside the lock
          op->queued = true;
          pending.fetch_add(1);
          queue.push_back(std::move(op));
          has_work.store(true, std::memory_order_release);
          if (!thr.joinable()) thr = std::thread([this] { thread_main(); });
        }
      }
    }
  }
  if (!post_error.empty()) {
    report_fatal(post_error, 2.0);
    complete(std::move(op), &post_error);
    return w;
  }
  if (inl) {
    run_inline(std::move(inl));
  } else if (op && backend && !backend->threaded()) {
    begin(*op);
    backend->run(*op);
    complete(std::move(op), nullptr);
  } else if (op) {
    run_local(std::move(op));
  } else if (wake_thread) {
    cv.notify_one();
    waker->wake();  // the thread may be sleeping lazily with transfers in flight
  }
  return w;
}

// An operation starts: timing, flight recorder, the watchdog's view of running operations.
void GroupImpl::begin(Op& op) {
  op.t_start = now_ns();
  op.work->mark_started(op.t_start);
  fr_start(op.fr_id, op.t_start);
  if (!backend || !backend->threaded()) return;  // completes before anything could watch it
  {
    std::lock_guard<std::mutex> lk(act_mu);
    active.push_back({op.d, op.t_start, &op});
  }
  if (!is_p2p(op.d.kind)) started.store(op.d.seq);
}

void GroupImpl::start_collective(Op& op) {
  if (backend->exchanges_fingerprints() && (config().desync || backend->fingerprints_free())) {
    op.fp = Fingerprint::of(op.d);
    op.fps.assign(static_cast<size_t>(size), Fingerprint{});
    op.fp_wait = true;
    backend->post_fingerprints(op);
    return;
  }
  backend->start(op);
}

int GroupImpl::progress_collective(Op& op) {
  if (!op.fp_wait) return backend->progress(op);
  if (!backend->fingerprints_ready(op)) return 0;
  op.fp_wait = false;
  check_fingerprints(op.fps, op.d.seq, name, granks);
  backend->start(op);
  const int s = backend->progress(op);
  return s == 0 ? 1 : s;  // the exchange finished: progress either way
}

// A collective on its caller's thread (InlineScope): what the communication thread does for one
// operation - start, progress (spinning first, then the same back-off), complete - while inline_busy keeps the
// thread from starting anything else.
void GroupImpl::run_inline(std::unique_ptr<Op> op) {
  auto release = [this] {
    {
      std::lock_guard<std::mutex> lk(mu);
      inline_busy = false;
    }
    cv.notify_all();
  };
  try {
    begin(*op);
    start_collective(*op);
    // The caller has nothing else to do until the collective completes, and what it waits for is
    // mostly its peers arriving (their compute's skew): it polls, yielding, for up to 2 ms before
    // backing off into sleeps like the communication thread (which must not spin: it shares the
    // cores with compute). Sleeping at once made the inline path slower than the communication
    // thread; with the polls it is faster (bench/tp_inline.sh, docs/benchmarks.md).
    constexpr int64_t kInlineSpinNs = 2'000'000;
    const int64_t spin_until = now_ns() + kInlineSpinNs;
    unsigned idle = 0;
    for (;;) {
      const int s = progress_collective(*op);
      if (s == 2) break;
      if (s == 1) {
        idle = 0;
      } else if (now_ns() < spin_until) {
        sched_yield();
      } else {
        backoff(idle++, config().poll_max_us);
      }
    }
  } catch (const CommError& e) {
    release();
    report_fatal(e.what(), 2.0);
    std::string msg = e.what();
    complete(std::move(op), &msg);
    return;
  }
  release();
  complete(std::move(op), nullptr);
}

// Groups of one rank: everything completes in the caller, without a backend.
void GroupImpl::run_local(std::unique_ptr<Op> op) {
  const size_t bytes = op->d.count * dtype_size(op->d.dt);
  begin(*op);
  switch (op->d.kind) {
    case OpKind::ReduceScatter:
    case OpKind::AllGather:
      if (bytes && op->sbuf != op->rbuf) std::memmove(op->rbuf, op->sbuf, bytes);
      break;
    case OpKind::AllToAllV: {
      const size_t b = op->scounts[0] * dtype_size(op->d.dt);
      if (b && op->sbuf != op->rbuf) std::memmove(op->rbuf, op->sbuf, b);
      break;
    }
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



void GroupImpl::complete(std::unique_ptr<Op> op, const std::string* err) {
  const int64_t t = now_ns();
  if (op->queued) pending.fetch_sub(1);
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









// Waiting for MPI with nothing to do: 24 tight polls, 24 yielding polls, then sleeps of 1, 2, 4,
// ... us up to max_us (reset by the caller whenever something completes). (Sleeps proportional to
// the time already waited were tried: more wake-ups, no gain for all_reduce and less bandwidth for
// all_gather on the shared 2-core machine, where they compete with the peer thread's copy.)
constexpr unsigned kSpins = 48;
static void backoff(unsigned idle, int max_us) {
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
  // Lazy polling (node-local groups): while only point-to-point transfers are in flight and no
  // caller waits for any of them, the sleeps grow past max_us up to poll_idle_us. A pipeline
  // posts its receives early and its sends complete when the peer gets to its receive, so
  // transfers are in flight for most of a step; polling them every max_us takes thousands of
  // wake-ups a step from the compute thread on the same core. A receiver copies the data itself
  // (shared memory), so it is copied when it is first needed (a caller waits: prompt polling
  // again) or at the next lazy poll, and a sender need not poll for the receiver to proceed.
  const int idle_us = backend->node_local() ? config().poll_idle_us : 0;

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
        thread_idle = true;
        cv.wait(lk, [&] { return stop || !queue.empty(); });
        thread_idle = false;
        idle = 0;
        if (queue.empty()) continue;
      }
      // A caller is driving a collective itself (run_inline): wait until it is done.
      cv.wait(lk, [&] { return !inline_busy; });
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
      backend->abandon();  // the job is ending
      continue;
    }
    bool progressed = !incoming.empty();
    try {
      for (auto& o : incoming) {
        if (is_p2p(o->d.kind)) {
          if (!o->started) {
            begin(*o);
            backend->start(*o);
            unposted_p2p.fetch_sub(1);
          }
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
          begin(*cur);
          start_collective(*cur);
          progressed = true;
        }
        int s = progress_collective(*cur);
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
        if (backend->p2p_done(*p2ps[i])) {
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
      continue;
    }
    idle_polls.fetch_add(1, std::memory_order_relaxed);
    if (idle_us > max_us && !cur && colls.empty() && idle >= kSpins && waker->waiters.load() == 0) {
      const unsigned k = std::min(idle++ - kSpins, 20u);
      if (waker->sleep_for(std::min<long>(idle_us, 1L << k))) idle = 0;  // woken: a waiter or new work
    } else {
      backoff(idle++, max_us);
    }
  }
}

}  // namespace detail

// ---------------------------------------------------------------------------------------------
// ProcessGroup

using detail::OpDesc;

InlineScope::InlineScope() : prev_(detail::t_inline_scope) { detail::t_inline_scope = true; }
InlineScope::~InlineScope() { detail::t_inline_scope = prev_; }

ProcessGroup::ProcessGroup(std::shared_ptr<detail::GroupImpl> impl) : impl_(std::move(impl)) {}
ProcessGroup::~ProcessGroup() = default;

int ProcessGroup::rank() const { return impl_->rank; }
int ProcessGroup::size() const { return impl_->size; }
const std::string& ProcessGroup::name() const { return impl_->name; }
std::vector<int> ProcessGroup::global_ranks() const { return impl_->granks; }

namespace {
// What every rank must agree on for one call (the peer is a root or a point-to-point peer).
OpDesc op_desc(OpKind kind, DType dt, size_t count, ReduceOp op = ReduceOp::Sum, int peer = -1, int tag = 0) {
  return OpDesc{.kind = kind, .dt = dt, .op = op, .count = count, .peer = peer, .tag = tag};
}
}  // namespace

WorkHandle ProcessGroup::all_reduce(void* buf, size_t count, DType dt, ReduceOp op) {
  return impl_->issue(op_desc(OpKind::AllReduce, dt, count, op), buf, buf);
}

WorkHandle ProcessGroup::reduce_scatter(const void* send, void* recv, size_t recv_count, DType dt,
                                        ReduceOp op) {
  return impl_->issue(op_desc(OpKind::ReduceScatter, dt, recv_count, op), send, recv);
}

WorkHandle ProcessGroup::all_gather(const void* send, void* recv, size_t send_count, DType dt) {
  return impl_->issue(op_desc(OpKind::AllGather, dt, send_count), send, recv);
}

WorkHandle ProcessGroup::all_to_all_v(const void* send, const size_t* send_counts, void* recv,
                                      const size_t* recv_counts, DType dt) {
  // The count is 0: the sizes differ per rank, not part of what every rank must agree on.
  const size_t n = static_cast<size_t>(size());
  return impl_->issue(op_desc(OpKind::AllToAllV, dt, 0), send, recv,
                      std::vector<size_t>(send_counts, send_counts + n),
                      std::vector<size_t>(recv_counts, recv_counts + n));
}

WorkHandle ProcessGroup::broadcast(void* buf, size_t count, DType dt, int root) {
  return impl_->issue(op_desc(OpKind::Broadcast, dt, count, ReduceOp::Sum, root), buf, buf);
}

WorkHandle ProcessGroup::send(const void* buf, size_t count, DType dt, int dst, int tag) {
  return impl_->issue(op_desc(OpKind::Send, dt, count, ReduceOp::Sum, dst, tag), buf, nullptr);
}

WorkHandle ProcessGroup::recv(void* buf, size_t count, DType dt, int src, int tag) {
  return impl_->issue(op_desc(OpKind::Recv, dt, count, ReduceOp::Sum, src, tag), nullptr, buf);
}

WorkHandle ProcessGroup::barrier() { return impl_->issue(op_desc(OpKind::Barrier, DType::F32, 0), nullptr, nullptr); }

CommStats ProcessGroup::stats() const {
  std::lock_guard<std::mutex> lk(impl_->stats->mu);
  return impl_->stats->s;
}

uint64_t ProcessGroup::collectives_called() const { return impl_->issued.load(); }

uint64_t ProcessGroup::idle_polls() const { return impl_->idle_polls.load(); }

}  // namespace mt::comm
