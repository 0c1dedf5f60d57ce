// The planner's stages behind BuildPlan (plan.h), shared by plan.cc and
// plan_target.cc; not a public header.
#pragma once

#include "memplan/planner/plan.h"

namespace memplan::planner {

// One plan of `model` as it is: its annotations and target settings fixed,
// the solver deciding the rest. Throws ErrorException.
Plan BuildPlanOrThrow(const Model& model, const PlanOptions& options);

// Targets without per-tensor storage (target.h): the framework settings
// given in model.target.settings, or else the ones the planner chooses
// (docs/targets.md, "Choosing the settings"), planned. Throws.
Plan PlanFrameworkSettings(const Model& model, const PlanOptions& options);

}  // namespace memplan::planner
