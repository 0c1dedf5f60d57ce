#include "memplan/traces/profile.h"

#include <algorithm>
#include <set>

namespace memplan::traces {

Measured ProfileFromRecords(const std::vector<MemoryRecord>& memory, const std::vector<PoolRecord>& pools) {
  Measured m;
  m.backend = "cuda";
  m.source = "cupti-injection";
  m.allocator = "pool";  // whatever the program used; compared at the pool tolerance
  m.device = "CUPTI profile";
  std::set<int32_t> devices;
  int64_t t0 = INT64_MAX;
  for (const auto& r : memory) {
    if (r.kind != MemoryKind::kDevice) continue;
    devices.insert(r.device_id);
    t0 = std::min(t0, r.timestamp_ns);
  }
  for (int32_t d : devices) {
    FootprintOptions o;
    o.device_id = d;
    Footprint f = ReconstructFootprint(memory, pools, o);
    MeasuredRank rank;
    rank.pp_rank = d;
    rank.allocated_peak = f.allocated_peak;
    rank.peak = f.reserved_peak;
    for (const auto& s : f.samples) {
      rank.timeline.push_back({static_cast<double>(s.timestamp_ns - t0) / 1000.0, s.allocated_bytes});
    }
    for (const auto& r : memory) {
      if (r.kind != MemoryKind::kDevice || r.device_id != d) continue;
      ++rank.events[r.op == MemoryOp::kAllocation ? "allocations" : "releases"];
    }
    rank.cupti = CuptiRankBytes{f.allocated_peak, f.reserved_peak, rank.timeline};
    m.ranks.push_back(std::move(rank));
  }
  return m;
}

}  // namespace memplan::traces
