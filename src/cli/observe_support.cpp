#include "cli/observe_support.h"

#include <unistd.h>

#include <algorithm>

#include "parallel/layout/parallel_config.h"
#include "train/config.h"
#include "validate/plan_validate.h"

namespace mt::cli {

const char* const kDiagnoseOptionsHelp =
    "  --config FILE [--section.key V ...]  the run's config and overrides: the planner then backs a\n"
    "                    layout suggestion with its prediction for the same ranks\n"
    "  --capacity-gib G  memory one rank may use (default: this machine's memory over the run's ranks)\n"
    "  --mfu-ceiling F   the best MFU measured for the model's shapes (0..1), for the compute check\n";

std::vector<std::string> diagnose_value_flags() {
  return {"config", "capacity-gib", "mfu-ceiling", "model.*", "data.*", "train.*", "parallel.*", "lora.*", "log.*"};
}

DiagnoseContext diagnose_context(const ArgParser& ap, const RunMetrics& run) {
  DiagnoseContext ctx;
  const int world = static_cast<int>(run.final_number("world_size").value_or(1.0));
  const double gib = ap.get_double("capacity-gib", 0.0);
  if (gib > 0)
    ctx.capacity_bytes = static_cast<int64_t>(gib * 1024 * 1024 * 1024);
  else
    ctx.capacity_bytes = static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGESIZE) / std::max(1, world);
  const double ceiling = ap.get_double("mfu-ceiling", 0.0);
  if (ceiling > 0) ctx.mfu_ceiling = ceiling;
  if (ap.get("config").empty() && ap.dotted().empty()) return ctx;
  const RunConfig cfg = RunConfig::load(ap.get("config"), ap.dotted());
  validate::EngineLayout e;
  e.strategy = parse_sharding_strategy(cfg.parallel.strategy);
  e.ranks = world;
  e.tp = static_cast<int>(cfg.parallel.tp);
  e.pp = static_cast<int>(cfg.parallel.pp);
  e.cp = static_cast<int>(cfg.parallel.cp);
  e.dp_replicate = static_cast<int>(cfg.parallel.dp_replicate);
  e.bf16 = cfg.train.dtype == "bf16";
  e.micro_batch = cfg.train.micro_batch;
  e.grad_accum = cfg.train.grad_accum;
  e.bucket_mb = cfg.parallel.bucket_mb;
  ModelConfig m = cfg.model_config();
  m.resolve();
  ctx.model = m;
  ctx.setup = validate::planner_setup(m, e);
  ctx.layout = validate::planner_layout(e);
  return ctx;
}

}  // namespace mt::cli
