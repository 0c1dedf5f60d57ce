// Block buffers (liveness.h, BlockBuffer): what each layer's forward and
// backward blocks allocate for themselves, derived from the layer's graph.
#include <algorithm>
#include <string>
#include <vector>

#include "memplan/common/check.h"
#include "memplan/planner/op_registry.h"
#include "layer_info.h"

namespace memplan::planner {

LayerBuffers MakeLayerBuffers(const LayerGraph& g, const std::vector<LayerInfo>& info, size_t l) {
  using B = BlockBuffer;
  const LayerInfo& li = info[l];
  LayerBuffers lb;
  const int32_t n = static_cast<int32_t>(g.ops.size());
  lb.ops = n;
  lb.prod = li.prod;
  lb.last_use = li.last_use;
  lb.export_to = li.export_to;
  lb.import_from = li.import_from;
  lb.share_layer = li.share_layer;
  lb.share_index = li.share_index;
  lb.shared_out = li.shared_out;
  auto push = [](std::vector<B>* v, B::Role role, B::When when, int32_t tensor, int32_t op, int32_t first,
                 int32_t last, int64_t bytes, int32_t next_last = -1) {
    if (bytes <= 0) return;
    B b;
    b.role = role;
    b.when = when;
    b.tensor = tensor;
    b.op = op;
    b.first = first;
    b.last = std::max(first, last);
    b.next_last = next_last;
    b.bytes = bytes;
    v->push_back(b);
  };
  // Forward: values that are not saved, from their producer to their last
  // consumer; the layer's output, until the next block of the pass is done
  // with it (or, when that block saves it, written into the saved instance).
  for (size_t t = 0; t < g.tensors.size(); ++t) {
    const TensorSpec& ts = g.tensors[t];
    if (ts.saved || li.share_layer[t] >= 0) continue;  // shared: read in place
    int32_t ti = static_cast<int32_t>(t);
    int32_t prod = li.prod[t];
    int32_t use = li.last_use[t];
    if (prod >= 0) {
      int32_t exp = li.export_to[t];
      if (exp >= 0) {
        const LayerInfo& ni = info[l + 1];
        bool next_saved = ni.saved.end() != std::find(ni.saved.begin(), ni.saved.end(), exp);
        if (!next_saved) {
          push(&lb.forward, B::Role::kValue, B::When::kNextInPass, ti, prod, prod, n - 1, ts.bytes,
               std::max(0, ni.last_use[static_cast<size_t>(exp)]));
        }
        push(&lb.forward, B::Role::kValue, B::When::kNextNotInPass, ti, prod, prod, n - 1, ts.bytes);
      } else {
        push(&lb.forward, B::Role::kValue, B::When::kAlways, ti, prod, prod, use, ts.bytes);
      }
    } else if (li.import_from[t] >= 0) {
      push(&lb.forward, B::Role::kValue, B::When::kPrevNotInPass, ti, -1, 0, use, ts.bytes);
    } else {
      push(&lb.forward, B::Role::kValue, B::When::kAlways, ti, -1, 0, use, ts.bytes);
    }
  }
  // Backward: local step j runs the backward of the op at position n-1-j.
  auto bstep = [n](int32_t pos) { return n - 1 - pos; };
  for (size_t t = 0; t < g.tensors.size(); ++t) {
    const TensorSpec& ts = g.tensors[t];
    // Shared tensors' gradients are cross buffers (CrossBuffer).
    if (!IsFloat(ts.dtype) || li.share_layer[t] >= 0 || li.shared_out[t]) continue;
    int32_t ti = static_cast<int32_t>(t);
    int32_t prod = li.prod[t];
    int32_t use = li.last_use[t];
    if (prod >= 0) {
      if (li.export_to[t] >= 0) {
        // Received from the next layer's backward on another pass or rank;
        // within the pass, that block's buffer spills into this one.
        push(&lb.backward, B::Role::kGrad, B::When::kPrevNotInPass, ti, prod, 0, bstep(prod), ts.bytes);
      } else if (use >= 0) {
        // Under the MoE gradient rewrite (the combine's routed input not
        // saved) the combine's backward writes no gate gradient: the last
        // expert GEMM's backward does, later (found by eager execution).
        int32_t writer = use;
        const OpSpec& last = g.ops[g.TopologicalOrder()[static_cast<size_t>(use)]];
        if (last.op == OpKind::kCombine && last.inputs.size() > 2 && last.inputs[1] == ts.name) {
          const size_t routed = static_cast<size_t>(li.tensor_idx.at(last.inputs[0]));
          if (!g.tensors[routed].saved && li.prod[routed] >= 0) writer = li.prod[routed];
        }
        push(&lb.backward, B::Role::kGrad, B::When::kAlways, ti, prod, bstep(writer), bstep(prod), ts.bytes);
      }
    } else if (use >= 0 && li.import_from[t] >= 0) {
      const LayerInfo& pi = info[l - 1];
      int32_t src_prod = pi.prod[static_cast<size_t>(li.import_from[t])];
      int32_t prev_n = static_cast<int32_t>(pi.fwd_s.size());
      push(&lb.backward, B::Role::kGrad, B::When::kNextInPass, ti, -1, bstep(use), n - 1, ts.bytes,
           prev_n - 1 - src_prod);
      push(&lb.backward, B::Role::kGrad, B::When::kNextNotInPass, ti, -1, bstep(use), n - 1, ts.bytes);
    }
  }
  const auto& order = g.TopologicalOrder();
  std::vector<int32_t> need_first(g.tensors.size(), -1), need_last(g.tensors.size(), -1);
  for (int32_t pos = 0; pos < n; ++pos) {
    const OpSpec& op = g.ops[order[static_cast<size_t>(pos)]];
    if (op.workspace_bytes > 0) {
      push(&lb.backward, B::Role::kWorkspace, B::When::kAlways, -1, pos, bstep(pos), bstep(pos), op.workspace_bytes);
    }
    // An input gradient that an earlier backward (a later consumer, or the
    // next layer) already wrote is summed: kernels that overwrite their
    // input gradients write into a temporary first.
    if (!GradAccumulates(op.op)) {
      for (const auto& in : op.inputs) {
        size_t t = static_cast<size_t>(li.tensor_idx.at(in));
        if (!IsFloat(g.tensors[t].dtype)) continue;
        bool later_reader = li.last_use[t] > pos || li.export_to[t] >= 0 || li.share_layer[t] >= 0 || li.shared_out[t];
        if (later_reader) {
          push(&lb.backward, B::Role::kGradTemp, B::When::kAlways, static_cast<int32_t>(t), pos, bstep(pos),
               bstep(pos), g.tensors[t].bytes);
        }
      }
    }
    for (int32_t t : BackwardReads(g, op)) {
      // Saved and shared tensors are resident; inputs from elsewhere arrive.
      if (g.tensors[static_cast<size_t>(t)].saved || li.prod[static_cast<size_t>(t)] < 0) continue;
      // Backward runs from the last op down: the first reader is the highest position.
      auto& f = need_first[static_cast<size_t>(t)];
      f = f < 0 ? bstep(pos) : std::min(f, bstep(pos));
      need_last[static_cast<size_t>(t)] = std::max(need_last[static_cast<size_t>(t)], bstep(pos));
    }
  }
  // A rebuilt value whose producer reads another value that is not saved
  // needs that one rebuilt first (producers from the last down, so that the
  // need travels up whole chains).
  std::vector<size_t> by_prod;
  for (size_t t = 0; t < g.tensors.size(); ++t) {
    if (li.prod[t] >= 0) by_prod.push_back(t);
  }
  std::stable_sort(by_prod.begin(), by_prod.end(), [&](size_t x, size_t y) { return li.prod[x] > li.prod[y]; });
  for (size_t t : by_prod) {
    if (need_first[t] < 0) continue;
    const OpSpec& op = g.ops[order[static_cast<size_t>(li.prod[t])]];
    for (const auto& in : op.inputs) {
      size_t u = static_cast<size_t>(li.tensor_idx.at(in));
      if (g.tensors[u].saved || li.prod[u] < 0) continue;
      need_first[u] = need_first[u] < 0 ? need_first[t] : std::min(need_first[u], need_first[t]);
      need_last[u] = std::max(need_last[u], need_last[t]);
    }
  }
  // Re-running a producer writes all its outputs: the ones that are not
  // saved are rebuilt alongside, for the same steps.
  for (size_t t = 0; t < g.tensors.size(); ++t) {
    if (need_first[t] < 0) continue;
    const OpSpec& op = g.ops[order[static_cast<size_t>(li.prod[t])]];
    for (const auto& out : op.outputs) {
      size_t u = static_cast<size_t>(li.tensor_idx.at(out));
      if (u == t || g.tensors[u].saved) continue;
      if (need_first[u] < 0) {
        need_first[u] = need_first[t], need_last[u] = need_last[t];
      } else {
        need_first[u] = std::min(need_first[u], need_first[t]);
        need_last[u] = std::max(need_last[u], need_last[t]);
      }
    }
  }
  for (size_t t = 0; t < g.tensors.size(); ++t) {
    if (need_first[t] < 0) continue;
    push(&lb.backward, B::Role::kRebuilt, B::When::kAlways, static_cast<int32_t>(t), li.prod[t], need_first[t],
         need_last[t], g.tensors[t].bytes);
  }
  // Saved tensors: their last reader in backward.
  lb.bwd_last.assign(g.tensors.size(), -1);
  for (int32_t pos = 0; pos < n; ++pos) {
    for (int32_t t : BackwardReads(g, g.ops[order[static_cast<size_t>(pos)]])) {
      lb.bwd_last[static_cast<size_t>(t)] = std::max(lb.bwd_last[static_cast<size_t>(t)], bstep(pos));
    }
  }
  for (int32_t pos = 0; pos < n; ++pos) {
    // The MoE gradient rewrite: the last expert GEMM's backward reads the
    // combine's gates and slots (op_impls.cc, ExpertsFc2 backward).
    const OpSpec& op = g.ops[order[static_cast<size_t>(pos)]];
    if (op.op != OpKind::kCombine || op.inputs.size() < 3) continue;
    const size_t routed = static_cast<size_t>(li.tensor_idx.at(op.inputs[0]));
    if (g.tensors[routed].saved || li.prod[routed] < 0) continue;
    for (size_t k : {size_t{1}, size_t{2}}) {
      size_t t = static_cast<size_t>(li.tensor_idx.at(op.inputs[k]));
      lb.bwd_last[t] = std::max(lb.bwd_last[t], bstep(li.prod[routed]));
    }
  }
  for (size_t u = 0; u < g.tensors.size(); ++u) {
    if (need_first[u] < 0) continue;  // a rebuilt value: its producer reads its inputs then
    for (const auto& in : g.ops[order[static_cast<size_t>(li.prod[u])]].inputs) {
      size_t t = static_cast<size_t>(li.tensor_idx.at(in));
      lb.bwd_last[t] = std::max(lb.bwd_last[t], need_first[u]);
    }
  }
  auto by_first = [](const B& a, const B& b) { return a.first < b.first; };
  std::stable_sort(lb.forward.begin(), lb.forward.end(), by_first);
  std::stable_sort(lb.backward.begin(), lb.backward.end(), by_first);
  return lb;
}

}  // namespace memplan::planner
