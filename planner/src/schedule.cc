#include "memplan/planner/schedule.h"

#include <algorithm>

#include "memplan/common/check.h"

namespace memplan::planner {
namespace {

PassRef Virtual(bool forward, int64_t k, int64_t pp, int64_t vp) {
  int64_t group = k / (pp * vp);
  int64_t in_group = k % (pp * vp);
  int64_t chunk = in_group / pp;
  if (!forward) chunk = vp - 1 - chunk;
  return {forward, static_cast<int32_t>(group * pp + in_group % pp), static_cast<int32_t>(chunk)};
}

}  // namespace

std::vector<RankSchedule> BuildSchedules(int64_t pp, int64_t vp, int64_t m) {
  MEMPLAN_CHECK(m >= pp && (vp == 1 || m % pp == 0), "schedule needs m >= pp (and m % pp == 0 interleaved)");
  std::vector<RankSchedule> out(static_cast<size_t>(pp));
  for (int64_t r = 0; r < pp; ++r) {
    RankSchedule& s = out[static_cast<size_t>(r)];
    int64_t total = m * vp;
    int64_t warmup = vp == 1 ? std::min(pp - r - 1, m) : std::min(2 * (pp - r - 1) + (vp - 1) * pp, total);
    auto fwd = [&](int64_t k) { return vp == 1 ? PassRef{true, static_cast<int32_t>(k), 0} : Virtual(true, k, pp, vp); };
    auto bwd = [&](int64_t k) { return vp == 1 ? PassRef{false, static_cast<int32_t>(k), 0} : Virtual(false, k, pp, vp); };
    for (int64_t k = 0; k < warmup; ++k) s.push_back(fwd(k));
    for (int64_t i = 0; i < total - warmup; ++i) {
      s.push_back(fwd(warmup + i));
      s.push_back(bwd(i));
    }
    for (int64_t k = total - warmup; k < total; ++k) s.push_back(bwd(k));
  }
  return out;
}

int64_t MaxInFlight(const RankSchedule& schedule) {
  int64_t live = 0;
  int64_t peak = 0;
  for (const auto& p : schedule) {
    live += p.forward ? 1 : -1;
    peak = std::max(peak, live);
  }
  return peak;
}

std::vector<std::vector<double>> PassStarts(const std::vector<RankSchedule>& schedules, int64_t pp, int64_t vp,
                                            int64_t microbatches, const std::vector<double>& stage_fwd_s,
                                            const std::vector<double>& stage_bwd_s, double* makespan_s) {
  const int64_t stages = pp * vp;
  auto key = [&](int64_t mb, int64_t stage) { return static_cast<size_t>(mb * stages + stage); };
  std::vector<double> f_end(static_cast<size_t>(microbatches * stages), -1);
  std::vector<double> b_end(static_cast<size_t>(microbatches * stages), -1);
  std::vector<std::vector<double>> starts(static_cast<size_t>(pp));
  std::vector<size_t> next(static_cast<size_t>(pp), 0);
  std::vector<double> free_at(static_cast<size_t>(pp), 0);
  for (bool progress = true; progress;) {
    progress = false;
    for (int64_t r = 0; r < pp; ++r) {
      const auto& sched = schedules[static_cast<size_t>(r)];
      size_t& i = next[static_cast<size_t>(r)];
      while (i < sched.size()) {
        const PassRef& pr = sched[i];
        const int64_t stage = pr.chunk * pp + r;
        double dep = 0;
        if (pr.forward) {
          if (stage > 0) dep = f_end[key(pr.microbatch, stage - 1)];
        } else {
          dep = stage + 1 < stages ? b_end[key(pr.microbatch, stage + 1)] : f_end[key(pr.microbatch, stage)];
        }
        if (dep < 0) break;  // waits for a neighbour
        const double start = std::max(free_at[static_cast<size_t>(r)], dep);
        const double dur = pr.forward ? stage_fwd_s[static_cast<size_t>(stage)] : stage_bwd_s[static_cast<size_t>(stage)];
        (pr.forward ? f_end : b_end)[key(pr.microbatch, stage)] = start + dur;
        free_at[static_cast<size_t>(r)] = start + dur;
        starts[static_cast<size_t>(r)].push_back(start);
        ++i;
        progress = true;
      }
    }
  }
  double makespan = 0;
  for (int64_t r = 0; r < pp; ++r) {
    MEMPLAN_CHECK(next[static_cast<size_t>(r)] == schedules[static_cast<size_t>(r)].size(), "pipeline schedule deadlocked");
    makespan = std::max(makespan, free_at[static_cast<size_t>(r)]);
  }
  if (makespan_s) *makespan_s = makespan;
  return starts;
}

}  // namespace memplan::planner
