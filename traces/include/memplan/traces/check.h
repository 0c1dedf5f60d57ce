// `memplan check`: compares a plan's predictions with a measurement.
//
// The rule (docs/design.md, docs/formats.md): a rank passes when
//   lower_bound <= allocated_peak <= lower_bound * (1 + tolerance)   and
//   measured peak <= predicted peak * (1 + tolerance).
// The first says the allocator-independent prediction is exact (no plan can
// beat its lower bound; a measurement below it means the plan or the
// measurement misses allocations); the second that the allocator does no
// worse than the planner's simulation of it. The default tolerance follows
// the measurement's allocator: 0 for an arena (one block per rank at the
// planner's offsets, host or cuda: exact by construction), 2 % for a pool.
//
// Where the measurement carries CUPTI's view, two more sources are checked
// at the same tolerance (docs/runtime.md, "What is measured"):
//   - per rank, CUPTI's bytes equal the allocator's: in arena mode the
//     rank's live device allocations (its arenas) equal its measured peak;
//     in pool mode CUPTI's reserved bytes equal the pool's reserved mark;
//   - per process, every device byte CUPTI saw equals the sum of the ranks'
//     measured peaks: nothing outside the plan took device memory (the
//     CUDA context and the profiler's own bytes are reported, not counted:
//     CUPTI records no allocation for them).
//
// Only the plan's schema, digest and ranks[].{pp_rank, peak, lower_bound}
// are read here, so traces/ does not depend on the planner library;
// schemas/plan.schema.json validates the rest.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "memplan/common/json_util.h"
#include "memplan/common/status.h"
#include "memplan/traces/measured.h"

namespace memplan::traces {

inline constexpr double kHostTolerance = 0.0;  // allocator "arena"
inline constexpr double kCudaTolerance = 0.02;  // allocator "pool"
// A framework's job profiled (a plan for target megatron): its reserved
// bytes are a prediction of PyTorch's allocator and NCCL's buffers
// (docs/targets.md, "What only a GPU can tell").
inline constexpr double kFrameworkTolerance = 0.05;

struct PlanRankBounds {
  int64_t pp_rank = 0;
  int64_t peak = 0;         // predicted allocator high-water mark, bytes
  int64_t lower_bound = 0;  // max over steps of live bytes, bytes
  // Plans for a framework target: PyTorch's reserved bytes at the peak and
  // the device bytes NCCL allocates beside them (its communicators'
  // buffers; the CUDA context is not a device allocation).
  int64_t reserved = 0;
  int64_t nccl = 0;
};

struct PlanBounds {
  std::string digest;  // "sha256:<64 hex>"
  std::vector<PlanRankBounds> ranks;
  double emulated_s = 0;  // overhead.emulated_s (0: an older plan without it)
  int64_t dp = 1;         // model.parallel.dp: replicas of every pipeline rank
  int64_t ep = 1;         // model.parallel.ep: a replica's place in its EP group is dp_rank % ep
  int64_t tp = 1;         // model.parallel.tp: tensor-parallel ranks of every replica
  int64_t cp = 1;         // model.parallel.cp: context-parallel ranks of every replica
  // static.runtime_detail.cuda_context of the first rank: the plan's CUDA
  // context (0: a host plan or an older one).
  int64_t cuda_context = 0;
  // The plan's /target ("memplan" when absent): a framework's plan is
  // checked against a profile of its job, device by device in its rank
  // order (tp fastest, then cp, dp, pp).
  std::string target = "memplan";
};

// Reads the bounds from a PLAN.json document; other keys are ignored.
// Errors are kBadInput, one line naming `file` and the JSON pointer.
Expected<PlanBounds> ParsePlanBounds(const Json& json, const std::string& file);

struct CheckOptions {
  // Relative tolerance in [0, 1]; default by backend (kHostTolerance,
  // kCudaTolerance).
  std::optional<double> tolerance;
  // Names used in messages.
  std::string plan_file = "PLAN.json";
  std::string measured_file = "MEASURED.json";
  // A profile of another program (source cupti-injection) has one entry
  // per device, not per rank: with `ranks_from_devices`, the measurement's
  // i-th entry (devices in order) stands for the plan's i-th rank, and no
  // digest is compared. Without it, such a measurement is refused.
  bool ranks_from_devices = false;
};

// One rank's comparison; bytes throughout.
struct RankCheck {
  int64_t pp_rank = 0;
  std::optional<int64_t> device;  // ranks_from_devices: the device standing for the rank
  int64_t predicted_peak = 0;
  int64_t measured_peak = 0;
  int64_t lower_bound = 0;
  int64_t allocated_peak = 0;
  std::optional<int64_t> cupti_bytes;  // CUPTI's bytes compared with measured_peak
  bool pass = false;
  std::string verdict;  // "pass", or why not, with the excess in bytes
  std::optional<int64_t> dp_rank;  // the data-parallel replica, when the run had several
  std::optional<int64_t> tp_rank;  // the tensor-parallel rank, when the run had several
  std::optional<int64_t> cp_rank;  // the context-parallel rank, when the run had several
};

// The process-wide comparison (measurements with a `process` object).
struct ProcessCheck {
  int64_t cupti_device_bytes = 0;  // every device allocation CUPTI saw
  int64_t expected_bytes = 0;      // sum of the ranks' measured peaks
  int64_t context_bytes = 0;       // reported only
  int64_t profiler_bytes = 0;      // reported only
  int64_t planned_context = 0;     // the plan's cuda_context item (informational)
  bool pass = false;
  std::string verdict;
};

// Predicted against measured time of the step's forwards and backwards
// (informational: never fails the check). The prediction is the plan's
// overhead.emulated_s, every rank in turn as one process runs them.
struct TimeCheck {
  double predicted_s = 0;
  double measured_s = 0;
  double diff = 0;  // (measured - predicted) / predicted
};

struct CheckResult {
  std::optional<TimeCheck> time;  // when both sides have the numbers
  double tolerance = 0;
  std::string allocator;         // the measurement's ("arena" | "pool")
  std::string source;            // the measurement's ("runtime" | "cupti-injection")
  bool pass = false;             // every rank (and the process) passes
  std::vector<RankCheck> ranks;  // in the plan's rank order
  std::optional<ProcessCheck> process;
  // A cuda run whose CUPTI did not start or dropped records (fails).
  bool cupti_missing = false;
};

// Compares plan and measurement rank by rank. Errors: kDigestMismatch when
// the measurement was taken for another plan; kBadInput when the sets of pp
// ranks differ or the tolerance is out of range. A failed verdict is not an
// error: it is CheckResult::pass == false.
Expected<CheckResult> Check(const PlanBounds& plan, const Measured& measured, const CheckOptions& options = {});

// Aligned table: pp_rank, predicted peak, measured peak, lower bound,
// allocated peak, CUPTI's bytes when present (MiB when all below 1 GiB,
// else GiB) and the verdict; then the process line when present. With
// `failures_only`, only the ranks that fail.
std::string RenderCheckTable(const CheckResult& result, bool failures_only = false);

}  // namespace memplan::traces
