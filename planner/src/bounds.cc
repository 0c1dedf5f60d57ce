#include "memplan/planner/bounds.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <functional>
#include <map>
#include <optional>

#include "memplan/common/best_fit_heap.h"
#include "memplan/common/parallel.h"
#include "memplan/common/units.h"
#include "memplan/planner/program.h"

namespace memplan::planner {
namespace {

int64_t g_periodic_skew = 0;  // testing::SkewPeriodicExpansion
std::atomic<int64_t> g_periodic_jumps{0};  // testing::PeriodicJumps

struct Placed {
  int64_t first, last, offset, size;
  size_t interval;  // index into intervals, or SIZE_MAX for a transient
};

// Places `rank`'s memory program (ProgramWalker: the order the runtime
// follows) with the deterministic best-fit heap. Returns the high-water mark.
int64_t Place(const PlanningProblem& p, int32_t rank, const std::vector<Interval>& ivs,
              const std::vector<size_t>& mine, std::vector<Placed>* placed) {
  BestFitHeap heap(256, /*track_allocations=*/false);
  ProgramWalker walk(p, rank, ivs, mine);
  while (walk.Next()) {
    auto& allocs = walk.allocations();
    for (size_t i = 0; i < allocs.size(); ++i) {
      ProgramBuffer& b = allocs[i];
      if (!placed && i + 1 == allocs.size() && b.first == b.last) {
        // The step's last allocation, gone at its end: nothing else is placed
        // while it lives, so only the high-water mark can change.
        heap.AllocateAndFree(b.bytes);
        b.tag = -1;
        continue;
      }
      b.tag = heap.Allocate(b.bytes);
      if (placed) {
        placed->push_back({b.first, b.last, b.tag, heap.AlignedSize(b.bytes),
                           b.interval >= 0 ? static_cast<size_t>(b.interval) : SIZE_MAX});
      }
    }
    for (const ProgramBuffer& b : walk.Frees()) {
      if (b.tag >= 0) heap.Free(b.tag, b.bytes);
    }
  }
  return heap.high_water();
}

// The model's memory program streamed from its periodic window's (period.h):
// the window's allocations before the cut, the period before the cut
// `periods` more times, then the rest, each buffer's last step moved with
// its first (a buffer from before the repeated period does not move),
// placed by the same best fit as Place in the window's memory. Returns
// nullopt when the window's period after the cut is not the period before
// it translated (then the window does not stand for the model).
std::optional<int64_t> PlacePeriodic(const PlanningProblem& p, int32_t rank, const std::vector<Interval>& ivs,
                                     const std::vector<size_t>& mine) {
  const auto [cut, period] = p.period_steps[static_cast<size_t>(rank)];
  const int64_t steps = p.timelines[static_cast<size_t>(rank)].steps;
  const int64_t copies = p.window->periods;
  if (period <= 0 || cut - period < 0 || cut + period > steps) return std::nullopt;
  struct Alloc {
    int64_t last, bytes;
  };
  std::vector<Alloc> allocs;
  std::vector<size_t> begin(static_cast<size_t>(steps) + 1, 0);  // per window step, its first allocation
  {
    ProgramWalker walk(p, rank, ivs, mine);
    int64_t next = 0;
    while (walk.Next()) {
      for (; next <= walk.step(); ++next) begin[static_cast<size_t>(next)] = allocs.size();
      for (const ProgramBuffer& b : walk.allocations()) allocs.push_back({b.last, b.bytes});
      walk.Frees();
    }
    for (; next <= steps; ++next) begin[static_cast<size_t>(next)] = allocs.size();
  }
  // The evidence: the period after the cut is the period before it, moved.
  for (int64_t s = cut; s < cut + period; ++s) {
    const size_t a = begin[static_cast<size_t>(s)], b = begin[static_cast<size_t>(s - period)];
    if (begin[static_cast<size_t>(s) + 1] - a != begin[static_cast<size_t>(s - period) + 1] - b) return std::nullopt;
    for (size_t k = 0; a + k < begin[static_cast<size_t>(s) + 1]; ++k) {
      if (allocs[a + k].bytes != allocs[b + k].bytes || allocs[a + k].last - period != allocs[b + k].last) {
        return std::nullopt;
      }
    }
  }
  BestFitHeap heap(256, /*track_allocations=*/false);
  struct Live {
    int64_t last, seq, offset, bytes;
    bool operator>(const Live& o) const { return last != o.last ? last > o.last : seq > o.seq; }
  };
  std::vector<Live> live;  // a min-heap by last step
  int64_t seq = 0;
  const int64_t repeated = copies * period;
  // Best fit is deterministic and its free lists are the gaps between the
  // live blocks, so the heap after a copy of the period is a function of
  // the live blocks (offset, bytes, steps left) before it. Once that state
  // recurs (Brent's cycle detection at copy boundaries), every further
  // cycle of copies repeats it with the same high-water mark: jump over
  // them, exactly. Small models settle within a few hundred periods; the
  // bundled large ones never do (docs/planner.md) and stream every copy.
  using State = std::vector<std::array<int64_t, 3>>;
  auto state_at = [&](int64_t t) {
    State s;
    s.reserve(live.size());
    for (const Live& l : live) s.push_back({l.offset, l.bytes, l.last - t});
    std::sort(s.begin(), s.end());
    return s;
  };
  State saved;
  int64_t saved_copy = -1, power = 1;
  bool jumped = false;
  for (int64_t t = 0; t < steps + repeated; ++t) {
    if (!jumped && t >= cut && t < cut + repeated && (t - cut) % period == 0) {
      const int64_t k = (t - cut) / period;  // copies placed so far
      State now = state_at(t);
      if (saved_copy >= 0 && now == saved) {
        const int64_t cycle = k - saved_copy;
        const int64_t skip = (copies - k) / cycle * cycle * period;
        for (Live& l : live) l.last += skip;
        t += skip;
        jumped = true;
        g_periodic_jumps.fetch_add(1, std::memory_order_relaxed);
      } else if (saved_copy < 0 || k - saved_copy == power) {
        if (saved_copy >= 0) power *= 2;
        saved = std::move(now);
        saved_copy = k;
      }
    }
    int64_t w = t, shift = 0;  // the window's step, and how far its buffers' last steps move
    if (t >= cut + repeated) {
      w = t - repeated;
      shift = repeated;
    } else if (t >= cut) {
      w = cut - period + (t - cut) % period;
      shift = ((t - cut) / period + 1) * period;
    }
    const size_t lo = begin[static_cast<size_t>(w)], hi = begin[static_cast<size_t>(w) + 1];
    for (size_t i = lo; i < hi; ++i) {
      // A buffer from before the repeated period ends where it ends in the
      // window: the window's period after the cut is the model's first
      // inserted one (checked above). The others move with their step.
      const int64_t last = allocs[i].last + (w < cut - period ? g_periodic_skew : shift);
      if (i + 1 == hi && last == t) {
        heap.AllocateAndFree(allocs[i].bytes);  // as Place: nothing else lives with it
        continue;
      }
      live.push_back({last, seq++, heap.Allocate(allocs[i].bytes), allocs[i].bytes});
      std::push_heap(live.begin(), live.end(), std::greater<>());
    }
    while (!live.empty() && live.front().last <= t) {
      heap.Free(live.front().offset, live.front().bytes);
      std::pop_heap(live.begin(), live.end(), std::greater<>());
      live.pop_back();
    }
  }
  return heap.high_water();
}

void VerifyPlacement(const std::vector<Placed>& placed, int32_t rank, std::vector<std::string>* errors) {
  // Sweep in time: buffers live at the same step must not share bytes.
  std::vector<size_t> order(placed.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return placed[a].first < placed[b].first; });
  std::multimap<int64_t, size_t> active;  // last step -> placed index
  std::map<int64_t, size_t> by_offset;    // offset -> placed index (active)
  for (size_t idx : order) {
    const Placed& b = placed[idx];
    while (!active.empty() && active.begin()->first < b.first) {
      by_offset.erase(placed[active.begin()->second].offset);
      active.erase(active.begin());
    }
    auto next = by_offset.lower_bound(b.offset);
    bool clash = next != by_offset.end() && next->first < b.offset + b.size;
    if (next != by_offset.begin()) {
      const Placed& prev = placed[std::prev(next)->second];
      clash |= prev.offset + prev.size > b.offset;
    }
    if (clash) {
      errors->push_back("pp rank " + std::to_string(rank) + ": buffers overlap at offset " + std::to_string(b.offset) +
                        " during step " + std::to_string(b.first));
      return;
    }
    by_offset[b.offset] = idx;
    active.emplace(b.last, idx);
  }
}

}  // namespace

