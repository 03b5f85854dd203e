// `train --auto`: the planner's layout for the ranks a job was given, in the engine's config terms.
#include <gtest/gtest.h>

#include <set>
#include <stdexcept>
#include <string>

#include "plan/auto_layout.h"
#include "plan/planner.h"

namespace mt::plan {
namespace {

const std::set<std::string> kEngineStrategies = {"NO_SHARD", "ZERO1", "SHARD_GRAD_OP", "FULL_SHARD", "HYBRID_SHARD"};

void expect_consistent(const AutoLayout& a, int world) {
  EXPECT_TRUE(kEngineStrategies.count(std::string(to_string(a.plan.strategy)))) << std::string(to_string(a.plan.strategy));
  EXPECT_EQ(a.plan.tp, 1);
  EXPECT_EQ(a.plan.pp, 1);
  EXPECT_EQ(a.plan.dp_replicate * a.plan.dp_shard, world);
  if (std::string(to_string(a.plan.strategy)) != "HYBRID_SHARD") {
    EXPECT_EQ(a.plan.dp_replicate, 1) << "the engine replicates only for HYBRID_*";
  } else {
    EXPECT_GE(a.plan.dp_replicate, 2);
  }
  EXPECT_GE(a.plan.micro_batch, 1);
  EXPECT_GE(a.plan.microbatches, 1);
  EXPECT_EQ(a.plan.micro_batch * a.plan.microbatches * world, a.global_batch);
  EXPECT_TRUE(std::string(to_string(a.plan.checkpointing)) == "none" || std::string(to_string(a.plan.checkpointing)) == "selective" ||
              std::string(to_string(a.plan.checkpointing)) == "full");
  EXPECT_FALSE(a.estimate.layout.offload_optimizer());
  EXPECT_FALSE(a.why.empty());
}

TEST(AutoLayout, SmallModelOnThisMachine) {
  const ModelConfig m = model_preset("gpt2-mini");
  const AutoLayout a = auto_layout(m, 2, 2, 4 * 128 * 2);
  expect_consistent(a, 2);
  EXPECT_TRUE(a.fits);
  EXPECT_EQ(a.global_batch, 8);  // 1024 tokens / 128 per sequence
}

TEST(AutoLayout, GlobalBatchRoundsUpToWholeSequencesPerRank) {
  const ModelConfig m = model_preset("gpt2-mini");
  EXPECT_EQ(auto_layout(m, 4, 4, 100).global_batch, 4);         // one sequence per rank at least
  EXPECT_EQ(auto_layout(m, 4, 4, 5 * 128).global_batch, 8);     // 5 sequences -> 8
  AutoLayoutOptions o;
  o.micro_batch = 3;
  const AutoLayout a = auto_layout(m, 2, 2, 7 * 128, o);        // 7 -> multiple of 2 x 3
  EXPECT_EQ(a.global_batch, 12);
  EXPECT_EQ(a.plan.micro_batch, 3);
  EXPECT_EQ(a.plan.microbatches, 2);
  expect_consistent(a, 2);
}

TEST(AutoLayout, PinnedStrategyAndCheckpointingAreKept) {
  const ModelConfig m = model_preset("gpt2-mini");
  AutoLayoutOptions o;
  o.strategy = Strategy::NoShard;
  AutoLayout a = auto_layout(m, 2, 2, 1024, o);
  EXPECT_EQ(std::string(to_string(a.plan.strategy)), "NO_SHARD");
  EXPECT_EQ(a.plan.dp_replicate, 1);  // DDP over every rank: dp_shard = world in the engine's mesh
  EXPECT_EQ(a.plan.dp_shard, 2);
  o.strategy = Strategy::FullShard;
  o.checkpointing = Checkpointing::Full;
  a = auto_layout(m, 4, 4, 2048, o);
  EXPECT_EQ(std::string(to_string(a.plan.strategy)), "FULL_SHARD");
  EXPECT_EQ(std::string(to_string(a.plan.checkpointing)), "full");
  EXPECT_EQ(a.plan.dp_shard, 4);
  expect_consistent(a, 4);
}

TEST(AutoLayout, OneRank) {
  const ModelConfig m = model_preset("gpt2-mini");
  AutoLayout a = auto_layout(m, 1, 1, 512);
  EXPECT_EQ(std::string(to_string(a.plan.strategy)), "NO_SHARD");
  expect_consistent(a, 1);
  AutoLayoutOptions o;
  o.strategy = Strategy::FullShard;  // kept: the engine runs a shard group of one
  a = auto_layout(m, 1, 1, 512, o);
  EXPECT_EQ(std::string(to_string(a.plan.strategy)), "FULL_SHARD");
  EXPECT_EQ(a.plan.dp_shard, 1);
}

TEST(AutoLayout, NeverUsesTensorOrPipelineParallelism) {
  // Unrestricted, the planner puts Llama 3 70B on 64 H100s with tp 4; the engine cannot run that.
  AutoLayoutOptions o;
  o.cluster = "h100-80g-ib400";
  o.fp32 = false;
  const ModelConfig m = model_preset("llama3-70b");
  Cluster c = cluster_preset("h100-80g-ib400");
  c.gpus = 64;
  TrainSetup st;
  st.global_batch = 512;
  st.grad_bytes = 4;
  const PlanResult free = plan(m, c, st);
  ASSERT_FALSE(free.candidates.empty());
  EXPECT_GT(free.candidates[0].layout.tp * free.candidates[0].layout.pp, 1);
  const AutoLayout a = auto_layout(m, 64, 8, 512 * 8192, o);
  expect_consistent(a, 64);
  EXPECT_TRUE(a.fits);
  EXPECT_TRUE(std::string(to_string(a.plan.strategy)) == "FULL_SHARD" || std::string(to_string(a.plan.strategy)) == "HYBRID_SHARD") << std::string(to_string(a.plan.strategy));
}

TEST(AutoLayout, HybridMapsToReplicateTimesShard) {
  AutoLayoutOptions o;
  o.cluster = "h100-80g-roce100";
  o.fp32 = false;
  o.strategy = Strategy::HybridShard;
  const AutoLayout a = auto_layout(model_preset("llama3-8b"), 16, 8, 1 << 21, o);
  EXPECT_EQ(std::string(to_string(a.plan.strategy)), "HYBRID_SHARD");
  EXPECT_GE(a.plan.dp_shard, 2);
  expect_consistent(a, 16);
}

TEST(AutoLayout, AgreesWithThePlannerRestrictedToTheEngine) {
  const ModelConfig m = model_preset("gpt2-124m");
  const AutoLayout a = auto_layout(m, 2, 2, 16 * 1024);
  Cluster c = cluster_preset("this-cpu");
  c.gpus = 2;
  TrainSetup st;
  st.fp32 = true;
  st.grad_bytes = 4;
  st.global_batch = 16;
  st.bucket_bytes = 25e6;
  PlanOptions po;
  po.tp = po.pp = 1;
  po.allow_offload = false;
  const PlanResult r = plan(m, c, st, po);
  ASSERT_FALSE(r.candidates.empty());
  EXPECT_EQ(a.estimate.layout.describe(), r.candidates[0].layout.describe());
  EXPECT_DOUBLE_EQ(a.estimate.time.total(), r.candidates[0].time.total());
}

CpuMeasurement sample_cpu(double model_gflops) {
  CpuMeasurement m;
  m.description = "test machine";
  m.ranks_per_node = 2;
  m.peak_flops_fp32 = 100e9;
  m.peak_flops_bf16 = 200e9;
  m.model_flops = model_gflops * 1e9;
  m.model_flops_bf16 = true;
  m.mem_bw = 20e9;
  m.node_mem = 16 * GiB;
  return m;
}

TEST(AutoLayout, MeasuredCpuClusterIsPerRankAndFollowsTheMeasurement) {
  const Cluster c = measured_cpu_cluster(sample_cpu(80));
  EXPECT_EQ(c.device, "rank");
  EXPECT_FALSE(c.shared_node);
  EXPECT_EQ(c.gpus_per_node, 2);
  EXPECT_DOUBLE_EQ(c.mem_per_gpu, 8 * GiB);
  EXPECT_DOUBLE_EQ(c.compute_efficiency, 0.4);  // 80 of the 200 GFLOP/s bf16 peak
  EXPECT_DOUBLE_EQ(c.peak_flops(false) * c.compute_efficiency, 80e9);
  EXPECT_EQ(c.description, "test machine");
  EXPECT_NO_THROW(c.validate());
  CpuMeasurement bad = sample_cpu(80);
  bad.mem_bw = 0;
  EXPECT_THROW(measured_cpu_cluster(bad), std::invalid_argument);

  // --auto with a measured cluster: twice the measured rate, about half the predicted compute time
  // (the optimizer's streaming and the per-kernel overhead do not change); the sentences speak of
  // ranks.
  AutoLayoutOptions o;
  o.fp32 = false;
  o.cluster_model = measured_cpu_cluster(sample_cpu(40));
  const AutoLayout slow = auto_layout(model_preset("gpt2-mini"), 2, 2, 32 * 128, o);
  o.cluster_model = measured_cpu_cluster(sample_cpu(80));
  const AutoLayout fast = auto_layout(model_preset("gpt2-mini"), 2, 2, 32 * 128, o);
  ASSERT_EQ(slow.estimate.layout.describe(), fast.estimate.layout.describe());
  const double ratio = slow.estimate.time.compute / fast.estimate.time.compute;
  EXPECT_GT(ratio, 1.8);
  EXPECT_LE(ratio, 2.0 + 1e-9);
  EXPECT_NE(fast.why.find("usable per rank"), std::string::npos) << fast.why;
  EXPECT_EQ(fast.why.find("GPU"), std::string::npos) << fast.why;
}

TEST(AutoLayout, ReportsWhenNothingFits) {
  // GPT-2 1.5B in fp32 needs 16 bytes x 1.56e9 of model state: more than this machine's 23 GiB.
  const AutoLayout a = auto_layout(model_preset("gpt2-1.5b"), 2, 2, 8 * 1024);
  EXPECT_FALSE(a.fits);
  EXPECT_NE(a.why.find("Nothing fits"), std::string::npos) << a.why;
  expect_consistent(a, 2);
}

TEST(AutoLayout, RejectsBadInput) {
  const ModelConfig m = model_preset("gpt2-mini");
  EXPECT_THROW(auto_layout(m, 0, 1, 1024), std::invalid_argument);
  EXPECT_THROW(auto_layout(m, 2, 0, 1024), std::invalid_argument);
  EXPECT_THROW(auto_layout(m, 2, 2, 0), std::invalid_argument);
  AutoLayoutOptions o;
  o.cluster = "no-such-cluster";
  EXPECT_THROW(auto_layout(m, 2, 2, 1024, o), std::invalid_argument);
  o = {};
  o.strategy = Strategy::HybridShard;
  EXPECT_THROW(auto_layout(m, 1, 1, 1024, o), std::invalid_argument);
  EXPECT_THROW(auto_layout(m, 3, 3, 3 * 128, o), std::invalid_argument);  // 3 ranks: no 2 x 2 split
}

}  // namespace
}  // namespace mt::plan
