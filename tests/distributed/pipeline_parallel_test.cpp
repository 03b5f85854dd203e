// Pipeline parallelism (GPipe, 1F1B, interleaved 1F1B) alone and composed with data and tensor
// parallelism, against single-process training on the same global batch (the single run uses
// gradient accumulation over the same micro-batches); stage memory; checkpoints across layouts.
//
// Every comparison's per-step losses are printed side by side and written to a file (harness.h).
#include <gtest/gtest.h>

#include <string>

#include "harness.h"
#include "parallel/layout/pipeline_schedule.h"

namespace mt {
namespace {

// fp32: each stage accumulates its parameters' gradients over the micro-batches in the same order
// as single-process accumulation, so the arithmetic is the same except (a) the tied embedding's
// gradient (head and embedding contributions are summed in another order), (b) the loss and
// gradient norm travel through an fp32 sum over the pipeline ranks, and (c) composed data/tensor
// parallel reductions: rounding-level differences, the tolerance of the other parity tests.
constexpr double kLossTol = 1e-5, kWeightTol = 2e-5;
constexpr double kBf16LossTol = 2e-2, kBf16WeightTol = 1e-2;

using PipelineParallel = ParityFixture;

void check(const std::string& what, const RunResult& ref, const RunResult& run, double lt = kLossTol,
           double wt = kWeightTol) {
  expect_close(ref, run, lt, wt, what);
}

// The idle time in the step's common window (pipeline_window: its computation is checked in
// PipelineWindow.*): present, and within the window. Under GPipe and 1F1B a pipeline always idles.
void check_window_idle(const std::string& what, const RunResult& run) {
  SCOPED_TRACE(what);
  const auto& f = run.final;
  const double idle = f.at("pp_idle_ms").get<double>(), window = f.at("pp_window_ms").get<double>();
  EXPECT_GT(idle, 0.0);
  EXPECT_LT(idle, window);
  EXPECT_GT(f.at("pp_idle_ms_median").get<double>(), 0.0);
}

// Single process: micro-batch 2, 4 micro-batches per step (the pipeline runs are 4 micro-batches).
TEST_F(PipelineParallel, EverySchedulePp2) {
  auto ref = train(1, 2, 4, "single");
  const RunResult f1b = train(2, 2, 4, "1f1b", "--parallel.pp 2"), gp =
      train(2, 2, 4, "gpipe", "--parallel.pp 2 --parallel.pp_schedule gpipe");
  check("pp=2 1f1b", ref, f1b);
  check("pp=2 gpipe", ref, gp);
  check_window_idle("pp=2 1f1b", f1b);
  check_window_idle("pp=2 gpipe", gp);
  check("pp=2 interleaved v=2", ref,
        train(2, 2, 4, "inter", "--parallel.pp 2 --parallel.pp_schedule interleaved_1f1b --parallel.pp_virtual_stages 2"));
}

TEST_F(PipelineParallel, InterleavedPp4) {
  const std::string m = "--model.n_layer 6 ";  // 8 units: one per virtual stage
  check("pp=4 interleaved v=2 (6 layers)", train(1, 2, 4, "single", m),
        train(4, 2, 4, "pp4i", m + "--parallel.pp 4 --parallel.pp_schedule interleaved_1f1b --parallel.pp_virtual_stages 2"));
}

TEST_F(PipelineParallel, ComposedOn4Ranks) {
  auto ref = train(1, 2, 4, "single");
  // Two data-parallel replicas of a 2-stage pipeline: micro-batch 1 per rank keeps the global batch.
  check("pp=2 x DDP 2", ref, train(4, 1, 4, "ppddp", "--parallel.pp 2"));
  check("pp=2 x ZERO1 2", ref, train(4, 1, 4, "ppz1", "--parallel.pp 2 --parallel.strategy ZERO1"));
  check("pp=2 x SHARD_GRAD_OP 2, full recompute", ref,
        train(4, 1, 4, "ppz2", "--parallel.pp 2 --parallel.strategy SHARD_GRAD_OP --train.activation_checkpointing full"));
  check("pp=2 x tp=2", ref, train(4, 2, 4, "pptp", "--parallel.pp 2 --parallel.tp 2"));
  check("pp=2 x tp=2 + sequence parallel, gpipe", ref,
        train(4, 2, 4, "pptpsp",
              "--parallel.pp 2 --parallel.tp 2 --parallel.sequence_parallel true --parallel.pp_schedule gpipe"));
}

TEST_F(PipelineParallel, LlamaWithFullShardAndHybrid) {
  const std::string m = "--model.preset llama-tiny ";
  auto ref = train(1, 2, 4, "single", m);
  check("llama pp=2 x FULL_SHARD 2", ref, train(4, 1, 4, "fs", m + "--parallel.pp 2 --parallel.strategy FULL_SHARD"));
  check("llama pp=2 x HYBRID_SHARD (2 replicas)", ref,
        train(4, 1, 4, "hy",
              m + "--parallel.pp 2 --parallel.strategy HYBRID_SHARD --parallel.dp_replicate 2 --parallel.dp_shard 1"));
}

// 3-D: pp=2 x dp=2 x tp=2 on 8 processes (oversubscribed on a small machine).
// GPT-2's tied embedding under a pipeline with sharded parameters: the last stage's replica is
// refreshed from the first stage's embedding unit, gathered for it.
TEST_F(PipelineParallel, TiedEmbeddingWithFullShardAndHybrid) {
  auto ref = train(1, 2, 4, "single");
  check("gpt2 pp=2 x FULL_SHARD 2", ref, train(4, 1, 4, "fs", "--parallel.pp 2 --parallel.strategy FULL_SHARD"));
  check("gpt2 pp=2 x HYBRID_SHARD (2 replicas), bf16 vs fp32 single", ref,
        train(4, 1, 4, "hybf",
              "--parallel.pp 2 --parallel.strategy HYBRID_SHARD --parallel.dp_replicate 2 --parallel.dp_shard 1 "
              "--train.dtype bf16"),
        kBf16LossTol, kBf16WeightTol);
}

TEST_F(PipelineParallel, ThreeDimensionalOn8Ranks) {
  check("pp=2 x SHARD_GRAD_OP 2 x tp=2", train(1, 2, 4, "single"),
        train(8, 1, 4, "3d", "--parallel.pp 2 --parallel.tp 2 --parallel.strategy SHARD_GRAD_OP"));
}

TEST_F(PipelineParallel, Bf16AndSelectiveRecompute) {
  check("bf16 pp=2 1f1b, selective recompute vs fp32 single", train(1, 2, 4, "single"),
        train(2, 2, 4, "bf", "--parallel.pp 2 --train.dtype bf16 --train.activation_checkpointing selective"),
        kBf16LossTol, kBf16WeightTol);
}

// Per-rank memory: each stage holds only its units' parameters (plus, on the last stage of a
// tied model, the embedding replica), and activations follow the schedule: GPipe keeps all m
// micro-batches on the first stage, 1F1B at most p.
TEST_F(PipelineParallel, StageMemoryAndActivationSlots) {
  const std::string m = "--model.n_layer 4 --parallel.pp 2 ";
  auto one = train(2, 2, 8, "1f1b", m);
  auto gp = train(2, 2, 8, "gpipe", m + "--parallel.pp_schedule gpipe");
  auto full = train(1, 2, 8, "single", "--model.n_layer 4");
  ASSERT_FALSE(one.final.is_null());
  ASSERT_FALSE(gp.final.is_null());
  ASSERT_FALSE(full.final.is_null());
  // The schedule checker's peak in-flight count for rank 0 is what the executor measured.
  auto c1 = parallel::check_schedule(parallel::make_schedule("1f1b", 2, 8));
  auto cg = parallel::check_schedule(parallel::make_schedule("gpipe", 2, 8));
  EXPECT_EQ(one.final["pp_peak_activation_slots"].get<int>(), c1.peak_in_flight[0]);
  EXPECT_EQ(gp.final["pp_peak_activation_slots"].get<int>(), cg.peak_in_flight[0]);
  EXPECT_EQ(c1.peak_in_flight[0], 2);
  EXPECT_EQ(cg.peak_in_flight[0], 8);
  const auto& r1 = one.final["mem_peak_by_category_per_rank"];
  const auto& rg = gp.final["mem_peak_by_category_per_rank"];
  const double a1 = r1[0]["activations"].get<double>(), ag = rg[0]["activations"].get<double>();
  // Rank 0 (embedding + 2 blocks) keeps 2 micro-batches under 1F1B, 8 under GPipe.
  EXPECT_NEAR(ag / a1, 4.0, 0.05) << "gpipe " << ag << " vs 1f1b " << a1;
  // fp32 params: 4 bytes per element of each stage's flat buffer; the stages add up to the whole
  // model plus the last stage's replica of the tied embedding (vocab x width).
  const double p0 = one.final["mem_resident_by_category_per_rank"][0]["params"].get<double>();
  const double p1 = one.final["mem_resident_by_category_per_rank"][1]["params"].get<double>();
  const double pfull = full.final["mem_resident_by_category"]["params"].get<double>();
  EXPECT_EQ(p0 + p1, pfull + 4.0 * 256 * 32);
  EXPECT_LT(std::max(p0, p1), 0.75 * pfull);
}

// Checkpoints are full and layout-independent: a single-process checkpoint resumes under pp=2
// 1F1B x tp=2 and continues like the uninterrupted run; one written under pp=2 resumes in one process.
TEST_F(PipelineParallel, CheckpointsReloadUnderAnotherLayout) {
  auto longer = train(1, 2, 4, "single12", "--train.steps 12 --train.checkpoint_every 4");
  ASSERT_EQ(longer.losses.size(), 12u);
  auto resumed = train(4, 2, 4, "resumed",
                       "--parallel.pp 2 --parallel.tp 2 --train.steps 12 --train.resume " +
                           (dir_ / "ck_single12").string() + "/step_00000008");
  ASSERT_EQ(resumed.losses.size(), 4u);
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(resumed.losses[i], longer.losses[8 + i], kLossTol) << "step " << 9 + i;
  train(2, 2, 4, "pp12", "--parallel.pp 2 --parallel.pp_schedule gpipe --train.steps 12 --train.checkpoint_every 4");
  auto back = train(1, 2, 4, "back", "--train.steps 12 --train.resume " + (dir_ / "ck_pp12").string() + "/step_00000008");
  ASSERT_EQ(back.losses.size(), 4u);
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(back.losses[i], longer.losses[8 + i], kLossTol) << "step " << 9 + i;
}

TEST_F(PipelineParallel, InvalidLayoutsAreRefused) {
  const std::string base = std::string(MT_BINARY) + " train --model.preset gpt2-tiny --data.train " +
                           (dir_ / "train.bin").string() + " --data.val '' --train.steps 1 ";
  RunOut r;
  r = run(mpirun(4) + base + "--parallel.pp 4 --parallel.pp_schedule interleaved_1f1b --parallel.pp_virtual_stages 2 "
                             "--train.grad_accum 4");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.output.find("8 pipeline stages (pp x virtual stages) but the model has only 4 units"), std::string::npos)
      << r.output;
  r = run(mpirun(2) + base + "--parallel.pp 2 --parallel.pp_partition 1,2");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.output.find("parallel.pp_partition assigns 3 blocks, the model has 2"), std::string::npos) << r.output;
  r = run(mpirun(2) + base + "--parallel.pp 2 --parallel.pp_schedule interleaved_1f1b --parallel.pp_virtual_stages 2 "
                             "--train.grad_accum 3");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.output.find("pipeline:"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace mt
