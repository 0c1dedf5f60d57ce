// Planning entry point and PLAN.json (`memplan.plan/1`).
//
// BuildPlan() runs the planner's stages on a parsed model: expand the layers
// (templates or explicit graph), lay them out over pipeline ranks, account
// static memory per rank, and size activations. Until the policy solver
// lands, every saved tensor is kept (`activation_model: "keep_all"`), and a
// rank's activation peak is the in-flight microbatches of each chunk at its
// 1F1B peak times that chunk's saved bytes per microbatch.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "memplan/common/json_util.h"
#include "memplan/common/status.h"
#include "memplan/planner/accounting.h"
#include "memplan/planner/graph.h"
#include "memplan/planner/layout.h"
#include "memplan/planner/model.h"

namespace memplan::planner {

inline constexpr std::string_view kPlanSchema = "memplan.plan/1";

struct PlanOptions {
  std::optional<int64_t> budget;  // overrides the model's budget (bytes)
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
  int64_t budget = 0;
  bool fits = false;
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
};

struct Plan {
  Model model;  // with options applied (budget override)
  std::string digest;
  ModelTotals totals;
  std::vector<RankPlan> ranks;
  std::vector<TensorEntry> tensors;
  std::vector<std::string> warnings;
};

Expected<Plan> BuildPlan(const Model& model, const PlanOptions& options = {});

// fnmatch over the whole name, case-sensitive, '*' crossing dots.
bool GlobMatch(const std::string& pattern, const std::string& name);

OrderedJson PlanToJson(const Plan& plan);

// The per-rank table (GiB) printed by `memplan plan`.
std::string RenderPlanTable(const Plan& plan);

// `memplan expand`: the normalized model with every layer's graph filled in.
Expected<Json> ExpandedModelJson(const Model& model);

}  // namespace memplan::planner
