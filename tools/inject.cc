// libmemplan_inject.so: the CUPTI injection library `memplan profile` loads
// into an unmodified CUDA program (CUDA_INJECTION64_PATH). The driver calls
// InitializeInjection() when the program initializes CUDA; it starts the
// CUPTI collector, and at exit the profile (MEASURED.json, source
// "cupti-injection", one entry per device) goes to $MEMPLAN_PROFILE_OUT.
// It never kills the program it measures: a collector that cannot start,
// or a profile that cannot be written, is one line on stderr.
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>

#include "memplan/common/json_util.h"
#include "memplan/common/output.h"
#include "memplan/traces/cupti_source.h"
#include "memplan/traces/profile.h"

namespace {

std::unique_ptr<memplan::traces::CuptiSource>& Source() {
  static std::unique_ptr<memplan::traces::CuptiSource> source;
  return source;
}

void WriteProfile() {
  auto& source = Source();
  if (!source) return;
  source->Flush();
  std::vector<memplan::traces::MemoryRecord> memory;
  std::vector<memplan::traces::PoolRecord> pools;
  source->Drain(memory, pools);
  memplan::traces::Measured m = memplan::traces::ProfileFromRecords(memory, pools);
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
    options.gpu_timeline = false;
    auto source = memplan::traces::CuptiSource::Start(options);
    if (!source) {
      std::fprintf(stderr, "memplan profile: %s; no profile\n", source.error().message.c_str());
      return;
    }
    Source() = std::move(*source);
    std::atexit(WriteProfile);
  });
  return 1;
}
