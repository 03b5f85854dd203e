// Pipeline schedules as data: builders, checker, timeline, table and the `schedule` command.
#include "parallel/layout/pipeline_schedule.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

using mt::parallel::CommPlacement;
using mt::parallel::PipeAction;
using mt::parallel::PipeSchedule;
namespace pl = mt::parallel;

namespace {

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

struct Case {
  std::string name;
  int pp, m, v;
  CommPlacement placement;
};

// Every valid combination the brief asks for: pp 1..4, m in {1,2,4,8,16}, interleaved with
// v in {2,3} where m % pp == 0, both comm placements.
std::vector<Case> all_cases() {
  std::vector<Case> cases;
  for (int pp : {1, 2, 3, 4})
    for (int m : {1, 2, 4, 8, 16}) {
      cases.push_back({"gpipe", pp, m, 1, CommPlacement::Eager});
      cases.push_back({"1f1b", pp, m, 1, CommPlacement::Eager});
      if (m % pp == 0)
        for (int v : {2, 3})
          for (CommPlacement p : {CommPlacement::Eager, CommPlacement::Batched})
            cases.push_back({"interleaved_1f1b", pp, m, v, p});
    }
  return cases;
}

std::string label(const Case& c) {
  return c.name + " pp=" + std::to_string(c.pp) + " m=" + std::to_string(c.m) + " v=" + std::to_string(c.v) +
         " " + pl::placement_name(c.placement);
}

// Position of an action in a rank's list (-1 if absent).
long find(const std::vector<PipeAction>& l, PipeAction::Kind k, int mb, int stage) {
  for (size_t i = 0; i < l.size(); ++i)
    if (l[i].kind == k && l[i].microbatch == mb && l[i].stage == stage) return static_cast<long>(i);
  return -1;
}

}  // namespace

// ------------------------------------------------------------------------------------------------
// The builders' schedules pass the checker

TEST(PipelineSchedule, AllBuiltSchedulesPassTheChecker) {
  for (const Case& c : all_cases()) {
    SCOPED_TRACE(label(c));
    const PipeSchedule s = pl::make_schedule(c.name, c.pp, c.m, c.v, c.placement);
    EXPECT_EQ(s.name, c.name);
    EXPECT_EQ(s.pp, c.pp);
    EXPECT_EQ(s.microbatches, c.m);
    EXPECT_EQ(s.virtual_stages, c.v);
    ASSERT_EQ(static_cast<int>(s.per_rank.size()), c.pp);
    const auto check = pl::check_schedule(s);
    EXPECT_TRUE(check.ok) << check.message;
    EXPECT_TRUE(check.deadlock_free) << check.deadlock_message;
    EXPECT_TRUE(contains(check.message, "ok:")) << check.message;
    EXPECT_TRUE(check.problems.empty());
    EXPECT_EQ(check.compute_actions, 2 * c.m * c.pp * c.v);
    EXPECT_EQ(check.sends, check.recvs);
    // One activation and one gradient transfer per micro-batch and stage boundary across ranks
    // (with pp = 1 every hand-off is local).
    EXPECT_EQ(check.sends, c.pp == 1 ? 0 : 2 * c.m * (c.pp * c.v - 1));
    // Eager GPipe / 1F1B and batched interleaved are also safe with rendezvous sends.
    if (c.name != "interleaved_1f1b" || c.placement == CommPlacement::Batched) {
      EXPECT_TRUE(check.rendezvous_safe) << check.rendezvous_message;
    }
    // Every compute is on the rank that owns its stage.
    for (int r = 0; r < c.pp; ++r)
      for (const PipeAction& a : s.per_rank[r])
        if (pl::is_compute(a.kind)) {
          EXPECT_EQ(a.stage % c.pp, r);
        }
  }
}

