// layout_study: how far layouts that could repeat every period of the
// pipeline (the periodic planner's placement, docs/planner.md "Toward a
// periodic planner") land from the deterministic best-fit heap the planner
// and the runtime use today, on the plans `memplan plan` writes.
//
//   build/bench/layout_study examples/models/deepseek-v3.json [...]
//
// Per pp rank and model file, the activation bytes (static memory left out)
// of:
//   lower bound  the maximum over steps of live bytes;
//   best fit     today's placement (Evaluate's peak);
//   class rings  one ring per saved-tensor class (owner rank, tensor, part)
//                of as many slots as its instances are ever live at once
//                (interval-graph colouring, optimal for the class alone),
//                with every other buffer best fit on its own region;
//   set layout   the parts an instance keeps until its layer's backward
//                (kept, FP8-compact, landed remote payloads) grouped per
//                (owner rank, chunk, microbatch), landed ones per layer, and
//                placed as whole sets by best fit (a few hundred items per
//                rank: cheap at any microbatch count), with the pass-local
//                buffers (transients, staging, fetched, restored) best fit
//                on a region of their own;
//   stack layout one ring of slots of the largest set, each set filling its
//                slot bottom-up in forward and draining it top-down in
//                backward; a block's pass-local buffers use what its own set
//                leaves free and spill into one overflow region (ideal
//                packing inside a block: a bound on what such a layout can
//                reach, not a placement); landed payloads best fit apart;
// and whether best fit's offsets ever repeat: the share of instances placed
// at the offset of the same tensor's instance c microbatches later, for the
// best c in 1..32 that at least half the instances have a translate for,
// averaged over ranks (instances placed by a formula would be at 100 %).
#include <algorithm>
#include <cstdio>
#include <map>
#include <tuple>
#include <vector>

#include "memplan/common/best_fit_heap.h"
#include "memplan/common/json_util.h"
#include "memplan/planner/bounds.h"
#include "memplan/planner/plan.h"
#include "memplan/planner/program.h"
#include "memplan/planner/replay.h"
#include "memplan/planner/templates.h"

