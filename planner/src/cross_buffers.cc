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
  const int64_t mbs = p.model->train.microbatches;
  std::vector<std::vector<CrossBuffer>> out(static_cast<size_t>(pp));
  std::vector<int32_t> layer_rank(p.layers.size(), 0);
  for (int64_t r = 0; r < pp; ++r) {
    for (const auto& chunk : p.layout.chunks[static_cast<size_t>(r)]) {
      for (int64_t l : chunk) layer_rank[static_cast<size_t>(l)] = static_cast<int32_t>(r);
    }
  }
  // Saved index of each graph tensor (the rank-local tensor is base + it).
  auto instance_of = [&](int64_t layer, int32_t tensor, int32_t mb) {
    const LayerGraph& g = p.layers[static_cast<size_t>(layer)];
    int32_t k = 0;
    for (int32_t t = 0; t < tensor; ++t) k += g.tensors[static_cast<size_t>(t)].saved ? 1 : 0;
    return (tensor_base[static_cast<size_t>(layer)].front() + k) * static_cast<int32_t>(mbs) + mb;
  };
  struct Use {
    int64_t fwd_first = -1, bwd_first = -1, bwd_last = -1;
  };
  // (owner rank, instance) -> reading rank -> its uses.
  std::map<std::pair<int32_t, int32_t>, std::map<int32_t, Use>> uses;
  bool any = false;
  for (const auto& lb : p.layer_buffers) {
    for (size_t t = 0; t < lb.share_layer.size(); ++t) any |= lb.share_layer[t] >= 0;
  }
  if (!any) return out;
  auto note = [](int64_t* lo, int64_t* hi, int64_t step) {
    if (lo) *lo = *lo < 0 ? step : std::min(*lo, step);
    if (hi) *hi = std::max(*hi, step);
  };
  for (int64_t r = 0; r < pp; ++r) {
    const RankTimeline& tl = p.timelines[static_cast<size_t>(r)];
    for (const Block& blk : tl.blocks) {
      const LayerGraph& g = p.layers[static_cast<size_t>(blk.layer)];
      const LayerBuffers& lb = p.layer_buffers[static_cast<size_t>(blk.layer)];
      const auto& order = g.TopologicalOrder();
      const int32_t n = lb.ops;
      auto use_inputs = [&](int32_t pos, int64_t step, bool forward, bool grad) {
        const OpSpec& op = g.ops[order[static_cast<size_t>(pos)]];
        for (const auto& name : op.inputs) {
          const TensorSpec* ts = g.FindTensor(name);
          const size_t t = static_cast<size_t>(ts - g.tensors.data());
          int64_t layer = blk.layer;
          int32_t tensor = static_cast<int32_t>(t);
          if (lb.share_layer[t] >= 0) {
            layer = lb.share_layer[t];
            tensor = lb.share_index[t];
          } else if (!lb.shared_out[t]) {
            continue;
          }
          const int32_t owner = layer_rank[static_cast<size_t>(layer)];
          Use& u = uses[{owner, instance_of(layer, tensor, blk.microbatch)}][static_cast<int32_t>(r)];
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
