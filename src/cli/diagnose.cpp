// `meshtrain diagnose METRICS.jsonl...`: what limits each run (train/report_diagnose.h).
#include <cstdio>
#include <string>

#include "cli/arg_parser.h"
#include "cli/cli_support.h"
#include "cli/commands.h"
#include "cli/observe_support.h"
#include "train/report_diagnose.h"

namespace mt::cli {

namespace {

std::string diagnose_help() {
  return std::string(
             "usage: meshtrain diagnose METRICS.jsonl... [--config FILE] [options]\n\n"
             "Classifies each run from its metrics file (train --log.metrics_out) as communication-bound\n"
             "(exposed communication >= 25% of the step; the group moving the most bytes), memory-bound\n"
             "(peak >= 85% of the capacity, or allocator retries), data-stalled (data_wait_ms >= 10% of the\n"
             "step), straggling (a rank named slow in >= 20% of the steps) or else compute-bound (MFU\n"
             "against the measured ceiling, or the compute share), and prints the change most likely to\n"
             "help. A check the metrics cannot answer says \"not recorded\".\n\n") +
         kDiagnoseOptionsHelp;
}

}  // namespace

int run_diagnose_command(int argc, char** argv) {
  std::vector<std::string> flags = diagnose_value_flags();
  ArgParser ap(flags, {"help"});
  if (auto done = cli_support::parse_args("diagnose", ap, argc, argv, [] { std::fputs(diagnose_help().c_str(), stdout); }))
    return *done;
  if (ap.positional().empty()) return cli_support::usage_error("diagnose", "give one or more METRICS.jsonl files");
  try {
    for (const auto& path : ap.positional()) {
      const RunMetrics run = read_run_metrics(path);
      const Diagnosis d = diagnose(run, diagnose_context(ap, run));
      if (ap.positional().size() > 1) std::printf("%s\n", run.label.c_str());
      std::fputs(d.text().c_str(), stdout);
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "meshtrain diagnose: %s\n", e.what());
    return 2;
  }
}

}  // namespace mt::cli
