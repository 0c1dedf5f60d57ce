// What memplan's own runtime (`memplan run`) does not execute yet among the
// layouts the planner plans: one rule for both sides, so that `plan` says at
// plan time what `run` would refuse (docs/runtime.md, "Limits"). Features
// the runtime lacks (multi-token prediction, learned positions, dtypes) are
// said by `run` alone: a plan of them is still a plan for a GPU framework.
#pragma once

#include <string>
#include <vector>

#include "memplan/planner/model.h"

namespace memplan::planner {

// Each layout the runtime refuses for `model`, as "/JSON/path: why" lines
// (paths under the model file's root; `run` prefixes /model).
std::vector<std::string> RuntimeLayoutGaps(const Model& model);

}  // namespace memplan::planner
