#include "train/report_diagnose.h"

#include <algorithm>
#include <cstdio>
#include <map>

#include "plan/cluster.h"
#include "plan/planner.h"
#include "runtime/memory.h"

namespace mt {

namespace {

constexpr double kCommShare = 0.25, kMemShare = 0.85, kDataShare = 0.10, kStragglerShare = 0.20;

std::string pct(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%.0f%%", v * 100.0);
  return b;
}
std::string ms(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%.1f ms", v);
  return b;
}

// The group that moved the most bytes (final comm_bytes_by_group), with its bytes.
std::pair<std::string, double> busiest_group(const RunMetrics& run) {
  std::pair<std::string, double> best{"", 0.0};
  if (!run.final.is_object() || !run.final.contains("comm_bytes_by_group")) return best;
  for (const auto& [g, b] : run.final["comm_bytes_by_group"].items())
    if (b.is_number() && b.get<double>() > best.second) best = {g, b.get<double>()};
  return best;
}

Finding communication(const RunMetrics& run, double step_ms) {
  Finding f;
  f.check = "communication";
  const auto exposed = run.mean("exposed_comm_ms");
  if (!exposed || step_ms <= 0) {
    f.recorded = false;
    f.evidence = "exposed_comm_ms not recorded";
    return f;
  }
  f.share = std::clamp(*exposed / step_ms, 0.0, 1.0);  // the parts overlap; exposed can exceed step_ms
  f.flagged = f.share >= kCommShare;
  f.evidence = "exposed communication " + ms(*exposed) + " of a " + ms(step_ms) + " step (" + pct(f.share) + ")";
  const auto [group, bytes] = busiest_group(run);
  const double steps = run.final_number("steps").value_or(static_cast<double>(run.steps.size()));
  if (!group.empty())
    f.evidence += "; most bytes on " + group + " (" + format_bytes(static_cast<int64_t>(bytes / std::max(1.0, steps))) +
                  " per step from rank 0)";
  return f;
}

// The highest peak of any rank: the per-rank final table when there is one, else the step records.
double peak_bytes(const RunMetrics& run) {
  double peak = 0;
  for (const auto& [s, v] : run.series_of("mem_peak_bytes")) peak = std::max(peak, v);
  if (run.final.is_object() && run.final.contains("mem_peak_by_category_per_rank"))
    for (const auto& r : run.final["mem_peak_by_category_per_rank"]) {
      double t = 0;
      for (const auto& [k, v] : r.items())
        if (v.is_number()) t += v.get<double>();
      peak = std::max(peak, t);
    }
  return peak;
}

Finding memory(const RunMetrics& run, const DiagnoseContext& ctx) {
  Finding f;
  f.check = "memory";
  const double peak = peak_bytes(run);
  const double cap = run.final_number("mem_capacity_bytes").value_or(static_cast<double>(ctx.capacity_bytes));
  const auto retries = run.final_number("alloc_retries");
  f.evidence = "peak " + format_bytes(static_cast<int64_t>(peak)) + " on the busiest rank";
  if (cap > 0) {
    f.share = peak / cap;
    f.evidence += " of " + format_bytes(static_cast<int64_t>(cap)) + " per rank (" + pct(f.share) + ")";
  } else {
    f.recorded = false;
    f.evidence += "; capacity not known";
  }
  f.evidence += retries ? "; allocator retries " + std::to_string(static_cast<long long>(*retries))
                        : "; allocator retries not recorded";
  f.flagged = f.share >= kMemShare || (retries && *retries > 0);
  return f;
}

Finding compute(const RunMetrics& run, const DiagnoseContext& ctx, double step_ms) {
  Finding f;
  f.check = "compute";
  const auto mfu = run.mean("mfu");
  const auto ceiling = ctx.mfu_ceiling ? ctx.mfu_ceiling : run.final_number("mfu_ceiling");
  const auto comp = run.mean("compute_ms");
  if (mfu && ceiling && *ceiling > 0) {
    f.share = *mfu / *ceiling;
    f.evidence = "MFU " + pct(*mfu) + " against a measured ceiling of " + pct(*ceiling) + " (" + pct(f.share) + " of it)";
  } else if (comp && step_ms > 0) {
    f.share = std::clamp(*comp / step_ms, 0.0, 1.0);
    f.evidence = "compute " + ms(*comp) + " of the step (" + pct(f.share) + ")" +
                 (mfu ? ", MFU " + pct(*mfu) + " (no measured ceiling)" : ", MFU not recorded (log.peak_flops)");
  } else {
    f.recorded = false;
    f.evidence = "compute_ms and mfu not recorded";
  }
  return f;
}

Finding data_wait(const RunMetrics& run, double step_ms) {
  Finding f;
  f.check = "data";
  const auto wait = run.mean("data_wait_ms");
  if (!wait || step_ms <= 0) {
    f.recorded = false;
    f.evidence = "data_wait_ms not recorded";
    return f;
  }
  f.share = *wait / step_ms;
  f.flagged = f.share >= kDataShare;
  f.evidence = "waiting for data " + ms(*wait) + " per step (" + pct(f.share) + ")";
  return f;
}

Finding straggler(const RunMetrics& run, std::string* who) {
  Finding f;
  f.check = "straggler";
  size_t seen = 0, named = 0;
  std::map<std::string, int> count;
  for (const auto& j : run.steps) {
    if (!j.contains("straggler")) continue;
    ++seen;
    const auto& s = j["straggler"];
    for (const auto& e : s.is_array() ? s : nlohmann::json::array({s})) {
      if (!e.is_object()) continue;
      ++named;
      const std::string name = "rank " + std::to_string(e.value("rank", -1)) +
                               (e.contains("host") ? " on " + e.value("host", "") : "") +
                               (e.contains("part") ? " (" + e.value("part", "") + ")" : "");
      ++count[name];
    }
  }
  if (!seen) {
    f.recorded = false;
    f.evidence = "straggler not recorded";
    return f;
  }
  // The ranks compare their times every log.straggler_every steps: the share is of those comparisons.
  f.share = static_cast<double>(named) / static_cast<double>(seen);
  f.flagged = f.share >= kStragglerShare;
  if (count.empty()) {
    f.evidence = "no rank named a straggler in " + std::to_string(seen) + " comparison" + (seen > 1 ? "s" : "");
    return f;
  }
  auto top = std::max_element(count.begin(), count.end(), [](auto& a, auto& b) { return a.second < b.second; });
  *who = top->first;
  f.evidence = top->first + " named slow in " + std::to_string(top->second) + " of " + std::to_string(seen) +
               " comparison" + (seen > 1 ? "s" : "") + " of the ranks";
  return f;
}

}  // namespace

std::string planner_advice(const DiagnoseContext& ctx, const std::string& goal, double measured_exposed_ms) {
  if (!ctx.model) return "";
  plan::Cluster c = plan::cluster_preset("this-cpu");
  c.gpus = ctx.layout.world();
  c.gpus_per_node = std::max(c.gpus_per_node, c.gpus);  // one machine
  plan::PlanOptions o;
  o.top_k = 0;
  o.allow_offload = false;
  const plan::PlanResult r = plan::plan(*ctx.model, c, ctx.setup, o);
  const plan::Estimate cur = plan::estimate(*ctx.model, c, ctx.setup, ctx.layout);
  const plan::Estimate* best = nullptr;
  for (const auto& e : r.candidates) {
    if (!e.fits || e.layout.global_batch() != ctx.layout.global_batch()) continue;
    if (goal == "memory" ? (!best || e.mem.total() < best->mem.total()) : !best) best = &e;
  }
  char b[512];
  const bool same = !best || best->layout.describe() == cur.layout.describe();
  if (same && goal != "memory") {
    std::snprintf(b, sizeof b,
                  "planner (this-cpu model): the current %s is already its best layout for %d ranks, predicting "
                  "%.1f ms of exposed communication per step against %.1f ms measured; the gap is this machine "
                  "(ranks sharing cores, collectives without overlap), not the layout",
                  cur.layout.describe().c_str(), c.gpus, cur.time.exposed_comm * 1e3, measured_exposed_ms);
    return b;
  }
  if (same) return "";
  if (goal == "memory") {
    if (best->mem.total() >= cur.mem.total() * 0.95) return "";
    std::snprintf(b, sizeof b, "planner (this-cpu model): %s needs %s per rank against %s for the current %s",
                  best->layout.describe().c_str(), format_bytes(static_cast<int64_t>(best->mem.total())).c_str(),
                  format_bytes(static_cast<int64_t>(cur.mem.total())).c_str(), cur.layout.describe().c_str());
  } else {
    const double gain = 1.0 - best->time.total() / cur.time.total();
    std::snprintf(b, sizeof b,
                  "planner (this-cpu model): %s predicts %.0f%% shorter steps than the current %s (exposed "
                  "communication %.1f ms -> %.1f ms)",
                  best->layout.describe().c_str(), gain * 100.0, cur.layout.describe().c_str(),
                  cur.time.exposed_comm * 1e3, best->time.exposed_comm * 1e3);
  }
  return b;
}

Diagnosis diagnose(const RunMetrics& run, const DiagnoseContext& ctx) {
  Diagnosis d;
  const double step_ms = run.mean("step_ms").value_or(0.0);
  std::string slow_rank;
  Finding comm = communication(run, step_ms), mem = memory(run, ctx), comp = compute(run, ctx, step_ms),
          data = data_wait(run, step_ms), strag = straggler(run, &slow_rank);
  d.findings = {comm, mem, comp, data, strag};
  const std::string group = busiest_group(run).first;
  if (strag.flagged) {
    d.verdict = "straggling";
    d.advice = slow_rank + " holds the others back at every collective: check that rank's core, storage or data "
               "shards (MESHTRAIN_LOG_RANKS=all shows its own timings)";
  } else if (data.flagged) {
    d.verdict = "data-stalled";
    d.advice = "the loader does not keep up: prepare the data as token shards on local storage (meshtrain prepare) "
               "or give the job fewer ranks per core";
  } else if (comm.flagged) {
    d.verdict = "communication-bound";
    const std::string planner = planner_advice(ctx, "time", run.mean("exposed_comm_ms").value_or(0.0));
    if (planner.find("predicts") != std::string::npos)
      d.advice = planner;
    else
      d.advice = (planner.empty() ? "" : planner + ". Otherwise: ") + "hide or shrink the " + (group.empty() ? std::string("collectives") : group + " traffic") +
                 ": fewer shard ranks (HYBRID_SHARD or SHARD_GRAD_OP instead of FULL_SHARD), a larger micro-batch or "
                 "grad_accum so each byte serves more tokens" +
                 (ctx.model ? "" : " (give diagnose the run's --config for the planner's layout)");
  } else if (mem.flagged) {
    d.verdict = "memory-bound";
    d.advice = planner_advice(ctx, "memory", 0.0);
    if (d.advice.empty())
      d.advice = "shard more of the model state (FULL_SHARD), recompute activations (train.recompute) or use a "
                 "smaller micro-batch with more grad_accum";
  } else {
    d.verdict = "compute-bound";
    d.advice = "the step is compute: bf16 (train.dtype = \"bf16\") where the CPU has it, a larger micro-batch for "
               "larger matmuls, or more ranks (communication is not the limit yet)";
  }
  for (auto& f : d.findings) f.flagged = f.flagged || (f.check == "compute" && d.verdict == "compute-bound");
  return d;
}

std::string Diagnosis::text() const {
  std::string s = "verdict: " + verdict + "\n";
  for (const auto& f : findings)
    s += std::string("  ") + (f.flagged ? "! " : "  ") + f.check + std::string(15 - f.check.size(), ' ') +
         f.evidence + "\n";
  s += "most likely to help: " + advice + "\n";
  return s;
}

}  // namespace mt