std::vector<int64_t> AnyPlanLowerBounds(const PlanningProblem& p) { return p.any_plan_lower_bound; }

namespace testing {
void SkewPeriodicExpansion(int64_t steps) { g_periodic_skew = steps; }
int64_t PeriodicJumps() { return g_periodic_jumps.load(); }
}  // namespace testing

namespace {

Evaluation EvaluateImpl(const PlanningProblem& p, const Assignment& a, bool verify, const Evaluation* reuse,
                        const std::vector<bool>* changed, bool place) {
  Evaluation e;
  size_t instances = 0;
  for (const auto& insts : p.instances) instances += insts.size();
  e.intervals.reserve(2 * instances);  // most instances have one or two
  const int32_t pp = static_cast<int32_t>(p.tensors.size());
  e.ranks.resize(static_cast<size_t>(pp));
  // Per rank, in parallel (common/parallel.h); the intervals are then
  // concatenated in rank order, the order the memory program follows.
  std::vector<std::vector<Interval>> own(static_cast<size_t>(pp));
  ParallelFor(static_cast<size_t>(pp), [&](size_t ri) {
    const int32_t r = static_cast<int32_t>(ri);
    TransferStats stats;
    InstanceIntervals(p, a, r, &own[ri], &stats);
    RankBounds& b = e.ranks[ri];
    b.exposed_transfer_s = stats.exposed_s;
    // Instances whose copy-out cannot finish before their prefetch window
    // opens stay resident (accounted as kept); they move no bytes.
    b.resident_offloads = stats.late_copies;
    const auto& insts = p.instances[ri];
    // Host copies: a difference array over the rank's steps (a window's
    // steps are translates of the model's, so its maximum is the model's).
    std::vector<int64_t> host(static_cast<size_t>(p.timelines[ri].steps) + 2, 0);
    bool any_host = false;
    for (const Instance& in : insts) {
      const Storage s = a.storage[ri][static_cast<size_t>(in.tensor)];
      if (s != Storage::kOffloadHost && s != Storage::kFp8OffloadHost) continue;
      const auto& t = p.tensors[ri][static_cast<size_t>(in.tensor)];
      const int64_t bytes = s == Storage::kFp8OffloadHost ? t.fp8_bytes : t.bytes;
      host[static_cast<size_t>(std::min(in.prod, in.b_first))] += bytes;
      host[static_cast<size_t>(std::max(in.prod, in.b_first)) + 1] -= bytes;
      any_host = true;
    }
    if (any_host) {
      int64_t run = 0;
      for (int64_t v : host) b.host_activations_peak = std::max(b.host_activations_peak, run += v);
    }
    for (size_t i = 0; i < insts.size(); ++i) {
      Storage s = a.storage[ri][static_cast<size_t>(insts[i].tensor)];
      const auto w = static_cast<double>(InstanceWeight(p, r, static_cast<int32_t>(i)));
      if (s == Storage::kRecompute) b.recompute_s += w * InstanceCost(p, r, static_cast<int32_t>(i), s);
      if (IsFp8(s)) b.quantize_s += w * InstanceCost(p, r, static_cast<int32_t>(i), Storage::kFp8);
    }
  });
  for (auto& v : own) {
    e.intervals.insert(e.intervals.end(), v.begin(), v.end());
    std::vector<Interval>().swap(v);
  }
  auto profiles = Profiles(p, e.intervals);
  const auto& any = p.any_plan_lower_bound;
  std::vector<std::vector<size_t>> mine(static_cast<size_t>(pp));
  for (size_t k = 0; k < e.intervals.size(); ++k) mine[static_cast<size_t>(e.intervals[k].rank)].push_back(k);
  std::vector<std::vector<std::string>> errors(static_cast<size_t>(pp));
  ParallelFor(static_cast<size_t>(pp), [&](size_t ri) {
    const int32_t r = static_cast<int32_t>(ri);
    RankBounds& b = e.ranks[ri];
    const auto& prof = profiles[ri];
    auto it = std::max_element(prof.begin(), prof.end());
    b.activations_peak = it == prof.end() ? 0 : *it;
    b.peak_step = it == prof.end() ? 0 : it - prof.begin();
    int64_t stat = p.statics[ri].total;
    b.lower_bound = stat + b.activations_peak;
    b.any_plan_lower_bound = any[ri];
    std::vector<Placed> placed;
    if (!place) {
      b.peak = b.lower_bound;
      b.periodic = true;
    } else if (reuse && changed && !(*changed)[ri] && !verify) {
      b.peak = reuse->ranks[ri].peak;
      b.periodic = reuse->ranks[ri].periodic;
    } else if (p.window && !verify) {
      const std::optional<int64_t> high = PlacePeriodic(p, r, e.intervals, mine[ri]);
      b.periodic = high.has_value();
      b.peak = stat + (high ? *high : Place(p, r, e.intervals, mine[ri], nullptr));
    } else {
      b.peak = stat + Place(p, r, e.intervals, mine[ri], verify ? &placed : nullptr);
    }
    if (verify) VerifyPlacement(placed, r, &errors[ri]);
  });
  for (auto& v : errors) e.verify_errors.insert(e.verify_errors.end(), v.begin(), v.end());
  // Bytes each rank holds on each other rank, at their maximum: one pass
  // over the intervals, a difference array per (owner, target) pair.
  std::map<std::pair<int32_t, int32_t>, std::vector<int64_t>> held;
  for (const auto& iv : e.intervals) {
    if (iv.rank == iv.owner_rank) continue;
    auto& d = held[{iv.owner_rank, iv.rank}];
    if (d.empty()) d.assign(static_cast<size_t>(p.timelines[static_cast<size_t>(iv.rank)].steps) + 1, 0);
    d[static_cast<size_t>(iv.first)] += iv.bytes;
    d[static_cast<size_t>(iv.last) + 1] -= iv.bytes;
  }
  for (auto& [pair, d] : held) {
    int64_t run = 0, mx = 0;
    for (int64_t v : d) mx = std::max(mx, run += v);
    e.ranks[static_cast<size_t>(pair.first)].remote_offload.emplace_back(pair.second, mx);
  }
  if (verify) {
    // Every decision allowed by the one storage rule (liveness.h) ...
    for (int32_t r = 0; r < pp && e.verify_errors.size() < 20; ++r) {
      const auto& ts = p.tensors[static_cast<size_t>(r)];
      for (size_t t = 0; t < ts.size() && e.verify_errors.size() < 20; ++t) {
        if (auto why = StorageRefusal(ts[t], a.storage[static_cast<size_t>(r)][t], pp, r, a.target[static_cast<size_t>(r)][t])) {
          e.verify_errors.push_back("pp rank " + std::to_string(r) + ": " + *why);
        }
      }
    }
    // ... and every instance resident when produced and through its layer's backward.
    std::vector<std::vector<std::vector<std::pair<int64_t, int64_t>>>> cover(static_cast<size_t>(pp));
    for (int32_t r = 0; r < pp; ++r) cover[static_cast<size_t>(r)].resize(p.instances[static_cast<size_t>(r)].size());
    for (const auto& iv : e.intervals) {
      if (iv.rank != iv.owner_rank) continue;
      cover[static_cast<size_t>(iv.owner_rank)][static_cast<size_t>(iv.instance)].emplace_back(iv.first, iv.last);
    }
    for (int32_t r = 0; r < pp && e.verify_errors.size() < 20; ++r) {
      for (size_t i = 0; i < p.instances[static_cast<size_t>(r)].size(); ++i) {
        const Instance& in = p.instances[static_cast<size_t>(r)][i];
        auto segs = cover[static_cast<size_t>(r)][i];
        std::sort(segs.begin(), segs.end());
        auto covers = [&](int64_t lo, int64_t hi) {
          int64_t need = lo;
          for (auto [f, l] : segs) {
            if (f <= need && l >= need) need = l + 1;
            if (need > hi) return true;
          }
          return need > hi;
        };
        if (!covers(in.prod, in.f_last) || !covers(in.b_first, in.b_last)) {
          e.verify_errors.push_back("pp rank " + std::to_string(r) + ": " +
                                    p.tensors[static_cast<size_t>(r)][static_cast<size_t>(in.tensor)].name + "@mb" +
                                    std::to_string(in.microbatch) + " is not resident when it is used");
          break;
        }
      }
    }
  }
  return e;
}

}  // namespace

