// Decisions (stage 6) and rebalancing (stage 7).
//
// Annotated tensors are constraints. For the rest, a solver picks a storage
// per tensor (all its instances) so that each rank's lower bound fits its
// budget at minimum added step time under the separable cost model of
// InstanceCost(): recompute FLOPs and bytes through a roofline, quantize and
// dequantize bytes at HBM bandwidth, and the part of each prefetch that does
// not fit its overlap window.
//
// heuristic (default): at the peak step, rank candidates by added seconds
//   per byte saved there, apply the best until the excess is covered,
//   re-simulate; then drop decisions that are no longer needed. A segment
//   tree keeps the per-step profile, so each change costs O(k log steps).
// exact: a MILP over binaries x[tensor][storage] with one memory row per
//   step, solved by COIN-OR CBC; for small instances.
//
// The rebalancer moves whole tensors of the most loaded rank to the spare
// memory of a later rank (offload_remote) while the maximum peak drops and
// the pipeline link can carry the bytes inside each layer's prefetch window.
// The planner runs: local solve, rebalance, local solve again (which also
// drops decisions the freed memory made unnecessary).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "memplan/common/status.h"
#include "memplan/planner/liveness.h"

namespace memplan::planner {

enum class SolverKind { kHeuristic, kExact };

// Whether this build has the exact solver (CBC, the Meson feature `cbc`);
// without it SolverKind::kExact is refused (kBadInput).
bool ExactSolverAvailable();

// Largest MILP the exact solver accepts (rows x columns).
inline constexpr int64_t kMaxExactCells = 4'000'000;

struct SolveResult {
  bool fits = false;
  double cost_s = 0;  // separable added seconds of this rank's decisions
};

// Decides every non-annotated, non-remote tensor of every rank so that the
// rank's activation profile (transients, its instances, incoming remote
// offloads) stays within activation_budgets[rank]. Throws
// ErrorException(kBadInput) when the exact solver is asked for an instance
// larger than kMaxExactCells.
// Every rank's live bytes per step under an assignment (queue-free copies),
// which Solve and Rebalance keep in step with the assignment they change:
// a planning run that passes one cache to each call builds the profiles
// once instead of once per call. Valid for the assignment it was made from
// as changed by those calls only.
class ProfileCache {
 public:
  ProfileCache(const PlanningProblem& p, const Assignment& a);
  ~ProfileCache();
  ProfileCache(const ProfileCache&) = delete;
  ProfileCache& operator=(const ProfileCache&) = delete;
  struct Impl;
  Impl& impl() { return *impl_; }

 private:
  std::unique_ptr<Impl> impl_;
};

std::vector<SolveResult> Solve(const PlanningProblem& p, const std::vector<int64_t>& activation_budgets,
                               SolverKind kind, Assignment* a, ProfileCache* cache = nullptr);

// The separable cost of `rank`'s assignment (seconds per step).
double SeparableCost(const PlanningProblem& p, int32_t rank, const Assignment& a);

struct RebalanceResult {
  // max/min over ranks of the keep-all lower bound, before and after the
  // chosen remote offloads (filled by the planner).
  double ratio_before = 1;
  double ratio_after = 1;
  int64_t moved_tensors = 0;
};

// Offloads tensors remotely from a rank into a later rank's spare memory:
// first from ranks over budget (most bytes off the peak step), then from the
// rank whose decisions cost the most time (most seconds saved per byte), as
// long as the target stays within the budget, the source does not grow, and
// the pipeline link hides each layer's remote bytes in its prefetch window.
// Annotated tensors never move; FP8 ones become fp8+offload_remote.
RebalanceResult Rebalance(const PlanningProblem& p, int64_t budget, Assignment* a, ProfileCache* cache = nullptr);

}  // namespace memplan::planner