TEST(PipelineSchedule, OneFOneBHasMegatronShape) {
  // pp=4, m=8: rank r runs pp-r-1 warm-up forwards, then alternates, then drains.
  const PipeSchedule s = pl::one_f_one_b(4, 8);
  for (int r = 0; r < 4; ++r) {
    std::vector<PipeAction> compute;
    for (const PipeAction& a : s.per_rank[r])
      if (pl::is_compute(a.kind)) compute.push_back(a);
    ASSERT_EQ(compute.size(), 16u);
    const int warmup = 4 - r - 1;
    for (int i = 0; i < warmup; ++i) EXPECT_EQ(compute[i].kind, PipeAction::Forward);
    for (int i = 0; i < 8 - warmup; ++i) {
      EXPECT_EQ(compute[warmup + 2 * i].kind, PipeAction::Forward);
      EXPECT_EQ(compute[warmup + 2 * i].microbatch, warmup + i);
      EXPECT_EQ(compute[warmup + 2 * i + 1].kind, PipeAction::Backward);
      EXPECT_EQ(compute[warmup + 2 * i + 1].microbatch, i);
    }
    for (int i = warmup + 2 * (8 - warmup); i < 16; ++i) EXPECT_EQ(compute[i].kind, PipeAction::Backward);
  }
  // Megatron's pairing: after a forward, "send forward" then "receive backward".
  const auto& r1 = s.per_rank[1];
  const long f = find(r1, PipeAction::Forward, 2, 1);
  ASSERT_GE(f, 0);
  EXPECT_EQ(r1[f + 1].kind, PipeAction::SendAct);
  EXPECT_EQ(r1[f + 1].peer, 2);
  EXPECT_EQ(r1[f + 2].kind, PipeAction::RecvGrad);
  EXPECT_EQ(r1[f + 2].peer, 2);
}

TEST(PipelineSchedule, InterleavedUsesMegatronLayoutAndOrder) {
  const PipeSchedule s = pl::interleaved_1f1b(4, 8, 2);
  EXPECT_EQ(s.num_stages(), 8);
  // Rank 1 owns stages 1 and 5; its first forwards run micro-batches 0..3 on chunk 0, then on
  // chunk 1 (stage 5), then micro-batches 4.. on chunk 0 again.
  std::vector<PipeAction> f;
  for (const PipeAction& a : s.per_rank[1])
    if (a.kind == PipeAction::Forward) f.push_back(a);
  ASSERT_EQ(f.size(), 16u);
  const int want_mb[] = {0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 4, 5, 6, 7};
  const int want_st[] = {1, 1, 1, 1, 5, 5, 5, 5, 1, 1, 1, 1, 5, 5, 5, 5};
  for (int i = 0; i < 16; ++i) {
    EXPECT_EQ(f[i].microbatch, want_mb[i]) << i;
    EXPECT_EQ(f[i].stage, want_st[i]) << i;
  }
  // The last rank's stage-3 output goes to rank 0's stage 4 (the ring wraps around).
  const long send = find(s.per_rank[3], PipeAction::SendAct, 0, 3);
  ASSERT_GE(send, 0);
  EXPECT_EQ(s.per_rank[3][send].peer, 0);
  EXPECT_GE(find(s.per_rank[0], PipeAction::RecvAct, 0, 3), 0);
  // Rank 0's first backward is micro-batch 0 on its last chunk (stage 4).
  for (const PipeAction& a : s.per_rank[0])
    if (a.kind == PipeAction::Backward) {
      EXPECT_EQ(a.microbatch, 0);
      EXPECT_EQ(a.stage, 4);
      break;
    }
}

TEST(PipelineSchedule, SingleRankPipelinesHaveNoCommunication) {
  for (const std::string name : {"gpipe", "1f1b", "interleaved_1f1b"}) {
    const PipeSchedule s = pl::make_schedule(name, 1, 4, name == "interleaved_1f1b" ? 3 : 1);
    for (const PipeAction& a : s.per_rank[0]) EXPECT_TRUE(pl::is_compute(a.kind)) << name;
    EXPECT_TRUE(pl::check_schedule(s).ok) << name;
  }
}

// ------------------------------------------------------------------------------------------------
// Peak activations in flight