Evaluation Evaluate(const PlanningProblem& p, const Assignment& a, bool verify, const Evaluation* reuse,
                    const std::vector<bool>* changed) {
  return EvaluateImpl(p, a, verify, reuse, changed, true);
}

Evaluation EvaluateUnplaced(const PlanningProblem& p, const Assignment& a) {
  return EvaluateImpl(p, a, false, nullptr, nullptr, false);
}

std::vector<AllocatorReplay> ReplayCachingAllocator(const PlanningProblem& p, const Evaluation& e,
                                                    const CachingAllocatorConfig& config,
                                                    const std::vector<int64_t>& capacity) {
  const size_t pp = p.timelines.size();
  std::vector<std::vector<size_t>> mine(pp);
  for (size_t k = 0; k < e.intervals.size(); ++k) mine[static_cast<size_t>(e.intervals[k].rank)].push_back(k);
  std::vector<AllocatorReplay> out(pp);
  ParallelFor(pp, [&](size_t r) {
    CachingAllocatorConfig c = config;
    if (r < capacity.size()) c.capacity_bytes = capacity[r];
    CachingAllocatorModel heap(c);
    ProgramWalker walk(p, static_cast<int32_t>(r), e.intervals, mine[r]);
    while (walk.Next()) {
      for (ProgramBuffer& b : walk.allocations()) b.tag = b.bytes > 0 ? heap.Allocate(b.bytes) : -1;
      for (const ProgramBuffer& b : walk.Frees()) {
        if (b.tag >= 0) heap.Free(b.tag);
      }
    }
    out[r] = {heap.peak_allocated_bytes(), heap.peak_reserved_bytes(), heap.segments()};
  });
  return out;
}

}  // namespace memplan::planner
