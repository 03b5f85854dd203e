// The seed article's worked numbers, reproduced and corrected, and its decision framework
// recomputed (docs/plan.md "The article, checked").
#include <gtest/gtest.h>

#include <map>

#include "plan/planner.h"
#include "plan/published.h"

namespace mt::plan {
namespace {

TEST(Article, SeventyBModelStateIsOnePointOneTwoTerabytes) {
  EXPECT_NEAR(article_70b_model_state_bytes() / 1e12, 1.12, 1e-9);
  EXPECT_NEAR(article_70b_model_state_as_article_adds() / 1e9, 700, 1e-9);  // what the article added up
  // The real Llama 3 70B has 70.55B parameters: 1.129 TB.
  EXPECT_NEAR(model_state_bytes(model_preset("llama3-70b"), false) / 1e12, 1.129, 0.001);
}

TEST(Article, ThreeBOnEightFortyGbGpus) {
  const double psi = 3e9;
  // Article: ~30 GB per GPU with DDP, ~3.75 GB with FSDP. Correct: 48 GB and 6 GB.
  EXPECT_NEAR(zero_model_state(psi, Strategy::NoShard, 8, false).total() / 1e9, 48.0, 1e-9);
  EXPECT_NEAR(zero_model_state(psi, Strategy::FullShard, 8, false).total() / 1e9, 6.0, 1e-9);
  EXPECT_GT(zero_model_state(psi, Strategy::NoShard, 8, false).total(), 40e9);  // DDP does not fit at all
  // The planner agrees on a real 3B model (Llama 3.2 3B) and 40 GB GPUs: no DDP layout fits.
  Cluster c = cluster_preset("a100-80g-ib400");
  c.gpus = 8;
  c.mem_per_gpu = 40 * GiB;
  c.mem_reserved = 1 * GiB + 0.05 * c.mem_per_gpu;
  TrainSetup st;
  st.seq = 4096;
  PlanOptions o;
  o.strategy = Strategy::NoShard;  // replicas of the whole model: no tp, no pp
  o.tp = 1;
  o.pp = 1;
  const PlanResult ddp = plan(plan_model_preset("llama3.2-3b"), c, st, o);
  EXPECT_FALSE(ddp.candidates[0].fits);
  const PlanResult any = plan(plan_model_preset("llama3.2-3b"), c, st);
  EXPECT_TRUE(any.candidates[0].fits);
  EXPECT_NE(any.candidates[0].layout.strategy, Strategy::NoShard);
}

TEST(Article, SevenBAllReduceAcrossThirtyTwoGpus) {
  const double bytes = 14e9;  // 7B bf16 gradients
  const double h100 = allreduce_seconds(bytes, 32, cluster_preset("h100-80g-ib400"));
  const double a100 = allreduce_seconds(bytes, 32, cluster_preset("a100-80g-ib200"));
  const double roce = allreduce_seconds(bytes, 32, cluster_preset("h100-80g-roce100"));
  // The article's 150-250 ms matches 200 Gb/s per GPU; 400 Gb/s halves it; 100 Gb/s RoCE doubles it.
  EXPECT_GT(a100, 0.150);
  EXPECT_LT(a100, 0.250);
  EXPECT_GT(h100, 0.060);
  EXPECT_LT(h100, 0.100);
  EXPECT_GT(roce, 0.250);
}

TEST(Article, FsdpIsOnePointFiveTimesDdp) {
  EXPECT_NEAR(fsdp_over_ddp_comm_ratio(false, 1), 1.5, 1e-9);  // same dtype both ways
  EXPECT_NEAR(fsdp_over_ddp_comm_ratio(true, 1), 1.0, 1e-9);   // bf16 gathers, fp32 reduction
  EXPECT_NEAR(fsdp_over_ddp_comm_ratio(false, 4), 6.0, 1e-9);  // re-gathered every micro-batch
}

TEST(Article, ChecksListEveryWorkedNumber) {
  std::map<std::string, ArticleCheck> by_id;
  for (const auto& c : article_checks()) by_id[c.id] = c;
  for (const char* id : {"70b-model-state", "3b-on-8x40gb", "7b-allreduce-32", "fsdp-1.5x-ddp", "7b-optimizer-80gb",
                         "70b-fsdp-32", "70b-offload-4", "tp-allreduces"}) {
    ASSERT_TRUE(by_id.count(id)) << id;
    EXPECT_FALSE(by_id[id].computed.empty());
    EXPECT_FALSE(by_id[id].verdict.empty());
  }
  EXPECT_EQ(by_id["70b-model-state"].verdict.rfind("wrong", 0), 0u);
  EXPECT_EQ(by_id["3b-on-8x40gb"].verdict.rfind("wrong", 0), 0u);
}

// The decision framework: "DDP or ZeRO-2 below 3B; FSDP full shard for 7-13B (hybrid across nodes);
// hybrid sharding + checkpointing (+TP) for 30-70B; TP inside a node x PP across nodes x DP beyond
// 100B", recomputed on 8-256 H100s with ~2M tokens per step. Where the planner's answer differs the
// test pins the difference documented in docs/plan.md.
class Bands : public testing::Test {
 protected:
  static void SetUpTestSuite() {
    cells_ = new std::vector<BandCell>(decision_bands(cluster_preset("h100-80g-ib400")));
  }
  static void TearDownTestSuite() {
    delete cells_;
    cells_ = nullptr;
  }
  static std::vector<const BandCell*> model(const std::string& name) {
    std::vector<const BandCell*> v;
    for (const auto& c : *cells_)
      if (c.model == name) v.push_back(&c);
    return v;
  }
  static std::vector<BandCell>* cells_;
};
std::vector<BandCell>* Bands::cells_ = nullptr;

TEST_F(Bands, OneBillionIsPlainDataParallel) {
  for (const BandCell* c : model("llama3.2-1b")) {
    const Layout& l = c->top.layout;
    ASSERT_TRUE(c->any_fits);
    EXPECT_EQ(l.tp, 1) << c->gpus;
    EXPECT_EQ(l.pp, 1) << c->gpus;
    EXPECT_EQ(l.checkpointing, Checkpointing::None) << c->gpus;
    // Article: DDP or ZeRO-2. Agrees up to 64 GPUs; from 128 GPUs (2 sequences per GPU) the
    // unsharded Adam step of DDP (28 bytes per parameter through HBM on every GPU) costs more than
    // ZeRO-3's hidden gathers, and the planner switches (documented deviation).
    if (c->gpus <= 64) {
      EXPECT_TRUE(l.strategy == Strategy::NoShard || l.strategy == Strategy::Zero1 || l.strategy == Strategy::ShardGradOp)
          << c->gpus << " " << l.describe();
    }
  }
}

TEST_F(Bands, SevenToThirteenBillionShardWithoutModelParallelism) {
  for (const char* name : {"llama2-7b", "llama2-13b"})
    for (const BandCell* c : model(name)) {
      const Layout& l = c->top.layout;
      ASSERT_TRUE(c->any_fits);
      EXPECT_NE(l.strategy, Strategy::NoShard) << name << " " << c->gpus;  // 16 B/param does not fit 80 GB
      EXPECT_EQ(l.tp, 1) << name << " " << c->gpus;
      EXPECT_EQ(l.pp, 1) << name << " " << c->gpus;
      // Article: full shard. Agrees from 64 GPUs; on 8-16 GPUs each GPU accumulates many micro-batches
      // and ZeRO-1/2 (one reduction per step) beat ZeRO-3's per-micro-batch gathers.
      if (c->gpus >= 64) {
        EXPECT_TRUE(l.strategy == Strategy::FullShard || l.strategy == Strategy::HybridShard) << name << " " << l.describe();
      }
    }
}

TEST_F(Bands, SeventyBillionNeedsShardingPlusTensorParallelOrCheckpointing) {
  for (const BandCell* c : model("llama3-70b")) {
    const Layout& l = c->top.layout;
    ASSERT_TRUE(c->any_fits) << c->gpus;
    EXPECT_NE(l.strategy, Strategy::NoShard);
    // Article: HSDP + checkpointing (+TP). The planner picks full sharding with TP inside the node:
    // TP+SP divides activations by t instead of paying checkpointing's recompute, and full-shard
    // collectives hide behind compute on 400 Gb/s; below 64 GPUs it also offloads the optimizer.
    EXPECT_TRUE(l.tp > 1 || l.checkpointing != Checkpointing::None) << l.describe();
    EXPECT_LE(l.tp, 8);
    if (c->gpus >= 64) {
      EXPECT_FALSE(l.offload_optimizer()) << l.describe();
    }
  }
}

TEST_F(Bands, HundredsOfBillionsUseModelParallelism) {
  for (const char* name : {"gpt3-175b", "llama3-405b"})
    for (const BandCell* c : model(name)) {
      if (!c->any_fits) {
        EXPECT_LE(c->gpus, 16) << name;  // 2.8 / 6.5 TB of model state
        continue;
      }
      const Layout& l = c->top.layout;
      // Model parallelism or full sharding: no replica of the whole model state on a GPU.
      const bool sharded = l.strategy == Strategy::FullShard || l.strategy == Strategy::HybridShard;
      EXPECT_TRUE(l.tp > 1 || l.pp > 1 || sharded) << name << " " << c->gpus << ": " << l.describe();
      EXPECT_LE(l.tp, 8);
      // Article: TP x PP x DP. Agrees for GPT-3 175B on 64 GPUs (tp x pp); from 128 GPUs the
      // planner prefers full sharding with selective checkpointing: sequence-parallel TP pays ten
      // activation collectives per layer (the engine's count, checked by plan --validate), exposed
      // because the planner assumes no TP overlap. For 405B with 8k sequences it prefers full
      // sharding + TP + full checkpointing on 128-256 GPUs (no bubble).
      if (std::string(name) == "gpt3-175b" && c->gpus == 64) {
        EXPECT_GT(l.pp, 1) << l.describe();
      }
    }
}

}  // namespace
}  // namespace mt::plan
