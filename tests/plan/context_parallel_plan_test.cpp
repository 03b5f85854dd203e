// The planner's context parallelism (docs/context_parallel.md, docs/plan.md): activations per GPU
// fall by cp, the cp ranks shard the model state with the data-parallel ranks, the ring's bytes are
// the engine's formula, and `plan` tries cp at long sequences only (or when pinned).
#include <gtest/gtest.h>

#include "plan/cost_model.h"
#include "plan/planner.h"

namespace mt::plan {
namespace {

Cluster cluster(const std::string& name, int gpus) {
  Cluster c = cluster_preset(name);
  c.gpus = gpus;
  return c;
}

Layout layout(Strategy s, int dp_shard, int cp, Checkpointing ac = Checkpointing::None) {
  Layout l;
  l.strategy = s;
  l.dp_shard = dp_shard;
  l.cp = cp;
  l.micro_batch = 1;
  l.microbatches = 2;
  l.checkpointing = ac;
  return l;
}

TEST(ContextParallelPlan, ActivationsFallByCpAndTheCpRanksShard) {
  const ModelConfig m = model_preset("llama3-8b");
  const Cluster c = cluster("h100-80g-ib400", 16);
  TrainSetup st;
  st.seq = 65536;
  const Estimate base = estimate(m, c, st, layout(Strategy::FullShard, 4, 1));
  for (int cp : {2, 4}) {
    const Estimate e = estimate(m, c, st, layout(Strategy::FullShard, 4, cp));
    EXPECT_EQ(e.world, 4 * cp);
    EXPECT_NEAR(e.mem.activations, base.mem.activations / cp, 1e-6 * base.mem.activations) << "cp " << cp;
    // FULL_SHARD over dp_shard x cp: the model state per GPU is 16 psi / (4 cp).
    EXPECT_NEAR(e.mem.params + e.mem.grads + e.mem.optimizer,
                (base.mem.params + base.mem.grads + base.mem.optimizer) / cp, 1.0);
    EXPECT_GT(e.cp_comm_s, 0.0);
    EXPECT_LE(e.cp_exposed_s, e.cp_comm_s);
  }
  EXPECT_EQ(base.group_bytes.cp, 0.0);
}

TEST(ContextParallelPlan, RingBytesAreTheEnginesFormula) {
  const ModelConfig m = model_preset("llama3-8b");  // 32 layers, 8 kv heads of 128
  const Cluster c = cluster("h100-80g-ib400", 8);
  TrainSetup st;
  st.seq = 32768;
  for (Checkpointing ac : {Checkpointing::None, Checkpointing::Full})
    for (int cp : {2, 4, 8}) {
      const Estimate e = estimate(m, c, st, layout(Strategy::Zero1, 8 / cp, cp, ac));
      const double block = 32768.0 / cp * 2 * 8 * 128 * 4;  // fp32 K and V of a rank's tokens
      const double sends = 32.0 * (cp - 1) * (ac == Checkpointing::Full ? 4 : 3);
      EXPECT_DOUBLE_EQ(e.group_bytes.cp, 2 * 2 * sends * block) << "cp " << cp;  // 2 micro-batches, send + receive
    }
}

TEST(ContextParallelPlan, RefusesSequencesThatDoNotSplit) {
  const ModelConfig m = model_preset("llama3-8b");
  TrainSetup st;
  st.seq = 6004;  // not a multiple of 8
  EXPECT_NE(check_layout(m, cluster("h100-80g-ib400", 8), st, layout(Strategy::Zero1, 2, 4)).find("divisible by 2 x cp"),
            std::string::npos);
}

TEST(ContextParallelPlan, PlanTriesCpAtLongSequencesOnly) {
  const ModelConfig m = model_preset("llama3-8b");
  const Cluster c = cluster("h100-80g-ib400", 16);
  PlanOptions o;
  o.top_k = 0;
  TrainSetup st;
  st.seq = 8192;
  for (const Estimate& e : plan(m, c, st, o).candidates) EXPECT_EQ(e.layout.cp, 1);
  st.seq = 131072;
  const PlanResult r = plan(m, c, st, o);
  bool any_cp = false;
  for (const Estimate& e : r.candidates) any_cp |= e.layout.cp > 1;
  EXPECT_TRUE(any_cp);
  // At 128K tokens one GPU cannot hold a sequence's activations: the best layout uses cp.
  EXPECT_GT(r.candidates.at(0).layout.cp, 1);
  EXPECT_TRUE(r.candidates.at(0).fits);
  o.cp = 4;
  for (const Estimate& e : plan(m, c, st, o).candidates) EXPECT_EQ(e.layout.cp, 4);
}

}  // namespace
}  // namespace mt::plan
