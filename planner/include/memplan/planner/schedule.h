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

// Start time of every pass of every rank's schedule: a forward of
// (microbatch, virtual stage v) waits for stage v - 1, a backward for v + 1
// or its own forward on the last stage, and a rank runs one pass at a time
// in its schedule's order. `stage_fwd_s`, `stage_bwd_s`: per virtual stage
// (chunk * pp + rank). Returns per rank the pass starts; `makespan_s`, when
// given, the last pass's end. With equal stages it reproduces the closed
// forms: 1F1B's bubble (pp - 1) / (m + pp - 1), interleaved (pp - 1) / (vp m)
// (tests/planner_test.cc).
std::vector<std::vector<double>> PassStarts(const std::vector<RankSchedule>& schedules, int64_t pp, int64_t vp,
                                            int64_t microbatches, const std::vector<double>& stage_fwd_s,
                                            const std::vector<double>& stage_bwd_s, double* makespan_s);

// Largest number of forward passes whose backward has not run yet, over the
// schedule: the in-flight peak of (microbatch, chunk) activations.
int64_t MaxInFlight(const RankSchedule& schedule);

}  // namespace memplan::planner
