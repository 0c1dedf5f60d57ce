// The periodic window (period.h, docs/planner.md "Periodic window").
#include "memplan/planner/period.h"

#include <algorithm>
#include <cmath>
#include <map>

#include "memplan/common/check.h"

namespace memplan::planner {

int64_t PeriodicWindow::Weight(int32_t rank, int32_t chunk, int32_t microbatch) const {
  const uint8_t k = role[static_cast<size_t>(rank)][static_cast<size_t>(chunk * simulated + microbatch)];
  return k == 1 ? 1 + periods : 1;
}

std::vector<int32_t> PeriodicWindow::ModelMicrobatches(int32_t rank, int32_t chunk, int32_t microbatch) const {
  const uint8_t k = role[static_cast<size_t>(rank)][static_cast<size_t>(chunk * simulated + microbatch)];
  if (k == 0) return {microbatch};
  if (k == 2) return {static_cast<int32_t>(microbatch + periods * unit)};
  std::vector<int32_t> out;
  for (int64_t c = 0; c <= periods; ++c) out.push_back(static_cast<int32_t>(microbatch + c * unit));
  return out;
}

namespace {

// Whether the window of `m0` microbatches stands for the model; fills `w`.
bool TryWindow(int64_t pp, int64_t vp, int64_t m, int64_t m0, const std::vector<double>& fwd,
               const std::vector<double>& bwd, const std::vector<RankSchedule>& full,
               const std::vector<std::vector<double>>& full_starts, double full_makespan, PeriodicWindow* w) {
  const int64_t unit = vp > 1 ? pp : 1;
  const int64_t pass_period = 2 * unit * vp;
  const int64_t periods = (m - m0) / unit;
  double makespan0 = 0;
  std::vector<RankSchedule> sched = BuildSchedules(pp, vp, m0);
  std::vector<std::vector<double>> starts = PassStarts(sched, pp, vp, m0, fwd, bwd, &makespan0);
  const double period_s = (full_makespan - makespan0) / static_cast<double>(periods);
  const double tol = 1e-9 * std::max(full_makespan, 1e-300);
  if (!(period_s > tol)) return false;

  // The longest time a (chunk, microbatch) pair's tensors can live on its
  // rank: from its microbatch's first forward there to its last backward's
  // end (shared blocks and the pp cache live within the microbatch's
  // passes on the rank; copies finish or stay resident within them).
  double life = 0;
  for (int64_t r = 0; r < pp; ++r) {
    std::vector<double> first(static_cast<size_t>(m0), -1), last(static_cast<size_t>(m0), -1);
    const auto& s = sched[static_cast<size_t>(r)];
    for (size_t i = 0; i < s.size(); ++i) {
      const int64_t stage = s[i].chunk * pp + r;
      const double end = starts[static_cast<size_t>(r)][i] +
                         (s[i].forward ? fwd[static_cast<size_t>(stage)] : bwd[static_cast<size_t>(stage)]);
      auto mb = static_cast<size_t>(s[i].microbatch);
      if (first[mb] < 0) first[mb] = starts[static_cast<size_t>(r)][i];
      last[mb] = std::max(last[mb], end);
    }
    for (size_t mb = 0; mb < first.size(); ++mb) life = std::max(life, last[mb] - first[mb]);
  }
  // The periodic neighbourhood a cut needs: a lifetime and a period
  // before it, a lifetime after it (docs/planner.md).
  const double before = life + period_s + period_s, after = life + period_s;

  // Times where a rank's pass is not the translate of the pass one period
  // earlier, plus both ends of the window.
  // (The first period of every rank is never a translate: the window's
  // start is a bad time.)
  std::vector<double> bad = {makespan0};
  for (int64_t r = 0; r < pp; ++r) {
    const auto& s = sched[static_cast<size_t>(r)];
    const auto& t = starts[static_cast<size_t>(r)];
    for (size_t i = 0; i < s.size(); ++i) {
      bool ok = i >= static_cast<size_t>(pass_period);
      if (ok) {
        const PassRef& a = s[i];
        const PassRef& b = s[i - static_cast<size_t>(pass_period)];
        ok = a.forward == b.forward && a.chunk == b.chunk && a.microbatch == b.microbatch + unit &&
             std::abs(t[i] - t[i - static_cast<size_t>(pass_period)] - period_s) <= tol;
      }
      if (!ok) bad.push_back(t[i]);
    }
  }
  std::sort(bad.begin(), bad.end());
  double cut = -1;
  for (size_t k = 0; k + 1 < bad.size(); ++k) {
    if (bad[k + 1] - bad[k] > before + after) {
      cut = bad[k] + before;
      break;
    }
  }
  if (cut < 0) return false;

  PeriodicWindow out;
  out.microbatches = m;
  out.simulated = m0;
  out.unit = unit;
  out.periods = periods;
  out.period_passes = pass_period;
  out.period_s = period_s;
  out.cut_s = cut;
  out.role.resize(static_cast<size_t>(pp));
  for (int64_t r = 0; r < pp; ++r) {
    const auto& s = sched[static_cast<size_t>(r)];
    const auto& t = starts[static_cast<size_t>(r)];
    const int64_t h = std::lower_bound(t.begin(), t.end(), cut) - t.begin();
    if (h < 2 * pass_period || h >= static_cast<int64_t>(s.size())) return false;
    out.cut_pass.push_back(h);
    // The model's passes: the window's before the cut, `periods` copies of
    // the period before the cut, then the window's after it, shifted.
    const auto& fs = full[static_cast<size_t>(r)];
    const auto& ft = full_starts[static_cast<size_t>(r)];
    if (fs.size() != s.size() + static_cast<size_t>(periods * pass_period)) return false;
    for (size_t i = 0; i < fs.size(); ++i) {
      int64_t j = static_cast<int64_t>(i), k = 0;
      if (j >= h + periods * pass_period) {
        j -= periods * pass_period;
        k = periods;
      } else if (j >= h) {
        k = (j - h) / pass_period + 1;
        j = h - pass_period + (j - h) % pass_period;
      }
      PassRef want = s[static_cast<size_t>(j)];
      if (j >= h - pass_period) want.microbatch += static_cast<int32_t>(k * unit);
      if (!(want == fs[i]) || std::abs(t[static_cast<size_t>(j)] + static_cast<double>(k) * period_s - ft[i]) > tol) {
        return false;
      }
    }
    auto& role = out.role[static_cast<size_t>(r)];
    role.assign(static_cast<size_t>(vp * m0), 0);
    for (size_t i = 0; i < s.size(); ++i) {
      if (!s[i].forward) continue;
      const int64_t idx = static_cast<int64_t>(i);
      role[static_cast<size_t>(s[i].chunk * m0 + s[i].microbatch)] = idx < h - pass_period ? 0 : idx < h ? 1 : 2;
    }
  }
  out.schedules = std::move(sched);
  out.starts = std::move(starts);
  *w = std::move(out);
  return true;
}

}  // namespace

std::optional<PeriodicWindow> FindWindow(int64_t pp, int64_t vp, int64_t microbatches,
                                         const std::vector<double>& stage_fwd_s, const std::vector<double>& stage_bwd_s,
                                         const std::vector<RankSchedule>& full,
                                         const std::vector<std::vector<double>>& full_starts, double full_makespan_s) {
  const int64_t unit = vp > 1 ? pp : 1;
  // Start where a window can hold warm-up, a periodic neighbourhood and
  // cool-down (about three in-flight spans), then grow by a quarter.
  int64_t m0 = std::max<int64_t>(pp, 2 * unit);
  const int64_t in_flight = vp > 1 ? (2 * (pp - 1) + (vp - 1) * pp + 1 + vp - 1) / vp : pp;
  m0 = std::max(m0, 3 * in_flight);
  if (m0 >= microbatches) return std::nullopt;
  m0 = microbatches - ((microbatches - m0) / unit) * unit;  // m0 = microbatches (mod unit), >= the start
  for (int attempt = 0; attempt < 24 && m0 < microbatches; ++attempt) {
    PeriodicWindow w;
    if (TryWindow(pp, vp, microbatches, m0, stage_fwd_s, stage_bwd_s, full, full_starts, full_makespan_s, &w)) {
      return w;
    }
    m0 += std::max(unit, (m0 / 4 / unit) * unit);
  }
  return std::nullopt;
}

}  // namespace memplan::planner
