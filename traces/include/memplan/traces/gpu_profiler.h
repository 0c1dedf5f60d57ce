// GpuProfiler: what the runtime uses of a GPU profiler, as an interface, so
// that the profiler can live in the CUDA plugin (runtime/cuda_plugin.h,
// docs/runtime.md "The CUDA plugin") and memplan itself links no CUPTI.
// CuptiSource (cupti_source.h) is the implementation.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "memplan/traces/footprint.h"

namespace memplan::traces {

// A kernel, copy or memset as the GPU timed it.
struct GpuActivity {
  enum class Kind { kKernel, kMemcpy, kMemset };
  Kind kind = Kind::kKernel;
  std::string name;          // kernel name; "memcpy HtoD" etc.; "memset"
  int64_t start_ns = 0;      // GPU timestamps (the profiler's clock)
  int64_t end_ns = 0;
  int32_t device_id = 0;
  int32_t stream_id = 0;
  uint32_t correlation_id = 0;  // matches the launching API call
  int64_t bytes = 0;            // copies and memsets
  uint64_t external_id = 0;     // the PushOp id around the launch; 0: none
};

struct CuptiOptions {
  // Also collect kernels, copies and memsets (for TRACE.json), and the
  // external correlation records that tie them to PushOp ids.
  bool gpu_timeline = true;
  // Size of each activity buffer handed to CUPTI (8-byte aligned host
  // memory). CUPTI's own device-side buffers are requested in pinned host
  // memory (CUPTI_ACTIVITY_ATTR_MEM_ALLOCATION_TYPE_HOST_PINNED) so that
  // the profiler does not add to the device footprint it measures.
  int64_t buffer_bytes = int64_t{8} << 20;
};

class GpuProfiler : public MemoryRecordSource {
 public:
  // Completes every buffer the profiler holds; call after a device synchronize.
  virtual void Flush() = 0;
  virtual std::vector<GpuActivity> DrainActivities() = 0;
  virtual int64_t dropped_records() const = 0;
  // Host bytes of the profiler's own buffers.
  virtual int64_t buffer_host_bytes() const = 0;
  // The profiler's clock now (ns; the clock of every record).
  virtual int64_t NowNs() const = 0;
  // The profiler's id of a CUDA stream (a cudaStream_t); -1 if unknown.
  virtual int64_t StreamIdOf(void* cuda_stream) const = 0;
  // Tags every kernel, copy and memset this thread launches until PopOp()
  // with `id` (> 0), returned as GpuActivity::external_id.
  virtual void PushOp(uint64_t id) = 0;
  virtual void PopOp() = 0;
};

}  // namespace memplan::traces
