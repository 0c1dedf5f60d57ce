// Eager execution against the plan, step by step (docs/runtime.md, "Eager
// execution"): the plan's predicted buffers of a rank (from the planner's
// memory program) and the buffers an eager run allocated and freed, both in
// model terms, compared at every step of the rank.
//
// Two kinds of lifetime are told apart:
//   - timing-independent: every buffer whose end is its last use; the
//     live set (name, part, bytes) must be the same at every step;
//   - copy-timed (`staging`): a payload on the device until its copy-out is
//     over. Its end is a copy's completion, which the plan's time model
//     predicts and the run measures; such lifetimes may move. They are
//     reported (which, by how many steps, earlier or later) and pass when
//     the allocated peak differs from the predicted one by no more than the
//     bytes of the moved buffers explain.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "memplan/traces/measured.h"

namespace memplan::traces {

struct PredictedLife {
  int64_t first = 0, last = 0;  // the rank's steps, inclusive
  int64_t bytes = 0;
  std::string name, part;
  bool copy_timed = false;
};

// A buffer live in one timeline and not in the other.
struct LiveBuffer {
  std::string name, part;
  int64_t bytes = 0;
};

struct MovedLifetime {
  std::string name, part;
  int64_t bytes = 0;
  int64_t predicted_last = 0, measured_last = 0;  // its last step in each
};

struct TimelineComparison {
  int64_t steps = 0;            // steps compared
  int64_t buffers = 0;          // measured buffers matched
  int64_t divergent_steps = 0;  // steps whose timing-independent live sets differ
  // The first divergent step: its bytes in each, and what only one has.
  std::optional<int64_t> first_step;
  int64_t predicted_bytes = 0, measured_bytes = 0;
  std::vector<LiveBuffer> only_predicted, only_measured;
  // Copy-timed lifetimes that moved, and their bytes.
  std::vector<MovedLifetime> moved;
  int64_t moved_bytes = 0;
  // Live activation bytes at their maximum (every buffer).
  int64_t predicted_peak = 0, measured_peak = 0;
  bool pass = false;
  std::string verdict;  // "pass", or the first divergence in one line
};

// `describe(step)` names a step in model terms (e.g. "layer3.mlp.fc1.bwd@mb1").
TimelineComparison CompareTimelines(const std::vector<PredictedLife>& predicted,
                                    const std::vector<StepAllocation>& measured, int64_t steps,
                                    const std::function<std::string(int64_t)>& describe);

}  // namespace memplan::traces
