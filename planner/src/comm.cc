#include "memplan/planner/comm.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <string_view>

#include "memplan/planner/accounting.h"

namespace memplan::planner {
namespace {

// A group of `span` consecutive ranks stays inside one node when the span
// fits; otherwise its ring crosses the node's per-GPU inter-node link.
Link LinkFor(int64_t span, const Hardware& hw) {
  const Hardware::Efficiency& e = hw.efficiency;
  if (span <= hw.gpus_per_node) return Link{hw.peer_bw * e.nvlink, e.nvlink_latency_s, false};
  return Link{hw.pp_link_bw * e.network, e.network_latency_s, hw.pp_link_bw != hw.peer_bw};
}

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

double AllReduceSeconds(double bytes, int64_t n, const Link& link) {
  if (n <= 1) return 0;
  const double steps = 2.0 * static_cast<double>(n - 1);
  return steps * link.latency_s + steps / static_cast<double>(n) * bytes / link.bw;
}

double AllGatherSeconds(double bytes, int64_t n, const Link& link) {
  if (n <= 1) return 0;
  const double steps = static_cast<double>(n - 1);
  return steps * link.latency_s + steps / static_cast<double>(n) * bytes / link.bw;
}

double AllToAllSeconds(double bytes, int64_t n, const Link& link) { return AllGatherSeconds(bytes, n, link); }

GroupLinks LinksOf(const Parallel& par, const Hardware& hw) {
  GroupLinks l;
  l.tp = LinkFor(par.tp, hw);
  l.cp = LinkFor(par.tp * par.cp, hw);
  // Experts are whole on every rank (expert TP 1, which export megatron
  // writes), so Megatron's expert grid folds EP over consecutive ranks
  // (MoE parallel folding, arXiv 2504.14960): the group spans ep ranks.
  l.ep = LinkFor(par.ep, hw);
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
      c.fwd_s = static_cast<double>(par.cp - 1) * (links.cp.latency_s + kv / links.cp.bw);
      c.bwd_s = 2 * c.fwd_s;
      c.overlapped = true;
      break;
    }
    default:
      break;
  }
  return c;
}

DataParallelTime DataParallelSeconds(const Model& model, const std::vector<LayerGraph>& layers,
                                     const std::vector<int64_t>& rank_layers, const GroupLinks& links) {
  const Parallel& par = model.parallel;
  const bool sharded = par.zero >= 1 || par.pipeline_zero2;
  const double gbytes = static_cast<double>(DTypeBytes(model.train.grad_dtype));
  const double pbytes = static_cast<double>(DTypeBytes(model.train.param_dtype));
  // Elements per data-parallel group (dense parameters, routed experts).
  std::map<int64_t, double> elements;
  for (int64_t layer : rank_layers) {
    for (const auto& p : layers[static_cast<size_t>(layer)].params) {
      elements[DataParallelGroup(model, p)] += static_cast<double>(LocalParamElements(model, p));
    }
  }
  DataParallelTime s;
  for (const auto& entry : elements) {
    const int64_t group = entry.first;  // named, not bound: lambdas below capture it
    const double n = entry.second;
    // Gradients travel in buckets, one collective each (Megatron's
    // ddp_bucket_size: max(40M, 1M x dp) elements): a collective's latency
    // is paid per bucket, its bandwidth per byte.
    const double bucket = std::max(40e6, 1e6 * static_cast<double>(group));
    const double buckets = std::max(1.0, std::ceil(n / bucket));
    const double share = static_cast<double>(group - 1) / static_cast<double>(group);
    // `times` collectives of `bytes` each.
    auto gather = [&](double bytes, double times = 1) {
      s.ring_bytes += times * share * bytes;
      return times * buckets * AllGatherSeconds(bytes / buckets, group, links.dp);
    };
    auto reduce = [&](double bytes) {
      s.ring_bytes += 2 * share * bytes;
      return buckets * AllReduceSeconds(bytes / buckets, group, links.dp);
    };
    if (par.zero >= 3) {
      // FSDP, every microbatch: the parameters gathered for forward (and
      // again for backward when resharded), the gradients reduce-scattered.
      const double m = static_cast<double>(model.train.microbatches);
      const double gathers = par.fsdp_reshard_after_forward ? 2 : 1;
      s.gather_s += gather(n * pbytes, m * gathers);
      s.reduce_s += gather(n * gbytes, m);
    } else if (sharded) {
      s.reduce_s += gather(n * gbytes);
      s.gather_s += gather(n * pbytes);
    } else {
      s.reduce_s += reduce(n * gbytes);
    }
  }
  return s;
}

const TensorSpec* ResidualStream(const std::vector<LayerGraph>& layers, int64_t layer) {
  return layers[static_cast<size_t>(layer)].FindTensor("layer" + std::to_string(layer) + ".attn_norm.x");
}

double PipelineSendSeconds(const Model& model, double bytes) {
  const Parallel& par = model.parallel;
  if (par.pp <= 1) return 0;
  const Link link = LinkFor(par.tp * par.cp * par.dp + 1, model.hardware);
  return link.latency_s + bytes / link.bw;
}

double OptimizerStepSeconds(const Model& model, const std::vector<LayerGraph>& layers,
                            const std::vector<int64_t>& rank_layers) {
  const Hardware& hw = model.hardware;
  if (hw.efficiency.optimizer_bytes_per_param <= 0) return 0;
  const bool sharded = model.parallel.zero >= 1 || model.parallel.pipeline_zero2;
  double params = 0;
  for (int64_t layer : rank_layers) {
    for (const auto& p : layers[static_cast<size_t>(layer)].params) {
      if (p.copy) continue;
      const double n = static_cast<double>(LocalParamElements(model, p));
      params += sharded ? n / static_cast<double>(DataParallelGroup(model, p)) : n;
    }
  }
  return params * hw.efficiency.optimizer_bytes_per_param / (hw.hbm_bw * hw.efficiency.memory);
}

double InterNodeBytes(const Model& model, const std::vector<LayerGraph>& layers, const std::vector<int64_t>& rank_layers,
                      int64_t chunks, const GroupLinks& links) {
  const Parallel& par = model.parallel;
  const Hardware& hw = model.hardware;
  const double m = static_cast<double>(model.train.microbatches);
  double bytes = 0;
  if (par.ep > 1 && links.ep.inter_node) {
    for (int64_t layer : rank_layers) {
      const LayerGraph& g = layers[static_cast<size_t>(layer)];
      for (const auto& op : g.ops) {
        if (op.op != OpKind::kDispatch && op.op != OpKind::kCombine) continue;
        const OpComm c = OpCommunication(g, op, par, links);
        const double latency = 2 * static_cast<double>(par.ep - 1) * links.ep.latency_s;
        bytes += m * (c.fwd_s + c.bwd_s - latency) * links.ep.bw;
      }
    }
  }
  if (par.dp * par.cp > 1 && links.dp.inter_node) bytes += DataParallelSeconds(model, layers, rank_layers, links).ring_bytes;
  // Megatron's order puts tp, cp and dp inside a pipeline stage: the next
  // stage is tp*cp*dp ranks away. Per microbatch and chunk, an activation
  // leaves and a gradient arrives at each end of the chunk.
  if (par.pp > 1 && par.tp * par.cp * par.dp >= hw.gpus_per_node && !rank_layers.empty()) {
    const TensorSpec* stream = ResidualStream(layers, rank_layers.front());
    if (stream) bytes += 4 * m * static_cast<double>(chunks) * static_cast<double>(stream->bytes);
  }
  return bytes;
}

}  // namespace memplan::planner
