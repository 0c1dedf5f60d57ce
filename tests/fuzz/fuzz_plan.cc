// Fuzz target: PLAN.json as `memplan run` (ValidatePlan: schema, embedded
// model, digest, rebuild) and `memplan check` (ParsePlanBounds) read it.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "fuzz_util.h"
#include "memplan/common/json_util.h"
#include "memplan/runtime/executor.h"
#include "memplan/traces/check.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace memplan;
  auto doc = fuzz::Parse(data, size);
  if (!doc) return 0;
  auto bounds = traces::ParsePlanBounds(*doc, fuzz::kFile);
  if (!bounds) fuzz::CheckError(bounds.error());
  auto valid = runtime::ValidatePlan(*doc, fuzz::kFile);
  if (!valid) fuzz::CheckError(valid.error());
  return 0;
}
