// Reading a PLAN.json back (docs/design.md, "Formats"): its embedded model
// and the storage its /tensors decided. The runtime executes what these
// give (runtime/src/plan_binding.cc); `memplan viz` draws it.
#pragma once

#include <set>
#include <string>
#include <vector>

#include "memplan/common/json_util.h"
#include "memplan/common/status.h"
#include "memplan/planner/liveness.h"
#include "memplan/planner/model.h"
#include "memplan/planner/program.h"

namespace memplan::planner {

// The plan's header and schema checked, and its model (its digest equal to
// /digest). Errors (kBadInput) name `file` and the JSON path.
Expected<Model> ReadPlanModel(const Json& plan, const std::string& file);

// The storage (and remote target) /tensors decided for every saved tensor of
// `p` (the problem rebuilt from the plan's model): one of the legal
// compositions each, every tensor listed once.
Expected<Assignment> ReadPlanAssignment(const Json& plan, const std::string& file, const PlanningProblem& p);

// What a run executes, as one sha256: the model digest and every saved
// tensor's storage and remote target, in the problem's order. Two plans
// with one model digest but other decisions differ here; processes of one
// launch compare it before their first step.
std::string ExecutionDigest(const std::string& model_digest, const Assignment& a);

// Every pipeline rank's predicted memory program under a plan (its model
// and storage decisions re-planned by this planner), in model terms: the
// buffers with their steps, and each step's name ("layer3.mlp.fc1.bwd@mb1",
// the op, its pass and microbatch). `check` compares eager runs with it.
struct RankProgram {
  std::vector<PredictedBuffer> buffers;
  std::vector<std::string> steps;
  // The routed tensors whose rows the plan holds at capacity above the mean
  // (Moe::RoutedRowsFactor > 1: the EP skew, a capacity factor): how many
  // rows a rank receives depends on the routing, so their kernels may leave
  // the reserve unwritten (the eager witness's check knows them).
  std::set<std::string> routed_reserve;
};
Expected<std::vector<RankProgram>> ReplayPrograms(const Json& plan, const std::string& file);

}  // namespace memplan::planner
