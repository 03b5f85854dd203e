// The parallel configuration's vocabulary: every value prints as its config spelling and parses
// back, and a bad value's error names the key and lists the valid values.
#include "parallel/layout/parallel_config.h"

#include <gtest/gtest.h>

#include <set>
#include <stdexcept>
#include <string>

namespace mt {
namespace {

template <class F>
std::string error_of(F f) {
  try {
    f();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(ParallelConfig, ShardingStrategyRoundTrips) {
  const std::vector<std::string> spellings = {"NO_SHARD",     "ZERO1",        "SHARD_GRAD_OP",
                                              "FULL_SHARD",   "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"};
  ASSERT_EQ(all_sharding_strategies().size(), spellings.size());
  for (size_t i = 0; i < spellings.size(); ++i) {
    const ShardingStrategy s = all_sharding_strategies()[i];
    EXPECT_EQ(to_string(s), spellings[i]);
    EXPECT_EQ(parse_sharding_strategy(spellings[i]), s);
    EXPECT_TRUE(try_parse_sharding_strategy(to_string(s)) == s);
  }
  EXPECT_EQ(valid_values(ShardingStrategy{}),
            "NO_SHARD, ZERO1, SHARD_GRAD_OP, FULL_SHARD, HYBRID_SHARD, HYBRID_SHARD_ZERO2");
  EXPECT_FALSE(try_parse_sharding_strategy("full_shard"));  // exact spelling only
  EXPECT_FALSE(try_parse_sharding_strategy(""));
}

TEST(ParallelConfig, PipelineScheduleAndRecomputeRoundTrip) {
  std::set<std::string> seen;
  for (PipelineSchedule s : all_pipeline_schedules()) {
    EXPECT_EQ(parse_pipeline_schedule(to_string(s)), s);
    seen.insert(to_string(s));
  }
  EXPECT_EQ(seen, (std::set<std::string>{"gpipe", "1f1b", "interleaved_1f1b", "zb1p", "zbv"}));
  // "none" (no pipeline) prints but is not a value of parallel.pp_schedule.
  EXPECT_STREQ(to_string(PipelineSchedule::None), "none");
  EXPECT_FALSE(try_parse_pipeline_schedule("none"));
  EXPECT_EQ(valid_values(PipelineSchedule{}), "gpipe, 1f1b, interleaved_1f1b, zb1p, zbv");

  seen.clear();
  for (Recompute r : all_recompute_modes()) {
    EXPECT_EQ(parse_recompute(to_string(r)), r);
    seen.insert(to_string(r));
  }
  EXPECT_EQ(seen, (std::set<std::string>{"none", "full", "selective"}));
  EXPECT_EQ(valid_values(Recompute{}), "none, full, selective");
}

TEST(ParallelConfig, BadValueErrorNamesTheKeyAndListsTheValues) {
  EXPECT_EQ(error_of([] { parse_sharding_strategy("FSDP"); }),
            "parallel.strategy must be one of NO_SHARD, ZERO1, SHARD_GRAD_OP, FULL_SHARD, HYBRID_SHARD, "
            "HYBRID_SHARD_ZERO2; got 'FSDP'");
  EXPECT_EQ(error_of([] { parse_pipeline_schedule("zigzag"); }),
            "parallel.pp_schedule must be one of gpipe, 1f1b, interleaved_1f1b, zb1p, zbv; got 'zigzag'");
  EXPECT_EQ(error_of([] { parse_recompute("some"); }),
            "train.activation_checkpointing must be one of none, full, selective; got 'some'");
  // The key is the caller's.
  EXPECT_EQ(error_of([] { parse_recompute("x", "--ac"); }), "--ac must be one of none, full, selective; got 'x'");
}

TEST(ParallelConfig, StrategyPredicates) {
  using S = ShardingStrategy;
  for (S s : all_sharding_strategies()) {
    EXPECT_EQ(is_sharded(s), s != S::NoShard) << to_string(s);
    EXPECT_EQ(is_hybrid(s), std::string(to_string(s)).rfind("HYBRID", 0) == 0) << to_string(s);
    EXPECT_EQ(shards_parameters(s), s == S::FullShard || s == S::HybridShard) << to_string(s);
    EXPECT_EQ(shards_gradients(s), s != S::NoShard && s != S::Zero1) << to_string(s);
  }
}

}  // namespace
}  // namespace mt
