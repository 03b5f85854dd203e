#include "parallel/layout/parallel_config.h"

#include <stdexcept>

namespace mt {

const char* to_string(ShardingStrategy s) {
  switch (s) {
    case ShardingStrategy::NoShard: return "NO_SHARD";
    case ShardingStrategy::Zero1: return "ZERO1";
    case ShardingStrategy::ShardGradOp: return "SHARD_GRAD_OP";
    case ShardingStrategy::FullShard: return "FULL_SHARD";
    case ShardingStrategy::HybridShard: return "HYBRID_SHARD";
    case ShardingStrategy::HybridShardZero2: return "HYBRID_SHARD_ZERO2";
  }
  return "?";
}

const char* to_string(PipelineSchedule s) {
  switch (s) {
    case PipelineSchedule::None: return "none";
    case PipelineSchedule::GPipe: return "gpipe";
    case PipelineSchedule::OneFOneB: return "1f1b";
    case PipelineSchedule::Interleaved: return "interleaved_1f1b";
    case PipelineSchedule::ZeroBubbleH1: return "zb1p";
    case PipelineSchedule::ZeroBubbleV: return "zbv";
  }
  return "?";
}

const char* to_string(Recompute r) {
  switch (r) {
    case Recompute::None: return "none";
    case Recompute::Full: return "full";
    case Recompute::Selective: return "selective";
  }
  return "?";
}

const char* to_string(Offload o) { return o == Offload::Optimizer ? "optimizer" : "none"; }

const char* strategy_label(ShardingStrategy s) {
  switch (s) {
    case ShardingStrategy::NoShard: return "DDP";
    case ShardingStrategy::Zero1: return "ZeRO-1";
    case ShardingStrategy::ShardGradOp: return "ZeRO-2";
    case ShardingStrategy::FullShard: return "ZeRO-3";
    case ShardingStrategy::HybridShard: return "HSDP";
    case ShardingStrategy::HybridShardZero2: return "HSDP-ZeRO-2";
  }
  return "?";
}

const std::vector<ShardingStrategy>& all_sharding_strategies() {
  static const std::vector<ShardingStrategy> v = {ShardingStrategy::NoShard,     ShardingStrategy::Zero1,
                                                  ShardingStrategy::ShardGradOp, ShardingStrategy::FullShard,
                                                  ShardingStrategy::HybridShard, ShardingStrategy::HybridShardZero2};
  return v;
}

const std::vector<PipelineSchedule>& all_pipeline_schedules() {
  static const std::vector<PipelineSchedule> v = {PipelineSchedule::GPipe, PipelineSchedule::OneFOneB,
                                                  PipelineSchedule::Interleaved, PipelineSchedule::ZeroBubbleH1,
                                                  PipelineSchedule::ZeroBubbleV};
  return v;
}

const std::vector<Recompute>& all_recompute_modes() {
  static const std::vector<Recompute> v = {Recompute::None, Recompute::Full, Recompute::Selective};
  return v;
}

namespace {

template <class E>
std::string join(const std::vector<E>& values) {
  std::string s;
  for (E v : values) s += (s.empty() ? "" : ", ") + std::string(to_string(v));
  return s;
}

template <class E>
std::optional<E> lookup(const std::vector<E>& values, std::string_view s) {
  for (E v : values)
    if (s == to_string(v)) return v;
  return std::nullopt;
}

template <class E>
E parse_or_throw(const std::vector<E>& values, std::string_view s, std::string_view key) {
  if (std::optional<E> v = lookup(values, s)) return *v;
  throw std::invalid_argument(std::string(key) + " must be one of " + join(values) + "; got '" + std::string(s) + "'");
}

}  // namespace

std::string valid_values(ShardingStrategy) { return join(all_sharding_strategies()); }
std::string valid_values(PipelineSchedule) { return join(all_pipeline_schedules()); }
std::string valid_values(Recompute) { return join(all_recompute_modes()); }

std::optional<ShardingStrategy> try_parse_sharding_strategy(std::string_view s) {
  return lookup(all_sharding_strategies(), s);
}
std::optional<PipelineSchedule> try_parse_pipeline_schedule(std::string_view s) {
  return lookup(all_pipeline_schedules(), s);
}
std::optional<Recompute> try_parse_recompute(std::string_view s) { return lookup(all_recompute_modes(), s); }

ShardingStrategy parse_sharding_strategy(std::string_view s, std::string_view key) {
  return parse_or_throw(all_sharding_strategies(), s, key);
}
PipelineSchedule parse_pipeline_schedule(std::string_view s, std::string_view key) {
  return parse_or_throw(all_pipeline_schedules(), s, key);
}
Recompute parse_recompute(std::string_view s, std::string_view key) {
  return parse_or_throw(all_recompute_modes(), s, key);
}

}  // namespace mt