TEST(PipelineSchedule, PeakInFlightOneFOneBAtMostPpGPipeAllMicrobatches) {
  for (int pp : {1, 2, 3, 4})
    for (int m : {1, 2, 4, 8, 16}) {
      SCOPED_TRACE("pp=" + std::to_string(pp) + " m=" + std::to_string(m));
      const auto c1 = pl::check_schedule(pl::one_f_one_b(pp, m));
      const auto cg = pl::check_schedule(pl::gpipe(pp, m));
      ASSERT_EQ(static_cast<int>(c1.peak_in_flight.size()), pp);
      for (int r = 0; r < pp; ++r) {
        EXPECT_LE(c1.peak_in_flight[r], pp);
        EXPECT_EQ(c1.peak_in_flight[r], std::min(pp - r, m));
        EXPECT_EQ(cg.peak_in_flight[r], m);
      }
    }
  // Interleaved (Megatron): rank r holds 2(pp-r-1) + (v-1)pp + 1 (micro-batch, stage) sets.
  const auto ci = pl::check_schedule(pl::interleaved_1f1b(4, 8, 2));
  EXPECT_EQ(ci.peak_in_flight, (std::vector<int>{11, 9, 7, 5}));
}

// ------------------------------------------------------------------------------------------------
// Bubble: simulation vs formula

TEST(PipelineSchedule, BubbleMatchesFormulaForGPipeAndOneFOneB) {
  for (const std::string name : {"gpipe", "1f1b"})
    for (int pp : {1, 2, 3, 4})
      for (int m : {1, 2, 4, 8, 16})
        for (double tb : {1.0, 2.0}) {
          SCOPED_TRACE(name + " pp=" + std::to_string(pp) + " m=" + std::to_string(m) +
                       " tb=" + std::to_string(tb));
          const PipeSchedule s = pl::make_schedule(name, pp, m);
          const auto t = pl::simulate_timeline(s, 1.0, tb, 0.0);
          ASSERT_TRUE(t.completed) << t.message;
          const double want = static_cast<double>(pp - 1) / (m + pp - 1);
          EXPECT_NEAR(t.bubble_fraction, want, 1e-12);
          EXPECT_NEAR(t.bubble_relative, static_cast<double>(pp - 1) / m, 1e-12);
          EXPECT_NEAR(t.makespan, (m + pp - 1) * (1.0 + tb), 1e-9);
          const auto f = pl::bubble_formula(s);
          EXPECT_NEAR(f.fraction, want, 1e-15);
          for (int r = 0; r < pp; ++r) {
            EXPECT_NEAR(t.busy[r], m * (1.0 + tb), 1e-9);
            EXPECT_NEAR(t.idle[r], (pp - 1) * (1.0 + tb), 1e-9);
          }
        }
}

TEST(PipelineSchedule, InterleavedBubbleIsOneVthOfOneFOneB) {
  for (int pp : {1, 2, 3, 4})
    for (int m : {1, 2, 4, 8, 16})
      for (double tb : {1.0, 2.0}) {
        if (m % pp) continue;
        const auto base = pl::simulate_timeline(pl::one_f_one_b(pp, m), 1.0, tb, 0.0);
        for (int v : {2, 3, 4})
          for (CommPlacement p : {CommPlacement::Eager, CommPlacement::Batched}) {
            SCOPED_TRACE("pp=" + std::to_string(pp) + " m=" + std::to_string(m) + " v=" + std::to_string(v) +
                         " tb=" + std::to_string(tb));
            const PipeSchedule s = pl::interleaved_1f1b(pp, m, v, p);
            const auto t = pl::simulate_timeline(s, 1.0, tb, 0.0);
            ASSERT_TRUE(t.completed) << t.message;
            // Megatron: bubble time / ideal time = (p-1)/(v*m), i.e. 1/v of 1F1B's (p-1)/m.
            EXPECT_NEAR(t.bubble_relative, (pp - 1.0) / (v * m), 1e-9);
            EXPECT_NEAR(t.bubble_relative, base.bubble_relative / v, 1e-9);
            EXPECT_NEAR(t.bubble_fraction, pl::bubble_formula(s).fraction, 1e-9);
            EXPECT_NEAR(pl::bubble_formula(s).relative, (pp - 1.0) / (v * m), 1e-15);
            if (pp > 1) {
              EXPECT_LT(t.bubble_fraction, base.bubble_fraction);
            }
          }
      }
}

