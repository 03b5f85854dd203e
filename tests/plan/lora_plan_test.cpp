// The planner's LoRA model (--lora-rank): the frozen base costs its compute-dtype weights only,
// gradients and optimizer state are the adapters' (as the engine keeps them, docs/finetuning.md),
// against the same layout's full fine-tuning estimate; LoRA makes Llama 3 8B fit on one GPU and 70B
// on eight without offload; no layout with tensor parallelism (the planner does not model it with LoRA).
#include <gtest/gtest.h>

#include <string>

#include "plan/planner.h"

namespace mt::plan {
namespace {

Cluster cluster(int gpus) {
  Cluster c = cluster_preset("h100-80g-ib400");
  c.gpus = gpus;
  return c;
}

ModelConfig with_lora(ModelConfig m) {
  m.lora_rank = 16;
  m.lora_targets = parse_lora_targets("q,k,v,o,gate,up,down", m.arch);
  return m;
}

TEST(LoraPlan, StateIsTheAdaptersAndTheBaseStaysInTheComputeDtype) {
  const ModelConfig full = plan_model_preset("llama3-8b"), lora = with_lora(full);
  const double adapters = static_cast<double>(lora.n_layer * lora.lora_block_params());
  ASSERT_GT(adapters, 0.0);
  TrainSetup st;
  st.seq = 2048;
  st.global_batch = 8;
  for (ShardingStrategy s : {ShardingStrategy::NoShard, ShardingStrategy::Zero1, ShardingStrategy::ShardGradOp,
                             ShardingStrategy::FullShard}) {
    Layout l;
    l.strategy = s;
    l.dp_shard = s == ShardingStrategy::NoShard ? 1 : 8;
    l.dp_replicate = s == ShardingStrategy::NoShard ? 8 : 1;
    l.micro_batch = 1;
    l.checkpointing = Recompute::Full;
    const Estimate f = estimate(full, cluster(8), st, l), a = estimate(lora, cluster(8), st, l);
    const std::string what = to_string(s);
    // The weights: the base and the adapters in the compute dtype, as full fine-tuning's per parameter.
    EXPECT_NEAR(a.mem.params / a.psi_stage, f.mem.params / f.psi_stage, 1e-9) << what;
    // Gradients and optimizer state: full fine-tuning's per parameter, for the adapters alone.
    EXPECT_NEAR(a.mem.grads / adapters, f.mem.grads / f.psi_stage, 1e-9) << what;
    EXPECT_NEAR(a.mem.optimizer / adapters, f.mem.optimizer / f.psi_stage, 1e-9) << what;
    EXPECT_LT(a.mem.grads + a.mem.optimizer, 0.01 * (f.mem.grads + f.mem.optimizer)) << what;
    // The gradient collectives move the adapters: far fewer bytes on the dp group.
    EXPECT_LT(a.group_bytes.dp, f.group_bytes.dp) << what;
  }
}

TEST(LoraPlan, EightBOnOneGpuAndSeventyBOnEightFitWithoutOffload) {
  PlanOptions no_offload;
  no_offload.allow_offload = false;
  const PlanResult f8 = plan(plan_model_preset("llama3-8b"), cluster(1), TrainSetup{}, no_offload);
  const PlanResult a8 = plan(with_lora(plan_model_preset("llama3-8b")), cluster(1), TrainSetup{}, no_offload);
  ASSERT_FALSE(f8.candidates.empty());
  ASSERT_FALSE(a8.candidates.empty());
  EXPECT_FALSE(f8.candidates[0].fits) << "full fine-tuning of 8B does not fit one GPU";
  EXPECT_TRUE(a8.candidates[0].fits) << "LoRA does";
  const PlanResult a70 = plan(with_lora(plan_model_preset("llama3-70b")), cluster(8), TrainSetup{}, no_offload);
  ASSERT_FALSE(a70.candidates.empty());
  EXPECT_TRUE(a70.candidates[0].fits);
  for (const Estimate& e : a70.candidates) EXPECT_EQ(e.layout.tp, 1) << "LoRA with tp > 1 is not modelled";
}

}  // namespace
}  // namespace mt::plan
