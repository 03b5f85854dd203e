// The vocabulary of the parallel configuration: the sharding strategy (parallel.strategy), the
// pipeline schedule (parallel.pp_schedule) and activation recomputation
// (train.activation_checkpointing), as enums with one spelling each. The config, the trainer, the
// strategies, the model and the planner all branch on these enums; the strings exist only at the
// edges (config files, command lines, printed text, metrics), produced by to_string and read by the
// parse functions below. Part of the layout library (mt_layout: no MPI, no kernels), so the
// planner uses it without the engine.
#pragma once
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace mt {

// parallel.strategy. The numbering of the first five is the planner's ranking (DDP 0 .. HSDP 4).
enum class ShardingStrategy {
  NoShard,          // NO_SHARD: DDP, full replicas
  Zero1,            // ZERO1: optimizer state sharded
  ShardGradOp,      // SHARD_GRAD_OP: ZeRO-2, optimizer state and gradients sharded
  FullShard,        // FULL_SHARD: ZeRO-3, everything sharded
  HybridShard,      // HYBRID_SHARD: FULL_SHARD inside dp_shard, replicated across dp_replicate
  HybridShardZero2  // HYBRID_SHARD_ZERO2: SHARD_GRAD_OP inside dp_shard, replicated across dp_replicate
};

// parallel.pp_schedule. None is "no pipeline" (pp = 1, printed "none"); it is not a value of the
// config key.
// ZeroBubbleH1 ("zb1p") and ZeroBubbleV ("zbv", two chunks per rank in a V) split each backward
// into its input gradient (B) and its weight gradient (W), run later.
enum class PipelineSchedule { None, GPipe, OneFOneB, Interleaved, ZeroBubbleH1, ZeroBubbleV };

// train.activation_checkpointing.
enum class Recompute { None, Full, Selective };

// Where the optimizer state lives: "none" (with the parameters) or "optimizer" (fp32 master and
// moments in host memory, Adam on the CPU). The planner models it; the engine records it only.
enum class Offload { None, Optimizer };

// The config spellings: "NO_SHARD", "ZERO1", "SHARD_GRAD_OP", "FULL_SHARD", "HYBRID_SHARD",
// "HYBRID_SHARD_ZERO2"; "none", "gpipe", "1f1b", "interleaved_1f1b", "zb1p", "zbv"; "none", "full", "selective".
const char* to_string(ShardingStrategy s);
const char* to_string(PipelineSchedule s);
const char* to_string(Recompute r);
const char* to_string(Offload o);  // "none", "optimizer"
// Human labels: DDP, ZeRO-1, ZeRO-2, ZeRO-3, HSDP, HSDP-ZeRO-2.
const char* strategy_label(ShardingStrategy s);

// Every value a config key accepts, in the order above (PipelineSchedule without None).
const std::vector<ShardingStrategy>& all_sharding_strategies();
const std::vector<PipelineSchedule>& all_pipeline_schedules();
const std::vector<Recompute>& all_recompute_modes();
// "NO_SHARD, ZERO1, ..." (what the error messages list).
std::string valid_values(ShardingStrategy);
std::string valid_values(PipelineSchedule);
std::string valid_values(Recompute);

// The config spelling back to the enum (exact match); nullopt for anything else.
std::optional<ShardingStrategy> try_parse_sharding_strategy(std::string_view s);
std::optional<PipelineSchedule> try_parse_pipeline_schedule(std::string_view s);
std::optional<Recompute> try_parse_recompute(std::string_view s);
// The same, throwing std::invalid_argument("<key> must be one of <valid values>; got '<s>'").
ShardingStrategy parse_sharding_strategy(std::string_view s, std::string_view key = "parallel.strategy");
PipelineSchedule parse_pipeline_schedule(std::string_view s, std::string_view key = "parallel.pp_schedule");
Recompute parse_recompute(std::string_view s, std::string_view key = "train.activation_checkpointing");

// What a strategy does.
constexpr bool is_sharded(ShardingStrategy s) { return s != ShardingStrategy::NoShard; }
constexpr bool is_hybrid(ShardingStrategy s) {
  return s == ShardingStrategy::HybridShard || s == ShardingStrategy::HybridShardZero2;
}
// Parameters live as shards between uses (ZeRO-3: FULL_SHARD, HYBRID_SHARD).
constexpr bool shards_parameters(ShardingStrategy s) {
  return s == ShardingStrategy::FullShard || s == ShardingStrategy::HybridShard;
}
// Gradients are reduce-scattered into shards (everything sharded except ZERO1).
constexpr bool shards_gradients(ShardingStrategy s) { return is_sharded(s) && s != ShardingStrategy::Zero1; }

}  // namespace mt
