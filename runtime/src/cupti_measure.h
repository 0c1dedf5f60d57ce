// What `memplan run --backend cuda` adds to MEASURED.json from CUPTI: each
// rank's device bytes as the driver saw them (records attributed to the
// rank's arenas or pool allocations) and the process's total, context and
// profiler bytes (docs/runtime.md, "Three measurements").
#pragma once

#include <cstdint>
#include <vector>

#include "memplan/traces/chrome_trace.h"
#include "memplan/traces/gpu_profiler.h"
#include "memplan/traces/footprint.h"
#include "memplan/traces/gpu_timeline.h"
#include "memplan/traces/measured.h"

namespace memplan::runtime {

struct CuptiMeasureInput {
  std::vector<traces::OwnerRegions> regions;  // owner = pp_rank
  int64_t context_bytes = 0;  // device bytes in use before the first allocation
  int64_t used_at_end = 0;    // device bytes in use with every rank's memory still held
  int64_t epoch_ns = 0;       // CUPTI's clock at the run's time 0 (0: the first record's time)
};

// Drains `source` (a CuptiSource after Flush(); a VectorRecordSource in
// tests), then fills every rank's `cupti` and the measurement's `process`.
// Records that no rank owns (cuBLAS's workspace, kernel scratch) count in
// the process total only, where `check` flags them.
// Each rank's CUPTI bytes over time are on the run's time axis (µs since
// `epoch_ns`; set-up allocations before it at 0).
void AttachCupti(traces::MemoryRecordSource& source, const CuptiMeasureInput& input, traces::Measured& measured);

// TRACE.json's GPU side: CUPTI's kernels, copies and memsets
// (CuptiSource::DrainActivities) on their streams (gpu_timeline.h), and
// each rank's CUPTI bytes (from `measured`, after AttachCupti) as the
// cupti_device_memory counter.
traces::GpuTimelineCounts AddCuptiTrace(const std::vector<traces::GpuActivity>& activities,
                                        const traces::GpuTimelineInput& input, const traces::Measured& measured,
                                        traces::ChromeTrace& trace);

}  // namespace memplan::runtime
