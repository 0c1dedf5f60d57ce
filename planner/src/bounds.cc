#include "memplan/planner/bounds.h"

#include <algorithm>
#include <map>

#include "memplan/common/best_fit_heap.h"
#include "memplan/common/parallel.h"
#include "memplan/common/units.h"
#include "memplan/planner/program.h"

namespace memplan::planner {
namespace {

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

Evaluation Evaluate(const PlanningProblem& p, const Assignment& a, bool verify, const Evaluation* reuse,
                    const std::vector<bool>* changed) {
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
    for (size_t i = 0; i < insts.size(); ++i) {
      Storage s = a.storage[ri][static_cast<size_t>(insts[i].tensor)];
      double c = InstanceCost(p, r, static_cast<int32_t>(i), s);
      if (s == Storage::kRecompute) b.recompute_s += c;
      if (IsFp8(s)) b.quantize_s += InstanceCost(p, r, static_cast<int32_t>(i), Storage::kFp8);
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
    if (reuse && changed && !(*changed)[ri] && !verify) {
      b.peak = reuse->ranks[ri].peak;
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

}  // namespace memplan::planner
