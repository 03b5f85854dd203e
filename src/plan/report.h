// The planner's results as text and JSON: what `meshtrain plan` (cli/plan.cpp) prints.
#pragma once
#include <string>

#include "plan/planner.h"

namespace mt::plan {

std::string format_plan(const PlanResult& r);       // the human table and explanations
std::string plan_json(const PlanResult& r);         // model, model_state_bytes, candidates[...] (docs/plan.md)
std::string format_published(bool json);            // `--published`
std::string format_article(const Cluster& bands_cluster, bool json);  // `--article`

}  // namespace mt::plan