TEST(PipelineSchedule, CommLatencyDelaysTheReceiverOnly) {
  // GPipe: the forward wave crosses pp-1 links and the backward wave pp-1 links back.
  const int pp = 4, m = 8;
  const double tc = 0.25;
  const auto t = pl::simulate_timeline(pl::gpipe(pp, m), 1.0, 2.0, tc);
  ASSERT_TRUE(t.completed);
  EXPECT_NEAR(t.makespan, (m + pp - 1) * 3.0 + 2 * (pp - 1) * tc, 1e-9);
  for (int r = 0; r < pp; ++r) EXPECT_NEAR(t.busy[r], m * 3.0, 1e-9);
  // Eager placement is never slower than batched under latency (it sends as soon as possible).
  const auto e = pl::simulate_timeline(pl::interleaved_1f1b(4, 8, 2, CommPlacement::Eager), 1.0, 2.0, tc);
  const auto b = pl::simulate_timeline(pl::interleaved_1f1b(4, 8, 2, CommPlacement::Batched), 1.0, 2.0, tc);
  EXPECT_LE(e.makespan, b.makespan + 1e-9);
}

TEST(PipelineSchedule, VirtualStageTakesItsShareOfTheRankTime) {
  const auto t = pl::simulate_timeline(pl::interleaved_1f1b(2, 4, 2), 1.0, 2.0, 0.0);
  ASSERT_TRUE(t.completed);
  for (const auto& ev : t.per_rank[0]) {
    if (ev.action.kind == PipeAction::Forward) {
      EXPECT_NEAR(ev.end - ev.start, 0.5, 1e-12);
    } else if (ev.action.kind == PipeAction::Backward) {
      EXPECT_NEAR(ev.end - ev.start, 1.0, 1e-12);
    }
  }
  // Each rank does m * (t_fwd + t_bwd) of work whatever v is.
  EXPECT_NEAR(t.busy[0], 4 * 3.0, 1e-12);
}

// ------------------------------------------------------------------------------------------------
// Broken schedules are refused with a clear message

TEST(PipelineScheduleBroken, SwappedSendCreatesADeadlockCycle) {
  // 1F1B pp=2 m=2, rank 0: F0.0 sA0.0 F1.0 sA1.0 rG0.1 B0.0 ... Move the send of micro-batch 0
  // after the receive of its gradient: rank 0 waits for a gradient that rank 1 can only
  // compute after receiving that activation.
  PipeSchedule s = pl::one_f_one_b(2, 2);
  auto& r0 = s.per_rank[0];
  const long send = find(r0, PipeAction::SendAct, 0, 0);
  const long recv = find(r0, PipeAction::RecvGrad, 0, 1);
  ASSERT_GE(send, 0);
  ASSERT_GT(recv, send);
  const PipeAction a = r0[send];
  r0.erase(r0.begin() + send);
  r0.insert(r0.begin() + recv, a);  // now right after the RecvGrad
  const auto c = pl::check_schedule(s);
  EXPECT_FALSE(c.ok);
  EXPECT_FALSE(c.deadlock_free);
  EXPECT_TRUE(contains(c.message, "deadlock")) << c.message;
  EXPECT_TRUE(contains(c.message, "cycle")) << c.message;
  EXPECT_TRUE(contains(c.message, "RecvGrad(mb 0, stage 1 <- rank 1)")) << c.message;
  EXPECT_TRUE(contains(c.message, "RecvAct(mb 0, stage 0 <- rank 0)")) << c.message;
  // The timeline stops at the deadlock and says so.
  const auto t = pl::simulate_timeline(s, 1, 1, 0);
  EXPECT_FALSE(t.completed);
  EXPECT_TRUE(contains(t.message, "deadlock"));
  EXPECT_TRUE(contains(pl::format_schedule(s), "the schedule stops here"));
}

