// TRACE.json: the Chrome Trace Event format, as Perfetto and chrome://tracing
// open it ({"traceEvents": [...], "displayTimeUnit": "ms"}, times in µs).
//
// Layout: one process per pipeline rank (pid = pp_rank + 1, named
// "pp rank N"), one thread per stream (tid = 1 + Stream: compute, d2h, h2d,
// link), and, on a GPU with CUPTI, one thread per CUDA stream as the GPU
// timed it (AddThread, tids from kGpuTidBase; gpu_timeline.h). Spans become
// "X" events, memory samples "C" events named "device_memory" with the series
// allocated / reserved / predicted (Perfetto makes one counter track per
// series) and, beside them, "cupti_device_memory" (series cupti). GPU work
// no rank owns goes to one more process, kUnownedPid. Ids start at 1 because
// some viewers treat pid/tid 0 as the idle process.
//
// Collecting is separate from writing: producers add spans and counters in
// any order; ToJson() emits metadata first, then events sorted by time
// (a span before the spans it contains).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "memplan/common/json_util.h"

namespace memplan::traces {

enum class Stream { kCompute = 0, kD2H = 1, kH2D = 2, kLink = 3 };
inline constexpr int kStreamCount = 4;
std::string_view StreamName(Stream stream);  // "compute", "d2h", "h2d", "link"

// A kernel, copy or transfer on one stream of one rank.
struct TraceSpan {
  int64_t pp_rank = 0;  // kUnownedRank: GPU work no rank owns
  Stream stream = Stream::kCompute;
  std::string name;  // e.g. "layer3.attn.fwd" or "offload layer3.mlp.fc1_out@mb2"
  std::string cat;   // "kernel", "memcpy", "recompute", ...
  double ts_us = 0;
  double dur_us = 0;
  OrderedJson args = OrderedJson::object();  // omitted when empty
  int64_t tid = 0;  // 0: the stream's thread; else one made by AddThread
};

// One sample of a rank's device memory, in bytes.
struct MemoryCounter {
  int64_t pp_rank = 0;
  double ts_us = 0;
  int64_t allocated_bytes = 0;
  int64_t reserved_bytes = 0;
  int64_t predicted_bytes = 0;
};

inline constexpr int64_t kUnownedRank = -1;
inline constexpr int64_t kGpuTidBase = 100;

class ChromeTrace {
 public:
  // Processes are named "<label> N" ("pp rank" unless set; profiles of
  // other programs use "device").
  void SetProcessLabel(std::string label) { label_ = std::move(label); }
  // Ensures rank `pp_rank` gets its process and thread metadata even when it
  // has no event.
  void AddRank(int64_t pp_rank);
  // A named thread of `pp_rank` (or kUnownedRank), tid >= kGpuTidBase;
  // threads sort by tid after the four streams.
  void AddThread(int64_t pp_rank, int64_t tid, std::string name);
  void AddSpan(TraceSpan span);
  void AddCounter(const MemoryCounter& counter);
  // A sample of the rank's device bytes as CUPTI's records give them.
  void AddCuptiCounter(int64_t pp_rank, double ts_us, int64_t bytes);

  // The whole document; deterministic for the same input.
  OrderedJson ToJson() const;

  static constexpr int64_t kUnownedPid = 1'000'000;
  static int64_t Pid(int64_t pp_rank) { return pp_rank == kUnownedRank ? kUnownedPid : pp_rank + 1; }
  static int64_t Tid(Stream stream) { return static_cast<int64_t>(stream) + 1; }

 private:
  struct Thread {
    int64_t pp_rank, tid;
    std::string name;
  };
  struct CuptiSample {
    int64_t pp_rank;
    double ts_us;
    int64_t bytes;
  };
  std::string label_ = "pp rank";
  std::vector<int64_t> ranks_;
  std::vector<Thread> threads_;
  std::vector<TraceSpan> spans_;
  std::vector<MemoryCounter> counters_;
  std::vector<CuptiSample> cupti_;
};

// Checks a trace document ({"traceEvents": [...]} or the bare array of
// events): every event is an object with a "ph"; X events have integer
// pid and tid, ts >= 0 and dur >= 0; C events ts >= 0;
// the X events of one (pid, tid) nest perfectly (two events are disjoint or
// one contains the other, within 1 ns). Returns one message per problem,
// empty when the trace is valid. O(n log n).
std::vector<std::string> ValidateNesting(const Json& trace);

}  // namespace memplan::traces
