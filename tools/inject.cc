// libmemplan_inject.so: the CUPTI injection library `memplan profile` loads
// into an unmodified CUDA program (CUDA_INJECTION64_PATH). The driver calls
// InitializeInjection() when the program initializes CUDA; it starts the
// CUPTI collector, and at exit the profile (MEASURED.json, source
// "cupti-injection", one entry per device) goes to $MEMPLAN_PROFILE_OUT and,
// when $MEMPLAN_PROFILE_TRACE is set, the GPU's kernels, copies and memsets
// (a Chrome trace, one process per device, one thread per stream) there.
// It never kills the program it measures: a collector that cannot start,
// or a profile that cannot be written, is one line on stderr.
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>

#include "memplan/common/json_util.h"
#include "memplan/common/output.h"
#include "memplan/traces/chrome_trace.h"
#include "memplan/traces/cupti_source.h"
#include "memplan/traces/gpu_timeline.h"
#include "memplan/traces/profile.h"

namespace {

std::unique_ptr<memplan::traces::CuptiSource>& Source() {
  static std::unique_ptr<memplan::traces::CuptiSource> source;
  return source;
}

int64_t g_epoch_ns = 0;  // CUPTI's clock when the collector started

void WriteTrace(const char* path) {
  memplan::traces::ChromeTrace trace;
  trace.SetProcessLabel("device");
  memplan::traces::GpuTimelineInput in;
  in.epoch_ns = g_epoch_ns;
  in.by_device = true;
  memplan::traces::AddGpuTimeline(Source()->DrainActivities(), in, trace);
  auto written = memplan::WriteFileAtomic(path, trace.ToJson().dump() + "\n");
  if (!written) std::fprintf(stderr, "memplan profile: %s\n", written.error().message.c_str());
}

void WriteProfile() {
  auto& source = Source();
  if (!source) return;
  source->Flush();
  std::vector<memplan::traces::MemoryRecord> memory;
  std::vector<memplan::traces::PoolRecord> pools;
  source->Drain(memory, pools);
  memplan::traces::Measured m = memplan::traces::ProfileFromRecords(memory, pools);
  if (const char* trace = std::getenv("MEMPLAN_PROFILE_TRACE")) WriteTrace(trace);
  const char* out = std::getenv("MEMPLAN_PROFILE_OUT");
  if (out == nullptr || m.ranks.empty()) return;  // no device memory: nothing to say
  auto written = memplan::WriteFileAtomic(out, memplan::traces::MeasuredToJson(m).dump(2) + "\n");
  if (!written) std::fprintf(stderr, "memplan profile: %s\n", written.error().message.c_str());
}

}  // namespace

extern "C" int InitializeInjection(void) {
  static std::once_flag once;
  std::call_once(once, [] {
    memplan::traces::CuptiOptions options;
    options.gpu_timeline = std::getenv("MEMPLAN_PROFILE_TRACE") != nullptr;
    auto source = memplan::traces::CuptiSource::Start(options);
    if (!source) {
      std::fprintf(stderr, "memplan profile: %s; no profile\n", source.error().message.c_str());
      return;
    }
    Source() = std::move(*source);
    g_epoch_ns = memplan::traces::CuptiSource::TimestampNs();
    std::atexit(WriteProfile);
  });
  return 1;
}
