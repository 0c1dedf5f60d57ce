#include "memplan/traces/gpu_timeline.h"

#include <algorithm>
#include <map>
#include <utility>

namespace memplan::traces {
namespace {

const char* Category(GpuActivity::Kind kind) {
  switch (kind) {
    case GpuActivity::Kind::kKernel: return "gpu_kernel";
    case GpuActivity::Kind::kMemcpy: return "gpu_memcpy";
    case GpuActivity::Kind::kMemset: return "gpu_memset";
  }
  return "gpu";
}

}  // namespace

GpuTimelineCounts AddGpuTimeline(const std::vector<GpuActivity>& activities, const GpuTimelineInput& input,
                                 ChromeTrace& trace) {
  GpuTimelineCounts counts;
  // (rank, stream id) -> tid. Named lanes first, in their order per rank.
  std::map<std::pair<int64_t, int64_t>, int64_t> tids;  // (rank, stream id) -> tid
  std::map<int64_t, int64_t> next_tid;  // rank -> next free tid
  std::map<int64_t, int64_t> lane_rank;  // stream id -> rank
  auto thread = [&](int64_t rank, int64_t stream, const std::string& name) {
    auto [it, fresh] = tids.try_emplace({rank, stream}, 0);
    if (fresh) {
      auto [n, unused] = next_tid.try_emplace(rank, kGpuTidBase);
      it->second = n->second++;
      trace.AddThread(rank, it->second, name);
    }
    return it->second;
  };
  for (const auto& lane : input.lanes) {
    if (lane.stream_id < 0 || lane_rank.count(lane.stream_id)) continue;
    lane_rank[lane.stream_id] = lane.pp_rank;
    thread(lane.pp_rank, lane.stream_id, "gpu " + lane.name);
  }
  for (const auto& a : activities) {
    if (a.end_ns < input.epoch_ns) {
      ++counts.before_epoch;
      continue;
    }
    const GpuOpName* op = nullptr;
    if (a.external_id > 0 && a.external_id <= input.ops.size()) op = &input.ops[static_cast<size_t>(a.external_id - 1)];
    int64_t rank = kUnownedRank;
    if (input.by_device) {
      rank = a.device_id;
    } else if (auto it = lane_rank.find(a.stream_id); it != lane_rank.end()) {
      rank = it->second;
    } else if (op != nullptr) {
      rank = op->pp_rank;
    }
    TraceSpan s;
    s.pp_rank = rank;
    s.tid = thread(rank, a.stream_id, "gpu stream " + std::to_string(a.stream_id));
    s.name = op != nullptr ? op->name : a.name;
    s.cat = Category(a.kind);
    const int64_t start = std::max(a.start_ns, input.epoch_ns);
    s.ts_us = static_cast<double>(start - input.epoch_ns) / 1000.0;
    s.dur_us = static_cast<double>(std::max<int64_t>(0, a.end_ns - start)) / 1000.0;
    s.args["kernel"] = a.name;
    if (a.bytes > 0) s.args["bytes"] = a.bytes;
    s.args["stream"] = a.stream_id;
    s.args["correlation"] = a.correlation_id;
    trace.AddSpan(std::move(s));
    ++counts.spans;
    if (op != nullptr) ++counts.with_op;
    if (rank == kUnownedRank) ++counts.unowned;
  }
  return counts;
}

}  // namespace memplan::traces
