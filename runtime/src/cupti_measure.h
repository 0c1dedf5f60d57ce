// What `memplan run --backend cuda` adds to MEASURED.json from CUPTI: each
// rank's device bytes as the driver saw them (records attributed to the
// rank's arenas or pool allocations) and the process's total, context and
// profiler bytes (docs/runtime.md, "Three measurements").
#pragma once

#include <cstdint>
#include <vector>

#include "memplan/traces/footprint.h"
#include "memplan/traces/measured.h"

namespace memplan::runtime {

struct CuptiMeasureInput {
  std::vector<traces::OwnerRegions> regions;  // owner = pp_rank
  int64_t context_bytes = 0;  // device bytes in use before the first allocation
  int64_t used_at_end = 0;    // device bytes in use with every rank's memory still held
};

// Drains `source` (a CuptiSource after Flush(); a VectorRecordSource in
// tests), then fills every rank's `cupti` and the measurement's `process`.
// Records that no rank owns (cuBLAS's workspace, kernel scratch) count in
// the process total only, where `check` flags them.
void AttachCupti(traces::MemoryRecordSource& source, const CuptiMeasureInput& input, traces::Measured& measured);

}  // namespace memplan::runtime
