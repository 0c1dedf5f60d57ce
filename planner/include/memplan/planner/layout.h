// Pipeline layout: which global layers each pipeline rank and virtual chunk
// holds, and how many microbatches of each chunk are in flight at a rank's
// activation peak under (interleaved) 1F1B with every activation kept.
//
// Virtual stage v = c * pp + r (chunk c of rank r) holds consecutive layers,
// in order of v, as Megatron-LM assigns them. Within a rank, its layers are
// split over its vp chunks as evenly as possible (earlier chunks take the
// remainder).
#pragma once

#include <cstdint>
#include <vector>

#include "memplan/planner/model.h"

namespace memplan::planner {

struct PipelineLayout {
  int64_t pp = 1;
  int64_t vp = 1;
  // chunks[r][c]: global layer indices of chunk c on pipeline rank r.
  std::vector<std::vector<std::vector<int64_t>>> chunks;
  // For each global layer: its rank and chunk.
  std::vector<int64_t> rank_of_layer;
  std::vector<int64_t> chunk_of_layer;

  std::vector<int64_t> LayersOfRank(int64_t rank) const;
};

PipelineLayout MakePipelineLayout(const Model& model);

// Warm-up forwards of rank r (0-based) before its first backward:
// plain 1F1B: min(pp - r - 1, m); interleaved: min(2*(pp - r - 1) + (vp - 1)*pp, m*vp).
int64_t WarmupForwards(int64_t pp, int64_t vp, int64_t rank, int64_t microbatches);

// Forwards of each chunk that are in flight at rank r's peak: the warm-up
// forwards plus the first steady-state forward, before the first backward
// frees anything. Megatron runs forward k of an interleaved rank on chunk
// (k / pp) % vp. The sum is min(pp - r, m) for vp = 1 and
// min(2*(pp - r - 1) + (vp - 1)*pp + 1, m*vp) for vp > 1.
std::vector<int64_t> InFlightPerChunk(int64_t pp, int64_t vp, int64_t rank, int64_t microbatches);

}  // namespace memplan::planner
