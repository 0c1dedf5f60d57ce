#include "memplan/planner/layout.h"

#include <algorithm>

#include "memplan/common/check.h"

namespace memplan::planner {

std::vector<int64_t> PipelineLayout::LayersOfRank(int64_t rank) const {
  std::vector<int64_t> out;
  for (const auto& chunk : chunks[static_cast<size_t>(rank)]) out.insert(out.end(), chunk.begin(), chunk.end());
  return out;
}

PipelineLayout MakePipelineLayout(const Model& model) {
  const Parallel& p = model.parallel;
  PipelineLayout l;
  l.pp = p.pp;
  l.vp = p.vp;
  MEMPLAN_CHECK(static_cast<int64_t>(p.pp_layout.size()) == p.pp, "pp_layout not filled");
  // Layers per (rank, chunk).
  std::vector<std::vector<int64_t>> counts(static_cast<size_t>(p.pp));
  for (int64_t r = 0; r < p.pp; ++r) {
    int64_t n = p.pp_layout[static_cast<size_t>(r)];
    for (int64_t c = 0; c < p.vp; ++c) counts[static_cast<size_t>(r)].push_back(n / p.vp + (c < n % p.vp ? 1 : 0));
  }
  l.chunks.assign(static_cast<size_t>(p.pp), std::vector<std::vector<int64_t>>(static_cast<size_t>(p.vp)));
  l.rank_of_layer.resize(static_cast<size_t>(model.arch.layers));
  l.chunk_of_layer.resize(static_cast<size_t>(model.arch.layers));
  int64_t next = 0;
  for (int64_t c = 0; c < p.vp; ++c) {
    for (int64_t r = 0; r < p.pp; ++r) {
      for (int64_t i = 0; i < counts[static_cast<size_t>(r)][static_cast<size_t>(c)]; ++i) {
        l.chunks[static_cast<size_t>(r)][static_cast<size_t>(c)].push_back(next);
        l.rank_of_layer[static_cast<size_t>(next)] = r;
        l.chunk_of_layer[static_cast<size_t>(next)] = c;
        ++next;
      }
    }
  }
  MEMPLAN_CHECK(next == model.arch.layers, "pipeline layout does not cover every layer");
  return l;
}

int64_t WarmupForwards(int64_t pp, int64_t vp, int64_t rank, int64_t microbatches) {
  if (vp == 1) return std::min(pp - rank - 1, microbatches);
  return std::min(2 * (pp - rank - 1) + (vp - 1) * pp, microbatches * vp);
}

std::vector<int64_t> InFlightPerChunk(int64_t pp, int64_t vp, int64_t rank, int64_t microbatches) {
  std::vector<int64_t> count(static_cast<size_t>(vp), 0);
  int64_t forwards = std::min(WarmupForwards(pp, vp, rank, microbatches) + 1, microbatches * vp);
  if (vp == 1) {
    count[0] = forwards;
    return count;
  }
  // Forward k runs chunk (k / pp) % vp: groups of pp microbatches per chunk.
  // Whole cycles of pp*vp forwards visit every chunk pp times.
  int64_t cycle = pp * vp;
  for (auto& c : count) c = (forwards / cycle) * pp;
  for (int64_t k = (forwards / cycle) * cycle; k < forwards; ++k) ++count[static_cast<size_t>((k / pp) % vp)];
  return count;
}

}  // namespace memplan::planner
