#include "memplan/traces/profile.h"

#include <algorithm>
#include <set>

namespace memplan::traces {
namespace {

const char* KindName(MemoryKind k) {
  switch (k) {
    case MemoryKind::kPageable: return "pageable";
    case MemoryKind::kPinned: return "pinned";
    case MemoryKind::kDevice: return "device";
    case MemoryKind::kArray: return "array";
    case MemoryKind::kManaged: return "managed";
    case MemoryKind::kDeviceStatic: return "device_static";
    case MemoryKind::kManagedStatic: return "managed_static";
    default: return "unknown";
  }
}

}  // namespace

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
    rank.cupti = CuptiRankBytes{f.allocated_peak, f.reserved_peak, rank.timeline, {}, {}};
    // Every record of the device, in time order (ties: as recorded).
    auto us = [&](int64_t ns) { return static_cast<double>(std::max<int64_t>(0, ns - t0)) / 1000.0; };
    for (const auto& r : memory) {
      if (r.device_id != d) continue;
      rank.cupti->allocations.push_back({us(r.timestamp_ns), r.op == MemoryOp::kRelease, r.address, r.bytes,
                                         r.stream_id, KindName(r.kind), r.pool_address});
    }
    std::stable_sort(rank.cupti->allocations.begin(), rank.cupti->allocations.end(),
                     [](const AllocationEvent& a, const AllocationEvent& b) { return a.t_us < b.t_us; });
    for (const auto& p : pools) {
      if (p.device_id != d) continue;
      const char* op = p.op == PoolOp::kCreated ? "created" : p.op == PoolOp::kTrimmed ? "trimmed" : "destroyed";
      rank.cupti->pools.push_back({us(p.timestamp_ns), op, p.address, p.size_bytes});
    }
    std::stable_sort(rank.cupti->pools.begin(), rank.cupti->pools.end(),
                     [](const PoolEvent& a, const PoolEvent& b) { return a.t_us < b.t_us; });
    m.ranks.push_back(std::move(rank));
  }
  return m;
}

}  // namespace memplan::traces