TEST(PipelineScheduleBroken, MissingBackward) {
  PipeSchedule s = pl::one_f_one_b(4, 8);
  auto& r0 = s.per_rank[0];
  const long b = find(r0, PipeAction::Backward, 3, 0);
  ASSERT_GE(b, 0);
  r0.erase(r0.begin() + b);
  const auto c = pl::check_schedule(s);
  EXPECT_FALSE(c.ok);
  EXPECT_TRUE(contains(c.message, "missing Backward(mb 3, stage 0) on rank 0")) << c.message;
  // Nothing else is wrong, and it still runs (there is nothing to wait for).
  EXPECT_EQ(c.problems.size(), 1u);
  EXPECT_TRUE(c.deadlock_free);
}

TEST(PipelineScheduleBroken, RecvWithoutSend) {
  PipeSchedule s = pl::gpipe(3, 4);
  auto& r0 = s.per_rank[0];
  const long send = find(r0, PipeAction::SendAct, 1, 0);
  ASSERT_GE(send, 0);
  r0.erase(r0.begin() + send);
  const auto c = pl::check_schedule(s);
  EXPECT_FALSE(c.ok);
  EXPECT_TRUE(
      contains(c.message, "RecvAct(mb 1, stage 0 <- rank 0) on rank 1 has no matching SendAct on rank 0"))
      << c.message;
  EXPECT_FALSE(c.deadlock_free);
  EXPECT_TRUE(contains(c.deadlock_message, "rank 1 is stuck at")) << c.deadlock_message;
  EXPECT_TRUE(contains(c.deadlock_message, "rank 0 has no matching SendAct")) << c.deadlock_message;
}

TEST(PipelineScheduleBroken, SendWithoutRecv) {
  PipeSchedule s = pl::one_f_one_b(2, 3);
  auto& r0 = s.per_rank[0];
  const long recv = find(r0, PipeAction::RecvGrad, 2, 1);
  ASSERT_GE(recv, 0);
  r0.erase(r0.begin() + recv);
  const auto c = pl::check_schedule(s);
  EXPECT_FALSE(c.ok);
  EXPECT_TRUE(
      contains(c.message, "SendGrad(mb 2, stage 1 -> rank 0) on rank 1 has no matching RecvGrad on rank 0"))
      << c.message;
  // Rank 1's send is posted asynchronously, so nothing waits: it is an error, not a deadlock.
  EXPECT_TRUE(c.deadlock_free);
}

TEST(PipelineScheduleBroken, ComputeBeforeItsInputArrives) {
  // Rank 1 runs its forward of micro-batch 0 before receiving the activation.
  PipeSchedule s = pl::gpipe(2, 2);
  auto& r1 = s.per_rank[1];
  ASSERT_EQ(r1[0].kind, PipeAction::RecvAct);
  std::swap(r1[0], r1[1]);
  const auto c = pl::check_schedule(s);
  EXPECT_FALSE(c.ok);
  EXPECT_TRUE(contains(
      c.message, "RecvAct(mb 0, stage 0 <- rank 0) at #1 must come before Forward(mb 0, stage 1) at #0"))
      << c.message;
  // A backward before its own forward on a single rank.
  PipeSchedule one = pl::gpipe(1, 1);
  std::swap(one.per_rank[0][0], one.per_rank[0][1]);
  const auto c1 = pl::check_schedule(one);
  EXPECT_FALSE(c1.ok);
  EXPECT_TRUE(contains(c1.message, "backward needs its forward")) << c1.message;
  // Two stages on one rank: the local hand-off order is checked too.
  PipeSchedule il = pl::interleaved_1f1b(1, 1, 2);  // F0.0 F0.1 B0.1 B0.0
  std::swap(il.per_rank[0][0], il.per_rank[0][1]);
  const auto c2 = pl::check_schedule(il);
  EXPECT_FALSE(c2.ok);
  EXPECT_TRUE(contains(c2.message, "forward of the next stage uses its output")) << c2.message;
}

