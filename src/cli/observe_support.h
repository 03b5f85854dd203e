// What `meshtrain diagnose` and `meshtrain report` share: the options that tell the diagnosis what
// the metrics do not hold (the run's config for the planner, the memory capacity, the MFU ceiling).
#pragma once
#include <string>
#include <vector>

#include "cli/arg_parser.h"
#include "train/report_diagnose.h"

namespace mt::cli {

// The value flags these options add to a command's parser (config, capacity-gib, mfu-ceiling and
// the --section.key overrides of the config).
std::vector<std::string> diagnose_value_flags();
// Help text for them.
extern const char* const kDiagnoseOptionsHelp;
// The context for `run`: its config (--config and overrides) when given, the capacity per rank
// (--capacity-gib, else this machine's memory over the run's ranks) and --mfu-ceiling.
DiagnoseContext diagnose_context(const ArgParser& ap, const RunMetrics& run);

}  // namespace mt::cli
