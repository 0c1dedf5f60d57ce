// Private to planner/: the cross buffers of Block AttnRes's shared blocks
// (liveness.h, CrossBuffer; docs/design.md "Shared blocks"), derived from a
// problem whose timelines and instances BuildProblem has built.
#pragma once

#include <cstdint>
#include <vector>

#include "memplan/planner/liveness.h"

namespace memplan::planner {

// Per rank, sorted by first step. `tensor_base`: per layer, the rank-local
// index of its first saved tensor.
std::vector<std::vector<CrossBuffer>> CrossBuffers(const PlanningProblem& p,
                                                   const std::vector<std::vector<int32_t>>& tensor_base);

}  // namespace memplan::planner
