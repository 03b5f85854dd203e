// Zero-bubble schedules (zb1p, zbv): split backward (B, then W), checked by the checker, and their
// accounting - bubble and activation sets in flight - against 1F1B and interleaved 1F1B.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "parallel/layout/pipeline_schedule.h"
#include "parallel/layout/pipeline_stages.h"

using mt::parallel::PipeAction;
using mt::parallel::PipeSchedule;
namespace pl = mt::parallel;

namespace {
bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }
long find(const std::vector<PipeAction>& l, PipeAction::Kind k, int mb, int stage) {
  for (size_t i = 0; i < l.size(); ++i)
    if (l[i].kind == k && l[i].microbatch == mb && l[i].stage == stage) return static_cast<long>(i);
  return -1;
}
// Largest activation held on any rank, in micro-batches' worth (a set is 1/v of a rank's layers).
double peak_mb(const PipeSchedule& s) {
  const auto c = pl::check_schedule(s);
  return static_cast<double>(*std::max_element(c.peak_in_flight.begin(), c.peak_in_flight.end())) / s.virtual_stages;
}
}  // namespace

TEST(ZeroBubble, EverySizePassesTheCheckerWithWeightAfterItsBackward) {
  for (const char* name : {"zb1p", "zbv"})
    for (int pp : {1, 2, 3, 4, 8})
      for (int m : {1, 2, 3, 4, 8, 16}) {
        SCOPED_TRACE(std::string(name) + " pp=" + std::to_string(pp) + " m=" + std::to_string(m));
        const PipeSchedule s = pl::make_schedule(name, pp, m);
        EXPECT_TRUE(s.split_backward);
        EXPECT_EQ(s.virtual_stages, std::string(name) == "zbv" ? 2 : 1);
        const auto c = pl::check_schedule(s);
        ASSERT_TRUE(c.ok) << c.message;
        EXPECT_EQ(c.compute_actions, 3 * m * s.num_stages());
        for (int r = 0; r < pp; ++r)
          for (int st = 0; st < s.num_stages(); ++st) {
            if (s.stage_rank(st) != r) continue;
            for (int mb = 0; mb < m; ++mb) {
              const long b = find(s.per_rank[r], PipeAction::Backward, mb, st);
              const long w = find(s.per_rank[r], PipeAction::Weight, mb, st);
              ASSERT_GE(b, 0);
              ASSERT_GT(w, b);
              // per stage the weight gradients run in micro-batch order (accumulation order)
              if (mb > 0) {
                EXPECT_GT(w, find(s.per_rank[r], PipeAction::Weight, mb - 1, st));
              }
            }
          }
      }
}

TEST(ZeroBubble, VShapePlacesStageRAndTwoPMinusOneMinusROnRankR) {
  const PipeSchedule s = pl::make_schedule("zbv", 4, 8);
  ASSERT_TRUE(s.vshape);
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(s.stage_rank(r), r);
    EXPECT_EQ(s.stage_rank(7 - r), r);
  }
  // the turn of the V (stage 3 -> 4 on rank 3) and the loss (stage 7 on rank 0) need no message
  for (const auto& l : s.per_rank)
    for (const PipeAction& a : l) {
      EXPECT_FALSE(a.kind == PipeAction::SendAct && a.stage == 3);
      EXPECT_FALSE(a.kind == PipeAction::SendGrad && a.stage == 4);
    }
  const pl::StagePartition part{{{0, 1}, {2, 2}, {3, 3}, {4, 4}, {5, 5}, {6, 6}, {7, 7}, {8, 9}}};
  const std::vector<char> own0 = pl::stage_units_of_rank(part, 4, 0, 10, true);
  EXPECT_EQ(own0, (std::vector<char>{1, 1, 0, 0, 0, 0, 0, 0, 1, 1}));
}

// The goal in the schedules' own accounting (T_F = T_B = T_W, free messages): at pp = 4 and 8 with
// m = 2 pp, ZB-H1's bubble is at most half of 1F1B's and ZB-V's at most a quarter; the activation
// memory a rank must provide (the largest over the ranks, in micro-batches' worth) is no more than
// 1F1B's for ZB-H1 and no more than interleaved 1F1B's (v = 2) for ZB-V.
TEST(ZeroBubble, BubbleAndActivationGoalsAtPp4And8) {
  for (int pp : {4, 8}) {
    const int m = 2 * pp;
    SCOPED_TRACE("pp=" + std::to_string(pp));
    const PipeSchedule f1b = pl::make_schedule("1f1b", pp, m);
    const PipeSchedule il = pl::make_schedule("interleaved_1f1b", pp, m, 2);
    const PipeSchedule h1 = pl::make_schedule("zb1p", pp, m);
    const PipeSchedule zv = pl::make_schedule("zbv", pp, m);
    const double b1 = pl::simulate_timeline(f1b, 1, 2, 0).bubble_fraction;
    const double bh = pl::simulate_timeline(h1, 1, 2, 0).bubble_fraction;
    const double bv = pl::simulate_timeline(zv, 1, 2, 0).bubble_fraction;
    std::printf("pp=%d m=%d bubble: 1f1b %.4f zb1p %.4f (%.3fx) zbv %.4f (%.3fx); peak mb: 1f1b %.1f interleaved %.1f "
                "zb1p %.1f zbv %.1f\n",
                pp, m, b1, bh, bh / b1, bv, bv / b1, peak_mb(f1b), peak_mb(il), peak_mb(h1), peak_mb(zv));
    EXPECT_GT(b1, 0.0);
    EXPECT_LE(bh, 0.5 * b1);
    EXPECT_LE(bv, 0.25 * b1);
    EXPECT_LE(peak_mb(h1), peak_mb(f1b));
    EXPECT_LE(peak_mb(zv), peak_mb(il));
    // ZB-H1's bubble is the closed form (p-1)/(3m+p-1)
    EXPECT_NEAR(bh, pl::bubble_formula(h1).fraction, 1e-12);
  }
}