TEST(PipelineScheduleBroken, WrongRankDuplicateAndRanges) {
  {
    PipeSchedule s = pl::gpipe(2, 2);
    s.per_rank[0].push_back({PipeAction::Forward, 0, 1, -1});  // stage 1 belongs to rank 1
    const auto c = pl::check_schedule(s);
    EXPECT_FALSE(c.ok);
    EXPECT_TRUE(
        contains(c.message, "rank 0: Forward(mb 0, stage 1) is on the wrong rank: it belongs on rank 1"))
        << c.message;
    bool dup = false;
    for (const auto& p : c.problems) dup = dup || contains(p, "Forward(mb 0, stage 1) appears 2 times");
    EXPECT_TRUE(dup);
  }
  {
    PipeSchedule s = pl::gpipe(2, 2);
    s.per_rank[1].push_back({PipeAction::Forward, 5, 1, -1});
    const auto c = pl::check_schedule(s);
    EXPECT_FALSE(c.ok);
    EXPECT_TRUE(contains(c.message, "micro-batch out of range")) << c.message;
  }
  {
    PipeSchedule s = pl::gpipe(2, 2);
    s.per_rank.pop_back();
    const auto c = pl::check_schedule(s);
    EXPECT_FALSE(c.ok);
    EXPECT_TRUE(contains(c.message, "action lists for 1 ranks but pp = 2")) << c.message;
  }
  {
    PipeSchedule s = pl::gpipe(2, 2);
    const long k = find(s.per_rank[0], PipeAction::SendAct, 0, 0);
    s.per_rank[0][k].peer = 0;
    const auto c = pl::check_schedule(s);
    EXPECT_FALSE(c.ok);
    EXPECT_TRUE(contains(c.message, "names the wrong peer: expected rank 1")) << c.message;
  }
  {
    // A send between two stages on the same rank is not needed.
    PipeSchedule s = pl::interleaved_1f1b(1, 1, 2);
    s.per_rank[0].insert(s.per_rank[0].begin() + 1, {PipeAction::SendAct, 0, 0, 0});
    const auto c = pl::check_schedule(s);
    EXPECT_FALSE(c.ok);
    EXPECT_TRUE(contains(c.message, "is not needed: stages 0 and 1 are both on rank 0")) << c.message;
  }
}

TEST(PipelineScheduleBroken, RendezvousOnlyDeadlockIsReportedSeparately) {
  // GPipe pp=2 m=2 where rank 1 receives micro-batch 1 before micro-batch 0, with a compute in
  // between. Asynchronous sends: fine (rank 0 posts both sends and goes on). Rendezvous sends:
  // rank 0's send of mb 0 waits for rank 1's receive of mb 0, and rank 1 waits for mb 1 first.
  PipeSchedule s;
  s.name = "hand-made";
  s.pp = 2;
  s.microbatches = 2;
  s.per_rank = {
      {{PipeAction::Forward, 0, 0, -1},
       {PipeAction::SendAct, 0, 0, 1},
       {PipeAction::Forward, 1, 0, -1},
       {PipeAction::SendAct, 1, 0, 1},
       {PipeAction::RecvGrad, 0, 1, 1},
       {PipeAction::Backward, 0, 0, -1},
       {PipeAction::RecvGrad, 1, 1, 1},
       {PipeAction::Backward, 1, 0, -1}},
      {{PipeAction::RecvAct, 1, 0, 0},
       {PipeAction::Forward, 1, 1, -1},
       {PipeAction::RecvAct, 0, 0, 0},
       {PipeAction::Forward, 0, 1, -1},
       {PipeAction::Backward, 0, 1, -1},
       {PipeAction::SendGrad, 0, 1, 0},
       {PipeAction::Backward, 1, 1, -1},
       {PipeAction::SendGrad, 1, 1, 0}},
  };
  const auto c = pl::check_schedule(s);
  EXPECT_TRUE(c.ok) << c.message;
  EXPECT_FALSE(c.rendezvous_safe);
  EXPECT_TRUE(contains(c.rendezvous_message, "rendezvous")) << c.rendezvous_message;
  EXPECT_TRUE(contains(c.rendezvous_message, "cycle: rank 0 -> rank 1 -> rank 0")) << c.rendezvous_message;
}

// ------------------------------------------------------------------------------------------------
// Names and sizes

