#include "parallel/layout/pipeline_schedule.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <sstream>
#include <stdexcept>


namespace mt::parallel {

// ---------------------------------------------------------------------------------------------
// Actions

bool is_compute(PipeAction::Kind k) { return k == PipeAction::Forward || k == PipeAction::Backward; }
bool is_send(PipeAction::Kind k) { return k == PipeAction::SendAct || k == PipeAction::SendGrad; }
bool is_recv(PipeAction::Kind k) { return k == PipeAction::RecvAct || k == PipeAction::RecvGrad; }

const char* kind_name(PipeAction::Kind k) {
  switch (k) {
    case PipeAction::Forward:
      return "Forward";
    case PipeAction::Backward:
      return "Backward";
    case PipeAction::SendAct:
      return "SendAct";
    case PipeAction::RecvAct:
      return "RecvAct";
    case PipeAction::SendGrad:
      return "SendGrad";
    case PipeAction::RecvGrad:
      return "RecvGrad";
  }
  return "?";
}

static bool valid_kind(PipeAction::Kind k) {
  int i = static_cast<int>(k);
  return i >= PipeAction::Forward && i <= PipeAction::RecvGrad;
}

std::string short_string(const PipeAction& a) {
  std::string mbs = std::to_string(a.microbatch) + "." + std::to_string(a.stage);
  switch (a.kind) {
    case PipeAction::Forward:
      return "F" + mbs;
    case PipeAction::Backward:
      return "B" + mbs;
    case PipeAction::SendAct:
      return "sA" + mbs + ">" + std::to_string(a.peer);
    case PipeAction::RecvAct:
      return "rA" + mbs + "<" + std::to_string(a.peer);
    case PipeAction::SendGrad:
      return "sG" + mbs + ">" + std::to_string(a.peer);
    case PipeAction::RecvGrad:
      return "rG" + mbs + "<" + std::to_string(a.peer);
  }
  return "?" + mbs;
}

std::string describe(const PipeAction& a) {
  std::string s = std::string(valid_kind(a.kind) ? kind_name(a.kind) : "InvalidKind") + "(mb " +
                  std::to_string(a.microbatch) + ", stage " + std::to_string(a.stage);
  if (is_send(a.kind)) s += " -> rank " + std::to_string(a.peer);
  if (is_recv(a.kind)) s += " <- rank " + std::to_string(a.peer);
  return s + ")";
}

bool operator==(const PipeAction& a, const PipeAction& b) {
  return a.kind == b.kind && a.microbatch == b.microbatch && a.stage == b.stage && a.peer == b.peer;
}

// ---------------------------------------------------------------------------------------------
// Builders

std::vector<std::string> schedule_names() {
  std::vector<std::string> v;
  for (PipelineSchedule k : all_pipeline_schedules()) v.emplace_back(to_string(k));
  return v;
}

// Largest pp * v * m a builder accepts (the lists and the checker's tables grow with it).
constexpr long long kMaxScheduleSize = 1 << 20;

static void check_sizes(const std::string& name, int pp, int m, int v) {
  if (pp < 1)
    throw std::invalid_argument(name + ": pipeline size pp must be >= 1, got " + std::to_string(pp));
  if (m < 1)
    throw std::invalid_argument(name + ": number of micro-batches must be >= 1, got " + std::to_string(m));
  if (v < 1)
    throw std::invalid_argument(name + ": virtual stages per rank must be >= 1, got " + std::to_string(v));
  if (static_cast<long long>(pp) * v * m > kMaxScheduleSize)
    throw std::invalid_argument(name + ": pp * virtual_stages * microbatches = " +
                                std::to_string(static_cast<long long>(pp) * v * m) + " is larger than the " +
                                std::to_string(kMaxScheduleSize) + " this tool handles");
}

// Turns per-rank compute orders into full action lists: a receive right before the compute that
// consumes a value from another rank, a send right after the compute that produces a value for
// another rank. Hand-offs between stages on the same rank stay local.
static PipeSchedule add_comm(std::string name, int pp, int m, int v,
                             const std::vector<std::vector<PipeAction>>& compute) {
  PipeSchedule s;
  s.name = std::move(name);
  s.pp = pp;
  s.microbatches = m;
  s.virtual_stages = v;
  s.per_rank.resize(pp);
  const int S = pp * v;
  for (int r = 0; r < pp; ++r) {
    auto& out = s.per_rank[r];
    out.reserve(compute[r].size() * 3);
    for (const PipeAction& a : compute[r]) {
      const int st = a.stage;
      if (a.kind == PipeAction::Forward) {
        if (st > 0 && s.stage_rank(st - 1) != r)
          out.push_back({PipeAction::RecvAct, a.microbatch, st - 1, s.stage_rank(st - 1)});
        out.push_back(a);
        if (st < S - 1 && s.stage_rank(st + 1) != r)
          out.push_back({PipeAction::SendAct, a.microbatch, st, s.stage_rank(st + 1)});
      } else {
        if (st < S - 1 && s.stage_rank(st + 1) != r)
          out.push_back({PipeAction::RecvGrad, a.microbatch, st + 1, s.stage_rank(st + 1)});
        out.push_back(a);
        if (st > 0 && s.stage_rank(st - 1) != r)
          out.push_back({PipeAction::SendGrad, a.microbatch, st, s.stage_rank(st - 1)});
      }
    }
  }
  return s;
}

// Megatron-style placement: the computes are grouped into steps (warm-up: one forward, steady:
// a forward and a backward, cool-down: one backward); after each step a single batch sends what
// the step produced and receives what the next step consumes.
static PipeSchedule add_comm_stepped(std::string name, int pp, int m, int v,
                                     const std::vector<std::vector<std::vector<PipeAction>>>& steps) {
  PipeSchedule s;
  s.name = std::move(name);
  s.pp = pp;
  s.microbatches = m;
  s.virtual_stages = v;
  s.per_rank.resize(pp);
  const int S = pp * v;
  auto recvs_for = [&](int r, const std::vector<PipeAction>& step, std::vector<PipeAction>& out) {
    for (const PipeAction& a : step) {
      const int st = a.stage;
      if (a.kind == PipeAction::Forward && st > 0 && s.stage_rank(st - 1) != r)
        out.push_back({PipeAction::RecvAct, a.microbatch, st - 1, s.stage_rank(st - 1)});
      if (a.kind == PipeAction::Backward && st < S - 1 && s.stage_rank(st + 1) != r)
        out.push_back({PipeAction::RecvGrad, a.microbatch, st + 1, s.stage_rank(st + 1)});
    }
  };
  auto sends_of = [&](int r, const std::vector<PipeAction>& step, std::vector<PipeAction>& out) {
    for (const PipeAction& a : step) {
      const int st = a.stage;
      if (a.kind == PipeAction::Forward && st < S - 1 && s.stage_rank(st + 1) != r)
        out.push_back({PipeAction::SendAct, a.microbatch, st, s.stage_rank(st + 1)});
      if (a.kind == PipeAction::Backward && st > 0 && s.stage_rank(st - 1) != r)
        out.push_back({PipeAction::SendGrad, a.microbatch, st, s.stage_rank(st - 1)});
    }
  };
  for (int r = 0; r < pp; ++r) {
    auto& out = s.per_rank[r];
    const auto& st = steps[r];
    if (!st.empty()) recvs_for(r, st[0], out);
    for (size_t i = 0; i < st.size(); ++i) {
      out.insert(out.end(), st[i].begin(), st[i].end());
      sends_of(r, st[i], out);
      if (i + 1 < st.size()) recvs_for(r, st[i + 1], out);
    }
  }
  return s;
}

static PipeAction fwd(int mb, int stage) { return {PipeAction::Forward, mb, stage, -1}; }
static PipeAction bwd(int mb, int stage) { return {PipeAction::Backward, mb, stage, -1}; }

PipeSchedule gpipe(int pp, int m) {
  check_sizes(to_string(PipelineSchedule::GPipe), pp, m, 1);
  std::vector<std::vector<PipeAction>> c(pp);
  for (int r = 0; r < pp; ++r) {
    for (int i = 0; i < m; ++i) c[r].push_back(fwd(i, r));
    for (int i = 0; i < m; ++i) c[r].push_back(bwd(i, r));
  }
  return add_comm(to_string(PipelineSchedule::GPipe), pp, m, 1, c);
}

PipeSchedule one_f_one_b(int pp, int m) {
  check_sizes(to_string(PipelineSchedule::OneFOneB), pp, m, 1);
  std::vector<std::vector<PipeAction>> c(pp);
  for (int r = 0; r < pp; ++r) {
    // Warm-up: enough forwards that the first backward reaches this rank just as they are done.
    const int warmup = std::min(pp - r - 1, m);
    const int steady = m - warmup;
    for (int i = 0; i < warmup; ++i) c[r].push_back(fwd(i, r));
    for (int i = 0; i < steady; ++i) {
      c[r].push_back(fwd(warmup + i, r));
      c[r].push_back(bwd(i, r));
    }
    for (int i = steady; i < m; ++i) c[r].push_back(bwd(i, r));  // cool-down
  }
  return add_comm(to_string(PipelineSchedule::OneFOneB), pp, m, 1, c);
}

PipeSchedule interleaved_1f1b(int pp, int m, int v, CommPlacement placement) {
  check_sizes(to_string(PipelineSchedule::Interleaved), pp, m, v);
  if (v < 2)
    throw std::invalid_argument("interleaved_1f1b needs at least 2 virtual stages per rank, got " +
                                std::to_string(v) + " (with one stage per rank use the 1f1b schedule)");
  if (m % pp != 0)
    throw std::invalid_argument("interleaved_1f1b needs the number of micro-batches (" + std::to_string(m) +
                                ") to be a multiple of the pipeline size pp (" + std::to_string(pp) +
                                "): micro-batches go through the virtual stages in groups of pp");
  // The k-th forward (backward) of a rank: micro-batches advance in groups of pp through the
  // chunks 0..v-1 (backwards: v-1..0), i.e. k -> group k / (pp*v), chunk (k % (pp*v)) / pp,
  // micro-batch group*pp + k % pp. Rank r's chunk c is virtual stage c*pp + r.
  const int total = m * v;
  auto mb_of = [&](int k) { return (k / (pp * v)) * pp + k % pp; };
  auto chunk_of = [&](int k, bool forward) {
    int c = (k % (pp * v)) / pp;
    return forward ? c : v - 1 - c;
  };
  std::vector<std::vector<PipeAction>> c(pp);
  std::vector<std::vector<std::vector<PipeAction>>> steps(pp);
  for (int r = 0; r < pp; ++r) {
    // Warm-up (Megatron): the first backward to reach rank r is micro-batch 0 on chunk v-1; until
    // then rank r can run (v-1)*pp forwards of the earlier chunks plus 2*(pp-r-1) for the trip
    // to the last rank and back.
    const long long want = 2LL * (pp - r - 1) + static_cast<long long>(v - 1) * pp;
    const int warmup = static_cast<int>(std::min<long long>(want, total));
    const int steady = total - warmup;
    for (int k = 0; k < warmup; ++k) {
      c[r].push_back(fwd(mb_of(k), chunk_of(k, true) * pp + r));
      steps[r].push_back({c[r].back()});
    }
    for (int i = 0; i < steady; ++i) {
      const int kf = warmup + i;
      c[r].push_back(fwd(mb_of(kf), chunk_of(kf, true) * pp + r));
      c[r].push_back(bwd(mb_of(i), chunk_of(i, false) * pp + r));
      steps[r].push_back({c[r][c[r].size() - 2], c[r].back()});
    }
    for (int k = steady; k < total; ++k) {
      c[r].push_back(bwd(mb_of(k), chunk_of(k, false) * pp + r));
      steps[r].push_back({c[r].back()});
    }
  }
  if (placement == CommPlacement::Batched) return add_comm_stepped(to_string(PipelineSchedule::Interleaved), pp, m, v, steps);
  return add_comm(to_string(PipelineSchedule::Interleaved), pp, m, v, c);
}

const char* placement_name(CommPlacement p) { return p == CommPlacement::Eager ? "eager" : "batched"; }

bool parse_placement(const std::string& s, CommPlacement* out) {
  if (s == "eager")
    *out = CommPlacement::Eager;
  else if (s == "batched")
    *out = CommPlacement::Batched;
  else
    return false;
  return true;
}

PipeSchedule make_schedule(PipelineSchedule kind, int pp, int m, int v, CommPlacement placement) {
  switch (kind) {
    case PipelineSchedule::Interleaved: return interleaved_1f1b(pp, m, v, placement);
    case PipelineSchedule::GPipe:
    case PipelineSchedule::OneFOneB:
      if (v != 1)
        throw std::invalid_argument(std::string("schedule ") + to_string(kind) +
                                    " has one stage per rank; virtual stages = " + std::to_string(v) +
                                    " needs --schedule interleaved_1f1b");
      return kind == PipelineSchedule::GPipe ? gpipe(pp, m) : one_f_one_b(pp, m);
    case PipelineSchedule::None: break;
  }
  throw std::invalid_argument("pipeline schedule 'none' has no action lists (known: " +
                              valid_values(PipelineSchedule{}) + ")");
}

PipeSchedule make_schedule(const std::string& name, int pp, int m, int v, CommPlacement placement) {
  if (std::optional<PipelineSchedule> kind = try_parse_pipeline_schedule(name))
    return make_schedule(*kind, pp, m, v, placement);
  throw std::invalid_argument("unknown pipeline schedule '" + name + "' (known: " + valid_values(PipelineSchedule{}) +
                              ")");
}

// ---------------------------------------------------------------------------------------------
// Execution models

namespace {

std::string action_at(const PipeSchedule& s, int r, size_t i) {
  return "#" + std::to_string(i) + " " + describe(s.per_rank[r][i]);
}

PipeAction::Kind counterpart(PipeAction::Kind k) {
  switch (k) {
    case PipeAction::SendAct:
      return PipeAction::RecvAct;
    case PipeAction::RecvAct:
      return PipeAction::SendAct;
    case PipeAction::SendGrad:
      return PipeAction::RecvGrad;
    case PipeAction::RecvGrad:
      return PipeAction::SendGrad;
    default:
      return k;
  }
}

// Index of the message an action sends or receives: activations and gradients, per
// (micro-batch, stage). Callers have checked the ranges.
struct MsgIndex {
  int m, S;
  size_t operator()(const PipeAction& a) const {
    const size_t dir = (a.kind == PipeAction::SendAct || a.kind == PipeAction::RecvAct) ? 0 : 1;
    return (dir * m + a.microbatch) * S + a.stage;
  }
  size_t size() const { return 2ull * m * S; }
};

// Position of the matching counterpart of comm action `a` (on rank a.peer), or -1.
long find_counterpart(const PipeSchedule& s, const PipeAction& a) {
  if (a.peer < 0 || a.peer >= s.pp) return -1;
  const auto& l = s.per_rank[a.peer];
  for (size_t i = 0; i < l.size(); ++i)
    if (l[i].kind == counterpart(a.kind) && l[i].microbatch == a.microbatch && l[i].stage == a.stage)
      return static_cast<long>(i);
  return -1;
}

// Follows "rank r waits for rank p" from the lowest blocked rank until a rank repeats (a cycle)
// or the chain ends at a message that will never come.
template <typename WaitOf>
std::string explain_wait_chain(const PipeSchedule& s, const std::vector<size_t>& pos, const char* model,
                               WaitOf wait_of) {
  int start = -1;
  for (int r = 0; r < s.pp; ++r)
    if (pos[r] < s.per_rank[r].size()) {
      start = r;
      break;
    }
  if (start < 0) return "";
  std::ostringstream o;
  o << "deadlock (" << model << "): ";
  std::vector<int> seen_at(s.pp, -1);
  std::vector<int> chain;
  int r = start;
  while (true) {
    if (seen_at[r] >= 0) {
      o << " -- a cycle:";
      for (size_t i = static_cast<size_t>(seen_at[r]); i < chain.size(); ++i)
        o << " rank " << chain[i] << " ->";
      o << " rank " << r;
      break;
    }
    seen_at[r] = static_cast<int>(chain.size());
    chain.push_back(r);
    // wait_of returns the comm action rank r is stuck on (its index).
    const size_t wi = wait_of(r);
    const PipeAction& w = s.per_rank[r][wi];
    if (chain.size() > 1) o << "; ";
    o << "rank " << r << " is stuck at " << action_at(s, r, wi);
    const long k = find_counterpart(s, w);
    const int p = w.peer;
    if (k < 0) {
      o << ", but rank " << p << " has no matching " << kind_name(counterpart(w.kind));
      break;
    }
    o << ", whose " << kind_name(counterpart(w.kind)) << " is rank " << p << "'s #" << k;
    if (pos[p] >= s.per_rank[p].size()) {
      o << " (rank " << p << " has finished)";
      break;
    }
    o << ", but rank " << p << " is stuck at #" << pos[p];
    r = p;
  }
  return o.str();
}

struct BufferedRun {
  bool completed = false;
  std::string deadlock;
  std::vector<size_t> pos;
  std::vector<double> clock, busy;
  std::vector<std::vector<TimedAction>> events;
};

// Buffered sends (post and go on), blocking receives; compute takes t_fwd/v or t_bwd/v.
BufferedRun run_buffered(const PipeSchedule& s, double t_fwd, double t_bwd, double t_comm) {
  const int pp = s.pp;
  const MsgIndex idx{s.microbatches, s.num_stages()};
  const double nan = std::numeric_limits<double>::quiet_NaN();
  std::vector<double> posted(idx.size(), nan);  // time each message was sent
  BufferedRun run;
  run.pos.assign(pp, 0);
  run.clock.assign(pp, 0.0);
  run.busy.assign(pp, 0.0);
  run.events.resize(pp);
  const double tf = t_fwd / s.virtual_stages, tb = t_bwd / s.virtual_stages;
  bool progress = true;
  while (progress) {
    progress = false;
    for (int r = 0; r < pp; ++r) {
      const auto& list = s.per_rank[r];
      size_t& i = run.pos[r];
      double& t = run.clock[r];
      while (i < list.size()) {
        const PipeAction& a = list[i];
        TimedAction ev{a, t, t};
        if (is_compute(a.kind)) {
          const double d = a.kind == PipeAction::Forward ? tf : tb;
          ev.end = t + d;
          run.busy[r] += d;
        } else if (is_send(a.kind)) {
          double& p = posted[idx(a)];
          if (std::isnan(p)) p = t;
        } else {
          const double p = posted[idx(a)];
          if (std::isnan(p)) break;  // blocked until the sender posts it
          ev.end = std::max(t, p + t_comm);
        }
        t = ev.end;
        run.events[r].push_back(ev);
        ++i;
        progress = true;
      }
    }
  }
  run.completed = true;
  for (int r = 0; r < pp; ++r) run.completed = run.completed && run.pos[r] == s.per_rank[r].size();
  if (!run.completed)
    run.deadlock = explain_wait_chain(s, run.pos, "buffered sends, blocking receives",
                                      [&](int r) { return run.pos[r]; });
  return run;
}

// Unbuffered (rendezvous) sends; each maximal run of consecutive comm actions is posted together
// and completes when every one of them has met its counterpart.
std::string run_rendezvous(const PipeSchedule& s, bool* ok) {
  const int pp = s.pp;
  const MsgIndex idx{s.microbatches, s.num_stages()};
  std::vector<char> send_posted(idx.size(), 0), recv_posted(idx.size(), 0);
  std::vector<size_t> pos(pp, 0);
  auto batch_end = [&](int r, size_t i) {
    const auto& l = s.per_rank[r];
    while (i < l.size() && !is_compute(l[i].kind)) ++i;
    return i;
  };
  bool progress = true;
  while (progress) {
    progress = false;
    for (int r = 0; r < pp; ++r) {
      const auto& l = s.per_rank[r];
      size_t& i = pos[r];
      while (i < l.size()) {
        if (is_compute(l[i].kind)) {
          ++i;
          progress = true;
          continue;
        }
        const size_t e = batch_end(r, i);
        bool all = true;
        for (size_t j = i; j < e; ++j) {
          const PipeAction& a = l[j];
          const size_t k = idx(a);
          if (is_send(a.kind)) {
            send_posted[k] = 1;
            all = all && recv_posted[k];
          } else {
            recv_posted[k] = 1;
            all = all && send_posted[k];
          }
        }
        if (!all) break;
        i = e;
        progress = true;
      }
    }
  }
  *ok = true;
  for (int r = 0; r < pp; ++r) *ok = *ok && pos[r] == s.per_rank[r].size();
  if (*ok) return "";
  // The first comm action of each stuck rank's batch that has no posted counterpart.
  return explain_wait_chain(s, pos, "rendezvous sends, batched isend/irecv", [&](int r) {
    const auto& l = s.per_rank[r];
    const size_t e = batch_end(r, pos[r]);
    for (size_t j = pos[r]; j < e; ++j) {
      const size_t k = idx(l[j]);
      if (is_send(l[j].kind) ? !recv_posted[k] : !send_posted[k]) return j;
    }
    return pos[r];
  });
}

class Problems {
 public:
  void add(std::string p) {
    ++count_;
    if (list_.size() < kMax) list_.push_back(std::move(p));
  }
  size_t count() const { return count_; }
  std::vector<std::string> list() const { return list_; }

