// Pipeline schedules (stage 4): each pipeline rank's order of forward and
// backward passes of (microbatch, model chunk), as Megatron-LM executes 1F1B
// (vp = 1) and interleaved 1F1B (vp > 1).
//
// Plain 1F1B on rank r: min(pp - r - 1, m) warm-up forwards, then one
// forward + one backward per step, then the cool-down backwards.
// Interleaved: warm-up min(2*(pp - r - 1) + (vp - 1)*pp, m*vp) forwards;
// virtual forward k runs chunk (k / pp) % vp on microbatch
// (k / (pp*vp))*pp + k % pp, and virtual backward k runs chunk
// vp - 1 - (k / pp) % vp on the same microbatch formula.
#pragma once

#include <cstdint>
#include <vector>

namespace memplan::planner {

struct PassRef {
  bool forward = true;
  int32_t microbatch = 0;
  int32_t chunk = 0;
  bool operator==(const PassRef&) const = default;
};

using RankSchedule = std::vector<PassRef>;

// One schedule per pipeline rank. Requires m >= pp, and m % pp == 0 when
// vp > 1 (validated with the model).
std::vector<RankSchedule> BuildSchedules(int64_t pp, int64_t vp, int64_t microbatches);

// Largest number of forward passes whose backward has not run yet, over the
// schedule: the in-flight peak of (microbatch, chunk) activations.
int64_t MaxInFlight(const RankSchedule& schedule);

}  // namespace memplan::planner
