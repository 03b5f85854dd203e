// `plan --validate`'s report: the text tables and the JSON of a ValidationReport.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

#include "validate/plan_validate.h"
#include "plan/planner.h"
#include <nlohmann/json.hpp>

#include "plan/text_table.h"

namespace mt::validate {

using namespace mt::plan;

using json = nlohmann::ordered_json;

// ---- output ------------------------------------------------------------------------------------------------

namespace {


std::string num(double v) {
  // 1234567 -> "1,234,567"
  const long long x = std::llround(v);
  std::string s = std::to_string(std::llabs(x)), o;
  for (size_t i = 0; i < s.size(); ++i) {
    if (i && (s.size() - i) % 3 == 0) o += ',';
    o += s[i];
  }
  return (x < 0 ? "-" : "") + o;
}

std::string diff_cell(double planner, double engine) {
  if (planner == 0 && engine == 0) return "0";
  if (engine == 0) return "inf";
  return fmt("%+.1f%%", 100.0 * (planner / engine - 1));
}

// The planner-vs-engine block of one layout: one row per figure, the planner's gap relative to the
// engine, the figures the planner does not model marked as such.
void gap_rows(const std::string& label, const PlannerGaps& g, std::vector<std::vector<std::string>>& rows) {
  bool first = true;
  for (const GapRow& x : g.rows) {
    const bool bytes = x.what.rfind("bytes ", 0) == 0;
    if (bytes && !x.modelled && x.engine == 0) continue;  // one-off traffic only (per step: none)
    rows.push_back({first ? label : "", x.what + (bytes && g.bytes_per_step ? " /step" : ""),
                    x.modelled ? num(x.planner) : "-", num(x.engine),
                    x.modelled ? diff_cell(x.planner, x.engine) : "not modelled"});
    first = false;
  }
  rows.push_back({"", "parameters (heaviest stage)", num(g.psi_planner), num(static_cast<double>(g.flat_engine)),
                  diff_cell(g.psi_planner, static_cast<double>(g.flat_engine))});
}

const char* kGapHead =
    "planner: estimate() per GPU (heaviest pipeline stage, peak) and bytes per step on each group; engine: the\n"
    "dry run's peak by category (the largest over the first and the last stage's first rank) and rank 0's\n"
    "bytes by group for one step, including the one-off model check, DDP's initial broadcast and the summary\n"
    "(\"/step\": per step instead, from the timed job of the same layout minus the one-step job);\n"
    "parameters: the planner's psi against the engine's padded flat size (elements). gap = planner / engine - 1:\n";

}  // namespace

std::string format_validation(const ValidationReport& rep) {
  std::ostringstream o;
  o << "Planner vs this engine: " << rep.results.size() << " jobs on " << rep.cores << " cores and " << rep.scale.size()
    << " dry-run-only layouts" << fmt(" (%.0f s)", rep.seconds) << "\n";
  if (!rep.comm_ceilings.empty()) o << "\nCeilings measured first:\n";
  for (const auto& c : rep.comm_ceilings)
    o << "  collectives, " << c.ranks << " ranks" << (c.busy ? ", cores busy" : ", idle") << ": "
      << fmt("%.2f GB/s", c.bw / 1e9) << " per rank (busbw), "
      << fmt("%.0f us", c.latency_s * 1e6) << " per ring step  [" << c.source << "]\n";
  for (const auto& r : rep.results)
    if (r.error.empty() && r.attempts > 0)
      o << "  compute, " << r.layout.label() << ": " << fmt("%.1f", r.compute.flops_per_s / 1e9)
        << " GFLOP/s per rank matmul+attention (" << fmt("%.1f", r.compute.gemm_flops_per_s / 1e9) << " GEMM alone), "
        << fmt("%.1f GB/s", r.compute.mem_bw / 1e9) << " streaming, " << fmt("%.1f GB/s", r.compute.elem_bw / 1e9) << " as the planner counts the elementwise kernels; " << r.compute.procs << " probes x "
        << r.compute.threads << " threads\n";

  for (const auto& r : rep.results)
    if (!r.error.empty()) o << "\nFAILED " << r.layout.label() << ": " << r.error << "\n";
  for (const auto& r : rep.scale)
    if (!r.error.empty()) o << "\nFAILED (dry run) " << r.layout.label() << ": " << r.error << "\n";

  // The engine: dry run against a real job.
  o << "\nThe engine's dry run vs a real one-step job, per-rank resident bytes after the step (measured: the rank\n"
       "furthest from its dry run); exact: equal to the byte; info: the CPU kernels' own buffers, not on Meta:\n";
  std::vector<std::vector<std::string>> rows;
  for (const auto& r : rep.results) {
    if (!r.error.empty()) continue;
    bool first = true;
    for (const auto& m : r.mem) {
      const bool info = m.check == MemCheck::Info;
      const std::string cat = m.pp_rank >= 0 ? "stage " + std::to_string(m.pp_rank) + ": " + m.category : m.category;
      rows.push_back({first ? r.layout.label() : "", cat, num(m.dry), num(m.measured), info ? "info" : "exact",
                      info ? "" : m.ok ? "ok" : "FAIL"});
      first = false;
    }
    rows.push_back({"", r.layout.pp > 1 ? "stage 0: flat elements" : "flat elements",
                    num(static_cast<double>(r.flat_dry)), num(static_cast<double>(r.flat_measured)), "exact",
                    r.flat_dry == r.flat_measured ? "ok" : "FAIL"});
    if (r.layout.pp > 1) {
      rows.push_back({"", "stage 0: activation slots", std::to_string(r.slots_dry), std::to_string(r.slots_measured),
                      "exact", r.slots_dry == r.slots_measured ? "ok" : "FAIL"});
      rows.push_back({"", "stages: " + r.stages_dry, "", r.stages_measured, "exact",
                      r.stages_dry == r.stages_measured ? "ok" : "FAIL"});
    }
    for (const auto& c : r.comm)
      rows.push_back({"", "bytes " + c.group, num(static_cast<double>(c.dry)), num(static_cast<double>(c.measured)),
                      c.info ? "info" : "exact", c.info ? "" : c.ok ? "ok" : "FAIL"});
  }
  o << format_table({"layout", "figure", "dry run", "real run", "check", ""}, rows,
                    {false, false, true, true, false, false});

  // The planner against the engine.
  o << "\nThe planner vs the engine (reported, not checked):\n" << kGapHead;
  rows.clear();
  for (const auto& r : rep.results)
    if (r.error.empty()) gap_rows(r.layout.label(), r.gaps, rows);
  for (const auto& r : rep.scale)
    if (r.error.empty()) gap_rows(r.layout.label() + " (" + std::to_string(r.layout.ranks) + " ranks)", r.gaps, rows);
  o << format_table({"layout", "figure", "planner", "engine", "gap"}, rows, {false, false, true, true, true});

  // Step time.
  bool timed = false;
  for (const auto& r : rep.results) timed = timed || (r.error.empty() && r.attempts > 0);
  if (timed) {
    o << "\nStep time: estimate() on the ceilings measured just before and after each job (drift: after/before)\n"
         "vs the median of the steps after the first:\n";
    rows.clear();
    for (const auto& r : rep.results) {
      if (!r.error.empty() || r.attempts == 0) continue;
      std::string verdict = !r.time.checked ? "(not checked)" : r.time.ok ? "ok" : "FAIL";
      if (r.attempts > 1) verdict += fmt(" (run %.0f; first ", r.attempts) + fmt("%+.0f%%)", 100 * r.first_time_error);
      rows.push_back({r.layout.label(), fmt("%.1f", r.compute.flops_per_s / 1e9), fmt("%+.0f%%", 100 * r.time.ceiling_drift),
                      r.time.steal < 0 ? std::string("-") : fmt("%.0f%%", 100 * r.time.steal),
                      fmt("%.1f", r.time.compute_s * 1e3),
                      fmt("%.1f", r.time.exposed_s * 1e3) +
                          (r.layout.tp > 1 ? " (tp " + fmt("%.1f", r.time.tp_exposed_s * 1e3) + ")" : std::string()) +
                          (r.layout.pp > 1 ? " + bubble " + fmt("%.1f", r.time.bubble_s * 1e3) +
                                                 fmt(" (%.0f%% / ", 100 * r.time.bubble_predicted) +
                                                 fmt("%.0f%% idle)", 100 * r.time.bubble_measured)
                                           : std::string()) +
                          " / " + fmt("%.1f", r.time.measured_exposed_s * 1e3),
                      fmt("%.1f", r.time.predicted_s * 1e3), fmt("%.1f", r.time.measured_s * 1e3),
                      fmt("%.0f", r.time.measured_min_s * 1e3) + "-" + fmt("%.0f", r.time.measured_max_s * 1e3),
                      fmt("%+.1f%%", 100 * r.time.error), verdict});
    }
    o << "(pipelines: + bubble = estimate()'s bubble, then the formula's / the measured mean idle share of the pp\n"
         " ranks; the engine's exposed is the data-parallel wait only)\n";
    o << "(steal: the share of the machine's CPU time the hypervisor gave other guests while the job ran,\n"
         " from /proc/stat; on a shared virtual machine it is what makes one run of a layout differ from the next)\n";
    o << format_table({"layout", "GFLOP/s", "drift", "steal", "compute ms", "exposed ms pred/meas", "predicted ms",
                       "measured ms", "range", "error", "25%"},
                      rows, {false, true, true, true, true, true, true, true, true, true, false});
  } else {
    o << "\nStep time: (not measured)\n";
  }
  o << "\n" << (rep.ok ? "All checks passed." : "Some checks FAILED.") << "\n";
  return o.str();
}

namespace {

json gaps_json(const PlannerGaps& g) {
  json x = {{"psi_planner", g.psi_planner}, {"flat_size_engine", g.flat_engine}, {"dry_run_ranks", g.ranks},
            {"engine_bytes_per_step", g.bytes_per_step}, {"rows", json::array()}};
  for (const GapRow& r : g.rows)
    x["rows"].push_back({{"figure", r.what}, {"planner", r.modelled ? json(r.planner) : json(nullptr)},
                         {"engine", r.engine}, {"modelled", r.modelled}});
  return x;
}

json layout_json(const EngineLayout& l) {
  return {{"label", l.label()}, {"strategy", to_string(l.strategy)}, {"ranks", l.ranks}, {"tp", l.tp},
          {"sequence_parallel", l.sequence_parallel}, {"pp", l.pp},
          {"pp_schedule", l.pp > 1 ? to_string(l.pp_schedule) : ""}, {"dp_replicate", l.replicas()},
          {"dtype", l.bf16 ? "bf16" : "fp32"}, {"model", l.model}};
}

}  // namespace

std::string validation_json(const ValidationReport& rep) {
  json j;
  j["ok"] = rep.ok;
  j["cores"] = rep.cores;
  j["seconds"] = rep.seconds;
  j["comm_ceilings"] = json::array();
  for (const auto& c : rep.comm_ceilings)
    j["comm_ceilings"].push_back(
        {{"ranks", c.ranks}, {"busy", c.busy}, {"bw", c.bw}, {"latency_s", c.latency_s}, {"source", c.source}});
  j["layouts"] = json::array();
  for (const auto& r : rep.results) {
    json x = layout_json(r.layout);
    x["ok"] = r.ok;
    x["error"] = r.error;
    if (r.error.empty()) {
      x["flat_size"] = {{"dry_run", r.flat_dry}, {"measured", r.flat_measured}};
      x["memory"] = json::array();
      for (const auto& m : r.mem)
        x["memory"].push_back({{"category", m.category}, {"pp_rank", m.pp_rank}, {"dry_run", m.dry},
                               {"measured", m.measured}, {"check", m.check == MemCheck::Exact ? "exact" : "info"},
                               {"ok", m.ok}});
      x["comm"] = json::array();
      for (const auto& c : r.comm)
        x["comm"].push_back({{"group", c.group}, {"dry_run", c.dry}, {"measured", c.measured}, {"ok", c.ok}});
      x["planner_vs_engine"] = gaps_json(r.gaps);
      if (r.attempts > 0)
        x["step_time_s"] = {{"predicted", r.time.predicted_s}, {"compute", r.time.compute_s},
                            {"exposed_comm", r.time.exposed_s}, {"tp_exposed_comm", r.time.tp_exposed_s},
                            {"measured_median", r.time.measured_s},
                            {"measured_exposed_comm_median", r.time.measured_exposed_s},
                            {"error", r.time.error}, {"checked", r.time.checked}, {"ok", r.time.ok}, {"ceiling_drift", r.time.ceiling_drift},
                            {"steal", r.time.steal},
                            {"attempts", r.attempts}, {"bubble", r.time.bubble_s},
                            {"pp_bubble_predicted", r.time.bubble_predicted},
                            {"pp_bubble_measured", r.time.bubble_measured}};
      if (r.layout.pp > 1)
        x["pipeline"] = {{"stages_dry_run", r.stages_dry}, {"stages_measured", r.stages_measured},
                         {"activation_slots_dry_run", r.slots_dry}, {"activation_slots_measured", r.slots_measured}};
    }
    j["layouts"].push_back(x);
  }
  j["scale"] = json::array();
  for (const auto& r : rep.scale) {
    json x = layout_json(r.layout);
    x["error"] = r.error;
    x["seconds"] = r.seconds;
    if (r.error.empty()) x["planner_vs_engine"] = gaps_json(r.gaps);
    j["scale"].push_back(x);
  }
  return j.dump(2) + "\n";
}

}  // namespace mt::validate
