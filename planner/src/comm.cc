#include "memplan/planner/comm.h"

#include <algorithm>
#include <string_view>

#include "memplan/planner/accounting.h"

namespace memplan::planner {
namespace {

// A group of `span` consecutive ranks stays inside one node when the span
// fits; otherwise its ring crosses the node's per-GPU inter-node link.
double LinkFor(int64_t span, const Hardware& hw) { return span <= hw.gpus_per_node ? hw.peer_bw : hw.pp_link_bw; }

const TensorSpec* Find(const LayerGraph& g, std::string_view name) {
  for (const auto& t : g.tensors) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

bool TpSharded(const TensorSpec& t) { return t.sharding == "tp"; }
// Sequence-parallel tensors hold 1/tp of the sequence: the whole is tp times.
double Whole(const TensorSpec& t, int64_t tp) {
  const bool seq = t.sharding == "sp" || t.sharding == "tp_seq";
  return static_cast<double>(t.bytes) * static_cast<double>(seq ? tp : 1);
}

double LargestBytes(const LayerGraph& g, const std::vector<std::string>& names) {
  double best = 0;
  for (const auto& n : names) {
    if (const TensorSpec* t = Find(g, n)) best = std::max(best, static_cast<double>(t->bytes));
  }
  return best;
}

}  // namespace

double AllReduceSeconds(double bytes, int64_t n, double bw) {
  return n <= 1 ? 0 : 2.0 * static_cast<double>(n - 1) / static_cast<double>(n) * bytes / bw;
}

double AllGatherSeconds(double bytes, int64_t n, double bw) {
  return n <= 1 ? 0 : static_cast<double>(n - 1) / static_cast<double>(n) * bytes / bw;
}

double AllToAllSeconds(double bytes, int64_t n, double bw) { return AllGatherSeconds(bytes, n, bw); }

GroupLinks LinksOf(const Parallel& par, const Hardware& hw) {
  GroupLinks l;
  l.tp = LinkFor(par.tp, hw);
  l.cp = LinkFor(par.tp * par.cp, hw);
  l.ep = LinkFor(par.tp * par.ep, hw);
  l.dp = LinkFor(par.tp * par.cp * par.dp, hw);
  return l;
}

OpComm OpCommunication(const LayerGraph& g, const OpSpec& op, const Parallel& par, const GroupLinks& links) {
  OpComm c;
  switch (op.op) {
    case OpKind::kLinear:
    case OpKind::kEmbedding: {
      if (par.tp <= 1 || op.inputs.empty() || op.outputs.empty()) break;
      const TensorSpec* in = Find(g, op.inputs.front());
      const TensorSpec* out = Find(g, op.outputs.front());
      if (in == nullptr || out == nullptr) break;
      const bool row = (op.op == OpKind::kEmbedding || TpSharded(*in)) && !TpSharded(*out);
      const bool column = op.op == OpKind::kLinear && !TpSharded(*in) && TpSharded(*out);
      if (!row && !column) break;
      // Row-parallel: the forward all-reduces the output's partial sums.
      // Column-parallel: the backward all-reduces the input gradient's. With
      // SP each becomes an all-gather one way and a reduce-scatter the other
      // (one forward, one backward) of the whole tensor.
      const double whole = Whole(row ? *out : *in, par.tp);
      if (par.sp) {
        c.fwd_s = c.bwd_s = AllGatherSeconds(whole, par.tp, links.tp);
      } else {
        (row ? c.fwd_s : c.bwd_s) = AllReduceSeconds(whole, par.tp, links.tp);
      }
      break;
    }
    case OpKind::kDispatch:
      // Tokens to their experts' ranks; the backward sends their gradients back.
      c.fwd_s = c.bwd_s = AllToAllSeconds(LargestBytes(g, op.outputs), par.ep, links.ep);
      break;
    case OpKind::kCombine:
      c.fwd_s = c.bwd_s = AllToAllSeconds(LargestBytes(g, op.inputs), par.ep, links.ep);
      break;
    case OpKind::kFlashAttention: {
      if (par.cp <= 1 || op.inputs.size() < 3) break;
      // Ring attention: cp - 1 steps, each receiving another rank's K and V
      // (the backward also returns their gradients), beside the compute.
      double kv = 0;
      for (size_t i = 1; i < 3; ++i) {
        if (const TensorSpec* t = Find(g, op.inputs[i])) kv += static_cast<double>(t->bytes);
      }
      c.fwd_s = static_cast<double>(par.cp - 1) * kv / links.cp;
      c.bwd_s = 2 * c.fwd_s;
      c.overlapped = true;
      break;
    }
    default:
      break;
  }
  return c;
}

double DataParallelSeconds(const Model& model, const std::vector<LayerGraph>& layers,
                           const std::vector<int64_t>& rank_layers, const GroupLinks& links) {
  const Parallel& par = model.parallel;
  const bool sharded = par.zero >= 1 || par.pipeline_zero2;
  const double gbytes = static_cast<double>(DTypeBytes(model.train.grad_dtype));
  const double pbytes = static_cast<double>(DTypeBytes(model.train.param_dtype));
  double s = 0;
  for (int64_t layer : rank_layers) {
    for (const auto& p : layers[static_cast<size_t>(layer)].params) {
      const double n = static_cast<double>(LocalParamElements(model, p));
      const int64_t group = DataParallelGroup(model, p);
      if (par.zero >= 3) {
        // FSDP, every microbatch: the parameters gathered for forward (and
        // again for backward when resharded), the gradients reduce-scattered.
        const double gathers = par.fsdp_reshard_after_forward ? 2 : 1;
        s += static_cast<double>(model.train.microbatches) *
             (gathers * AllGatherSeconds(n * pbytes, group, links.dp) + AllGatherSeconds(n * gbytes, group, links.dp));
      } else if (sharded) {
        s += AllGatherSeconds(n * gbytes, group, links.dp) + AllGatherSeconds(n * pbytes, group, links.dp);
      } else {
        s += AllReduceSeconds(n * gbytes, group, links.dp);
      }
    }
  }
  return s;
}

double InterNodeBytes(const Model& model, const std::vector<LayerGraph>& layers, const std::vector<int64_t>& rank_layers,
                      int64_t chunks, const GroupLinks& links) {
  const Parallel& par = model.parallel;
  const Hardware& hw = model.hardware;
  const double m = static_cast<double>(model.train.microbatches);
  auto inter = [&](double bw) { return bw == hw.pp_link_bw && hw.pp_link_bw != hw.peer_bw; };
  double bytes = 0;
  if (par.ep > 1 && inter(links.ep)) {
    for (int64_t layer : rank_layers) {
      const LayerGraph& g = layers[static_cast<size_t>(layer)];
      for (const auto& op : g.ops) {
        if (op.op != OpKind::kDispatch && op.op != OpKind::kCombine) continue;
        const OpComm c = OpCommunication(g, op, par, links);
        bytes += m * (c.fwd_s + c.bwd_s) * links.ep;
      }
    }
  }
  if (par.dp * par.cp > 1 && inter(links.dp)) bytes += DataParallelSeconds(model, layers, rank_layers, links) * links.dp;
  // Megatron's order puts tp, cp and dp inside a pipeline stage: the next
  // stage is tp*cp*dp ranks away. Per microbatch and chunk, an activation
  // leaves and a gradient arrives at each end of the chunk.
  if (par.pp > 1 && par.tp * par.cp * par.dp >= hw.gpus_per_node && !rank_layers.empty()) {
    // The residual stream: the layer's input, attn_norm.x (templates.cc).
    const int64_t first = rank_layers.front();
    const TensorSpec* stream = layers[static_cast<size_t>(first)].FindTensor("layer" + std::to_string(first) + ".attn_norm.x");
    if (stream) bytes += 4 * m * static_cast<double>(chunks) * static_cast<double>(stream->bytes);
  }
  return bytes;
}

}  // namespace memplan::planner
