// Fuzz target: MODEL.json as `memplan plan` and `memplan expand` read it.
// Every input is parsed and validated; a model that validates and is small
// enough to plan in milliseconds is also expanded and planned, so the
// accounting, schedule and solver meet mutated numbers too.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "fuzz_util.h"
#include "memplan/common/json_util.h"
#include "memplan/planner/model.h"
#include "memplan/planner/plan.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace memplan;
  auto doc = fuzz::Parse(data, size);
  if (!doc) return 0;
  auto model = planner::ParseModel(*doc, fuzz::kFile);
  if (!model) {
    fuzz::CheckError(model.error());
    return 0;
  }
  const auto& m = *model;
  // Planning cost grows with layers x microbatches x experts; the fuzzer
  // explores the rules, not the planner's speed (bench/ measures that).
  const int64_t experts = m.arch.moe ? m.arch.moe->experts : 1;
  if (m.arch.layers > 16 || m.train.microbatches > 16 || experts > 64 || m.parallel.pp * m.parallel.vp > 16) return 0;
  auto expanded = planner::ExpandedModelJson(m);
  if (!expanded) fuzz::CheckError(expanded.error());
  auto plan = planner::BuildPlan(m);
  if (!plan) {
    // Infeasible budgets (exit 3) are answers, not bad input.
    fuzz::CheckError(plan.error(), "");
    return 0;
  }
  if (auto at = FindNonFinite(planner::PlanToJson(*plan))) fuzz::Broken("plan holds a non-finite number", *at);
  return 0;
}
