// `meshtrain plan`: ranked parallel layouts for a model on a cluster (see `meshtrain plan --help`).
#pragma once
#include <string>

#include "plan/planner.h"

namespace mt::plan {

// argv[0] is "plan". Returns the process exit code: 0 ok, 2 bad input (message on stderr naming the
// flag), 1 internal error.
int run_plan_command(int argc, char** argv);

// The pieces run_plan_command prints, for tests and other commands.
std::string plan_help();
std::string format_plan(const PlanResult& r);       // the human table and explanations
std::string plan_json(const PlanResult& r);         // INTERFACE.md "Planner output"
std::string format_published(bool json);            // `--published`
std::string format_article(const Cluster& bands_cluster, bool json);  // `--article`

}  // namespace mt::plan
