// `meshtrain report METRICS.jsonl... --out report.html`: one self-contained page of the runs
// (train/report_html.h), each with its diagnosis (train/report_diagnose.h).
#include <cstdio>
#include <fstream>
#include <string>

#include "cli/arg_parser.h"
#include "cli/cli_support.h"
#include "cli/commands.h"
#include "cli/observe_support.h"
#include "train/config.h"
#include "train/report_html.h"

namespace mt::cli {

namespace {

std::string report_help() {
  return std::string(
             "usage: meshtrain report METRICS.jsonl... [--out report.html] [--labels A,B,...] [--title TEXT]\n"
             "                        [--config FILE] [options]\n\n"
             "Writes one self-contained HTML page (no network access needed) of the runs' metrics files\n"
             "(train --log.metrics_out), overlaid in one colour each: loss and validation loss, tokens/s,\n"
             "MFU, step time, exposed communication, data wait, peak memory per step, memory by category,\n"
             "bytes by group, a per-rank step-time heat map when recorded, and per run its layout, config\n"
             "(with --config) and the diagnosis of `meshtrain diagnose`.\n\n"
             "  --out FILE        the page (default report.html)\n"
             "  --labels NAMES    run names, comma-separated (default: the file names)\n"
             "  --title TEXT      page title (default \"meshtrain run report\")\n") +
         kDiagnoseOptionsHelp;
}

}  // namespace

int run_report_command(int argc, char** argv) {
  std::vector<std::string> flags = diagnose_value_flags();
  flags.insert(flags.end(), {"out", "labels", "title"});
  ArgParser ap(flags, {"help"});
  if (auto done = cli_support::parse_args("report", ap, argc, argv, [] { std::fputs(report_help().c_str(), stdout); }))
    return *done;
  const auto& files = ap.positional();
  if (files.empty()) return cli_support::usage_error("report", "give one or more METRICS.jsonl files");
  const std::vector<std::string> labels = split_list(ap.get("labels"));
  if (!labels.empty() && labels.size() != files.size())
    return cli_support::usage_error("report", "--labels has " + std::to_string(labels.size()) + " names for " +
                                                  std::to_string(files.size()) + " metrics files");
  try {
    std::string config_text;
    if (!ap.get("config").empty() || !ap.dotted().empty())
      config_text = RunConfig::load(ap.get("config"), ap.dotted()).to_toml();
    std::vector<ReportRun> runs;
    for (size_t i = 0; i < files.size(); ++i) {
      ReportRun r{read_run_metrics(files[i], labels.empty() ? "" : labels[i]), {}, config_text};
      r.diagnosis = diagnose(r.metrics, diagnose_context(ap, r.metrics));
      std::printf("%s: %zu steps, %s\n", r.metrics.label.c_str(), r.metrics.steps.size(), r.diagnosis.verdict.c_str());
      runs.push_back(std::move(r));
    }
    const std::string out = ap.get("out", "report.html");
    std::ofstream f(out, std::ios::trunc);
    f << report_html(runs, ap.get("title", "meshtrain run report"));
    f.flush();
    if (!f) throw std::runtime_error("cannot write " + out);
    std::printf("wrote %s\n", out.c_str());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "meshtrain report: %s\n", e.what());
    return 2;
  }
}

}  // namespace mt::cli
