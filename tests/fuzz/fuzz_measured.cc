// Fuzz target: MEASURED.json as `memplan check` reads it, then the check
// itself against a plan whose digest and ranks match, so that mutated
// numbers reach the verdict and the table.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "fuzz_util.h"
#include "memplan/common/json_util.h"
#include "memplan/traces/check.h"
#include "memplan/traces/measured.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace memplan;
  auto doc = fuzz::Parse(data, size);
  if (!doc) return 0;
  auto measured = traces::ParseMeasured(*doc, fuzz::kFile);
  if (!measured) {
    fuzz::CheckError(measured.error());
    return 0;
  }
  traces::PlanBounds plan;
  plan.digest = measured->plan_digest;
  int64_t peak = 1 << 20;
  for (const auto& r : measured->ranks) plan.ranks.push_back({r.pp_rank, peak, peak / 2});
  auto result = traces::Check(plan, *measured, {std::nullopt, "plan.json", fuzz::kFile});
  if (!result) {
    fuzz::CheckError(result.error(), "");
    return 0;
  }
  if (traces::RenderCheckTable(*result, true).empty()) fuzz::Broken("empty check table", "");
  return 0;
}
