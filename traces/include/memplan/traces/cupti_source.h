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
#include "memplan/traces/gpu_profiler.h"

namespace memplan::traces {

class CuptiSource final : public GpuProfiler {
 public:
  // Errors: kRuntime when this build has no CUPTI, when CUPTI cannot start
  // (no driver, no device), or when another subscriber holds its buffers.
  static Expected<std::unique_ptr<CuptiSource>> Start(const CuptiOptions& options = {});
  ~CuptiSource() override;  // disables the activity kinds, flushes, frees
  CuptiSource(const CuptiSource&) = delete;
  CuptiSource& operator=(const CuptiSource&) = delete;

  // Completes every buffer CUPTI holds (cuptiActivityFlushAll with the
  // forced flag); call after a device synchronize.
  void Flush() override;

  void Drain(std::vector<MemoryRecord>& memory, std::vector<PoolRecord>& pools) override;
  std::vector<GpuActivity> DrainActivities() override;

  int64_t dropped_records() const override;
  // Host bytes of the buffers handed to CUPTI so far (the profiler's own
  // host memory; its device bytes are measured as a process difference).
  int64_t buffer_host_bytes() const override;

  // CUPTI's clock now (ns; the clock of every record), 0 without CUPTI.
  static int64_t TimestampNs();
  // CUPTI's id of a CUDA stream (a cudaStream_t), as records carry it;
  // -1 without CUPTI or for a stream CUPTI does not know.
  static int64_t StreamId(void* cuda_stream);

  // GpuProfiler: the statics above and ScopedGpuOp, through the interface.
  int64_t NowNs() const override { return TimestampNs(); }
  int64_t StreamIdOf(void* cuda_stream) const override { return StreamId(cuda_stream); }
  void PushOp(uint64_t id) override;
  void PopOp() override;

 private:
  CuptiSource() = default;
  std::vector<bool> pushed_;  // PushOp's stack: whether CUPTI took each id
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
