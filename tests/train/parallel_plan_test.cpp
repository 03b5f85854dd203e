// The job's parallel plan read from the config (RunConfig::parallel_plan): degrees resolved against
// the world, the schedule, recompute and micro-batches filled in, and inconsistent degrees refused
// with one message naming the key at fault.
#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "train/config.h"

namespace mt {
namespace {

RunConfig config(const std::vector<std::pair<std::string, std::string>>& kv) {
  std::vector<std::pair<std::string, std::string>> all = {{"model.preset", "gpt2-tiny"}};
  all.insert(all.end(), kv.begin(), kv.end());
  return RunConfig::load("", all);
}

ParallelPlan plan_of(const std::vector<std::pair<std::string, std::string>>& kv, int world) {
  const RunConfig c = config(kv);
  return c.parallel_plan(c.model_config(), world);
}

// The message of the ConfigError the config raises (empty when it raises none).
std::string error_of(const std::vector<std::pair<std::string, std::string>>& kv, int world) {
  try {
    (void)plan_of(kv, world);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

TEST(ParallelPlanFromConfig, ResolvesTheDegreesScheduleAndRecompute) {
  const ParallelPlan p = plan_of({{"parallel.strategy", "HYBRID_SHARD"}, {"parallel.dp_replicate", "2"},
                                  {"parallel.pp", "2"}, {"parallel.pp_schedule", "interleaved_1f1b"},
                                  {"parallel.pp_virtual_stages", "2"}, {"parallel.pp_microbatches", "4"},
                                  {"train.micro_batch", "3"}, {"train.grad_accum", "2"},
                                  {"train.activation_checkpointing", "selective"}},
                                 16);
  EXPECT_EQ(p.strategy, ShardingStrategy::HybridShard);
  EXPECT_EQ(p.pp, 2);
  EXPECT_EQ(p.dp_replicate, 2);
  EXPECT_EQ(p.dp_shard, 4);  // -1: the ranks left over, 16 / (2 x 2)
  EXPECT_EQ(p.world(), 16);
  EXPECT_EQ(p.schedule, PipelineSchedule::Interleaved);
  EXPECT_EQ(p.virtual_stages, 2);
  EXPECT_EQ(p.microbatches, 4);  // the pipeline's micro-batches, not grad_accum
  EXPECT_EQ(p.micro_batch, 3);
  EXPECT_EQ(p.checkpointing, Recompute::Selective);
  EXPECT_EQ(p.offload, Offload::None);
  EXPECT_EQ(p.describe(), "HSDP dp_replicate=2 dp_shard=4 tp=1 pp=2 interleaved_1f1b(v=2) mb=3x4 ac=selective");

  const ParallelPlan one = plan_of({{"train.grad_accum", "3"}}, 4);
  EXPECT_EQ(one.dp_shard, 4);
  EXPECT_EQ(one.schedule, PipelineSchedule::None);  // no pipeline
  EXPECT_EQ(one.microbatches, 3);
}

TEST(ParallelPlanFromConfig, RefusesInconsistentDegreesWithOneMessage) {
  // tp x pp does not divide the world.
  const std::string mesh = error_of({{"parallel.tp", "2"}, {"parallel.pp", "3"}}, 8);
  EXPECT_EQ(mesh.rfind("parallel mesh: ", 0), 0u) << mesh;
  EXPECT_EQ(mesh.find('\n'), std::string::npos) << mesh;
  // Degrees that multiply to more than the world.
  EXPECT_EQ(error_of({{"parallel.dp_shard", "4"}, {"parallel.tp", "4"}}, 8).rfind("parallel mesh: ", 0), 0u);
  // Replicas without a hybrid strategy.
  EXPECT_EQ(error_of({{"parallel.dp_replicate", "2"}}, 4),
            "parallel.dp_replicate = 2 needs a HYBRID_* strategy (NO_SHARD shards or replicates over every "
            "data-parallel rank; set dp_shard instead)");
  // tp that does not divide the heads (gpt2-tiny has 2).
  EXPECT_EQ(error_of({{"parallel.tp", "3"}, {"parallel.dp_shard", "1"}}, 3),
            "model.n_head (2) must be divisible by parallel.tp (3)");
  EXPECT_EQ(error_of({{"parallel.pp_virtual_stages", "2"}}, 2), "parallel.pp_virtual_stages = 2 needs parallel.pp > 1");
  EXPECT_EQ(error_of({{"parallel.ep", "2"}}, 2),
            "parallel.ep = 2 needs a mixture-of-experts model (model.moe_experts > 0)");
  EXPECT_EQ(error_of({{"parallel.tp", "0"}}, 2), "parallel.tp must be >= 1, got 0");
  EXPECT_EQ(error_of({{"parallel.pp", "2"}, {"parallel.pp_schedule", "zigzag"}}, 2).rfind("pipeline: parallel.pp_schedule", 0),
            0u);
  EXPECT_EQ(error_of({{"parallel.pp_costs", "fast"}}, 2),
            "parallel.pp_costs must be three positive numbers F,B,W (e.g. \"1,1.3,0.7\") or auto, got 'fast'");
  EXPECT_EQ(error_of({{"parallel.pp_costs", "1,0,1"}}, 2).rfind("parallel.pp_costs must be", 0), 0u);
  EXPECT_EQ(error_of({{"parallel.pp_costs", "auto"}}, 2), "");
  EXPECT_EQ(error_of({}, 2), "");
}

}  // namespace
}  // namespace mt
