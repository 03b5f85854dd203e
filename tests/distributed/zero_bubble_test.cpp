// Zero-bubble pipeline schedules (zb1p, zbv): the split backward (input gradients in B, weight
// gradients in a later W) trains exactly like the unsplit one, alone and composed with data and
// tensor parallelism, against 1F1B and against single-process training on the same global batch.
//
// Every comparison's per-step losses are printed side by side and written to a file (harness.h).
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>

#include "harness.h"
#include "parallel/layout/pipeline_schedule.h"

namespace mt {
namespace {

constexpr double kLossTol = 1e-5, kWeightTol = 2e-5;  // the pipeline parity tests' tolerances
constexpr double kBf16LossTol = 2e-2, kBf16WeightTol = 1e-2;
constexpr double kMoeLossTol = 2e-5, kMoeWeightTol = 5e-5;  // the MoE parity tests' (router top-k sums)

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

// parallel.pp_costs = auto: after the second step ZB-V's order is rebuilt for the costs measured
// (here given by MESHTRAIN_TEST_PP_COSTS, so that the rebuild is certain: ZB-V built for
// F = B = 2W idles 4.8% instead of the unit order's 14.9% with those costs), within the unit order's
// activations; training is unchanged. Without the override the measured costs are used.
TEST_F(ZeroBubble, RebuiltForMeasuredCostsTrainsTheSame) {
  const std::string m = "--model.n_layer 6 --parallel.pp 2 --parallel.pp_schedule zbv ";
  auto ref = train(1, 2, 4, "single", "--model.n_layer 6 ");
  const RunResult unit = train(2, 2, 4, "zbv", m);
  ::setenv("MESHTRAIN_TEST_PP_COSTS", "1,1,0.5", 1);
  const RunResult given = train(2, 2, 4, "zbvgiven", m + "--parallel.pp_costs auto");
  ::unsetenv("MESHTRAIN_TEST_PP_COSTS");
  const RunResult measured = train(2, 2, 4, "zbvauto", m + "--parallel.pp_costs auto");
  expect_close(ref, given, kLossTol, kWeightTol, "pp=2 zbv rebuilt for F,B,W = 1,1,0.5");
  expect_close(ref, measured, kLossTol, kWeightTol, "pp=2 zbv rebuilt for the measured costs");
  const auto& gc = given.final.at("pp_costs");
  EXPECT_EQ(gc.at("B").get<double>(), 1.0);
  EXPECT_EQ(gc.at("W").get<double>(), 0.5);  // the order in use is the rebuilt one
  EXPECT_EQ(unit.final.at("pp_costs").at("W").get<double>(), 1.0);
  EXPECT_LE(given.final.at("pp_peak_activation_slots").get<int>(), unit.final.at("pp_peak_activation_slots").get<int>());
  EXPECT_EQ(measured.final.at("pp_costs").at("F").get<double>(), 1.0);
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

// reduce_every_microbatch (the default) under a split backward: each micro-batch's W reduce-scatters
// its unit's gradient (B's of later micro-batches may already point into the buffer: it is zeroed
// in place then, not freed). Same training as one rank, and the shard group moves a gradient
// reduction per micro-batch instead of one per step.
TEST_F(ZeroBubble, ReduceEveryMicrobatchUnderASplitBackward) {
  auto ref = train(1, 1, 8, "single");
  const std::string z = "--parallel.pp 2 --parallel.strategy SHARD_GRAD_OP --parallel.reduce_every_microbatch ";
  auto every = train(4, 1, 4, "zb_every", z + "true --parallel.pp_schedule zb1p");
  auto last = train(4, 1, 4, "zb_last", z + "false --parallel.pp_schedule zb1p");
  expect_close(ref, every, kLossTol, kWeightTol, "pp=2 zb1p x SHARD_GRAD_OP 2, reduce every micro-batch");
  expect_close(ref, last, kLossTol, kWeightTol, "pp=2 zb1p x SHARD_GRAD_OP 2, reduce at the last micro-batch");
  expect_close(ref,
               train(4, 1, 4, "zbv_every",
                     "--parallel.pp 2 --parallel.strategy FULL_SHARD --parallel.reduce_every_microbatch true "
                     "--parallel.pp_schedule zbv"),
               kLossTol, kWeightTol, "pp=2 zbv x FULL_SHARD 2, reduce every micro-batch");
  ASSERT_FALSE(every.final.is_null());
  ASSERT_FALSE(last.final.is_null());
  const auto& be = every.final["comm_bytes_by_group"];
  const auto& bl = last.final["comm_bytes_by_group"];
  ASSERT_TRUE(be.contains("dp")) << be.dump();
  // 4 micro-batches: each unit's reduce-scatter 4 times instead of once, beside the same parameter
  // all-gathers (as many bytes as one round of reductions): 5 rounds against 2.
  EXPECT_GT(be["dp"].get<double>(), 2.2 * bl["dp"].get<double>()) << be.dump() << " vs " << bl.dump();
}

// bf16: W's GEMMs read the layer inputs as the forward's matmul used them (bf16) and the fp32 output
// gradients, as the unsplit backward does: zb1p is bit-identical to bf16 1F1B; zbv (other stages)
// matches one fp32 process within the bf16 tolerances, and so does zb1p with selective recompute
// (the recomputed inputs are copied for W).
TEST_F(ZeroBubble, Bf16SplitBackward) {
  const std::string b = "--train.dtype bf16 --parallel.pp 2 ";
  expect_identical(train(2, 2, 4, "bf1f1b", b), train(2, 2, 4, "bfzb1p", b + "--parallel.pp_schedule zb1p"),
                   "bf16 pp=2 zb1p vs 1f1b");
  auto ref = train(1, 2, 4, "single");
  expect_close(ref, train(2, 2, 4, "bfzbv", b + "--parallel.pp_schedule zbv"), kBf16LossTol, kBf16WeightTol,
               "bf16 pp=2 zbv vs fp32 single");
  expect_close(ref,
               train(2, 2, 4, "bfzbsel",
                     b + "--parallel.pp_schedule zb1p --train.activation_checkpointing selective"),
               kBf16LossTol, kBf16WeightTol, "bf16 pp=2 zb1p + selective recompute vs fp32 single");
}

// Context parallelism: every pipeline stage runs on cp = 2 ranks, each with half of every
// sequence; B's attention backward exchanges blocks with the cp peer, W runs on the rank's rows.
TEST_F(ZeroBubble, ComposedWithContextParallel) {
  auto ref = train(1, 4, 2, "single");
  expect_close(ref, train(4, 4, 2, "cp2zb1p", "--parallel.cp 2 --parallel.pp 2 --parallel.pp_schedule zb1p"),
               kLossTol, kWeightTol, "gpt2 cp=2 x pp=2 zb1p");
  expect_close(ref, train(4, 4, 2, "cp2zbv", "--parallel.cp 2 --parallel.pp 2 --parallel.pp_schedule zbv"),
               kLossTol, kWeightTol, "gpt2 cp=2 x pp=2 zbv");
}

// Expert parallelism: the routed experts' weight gradients wait for W on the ep rank that holds the
// expert (the token exchange itself belongs to B).
TEST_F(ZeroBubble, ComposedWithExpertParallel) {
  const std::string moe =
      "--model.preset llama-tiny --model.moe_experts 4 --model.moe_top_k 2 --model.moe_shared_experts 1 "
      "--model.moe_aux_loss_coef 0.02 --model.moe_z_loss_coef 0.001 --parallel.ep 2 --parallel.pp 2 ";
  auto ref = train(1, 2, 4, "single",
                   "--model.preset llama-tiny --model.moe_experts 4 --model.moe_top_k 2 --model.moe_shared_experts 1 "
                   "--model.moe_aux_loss_coef 0.02 --model.moe_z_loss_coef 0.001");
  expect_close(ref, train(4, 2, 2, "ep2zb1p", moe + "--parallel.pp_schedule zb1p"), kMoeLossTol, kMoeWeightTol,
               "llama MoE ep=2 x pp=2 zb1p");
  expect_close(ref, train(4, 2, 2, "ep2zbv", moe + "--parallel.pp_schedule zbv"), kMoeLossTol, kMoeWeightTol,
               "llama MoE ep=2 x pp=2 zbv");
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
