// The planner's report of layouts that fit only with CPU offload of the optimizer state, and what
// offload costs per step against the same layout without it (the article's 70B on 4 x 80 GB).
#include <gtest/gtest.h>

#include <string>

#include "plan/planner.h"
#include "plan/report.h"

namespace mt::plan {
namespace {

Cluster cluster(const std::string& name, int gpus) {
  Cluster c = cluster_preset(name);
  c.gpus = gpus;
  return c;
}

// The article's example: 70B on 4 x 80 GB fits only fully sharded with offload, full activation
// checkpointing and short sequences (at 8192 tokens nothing fits even with offload).
TrainSetup short_sequences() {
  TrainSetup st;
  st.seq = 1024;
  st.global_batch = 64;
  return st;
}

TEST(OffloadPlan, SeventyBillionOnFourGpusFitsOnlyWithOffload) {
  const PlanResult r = plan(plan_model_preset("llama3-70b"), cluster("h100-80g-ib400", 4), short_sequences());
  ASSERT_GT(r.offload_only_count, 0);
  ASSERT_FALSE(r.offload_only.empty());
  for (const auto& [with, without] : r.offload_only) {
    EXPECT_TRUE(with.layout.offload_optimizer());
    EXPECT_FALSE(without.layout.offload_optimizer());
    EXPECT_TRUE(with.fits);
    EXPECT_FALSE(without.fits);
    // The same layout otherwise.
    EXPECT_EQ(with.layout.strategy, without.layout.strategy);
    EXPECT_EQ(with.layout.tp, without.layout.tp);
    EXPECT_EQ(with.layout.pp, without.layout.pp);
    EXPECT_EQ(with.layout.micro_batch, without.layout.micro_batch);
    EXPECT_EQ(with.layout.checkpointing, without.layout.checkpointing);
    // Offload frees the optimizer state on the GPU and costs the CPU step and the copies.
    EXPECT_LT(with.mem.total(), without.mem.total());
    EXPECT_GT(with.time.total(), without.time.total());
    EXPECT_GT(with.offload_s, 0.0);
  }
  // Nothing on 4 GPUs fits without offload, so the recommendation offloads.
  ASSERT_TRUE(r.candidates[0].fits);
  EXPECT_TRUE(r.candidates[0].layout.offload_optimizer());
  const std::string text = format_plan(r);
  EXPECT_NE(text.find("Fits only with CPU offload"), std::string::npos) << text;
  EXPECT_NE(plan_json(r).find("\"slowdown_vs_without_offload\""), std::string::npos);
}

TEST(OffloadPlan, NoneWhereEverythingFitsOrOffloadIsOff) {
  PlanOptions no;
  no.allow_offload = false;
  const PlanResult off = plan(plan_model_preset("llama3-70b"), cluster("h100-80g-ib400", 4), short_sequences(), no);
  EXPECT_EQ(off.offload_only_count, 0);
  EXPECT_TRUE(off.offload_only.empty());
  EXPECT_EQ(format_plan(off).find("Fits only with CPU offload"), std::string::npos);
  // A small model fits without offload in every layout that fits with it.
  const PlanResult small = plan(plan_model_preset("gpt2-124m"), cluster("h100-80g-ib400", 8), TrainSetup{});
  EXPECT_EQ(small.offload_only_count, 0);
}

}  // namespace
}  // namespace mt::plan
