// Context parallelism (ring attention): every sequence cut into 2 x cp chunks, cp rank i holding
// chunks i and 2cp-1-i, attention over every rank's keys and values passed around the ring. Against
// single-process training on the same global batch (the loss over all tokens, the same weights),
// alone and composed with tensor parallelism, FULL_SHARD and a pipeline, for GPT-2 (learned
// positions) and Llama (RoPE, grouped-query attention); the refusals; the bytes the ring moves.
#include <gtest/gtest.h>

#include <string>

#include "harness.h"

namespace mt {
namespace {

// fp32: cp changes where sums happen (each query row's softmax merged from per-block partial
// results by log-sum-exp; the key / value gradients summed along the ring; the weight gradients
// summed over the cp ranks by the data-parallel reduction): rounding-level differences, the same
// tolerance as the data-parallel and tensor-parallel tests.
constexpr double kLossTol = 1e-5, kWeightTol = 2e-5;
constexpr double kBf16LossTol = 2e-2, kBf16WeightTol = 1e-2;
constexpr double kExactLoss = 0.0, kExactWeight = 1e-30;
const std::string kLlama = "--model.preset llama-tiny ";

using ContextParallel = ParityFixture;

TEST_F(ContextParallel, Gpt2Cp2) {
  auto ref = train(1, 8, 1, "single");
  auto cp2 = train(2, 8, 1, "cp2", "--parallel.cp 2");
  expect_close(ref, cp2, kLossTol, kWeightTol, "gpt2 cp=2 (ring)");
  expect_close(ref, train(2, 8, 1, "cp2ag", "--parallel.cp 2 --parallel.cp_mode allgather"), kLossTol, kWeightTol,
               "gpt2 cp=2 (allgather)");
  // Recompute re-runs the ring in backward: the same arithmetic, bit for bit.
  expect_close(cp2, train(2, 8, 1, "cp2rc", "--parallel.cp 2 --train.activation_checkpointing full"), kExactLoss,
               kExactWeight, "gpt2 cp=2, full recompute vs none");
  ASSERT_FALSE(ref.final.is_null());
  ASSERT_FALSE(cp2.final.is_null());
  // Every activation is per token: a cp rank holds exactly half of what the single process holds.
  EXPECT_EQ(2 * cp2.final["mem_peak_by_category"]["activations"].get<int64_t>(),
            ref.final["mem_peak_by_category"]["activations"].get<int64_t>());
}

TEST_F(ContextParallel, Gpt2Cp4) {
  expect_close(train(1, 8, 1, "single"), train(4, 8, 1, "cp4", "--parallel.cp 4"), kLossTol, kWeightTol,
               "gpt2 cp=4 (ring of 4, chunks of 4 tokens)");
}

TEST_F(ContextParallel, LlamaCp2AndCp4WithGroupedQueryAttention) {
  auto ref = train(1, 8, 1, "single", kLlama);
  expect_close(ref, train(2, 8, 1, "cp2", kLlama + "--parallel.cp 2"), kLossTol, kWeightTol, "llama cp=2");
  expect_close(ref, train(4, 8, 1, "cp4", kLlama + "--parallel.cp 4"), kLossTol, kWeightTol, "llama cp=4");
}

TEST_F(ContextParallel, ComposedOn4Ranks) {
  auto ref = train(1, 8, 1, "single");
  expect_close(ref, train(4, 8, 1, "cp2tp2", "--parallel.cp 2 --parallel.tp 2 --parallel.sequence_parallel true"),
               kLossTol, kWeightTol, "gpt2 cp=2 x tp=2 + SP");
  expect_close(ref, train(4, 4, 1, "cp2fs2", "--parallel.cp 2 --parallel.strategy FULL_SHARD"), kLossTol, kWeightTol,
               "gpt2 cp=2 x FULL_SHARD 2");
  expect_close(ref, train(4, 4, 2, "cp2pp2", "--parallel.cp 2 --parallel.pp 2"), kLossTol, kWeightTol,
               "gpt2 cp=2 x pp=2 (1f1b, 2 micro-batches)");
  expect_close(ref,
               train(4, 2, 2, "cp2z1sel",
                     "--parallel.cp 2 --parallel.strategy ZERO1 --train.activation_checkpointing selective"),
               kLossTol, kWeightTol, "gpt2 cp=2 x ZERO1 2, accum 2, selective recompute");
  expect_close(ref,
               train(4, 4, 1, "cp2hz2", "--parallel.cp 2 --parallel.strategy HYBRID_SHARD_ZERO2 --parallel.dp_replicate 2"),
               kLossTol, kWeightTol, "gpt2 cp=2 x HYBRID_SHARD_ZERO2 (2 replicas)");
}

TEST_F(ContextParallel, LlamaComposedOn4Ranks) {
  auto ref = train(1, 8, 1, "single", kLlama);
  expect_close(ref, train(4, 8, 1, "cp2tp2", kLlama + "--parallel.cp 2 --parallel.tp 2"), kLossTol, kWeightTol,
               "llama cp=2 x tp=2");
  expect_close(ref, train(4, 4, 1, "cp2fs2", kLlama + "--parallel.cp 2 --parallel.strategy FULL_SHARD"), kLossTol,
               kWeightTol, "llama cp=2 x FULL_SHARD 2");
  expect_close(ref, train(4, 4, 1, "cp2hs", kLlama + "--parallel.cp 2 --parallel.strategy HYBRID_SHARD --parallel.dp_replicate 2"),
               kLossTol, kWeightTol, "llama cp=2 x HYBRID_SHARD (2 replicas)");
  expect_close(ref, train(4, 4, 2, "cp2pp2", kLlama + "--parallel.cp 2 --parallel.pp 2 --parallel.strategy SHARD_GRAD_OP"),
               kLossTol, kWeightTol, "llama cp=2 x pp=2, ZeRO-2 over the cp ranks");
}

// Evaluation runs the same ring (validation loss over all tokens, as without cp).
TEST_F(ContextParallel, ValidationLossMatches) {
  const std::string val = kLlama + "--data.val " + (dir_ / "train.bin").string() +
                          " --train.eval_every 4 --train.eval_batches 2 ";
  auto ref = train(1, 8, 1, "single", val);
  auto cp2 = train(2, 8, 1, "cp2", val + "--parallel.cp 2");
  ASSERT_FALSE(ref.final.is_null());
  ASSERT_FALSE(cp2.final.is_null());
  ASSERT_TRUE(ref.final.contains("val_loss"));
  EXPECT_NEAR(cp2.final["val_loss"].get<double>(), ref.final["val_loss"].get<double>(), kLossTol);
}

TEST_F(ContextParallel, Bf16) {
  expect_close(train(1, 8, 1, "single"), train(2, 8, 1, "cp2bf", "--parallel.cp 2 --train.dtype bf16"), kBf16LossTol,
               kBf16WeightTol, "bf16 cp=2 vs fp32 single");
}

// The ring's bytes: per layer and micro-batch, forward sends the rank's key / value block cp - 1
// times, backward sends it cp - 1 times again and its gradient cp - 1 times (accumulated from the
// next rank on, the last hop home); each send is received by the next rank, and the cp group counts
// both sides. With full recompute every layer's forward ring runs again in backward.
TEST_F(ContextParallel, RingBytesEqualTheFormula) {
  for (int cp : {2, 4})
    for (bool recompute : {false, true}) {
      auto r = train(cp, 8, 1, "bytes" + std::to_string(cp) + (recompute ? "rc" : ""),
                     kLlama + "--parallel.cp " + std::to_string(cp) +
                         (recompute ? " --train.activation_checkpointing full" : ""));
      ASSERT_FALSE(r.final.is_null());
      const int64_t L = 2, B = 8, T = 32 / cp, nkv = 2, hd = 8, steps = 8;  // llama-tiny: 32 wide, 4 heads of 8
      const int64_t block = B * T * 2 * nkv * hd * 4;
      const int64_t sends = L * (3 + (recompute ? 1 : 0)) * (cp - 1) * steps;
      EXPECT_EQ(r.final["comm_bytes_by_group"]["cp"].get<int64_t>(), 2 * sends * block) << "cp " << cp;
    }
}

// Checkpoints do not depend on cp: a single process's step-8 checkpoint resumes under cp 2 x
// FULL_SHARD 2 and continues like the uninterrupted run, and one written under cp 2 resumes in one
// process.
TEST_F(ContextParallel, CheckpointsReloadUnderAnotherLayout) {
  auto longer = train(1, 8, 1, "single12", kLlama + "--train.steps 12 --train.checkpoint_every 4");
  ASSERT_EQ(longer.losses.size(), 12u);
  auto resumed = train(4, 4, 1, "resumed",
                       kLlama + "--parallel.cp 2 --parallel.strategy FULL_SHARD --train.steps 12 --train.resume " +
                           (dir_ / "ck_single12").string() + "/step_00000008");
  ASSERT_EQ(resumed.losses.size(), 4u);
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(resumed.losses[i], longer.losses[8 + i], kLossTol) << "step " << 9 + i;
  train(2, 8, 1, "cp12", kLlama + "--parallel.cp 2 --train.steps 12 --train.checkpoint_every 4");
  auto back = train(1, 8, 1, "back",
                    kLlama + "--train.steps 12 --train.resume " + (dir_ / "ck_cp12").string() + "/step_00000008");
  ASSERT_EQ(back.losses.size(), 4u);
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(back.losses[i], longer.losses[8 + i], kLossTol) << "step " << 9 + i;
  // The sharded format: every rank of cp 2 x FULL_SHARD 2 writes its own share; one process reads it back.
  train(4, 4, 1, "cpfs12", kLlama + "--parallel.cp 2 --parallel.strategy FULL_SHARD --train.steps 12 "
                           "--train.checkpoint_every 4 --train.checkpoint_format sharded");
  auto sharded = train(1, 8, 1, "fromsharded",
                       kLlama + "--train.steps 12 --train.resume " + (dir_ / "ck_cpfs12").string() + "/step_00000008");
  ASSERT_EQ(sharded.losses.size(), 4u);
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(sharded.losses[i], longer.losses[8 + i], kLossTol) << "step " << 9 + i;
}

TEST_F(ContextParallel, RefusesWhatItCannotSplit) {
  const std::string base = std::string(MT_BINARY) + " train --model.preset gpt2-tiny --data.train " +
                           (dir_ / "train.bin").string() + " --train.steps 1 --train.threads 1 ";
  auto r = run(mpirun(2) + base + "--parallel.cp 2 --model.seq_len 30");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.output.find("must be divisible by 2 x cp = 4"), std::string::npos) << r.output;
  r = run(mpirun(2) + base + "--parallel.cp 2 --parallel.cp_mode halo");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.output.find("parallel.cp_mode must be ring or allgather"), std::string::npos) << r.output;
  r = run(mpirun(2) + base + "--parallel.cp 2 --train.sample_tokens 8");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.output.find("not supported with parallel.cp > 1"), std::string::npos) << r.output;
  r = run(mpirun(2) + base + "--parallel.cp 3");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.output.find("parallel mesh"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace mt
