// The periodic window (docs/planner.md, "Periodic window"): plan on a few
// microbatches, answer for all of them.
//
// In the steady state of (interleaved) 1F1B every rank repeats one period:
// `unit` microbatches (1 for plain 1F1B, pp interleaved), each forward and
// backward of each chunk, in 2 * unit * vp passes that take `period_s`. A
// model with M microbatches runs warm-up, (M - W) / unit steady periods and
// cool-down; a model with fewer microbatches runs the same warm-up and
// cool-down with fewer periods in between. FindWindow picks the smallest
// simulated count M0 (M0 = M mod unit) whose pipeline timing, pass by pass,
// is the model's with `periods` copies of one steady period left out, at
// one common time `cut_s` on every rank, with a periodic neighbourhood
// around it at least one saved tensor's lifetime wide on each side. Then
// every step of the model's timeline is a translate of a step of the
// window's with the same live bytes, and every decision and bound made on
// the window holds for the model; time sums
// (recompute, quantize, exposed transfer) count the repeated period's
// (chunk, microbatch) pairs 1 + periods times.
//
// The memory program's periodicity is checked, not assumed: before it
// places the model's program, bounds.cc compares the window's allocations
// in the period after the cut with the period before it, translated, and
// the planner falls back to simulating every microbatch when they differ.
// The placement itself is the deterministic best fit of the model's whole
// program, streamed from the window's (PlacePeriodic): byte for byte the
// full simulation's, in the window's memory.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "memplan/planner/schedule.h"

namespace memplan::planner {

struct PeriodicWindow {
  int64_t microbatches = 0;  // the model's
  int64_t simulated = 0;     // the window's (M0)
  int64_t unit = 1;          // microbatches per period
  int64_t periods = 0;       // periods left out: (microbatches - simulated) / unit
  int64_t period_passes = 0; // passes per period per rank: 2 * unit * vp
  double period_s = 0;
  double cut_s = 0;          // where the left-out periods go, on every rank
  // Per rank: the window's first pass at or after cut_s (the repeated
  // period is the period_passes passes before it).
  std::vector<int64_t> cut_pass;
  // Per rank, per (chunk * simulated + microbatch): 0 before the repeated
  // period, 1 in it, 2 after it (by its forward pass).
  std::vector<std::vector<uint8_t>> role;
  std::vector<RankSchedule> schedules;       // of the window
  std::vector<std::vector<double>> starts;   // of the window's passes

  // How many of the model's (chunk, microbatch) pairs the window's stands
  // for: 1 + periods in the repeated period, else 1.
  int64_t Weight(int32_t rank, int32_t chunk, int32_t microbatch) const;
  // The model's microbatches that window microbatch `microbatch` of
  // `chunk` on `rank` stands for.
  std::vector<int32_t> ModelMicrobatches(int32_t rank, int32_t chunk, int32_t microbatch) const;
};

// The smallest periodic window for M microbatches, or nullopt when the
// model is too short for one (then plan everything). `full` and
// `full_starts` are the model's schedules and pass starts.
std::optional<PeriodicWindow> FindWindow(int64_t pp, int64_t vp, int64_t microbatches,
                                         const std::vector<double>& stage_fwd_s, const std::vector<double>& stage_bwd_s,
                                         const std::vector<RankSchedule>& full,
                                         const std::vector<std::vector<double>>& full_starts, double full_makespan_s);

}  // namespace memplan::planner