 private:
  static constexpr size_t kMax = 100;
  std::vector<std::string> list_;
  size_t count_ = 0;
};

// Range problems (kind, micro-batch, stage, peer) that make every other check meaningless.
void check_ranges(const PipeSchedule& s, Problems& P) {
  if (s.pp < 1) P.add("pp must be >= 1, got " + std::to_string(s.pp));
  if (s.microbatches < 1) P.add("microbatches must be >= 1, got " + std::to_string(s.microbatches));
  if (s.virtual_stages < 1) P.add("virtual_stages must be >= 1, got " + std::to_string(s.virtual_stages));
  if (P.count()) return;
  if (static_cast<long long>(s.pp) * s.virtual_stages * s.microbatches > kMaxScheduleSize) {
    P.add("pp * virtual_stages * microbatches is larger than " + std::to_string(kMaxScheduleSize));
    return;
  }
  if (static_cast<int>(s.per_rank.size()) != s.pp) {
    P.add("the schedule has action lists for " + std::to_string(s.per_rank.size()) +
          " ranks but pp = " + std::to_string(s.pp));
    return;
  }
  const int S = s.num_stages();
  for (int r = 0; r < s.pp; ++r)
    for (size_t i = 0; i < s.per_rank[r].size(); ++i) {
      const PipeAction& a = s.per_rank[r][i];
      const std::string where = "rank " + std::to_string(r) + " #" + std::to_string(i) + ": ";
      if (!valid_kind(a.kind)) {
        P.add(where + "invalid action kind " + std::to_string(static_cast<int>(a.kind)));
        continue;
      }
      if (a.microbatch < 0 || a.microbatch >= s.microbatches)
        P.add(where + describe(a) + " has micro-batch out of range 0.." + std::to_string(s.microbatches - 1));
      if (a.stage < 0 || a.stage >= S)
        P.add(where + describe(a) + " has stage out of range 0.." + std::to_string(S - 1));
      if (!is_compute(a.kind) && (a.peer < 0 || a.peer >= s.pp))
        P.add(where + describe(a) + " has peer out of range 0.." + std::to_string(s.pp - 1));
    }
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Checker

ScheduleCheck check_schedule(const PipeSchedule& s) {
  ScheduleCheck c;
  Problems P;
  check_ranges(s, P);
  auto finish = [&]() {
    c.problems = P.list();
    c.ok = P.count() == 0;
    if (c.ok) {
      std::ostringstream o;
      o << "ok: " << c.compute_actions << " forwards/backwards complete, " << c.sends << " sends matched by "
        << c.recvs << " receives, dependencies in order, no deadlock (buffered sends, blocking receives)";
      c.message = o.str();
    } else {
      c.message = c.problems.front();
      if (P.count() > 1) c.message += " (and " + std::to_string(P.count() - 1) + " more problems)";
    }
    return c;
  };
  if (P.count()) return finish();

  const int pp = s.pp, m = s.microbatches, S = s.num_stages();
  // Where each (kind, micro-batch, stage) occurs: count, rank and position of the first one.
  const size_t n = 6ull * m * S;
  auto key = [&](int kind, int mb, int st) { return (static_cast<size_t>(kind) * m + mb) * S + st; };
  std::vector<int> count(n, 0), at_rank(n, -1), at_pos(n, -1);
  for (int r = 0; r < pp; ++r)
    for (size_t i = 0; i < s.per_rank[r].size(); ++i) {
      const PipeAction& a = s.per_rank[r][i];
      const size_t k = key(a.kind, a.microbatch, a.stage);
      if (count[k]++ == 0) {
        at_rank[k] = r;
        at_pos[k] = static_cast<int>(i);
      }
      if (is_compute(a.kind))
        ++c.compute_actions;
      else if (is_send(a.kind))
        ++c.sends;
      else
        ++c.recvs;
    }

  // Where an action must be: its rank and (for comm) its peer; -1 if it must not exist.
  struct Place {
    int rank, peer;
  };
  auto expected = [&](int kind, int st) -> Place {
    switch (kind) {
      case PipeAction::Forward:
      case PipeAction::Backward:
        return {s.stage_rank(st), -1};
      case PipeAction::SendAct:
      case PipeAction::RecvAct: {
        if (st == S - 1 || s.stage_rank(st + 1) == s.stage_rank(st)) return {-1, -1};
        const int from = s.stage_rank(st), to = s.stage_rank(st + 1);
        return kind == PipeAction::SendAct ? Place{from, to} : Place{to, from};
      }
      default: {
        if (st == 0 || s.stage_rank(st - 1) == s.stage_rank(st)) return {-1, -1};
        const int from = s.stage_rank(st), to = s.stage_rank(st - 1);
        return kind == PipeAction::SendGrad ? Place{from, to} : Place{to, from};
      }
    }
  };

  // 1. Every action is on the right rank and names the right peer.
  for (int r = 0; r < pp; ++r)
    for (size_t i = 0; i < s.per_rank[r].size(); ++i) {
      const PipeAction& a = s.per_rank[r][i];
      const std::string where = "rank " + std::to_string(r) + ": " + describe(a) + " ";
      const Place want = expected(a.kind, a.stage);
      if (want.rank < 0) {
        const bool act = a.kind == PipeAction::SendAct || a.kind == PipeAction::RecvAct;
        if ((act && a.stage == S - 1) || (!act && a.stage == 0))
          P.add(where + "is not needed: stage " + std::to_string(a.stage) + " is the " +
                (act ? "last stage (its output is the loss)" : "first stage (nothing before it)"));
        else
          P.add(where + "is not needed: stages " + std::to_string(act ? a.stage : a.stage - 1) + " and " +
                std::to_string(act ? a.stage + 1 : a.stage) + " are both on rank " +
                std::to_string(s.stage_rank(a.stage)) + ", so the hand-off is local");
        continue;
      }
      if (want.rank != r) {
        P.add(where + "is on the wrong rank: it belongs on rank " + std::to_string(want.rank) + " (stage " +
              std::to_string(a.stage) + " is on rank " + std::to_string(s.stage_rank(a.stage)) + ")");
        continue;
      }
      if (!is_compute(a.kind) && a.peer != want.peer)
        P.add(where + "names the wrong peer: expected rank " + std::to_string(want.peer));
    }

  // 2. Completeness and send/recv matching.
  for (int mb = 0; mb < m; ++mb)
    for (int st = 0; st < S; ++st) {
      for (int kind : {PipeAction::Forward, PipeAction::Backward}) {
        const size_t k = key(kind, mb, st);
        const PipeAction a{static_cast<PipeAction::Kind>(kind), mb, st, -1};
        if (count[k] == 0)
          P.add("missing " + describe(a) + " on rank " + std::to_string(s.stage_rank(st)));
        else if (count[k] > 1)
          P.add(describe(a) + " appears " + std::to_string(count[k]) + " times (first on rank " +
                std::to_string(at_rank[k]) + ")");
      }
      for (int kind : {PipeAction::SendAct, PipeAction::SendGrad}) {
        const Place ps = expected(kind, st);
        if (ps.rank < 0) continue;
        const int rk = counterpart(static_cast<PipeAction::Kind>(kind));
        const size_t ks = key(kind, mb, st), kr = key(rk, mb, st);
        const PipeAction snd{static_cast<PipeAction::Kind>(kind), mb, st, ps.peer};
        const PipeAction rcv{static_cast<PipeAction::Kind>(rk), mb, st, ps.rank};
        if (count[ks] == 0 && count[kr] == 0)
          P.add("missing the " + std::string(kind == PipeAction::SendAct ? "activation" : "gradient") +
                " transfer of mb " + std::to_string(mb) + ", stage " + std::to_string(st) + ": neither " +
                describe(snd) + " on rank " + std::to_string(ps.rank) + " nor " + describe(rcv) +
                " on rank " + std::to_string(ps.peer));
        else if (count[ks] == 0)
          P.add(describe(rcv) + " on rank " + std::to_string(ps.peer) + " has no matching " +
                kind_name(snd.kind) + " on rank " + std::to_string(ps.rank));
        else if (count[kr] == 0)
          P.add(describe(snd) + " on rank " + std::to_string(ps.rank) + " has no matching " +
                kind_name(rcv.kind) + " on rank " + std::to_string(ps.peer));
        if (count[ks] > 1) P.add(describe(snd) + " appears " + std::to_string(count[ks]) + " times");
        if (count[kr] > 1) P.add(describe(rcv) + " appears " + std::to_string(count[kr]) + " times");
      }
    }

  // 3. Local order: what each compute needs is on its rank before it.
  auto pos_of = [&](int kind, int mb, int st) -> long {
    const size_t k = key(kind, mb, st);
    const Place want = expected(kind, st);
    return (count[k] == 1 && at_rank[k] == want.rank) ? at_pos[k] : -1;
  };
  auto need_before = [&](int kind_a, int st_a, int kind_b, int st_b, int mb, const char* why) {
    const long pa = pos_of(kind_a, mb, st_a), pb = pos_of(kind_b, mb, st_b);
    if (pa < 0 || pb < 0 || pa < pb) return;
    const PipeAction a{static_cast<PipeAction::Kind>(kind_a), mb, st_a,
                       s.per_rank[at_rank[key(kind_a, mb, st_a)]][pa].peer};
    const PipeAction b{static_cast<PipeAction::Kind>(kind_b), mb, st_b,
                       s.per_rank[at_rank[key(kind_b, mb, st_b)]][pb].peer};
    P.add("rank " + std::to_string(at_rank[key(kind_a, mb, st_a)]) + ": " + describe(a) + " at #" +
          std::to_string(pa) + " must come before " + describe(b) + " at #" + std::to_string(pb) + " (" +
          why + ")");
  };
  for (int mb = 0; mb < m; ++mb)
    for (int st = 0; st < S; ++st) {
      need_before(PipeAction::Forward, st, PipeAction::Backward, st, mb, "backward needs its forward");
      if (st + 1 < S) {
        if (s.stage_rank(st) == s.stage_rank(st + 1)) {
          need_before(PipeAction::Forward, st, PipeAction::Forward, st + 1, mb,
                      "forward of the next stage uses its output");
          need_before(PipeAction::Backward, st + 1, PipeAction::Backward, st, mb,
                      "backward needs the next stage's gradient");
        } else {
          need_before(PipeAction::Forward, st, PipeAction::SendAct, st, mb,
                      "a send needs the activation computed");
          need_before(PipeAction::RecvAct, st, PipeAction::Forward, st + 1, mb,
                      "the forward uses the received activation");
          need_before(PipeAction::Backward, st + 1, PipeAction::SendGrad, st + 1, mb,
                      "a send needs the gradient computed");
          need_before(PipeAction::RecvGrad, st + 1, PipeAction::Backward, st, mb,
                      "the backward uses the received gradient");
        }
      }
    }

  // 4. Peak activations alive per rank.
  c.peak_in_flight.assign(pp, 0);
  for (int r = 0; r < pp; ++r) {
    int alive = 0;
    for (const PipeAction& a : s.per_rank[r]) {
      if (a.kind == PipeAction::Forward) c.peak_in_flight[r] = std::max(c.peak_in_flight[r], ++alive);
      if (a.kind == PipeAction::Backward) --alive;
    }
  }

  // 5. Deadlock: run the lists under the executor contract, and under rendezvous sends.
  const BufferedRun run = run_buffered(s, 1.0, 1.0, 0.0);
  c.deadlock_free = run.completed;
  c.deadlock_message = run.deadlock;
  if (!run.completed) P.add(run.deadlock);
  c.rendezvous_message = run_rendezvous(s, &c.rendezvous_safe);
  return finish();
}

// ---------------------------------------------------------------------------------------------
// Timeline

Timeline simulate_timeline(const PipeSchedule& s, double t_fwd, double t_bwd, double t_comm) {
  Timeline t;
  Problems P;
  check_ranges(s, P);
  if (P.count()) {
    t.message = "cannot simulate: " + P.list().front();
    return t;
  }
  if (!(t_fwd >= 0) || !(t_bwd >= 0) || !(t_comm >= 0)) {
    t.message = "cannot simulate: times must be >= 0";
    return t;
  }
  BufferedRun run = run_buffered(s, t_fwd, t_bwd, t_comm);
  t.completed = run.completed;
  t.message = run.completed ? "completed" : run.deadlock;
  t.makespan = 0;
  for (double c : run.clock) t.makespan = std::max(t.makespan, c);
  t.busy = run.busy;
  t.idle.resize(s.pp);
  double idle = 0, busy = 0;
  for (int r = 0; r < s.pp; ++r) {
    t.idle[r] = t.makespan - t.busy[r];
    idle += t.idle[r];
    busy += t.busy[r];
  }
  t.bubble_fraction = t.makespan > 0 ? idle / (s.pp * t.makespan) : 0.0;
  t.bubble_relative = busy > 0 ? idle / busy : 0.0;
  t.per_rank = std::move(run.events);
  return t;
}

BubbleFormula bubble_formula(const PipeSchedule& s) {
  const double p = s.pp, m = s.microbatches;
  if (s.virtual_stages > 1) {
    const double vm = s.virtual_stages * m;
    return {"(p-1)/(v*m+p-1), relative (p-1)/(v*m)", (p - 1) / (vm + p - 1), (p - 1) / vm};
  }
  return {"(p-1)/(m+p-1), relative (p-1)/m", (p - 1) / (m + p - 1), (p - 1) / m};
}

// ---------------------------------------------------------------------------------------------
// Printing

std::string format_actions(const PipeSchedule& s) {
  std::ostringstream o;
  for (size_t r = 0; r < s.per_rank.size(); ++r) {
    o << "rank " << r << ":";
    for (const PipeAction& a : s.per_rank[r]) o << " " << short_string(a);
    o << "\n";
  }
  return o.str();
}

std::string format_schedule(const PipeSchedule& s, bool show_comm) {
  // One slot per virtual-stage forward/backward: t_fwd = t_bwd = v per rank-share.
  const double v = std::max(1, s.virtual_stages);
  Timeline t = simulate_timeline(s, v, v, 0.0);
  if (t.per_rank.empty()) return t.message + "\n";
  const int pp = s.pp;
  const long slots = std::lround(t.makespan);
  // cells[row][rank]; compute row for slot k is 2k+1, comm row before it is 2k (row 2*slots is
  // the comm after the last slot).
  std::vector<std::vector<std::string>> cells(2 * slots + 1, std::vector<std::string>(pp));
  for (int r = 0; r < pp; ++r)
    for (const TimedAction& e : t.per_rank[r]) {
      if (is_compute(e.action.kind)) {
        cells[2 * std::lround(e.start) + 1][r] = short_string(e.action);
      } else if (show_comm) {
        std::string& c = cells[2 * std::lround(is_send(e.action.kind) ? e.start : e.end)][r];
        c += (c.empty() ? "" : " ") + short_string(e.action);
      }
    }
  const std::string slot_hdr = "slot";
  size_t w0 = std::max(slot_hdr.size(), std::to_string(slots).size());
  std::vector<size_t> w(pp);
  for (int r = 0; r < pp; ++r) {
    w[r] = ("rank " + std::to_string(r)).size();
    for (const auto& row : cells) w[r] = std::max(w[r], row[r].size());
  }
  std::ostringstream o;
  auto emit = [&](std::string line) {  // one table line, without trailing blanks
    while (!line.empty() && line.back() == ' ') line.pop_back();
    o << line << "\n";
  };
  auto pad = [](const std::string& x, size_t width) { return x + std::string(width - x.size(), ' '); };
  std::string line = pad(slot_hdr, w0);
  for (int r = 0; r < pp; ++r) line += " | " + pad("rank " + std::to_string(r), w[r]);
  emit(line);
  line = std::string(w0, '-');
  for (int r = 0; r < pp; ++r) line += "-+-" + std::string(w[r], '-');
  emit(line);
  for (size_t row = 0; row < cells.size(); ++row) {
    const bool compute_row = row % 2 == 1;
    if (!compute_row) {
      bool any = false;
      for (int r = 0; r < pp; ++r) any = any || !cells[row][r].empty();
      if (!any) continue;
    }
    const std::string label = compute_row ? std::to_string(row / 2) : "";
    line = std::string(w0 - label.size(), ' ') + label;
    for (int r = 0; r < pp; ++r) {
      const std::string& x = cells[row][r];
      line += (compute_row ? " | " : " : ") + pad(compute_row && x.empty() ? "." : x, w[r]);
    }
    emit(line);
  }
  if (!t.completed) o << "(the schedule stops here) " << t.message << "\n";
  return o.str();
}

}  // namespace mt::parallel
