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

}  // namespace memplan::planner
