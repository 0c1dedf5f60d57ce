#include "cross_buffers.h"

#include <algorithm>
#include <map>

#include "memplan/common/check.h"

namespace memplan::planner {

// The cross buffers of every shared instance (CrossBuffer), per rank. A use
// is a step of some rank at which an op reads a shared instance in place: its
// forward, the re-run of its producer in backward (a rebuilt value), or its
// backward (which also adds into the gradient).
std::vector<std::vector<CrossBuffer>> CrossBuffers(const PlanningProblem& p,
                                                   const std::vector<std::vector<int32_t>>& tensor_base) {
  const int64_t pp = static_cast<int64_t>(p.timelines.size());
  const int32_t mbs = static_cast<int32_t>(p.microbatches);
  std::vector<std::vector<CrossBuffer>> out(static_cast<size_t>(pp));
  // Per layer, once: for each op (topological position), the shared
  // instances its inputs are, as (owner layer, rank-local saved index of
  // that layer's tensor) — the same in every block of the layer.
  struct Read {
    int64_t layer;
    int32_t saved;
  };
  std::vector<std::vector<std::vector<Read>>> reads(p.layers.size());
  bool any = false;
  for (size_t l = 0; l < p.layers.size(); ++l) {
    const LayerGraph& g = p.layers[l];
    const LayerBuffers& lb = p.layer_buffers[l];
    const auto& order = g.TopologicalOrder();
    reads[l].resize(order.size());
    for (size_t pos = 0; pos < order.size(); ++pos) {
      for (const auto& name : g.ops[order[pos]].inputs) {
        const size_t t = static_cast<size_t>(g.FindTensor(name) - g.tensors.data());
        int64_t layer = static_cast<int64_t>(l);
        int32_t tensor = static_cast<int32_t>(t);
        if (lb.share_layer[t] >= 0) {
          layer = lb.share_layer[t];
          tensor = lb.share_index[t];
        } else if (!lb.shared_out[t]) {
          continue;
        }
        const auto& owner = p.layers[static_cast<size_t>(layer)].tensors;
        int32_t k = 0;  // the tensor's index among its layer's saved ones
        for (int32_t u = 0; u < tensor; ++u) k += owner[static_cast<size_t>(u)].saved ? 1 : 0;
        reads[l][pos].push_back({layer, tensor_base[static_cast<size_t>(layer)].front() + k});
        any = true;
      }
    }
  }
  if (!any) return out;
  struct Use {
    int64_t fwd_first = -1, bwd_first = -1, bwd_last = -1;
  };
  // (owner rank, instance) -> reading rank -> its uses.
  std::map<std::pair<int32_t, int32_t>, std::map<int32_t, Use>> uses;
  auto note = [](int64_t* lo, int64_t* hi, int64_t step) {
    if (lo) *lo = *lo < 0 ? step : std::min(*lo, step);
    if (hi) *hi = std::max(*hi, step);
  };
  for (int64_t r = 0; r < pp; ++r) {
    const RankTimeline& tl = p.timelines[static_cast<size_t>(r)];
    for (const Block& blk : tl.blocks) {
      const auto& layer_reads = reads[static_cast<size_t>(blk.layer)];
      const LayerBuffers& lb = p.layer_buffers[static_cast<size_t>(blk.layer)];
      const int32_t n = lb.ops;
      auto use_inputs = [&](int32_t pos, int64_t step, bool forward, bool grad) {
        for (const Read& rd : layer_reads[static_cast<size_t>(pos)]) {
          const int32_t owner = static_cast<int32_t>(p.layout.rank_of_layer[static_cast<size_t>(rd.layer)]);
          Use& u = uses[{owner, rd.saved * mbs + blk.microbatch}][static_cast<int32_t>(r)];
          if (forward) {
            note(&u.fwd_first, nullptr, step);
          } else {
            note(grad ? &u.bwd_first : nullptr, &u.bwd_last, step);
          }
        }
      };
      if (blk.forward) {
        for (int32_t pos = 0; pos < n; ++pos) use_inputs(pos, blk.first + pos, true, false);
        continue;
      }
      for (const BlockBuffer& b : lb.backward) {
        if (b.role != BlockBuffer::Role::kRebuilt) continue;
        int64_t first = 0, last = 0;
        if (BlockBufferSteps(blk, lb, b, &first, &last)) use_inputs(b.op, first, false, false);
      }
      for (int32_t pos = 0; pos < n; ++pos) use_inputs(pos, blk.first + (n - 1 - pos), false, true);
    }
  }
  using R = CrossBuffer::Role;
  for (const auto& [key, by_rank] : uses) {
    const int32_t owner = key.first, index = key.second;
    const Instance& in = p.instances[static_cast<size_t>(owner)][static_cast<size_t>(index)];
    const SavedTensor& st = p.tensors[static_cast<size_t>(owner)][static_cast<size_t>(in.tensor)];
    const int32_t n = p.layer_buffers[static_cast<size_t>(st.layer)].ops;
    auto add = [&](R role, int32_t rank, int64_t first, int64_t last) {
      MEMPLAN_CHECK(first >= 0 && first <= last, "shared tensor used outside its lifetime");
      out[static_cast<size_t>(rank)].push_back({role, rank, first, last, st.bytes, owner, index});
    };
    // The owner's gradient: from the first local backward that adds into it
    // (or the owner layer's first backward step, where the other ranks'
    // cache gradients arrive) to the producer's backward.
    int64_t grad_first = -1;
    bool remote = false;
    for (const auto& [rank, u] : by_rank) {
      if (rank != owner) {
        remote = true;
        note(&grad_first, nullptr, in.b_first);
        add(R::kCache, rank, u.fwd_first, u.bwd_last);
        add(R::kCacheGrad, rank, u.bwd_first, u.bwd_last);
      } else if (u.bwd_first >= 0) {
        note(&grad_first, nullptr, u.bwd_first);
      }
    }
    add(R::kSharedGrad, owner, grad_first, in.b_first + (n - 1 - std::max<int64_t>(0, st.prod_pos)));
    if (remote) add(R::kGradInbox, owner, in.b_first, in.b_first);
  }
  for (auto& v : out) {
    std::stable_sort(v.begin(), v.end(), [](const CrossBuffer& a, const CrossBuffer& b) { return a.first < b.first; });
  }
  return out;
}

}  // namespace memplan::planner
