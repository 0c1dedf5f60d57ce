// A profile of another program (`memplan profile -- CMD`): CUPTI's memory
// records turned into a MEASURED.json with one entry per device
// (source "cupti-injection"). `memplan check --ranks-from devices` compares
// it with a plan, device i standing for rank i.
#pragma once

#include <vector>

#include "memplan/traces/footprint.h"
#include "memplan/traces/measured.h"

namespace memplan::traces {

// One entry per device with device-memory records, in device order:
// pp_rank = the device ordinal, allocated_peak and peak = CUPTI's live and
// reserved maxima, static 0, the allocated timeline (microseconds from the
// first record), events {allocations, releases}, and `cupti` with the same
// numbers plus every memory record of the device (allocations: time, op,
// address, size, stream, kind, pool) and its pools' events. No plan digest,
// loss or gradient norm (zeros).
Measured ProfileFromRecords(const std::vector<MemoryRecord>& memory, const std::vector<PoolRecord>& pools);

}  // namespace memplan::traces
