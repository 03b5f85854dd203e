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

bool is_compute(PipeAction::Kind k) {
  return k == PipeAction::Forward || k == PipeAction::Backward || k == PipeAction::Weight;
}
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
    case PipeAction::Weight:
      return "Weight";
  }
  return "?";
}

bool valid_kind(PipeAction::Kind k) {
  int i = static_cast<int>(k);
  return i >= PipeAction::Forward && i <= PipeAction::Weight;
}

std::string short_string(const PipeAction& a) {
  std::string mbs = std::to_string(a.microbatch) + "." + std::to_string(a.stage);
  switch (a.kind) {
    case PipeAction::Forward:
      return "F" + mbs;
    case PipeAction::Backward:
      return "B" + mbs;
    case PipeAction::Weight:
      return "W" + mbs;
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
                             const std::vector<std::vector<PipeAction>>& compute, bool vshape = false) {
  PipeSchedule s;
  s.name = std::move(name);
  s.pp = pp;
  s.microbatches = m;
  s.virtual_stages = v;
  s.vshape = vshape;
  s.per_rank.resize(pp);
  const int S = pp * v;
  for (int r = 0; r < pp; ++r) {
    auto& out = s.per_rank[r];
    out.reserve(compute[r].size() * 3);
    for (const PipeAction& a : compute[r]) {
      const int st = a.stage;
      if (a.kind == PipeAction::Weight) {
        out.push_back(a);
      } else if (a.kind == PipeAction::Forward) {
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

// The zero-bubble list scheduler (pipeline_schedule.h). limit[r]: activation sets rank r may hold;
// c: one micro-batch's F, B and W on one stage. Event-driven: the rank that is free first (the
// lowest rank on a tie) picks, at the time it is free, among what is ready then; a rank with
// nothing ready waits for the next action of another rank to end. With c = {1, 1, 1} every time is
// a whole slot: the unit-slot list scheduler.
static PipeSchedule zero_bubble(const std::string& name, int pp, int m, int v, bool vshape,
                                const std::vector<int>& limit, const StageCosts& c) {
  PipeSchedule shape;
  shape.pp = pp;
  shape.virtual_stages = v;
  shape.vshape = vshape;
  const int S = pp * v;
  constexpr double kNever = -1;
  std::vector<std::vector<double>> f_done(S, std::vector<double>(m, kNever)), b_done = f_done;
  std::vector<int> next_f(S, 0), next_b(S, 0), next_w(S, 0), alive(pp, 0);
  std::vector<double> free_at(pp, 0.0);
  std::vector<std::vector<int>> stages_of(pp);
  for (int st = 0; st < S; ++st) stages_of[shape.stage_rank(st)].push_back(st);
  std::vector<std::vector<PipeAction>> lists(pp);
  const long long total = 3LL * m * S;
  long long placed = 0;
  // A tolerance for sums of costs that should be equal (1.3 + 0.7 vs 2.0).
  auto done_by = [](double when, double t) { return when >= 0 && when <= t + 1e-9; };
  // What rank r starts at time t, if anything: true when it placed an action.
  auto start = [&](int r, double t) {
    // B: the ready one of the smallest micro-batch (ties: the later stage, nearer the loss).
    int pick = -1, best_mb = m;
    for (int st : stages_of[r]) {
      const int mb = next_b[st];
      if (mb >= m || !done_by(f_done[st][mb], t)) continue;
      if (st + 1 < S && !done_by(b_done[st + 1][mb], t)) continue;
      if (mb < best_mb || (mb == best_mb && st > pick)) pick = st, best_mb = mb;
    }
    if (pick >= 0) {
      lists[r].push_back(bwd(best_mb, pick));
      b_done[pick][best_mb] = free_at[r] = t + c.b;
      ++next_b[pick];
      return true;
    }
    // F: under the limit; the later stage first (it brings a micro-batch nearer the loss).
    if (alive[r] < limit[r])
      for (int st : stages_of[r]) {
        const int mb = next_f[st];
        if (mb >= m || (st > 0 && !done_by(f_done[st - 1][mb], t))) continue;
        if (pick < 0 || st > pick) pick = st;
      }
    if (pick >= 0) {
      const int mb = next_f[pick]++;
      lists[r].push_back(fwd(mb, pick));
      f_done[pick][mb] = free_at[r] = t + c.f;
      ++alive[r];
      return true;
    }
    // W: the oldest pending one.
    for (int st : stages_of[r]) {
      const int mb = next_w[st];
      if (mb >= next_b[st] || !done_by(b_done[st][mb], t)) continue;
      if (pick < 0 || b_done[st][mb] < b_done[pick][next_w[pick]]) pick = st;
    }
    if (pick >= 0) {
      lists[r].push_back({PipeAction::Weight, next_w[pick]++, pick, -1});
      free_at[r] = t + c.w;
      --alive[r];
      return true;
    }
    return false;
  };
  while (placed < total) {
    // The ranks free at the earliest time pick in rank order; when none of them can start
    // anything, they all wait for the next action anywhere to end.
    double t = free_at[0];
    for (int q = 1; q < pp; ++q) t = std::min(t, free_at[q]);
    bool any = false;
    for (int r = 0; r < pp && !any; ++r)
      if (free_at[r] <= t + 1e-9 && start(r, t)) any = true;
    if (any) {
      ++placed;
      continue;
    }
    double next = std::numeric_limits<double>::infinity();
    for (int q = 0; q < pp; ++q)
      if (free_at[q] > t + 1e-9) next = std::min(next, free_at[q]);
    for (int st = 0; st < S; ++st)
      for (int mb = 0; mb < m; ++mb)
        for (double e : {f_done[st][mb], b_done[st][mb]})
          if (e > t + 1e-9) next = std::min(next, e);
    if (!std::isfinite(next)) throw std::logic_error(name + ": the list scheduler is stuck (activation limit too small)");
    for (int q = 0; q < pp; ++q)
      if (free_at[q] <= t + 1e-9) free_at[q] = next;
  }
  PipeSchedule s = add_comm(name, pp, m, v, lists, vshape);
  s.split_backward = true;
  return s;
}

static bool unit_costs(const StageCosts& c) { return c.f == 1.0 && c.b == 1.0 && c.w == 1.0; }

// The candidate that idles least when simulated with the costs (the first on a tie).
static PipeSchedule least_idle(std::vector<PipeSchedule> candidates, const StageCosts& c) {
  size_t best = 0;
  double best_bubble = 2.0;
  for (size_t i = 0; i < candidates.size(); ++i) {
    const double v = candidates[i].virtual_stages;
    const Timeline t = simulate_timeline(candidates[i], v * c.f, v * (c.b + c.w), 0.0, c.w / (c.b + c.w));
    if (t.completed && t.bubble_fraction < best_bubble - 1e-12) best = i, best_bubble = t.bubble_fraction;
  }
  return std::move(candidates[best]);
}

static void check_costs(const std::string& name, const StageCosts& c) {
  if (!(c.f > 0 && c.b > 0 && c.w > 0 && std::isfinite(c.f + c.b + c.w)))
    throw std::invalid_argument(name + ": stage costs F, B, W must be finite and > 0");
}

PipeSchedule zero_bubble_h1(int pp, int m, const StageCosts& costs) {
  check_sizes(to_string(PipelineSchedule::ZeroBubbleH1), pp, m, 1);
  check_costs(to_string(PipelineSchedule::ZeroBubbleH1), costs);
  // Measured costs: the fixed order below or the list scheduler under the same memory limit (pp sets
  // on every rank; the paper's automatic "ZB-1p"), whichever idles less with those costs.
  if (!unit_costs(costs))
    return least_idle({zero_bubble_h1(pp, m),
                       zero_bubble(to_string(PipelineSchedule::ZeroBubbleH1), pp, m, 1, false, std::vector<int>(pp, pp), costs)},
                      costs);
  // Rank r: 1F1B's warm-up (pp - r forwards before the first backward), then per step a B, the W
  // of r steps before (the later ranks postpone their weight gradients into the slots that the
  // earlier ranks' B would otherwise leave idle), and the next F; the postponed W's end the list.
  // Every rank holds at most pp sets in flight (F done, W not yet), 1F1B's rank-0 peak.
  std::vector<std::vector<PipeAction>> c(pp);
  for (int r = 0; r < pp; ++r) {
    const int warm = std::min(pp - r, m);
    for (int i = 0; i < warm; ++i) c[r].push_back(fwd(i, r));
    int next_w = 0;
    for (int k = 0; k < m; ++k) {
      c[r].push_back(bwd(k, r));
      if (k >= r) c[r].push_back({PipeAction::Weight, next_w++, r, -1});
      if (warm + k < m) c[r].push_back(fwd(warm + k, r));
    }
    while (next_w < m) c[r].push_back({PipeAction::Weight, next_w++, r, -1});
  }
  PipeSchedule s = add_comm(to_string(PipelineSchedule::ZeroBubbleH1), pp, m, 1, c);
  s.split_backward = true;
  return s;
}

PipeSchedule zero_bubble_v(int pp, int m, const StageCosts& costs) {
  check_sizes(to_string(PipelineSchedule::ZeroBubbleV), pp, m, 2);
  check_costs(to_string(PipelineSchedule::ZeroBubbleV), costs);
  const std::string name = to_string(PipelineSchedule::ZeroBubbleV);
  const std::vector<int> limit(pp, 2 * pp);
  if (unit_costs(costs)) return zero_bubble(name, pp, m, 2, true, limit, costs);
  // Measured costs: the list schedule for them, or for unit costs where that idles less.
  return least_idle({zero_bubble(name, pp, m, 2, true, limit, costs), zero_bubble(name, pp, m, 2, true, limit, {})},
                    costs);
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

PipeSchedule make_schedule(PipelineSchedule kind, int pp, int m, int v, CommPlacement placement,
                           const StageCosts& costs) {
  switch (kind) {
    case PipelineSchedule::Interleaved: return interleaved_1f1b(pp, m, v, placement);
    case PipelineSchedule::GPipe:
    case PipelineSchedule::OneFOneB:
      if (v != 1)
        throw std::invalid_argument(std::string("schedule ") + to_string(kind) +
                                    " has one stage per rank; virtual stages = " + std::to_string(v) +
                                    " needs --schedule interleaved_1f1b");
      return kind == PipelineSchedule::GPipe ? gpipe(pp, m) : one_f_one_b(pp, m);
    case PipelineSchedule::ZeroBubbleH1:
      if (v != 1)
        throw std::invalid_argument("schedule zb1p has one stage per rank; virtual stages = " + std::to_string(v) +
                                    " needs --schedule zbv (2) or interleaved_1f1b");
      return zero_bubble_h1(pp, m, costs);
    case PipelineSchedule::ZeroBubbleV:
      if (v != 1 && v != 2)
        throw std::invalid_argument("schedule zbv has two stages per rank (a V); virtual stages = " +
                                    std::to_string(v) + " is not possible");
      return zero_bubble_v(pp, m, costs);
    case PipelineSchedule::None: break;
  }
  throw std::invalid_argument("pipeline schedule 'none' has no action lists (known: " +
                              valid_values(PipelineSchedule{}) + ")");
}

PipeSchedule make_schedule(const std::string& name, int pp, int m, int v, CommPlacement placement,
                           const StageCosts& costs) {
  if (std::optional<PipelineSchedule> kind = try_parse_pipeline_schedule(name))
    return make_schedule(*kind, pp, m, v, placement, costs);
  throw std::invalid_argument("unknown pipeline schedule '" + name + "' (known: " + valid_values(PipelineSchedule{}) +
                              ")");
}

// ---------------------------------------------------------------------------------------------
// Bubble

BubbleFormula bubble_formula(const PipeSchedule& s) {
  const double p = s.pp, m = s.microbatches;
  if (s.split_backward && s.vshape) {  // no closed form: the schedule's own timeline
    const Timeline t = simulate_timeline(s, 1.0, 2.0, 0.0);
    return {"simulated with T_F = T_B = T_W (no closed form)", t.bubble_fraction, t.bubble_relative};
  }
  if (s.split_backward)  // the fill costs T_F + T_B - T_W per rank instead of T_F + T_B + T_W
    return {"(p-1)/(3m+p-1), relative (p-1)/(3m) with T_F = T_B = T_W", (p - 1) / (3 * m + p - 1), (p - 1) / (3 * m)};
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
  Timeline t = simulate_timeline(s, v, s.split_backward ? 2 * v : v, 0.0);
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