namespace {

using namespace memplan::planner;

struct RankStudy {
  int64_t lower_bound = 0, best_fit = 0, class_rings = 0, set_layout = 0, stack_layout = 0;
  double repeating = 0;  // share of instances at the offset of their translate
};

struct Span {
  int64_t first = INT64_MAX, last = -1, bytes = 0;
};

// Best fit over whole spans in time order: the sets' region.
int64_t PlaceSpans(const std::vector<Span>& spans) {
  std::vector<std::tuple<int64_t, int, size_t>> events;  // (step, 0 free / 1 alloc, span)
  for (size_t i = 0; i < spans.size(); ++i) {
    events.emplace_back(spans[i].first, 1, i);
    events.emplace_back(spans[i].last + 1, 0, i);
  }
  std::sort(events.begin(), events.end());
  memplan::BestFitHeap heap(256);
  std::vector<int64_t> offset(spans.size());
  for (const auto& [step, alloc, i] : events) {
    if (alloc) {
      offset[i] = heap.Allocate(spans[i].bytes);
    } else {
      heap.Free(offset[i]);
    }
  }
  return heap.high_water();
}

RankStudy StudyRank(const PlanningProblem& p, const Evaluation& e, int32_t rank) {
  RankStudy out;
  const auto ri = static_cast<size_t>(rank);
  out.lower_bound = e.ranks[ri].activations_peak;
  out.best_fit = e.ranks[ri].peak - p.statics[ri].total;
  std::vector<size_t> mine;
  for (size_t k = 0; k < e.intervals.size(); ++k) {
    if (e.intervals[k].rank == rank) mine.push_back(k);
  }
  const RankTimeline& tl = p.timelines[ri];
  auto block_of = [&](int64_t step) {
    return std::upper_bound(tl.blocks.begin(), tl.blocks.end(), step,
                            [](int64_t s, const Block& b) { return s < b.first; }) - tl.blocks.begin();
  };
  using Class = std::tuple<int32_t, int32_t, int32_t>;          // owner, tensor, part
  using Set = std::tuple<int32_t, int32_t, int32_t, int64_t>;   // owner, chunk, microbatch, layer (landed) or -1
  std::map<Class, std::vector<std::pair<int64_t, int64_t>>> classes;  // (first, last) per instance
  std::map<Class, int64_t> class_bytes;
  std::map<Set, Span> sets;
  std::map<std::tuple<int32_t, int32_t, int32_t, int32_t>, int64_t> offsets;  // owner, tensor, part, mb -> best fit
  memplan::BestFitHeap best(256, false), rest(256, false), pass_local(256, false);
  struct Offsets {
    int64_t best, rest, pass_local;  // -1: not in that heap
  };
  std::vector<Offsets> placed;  // per buffer, by ProgramBuffer::tag
  // Stack layout: the rank's own sets' members per (chunk, microbatch),
  // what is neither (pass-local) per step, landed payloads apart.
  std::map<std::pair<int32_t, int32_t>, std::vector<Span>> members;
  std::vector<int64_t> pass_diff(static_cast<size_t>(tl.steps) + 1, 0);
  std::vector<Span> landed;
  ProgramWalker walk(p, rank, e.intervals, mine);
  while (walk.Next()) {
    for (ProgramBuffer& b : walk.allocations()) {
      const int64_t best_offset = best.Allocate(b.bytes);
      bool ring = false, set = false;
      if (b.interval >= 0) {
        const Interval& iv = e.intervals[static_cast<size_t>(b.interval)];
        const Instance& in = p.instances[static_cast<size_t>(iv.owner_rank)][static_cast<size_t>(iv.instance)];
        const SavedTensor& t = p.tensors[static_cast<size_t>(iv.owner_rank)][static_cast<size_t>(in.tensor)];
        offsets[{iv.owner_rank, in.tensor, static_cast<int32_t>(iv.part), in.microbatch}] = best_offset;
        ring = block_of(b.first) != block_of(b.last);
        if (ring) {
          Class c{iv.owner_rank, in.tensor, static_cast<int32_t>(iv.part)};
          classes[c].emplace_back(b.first, b.last);
          class_bytes[c] = std::max(class_bytes[c], best.AlignedSize(b.bytes));
        }
        const bool kept_full = iv.part == IntervalPart::kFull && iv.rank == iv.owner_rank && iv.last >= in.b_first;
        set = ring && (kept_full || iv.part == IntervalPart::kCompact || iv.part == IntervalPart::kLanded);
        if (set && iv.part != IntervalPart::kLanded) {
          members[{t.chunk, in.microbatch}].push_back({b.first, b.last, best.AlignedSize(b.bytes)});
        }
        if (set) {
          Span& s = sets[{iv.owner_rank, t.chunk, in.microbatch, iv.part == IntervalPart::kLanded ? t.layer : -1}];
          s.first = std::min(s.first, b.first);
          s.last = std::max(s.last, b.last);
          s.bytes += best.AlignedSize(b.bytes);
        }
      }
      if (!set) {
        pass_diff[static_cast<size_t>(b.first)] += best.AlignedSize(b.bytes);
        pass_diff[static_cast<size_t>(b.last) + 1] -= best.AlignedSize(b.bytes);
      } else if (e.intervals[static_cast<size_t>(b.interval)].part == IntervalPart::kLanded) {
        landed.push_back({b.first, b.last, best.AlignedSize(b.bytes)});
      }
      b.tag = static_cast<int64_t>(placed.size());
      placed.push_back({best_offset, ring ? -1 : rest.Allocate(b.bytes), set ? -1 : pass_local.Allocate(b.bytes)});
    }
    for (const ProgramBuffer& b : walk.Frees()) {
      const Offsets& o = placed[static_cast<size_t>(b.tag)];
      best.Free(o.best, b.bytes);
      if (o.rest >= 0) rest.Free(o.rest, b.bytes);
      if (o.pass_local >= 0) pass_local.Free(o.pass_local, b.bytes);
    }
  }
  // Class rings: each class's slots are its maximum concurrency.
  int64_t rings = 0;
  for (auto& [c, lives] : classes) {
    std::vector<std::pair<int64_t, int>> events;
    for (auto [f, l] : lives) {
      events.emplace_back(f, 1);
      events.emplace_back(l + 1, -1);
    }
    std::sort(events.begin(), events.end());
    int64_t live = 0, slots = 0;
    for (auto [step, d] : events) slots = std::max(slots, live += d);
    rings += slots * class_bytes[c];
  }
  out.class_rings = rings + rest.high_water();
  std::vector<Span> spans;
  for (const auto& [k, s] : sets) spans.push_back(s);
  out.set_layout = PlaceSpans(spans) + pass_local.high_water();
  // Stack layout (ideal packing inside one block's template): one ring of
  // slots of the largest set, a set filling from the bottom of its slot in
  // forward and draining from the top in backward; the pass-local buffers
  // of a block use what its own (active) set leaves of its slot and spill
  // into one overflow region above the ring.
  {
    std::map<int64_t, int32_t> chunk_of_layer;
    for (const SavedTensor& t : p.tensors[ri]) chunk_of_layer[t.layer] = t.chunk;
    int64_t slot = 0;
    std::vector<Span> spans;
    for (auto& [key, v] : members) {
      Span whole;
      for (const Span& m : v) {
        whole.first = std::min(whole.first, m.first);
        whole.last = std::max(whole.last, m.last);
        whole.bytes += m.bytes;
      }
      slot = std::max(slot, whole.bytes);
      spans.push_back(whole);
    }
    std::vector<std::pair<int64_t, int>> events;
    for (const Span& w : spans) {
      events.emplace_back(w.first, 1);
      events.emplace_back(w.last + 1, -1);
    }
    std::sort(events.begin(), events.end());
    int64_t live = 0, slots = 0;
    for (auto [step, d] : events) slots = std::max(slots, live += d);
    // Per step: the active set's live members + pass-local bytes, beyond a slot.
    std::vector<int64_t> active(static_cast<size_t>(tl.steps), 0);
    int64_t run = 0;
    for (size_t st = 0; st < active.size(); ++st) active[st] = run += pass_diff[st];
    for (size_t bi = 0; bi < tl.blocks.size(); ++bi) {
      const Block& bl = tl.blocks[bi];
      const int64_t end = bi + 1 < tl.blocks.size() ? tl.blocks[bi + 1].first : tl.steps;
      auto it = members.find({chunk_of_layer.count(bl.layer) ? chunk_of_layer[bl.layer] : 0, bl.microbatch});
      if (it == members.end()) continue;
      for (const Span& m : it->second) {
        for (int64_t st = std::max(m.first, bl.first); st <= std::min(m.last, end - 1); ++st) {
          active[static_cast<size_t>(st)] += m.bytes;
        }
      }
    }
    int64_t overflow = 0;
    for (int64_t a : active) overflow = std::max(overflow, a - slot);
    out.stack_layout = slots * slot + std::max<int64_t>(0, overflow) + PlaceSpans(landed);
  }
  // Does best fit repeat with some cycle of c microbatches?
  for (int c = 1; c <= 32; ++c) {
    int64_t same = 0, pairs = 0;
    for (const auto& [k, off] : offsets) {
      auto [owner, tensor, part, mb] = k;
      auto it = offsets.find({owner, tensor, part, mb + c});
      if (it == offsets.end()) continue;
      ++pairs;
      same += it->second == off;
    }
    // Only cycles most instances have a translate for (not mb 0 against 31 alone).
    if (2 * pairs >= static_cast<int64_t>(offsets.size())) out.repeating = std::max(out.repeating, static_cast<double>(same) / static_cast<double>(pairs));
  }
  return out;
}

double Over(int64_t layout, int64_t best_fit) {
  return 100.0 * static_cast<double>(layout - best_fit) / static_cast<double>(std::max<int64_t>(1, best_fit));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: layout_study MODEL.json [MODEL.json ...]\n");
    return 2;
  }
  std::printf("%-20s %5s %9s %9s %16s %16s %16s %10s\n", "model", "ranks", "best fit", "vs bound", "class rings",
              "set layout", "stack layout", "repeating");
  std::printf("%-20s %5s %9s %9s %16s %16s %16s %10s\n", "", "", "worst GB", "mean", "mean / worst", "mean / worst",
              "mean / worst", "mean");
  for (int i = 1; i < argc; ++i) {
    auto model = LoadModel(argv[i]);
    auto plan = model ? BuildPlan(*model) : memplan::Expected<Plan>(model.error());
    if (!plan) {
      std::fprintf(stderr, "layout_study: %s\n", plan.error().message.c_str());
      return 1;
    }
    const memplan::Json doc = memplan::Json::parse(PlanToJson(*plan).dump());
    auto layers = ExpandModel(plan->model);
    if (!layers) return 1;
    PlanningProblem p = BuildProblem(plan->model, std::move(*layers));
    auto a = ReadPlanAssignment(doc, argv[i], p);
    if (!a) {
      std::fprintf(stderr, "layout_study: %s\n", a.error().message.c_str());
      return 1;
    }
    const Evaluation e = Evaluate(p, *a, false);
    double bound = 0, rings = 0, sets = 0, stack = 0, rings_worst = -1e9, sets_worst = -1e9, stack_worst = -1e9, repeat = 0, worst_fit = 0;
    const auto ranks = static_cast<int32_t>(p.tensors.size());
    for (int32_t r = 0; r < ranks; ++r) {
      const RankStudy s = StudyRank(p, e, r);
      bound += Over(s.best_fit, s.lower_bound);
      rings += Over(s.class_rings, s.best_fit);
      sets += Over(s.set_layout, s.best_fit);
      rings_worst = std::max(rings_worst, Over(s.class_rings, s.best_fit));
      sets_worst = std::max(sets_worst, Over(s.set_layout, s.best_fit));
      stack += Over(s.stack_layout, s.best_fit);
      stack_worst = std::max(stack_worst, Over(s.stack_layout, s.best_fit));
      repeat += s.repeating / ranks;
      worst_fit = std::max(worst_fit, static_cast<double>(s.best_fit) / 1e9);
    }
    std::string name = argv[i];
    name = name.substr(name.find_last_of('/') + 1);
    char r_cell[32], s_cell[32], k_cell[32];
    std::snprintf(k_cell, sizeof k_cell, "%+.1f / %+.1f %%", stack / ranks, stack_worst);
    std::snprintf(r_cell, sizeof r_cell, "%+.1f / %+.1f %%", rings / ranks, rings_worst);
    std::snprintf(s_cell, sizeof s_cell, "%+.1f / %+.1f %%", sets / ranks, sets_worst);
    std::printf("%-20s %5d %9.2f %8.1f%% %16s %16s %16s %9.0f%%\n", name.c_str(), ranks, worst_fit, bound / ranks,
                r_cell, s_cell, k_cell, 100 * repeat);
  }
  return 0;
}
