// Zero-bubble pipeline schedules (zb1p, zbv): the split backward (input gradients in B, weight
// gradients in a later W) trains exactly like the unsplit one, alone and composed with data and
// tensor parallelism, against 1F1B and against single-process training on the same global batch.
//
// Every comparison's per-step losses are printed side by side and written to a file (harness.h).
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <utility>

#include "harness.h"
#include "parallel/layout/pipeline_schedule.h"

namespace mt {
namespace {

constexpr double kLossTol = 1e-5, kWeightTol = 2e-5;  // the pipeline parity tests' tolerances

using ZeroBubble = ParityFixture;

// Bit for bit: every step's loss and every final weight.
void expect_identical(const RunResult& a, const RunResult& b, const std::string& what) {
  loss_table(what, a, b);
  ASSERT_EQ(a.losses.size(), 8u) << what;
  EXPECT_EQ(a.losses, b.losses) << what;
  ASSERT_EQ(a.weights.size(), b.weights.size()) << what;
  ASSERT_FALSE(a.weights.empty()) << what;
  size_t differ = 0;
  for (size_t i = 0; i < a.weights.size(); ++i) differ += std::memcmp(&a.weights[i], &b.weights[i], sizeof(float)) != 0;
  EXPECT_EQ(differ, 0u) << what << ": weights that differ in some bit";
}

// W runs the same GEMMs as the unsplit backward, later, and per stage in micro-batch order: the
// same gradients bit for bit, so the same losses and weights as 1F1B on the same stages (GPT-2:
// the tied embedding's replica gradient too; Llama: untied, gated MLP).
TEST_F(ZeroBubble, SplitBackwardIsBitIdenticalToOneFOneB) {
  expect_identical(train(2, 2, 4, "1f1b", "--parallel.pp 2"),
                   train(2, 2, 4, "zb1p", "--parallel.pp 2 --parallel.pp_schedule zb1p"), "gpt2 pp=2 zb1p vs 1f1b");
  const std::string l = "--model.preset llama-tiny --parallel.pp 2 ";
  expect_identical(train(2, 2, 4, "l1f1b", l), train(2, 2, 4, "lzb1p", l + "--parallel.pp_schedule zb1p"),
                   "llama pp=2 zb1p vs 1f1b");
  // MoE: routed experts, shared expert and router weight gradients deferred too.
  const std::string e = l + "--model.moe_experts 4 --model.moe_top_k 2 --model.moe_shared_experts 1 ";
  expect_identical(train(2, 2, 4, "e1f1b", e), train(2, 2, 4, "ezb1p", e + "--parallel.pp_schedule zb1p"),
                   "llama MoE pp=2 zb1p vs 1f1b");
}

// (zb1p at pp = 2 is bit-identical to 1F1B above, which the pipeline tests compare with one rank.)
TEST_F(ZeroBubble, Pp2AndPp4EqualOneRank) {
  const std::string m = "--model.n_layer 6 ";  // 8 units: zbv at pp=4 has 8 stages
  auto ref = train(1, 2, 4, "single", m);
  expect_close(ref, train(2, 2, 4, "zv2", m + "--parallel.pp 2 --parallel.pp_schedule zbv"), kLossTol, kWeightTol,
               "pp=2 zbv");
  expect_close(ref, train(4, 2, 4, "zb4", m + "--parallel.pp 4 --parallel.pp_schedule zb1p"), kLossTol, kWeightTol,
               "pp=4 zb1p");
  expect_close(ref, train(4, 2, 4, "zv4", m + "--parallel.pp 4 --parallel.pp_schedule zbv"), kLossTol, kWeightTol,
               "pp=4 zbv");
}

// pp=2 x 2 data-parallel ranks with each strategy (the two schedules take turns), and x tp=2: the
// hooks fire when a unit's W completes (the last micro-batch's W reduces).
TEST_F(ZeroBubble, ComposedWithEveryDataParallelStrategyAndTp) {
  auto ref = train(1, 2, 4, "single");
  for (auto [sched, strategy] : {std::pair<const char*, const char*>{"zb1p", "NO_SHARD"}, {"zbv", "ZERO1"},
                                 {"zb1p", "SHARD_GRAD_OP"}, {"zbv", "FULL_SHARD"}}) {
    const std::string tag = std::string(sched) + "_" + strategy;
    expect_close(ref,
                 train(4, 1, 4, tag,
                       std::string("--parallel.pp 2 --parallel.pp_schedule ") + sched + " --parallel.strategy " + strategy),
                 kLossTol, kWeightTol, std::string("pp=2 ") + sched + " x " + strategy + " 2");
  }
  expect_close(ref, train(4, 2, 4, "tp", "--parallel.pp 2 --parallel.pp_schedule zb1p --parallel.tp 2"), kLossTol,
               kWeightTol, "pp=2 zb1p x tp=2");
  expect_close(ref,
               train(4, 2, 4, "tpsp",
                     "--parallel.pp 2 --parallel.pp_schedule zbv --parallel.tp 2 --parallel.sequence_parallel true"),
               kLossTol, kWeightTol, "pp=2 zbv x tp=2 + sequence parallel");
}

// The executor holds a micro-batch's activation slot until its W: its peak is the checker's
// count; the copies the weight gradients read are activations too (more than 1F1B holds).
TEST_F(ZeroBubble, SlotsFollowTheScheduleAndHeldCopiesAreActivations) {
  const std::string m = "--model.n_layer 4 --parallel.pp 2 ";
  auto one = train(2, 2, 8, "1f1b", m);
  auto zb = train(2, 2, 8, "zb1p", m + "--parallel.pp_schedule zb1p");
  ASSERT_FALSE(one.final.is_null());
  ASSERT_FALSE(zb.final.is_null());
  const auto cz = parallel::check_schedule(parallel::make_schedule("zb1p", 2, 8));
  EXPECT_EQ(zb.final["pp_peak_activation_slots"].get<int>(), cz.peak_in_flight[0]);
  const double a1 = one.final["mem_peak_by_category_per_rank"][1]["activations"].get<double>();
  const double az = zb.final["mem_peak_by_category_per_rank"][1]["activations"].get<double>();
  EXPECT_GT(az, a1) << "the last stage holds its micro-batches' copies until their W";
}

}  // namespace
}  // namespace mt
