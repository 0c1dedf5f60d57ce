// Fuzz target: a calibration file (memplan.hardware/1) as a model's
// "hardware": {"calibration": ...} reads it: a Hardware, or one line
// naming the file and the JSON pointer.
#include <cstddef>
#include <cstdint>

#include "fuzz_util.h"
#include "memplan/planner/model.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace memplan;
  auto doc = fuzz::Parse(data, size);
  if (!doc) return 0;
  auto hw = planner::ParseHardwareFile(*doc, fuzz::kFile);
  if (!hw) {
    fuzz::CheckError(hw.error());
  } else if (!(hw->bf16_flops > 0) || !(hw->hbm_bw > 0) || !(hw->device_memory > 0)) {
    fuzz::Broken("an accepted calibration has a non-positive rate or memory", "");
  }
  return 0;
}