TEST(PipelineSchedule, MakeScheduleRefusesBadNamesAndSizes) {
  auto msg = [](auto f) {
    try {
      f();
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  EXPECT_TRUE(contains(msg([] { pl::make_schedule("zigzag", 2, 4); }), "unknown pipeline schedule 'zigzag'"));
  EXPECT_TRUE(contains(msg([] { pl::make_schedule("zigzag", 2, 4); }), "gpipe, 1f1b, interleaved_1f1b"));
  EXPECT_TRUE(contains(msg([] { pl::make_schedule("interleaved_1f1b", 4, 6, 2); }),
                       "micro-batches (6) to be a multiple of the pipeline size pp (4)"));
  EXPECT_TRUE(
      contains(msg([] { pl::make_schedule("interleaved_1f1b", 2, 4, 1); }), "at least 2 virtual stages"));
  EXPECT_TRUE(contains(msg([] { pl::make_schedule("1f1b", 2, 4, 2); }), "needs --schedule interleaved_1f1b"));
  EXPECT_TRUE(contains(msg([] { pl::make_schedule("gpipe", 0, 4); }), "pp must be >= 1"));
  EXPECT_TRUE(contains(msg([] { pl::make_schedule("1f1b", 2, 0); }), "micro-batches must be >= 1"));
  EXPECT_TRUE(contains(msg([] { pl::make_schedule("interleaved_1f1b", 2, 4, 0); }), "virtual stages"));
  EXPECT_TRUE(contains(msg([] { pl::make_schedule("gpipe", 4096, 4096); }), "larger than"));
  CommPlacement p;
  EXPECT_TRUE(pl::parse_placement("batched", &p));
  EXPECT_EQ(p, CommPlacement::Batched);
  EXPECT_FALSE(pl::parse_placement("lazy", &p));
}

// ------------------------------------------------------------------------------------------------
// Printing

TEST(PipelineSchedule, FormatIsTheTimeSlotTable) {
  const std::string want =
      "slot | rank 0 | rank 1\n"
      "-----+--------+-------\n"
      "   0 | F0.0   | .\n"
      "   1 | F1.0   | F0.1\n"
      "   2 | .      | B0.1\n"
      "   3 | B0.0   | F1.1\n"
      "   4 | .      | B1.1\n"
      "   5 | B1.0   | .\n";
  EXPECT_EQ(pl::format_schedule(pl::one_f_one_b(2, 2)), want);
  const std::string comm = pl::format_schedule(pl::one_f_one_b(2, 2), true);
  EXPECT_TRUE(contains(comm, "     : sA0.0>1 : rA0.0<0\n")) << comm;
  EXPECT_TRUE(contains(comm, "sG0.1>0 rA1.0<0")) << comm;
  EXPECT_EQ(pl::format_actions(pl::gpipe(2, 1)),
            "rank 0: F0.0 sA0.0>1 rG0.1<1 B0.0\n"
            "rank 1: rA0.0<0 F0.1 B0.1 sG0.1>0\n");
  EXPECT_EQ(pl::short_string({PipeAction::RecvGrad, 3, 2, 2}), "rG3.2<2");
  EXPECT_EQ(pl::describe({PipeAction::SendAct, 3, 1, 2}), "SendAct(mb 3, stage 1 -> rank 2)");
}

TEST(PipelineSchedule, GPipeTableRowsAreTheSimulatedSlots) {
  // pp=4 m=8 GPipe with unit slots: 2 * (m + pp - 1) rows, rank 0 idle in the middle.
  const std::string t = pl::format_schedule(pl::gpipe(4, 8));
  EXPECT_TRUE(contains(t, "\n   0 | F0.0   | .      | .      | .\n")) << t;
  EXPECT_TRUE(
      contains(t, "\n  10 | .      | .      | .      | F7.3\n  11 | .      | .      | .      | B0.3\n"))
      << t;
  EXPECT_TRUE(contains(t, "\n  21 | B7.0   | .      | .      | .\n")) << t;
  EXPECT_FALSE(contains(t, "\n  22 |")) << t;
}
