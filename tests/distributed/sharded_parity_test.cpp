// Sharded data parallelism (ZeRO-1/2/3, hybrid) against single-process training on the same global
// batch, as real processes under mpirun; per-rank model-state memory against the formulas; the
// bound on gathered units under FULL_SHARD.
#include <gtest/gtest.h>

#include <algorithm>

#include <string>

#include "harness.h"
#include "model/transformer.h"
#include "parallel/strategy.h"

namespace mt {
namespace {

// fp32: sharding changes only where sums happen (reduce-scatter + all-gather instead of one sum):
// the same tolerance as DDP (losses 1e-5, weights 2e-5 absolute after 8 steps).
constexpr double kLossTol = 1e-5, kWeightTol = 2e-5;
// bf16 compute vs the fp32 single-process run: bf16 rounds matmul inputs to 8 significant bits;
// over 8 steps the losses stay within 2e-2 and the weights within 1e-2 (lr 3e-3 per step bounds
// how far Adam can move any weight: 8 x 3e-3 = 2.4e-2).
constexpr double kBf16LossTol = 2e-2, kBf16WeightTol = 1e-2;
// bf16 sharded vs bf16 single process: identical arithmetic except the reduction order, whose
// fp32 rounding differences can flip a bf16 rounding of a weight copy now and then.
constexpr double kBf16SameLossTol = 2e-3, kBf16SameWeightTol = 2e-3;

class Sharded : public ParityFixture {
 protected:
  RunResult single() { return train(1, 8, 1, "single"); }
};

TEST_F(Sharded, Zero1) { expect_close(single(), train(2, 4, 1, "z1", "--parallel.strategy ZERO1"), kLossTol, kWeightTol, "ZERO1 np=2"); }

TEST_F(Sharded, Zero2) {
  auto ref = single();
  expect_close(ref, train(2, 4, 1, "z2", "--parallel.strategy SHARD_GRAD_OP"), kLossTol, kWeightTol, "SHARD_GRAD_OP np=2");
  expect_close(ref, train(4, 2, 1, "z2n4", "--parallel.strategy SHARD_GRAD_OP --train.activation_checkpointing selective"),
               kLossTol, kWeightTol, "SHARD_GRAD_OP np=4 selective recompute");
}

TEST_F(Sharded, FullShard) {
  auto ref = single();
  expect_close(ref, train(2, 4, 1, "z3", "--parallel.strategy FULL_SHARD"), kLossTol, kWeightTol, "FULL_SHARD np=2");
  expect_close(ref, train(4, 2, 1, "z3n4", "--parallel.strategy FULL_SHARD"), kLossTol, kWeightTol, "FULL_SHARD np=4");
}

TEST_F(Sharded, FullShardWithCheckpointingAndAccumulation) {
  auto ref = single();
  expect_close(ref, train(2, 2, 2, "z3ac", "--parallel.strategy FULL_SHARD --train.activation_checkpointing full"),
               kLossTol, kWeightTol, "FULL_SHARD np=2 accum=2 full recompute");
  expect_close(ref,
               train(2, 2, 2, "z3last", "--parallel.strategy FULL_SHARD --parallel.reduce_every_microbatch false"),
               kLossTol, kWeightTol, "FULL_SHARD np=2 accum=2 reduce on last micro-batch");
  expect_close(ref,
               train(2, 4, 1, "z3keep", "--parallel.strategy FULL_SHARD --parallel.reshard_after_forward false "
                                        "--parallel.prefetch 2"),
               kLossTol, kWeightTol, "FULL_SHARD np=2 no reshard, prefetch 2");
}

TEST_F(Sharded, HybridOnA2x2Mesh) {
  auto ref = single();
  const std::string mesh = " --parallel.dp_replicate 2 --parallel.dp_shard 2";
  expect_close(ref, train(4, 2, 1, "hs", "--parallel.strategy HYBRID_SHARD" + mesh), kLossTol, kWeightTol,
               "HYBRID_SHARD 2x2");
  expect_close(ref, train(4, 1, 2, "hs2", "--parallel.strategy HYBRID_SHARD_ZERO2" + mesh), kLossTol, kWeightTol,
               "HYBRID_SHARD_ZERO2 2x2 accum=2");
}

TEST_F(Sharded, Bf16) {
  auto ref = single();
  auto bf_single = train(1, 8, 1, "bf_single", "--train.dtype bf16");
  expect_close(ref, bf_single, kBf16LossTol, kBf16WeightTol, "bf16 single vs fp32 single");
  expect_close(bf_single, train(2, 4, 1, "bf_z3", "--train.dtype bf16 --parallel.strategy FULL_SHARD"),
               kBf16SameLossTol, kBf16SameWeightTol, "bf16 FULL_SHARD np=2 vs bf16 single");
  expect_close(ref, train(2, 4, 1, "bf_z1", "--train.dtype bf16 --parallel.strategy ZERO1"), kBf16LossTol,
               kBf16WeightTol, "bf16 ZERO1 np=2 vs fp32 single");
  expect_close(ref,
               train(4, 1, 2, "bf_hs",
                     "--train.dtype bf16 --parallel.strategy HYBRID_SHARD --parallel.dp_replicate 2 "
                     "--parallel.dp_shard 2 --train.activation_checkpointing full"),
               kBf16LossTol, kBf16WeightTol, "bf16 HYBRID_SHARD 2x2 accum=2 full recompute vs fp32 single");
  expect_close(ref, train(2, 4, 1, "bf_ddp", "--train.dtype bf16"), kBf16LossTol, kBf16WeightTol,
               "bf16 DDP np=2 vs fp32 single");
}

// The bf16 residual stream (model.residual_dtype = bf16) under FULL_SHARD: the end-of-block add is
// fused into the next unit's first norm, which runs after that unit's weights are gathered, and a
// recomputed block reads its saved bf16 input; against the same stream on one process (the
// tolerance of bf16 sharded vs bf16 single).
TEST_F(Sharded, Bf16ResidualFullShard) {
  const std::string bf = "--train.dtype bf16 --model.residual_dtype bf16";
  expect_close(train(1, 8, 1, "bfres_single", bf),
               train(2, 2, 2, "bfres_z3", bf + " --parallel.strategy FULL_SHARD --train.activation_checkpointing full"),
               kBf16SameLossTol, kBf16SameWeightTol, "bf16 residual FULL_SHARD np=2 accum=2 full recompute vs single");
}

// Per-rank model state after a step equals the formula of each strategy exactly (Ψ = the padded
// flat size), at N = 2 and 4, fp32 and bf16.
TEST_F(Sharded, ModelStateMemoryMatchesTheFormulas) {
  for (const std::string strategy : {"NO_SHARD", "ZERO1", "SHARD_GRAD_OP", "FULL_SHARD"})
    for (int np : {2, 4})
      for (const std::string dtype : {"fp32", "bf16"}) {
        if (np == 4 && dtype == "bf16" && strategy != "FULL_SHARD") continue;  // keep the test short
        std::string tag = strategy + std::to_string(np) + dtype;
        auto r = train(np, 8 / np, 1, tag, "--parallel.strategy " + strategy + " --train.dtype " + dtype);
        ASSERT_TRUE(r.final.is_object()) << tag;
        const int64_t F = r.final["flat_size"];
        DType dt = dtype == "fp32" ? DType::F32 : DType::BF16;
        const auto want = parallel::expected_state_bytes(parse_sharding_strategy(strategy), dt, F, np);
        ASSERT_EQ(r.final["mem_resident_by_category_per_rank"].size(), static_cast<size_t>(np));
        for (int rank = 0; rank < np; ++rank) {
          const auto& got = r.final["mem_resident_by_category_per_rank"][rank];
          EXPECT_EQ(got["params"].get<int64_t>(), want.params) << tag << " rank " << rank;
          EXPECT_EQ(got["grads"].get<int64_t>(), want.grads) << tag << " rank " << rank;
          EXPECT_EQ(got["optimizer"].get<int64_t>(), want.optimizer) << tag << " rank " << rank;
        }
      }
}

// FULL_SHARD keeps at most 1 + prefetch gathered blocks besides the root units (embedding and the
// tied head, kept like FSDP's root): checked from the allocator's params counter (peak minus what
// stays resident is what was gathered at once).
TEST_F(Sharded, FullShardGathersAtMostOnePlusPrefetchUnits) {
  for (int prefetch : {0, 1, 2}) {
    auto r = train(2, 4, 1, "pf" + std::to_string(prefetch),
                   "--parallel.strategy FULL_SHARD --model.n_layer 6 --parallel.prefetch " + std::to_string(prefetch));
    ASSERT_TRUE(r.final.is_object());
    ModelConfig c = model_preset("gpt2-tiny");
    c.n_layer = 6;
    parallel::StrategySpec spec;
    spec.strategy = ShardingStrategy::FullShard;
    ModelStorage st = parallel::model_storage(spec, DType::F32, 2);
    Transformer m(c, ModelOptions{.storage = {.weights = false, .master = false, .grads = false, .unit_align = st.unit_align}});
    int64_t block = m.unit(1).numel, root = m.unit(0).numel + m.unit(m.num_units() - 1).numel;
    const auto& f = r.final;
    int64_t gathered = f["mem_peak_by_category"]["params"].get<int64_t>() -
                       f["mem_resident_by_category"]["params"].get<int64_t>();
    int64_t bound = 4 * (root + (1 + prefetch) * block);
    EXPECT_LE(gathered, bound) << "prefetch " << prefetch;
    // ... and really does hold more than the root while computing a block.
    EXPECT_GT(gathered, 4 * root) << "prefetch " << prefetch;
    std::printf("[prefetch %d] gathered at peak %lld bytes, bound %lld (block %lld, root %lld elements)\n", prefetch,
                static_cast<long long>(gathered), static_cast<long long>(bound), static_cast<long long>(block),
                static_cast<long long>(root));
  }
}

// train.loss_chunk_tokens: the chunked LM head (its backward partly done in forward, its weight
// gradient added by the next backward) composes with DDP's chunked tied-embedding reduction and
// accumulation, FULL_SHARD, a GPipe pipeline (every forward of the last stage before any backward,
// the tied replica's gradient sent back) and tensor parallelism (+ SP): all match the single
// process with whole logits.
TEST_F(Sharded, ChunkedLossMatchesWholeLogits) {
  auto ref = train(1, 8, 2, "single");
  const std::string chunk = "--train.loss_chunk_tokens 40 ";
  expect_close(ref, train(2, 4, 2, "ddp", chunk), kLossTol, kWeightTol, "DDP 2 x accumulation 2, chunked loss");
  expect_close(ref, train(2, 4, 2, "fs", chunk + "--parallel.strategy FULL_SHARD"), kLossTol, kWeightTol,
               "FULL_SHARD 2, chunked loss");
  expect_close(ref, train(2, 8, 2, "gpipe", chunk + "--parallel.pp 2 --parallel.pp_schedule gpipe"), kLossTol, kWeightTol,
               "pp 2 GPipe, chunked loss");
  // Vocab-parallel: per chunk the row statistics are reduced over the tp ranks, the input gradient
  // by the backward (all-reduce, or reduce-scatter with sequence parallelism).
  expect_close(ref, train(2, 8, 2, "tp", chunk + "--parallel.tp 2"), kLossTol, kWeightTol, "tp 2, chunked loss");
  expect_close(ref, train(2, 8, 2, "sp", chunk + "--parallel.tp 2 --parallel.sequence_parallel true"), kLossTol,
               kWeightTol, "tp 2 + sequence parallel, chunked loss");
}

// Checkpoints are gathered and written one unit at a time: saving (here after every step) adds a
// few copies of the largest unit to the workspace peak, never copies of the whole model's state.
TEST_F(Sharded, CheckpointSavingHoldsOneUnitAtATime) {
  const std::string layout = " --parallel.strategy FULL_SHARD --model.n_layer 6";
  const std::string m0 = (dir_ / "m_nock.jsonl").string();
  RunOut r = run(mpirun(2) + MT_BINARY + " train --model.preset gpt2-tiny --data.train " + (dir_ / "train.bin").string() +
                 " --data.val '' --train.steps 8 --train.warmup_steps 2 --train.lr 3e-3 --train.threads 1"
                 " --train.micro_batch 4 --parallel.bucket_mb 0.01 --log.metrics_out " + m0 + layout);
  ASSERT_EQ(r.code, 0) << r.output;
  auto saving = train(2, 4, 1, "ckevery", layout + " --train.checkpoint_every 1");
  ASSERT_TRUE(saving.final.is_object());
  const nlohmann::json plain = final_metrics(m0);
  EXPECT_EQ(losses(m0), saving.losses);  // saving changes nothing in the run

  ModelConfig c = model_preset("gpt2-tiny");
  c.n_layer = 6;
  const Transformer ref(c, ModelOptions{.storage = ModelStorage{.weights = false, .master = false, .grads = false}});
  parallel::StrategySpec spec;
  spec.strategy = ShardingStrategy::FullShard;
  const Transformer local(c, ModelOptions{.storage = {.weights = false,
                                                      .master = false,
                                                      .grads = false,
                                                      .unit_align = parallel::model_storage(spec, DType::F32, 2).unit_align}});
  int64_t largest = 0;  // elements of the largest unit (its padded local range if that is larger)
  for (int u = 0; u < ref.num_units(); ++u) largest = std::max({largest, ref.unit(u).numel, local.unit(u).numel});
  const int64_t extra = saving.final["mem_peak_by_category"]["workspace"].get<int64_t>() -
                        plain["mem_peak_by_category"]["workspace"].get<int64_t>();
  // Per unit: weights and two moments, gathered (shard -> unit) and assembled (unit, ref layout).
  const int64_t bound = 4 * 6 * largest, whole = 4 * 3 * ref.flat_size();
  std::printf("checkpoint saving: workspace peak +%lld bytes; bound %lld (6 x the largest unit, %lld elements); "
              "the whole model's weights + moments: %lld bytes\n",
              static_cast<long long>(extra), static_cast<long long>(bound), static_cast<long long>(largest),
              static_cast<long long>(whole));
  EXPECT_LE(extra, bound);
  EXPECT_LT(bound, whole);  // the test model is large enough to tell the two apart
}

TEST_F(Sharded, BadMeshIsAClearError) {
  RunOut r = run(mpirun(4) + MT_BINARY + " train --model.preset gpt2-tiny --data.train " + (dir_ / "train.bin").string() +
                 " --data.val '' --train.steps 1 --parallel.strategy HYBRID_SHARD --parallel.dp_replicate 3");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.output.find("dp_replicate"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace mt
