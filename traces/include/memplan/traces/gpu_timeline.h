// The GPU's own timeline in TRACE.json: CUPTI's kernels, copies and memsets
// (cupti_source.h) placed on the CUDA streams that ran them, under the rank
// that owns each stream, named by the op that launched them.
//
//   lanes   each CUDA stream the runtime made (CUPTI stream id -> rank and
//           a name such as "compute"); a rank's lanes become its threads
//           "gpu <name>" (tids from kGpuTidBase, in lane order).
//   ops     the ScopedGpuOp ids: id k names ops[k - 1] (rank, op name).
//   epoch   CUPTI's clock at the trace's time 0 (CuptiSource::TimestampNs()
//           when the host trace starts), so GPU and host spans share a
//           time axis.
//
// A span is named by its op when the launch was inside a ScopedGpuOp, else
// by the activity ("memcpy HtoD", the kernel); the kernel's own name is in
// args.kernel. An activity on a stream no lane names goes under its op's
// rank (thread "gpu stream N"), or, with no op either, under the process
// for work no rank owns. Work that ended before the epoch (set-up: weight
// initialisation) is counted, not drawn.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "memplan/traces/chrome_trace.h"
#include "memplan/traces/gpu_profiler.h"

namespace memplan::traces {

struct GpuLane {
  int64_t stream_id = -1;  // CuptiSource::StreamId
  int64_t pp_rank = 0;
  std::string name;        // "compute", "d2h", "static", ...
};

struct GpuOpName {
  int64_t pp_rank = 0;
  std::string name;
};

struct GpuTimelineInput {
  std::vector<GpuLane> lanes;
  std::vector<GpuOpName> ops;  // ScopedGpuOp id k -> ops[k - 1]
  int64_t epoch_ns = 0;
  // A profile of another program (memplan profile): no lanes or ops; each
  // activity goes under its device (pp_rank = device ordinal), one thread
  // per stream.
  bool by_device = false;
};

struct GpuTimelineCounts {
  int64_t spans = 0;          // drawn
  int64_t with_op = 0;        // of those, named by their op
  int64_t unowned = 0;        // of those, on no rank
  int64_t before_epoch = 0;   // not drawn: ended before the epoch
};

GpuTimelineCounts AddGpuTimeline(const std::vector<GpuActivity>& activities, const GpuTimelineInput& input,
                                 ChromeTrace& trace);

}  // namespace memplan::traces
