// What import, plan and search assumed that the user may not have said
// (docs/planner.md, "Assumptions"): the hardware preset and how the budget
// was derived, dtypes, optimizer and ZeRO stage, the layout, SP, the
// attention kind, MoE routing, the storage kinds allowed and the host
// memory for offloads; each row names the flag or model field that
// changes it. The commands print it on stderr; -q silences it.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "memplan/planner/model.h"

namespace memplan::planner {

enum class AssumptionsFor { kImport, kPlan, kSearch };

struct AssumptionsContext {
  AssumptionsFor verb = AssumptionsFor::kPlan;
  std::optional<int64_t> budget;  // --budget, when given on the command line
};

// The aligned table (with its heading line). Import also prints the
// parameter totals (total and active per token).
std::string RenderAssumptions(const Model& model, const AssumptionsContext& context);

}  // namespace memplan::planner
