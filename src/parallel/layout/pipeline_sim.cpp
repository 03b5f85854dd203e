// Pipeline schedules run as programs (declared in pipeline_schedule.h): the execution models -
// buffered sends with blocking receives, and rendezvous sends in batches - with the deadlock
// explanations they give, the checker built on them, and the timeline simulation.
#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "parallel/layout/pipeline_schedule.h"

namespace mt::parallel {

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
BufferedRun run_buffered(const PipeSchedule& s, double t_fwd, double t_bwd, double t_comm, double w_share = 0.5) {
  const int pp = s.pp;
  const MsgIndex idx{s.microbatches, s.num_stages()};
  const double nan = std::numeric_limits<double>::quiet_NaN();
  std::vector<double> posted(idx.size(), nan);  // time each message was sent
  BufferedRun run;
  run.pos.assign(pp, 0);
  run.clock.assign(pp, 0.0);
  run.busy.assign(pp, 0.0);
  run.events.resize(pp);
  const double tf = t_fwd / s.virtual_stages, tb_all = t_bwd / s.virtual_stages;
  const double tb = s.split_backward ? tb_all * (1.0 - w_share) : tb_all, tw = tb_all * w_share;
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
          const double d = a.kind == PipeAction::Forward ? tf : a.kind == PipeAction::Backward ? tb : tw;
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

namespace {

// Where an action must be: its rank and (for comm) its peer; rank -1 if it must not exist.
struct Place {
  int rank, peer;
};

Place expected_place(const PipeSchedule& s, int kind, int st) {
  const int S = s.num_stages();
  switch (kind) {
    case PipeAction::Forward:
    case PipeAction::Backward:
    case PipeAction::Weight:
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
}

// Where each (kind, micro-batch, stage) occurs: how often, and the rank and position of the first.
struct Occurrences {
  int m, S;
  std::vector<int> count, rank, pos;
  Occurrences(const PipeSchedule& s, ScheduleCheck& c)
      : m(s.microbatches), S(s.num_stages()), count(7ull * m * S, 0), rank(count.size(), -1), pos(count.size(), -1) {
    for (int r = 0; r < s.pp; ++r)
      for (size_t i = 0; i < s.per_rank[r].size(); ++i) {
        const PipeAction& a = s.per_rank[r][i];
        const size_t k = key(a.kind, a.microbatch, a.stage);
        if (count[k]++ == 0) {
          rank[k] = r;
          pos[k] = static_cast<int>(i);
        }
        if (is_compute(a.kind))
          ++c.compute_actions;
        else if (is_send(a.kind))
          ++c.sends;
        else
          ++c.recvs;
      }
  }
  size_t key(int kind, int mb, int st) const { return (static_cast<size_t>(kind) * m + mb) * S + st; }
};

// Every action is on the right rank and names the right peer.
void check_placement(const PipeSchedule& s, Problems& P) {
  const int S = s.num_stages();
  for (int r = 0; r < s.pp; ++r)
    for (size_t i = 0; i < s.per_rank[r].size(); ++i) {
      const PipeAction& a = s.per_rank[r][i];
      const std::string where = "rank " + std::to_string(r) + ": " + describe(a) + " ";
      const Place want = expected_place(s, a.kind, a.stage);
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
}

// The transfer of `kind` (SendAct or SendGrad) for (mb, st) is there once: its send and receive.
void check_transfer(const PipeSchedule& s, const Occurrences& o, int kind, int mb, int st, Problems& P) {
  const Place ps = expected_place(s, kind, st);
  if (ps.rank < 0) return;
  const int rk = counterpart(static_cast<PipeAction::Kind>(kind));
  const size_t ks = o.key(kind, mb, st), kr = o.key(rk, mb, st);
  const PipeAction snd{static_cast<PipeAction::Kind>(kind), mb, st, ps.peer};
  const PipeAction rcv{static_cast<PipeAction::Kind>(rk), mb, st, ps.rank};
  if (o.count[ks] == 0 && o.count[kr] == 0)
    P.add("missing the " + std::string(kind == PipeAction::SendAct ? "activation" : "gradient") + " transfer of mb " +
          std::to_string(mb) + ", stage " + std::to_string(st) + ": neither " + describe(snd) + " on rank " +
          std::to_string(ps.rank) + " nor " + describe(rcv) + " on rank " + std::to_string(ps.peer));
  else if (o.count[ks] == 0)
    P.add(describe(rcv) + " on rank " + std::to_string(ps.peer) + " has no matching " + kind_name(snd.kind) +
          " on rank " + std::to_string(ps.rank));
  else if (o.count[kr] == 0)
    P.add(describe(snd) + " on rank " + std::to_string(ps.rank) + " has no matching " + kind_name(rcv.kind) +
          " on rank " + std::to_string(ps.peer));
  if (o.count[ks] > 1) P.add(describe(snd) + " appears " + std::to_string(o.count[ks]) + " times");
  if (o.count[kr] > 1) P.add(describe(rcv) + " appears " + std::to_string(o.count[kr]) + " times");
}

// Every forward and backward is there once, and every transfer between ranks.
void check_complete(const PipeSchedule& s, const Occurrences& o, Problems& P) {
  for (int mb = 0; mb < o.m; ++mb)
    for (int st = 0; st < o.S; ++st) {
      for (int kind : {PipeAction::Forward, PipeAction::Backward}) {
        const size_t k = o.key(kind, mb, st);
        const PipeAction a{static_cast<PipeAction::Kind>(kind), mb, st, -1};
        if (o.count[k] == 0)
          P.add("missing " + describe(a) + " on rank " + std::to_string(s.stage_rank(st)));
        else if (o.count[k] > 1)
          P.add(describe(a) + " appears " + std::to_string(o.count[k]) + " times (first on rank " +
                std::to_string(o.rank[k]) + ")");
      }
      // Weight: exactly once per (micro-batch, stage) with a split backward, never without.
      const size_t kw = o.key(PipeAction::Weight, mb, st);
      const PipeAction w{PipeAction::Weight, mb, st, -1};
      if (s.split_backward && o.count[kw] == 0)
        P.add("missing " + describe(w) + " on rank " + std::to_string(s.stage_rank(st)) +
              " (a split backward needs the weight gradient of every backward)");
      else if (s.split_backward && o.count[kw] > 1)
        P.add(describe(w) + " appears " + std::to_string(o.count[kw]) + " times");
      else if (!s.split_backward && o.count[kw] > 0)
        P.add(describe(w) + " in a schedule without a split backward (its Backward already computes the weight "
              "gradients)");
      for (int kind : {PipeAction::SendAct, PipeAction::SendGrad}) check_transfer(s, o, kind, mb, st, P);
    }
}

// Local order: what each compute needs is on its rank before it.
void check_local_order(const PipeSchedule& s, const Occurrences& o, Problems& P) {
  auto pos_of = [&](int kind, int mb, int st) -> long {
    const size_t k = o.key(kind, mb, st);
    const Place want = expected_place(s, kind, st);
    return (o.count[k] == 1 && o.rank[k] == want.rank) ? o.pos[k] : -1;
  };
  auto need_before = [&](int kind_a, int st_a, int kind_b, int st_b, int mb, const char* why) {
    const long pa = pos_of(kind_a, mb, st_a), pb = pos_of(kind_b, mb, st_b);
    if (pa < 0 || pb < 0 || pa < pb) return;
    const PipeAction a{static_cast<PipeAction::Kind>(kind_a), mb, st_a,
                       s.per_rank[o.rank[o.key(kind_a, mb, st_a)]][pa].peer};
    const PipeAction b{static_cast<PipeAction::Kind>(kind_b), mb, st_b,
                       s.per_rank[o.rank[o.key(kind_b, mb, st_b)]][pb].peer};
    P.add("rank " + std::to_string(o.rank[o.key(kind_a, mb, st_a)]) + ": " + describe(a) + " at #" +
          std::to_string(pa) + " must come before " + describe(b) + " at #" + std::to_string(pb) + " (" + why + ")");
  };
  for (int mb = 0; mb < o.m; ++mb)
    for (int st = 0; st < o.S; ++st) {
      need_before(PipeAction::Forward, st, PipeAction::Backward, st, mb, "backward needs its forward");
      if (s.split_backward)
        need_before(PipeAction::Backward, st, PipeAction::Weight, st, mb,
                    "the weight gradient needs its backward's output gradient");
      if (st + 1 >= o.S) continue;
      if (s.stage_rank(st) == s.stage_rank(st + 1)) {
        need_before(PipeAction::Forward, st, PipeAction::Forward, st + 1, mb, "forward of the next stage uses its output");
        need_before(PipeAction::Backward, st + 1, PipeAction::Backward, st, mb, "backward needs the next stage's gradient");
      } else {
        need_before(PipeAction::Forward, st, PipeAction::SendAct, st, mb, "a send needs the activation computed");
        need_before(PipeAction::RecvAct, st, PipeAction::Forward, st + 1, mb, "the forward uses the received activation");
        need_before(PipeAction::Backward, st + 1, PipeAction::SendGrad, st + 1, mb, "a send needs the gradient computed");
        need_before(PipeAction::RecvGrad, st + 1, PipeAction::Backward, st, mb,
                    "the backward uses the received gradient");
      }
    }
}

// Peak activations alive per rank.
std::vector<int> peak_in_flight(const PipeSchedule& s) {
  std::vector<int> peak(s.pp, 0);
  for (int r = 0; r < s.pp; ++r) {
    int alive = 0;
    for (const PipeAction& a : s.per_rank[r]) {
      if (a.kind == PipeAction::Forward) peak[r] = std::max(peak[r], ++alive);
      if (a.kind == (s.split_backward ? PipeAction::Weight : PipeAction::Backward)) --alive;
    }
  }
  return peak;
}

// The problems found into `c`, with its one-line message.
ScheduleCheck& summarize(ScheduleCheck& c, const Problems& P) {
  c.problems = P.list();
  c.ok = P.count() == 0;
  if (c.ok) {
    std::ostringstream o;
    o << "ok: " << c.compute_actions << " forwards/backwards complete, " << c.sends << " sends matched by " << c.recvs
      << " receives, dependencies in order, no deadlock (buffered sends, blocking receives)";
    c.message = o.str();
  } else {
    c.message = c.problems.front();
    if (P.count() > 1) c.message += " (and " + std::to_string(P.count() - 1) + " more problems)";
  }
  return c;
}

}  // namespace

ScheduleCheck check_schedule(const PipeSchedule& s) {
  ScheduleCheck c;
  Problems P;
  check_ranges(s, P);
  if (P.count()) return summarize(c, P);
  const Occurrences occ(s, c);
  check_placement(s, P);
  check_complete(s, occ, P);
  check_local_order(s, occ, P);
  c.peak_in_flight = peak_in_flight(s);
  // Deadlock: run the lists under the executor contract, and under rendezvous sends.
  const BufferedRun run = run_buffered(s, 1.0, 1.0, 0.0);
  c.deadlock_free = run.completed;
  c.deadlock_message = run.deadlock;
  if (!run.completed) P.add(run.deadlock);
  c.rendezvous_message = run_rendezvous(s, &c.rendezvous_safe);
  return summarize(c, P);
}

// ---------------------------------------------------------------------------------------------
// Timeline

Timeline simulate_timeline(const PipeSchedule& s, double t_fwd, double t_bwd, double t_comm, double w_share) {
  Timeline t;
  Problems P;
  check_ranges(s, P);
  if (P.count()) {
    t.message = "cannot simulate: " + P.list().front();
    return t;
  }
  if (!(t_fwd >= 0) || !(t_bwd >= 0) || !(t_comm >= 0) || !(w_share >= 0 && w_share <= 1)) {
    t.message = "cannot simulate: times must be >= 0";
    return t;
  }
  BufferedRun run = run_buffered(s, t_fwd, t_bwd, t_comm, w_share);
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

}  // namespace mt::parallel
