#include "parallel/layout/parallel_plan.h"

#include <cstdio>

namespace mt {

std::string ParallelPlan::describe() const {
  char buf[256];
  std::snprintf(buf, sizeof buf, "%s dp_replicate=%d dp_shard=%d%s tp=%d pp=%d%s%s mb=%lldx%lld ac=%s%s",
                strategy_label(strategy), dp_replicate, dp_shard, cp > 1 ? (" cp=" + std::to_string(cp)).c_str() : "",
                tp, pp, pp > 1 ? " " : "",
                pp > 1 ? (std::string(to_string(schedule)) +
                          (schedule == PipelineSchedule::Interleaved ? "(v=" + std::to_string(virtual_stages) + ")" : ""))
                             .c_str()
                       : "",
                static_cast<long long>(micro_batch), static_cast<long long>(microbatches), to_string(checkpointing),
                offload_optimizer() ? " offload" : "");
  if (ep > 1) return std::string(buf) + " ep=" + std::to_string(ep);
  return buf;
}

}  // namespace mt
