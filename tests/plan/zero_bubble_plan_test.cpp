// The planner's costing of the zero-bubble schedules: bubble and activation memory against 1F1B
// and interleaved 1F1B, and the layout search choosing among them.
#include <gtest/gtest.h>

#include "plan/cost_model.h"
#include "plan/planner.h"

namespace mt::plan {
namespace {

Layout pp_layout(Schedule s, int pp, int v, int64_t m) {
  Layout l;
  l.strategy = Strategy::NoShard;
  l.dp_replicate = 1;
  l.pp = pp;
  l.schedule = s;
  l.virtual_stages = v;
  l.micro_batch = 1;
  l.microbatches = m;
  return l;
}

TEST(ZeroBubblePlan, BubbleShrinksAndActivationsStayWithinTheirReferences) {
  const ModelConfig m = model_preset("llama3-8b");
  Cluster c = cluster_preset("h100-80g-ib400");
  c.gpus = 4;
  const TrainSetup st;
  const Estimate f1b = estimate(m, c, st, pp_layout(Schedule::OneFOneB, 4, 1, 8));
  const Estimate il = estimate(m, c, st, pp_layout(Schedule::Interleaved, 4, 2, 8));
  const Estimate h1 = estimate(m, c, st, pp_layout(Schedule::ZeroBubbleH1, 4, 1, 8));
  const Estimate zv = estimate(m, c, st, pp_layout(Schedule::ZeroBubbleV, 4, 2, 8));
  ASSERT_GT(f1b.time.bubble, 0);
  EXPECT_LT(h1.time.bubble, 0.5 * f1b.time.bubble);
  EXPECT_LT(zv.time.bubble, 0.55 * h1.time.bubble);  // half, plus the second chunk's messages
  // Same micro-batches in flight as 1F1B, plus the copies held from B to W (the fp32 output
  // gradients make them larger than a layer's saved activations at this width).
  EXPECT_GT(h1.mem.activations, f1b.mem.activations);
  EXPECT_LT(h1.mem.activations, 4.0 * f1b.mem.activations);
  EXPECT_NEAR(zv.mem.activations / h1.mem.activations, 1.0, 0.05);
  EXPECT_GT(il.mem.activations, f1b.mem.activations);
  EXPECT_TRUE(check_layout(m, c, st, pp_layout(Schedule::ZeroBubbleV, 4, 2, 8)).empty());
  EXPECT_FALSE(check_layout(m, c, st, pp_layout(Schedule::ZeroBubbleV, 4, 1, 8)).empty());
}

}  // namespace
}  // namespace mt::plan
