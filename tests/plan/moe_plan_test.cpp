// The planner's mixture-of-experts model: presets (total vs active parameters), expert
// parallelism's memory split, the all-to-all volume, and the search over ep.
#include <gtest/gtest.h>

#include <cmath>

#include "plan/cost_model.h"
#include "plan/planner.h"

namespace mt::plan {
namespace {

TEST(MoePlan, PresetsHaveTheirPublishedSizes) {
  const ModelConfig m = model_preset("mixtral-8x7b");
  // mistralai/Mixtral-8x7B-v0.1: 46,702,792,704 parameters; 12.9B active per token.
  EXPECT_NEAR(static_cast<double>(m.num_params()), 46.7028e9, 0.001e9);
  EXPECT_NEAR(static_cast<double>(m.active_params()), 12.88e9, 0.01e9);
  const ModelConfig d = model_preset("deepseek-v3-like");
  EXPECT_GT(d.num_params(), 650e9);  // DeepSeek-V3: 671B total, 37B active (MLA attention not modelled)
  EXPECT_LT(d.num_params(), 720e9);
  EXPECT_GT(d.active_params(), 35e9);
  EXPECT_LT(d.active_params(), 42e9);
  // FLOPs follow the active parameters.
  EXPECT_NEAR(flops_per_token(m, 4096), 6.0 * (m.active_params() - 32000.0 * 4096) + 12.0 * 32 * 4096 * 4096, 1e6);
}

TEST(MoePlan, ExpertParallelismSplitsTheExpertsAndMovesTokens) {
  const ModelConfig m = model_preset("mixtral-8x7b");
  Cluster c = cluster_preset("h100-80g-ib400");
  c.gpus = 8;
  TrainSetup st;
  st.seq = 4096;
  Layout l;
  l.strategy = Strategy::FullShard;
  l.dp_shard = 8;
  l.micro_batch = 1;
  l.microbatches = 2;
  l.checkpointing = Checkpointing::Full;
  const Estimate one = estimate(m, c, st, l);
  l.ep = 8;
  const Estimate eight = estimate(m, c, st, l);
  const double experts = 32.0 * 8 * m.expert_params();
  EXPECT_NEAR(one.psi_experts, experts, 1);
  EXPECT_NEAR(eight.psi_experts, experts / 8, 1);
  // ep = 1: the experts are ZeRO-3 sharded with the rest (16 B/param / 8); ep = 8: each GPU keeps
  // its 1/8 of the experts whole (DDP over the single rank holding them), the rest still sharded.
  const double dense = one.psi_stage - experts;
  EXPECT_NEAR(one.mem.params + one.mem.grads + one.mem.optimizer, 16.0 * (dense + experts) / 8, 1e3);
  EXPECT_NEAR(eight.mem.params + eight.mem.grads + eight.mem.optimizer, 16.0 * dense / 8 + 16.0 * experts / 8, 1e3);
  // All-to-all: per MoE layer and micro-batch, 7/8 of the 2 x 4096 token choices' rows of 4096
  // values leave the GPU four times (bf16 input rows, fp32 outputs and gradients) and full
  // recompute repeats the forward two.
  EXPECT_EQ(one.group_bytes.ep, 0.0);
  const double rows = 2.0 * 4096 * 7 / 8;
  EXPECT_NEAR(eight.group_bytes.ep, 2.0 * 32 * rows * 4096 * (2 + 4 + 4 + 4 + (2 + 4)), 1e3);
  EXPECT_GT(eight.ep_comm_s, 0.0);
  EXPECT_NE(eight.layout.describe().find("ep=8"), std::string::npos);
  // With tp every tp rank routes all the micro-batch's tokens, with sequence parallelism as well
  // (the MoE layer gathers its input over tp): the same rows leave each rank.
  l.tp = 2;
  l.dp_shard = 4;
  l.ep = 4;
  st.sequence_parallel = false;
  const Estimate tp2 = estimate(m, c, st, l);
  st.sequence_parallel = true;
  const Estimate tp2sp = estimate(m, c, st, l);
  EXPECT_NEAR(tp2.group_bytes.ep, 2.0 * 32 * (2.0 * 4096 * 3 / 4) * 4096 * (2 + 4 + 4 + 4 + (2 + 4)), 1e3);
  EXPECT_EQ(tp2sp.group_bytes.ep, tp2.group_bytes.ep);
  // Padded to a capacity: E x ceil(factor x tokens x k / E) rows per micro-batch, whatever the
  // routing (capacity ceil(1.25 x 4096 x 2 / 8) = 1280 rows of each of 8 experts).
  ModelConfig mp = m;
  mp.moe_capacity_factor = 1.25f;
  mp.moe_pad_to_capacity = true;
  const Estimate padded = estimate(mp, c, st, l);
  EXPECT_NEAR(padded.group_bytes.ep, tp2.group_bytes.ep * (8.0 * 1280) / (2.0 * 4096), 1e3);
  EXPECT_GT(padded.mem.activations, tp2sp.mem.activations);  // the same setup, sequence parallel
  EXPECT_GT(padded.time.compute, tp2sp.time.compute);
  mp.moe_pad_to_capacity = false;  // a capacity alone changes nothing the planner models (drops are not)
  EXPECT_EQ(estimate(mp, c, st, l).group_bytes.ep, tp2.group_bytes.ep);
}

TEST(MoePlan, TheSearchTriesExpertParallelismForMoeModelsOnly) {
  Cluster c = cluster_preset("h100-80g-ib400");
  c.gpus = 16;
  TrainSetup st;
  st.global_batch = 64;
  st.seq = 4096;
  PlanOptions o;
  o.top_k = 0;
  bool saw_ep = false;
  for (const Estimate& e : plan(model_preset("mixtral-8x7b"), c, st, o).candidates) saw_ep |= e.layout.ep > 1;
  EXPECT_TRUE(saw_ep);
  for (const Estimate& e : plan(model_preset("llama3-8b"), c, st, o).candidates) EXPECT_EQ(e.layout.ep, 1);
  // Context parallelism composes with MoE (with and without ep), but not with a capacity factor
  // (the engine refuses it: drops would depend on which chunks a cp rank sees).
  o.cp_min_seq = 4096;
  ModelConfig m = model_preset("mixtral-8x7b");
  bool saw_cp_ep = false;
  for (const Estimate& e : plan(m, c, st, o).candidates) saw_cp_ep |= e.layout.cp > 1 && e.layout.ep > 1;
  EXPECT_TRUE(saw_cp_ep);
  m.moe_capacity_factor = 1.25f;
  for (const Estimate& e : plan(m, c, st, o).candidates) EXPECT_EQ(e.layout.cp, 1);
}

}  // namespace
}  // namespace mt::plan
