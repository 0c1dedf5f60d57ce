#include "cupti_measure.h"

#include <algorithm>

namespace memplan::runtime {
namespace {

std::vector<traces::TimelinePoint> Timeline(const traces::Footprint& f, int64_t t0_ns) {
  std::vector<traces::TimelinePoint> out;
  out.reserve(f.samples.size());
  for (const auto& s : f.samples) {
    out.push_back({static_cast<double>(std::max<int64_t>(0, s.timestamp_ns - t0_ns)) / 1000.0, s.allocated_bytes});
  }
  return out;
}

}  // namespace

void AttachCupti(traces::MemoryRecordSource& source, const CuptiMeasureInput& input, traces::Measured& measured) {
  std::vector<traces::MemoryRecord> memory;
  std::vector<traces::PoolRecord> pools;
  source.Drain(memory, pools);
  traces::AttributedFootprint f = traces::ReconstructByOwner(memory, pools, input.regions);
  const int64_t t0 = input.epoch_ns != 0 || f.total.samples.empty() ? input.epoch_ns
                                                                      : f.total.samples.front().timestamp_ns;
  for (auto& rank : measured.ranks) {
    auto it = f.by_owner.find(rank.pp_rank);
    if (it == f.by_owner.end()) continue;
    rank.cupti = traces::CuptiRankBytes{it->second.allocated_peak, it->second.reserved_peak, Timeline(it->second, t0), {}, {}};
  }
  traces::MeasuredProcess process;
  process.device_bytes_peak = f.total.reserved_peak;
  process.context_bytes = input.context_bytes;
  process.profiler_bytes = std::max<int64_t>(0, input.used_at_end - input.context_bytes - f.total.reserved_bytes);
  measured.process = process;
}

traces::GpuTimelineCounts AddCuptiTrace(const std::vector<traces::GpuActivity>& activities,
                                        const traces::GpuTimelineInput& input, const traces::Measured& measured,
                                        traces::ChromeTrace& trace) {
  traces::GpuTimelineCounts counts = traces::AddGpuTimeline(activities, input, trace);
  for (const auto& rank : measured.ranks) {
    if (!rank.cupti) continue;
    for (const auto& p : rank.cupti->timeline) trace.AddCuptiCounter(rank.pp_rank, p.t_us, p.allocated_bytes);
  }
  return counts;
}

}  // namespace memplan::runtime
