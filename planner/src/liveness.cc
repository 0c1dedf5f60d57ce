#include "memplan/planner/liveness.h"

#include "memplan/planner/program.h"

#include <algorithm>
#include <limits>
#include <map>
#include <cmath>
#include <numeric>
#include <unordered_map>

#include "memplan/common/check.h"
#include "memplan/common/parallel.h"
#include "memplan/common/units.h"
#include "memplan/planner/comm.h"
#include "memplan/planner/kernel_time.h"
#include "memplan/planner/plan.h"
#include "cross_buffers.h"
#include "layer_info.h"

namespace memplan::planner {

std::vector<Policy> StoragePolicies(Storage s) {
  switch (s) {
    case Storage::kKeep: return {Policy::kKeep};
    case Storage::kRecompute: return {Policy::kRecompute};
    case Storage::kFp8: return {Policy::kFp8};
    case Storage::kOffloadHost: return {Policy::kOffloadHost};
    case Storage::kFp8OffloadHost: return {Policy::kFp8, Policy::kOffloadHost};
    case Storage::kOffloadRemote: return {Policy::kOffloadRemote};
    case Storage::kFp8OffloadRemote: return {Policy::kFp8, Policy::kOffloadRemote};
  }
  return {Policy::kKeep};
}

Storage StorageFrom(const std::vector<Policy>& p) {
  if (p.size() == 2) return p[1] == Policy::kOffloadHost ? Storage::kFp8OffloadHost : Storage::kFp8OffloadRemote;
  switch (p.empty() ? Policy::kKeep : p[0]) {
    case Policy::kKeep: return Storage::kKeep;
    case Policy::kRecompute: return Storage::kRecompute;
    case Policy::kFp8: return Storage::kFp8;
    case Policy::kOffloadHost: return Storage::kOffloadHost;
    case Policy::kOffloadRemote: return Storage::kOffloadRemote;
  }
  return Storage::kKeep;
}

bool IsRemote(Storage s) { return s == Storage::kOffloadRemote || s == Storage::kFp8OffloadRemote; }
bool IsOffload(Storage s) {
  return IsRemote(s) || s == Storage::kOffloadHost || s == Storage::kFp8OffloadHost;
}
bool IsFp8(Storage s) {
  return s == Storage::kFp8 || s == Storage::kFp8OffloadHost || s == Storage::kFp8OffloadRemote;
}

int64_t Fp8Bytes(const std::vector<int64_t>& shape) {
  int64_t cols = shape.empty() ? 1 : shape.back();  // a scalar is one block of one
  int64_t rows = 1;
  for (size_t i = 0; i + 1 < shape.size(); ++i) rows = CheckedMul(rows, shape[i], "fp8 rows");
  int64_t blocks = (cols + 127) / 128;
  return CheckedAdd(CheckedMul(rows, cols, "fp8 bytes"), CheckedMul(rows, blocks * 4, "fp8 scales"), "fp8 bytes");
}

int64_t StoredBytes(const SavedTensor& t, Storage s) {
  if (s == Storage::kKeep) return t.bytes;
  if (s == Storage::kFp8) return t.fp8_bytes;
  return 0;
}

std::optional<std::string> StorageRefusal(const SavedTensor& t, Storage s, int64_t pp, int32_t rank, int32_t target) {
  auto refuse = [&](const std::string& why) {
    std::string name;
    for (Policy p : StoragePolicies(s)) name += (name.empty() ? "" : "+") + std::string(PolicyName(p));
    return std::optional<std::string>(t.name + " cannot be stored as " + name + " (" + why + ")");
  };
  if (t.shared && s != Storage::kKeep) return refuse("later layers read it in place: it is only kept");
  for (Policy q : StoragePolicies(s)) {
    if (!t.allowed.Allows(q)) return refuse("--storage leaves out " + std::string(PolicyName(q)));
  }
  if (IsFp8(s) && !t.can_fp8) return refuse("fp8 needs a floating-point tensor");
  if (s == Storage::kRecompute && !t.can_recompute) return refuse("no producer chain in its layer");
  if (IsRemote(s) && pp < 2) return refuse("a remote offload needs a second pipeline rank");
  if (IsRemote(s) && rank >= 0 && (target < 0 || target >= pp || target == rank)) {
    return refuse("to_pp_rank " + std::to_string(target) + " is not another pipeline rank (0.." + std::to_string(pp - 1) + ")");
  }
  return std::nullopt;
}

bool Legal(const SavedTensor& t, Storage s, int64_t pp) { return !StorageRefusal(t, s, pp); }

namespace {

double MemoryBound(const Hardware& hw, double bytes) { return hw.launch_s + MemoryBoundSeconds(hw, bytes); }

// Nearest legal storage for an annotation that cannot apply as written:
// no fp8 for masks and indices, no recompute without a local producer, no
// remote offload without a second pipeline rank, nothing --storage leaves
// out (a remote offload becomes a host one where that is allowed).
Storage Fallback(const SavedTensor& t, Storage s, int64_t pp) {
  if (t.shared) return Storage::kKeep;
  if (s == Storage::kRecompute) return t.can_recompute && t.allowed.recompute ? s : Storage::kKeep;
  const bool fp8 = IsFp8(s) && t.can_fp8 && t.allowed.fp8;
  bool remote = IsRemote(s), host = IsOffload(s) && !remote;
  if (remote && (pp < 2 || !t.allowed.offload_remote)) remote = false, host = true;
  host = host && t.allowed.offload_host;
  if (remote) return fp8 ? Storage::kFp8OffloadRemote : Storage::kOffloadRemote;
  if (host) return fp8 ? Storage::kFp8OffloadHost : Storage::kOffloadHost;
  return fp8 ? Storage::kFp8 : Storage::kKeep;
}

}  // namespace

bool GradAccumulates(OpKind kind) { return GetOpDef(kind).grad_accumulates; }

namespace {

// Step k of a layer's block in a forward or backward pass: its time and the
// part of it spent waiting on TP / CP / EP groups.
struct StepTime {
  double dur, comm;
};
StepTime StepTimeOf(const LayerInfo& li, bool forward, size_t k) {
  const size_t n = li.fwd_s.size();
  const size_t pos = forward ? k : n - 1 - k;
  return forward ? StepTime{li.fwd_s[pos], li.fwd_comm_s[pos]} : StepTime{li.bwd_s[pos], li.bwd_comm_s[pos]};
}

// `hw` null: no times (tests of the structure). `par`, `links`: the
// communication around each op (comm.h), in the op's time.
LayerInfo Analyze(const LayerGraph& g, const Hardware* hw, const Parallel* par = nullptr,
                  const GroupLinks* links = nullptr) {
  LayerInfo info;
  const auto& order = g.TopologicalOrder();
  for (size_t i = 0; i < g.tensors.size(); ++i) info.tensor_idx.emplace(g.tensors[i].name, static_cast<int32_t>(i));
  info.prod.assign(g.tensors.size(), -1);
  info.last_use.assign(g.tensors.size(), -1);
  info.export_to.assign(g.tensors.size(), -1);
  info.import_from.assign(g.tensors.size(), -1);
  info.share_layer.assign(g.tensors.size(), -1);
  info.share_index.assign(g.tensors.size(), -1);
  info.shared_out.assign(g.tensors.size(), 0);
  for (size_t pos = 0; pos < order.size(); ++pos) {
    const OpSpec& op = g.ops[order[pos]];
    info.op_pos.emplace(op.name, static_cast<int32_t>(pos));
    static const Parallel kNoParallel;
    const OpTime compute = hw ? OpComputeSeconds(*hw, g, op, par ? *par : kNoParallel) : OpTime{};
    double fwd = compute.fwd_s, bwd = compute.bwd_s;
    if (hw && par && links) {
      const OpComm c = OpCommunication(g, op, *par, *links);
      fwd = c.overlapped ? std::max(fwd, c.fwd_s) : fwd + c.fwd_s;
      bwd = c.overlapped ? std::max(bwd, c.bwd_s) : bwd + c.bwd_s;
    }
    info.fwd_s.push_back(fwd);
    info.bwd_s.push_back(bwd);
    info.fwd_comm_s.push_back(fwd - compute.fwd_s);
    info.bwd_comm_s.push_back(bwd - compute.bwd_s);
    info.fwd_total += fwd;
    info.bwd_total += bwd;
    for (const auto& out : op.outputs) info.prod[static_cast<size_t>(info.tensor_idx.at(out))] = static_cast<int32_t>(pos);
    for (const auto& in : op.inputs) {
      auto& u = info.last_use[static_cast<size_t>(info.tensor_idx.at(in))];
      u = std::max(u, static_cast<int32_t>(pos));
    }
  }
  for (size_t i = 0; i < g.tensors.size(); ++i) {
    const TensorSpec& t = g.tensors[i];
    if (!t.saved) continue;
    info.saved.push_back(static_cast<int32_t>(i));
    auto it = info.op_pos.find(t.producer);
    info.prod_pos.push_back(it == info.op_pos.end() ? -1 : it->second);
  }
  return info;
}

// Links the tensors a layer declares under an earlier layer's name to that
// layer's saved tensor, which it reads in place (Block AttnRes with a single
// copy). Throws kBadInput when the earlier layer does not save it.
void LinkShared(const std::vector<LayerGraph>& layers, std::vector<LayerInfo>* info, const std::string& file) {
  for (size_t l = 0; l < layers.size(); ++l) {
    const LayerGraph& g = layers[l];
    for (size_t t = 0; t < g.tensors.size(); ++t) {
      const TensorSpec& ts = g.tensors[t];
      const int64_t owner = TensorLayer(ts.name);
      if (owner < 0 || owner == static_cast<int64_t>(l) || (*info)[l].prod[t] >= 0) continue;
      const JsonLocation where{file, "/graph/layers/" + std::to_string(l) + "/tensors/" + std::to_string(t)};
      if (owner > static_cast<int64_t>(l) || owner >= static_cast<int64_t>(layers.size())) {
        ThrowAt(where, "tensor \"" + ts.name + "\" names layer " + std::to_string(owner) +
                           ", which is not an earlier layer (a layer reads earlier layers' tensors in place)");
      }
      LayerInfo& oi = (*info)[static_cast<size_t>(owner)];
      auto it = oi.tensor_idx.find(ts.name);
      const TensorSpec* o = it == oi.tensor_idx.end() ? nullptr : &layers[static_cast<size_t>(owner)].tensors[static_cast<size_t>(it->second)];
      if (o == nullptr || !o->saved || o->bytes != ts.bytes || oi.prod[static_cast<size_t>(it->second)] < 0) {
        ThrowAt(where, "tensor \"" + ts.name + "\" is read in place from layer " + std::to_string(owner) +
                           ", which must produce and save it with the same bytes");
      }
      (*info)[l].share_layer[t] = static_cast<int32_t>(owner);
      (*info)[l].share_index[t] = it->second;
      oi.shared_out[static_cast<size_t>(it->second)] = 1;
    }
  }
}

// Links each layer's inputs produced by the previous layer to the tensor
// that op writes there (the residual stream crossing layers).
void LinkLayers(const std::vector<LayerGraph>& layers, std::vector<LayerInfo>* info) {
  for (size_t l = 1; l < layers.size(); ++l) {
    const LayerGraph& g = layers[l];
    const LayerGraph& prev = layers[l - 1];
    LayerInfo& li = (*info)[l];
    LayerInfo& pi = (*info)[l - 1];
    for (size_t t = 0; t < g.tensors.size(); ++t) {
      if (li.prod[t] >= 0 || g.tensors[t].producer.empty() || li.share_layer[t] >= 0) continue;
      auto op = pi.op_pos.find(g.tensors[t].producer);
      if (op == pi.op_pos.end()) continue;
      const OpSpec& o = prev.ops[prev.TopologicalOrder()[static_cast<size_t>(op->second)]];
      int32_t src = -1;
      for (const auto& out : o.outputs) {
        int32_t k = pi.tensor_idx.at(out);
        if (prev.tensors[static_cast<size_t>(k)].bytes == g.tensors[t].bytes && pi.export_to[static_cast<size_t>(k)] < 0) {
          src = k;
          break;
        }
      }
      if (src < 0) continue;
      pi.export_to[static_cast<size_t>(src)] = static_cast<int32_t>(t);
      li.import_from[t] = src;
    }
  }
}

// The producer chain that re-materializes `tensor` of layer `layer` from
// tensors that are available at its backward (saved ones, kept alive by
// their own layers), reaching back into earlier layers of the same chunk.
struct Chain {
  bool legal = true;
  double seconds = 0;
  int64_t extra_bytes = 0;
};

void AddToChain(const std::vector<LayerGraph>& layers, const std::vector<LayerInfo>& info, int64_t layer,
                const std::string& tensor, bool root, Chain* c, int depth) {
  if (!c->legal) return;
  if (depth > 12) {  // long chains are not the cheap recompute this is for
    c->legal = false;
    return;
  }
  const LayerGraph& g = layers[static_cast<size_t>(layer)];
  const LayerInfo& li = info[static_cast<size_t>(layer)];
  auto ti = li.tensor_idx.find(tensor);
  if (ti == li.tensor_idx.end()) {
    c->legal = false;
    return;
  }
  const TensorSpec& t = g.tensors[static_cast<size_t>(ti->second)];
  // Available: saved here, or another layer's tensor read in place (shared,
  // so kept resident until that layer's backward, after this one's).
  if (!root && (t.saved || li.share_layer[static_cast<size_t>(ti->second)] >= 0)) return;
  auto pi = li.op_pos.find(t.producer);
  if (pi == li.op_pos.end()) {
    // Produced by another layer: the chain would read that layer's saved
    // tensors, whose own storage may not leave them resident here.
    c->legal = false;
    return;
  }
  const OpSpec& o = g.ops[g.TopologicalOrder()[static_cast<size_t>(pi->second)]];
  // Re-running an op writes all its outputs: saved ones into their own
  // (resident) buffers, the others into the chain's scratch (the AttnRes
  // mix's weights, when a chain reads the blocks in place).
  for (const auto& out : o.outputs) {
    const TensorSpec& ot = g.tensors[static_cast<size_t>(li.tensor_idx.at(out))];
    if (out != tensor && !ot.saved) c->extra_bytes += ot.bytes;
  }
  c->seconds += li.fwd_s[static_cast<size_t>(pi->second)];
  if (!root) c->extra_bytes += t.bytes;
  if (o.inputs.empty()) return;
  for (const auto& in : o.inputs) AddToChain(layers, info, layer, in, false, c, depth + 1);
}

template <class T>
std::optional<double> FirstCost(const Model& m, const std::string& name, T field) {
  for (const auto& c : m.costs) {
    if ((c.*field).has_value() && GlobMatch(c.match, name)) return *(c.*field);
  }
  return std::nullopt;
}

}  // namespace

int64_t StepAt(const RankTimeline& t, double s) {
  auto it = std::lower_bound(t.end_s.begin(), t.end_s.end(), s);
  if (it == t.end_s.end()) return t.steps - 1;
  return static_cast<int64_t>(it - t.end_s.begin());
}

int64_t CopyDoneStep(const RankTimeline& t, const Instance& inst, int64_t bytes, double bw) {
  return std::max(inst.prod, StepAt(t, inst.prod_end_s + static_cast<double>(bytes) / bw));
}

namespace {

// The pipeline's timing: per virtual stage one microbatch's pass times,
// per rank its passes' start times and the data-parallel reduction left
// after its last backward, and the base step (the pipeline, then each
// rank's exposed reduction).
struct PipelineTimes {
  std::vector<double> stage_fwd_s, stage_bwd_s;
  std::vector<std::vector<double>> pass_start;
  std::vector<double> dp_exposed_s;
  double makespan_s = 0;
};

PipelineTimes PipelineTiming(const Model& model, const std::vector<LayerGraph>& layers, const PipelineLayout& layout,
                             const std::vector<RankSchedule>& schedules, const std::vector<LayerInfo>& info,
                             const GroupLinks& links) {
  const int64_t pp = model.parallel.pp;
  const int64_t vp = model.parallel.vp;
  PipelineTimes t;
  t.stage_fwd_s.assign(static_cast<size_t>(pp * vp), 0);
  t.stage_bwd_s.assign(static_cast<size_t>(pp * vp), 0);
  for (int64_t r = 0; r < pp; ++r) {
    for (int64_t c = 0; c < vp; ++c) {
      for (int64_t layer : layout.chunks[static_cast<size_t>(r)][static_cast<size_t>(c)]) {
        t.stage_fwd_s[static_cast<size_t>(c * pp + r)] += info[static_cast<size_t>(layer)].fwd_total;
        t.stage_bwd_s[static_cast<size_t>(c * pp + r)] += info[static_cast<size_t>(layer)].bwd_total;
      }
    }
  }
  // Each pass ends by sending its output (forward: the activation to the
  // next virtual stage; backward: its gradient to the previous one), the
  // residual stream of the chunk's first layer; blocking, as 1F1B's sends.
  for (int64_t r = 0; r < pp; ++r) {
    for (int64_t c = 0; c < vp; ++c) {
      const auto& chunk = layout.chunks[static_cast<size_t>(r)][static_cast<size_t>(c)];
      if (chunk.empty()) continue;
      const TensorSpec* stream = ResidualStream(layers, chunk.front());
      if (stream == nullptr) continue;
      const double send = PipelineSendSeconds(model, static_cast<double>(stream->bytes));
      const int64_t v = c * pp + r;
      if (v + 1 < pp * vp) t.stage_fwd_s[static_cast<size_t>(v)] += send;
      if (v > 0) t.stage_bwd_s[static_cast<size_t>(v)] += send;
    }
  }
  t.pass_start = PassStarts(schedules, pp, vp, model.train.microbatches, t.stage_fwd_s, t.stage_bwd_s, &t.makespan_s);
  // Data parallelism: a layer's gradients are final after its last
  // microbatch's backward, so their reduction overlaps the rank's last
  // backward of every chunk (Megatron's --overlap-grad-reduce); the updated
  // weights' all-gather overlaps the first forward of every chunk of the
  // next step (--overlap-param-gather). What remains delays the end of the
  // step.
  t.dp_exposed_s.assign(static_cast<size_t>(pp), 0);
  for (int64_t r = 0; r < pp; ++r) {
    std::vector<int64_t> rank_layers;
    double bwd_window = 0, fwd_window = 0;
    for (int64_t c = 0; c < vp; ++c) {
      const auto& chunk = layout.chunks[static_cast<size_t>(r)][static_cast<size_t>(c)];
      rank_layers.insert(rank_layers.end(), chunk.begin(), chunk.end());
      const size_t stage = static_cast<size_t>(c * pp + r);
      bwd_window += t.stage_bwd_s[stage];
      fwd_window += t.stage_fwd_s[stage];
    }
    const DataParallelTime dp = DataParallelSeconds(model, layers, rank_layers, links);
    const size_t ri = static_cast<size_t>(r);
    if (model.parallel.zero >= 3) {
      // ZeRO-3 gathers and reduce-scatters beside every pass (prefetched).
      const double m = static_cast<double>(model.train.microbatches);
      t.dp_exposed_s[ri] = std::max(0.0, dp.total_s() - m * (fwd_window + bwd_window));
    } else {
      t.dp_exposed_s[ri] = std::max(0.0, dp.reduce_s - bwd_window) + std::max(0.0, dp.gather_s - fwd_window);
    }
    const auto& sched = schedules[ri];
    if (sched.empty()) continue;
    const PassRef& last = sched.back();
    const size_t stage = static_cast<size_t>(last.chunk * pp + r);
    const double end = t.pass_start[ri].back() + (last.forward ? t.stage_fwd_s[stage] : t.stage_bwd_s[stage]);
    t.makespan_s = std::max(t.makespan_s, end + t.dp_exposed_s[ri] + OptimizerStepSeconds(model, layers, rank_layers));
  }
  return t;
}

}  // namespace

double BaseStepSeconds(const Model& model, const std::vector<LayerGraph>& layers) {
  const GroupLinks links = LinksOf(model.parallel, model.hardware);
  std::vector<LayerInfo> info;
  info.reserve(layers.size());
  for (const auto& g : layers) info.push_back(Analyze(g, &model.hardware, &model.parallel, &links));
  const auto schedules = BuildSchedules(model.parallel.pp, model.parallel.vp, model.train.microbatches);
  return PipelineTiming(model, layers, MakePipelineLayout(model), schedules, info, links).makespan_s;
}

int64_t InstanceWeight(const PlanningProblem& p, int32_t rank, int32_t instance) {
  if (!p.window) return 1;
  const Instance& in = p.instances[static_cast<size_t>(rank)][static_cast<size_t>(instance)];
  const SavedTensor& t = p.tensors[static_cast<size_t>(rank)][static_cast<size_t>(in.tensor)];
  return p.window->Weight(rank, t.chunk, in.microbatch);
}

PlanningProblem BuildProblem(const Model& model, std::vector<LayerGraph> layers, Simulation simulation) {
  PlanningProblem p;
  p.model = &model;
  p.layers = std::move(layers);
  p.layout = MakePipelineLayout(model);
  const int64_t pp = model.parallel.pp;
  const int64_t vp = model.parallel.vp;
  p.schedules = BuildSchedules(pp, vp, model.train.microbatches);
  const Hardware& hw = model.hardware;

  std::vector<LayerInfo> info;
  info.reserve(p.layers.size());
  const GroupLinks links = LinksOf(model.parallel, hw);
  for (const auto& g : p.layers) info.push_back(Analyze(g, &hw, &model.parallel, &links));
  LinkShared(p.layers, &info, model.file);
  LinkLayers(p.layers, &info);
  for (size_t l = 0; l < p.layers.size(); ++l) p.layer_buffers.push_back(MakeLayerBuffers(p.layers[l], info, l));
  // Per layer: its tensors that are earlier layers' shared blocks, read in place.
  std::vector<std::vector<int32_t>> shared_reads(p.layers.size());
  for (size_t l = 0; l < p.layers.size(); ++l) {
    const auto& share = p.layer_buffers[l].share_layer;
    for (size_t t = 0; t < share.size(); ++t) {
      if (share[t] >= 0) shared_reads[l].push_back(static_cast<int32_t>(t));
    }
  }

  // --- Saved tensors per rank ------------------------------------------------
  p.tensors.resize(static_cast<size_t>(pp));
  p.statics.resize(static_cast<size_t>(pp));
  std::vector<std::vector<int32_t>> tensor_base(p.layers.size());  // layer -> rank-local index of its first saved tensor
  for (int64_t r = 0; r < pp; ++r) {
    p.statics[static_cast<size_t>(r)] = AccountRank(model, p.layers, p.layout, r);
    auto& ts = p.tensors[static_cast<size_t>(r)];
    for (int64_t c = 0; c < vp; ++c) {
      const auto& chunk = p.layout.chunks[static_cast<size_t>(r)][static_cast<size_t>(c)];
      for (int64_t layer : chunk) {
        const LayerGraph& g = p.layers[static_cast<size_t>(layer)];
        const LayerInfo& li = info[static_cast<size_t>(layer)];
        tensor_base[static_cast<size_t>(layer)].push_back(static_cast<int32_t>(ts.size()));
        for (size_t k = 0; k < li.saved.size(); ++k) {
          const TensorSpec& spec = g.tensors[static_cast<size_t>(li.saved[k])];
          SavedTensor t;
          t.name = spec.name;
          t.layer = layer;
          t.chunk = static_cast<int32_t>(c);
          t.graph_index = li.saved[k];
          t.bytes = spec.bytes;
          t.fp8_bytes = Fp8Bytes(spec.shape);
          t.can_fp8 = IsFloat(spec.dtype);
          t.prod_pos = li.prod_pos[k];
          t.shared = li.shared_out[static_cast<size_t>(li.saved[k])] != 0;
          Chain chain;
          AddToChain(p.layers, info, layer, spec.name, true, &chain, 0);
          t.can_recompute = chain.legal;
          t.allowed = model.storage;
          t.recompute_s = chain.seconds;
          t.recompute_extra_bytes = chain.extra_bytes;
          t.fp8_s = 2 * MemoryBound(hw, static_cast<double>(t.bytes + t.fp8_bytes));
          t.cost_recompute_s = FirstCost(model, t.name, &CostOverride::recompute_s);
          t.cost_fp8_s = FirstCost(model, t.name, &CostOverride::fp8_s);
          t.cost_offload_s = FirstCost(model, t.name, &CostOverride::offload_s);
          for (const auto& a : model.policies) {
            if (GlobMatch(a.match, t.name)) {
              t.annotated = true;
              t.annotation = a.policy;
              t.annotation_glob = a.match;
              t.annotated_storage = Fallback(t, StorageFrom(a.policy), pp);
              break;
            }
          }
          ts.push_back(std::move(t));
        }
      }
    }
  }

  // --- Pipeline timing ---------------------------------------------------------
  PipelineTimes times = PipelineTiming(model, p.layers, p.layout, p.schedules, info, links);
  p.makespan_s = times.makespan_s;
  // PCIe contention: the busiest rank's inter-node rate, per direction (half
  // of what it sends and receives), leaves the rest of the host link to
  // offload copies; at least a tenth is kept (copies are not starved).
  if (hw.d2h_bw > 0 && p.makespan_s > 0) {
    for (int64_t r = 0; r < pp; ++r) {
      std::vector<int64_t> rank_layers;
      for (const auto& chunk : p.layout.chunks[static_cast<size_t>(r)]) rank_layers.insert(rank_layers.end(), chunk.begin(), chunk.end());
      const double rate = InterNodeBytes(model, p.layers, rank_layers, vp, links) / 2 / p.makespan_s;
      p.inter_node_bytes_per_s = std::max(p.inter_node_bytes_per_s, rate);
    }
    const double link = std::min(hw.d2h_bw, hw.h2d_bw);
    p.offload_bw_share = std::clamp((link - p.inter_node_bytes_per_s) / link, 0.1, 1.0);
  }
  p.stage_fwd_s = times.stage_fwd_s;
  p.stage_bwd_s = times.stage_bwd_s;
  std::vector<std::vector<double>> pass_start = std::move(times.pass_start);
  // The periodic window (period.h): simulate a few microbatches for all.
  std::vector<RankSchedule> full_schedules;
  if (simulation == Simulation::kPeriodic) {
    double pipeline_s = 0;  // the passes alone, as FindWindow simulates them
    PassStarts(p.schedules, pp, vp, model.train.microbatches, p.stage_fwd_s, p.stage_bwd_s, &pipeline_s);
    p.window = FindWindow(pp, vp, model.train.microbatches, p.stage_fwd_s, p.stage_bwd_s, p.schedules, pass_start,
                          pipeline_s);
    if (p.window) {
      full_schedules = std::move(p.schedules);
      p.schedules = p.window->schedules;
      pass_start = p.window->starts;
    }
  }
  const int64_t mbs = p.window ? p.window->simulated : model.train.microbatches;
  p.microbatches = mbs;
  // Every microbatch simulated: instances and steps grow with layers x
  // microbatches (model.h).
  if (static_cast<int64_t>(p.layers.size()) * mbs > kMaxSimulatedLayerMicrobatches) {
    ThrowError(ErrorCode::kBadInput,
               model.file + ": /train/microbatches: " + std::to_string(mbs) + " microbatches of " +
                   std::to_string(p.layers.size()) + " layers is " +
                   std::to_string(static_cast<int64_t>(p.layers.size()) * mbs) +
                   " layer-microbatches to simulate one by one, over the limit of " +
                   std::to_string(kMaxSimulatedLayerMicrobatches) +
                   (simulation == Simulation::kFull
                        ? std::string(" (every microbatch simulated)")
                        : std::string(" (this pipeline's timing has no periodic window to stand for them)")));
  }

  // --- Steps and instances -------------------------------------------------------
  p.timelines.resize(static_cast<size_t>(pp));
  p.instances.resize(static_cast<size_t>(pp));
  p.first_instance.resize(static_cast<size_t>(pp));
  // Per rank, in parallel (common/parallel.h): each writes its own slots.
  ParallelFor(static_cast<size_t>(pp), [&](size_t rank_index) {
    const int64_t r = static_cast<int64_t>(rank_index);
    const auto& ts = p.tensors[static_cast<size_t>(r)];
    auto& insts = p.instances[static_cast<size_t>(r)];
    auto& first = p.first_instance[static_cast<size_t>(r)];
    for (size_t t = 0; t <= ts.size(); ++t) first.push_back(static_cast<int32_t>(t * static_cast<size_t>(mbs)));
    insts.resize(ts.size() * static_cast<size_t>(mbs));
    for (size_t t = 0; t < ts.size(); ++t) {
      for (int64_t m = 0; m < mbs; ++m) {
        auto& in = insts[t * static_cast<size_t>(mbs) + static_cast<size_t>(m)];
        in.tensor = static_cast<int32_t>(t);
        in.microbatch = static_cast<int32_t>(m);
      }
    }
    RankTimeline& tl = p.timelines[static_cast<size_t>(r)];
    tl.dp_exposed_s = times.dp_exposed_s[rank_index];
    const auto& sched = p.schedules[static_cast<size_t>(r)];
    int64_t prev_block_first = 0;
    for (size_t pi = 0; pi < sched.size(); ++pi) {
      const PassRef& pr = sched[pi];
      const auto& chunk = p.layout.chunks[static_cast<size_t>(r)][static_cast<size_t>(pr.chunk)];
      double now = pass_start[static_cast<size_t>(r)][pi];
      auto visit = [&](size_t j) {
        int64_t layer = pr.forward ? chunk[j] : chunk[chunk.size() - 1 - j];
        const LayerInfo& li = info[static_cast<size_t>(layer)];
        int64_t block_first = tl.steps;
        Block blk;
        blk.first = block_first;
        blk.layer = layer;
        blk.microbatch = pr.microbatch;
        blk.forward = pr.forward;
        blk.prev_in_pass = j > 0;
        blk.next_in_pass = j + 1 < chunk.size();
        tl.blocks.push_back(blk);
        size_t n = li.fwd_s.size();
        for (size_t k = 0; k < n; ++k) {
          const auto [dur, comm] = StepTimeOf(li, pr.forward, k);
          tl.start_s.push_back(now);
          now += dur;
          tl.end_s.push_back(now);
          tl.step_pass.push_back(static_cast<int32_t>(pi));
          tl.compute_s += dur - comm;
          tl.comm_s += comm;
          ++tl.steps;
        }
        const auto& bases = tensor_base[static_cast<size_t>(layer)];
        int32_t base = bases.empty() ? 0 : bases.front();
        for (size_t k = 0; k < li.saved.size(); ++k) {
          Instance& in = insts[(static_cast<size_t>(base) + k) * static_cast<size_t>(mbs) + static_cast<size_t>(pr.microbatch)];
          size_t gi = static_cast<size_t>(li.saved[k]);
          if (pr.forward) {
            in.prod = block_first + std::max<int64_t>(0, li.prod_pos[k]);
            int32_t src = li.import_from[gi];
            if (li.prod_pos[k] < 0 && src >= 0 && blk.prev_in_pass) {
              // Written straight into this instance by the previous layer's
              // last op, unless that layer saves the value itself (then it is
              // copied at this block's first step).
              const LayerInfo& prev = info[static_cast<size_t>(layer - 1)];
              bool src_saved = p.layers[static_cast<size_t>(layer - 1)].tensors[static_cast<size_t>(src)].saved;
              if (!src_saved) in.prod = prev_block_first + prev.prod[static_cast<size_t>(src)];
            }
            in.f_last = in.prod;
            if (li.last_use[gi] >= 0) in.f_last = std::max(in.f_last, block_first + li.last_use[gi]);
            int32_t exp = li.export_to[gi];
            if (exp >= 0) {
              int64_t next_first = block_first + static_cast<int64_t>(n);
              if (blk.next_in_pass) {
                const LayerInfo& ni = info[static_cast<size_t>(layer + 1)];
                bool exp_saved = p.layers[static_cast<size_t>(layer + 1)].tensors[static_cast<size_t>(exp)].saved;
                in.f_last = std::max(in.f_last, next_first + (exp_saved ? 0 : std::max(0, ni.last_use[static_cast<size_t>(exp)])));
              } else {
                in.f_last = std::max(in.f_last, next_first - 1);  // sent at the end of the pass
              }
            }
          } else {
            in.b_first = block_first;
            // Shared tensors (read in place by later layers) stay to the end.
            const LayerBuffers& lbuf = p.layer_buffers[static_cast<size_t>(layer)];
            // A shared tensor (read in place by later layers) lives until its
            // last reader on this rank (raised below); the others until their
            // last backward reader, at least the layer's restore step.
            const int32_t own = lbuf.bwd_last[gi];
            in.b_last = li.shared_out[gi] ? (own >= 0 ? block_first + own : in.f_last)
                                          : block_first + std::max(0, own);
            in.pf_start = prev_block_first;
          }
        }
        prev_block_first = block_first;
      };
      for (size_t j = 0; j < chunk.size(); ++j) visit(j);
    }
    // Shared tensors: their in-place readers on this rank, forward and
    // backward (found by eager execution: a block read only through other
    // ranks' caches is not needed here after its producer).
    for (const Block& blk : tl.blocks) {
      const LayerBuffers& lbuf = p.layer_buffers[static_cast<size_t>(blk.layer)];
      const LayerInfo& li = info[static_cast<size_t>(blk.layer)];
      for (const int32_t ti : shared_reads[static_cast<size_t>(blk.layer)]) {
        const size_t t = static_cast<size_t>(ti);
        const int32_t owner_layer = lbuf.share_layer[t];
        if (p.layout.rank_of_layer[static_cast<size_t>(owner_layer)] != r) continue;
        const int32_t local = blk.forward ? li.last_use[t] : lbuf.bwd_last[t];
        if (local < 0) continue;
        const LayerInfo& oi = info[static_cast<size_t>(owner_layer)];
        const auto k = std::find(oi.saved.begin(), oi.saved.end(), lbuf.share_index[t]) - oi.saved.begin();
        const auto& bases = tensor_base[static_cast<size_t>(owner_layer)];
        if (bases.empty() || static_cast<size_t>(k) >= oi.saved.size()) continue;
        Instance& in = insts[(static_cast<size_t>(bases.front()) + static_cast<size_t>(k)) * static_cast<size_t>(mbs) +
                             static_cast<size_t>(blk.microbatch)];
        in.b_last = std::max(in.b_last, blk.first + local);
      }
    }
    // Block buffers per step.
    std::vector<int64_t> diff(static_cast<size_t>(tl.steps) + 1, 0);
    for (const Block& blk : tl.blocks) {
      const LayerBuffers& lb = p.layer_buffers[static_cast<size_t>(blk.layer)];
      for (const BlockBuffer& b : blk.forward ? lb.forward : lb.backward) {
        int64_t first = 0, last = 0;
        if (!BlockBufferSteps(blk, lb, b, &first, &last)) continue;
        MEMPLAN_CHECK(last < tl.steps, "block buffer outlives the timeline");
        diff[static_cast<size_t>(first)] += b.bytes;
        diff[static_cast<size_t>(last) + 1] -= b.bytes;
      }
    }
    tl.transient.resize(static_cast<size_t>(tl.steps));
    int64_t run = 0;
    for (size_t st = 0; st < tl.transient.size(); ++st) tl.transient[st] = run += diff[st];
    for (auto& in : insts) {
      in.prod_end_s = tl.end_s[static_cast<size_t>(in.prod)];
      in.pf_start_s = tl.start_s[static_cast<size_t>(in.pf_start)];
      in.need_s = tl.start_s[static_cast<size_t>(in.b_first)];
    }
  });
  if (p.window) {
    for (int64_t r = 0; r < pp; ++r) {
      RankTimeline& tl = p.timelines[static_cast<size_t>(r)];
      // The model's sums, added in the model's order (the same bits as
      // simulating every microbatch): every op of every pass.
      tl.compute_s = tl.comm_s = 0;
      for (const PassRef& pr : full_schedules[static_cast<size_t>(r)]) {
        const auto& chunk = p.layout.chunks[static_cast<size_t>(r)][static_cast<size_t>(pr.chunk)];
        for (size_t j = 0; j < chunk.size(); ++j) {
          const LayerInfo& li = info[static_cast<size_t>(pr.forward ? chunk[j] : chunk[chunk.size() - 1 - j])];
          for (size_t k = 0; k < li.fwd_s.size(); ++k) {
            const auto [dur, comm] = StepTimeOf(li, pr.forward, k);
            tl.compute_s += dur - comm;
            tl.comm_s += comm;
          }
        }
      }
      auto first_step_of = [&](int64_t pass) {
        return static_cast<int64_t>(std::lower_bound(tl.step_pass.begin(), tl.step_pass.end(), pass) - tl.step_pass.begin());
      };
      const int64_t h = p.window->cut_pass[static_cast<size_t>(r)];
      const int64_t cut = first_step_of(h);
      p.period_steps.push_back({cut, cut - first_step_of(h - p.window->period_passes)});
    }
  }
  p.cross = CrossBuffers(p, tensor_base);
  for (int64_t r = 0; r < pp; ++r) {
    RankTimeline& tl = p.timelines[static_cast<size_t>(r)];
    std::vector<int64_t> diff(static_cast<size_t>(tl.steps) + 1, 0);
    for (const CrossBuffer& c : p.cross[static_cast<size_t>(r)]) {
      diff[static_cast<size_t>(c.first)] += c.bytes;
      diff[static_cast<size_t>(c.last) + 1] -= c.bytes;
    }
    int64_t run = 0;
    for (size_t st = 0; st < tl.transient.size(); ++st) tl.transient[st] += run += diff[st];
  }
  p.tensor_cost_s.resize(static_cast<size_t>(pp));
  ParallelFor(static_cast<size_t>(pp), [&](size_t rank_index) {
    const int64_t r = static_cast<int64_t>(rank_index);
    const auto& first = p.first_instance[static_cast<size_t>(r)];
    auto& table = p.tensor_cost_s[static_cast<size_t>(r)];
    table.resize(p.tensors[static_cast<size_t>(r)].size());
    for (size_t t = 0; t < table.size(); ++t) {
      for (int s = 0; s < kStorageCount; ++s) {
        double c = 0;
        for (int32_t i = first[t]; i < first[t + 1]; ++i) {
          c += static_cast<double>(InstanceWeight(p, static_cast<int32_t>(r), i)) *
               InstanceCost(p, static_cast<int32_t>(r), i, static_cast<Storage>(s));
        }
        table[t][static_cast<size_t>(s)] = c;
      }
    }
  });
  auto any = AnyPlanProfiles(p);
  for (size_t r = 0; r < any.size(); ++r) {
    int64_t m = any[r].empty() ? 0 : *std::max_element(any[r].begin(), any[r].end());
    p.any_plan_lower_bound.push_back(p.statics[r].total + m);
  }
  return p;
}

Assignment Assignment::KeepAll(const PlanningProblem& p) {
  Assignment a;
  for (const auto& ts : p.tensors) {
    a.storage.emplace_back(ts.size(), Storage::kKeep);
    a.target.emplace_back(ts.size(), -1);
  }
  return a;
}

Assignment Assignment::Annotated(const PlanningProblem& p) {
  Assignment a = KeepAll(p);
  for (size_t r = 0; r < p.tensors.size(); ++r) {
    for (size_t t = 0; t < p.tensors[r].size(); ++t) {
      const SavedTensor& st = p.tensors[r][t];
      if (!st.annotated) continue;
      a.storage[r][t] = st.annotated_storage;
      // Remote targets of annotated tensors: the last rank (the least loaded
      // under 1F1B), or the next one for the last rank itself.
      if (IsRemote(st.annotated_storage)) {
        int32_t last = static_cast<int32_t>(p.tensors.size()) - 1;
        a.target[r][t] = static_cast<int32_t>(r) == last ? last - 1 : last;
      }
    }
  }
  return a;
}


std::vector<int32_t> BackwardReads(const LayerGraph& g, const OpSpec& op) {
  auto idx = [&](const std::string& name) {
    for (size_t i = 0; i < g.tensors.size(); ++i) {
      if (g.tensors[i].name == name) return static_cast<int32_t>(i);
    }
    return -1;
  };
  std::vector<int32_t> r;
  for (const OpSlot& s : GetOpDef(op.op).backward_reads) {
    const auto& names = s.output ? op.outputs : op.inputs;
    const size_t lo = s.index == OpSlot::kAll ? 0 : s.index;
    const size_t hi = s.index == OpSlot::kAll ? names.size() : std::min<size_t>(s.index + 1, names.size());
    for (size_t k = lo; k < hi; ++k) {
      int32_t t = idx(names[k]);
      if (t < 0 || (s.only_if_saved && !g.tensors[static_cast<size_t>(t)].saved)) continue;
      r.push_back(t);
    }
  }
  if (const auto& m = testing::ActivePlannerMutation(); !m.spurious_read_kind.empty() && op.kind == m.spurious_read_kind) {
    for (const auto& name : op.inputs) {  // tests only: a registry entry declaring reads its backward never makes
      const int32_t t = idx(name);
      if (t >= 0 && std::find(r.begin(), r.end(), t) == r.end()) r.push_back(t);
    }
  }
  return r;
}

bool BlockBufferSteps(const Block& block, const LayerBuffers& lb, const BlockBuffer& b, int64_t* first, int64_t* last) {
  using W = BlockBuffer::When;
  switch (b.when) {
    case W::kAlways: break;
    case W::kPrevInPass: if (!block.prev_in_pass) return false; break;
    case W::kPrevNotInPass: if (block.prev_in_pass) return false; break;
    case W::kNextInPass: if (!block.next_in_pass) return false; break;
    case W::kNextNotInPass: if (block.next_in_pass) return false; break;
  }
  *first = block.first + b.first;
  *last = b.when == W::kNextInPass ? block.first + lb.ops + b.next_last : block.first + b.last;
  return true;
}


}  // namespace memplan::planner
