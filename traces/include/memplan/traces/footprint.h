// Footprint reconstruction: allocated and reserved device bytes over time,
// from allocation records (CUPTI MEMORY2 / MEMORY_POOL on a GPU; synthetic
// ones in tests), as CUPTI reports them (docs/runtime.md, "Three measurements").
//
// Glossary: allocated = bytes of live allocations (PyTorch's "Total
// Allocated"); reserved = bytes the device has set aside for them: every
// non-pool allocation (cudaMalloc) plus each pool's latest size.
//
// Records may arrive out of order (CUPTI buffers are per thread), so they are
// sorted by timestamp; on equal timestamps a pool's creation comes first,
// then allocations, releases, and pool trims/destructions, which is the
// conservative order: the peak counts a buffer freed and one allocated at the
// same instant together.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace memplan::traces {

enum class MemoryOp { kAllocation, kRelease };

// CUPTI_ACTIVITY_MEMORY_KIND_* (same values).
enum class MemoryKind {
  kUnknown = 0,
  kPageable = 1,
  kPinned = 2,
  kDevice = 3,
  kArray = 4,
  kManaged = 5,
  kDeviceStatic = 6,
  kManagedStatic = 7,
};

// One allocation or release (CUpti_ActivityMemory4).
struct MemoryRecord {
  int64_t timestamp_ns = 0;
  uint64_t address = 0;
  int64_t bytes = 0;  // ignored on release: the allocation's size is used
  MemoryOp op = MemoryOp::kAllocation;
  MemoryKind kind = MemoryKind::kDevice;
  int32_t device_id = 0;
  uint64_t pool_address = 0;  // 0: not from a pool (cudaMalloc)
  int64_t pool_bytes = 0;     // the pool's size when the record was taken (0: unknown)
  int64_t stream_id = -1;     // CUPTI's stream id of an async (stream-ordered) operation; -1: none
};

enum class PoolOp { kCreated, kDestroyed, kTrimmed };

// One pool event (CUpti_ActivityMemoryPool3).
struct PoolRecord {
  int64_t timestamp_ns = 0;
  uint64_t address = 0;
  int64_t size_bytes = 0;  // the pool's size after the operation
  PoolOp op = PoolOp::kCreated;
  int32_t device_id = 0;
};

// Where records come from: the CUPTI collector on a GPU, a fake in tests.
// Collecting is separate from reconstructing (as in kineto).
class MemoryRecordSource {
 public:
  virtual ~MemoryRecordSource() = default;
  // Appends every record collected since the previous call, in any order.
  virtual void Drain(std::vector<MemoryRecord>& memory, std::vector<PoolRecord>& pools) = 0;
};

// A source over records already in memory.
class VectorRecordSource : public MemoryRecordSource {
 public:
  void Add(const MemoryRecord& r) { memory_.push_back(r); }
  void Add(const PoolRecord& r) { pools_.push_back(r); }
  void Drain(std::vector<MemoryRecord>& memory, std::vector<PoolRecord>& pools) override;

 private:
  std::vector<MemoryRecord> memory_;
  std::vector<PoolRecord> pools_;
};

struct FootprintOptions {
  std::optional<int32_t> device_id;        // only this device (default: all records)
  MemoryKind kind = MemoryKind::kDevice;   // pinned host memory is not device footprint
};

// State after one record.
struct FootprintSample {
  int64_t timestamp_ns = 0;
  int64_t allocated_bytes = 0;
  int64_t reserved_bytes = 0;
};

struct Footprint {
  int64_t allocated_peak = 0;
  int64_t reserved_peak = 0;
  int64_t allocated_bytes = 0;  // at the end
  int64_t reserved_bytes = 0;   // at the end
  std::vector<FootprintSample> samples;  // one per applied record, in time order
  // Records that could not be applied (a release of an unknown address: an
  // allocation before tracing started or a dropped record; an address
  // allocated twice). Reported, never fatal.
  std::vector<std::string> warnings;
};

// O(n log n) in the number of records.
Footprint ReconstructFootprint(std::vector<MemoryRecord> memory, std::vector<PoolRecord> pools,
                               const FootprintOptions& options = {});
Footprint ReconstructFootprint(MemoryRecordSource& source, const FootprintOptions& options = {});

// Where one owner's (a pipeline rank's) device memory lies: the blocks it
// allocated itself ([begin, end) address ranges: arena mode), the pools it
// allocates from (pool base addresses, as CUPTI reports them), and the
// addresses its allocations had (pool mode, where the pool's base is not
// known up front: a pool is then the owner's once one of its allocations
// is).
struct OwnerRegions {
  int64_t owner = 0;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  std::vector<uint64_t> pools;
  std::vector<uint64_t> addresses;
};

struct AttributedFootprint {
  std::map<int64_t, Footprint> by_owner;  // every owner of `regions`, records or not
  Footprint unattributed;                 // records no owner claims (cuBLAS, kernel scratch...)
  Footprint total;                        // every record: the process's view
};

// Splits the records by owner (an allocation belongs to the owner whose
// range holds its address, whose pool served it, or who allocated that
// address; a pool event to the owner of that pool) and reconstructs each
// part, the rest, and the whole.
// Overlapping regions are a caller's bug: the first owner listed wins.
AttributedFootprint ReconstructByOwner(const std::vector<MemoryRecord>& memory, const std::vector<PoolRecord>& pools,
                                       const std::vector<OwnerRegions>& regions,
                                       const FootprintOptions& options = {});

}  // namespace memplan::traces
