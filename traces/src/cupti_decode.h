// Converting CUPTI activity records into memplan's records: pure functions
// over CUPTI's structs, so tests build records by hand and check every
// field without a GPU. Private to traces/ (includes CUPTI's header).
#pragma once

#include <cupti_activity.h>

#include <cstdint>

#include "memplan/traces/cupti_source.h"
#include "memplan/traces/footprint.h"

namespace memplan::traces::cupti {

inline MemoryKind ToMemoryKind(CUpti_ActivityMemoryKind k) {
  switch (k) {
    case CUPTI_ACTIVITY_MEMORY_KIND_PAGEABLE: return MemoryKind::kPageable;
    case CUPTI_ACTIVITY_MEMORY_KIND_PINNED: return MemoryKind::kPinned;
    case CUPTI_ACTIVITY_MEMORY_KIND_DEVICE: return MemoryKind::kDevice;
    case CUPTI_ACTIVITY_MEMORY_KIND_ARRAY: return MemoryKind::kArray;
    case CUPTI_ACTIVITY_MEMORY_KIND_MANAGED: return MemoryKind::kManaged;
    case CUPTI_ACTIVITY_MEMORY_KIND_DEVICE_STATIC: return MemoryKind::kDeviceStatic;
    case CUPTI_ACTIVITY_MEMORY_KIND_MANAGED_STATIC: return MemoryKind::kManagedStatic;
    default: return MemoryKind::kUnknown;
  }
}

// MEMORY2: one allocation or release. A pool allocation carries the pool's
// address and its size at that moment (memoryPoolConfig).
inline MemoryRecord FromActivity(const CUpti_ActivityMemory4& r) {
  MemoryRecord m;
  m.timestamp_ns = static_cast<int64_t>(r.timestamp);
  m.address = r.address;
  m.bytes = static_cast<int64_t>(r.bytes);
  m.op = r.memoryOperationType == CUPTI_ACTIVITY_MEMORY_OPERATION_TYPE_RELEASE ? MemoryOp::kRelease
                                                                                : MemoryOp::kAllocation;
  m.kind = ToMemoryKind(r.memoryKind);
  m.device_id = static_cast<int32_t>(r.deviceId);
  m.stream_id = r.streamId == CUPTI_INVALID_STREAM_ID ? -1 : static_cast<int64_t>(r.streamId);
  if (r.memoryPoolConfig.memoryPoolType != CUPTI_ACTIVITY_MEMORY_POOL_TYPE_INVALID) {
    m.pool_address = r.memoryPoolConfig.address;
    if (r.memoryPoolConfig.memoryPoolType == CUPTI_ACTIVITY_MEMORY_POOL_TYPE_LOCAL) {
      m.pool_bytes = static_cast<int64_t>(r.memoryPoolConfig.pool.size);
    }
  }
  return m;
}

// MEMORY_POOL: a pool created, trimmed or destroyed, with its size after.
inline PoolRecord FromActivity(const CUpti_ActivityMemoryPool3& r) {
  PoolRecord p;
  p.timestamp_ns = static_cast<int64_t>(r.timestamp);
  p.address = r.address;
  p.size_bytes = static_cast<int64_t>(r.size);
  p.device_id = static_cast<int32_t>(r.deviceId);
  switch (r.memoryPoolOperationType) {
    case CUPTI_ACTIVITY_MEMORY_POOL_OPERATION_TYPE_DESTROYED: p.op = PoolOp::kDestroyed; break;
    case CUPTI_ACTIVITY_MEMORY_POOL_OPERATION_TYPE_TRIMMED: p.op = PoolOp::kTrimmed; break;
    default: p.op = PoolOp::kCreated; break;
  }
  return p;
}

inline const char* CopyName(uint8_t copy_kind) {
  switch (copy_kind) {
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOD: return "memcpy HtoD";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOH: return "memcpy DtoH";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOD: return "memcpy DtoD";
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOH: return "memcpy HtoH";
    case CUPTI_ACTIVITY_MEMCPY_KIND_PTOP: return "memcpy PtoP";
    default: return "memcpy";
  }
}

inline GpuActivity FromActivity(const CUpti_ActivityKernel10& r) {
  return {GpuActivity::Kind::kKernel, r.name ? r.name : "kernel", static_cast<int64_t>(r.start),
          static_cast<int64_t>(r.end), static_cast<int32_t>(r.deviceId), static_cast<int32_t>(r.streamId),
          r.correlationId, 0, 0};
}

inline GpuActivity FromActivity(const CUpti_ActivityMemcpy6& r) {
  return {GpuActivity::Kind::kMemcpy, CopyName(r.copyKind), static_cast<int64_t>(r.start),
          static_cast<int64_t>(r.end), static_cast<int32_t>(r.deviceId), static_cast<int32_t>(r.streamId),
          r.correlationId, static_cast<int64_t>(r.bytes), 0};
}

// EXTERNAL_CORRELATION: the ScopedGpuOp id (CUSTOM0) around the launch
// whose CUPTI correlation id is `correlation`; 0 for another kind's id.
struct ExternalLink {
  uint32_t correlation = 0;
  uint64_t external_id = 0;
};
inline ExternalLink FromActivity(const CUpti_ActivityExternalCorrelation& r) {
  if (r.externalKind != CUPTI_EXTERNAL_CORRELATION_KIND_CUSTOM0) return {r.correlationId, 0};
  return {r.correlationId, r.externalId};
}

inline GpuActivity FromActivity(const CUpti_ActivityMemset4& r) {
  return {GpuActivity::Kind::kMemset, "memset", static_cast<int64_t>(r.start), static_cast<int64_t>(r.end),
          static_cast<int32_t>(r.deviceId), static_cast<int32_t>(r.streamId), r.correlationId,
          static_cast<int64_t>(r.bytes), 0};
}

}  // namespace memplan::traces::cupti
