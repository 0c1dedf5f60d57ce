// Parts of the model reader shared between model.cc and model_target.cc;
// not a public header.
#pragma once

#include "memplan/common/json_util.h"
#include "memplan/planner/model.h"

namespace memplan::planner {

// The model file's `target` (docs/formats.md) into m.target; absent: memplan.
// Throws ErrorException at the offending JSON pointer.
void ParseTarget(const Json* value, const JsonLocation& where, Model& m);

// A model file's (or a calibration's) `hardware` object, from its preset
// or calibration file and the keys that override them (hardware.cc).
Hardware ParseHardwareObject(ObjectReader& r);

}  // namespace memplan::planner
