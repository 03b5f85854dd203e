// Tensor parallelism (Megatron: heads and MLP split, vocab-parallel embedding and loss), alone and
// composed with data parallelism, against single-process training on the same global batch; and
// checkpoints written under one layout resumed under another.
#include <gtest/gtest.h>

#include <string>

#include "harness.h"

namespace mt {
namespace {

// fp32: tp changes where sums happen (partial matmul sums over heads / hidden units added by an
// all-reduce; the softmax's sums split across ranks): rounding-level differences, the same
// tolerance as the data-parallel tests.
constexpr double kLossTol = 1e-5, kWeightTol = 2e-5;
constexpr double kBf16LossTol = 2e-2, kBf16WeightTol = 1e-2;
// "Bit for bit": losses equal (|a - b| <= 0), weight differences below any nonzero difference of
// floats of these magnitudes.
constexpr double kExactLoss = 0.0, kExactWeight = 1e-30;

using TensorParallel = ParityFixture;

TEST_F(TensorParallel, Gpt2Tp2) {
  auto tp2 = train(2, 8, 1, "tp2", "--parallel.tp 2");
  expect_close(train(1, 8, 1, "single"), tp2, kLossTol, kWeightTol, "gpt2 tp=2");
  // Overlapping the input-gradient reductions with the weight-gradient matmuls changes only when
  // things run, not the arithmetic: the same losses and weights bit for bit (also with SP).
  expect_close(tp2, train(2, 8, 1, "tp2sync", "--parallel.tp 2 --parallel.tp_overlap false"), kExactLoss, kExactWeight,
               "gpt2 tp=2, overlap off vs on");
  const std::string sp = "--parallel.tp 2 --parallel.sequence_parallel true ";
  expect_close(train(2, 8, 1, "sp2", sp), train(2, 8, 1, "sp2sync", sp + "--parallel.tp_overlap false"), kExactLoss, kExactWeight,
               "gpt2 tp=2 + sp, overlap off vs on");
}

TEST_F(TensorParallel, Gpt2Tp4) {
  const std::string m = "--model.n_head 4 ";
  expect_close(train(1, 8, 1, "single", m), train(4, 8, 1, "tp4", m + "--parallel.tp 4"), kLossTol, kWeightTol,
               "gpt2 (4 heads) tp=4");
}

TEST_F(TensorParallel, LlamaTp2WithGroupedQueryAttention) {
  const std::string m = "--model.preset llama-tiny ";
  expect_close(train(1, 8, 1, "single", m), train(2, 8, 1, "tp2", m + "--parallel.tp 2"), kLossTol, kWeightTol,
               "llama (4 heads, 2 kv) tp=2");
}

TEST_F(TensorParallel, ComposedWithDataParallelOn4Ranks) {
  auto ref = train(1, 8, 1, "single");
  expect_close(ref, train(4, 4, 1, "tp2ddp2", "--parallel.tp 2"), kLossTol, kWeightTol, "tp=2 x DDP 2");
  expect_close(ref, train(4, 4, 1, "tp2fs2", "--parallel.tp 2 --parallel.strategy FULL_SHARD"), kLossTol, kWeightTol,
               "tp=2 x FULL_SHARD 2");
  expect_close(ref,
               train(4, 2, 2, "tp2z2ac",
                     "--parallel.tp 2 --parallel.strategy SHARD_GRAD_OP --train.activation_checkpointing full"),
               kLossTol, kWeightTol, "tp=2 x SHARD_GRAD_OP 2, accum 2, full recompute");
}

TEST_F(TensorParallel, Bf16) {
  expect_close(train(1, 8, 1, "single"), train(2, 8, 1, "tp2bf", "--parallel.tp 2 --train.dtype bf16"), kBf16LossTol,
               kBf16WeightTol, "bf16 tp=2 vs fp32 single");
}

// Sequence parallelism: norms and residuals on 1/t of the rows, all-gather / reduce-scatter in
// place of the all-reduces. The sums are the same (this engine's all-reduce is a reduce-scatter
// plus an all-gather), only the norms' parameter gradients are summed from row shards: fp32
// tolerance as above; bf16 sequence parallel vs bf16 tp stays at fp32-rounding distance.
TEST_F(TensorParallel, SequenceParallel) {
  auto ref = train(1, 8, 1, "single");
  const std::string sp = "--parallel.tp 2 --parallel.sequence_parallel true ";
  auto tp2 = train(2, 8, 1, "tp2", "--parallel.tp 2");
  auto sp2 = train(2, 8, 1, "sp2", sp);
  expect_close(ref, sp2, kLossTol, kWeightTol, "gpt2 tp=2 + sequence parallel");
  // Less activation memory per rank: the norms' inputs/outputs and the residual stream are split.
  ASSERT_FALSE(tp2.final.is_null());
  ASSERT_FALSE(sp2.final.is_null());
  EXPECT_LT(sp2.final["mem_peak_by_category"]["activations"].get<double>(),
            0.9 * tp2.final["mem_peak_by_category"]["activations"].get<double>());
  const std::string l = "--model.preset llama-tiny ";
  expect_close(train(1, 8, 1, "lsingle", l), train(2, 8, 1, "lsp2", l + sp), kLossTol, kWeightTol,
               "llama tp=2 + sequence parallel");
  expect_close(ref, train(4, 4, 1, "spfs", sp + "--parallel.strategy FULL_SHARD --train.activation_checkpointing full"),
               kLossTol, kWeightTol, "tp=2 + sp x FULL_SHARD 2, full recompute");
  expect_close(train(2, 8, 1, "tpbf", "--parallel.tp 2 --train.dtype bf16"),
               train(2, 8, 1, "spbf", sp + "--train.dtype bf16"), kLossTol, kWeightTol, "bf16 sp vs bf16 tp");
}

TEST_F(TensorParallel, IndivisibleHeadsAreRefused) {
  RunOut r = run(mpirun(3) + MT_BINARY + " train --model.preset gpt2-tiny --data.train " +
                 (dir_ / "train.bin").string() + " --data.val '' --train.steps 1 --parallel.tp 3");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.output.find("model.n_head (2) must be divisible by parallel.tp (3)"), std::string::npos) << r.output;
}

// A checkpoint is full and unsharded: one written by a single process resumes under tp=2 x
// FULL_SHARD and continues exactly like the uninterrupted single-process run (and vice versa).
TEST_F(TensorParallel, CheckpointsReloadUnderAnotherLayout) {
  // 12 steps in one process, checkpoints every 4; then steps 9..12 again from its step-8
  // checkpoint under tp=2 x FULL_SHARD on 4 ranks, and from a step-8 checkpoint that tp=2 wrote
  // back in one process.
  auto longer = train(1, 8, 1, "single12", "--train.steps 12 --train.checkpoint_every 4");
  ASSERT_EQ(longer.losses.size(), 12u);
  std::string ck = (dir_ / "ck_single12").string();
  auto resumed = train(4, 4, 1, "resumed",
                       "--parallel.tp 2 --parallel.strategy FULL_SHARD --train.steps 12 --train.resume " + ck +
                           "/step_00000008");
  ASSERT_EQ(resumed.losses.size(), 4u);
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(resumed.losses[i], longer.losses[8 + i], kLossTol) << "step " << 9 + i;
  train(2, 8, 1, "tp12", "--parallel.tp 2 --train.steps 12 --train.checkpoint_every 4");
  auto back = train(1, 8, 1, "back",
                    "--train.steps 12 --train.resume " + (dir_ / "ck_tp12").string() + "/step_00000008");
  ASSERT_EQ(back.losses.size(), 4u);
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(back.losses[i], longer.losses[8 + i], kLossTol) << "step " << 9 + i;
}

}  // namespace
}  // namespace mt
