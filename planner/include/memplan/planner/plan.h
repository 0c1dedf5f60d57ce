// Planning entry point and PLAN.json (`memplan.plan/1`).
//
// BuildPlan() runs the planner's stages on a parsed model: expand the layers
// (templates or explicit graph), lay them out over pipeline ranks, account
// static memory per rank, schedule, simulate liveness, rebalance across
// pipeline ranks (pp_balance), decide every saved tensor's storage under the
// budget, bound and verify. A budget below a rank's any-plan lower bound is
// an ErrorCode::kInfeasible error; a rank that cannot fit because
// annotations pin its tensors is reported with fits = false and a warning.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string_view>
#include <string>
#include <vector>

#include "memplan/common/json_util.h"
#include "memplan/common/status.h"
#include "memplan/planner/accounting.h"
#include "memplan/planner/graph.h"
#include "memplan/planner/layout.h"
#include "memplan/planner/model.h"
#include "memplan/planner/schedule.h"
#include "memplan/planner/solver.h"

namespace memplan::planner {

inline constexpr std::string_view kPlanSchema = "memplan.plan/1";

struct PlanOptions {
  std::optional<int64_t> budget;  // overrides the model's budget (bytes)
  std::optional<int64_t> headroom = std::nullopt;  // overrides the model's headroom (bytes)
  SolverKind solver = SolverKind::kHeuristic;
  bool sweep = false;   // also compute the budget / step-time trade-off curve
  bool verify = false;  // run the plan verifier (always on in tests)
  // Simulate every microbatch even where a periodic window stands for them
  // (period.h): the oracle, and what the periodic window is checked against.
  bool full_simulation = false;
  int sweep_points = 12;
  // Called after each planner stage with its name and wall time (ms).
  std::function<void(std::string_view stage, double ms)> on_stage = nullptr;
  // Under a target without per-tensor storage: one line after each round
  // of choosing its settings (plans so far, the best so far).
  std::function<void(const std::string& line)> on_progress = nullptr;
  // Search: called once the decisions are solved, before the first
  // placement, with the step they imply (placement can only tighten the
  // budgets, so the placed plan is rarely faster); again in each host-side
  // round (pinning host offloads to recompute only adds cost). False: the
  // plan stops there, BuildPlan fails with kInfeasible and *not_placed is
  // set.
  std::function<bool(double step_s)> place_if = nullptr;
  bool* not_placed = nullptr;
  // Search: when the first plan's offloads pass the host's memory, stop
  // before the host-side rounds (BuildPlan fails with kInfeasible and
  // *deferred is set), so that they run once the top steps are known.
  bool* deferred = nullptr;
};

struct RankPlan {
  int64_t pp_rank = 0;
  std::vector<int64_t> layers;
  std::vector<std::vector<int64_t>> chunks;
  StaticBreakdown statics;
  int64_t activations_per_microbatch = 0;  // all chunks, one microbatch each
  std::vector<int64_t> chunk_activation_bytes;  // per chunk, one microbatch
  std::vector<int64_t> in_flight_chunks;        // per chunk, at the peak
  int64_t activations_peak = 0;
  int64_t peak = 0;
  int64_t lower_bound = 0;
  int64_t keep_all_lower_bound = 0;  // every activation kept (annotations ignored)
  int64_t any_plan_lower_bound = 0;
  int64_t budget = 0;
  // What the target's allocator holds at the peak (target.h): memplan's
  // arena holds exactly `peak` (allocated = reserved = peak); PyTorch's
  // caching allocator, replayed over the same memory program, rounds
  // blocks (allocated) and caches segments (reserved). Both include static
  // memory; neither includes `statics.runtime`.
  int64_t allocated = 0;
  int64_t reserved = 0;
  // budget - reserved - statics.runtime: what is left at the peak.
  int64_t margin = 0;
  // fits: margin >= 0 and the host side fits.
  bool fits = false;
  // Host bytes this GPU's process needs at their peak: the training state
  // kept on the host (statics.host) plus offloaded activations.
  int64_t host_peak = 0;
  double recompute_s = 0, quantize_s = 0, exposed_transfer_s = 0;
  std::vector<std::pair<int32_t, int64_t>> remote_offload;  // (to rank, bytes)
  // Offloaded instances whose copy-out cannot finish before their prefetch
  // window opens: they stay on the device, counted as kept (tensor name,
  // microbatch), in schedule order.
  std::vector<std::pair<std::string, int32_t>> resident_offloads;
};

struct Overhead {
  double recompute_s = 0;
  double quantize_s = 0;
  double exposed_transfer_s = 0;
  double step_s = 0;      // base pipeline step plus the critical rank's added time
  double base_step_s = 0;
  // Every rank's forwards and backwards one after another, with their
  // recompute and FP8 time: what one process emulating the whole pipeline
  // computes (`memplan run`), compared with the measured step by `check`.
  double emulated_s = 0;
  // Communication (comm.h), inside base_step_s: what the busiest rank's
  // passes wait on TP / CP / EP groups, and the largest data-parallel
  // reduction left after a rank's last backward.
  double comm_s = 0;
  double dp_exposed_s = 0;
  // PCIe contention (liveness.h PlanningProblem::offload_bw_share).
  double offload_bw_share = 1;
  double inter_node_bytes_per_s = 0;
};

struct SweepPoint {
  int64_t budget = 0;
  bool fits = false;
  int64_t max_peak = 0;
  double added_s = 0;
  double step_s = 0;
};

struct TensorEntry {
  std::string name;
  int64_t layer = 0;
  std::string module;
  int64_t pp_rank = 0;
  int64_t chunk = 0;
  std::vector<int64_t> shape;
  DType dtype = DType::kBF16;
  int64_t bytes = 0;
  std::vector<Policy> policy;     // the annotation, or keep
  std::vector<Policy> effective;  // what the plan does
  int64_t device_bytes = 0;
  std::string annotation;  // glob that matched, if any
  int32_t to_pp_rank = -1;  // remote offload target
};

// What the liveness simulated (docs/planner.md, "Periodic window").
struct PlanSimulation {
  int64_t microbatches = 0;         // the model's
  int64_t simulated = 0;            // the periodic window's, or all of them
  int64_t period_microbatches = 0;  // 0: no window
  // Why every microbatch was simulated although a window was found, or empty.
  std::string fallback;
};

struct Plan {
  // With options applied (budget override); under a target without
  // per-tensor storage, target.settings holds the settings chosen, so
  // planning plan.model again gives this plan.
  Model model;
  // What plan and search keep free under the budget (model.headroom or
  // the target's default); a rank whose margin is smaller is warned.
  int64_t headroom = 0;
  // The settings the planner tried before the chosen ones, in order, with
  // their worst margin (targets without per-tensor storage).
  std::vector<std::pair<FrameworkSettings, int64_t>> settings_tried;
  PlanSimulation simulation;
  std::string digest;
  ModelTotals totals;
  std::vector<RankPlan> ranks;
  std::vector<TensorEntry> tensors;
  std::vector<RankSchedule> schedules;
  Overhead overhead;
  RebalanceResult rebalance;
  SolverKind solver = SolverKind::kHeuristic;
  std::vector<SweepPoint> sweep;
  std::vector<std::string> warnings;
  std::vector<std::string> verify_errors;
  bool verified = false;
};

Expected<Plan> BuildPlan(const Model& model, const PlanOptions& options = {});

// What a step time means in the units training runs publish (docs/planner.md,
// "Throughput"): model FLOPs per token counted as PaLM's appendix B does,
// 6 N + 6 L_attn heads (d_qk + d_v) s, with N the active parameters less
// the input embedding and position tables, over the softmax-attention
// layers; tokens per second per GPU; and the model FLOPs utilization
// against the hardware's dense bf16 peak. All of it is modelled: `source`
// says from what ("preset h100", or "calibrated" for a hardware file).
struct Throughput {
  double flops_per_token = 0;
  double tokens_per_s_per_gpu = 0;
  double mfu = 0;  // fraction
  std::string source;
};
double ModelFlopsPerToken(const Model& model, const ModelTotals& totals);
Throughput ModelledThroughput(const Model& model, const ModelTotals& totals, double step_s);
// "modelled: 1234 tokens/s per GPU, MFU 41.2 % (preset h100)".
std::string ThroughputLine(const Throughput& t);

// fnmatch over the whole name, case-sensitive, '*' crossing dots.
bool GlobMatch(const std::string& pattern, const std::string& name);

OrderedJson PlanToJson(const Plan& plan);

// The per-rank table (GiB) printed by `memplan plan`.
std::string RenderPlanTable(const Plan& plan);

// `memplan expand`: the normalized model with every layer's graph filled in.
Expected<Json> ExpandedModelJson(const Model& model);

}  // namespace memplan::planner