TEST(ZeroBubbleBroken, WeightBeforeItsBackwardOrMissingIsRefused) {
  PipeSchedule s = pl::make_schedule("zb1p", 2, 4);
  auto& l = s.per_rank[1];
  const long b = find(l, PipeAction::Backward, 0, 1), w = find(l, PipeAction::Weight, 0, 1);
  ASSERT_GE(b, 0);
  const PipeAction wa = l[static_cast<size_t>(w)];
  l.erase(l.begin() + w);
  l.insert(l.begin() + b, wa);  // the weight gradient just before its backward
  auto c = pl::check_schedule(s);
  EXPECT_FALSE(c.ok);
  EXPECT_TRUE(contains(c.message, "Weight(mb 0, stage 1)")) << c.message;
  EXPECT_TRUE(contains(c.message, "the weight gradient needs its backward's output gradient")) << c.message;

  s = pl::make_schedule("zb1p", 2, 4);
  auto& l0 = s.per_rank[0];
  l0.erase(l0.begin() + find(l0, PipeAction::Weight, 2, 0));
  c = pl::check_schedule(s);
  EXPECT_FALSE(c.ok);
  EXPECT_TRUE(contains(c.message, "missing Weight(mb 2, stage 0) on rank 0")) << c.message;

  PipeSchedule u = pl::make_schedule("1f1b", 2, 4);
  u.per_rank[0].push_back({PipeAction::Weight, 0, 0, -1});
  c = pl::check_schedule(u);
  EXPECT_FALSE(c.ok);
  EXPECT_TRUE(contains(c.message, "without a split backward")) << c.message;
}

TEST(ZeroBubble, TableShowsBAndWInTheirOwnSlots) {
  const std::string t = pl::format_schedule(pl::make_schedule("zb1p", 2, 2));
  EXPECT_TRUE(contains(t, "W0.0")) << t;
  EXPECT_TRUE(contains(t, "B1.1")) << t;
  EXPECT_TRUE(contains(pl::format_actions(pl::make_schedule("zbv", 2, 2)), "W1.3")) ;
}

// Built for measured costs (B longer than W, as a transformer's input gradient, which holds the
// attention backward, is): every size still passes the checker with W after B in micro-batch order
// and within its memory limit; the event-driven list scheduler with unit costs gives the unit-slot
// ZB-V; and simulated with those costs, each schedule built for them idles no more than the one
// built for T_F = T_B = T_W (zb1p: the fixed ZB-H1 order) - strictly less somewhere.
TEST(ZeroBubble, SchedulesBuiltForMeasuredCosts) {
  const pl::StageCosts unit{}, measured{1.0, 1.3, 0.7};
  const auto bubble = [](const PipeSchedule& s, const pl::StageCosts& c) {
    const double v = s.virtual_stages;
    return pl::simulate_timeline(s, v * c.f, v * (c.b + c.w), 0, c.w / (c.b + c.w)).bubble_fraction;
  };
  EXPECT_EQ(pl::format_actions(pl::make_schedule("zbv", 4, 8, 2, pl::CommPlacement::Eager, unit)),
            pl::format_actions(pl::make_schedule("zbv", 4, 8)));
  int better = 0;
  for (const char* name : {"zb1p", "zbv"})
    for (int pp : {2, 3, 4})
      for (int m : {1, 2, 4, 8, 16}) {
        SCOPED_TRACE(std::string(name) + " pp=" + std::to_string(pp) + " m=" + std::to_string(m));
        const PipeSchedule s = pl::make_schedule(name, pp, m, 1, pl::CommPlacement::Eager, measured);
        const auto c = pl::check_schedule(s);
        ASSERT_TRUE(c.ok) << c.message;
        EXPECT_TRUE(s.split_backward);
        for (int r = 0; r < pp; ++r) {
          EXPECT_LE(c.peak_in_flight[r], pp * s.virtual_stages);  // 1F1B's rank-0 peak, in micro-batches' worth
          for (int st = 0; st < s.num_stages(); ++st)
            for (int mb = 1; mb < m && s.stage_rank(st) == r; ++mb)
              EXPECT_GT(find(s.per_rank[r], PipeAction::Weight, mb, st), find(s.per_rank[r], PipeAction::Weight, mb - 1, st));
        }
        const double built = bubble(s, measured), fixed = bubble(pl::make_schedule(name, pp, m), measured);
        std::printf("%s pp=%d m=%d, costs 1/1.3/0.7: simulated bubble %.4f built for them, %.4f for unit costs\n", name,
                    pp, m, built, fixed);
        EXPECT_LE(built, fixed + 1e-9);
        better += built < fixed - 1e-9;
      }
  EXPECT_GT(better, 0);
  EXPECT_THROW(pl::make_schedule("zbv", 2, 4, 2, pl::CommPlacement::Eager, {1, 0, 1}), std::invalid_argument);
}
