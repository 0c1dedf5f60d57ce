// TRACE.json: the Chrome Trace Event format, as Perfetto and chrome://tracing
// open it ({"traceEvents": [...], "displayTimeUnit": "ms"}, times in µs).
//
// Layout: one process per pipeline rank (pid = pp_rank + 1, named
// "pp rank N"), one thread per stream (tid = 1 + Stream: compute, d2h, h2d,
// link). Spans become "X" events, memory samples "C" events named
// "device_memory" with the series allocated / reserved / predicted (Perfetto
// makes one counter track per series). Ids start at 1 because some viewers
// treat pid/tid 0 as the idle process.
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
  int64_t pp_rank = 0;
  Stream stream = Stream::kCompute;
  std::string name;  // e.g. "layer3.attn.fwd" or "offload layer3.mlp.fc1_out@mb2"
  std::string cat;   // "kernel", "memcpy", "recompute", ...
  double ts_us = 0;
  double dur_us = 0;
  OrderedJson args = OrderedJson::object();  // omitted when empty
};

// One sample of a rank's device memory, in bytes.
struct MemoryCounter {
  int64_t pp_rank = 0;
  double ts_us = 0;
  int64_t allocated_bytes = 0;
  int64_t reserved_bytes = 0;
  int64_t predicted_bytes = 0;
};

class ChromeTrace {
 public:
  // Ensures rank `pp_rank` gets its process and thread metadata even when it
  // has no event.
  void AddRank(int64_t pp_rank);
  void AddSpan(TraceSpan span);
  void AddCounter(const MemoryCounter& counter);

  // The whole document; deterministic for the same input.
  OrderedJson ToJson() const;

  static int64_t Pid(int64_t pp_rank) { return pp_rank + 1; }
  static int64_t Tid(Stream stream) { return static_cast<int64_t>(stream) + 1; }

 private:
  std::vector<int64_t> ranks_;
  std::vector<TraceSpan> spans_;
  std::vector<MemoryCounter> counters_;
};

// Checks a trace document: traceEvents is an array of objects with a "ph";
// X events have numeric pid, tid, ts >= 0 and dur >= 0; C events ts >= 0;
// the X events of one (pid, tid) nest perfectly (two events are disjoint or
// one contains the other, within 1 ns). Returns one message per problem,
// empty when the trace is valid. O(n log n).
std::vector<std::string> ValidateNesting(const Json& trace);

}  // namespace memplan::traces
