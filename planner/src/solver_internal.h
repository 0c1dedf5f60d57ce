// What the solvers share (solver.cc: the heuristic, the rebalancer and
// Solve; milp.cc: the exact solver). Private to planner/.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "memplan/planner/liveness.h"
#include "memplan/planner/solver.h"

namespace memplan::planner::internal {

inline constexpr Storage kLocalOptions[] = {Storage::kKeep, Storage::kRecompute, Storage::kFp8,
                                            Storage::kOffloadHost, Storage::kFp8OffloadHost};

// Intervals of one instance with a copy-out on an otherwise idle queue.
void QueueFree(const PlanningProblem& p, int32_t rank, int32_t index, Storage s, int32_t target,
               std::vector<Interval>* out);

// InstanceCost summed over each tensor's instances, per storage.
const std::vector<std::array<double, kStorageCount>>& CostTable(const PlanningProblem& p, int32_t rank);

// Whether the solvers decide this tensor (not annotated, not remote).
bool Decidable(const SavedTensor& t, Storage current);

// The MILP for one rank (docs/planner.md, "What --solver exact optimizes"):
// `fixed` holds the bytes other ranks offload here; `warm_start` (may be
// null) is the heuristic's storage per tensor, CBC's first incumbent.
SolveResult Exact(const PlanningProblem& p, int32_t rank, int64_t budget, const std::vector<Interval>& fixed,
                  const std::vector<Storage>* warm_start, Assignment* a);

}  // namespace memplan::planner::internal
