// Reading a PLAN.json back (docs/design.md, "Formats"): its embedded model
// and the storage its /tensors decided. The runtime executes what these
// give (runtime/src/plan_binding.cc); `memplan viz` draws it.
#pragma once

#include <string>

#include "memplan/common/json_util.h"
#include "memplan/common/status.h"
#include "memplan/planner/liveness.h"
#include "memplan/planner/model.h"

namespace memplan::planner {

// The plan's header and schema checked, and its model (its digest equal to
// /digest). Errors (kBadInput) name `file` and the JSON path.
Expected<Model> ReadPlanModel(const Json& plan, const std::string& file);

// The storage (and remote target) /tensors decided for every saved tensor of
// `p` (the problem rebuilt from the plan's model): one of the legal
// compositions each, every tensor listed once.
Expected<Assignment> ReadPlanAssignment(const Json& plan, const std::string& file, const PlanningProblem& p);

}  // namespace memplan::planner
