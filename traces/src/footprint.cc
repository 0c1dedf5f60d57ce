#include "memplan/traces/footprint.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <optional>
#include <unordered_map>

namespace memplan::traces {
namespace {

// Tie order on equal timestamps (see the header).
int TieRank(const MemoryRecord& r) { return r.op == MemoryOp::kAllocation ? 1 : 2; }
int TieRank(const PoolRecord& r) { return r.op == PoolOp::kCreated ? 0 : 3; }

std::string Hex(uint64_t v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "0x%llx", static_cast<unsigned long long>(v));
  return buf;
}

}  // namespace

void VectorRecordSource::Drain(std::vector<MemoryRecord>& memory, std::vector<PoolRecord>& pools) {
  memory.insert(memory.end(), memory_.begin(), memory_.end());
  pools.insert(pools.end(), pools_.begin(), pools_.end());
  memory_.clear();
  pools_.clear();
}

Footprint ReconstructFootprint(std::vector<MemoryRecord> memory, std::vector<PoolRecord> pools,
                               const FootprintOptions& options) {
  std::erase_if(memory, [&](const MemoryRecord& r) {
    return r.kind != options.kind || (options.device_id && r.device_id != *options.device_id);
  });
  std::erase_if(pools, [&](const PoolRecord& r) { return options.device_id && r.device_id != *options.device_id; });

  // One merged list; the stable sort keeps the source order of otherwise
  // equal records.
  struct Event {
    int64_t timestamp_ns;
    int tie;
    const MemoryRecord* memory;
    const PoolRecord* pool;
  };
  std::vector<Event> events;
  events.reserve(memory.size() + pools.size());
  for (const auto& r : memory) events.push_back({r.timestamp_ns, TieRank(r), &r, nullptr});
  for (const auto& r : pools) events.push_back({r.timestamp_ns, TieRank(r), nullptr, &r});
  std::stable_sort(events.begin(), events.end(), [](const Event& a, const Event& b) {
    return a.timestamp_ns != b.timestamp_ns ? a.timestamp_ns < b.timestamp_ns : a.tie < b.tie;
  });

  struct Live {
    int64_t bytes;
    bool pooled;
  };
  std::unordered_map<uint64_t, Live> live;
  std::map<uint64_t, int64_t> pool_bytes;  // pool address -> latest size
  int64_t allocated = 0, unpooled = 0, pooled_reserved = 0;
  Footprint f;
  auto set_pool = [&](uint64_t address, int64_t bytes) {
    auto [it, inserted] = pool_bytes.try_emplace(address, 0);
    pooled_reserved += bytes - it->second;
    it->second = bytes;
  };
  for (const Event& e : events) {
    if (e.pool) {
      if (e.pool->op == PoolOp::kDestroyed) {
        if (auto it = pool_bytes.find(e.pool->address); it != pool_bytes.end()) {
          pooled_reserved -= it->second;
          pool_bytes.erase(it);
        }
      } else {
        set_pool(e.pool->address, e.pool->size_bytes);
      }
    } else {
      const MemoryRecord& r = *e.memory;
      const bool pooled = r.pool_address != 0;
      if (r.op == MemoryOp::kAllocation) {
        auto [it, inserted] = live.try_emplace(r.address, Live{r.bytes, pooled});
        if (!inserted) {
          f.warnings.push_back("allocation at " + Hex(r.address) + " (t=" + std::to_string(r.timestamp_ns) +
                               " ns) while an allocation there is live; the older one is dropped");
          allocated -= it->second.bytes;
          if (!it->second.pooled) unpooled -= it->second.bytes;
          it->second = Live{r.bytes, pooled};
        }
        allocated += r.bytes;
        if (!pooled) unpooled += r.bytes;
      } else {
        auto it = live.find(r.address);
        if (it == live.end()) {
          f.warnings.push_back("release of " + Hex(r.address) + " (t=" + std::to_string(r.timestamp_ns) +
                               " ns) without a live allocation; ignored");
          continue;
        }
        allocated -= it->second.bytes;
        if (!it->second.pooled) unpooled -= it->second.bytes;
        live.erase(it);
      }
      if (pooled && r.pool_bytes > 0) set_pool(r.pool_address, r.pool_bytes);
    }
    int64_t reserved = unpooled + pooled_reserved;
    f.allocated_peak = std::max(f.allocated_peak, allocated);
    f.reserved_peak = std::max(f.reserved_peak, reserved);
    f.samples.push_back({e.timestamp_ns, allocated, reserved});
  }
  f.allocated_bytes = allocated;
  f.reserved_bytes = unpooled + pooled_reserved;
  return f;
}

AttributedFootprint ReconstructByOwner(const std::vector<MemoryRecord>& memory, const std::vector<PoolRecord>& pools,
                                       const std::vector<OwnerRegions>& regions, const FootprintOptions& options) {
  // Ranges sorted by begin for a binary search; pools in a map.
  std::map<uint64_t, std::pair<uint64_t, int64_t>> ranges;  // begin -> (end, owner)
  std::unordered_map<uint64_t, int64_t> pool_owner;
  std::unordered_map<uint64_t, int64_t> address_owner;
  for (const auto& r : regions) {
    for (const auto& [begin, end] : r.ranges) ranges.try_emplace(begin, end, r.owner);
    for (uint64_t p : r.pools) pool_owner.try_emplace(p, r.owner);
    for (uint64_t a : r.addresses) address_owner.try_emplace(a, r.owner);
  }
  // A pool whose allocation an owner made is that owner's.
  for (const auto& m : memory) {
    if (m.pool_address == 0) continue;
    if (auto it = address_owner.find(m.address); it != address_owner.end()) {
      pool_owner.try_emplace(m.pool_address, it->second);
    }
  }
  auto owner_of = [&](const MemoryRecord& m) -> std::optional<int64_t> {
    if (m.pool_address != 0) {
      if (auto it = pool_owner.find(m.pool_address); it != pool_owner.end()) return it->second;
    }
    if (auto it = address_owner.find(m.address); it != address_owner.end()) return it->second;
    auto it = ranges.upper_bound(m.address);
    if (it == ranges.begin()) return std::nullopt;
    --it;
    if (m.address < it->second.first) return it->second.second;
    return std::nullopt;
  };
  std::map<int64_t, std::vector<MemoryRecord>> mine;
  std::map<int64_t, std::vector<PoolRecord>> mine_pools;
  std::vector<MemoryRecord> rest;
  std::vector<PoolRecord> rest_pools;
  for (const auto& m : memory) {
    if (auto o = owner_of(m)) {
      mine[*o].push_back(m);
    } else {
      rest.push_back(m);
    }
  }
  for (const auto& p : pools) {
    if (auto it = pool_owner.find(p.address); it != pool_owner.end()) {
      mine_pools[it->second].push_back(p);
    } else {
      rest_pools.push_back(p);
    }
  }
  AttributedFootprint out;
  for (const auto& r : regions) {
    out.by_owner[r.owner] = ReconstructFootprint(mine[r.owner], mine_pools[r.owner], options);
  }
  out.unattributed = ReconstructFootprint(std::move(rest), std::move(rest_pools), options);
  out.total = ReconstructFootprint(memory, pools, options);
  return out;
}

Footprint ReconstructFootprint(MemoryRecordSource& source, const FootprintOptions& options) {
  std::vector<MemoryRecord> memory;
  std::vector<PoolRecord> pools;
  source.Drain(memory, pools);
  return ReconstructFootprint(std::move(memory), std::move(pools), options);
}

}  // namespace memplan::traces
