// CUPTI activity collection: the record source behind footprint.h's
// MemoryRecordSource on a GPU, and the GPU's own timeline for TRACE.json.
//
// Kineto's shape: collecting is separate from reconstructing and writing.
// CuptiSource enables MEMORY2 and MEMORY_POOL (always) and, when asked,
// CONCURRENT_KERNEL, MEMCPY and MEMSET; CUPTI fills buffers this class
// hands it, and Flush() (after a device synchronize) makes every completed
// record drainable. Only one CuptiSource can be active in a process (CUPTI's
// activity API has one set of buffer callbacks). A profiler that cannot
// start is an Error, never a crash of the program it measures.
//
// This header names no CUPTI type: the decoding lives in one .cc
// (cupti_source.cc, cupti_decode.h), built only where CUPTI is found.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "memplan/common/status.h"
#include "memplan/traces/footprint.h"

namespace memplan::traces {

// A kernel, copy or memset as the GPU timed it.
struct GpuActivity {
  enum class Kind { kKernel, kMemcpy, kMemset };
  Kind kind = Kind::kKernel;
  std::string name;          // kernel name; "memcpy HtoD" etc.; "memset"
  int64_t start_ns = 0;      // GPU timestamps (CUPTI's clock)
  int64_t end_ns = 0;
  int32_t device_id = 0;
  int32_t stream_id = 0;
  uint32_t correlation_id = 0;  // matches the launching API call
  int64_t bytes = 0;            // copies and memsets
  uint64_t external_id = 0;     // the ScopedGpuOp id around the launch; 0: none
};

struct CuptiOptions {
  // Also collect kernels, copies and memsets (for TRACE.json), and the
  // external correlation records that tie them to ScopedGpuOp ids.
  bool gpu_timeline = true;
  // Size of each activity buffer handed to CUPTI (8-byte aligned host
  // memory). CUPTI's own device-side buffers are requested in pinned host
  // memory (CUPTI_ACTIVITY_ATTR_MEM_ALLOCATION_TYPE_HOST_PINNED) so that
  // the profiler does not add to the device footprint it measures.
  int64_t buffer_bytes = int64_t{8} << 20;
};

class CuptiSource final : public MemoryRecordSource {
 public:
  // Errors: kRuntime when this build has no CUPTI, when CUPTI cannot start
  // (no driver, no device), or when another subscriber holds its buffers.
  static Expected<std::unique_ptr<CuptiSource>> Start(const CuptiOptions& options = {});
  ~CuptiSource() override;  // disables the activity kinds, flushes, frees
  CuptiSource(const CuptiSource&) = delete;
  CuptiSource& operator=(const CuptiSource&) = delete;

  // Completes every buffer CUPTI holds (cuptiActivityFlushAll with the
  // forced flag); call after a device synchronize.
  void Flush();

  void Drain(std::vector<MemoryRecord>& memory, std::vector<PoolRecord>& pools) override;
  std::vector<GpuActivity> DrainActivities();

  int64_t dropped_records() const;
  // Host bytes of the buffers handed to CUPTI so far (the profiler's own
  // host memory; its device bytes are measured as a process difference).
  int64_t buffer_host_bytes() const;

  // CUPTI's clock now (ns; the clock of every record), 0 without CUPTI.
  static int64_t TimestampNs();
  // CUPTI's id of a CUDA stream (a cudaStream_t), as records carry it;
  // -1 without CUPTI or for a stream CUPTI does not know.
  static int64_t StreamId(void* cuda_stream);

 private:
  CuptiSource() = default;
};

// Tags every kernel, copy and memset launched by this thread while it lives
// with `id` (> 0; CUPTI's external correlation, kineto's mechanism), which
// DrainActivities returns as GpuActivity::external_id. Inactive (`active`
// false, or no CUPTI) it does nothing.
class ScopedGpuOp {
 public:
  ScopedGpuOp(bool active, uint64_t id);
  ~ScopedGpuOp();
  ScopedGpuOp(const ScopedGpuOp&) = delete;
  ScopedGpuOp& operator=(const ScopedGpuOp&) = delete;

 private:
  bool pushed_ = false;
};

// True when this build links CUPTI.
bool CuptiBuilt();

}  // namespace memplan::traces
