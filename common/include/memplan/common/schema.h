// Validating documents against memplan's JSON Schemas (schemas/, compiled
// into the library): a plan or measurement read back by `run` or `check`
// is checked whole before any field is used, so a wrong type or an unknown
// key anywhere is refused with its JSON pointer instead of being ignored.
#pragma once

#include <string>

#include "memplan/common/json_util.h"
#include "memplan/common/status.h"

namespace memplan {

enum class SchemaKind { kModel, kPlan, kMeasured, kHardware, kSearch };

// Errors: kBadInput, "FILE: POINTER: what the schema expected" (the first
// violation valijson reports, deepest location first).
Expected<bool> ValidateSchema(const Json& doc, SchemaKind kind, const std::string& file);

}  // namespace memplan
