// Bounds and verification (stage 8).
//
//   lower_bound           static + max over steps of live bytes: what a
//                         perfect allocator needs.
//   peak                  static + the high-water mark of the deterministic
//                         best-fit heap (common/best_fit_heap.h) placing every
//                         interval and every op's transient in step order:
//                         fragmentation included, the number the host
//                         runtime's arena reaches.
//   any_plan_lower_bound  the lower bound when every instance takes its
//                         smallest footprint (resident from its production
//                         to its last forward reader and again during its
//                         layer's backward); no plan can do
//                         better, so a budget below it is infeasible.
//
// The verifier checks the result instead of trusting it: every instance is
// resident when produced and throughout its layer's backward, no two placed
// buffers overlap in both time and space, and every copy that moves bytes
// finishes before the bytes are needed again (a copy-out before its
// prefetch is issued; an instance whose window is too short stays resident
// and is accounted as kept).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "memplan/common/caching_allocator.h"
#include "memplan/planner/liveness.h"

namespace memplan::planner {

struct RankBounds {
  int64_t activations_peak = 0;  // max over steps of non-static live bytes
  int64_t lower_bound = 0;
  int64_t peak = 0;
  int64_t any_plan_lower_bound = 0;
  int64_t peak_step = 0;           // where the lower bound is reached
  double recompute_s = 0;          // added seconds per step on this rank
  double quantize_s = 0;
  double exposed_transfer_s = 0;
  int64_t resident_offloads = 0;  // offloaded instances whose window is too short: kept resident
  // Host bytes of offloaded activations at their peak: each host-offloaded
  // instance from its production to its backward (docs/accounting.md §7).
  int64_t host_activations_peak = 0;
  std::vector<std::pair<int32_t, int64_t>> remote_offload;  // (to rank, max bytes held there)
  // A periodic window's rank whose period after the cut is the period before
  // it (period.h): `peak` is then the model's; otherwise only the window's.
  bool periodic = true;
};

struct Evaluation {
  std::vector<RankBounds> ranks;
  std::vector<Interval> intervals;
  std::vector<std::string> verify_errors;  // empty when the plan verifies
};

// Simulates `a` with first-in-first-out copy queues, places every buffer,
// and (when `verify`) runs the verifier. With `reuse`, ranks whose flag in
// `changed` is false keep reuse->ranks[r].peak instead of being placed
// again (their intervals must not have changed).
Evaluation Evaluate(const PlanningProblem& p, const Assignment& a, bool verify,
                    const Evaluation* reuse = nullptr, const std::vector<bool>* changed = nullptr);
// The same without placing: each rank's peak is its lower bound. The costs
// (recompute, quantize, exposed transfers) are Evaluate's.
Evaluation EvaluateUnplaced(const PlanningProblem& p, const Assignment& a);

// What PyTorch's caching allocator (common/caching_allocator.h) holds for a
// rank's activations when the framework allocates and frees them in the
// order of the rank's memory program (ProgramWalker), from an empty pool:
// the peak of allocated blocks (rounded) and of reserved segments. Static
// memory is not included (the target reserves it, target.h). `capacity`,
// per rank, is what the activations may reserve before the allocator's
// OOM retry releases cached segments (config's own capacity when empty).
struct AllocatorReplay {
  int64_t allocated_peak = 0;
  int64_t reserved_peak = 0;
  int64_t segments = 0;
};
std::vector<AllocatorReplay> ReplayCachingAllocator(const PlanningProblem& p, const Evaluation& e,
                                                    const CachingAllocatorConfig& config,
                                                    const std::vector<int64_t>& capacity = {});

// Static + max of AnyPlanProfiles per rank.
std::vector<int64_t> AnyPlanLowerBounds(const PlanningProblem& p);

}  // namespace memplan::planner
