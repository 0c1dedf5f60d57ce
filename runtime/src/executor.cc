#include "memplan/runtime/executor.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "memplan/common/check.h"
#include "memplan/common/schema.h"
#include "memplan/common/units.h"
#include "memplan/common/workspace.h"
#include "memplan/kernels/ops.h"
#include "memplan/planner/accounting.h"
#include "memplan/planner/bounds.h"
#include "memplan/planner/liveness.h"
#include "memplan/planner/model.h"
#include "memplan/planner/plan.h"
#include "memplan/planner/templates.h"
#include "memplan/runtime/activation.h"
#include "memplan/runtime/backend.h"
#include "memplan/runtime/npy.h"
#include "memplan/traces/cupti_source.h"
#include "memplan/traces/chrome_trace.h"
#include "memplan/traces/gpu_timeline.h"

#include "cupti_measure.h"

namespace memplan::runtime {

std::string_view BackendName(BackendKind kind) { return kind == BackendKind::kCuda ? "cuda" : "host"; }

namespace {

using planner::Block;
using planner::BlockBuffer;
using planner::Instance;
using planner::Interval;
using planner::IntervalPart;
using planner::LayerBuffers;
using planner::LayerGraph;
using planner::OpSpec;
using planner::PlanningProblem;
using planner::SavedTensor;
using planner::Storage;
using planner::TensorSpec;

// The exact math the runtime applies (docs/runtime.md repeats it).
constexpr float kLayerNormEps = 1e-5f;
constexpr float kRmsNormEps = 1e-6f;
constexpr float kDropoutP = 0.1f;
constexpr bool kRouterRenormalize = true;

uint64_t Fnv1a(std::string_view s) {
  uint64_t h = 1469598103934665603ull;
  for (char c : s) {
    h ^= static_cast<uint8_t>(c);
    h *= 1099511628211ull;
  }
  return h;
}

int64_t Elements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

Error BadInput(const std::string& msg) { return Error{ErrorCode::kBadInput, msg}; }

// --- Static state -------------------------------------------------------------

struct ParamState {
  const planner::ParamSpec* spec = nullptr;
  std::vector<int64_t> shape;  // as stored (a tied head stores the embedding's [vocab, hidden])
  int64_t elements = 0;
  Buffer weight, grad, m, v;
  bool tied_head = false;  // stores the embedding matrix; logits = x * E^T
};

// A copy in flight, for the trace.
struct CopySpan {
  traces::Stream stream;
  std::string name;
  double issue_us;
  Event event;
};

struct Rank {
  int32_t index = 0;
  std::unique_ptr<Device> dev;   // activations
  std::unique_ptr<Device> stat;  // weights, gradients, optimizer state
  std::unique_ptr<HostArena> host;
  std::unique_ptr<kernels::Ops> ops;
  int64_t static_bytes = 0;
  OpsMemory ops_memory;  // planned static buffers: cuBLAS workspace, kernel scratch
  std::vector<ParamState> params;
  std::unordered_map<std::string, size_t> param_index;
  std::map<std::pair<int64_t, int32_t>, std::vector<int64_t>> routing;  // (layer, mb) -> expert offsets (host)
  std::vector<std::vector<int32_t>> produced_at;  // step -> instances produced there
  size_t block = 0;
  int64_t next_step = 0;
  // Measurement.
  std::vector<traces::TimelinePoint> timeline;
  std::map<std::string, int64_t> events;  // the executor's own; the manager's are merged at the end
  std::vector<CopySpan> copies;
  double queue_end_us[traces::kStreamCount] = {0, 0, 0, 0};
};

class Executor {
 public:
  Executor(const Json& plan, const RunOptions& options) : plan_json_(plan), options_(options) {}

  Expected<RunResult> Run();
  // Reads and checks the plan (Setup) without executing anything.
  Expected<std::monostate> Validate();

 private:
  Expected<std::monostate> Setup();
  Expected<std::monostate> Check();
  Expected<std::monostate> MakeRanks();
  void InitParams(Rank& r);
  void Step(Rank& r);
  bool Runnable(const Rank& r) const;
  void SyncTied();
  void Optimize(double* grad_norm);
  void MakeBatch();
  Expected<std::monostate> Dump(bool grads);
  Expected<RunResult> Finish(double grad_norm, double step_s);

  // Tensors.
  const LayerGraph& G(int64_t layer) const { return p_.layers[static_cast<size_t>(layer)]; }
  const LayerBuffers& LB(int64_t layer) const { return p_.layer_buffers[static_cast<size_t>(layer)]; }
  int32_t SavedIndex(int64_t layer, int32_t tensor) const;
  int32_t InstIndex(int64_t layer, int32_t tensor, int32_t mb) const;
  Buffer FwdFull(Rank& r, int64_t layer, int32_t tensor, int32_t mb) {
    return acts_->Forward(r.index, InstIndex(layer, tensor, mb));
  }
  Buffer BwdFull(Rank& r, int64_t layer, int32_t tensor, int32_t mb) {
    return acts_->Backward(r.index, InstIndex(layer, tensor, mb));
  }
  Buffer BlockBuf(Rank& r, size_t block, BlockBuffer::Role role, int32_t tensor, int32_t op = -1) {
    return acts_->BlockBuffer(r.index, static_cast<int64_t>(block), role, tensor, op);
  }
  // A forward value of `tensor` in block `bi` (forward) or, in backward, its
  // saved or rebuilt copy.
  Buffer Value(Rank& r, size_t bi, int32_t tensor);
  Buffer Grad(Rank& r, size_t bi, int32_t tensor);
  const ParamState& Param(Rank& r, const OpSpec& op, std::string_view suffix = "weight");
  // The query and norm weight of a Block AttnRes op.
  std::pair<const ParamState*, const ParamState*> AttnResParams(Rank& r, const OpSpec& op);
  // Whether layer `layer`'s sources end with a running (partial) block.
  bool AttnResHasPartial(int64_t layer) const { return layer % model_.arch.attn_res->block_layers != 0; }

  // Ops.
  void Forward(Rank& r, size_t bi, int32_t pos, const std::function<Buffer(int32_t)>& value, int32_t mb);
  void Backward(Rank& r, size_t bi, int32_t pos);
  void Recompute(Rank& r, size_t bi, int32_t inst);
  void RestoreLayer(Rank& r, size_t bi);
  void LoadInput(Rank& r, size_t bi, int32_t tensor, Buffer dst);

  // Trace and measurement.
  double NowUs() const {
    return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0_).count();
  }
  void TakeCopies(Rank& r) {
    for (auto& c : acts_->TakeCopies(r.index)) {
      if (!options_.trace) continue;
      auto stream = c.queue == Queue::kD2H ? traces::Stream::kD2H
                    : c.queue == Queue::kH2D ? traces::Stream::kH2D : traces::Stream::kLink;
      r.copies.push_back({stream, std::move(c.what), NowUs(), c.event});
    }
  }
  void RetireCopies(Rank& r, bool all);
  void Span(Rank& r, std::string name, std::string cat, double ts) {
    if (!options_.trace) return;
    traces::TraceSpan s;
    s.pp_rank = r.index;
    s.name = std::move(name);
    s.cat = std::move(cat);
    s.ts_us = ts;
    s.dur_us = std::max(0.0, NowUs() - ts);
    trace_.AddSpan(std::move(s));
  }

  const Json& plan_json_;
  RunOptions options_;
  planner::Model model_;
  PlanningProblem p_;
  planner::Assignment assign_;
  planner::Evaluation eval_;
  std::vector<std::vector<int64_t>> profiles_;
  std::unique_ptr<Backend> backend_;
  std::vector<std::unique_ptr<Rank>> ranks_;
  std::unique_ptr<ActivationManager> acts_;
  std::vector<std::vector<int32_t>> tensor_base_;  // layer -> rank-local index of its first saved tensor
  std::vector<std::vector<int32_t>> saved_index_;  // layer -> per graph tensor, index among saved or -1
  std::map<std::tuple<int64_t, int32_t, bool>, std::vector<std::byte>> mailbox_;  // (stage, mb, forward)
  std::vector<std::vector<int32_t>> tokens_, targets_;  // per microbatch
  double loss_sum_ = 0;
  int64_t steps_total_ = 0, steps_done_ = 0;
  std::chrono::steady_clock::time_point t0_;
  traces::ChromeTrace trace_;
  // cuda: CUPTI's view of the step (started before any device memory).
  std::unique_ptr<traces::CuptiSource> cupti_;
  int64_t context_bytes_ = 0;
  int64_t cupti_epoch_ns_ = 0;               // CUPTI's clock at t0_
  std::vector<traces::GpuOpName> gpu_ops_;  // ScopedGpuOp id k -> gpu_ops_[k - 1]
  std::vector<std::string> warnings_;
};

// --- Setup ----------------------------------------------------------------------

Expected<std::monostate> Executor::Setup() {
  const std::string& file = options_.plan_file;
  if (!plan_json_.is_object() || !plan_json_.contains("model") || !plan_json_.contains("tensors")) {
    return BadInput(file + ": not a memplan plan (expected an object with /model and /tensors)");
  }
  if (plan_json_.value("schema", Json()) != Json(std::string(planner::kPlanSchema))) {
    return BadInput(file + ": /schema: expected \"" + std::string(planner::kPlanSchema) + "\"");
  }
  if (!plan_json_.contains("digest") || !plan_json_["digest"].is_string()) {
    return BadInput(file + ": /digest: expected a string");
  }
  if (!plan_json_["tensors"].is_array()) return BadInput(file + ": /tensors: expected an array");
  if (!plan_json_.contains("ranks") || !plan_json_["ranks"].is_array()) {
    return BadInput(file + ": /ranks: expected an array");
  }
  // The whole plan against its schema before any field is used: a field
  // this runtime rebuilds rather than reads (tensors, schedule) is still
  // refused when malformed.
  if (auto valid = ValidateSchema(plan_json_, SchemaKind::kPlan, file); !valid.ok()) return valid.error();
  auto model = planner::ParseModel(plan_json_["model"], file + " /model");
  if (!model.ok()) return model.error();
  model_ = std::move(*model);
  if (plan_json_["digest"].get<std::string>() != planner::ModelDigest(model_)) {
    return BadInput(file + ": /digest does not match the embedded model (the plan was edited or is corrupt)");
  }
  const auto& par = model_.parallel;
  for (auto [name, v] : {std::pair<const char*, int64_t>{"tp", par.tp}, {"ep", par.ep}, {"cp", par.cp}, {"dp", par.dp}}) {
    if (v > 1) {
      return BadInput(file + ": /model/parallel/" + name + " is " + std::to_string(v) +
                      ": the runtime emulates pipeline ranks in one process and cannot execute " + name +
                      " > 1 yet (multi-process ranks come later)");
    }
  }
  const auto& tr = model_.train;
  for (auto [name, d] : {std::pair<const char*, planner::DType>{"act_dtype", tr.act_dtype},
                         {"param_dtype", tr.param_dtype},
                         {"grad_dtype", tr.grad_dtype}}) {
    if (d != planner::DType::kFP32) {
      return BadInput(file + ": /model/train/" + name + " is " + std::string(planner::DTypeName(d)) +
                      ": the runtime's kernels compute and store fp32, so it executes fp32 models only");
    }
  }
  if (tr.optimizer != planner::Optimizer::kAdam) {
    return BadInput(file + ": /model/train/optimizer is muon: the runtime takes Adam steps only (Muon later)");
  }
  const auto& a = model_.arch;
  if (a.mla) return BadInput(file + ": /model/arch/mla: MLA layers are not executable yet");
  if (a.linear_attention) return BadInput(file + ": /model/arch/linear_attention: KDA layers are not executable yet");
  if (a.attn_res && model_.options.attn_res_single_copy) {
    return BadInput(file + ": /model/options/attn_res_single_copy: with a single copy, every layer reads the block "
                           "representations of all earlier layers (and stages) in place; the runtime executes Block "
                           "AttnRes with attn_res_single_copy false, the blocks travelling from layer to layer");
  }
  if (!model_.graph.empty()) return BadInput(file + ": /model/graph: explicit layer graphs are not executable");

  auto layers = planner::ExpandModel(model_);
  if (!layers.ok()) return layers.error();
  static const std::set<std::string> kExecutable = {
      "embedding", "dropout", "identity", "copy", "layernorm", "rmsnorm", "linear", "split_rope", "batched_gemm",
      "softmax", "sigmoid", "add", "gelu", "swiglu", "cross_entropy", "flash_attention", "topk", "dispatch",
      "grouped_gemm", "combine", "attn_res", "attn_res_accumulate"};
  for (const auto& g : *layers) {
    for (const auto& op : g.ops) {
      if (!kExecutable.count(op.kind)) {
        return BadInput(file + ": " + op.name + ": ops of kind \"" + op.kind + "\" are not executable yet" +
                        (op.kind.starts_with("attn_res") ? " (Block AttnRes runs with options.attn_res_checkpoint on)" : ""));
      }
    }
  }
  try {
    p_ = planner::BuildProblem(model_, std::move(*layers));
  } catch (const ErrorException& e) {
    return e.error();
  }
  // Storage per tensor, as the plan decided: one of the legal compositions.
  std::unordered_map<std::string, std::pair<Storage, int32_t>> decided;
  const Json& ts = plan_json_["tensors"];
  const std::map<std::vector<std::string>, Storage> kCompositions = {
      {{"keep"}, Storage::kKeep},
      {{"recompute"}, Storage::kRecompute},
      {{"fp8"}, Storage::kFp8},
      {{"offload_host"}, Storage::kOffloadHost},
      {{"offload_remote"}, Storage::kOffloadRemote},
      {{"fp8", "offload_host"}, Storage::kFp8OffloadHost},
      {{"fp8", "offload_remote"}, Storage::kFp8OffloadRemote}};
  for (size_t i = 0; i < ts.size(); ++i) {
    const Json& t = ts[i];
    std::string where = file + ": /tensors/" + std::to_string(i);
    if (!t.is_object() || !t.contains("name") || !t["name"].is_string()) {
      return BadInput(where + ": expected an object with a string \"name\"");
    }
    if (!t.contains("effective") || !t["effective"].is_array()) return BadInput(where + "/effective: expected an array");
    std::vector<std::string> names;
    for (const auto& n : t["effective"]) {
      if (!n.is_string()) return BadInput(where + "/effective: expected policy names");
      names.push_back(n.get<std::string>());
    }
    auto comp = kCompositions.find(names);
    if (comp == kCompositions.end()) {
      return BadInput(where + "/effective: expected keep, recompute, fp8, offload_host, offload_remote or "
                              "[fp8, offload_host|offload_remote]");
    }
    int32_t target = -1;
    if (t.contains("to_pp_rank")) {
      if (!t["to_pp_rank"].is_number_integer()) return BadInput(where + "/to_pp_rank: expected an integer");
      target = t["to_pp_rank"].get<int32_t>();
    }
    if (!decided.emplace(t["name"].get<std::string>(), std::pair{comp->second, target}).second) {
      return BadInput(where + "/name: " + t["name"].get<std::string>() + " is listed twice");
    }
  }
  assign_ = planner::Assignment::KeepAll(p_);
  for (size_t r = 0; r < p_.tensors.size(); ++r) {
    for (size_t t = 0; t < p_.tensors[r].size(); ++t) {
      auto it = decided.find(p_.tensors[r][t].name);
      if (it == decided.end()) {
        return BadInput(file + ": /tensors has no entry for " + p_.tensors[r][t].name + " (a different planner made it)");
      }
      const SavedTensor& st = p_.tensors[r][t];
      auto [storage, target] = it->second;
      if (!planner::Legal(st, storage, model_.parallel.pp)) {
        return BadInput(file + ": /tensors: " + st.name + " cannot be stored as " +
                        std::string(planner::PolicyName(planner::StoragePolicies(storage).front())) +
                        (planner::IsFp8(storage) && !st.can_fp8 ? " (fp8 needs a floating-point tensor)" : "") +
                        (storage == Storage::kRecompute && !st.can_recompute ? " (no producer chain in its layer)" : ""));
      }
      if (planner::IsRemote(storage) &&
          (target < 0 || target >= model_.parallel.pp || target == static_cast<int32_t>(r))) {
        return BadInput(file + ": /tensors: " + st.name + ": to_pp_rank " + std::to_string(target) +
                        " is not another pipeline rank (0.." + std::to_string(model_.parallel.pp - 1) + ")");
      }
      assign_.storage[r][t] = storage;
      assign_.target[r][t] = target;
    }
  }
  eval_ = planner::Evaluate(p_, assign_, false);
  profiles_ = planner::Profiles(p_, eval_.intervals);
  return Check();
}

Expected<std::monostate> Executor::Check() {
  const Json& ranks = plan_json_["ranks"];
  if (ranks.size() != eval_.ranks.size()) {
    return BadInput(options_.plan_file + ": /ranks has " + std::to_string(ranks.size()) + " entries, the model " +
                    std::to_string(eval_.ranks.size()) + " pipeline ranks");
  }
  for (size_t r = 0; r < ranks.size(); ++r) {
    const Json& rk = ranks[r];
    if (!rk.is_object() || !rk.contains("peak") || !rk["peak"].is_number_integer() || !rk.contains("lower_bound") ||
        !rk["lower_bound"].is_number_integer()) {
      return BadInput(options_.plan_file + ": /ranks/" + std::to_string(r) + ": expected integer peak and lower_bound");
    }
    int64_t peak = rk["peak"].get<int64_t>(), lb = rk["lower_bound"].get<int64_t>();
    if (peak != eval_.ranks[r].peak || lb != eval_.ranks[r].lower_bound) {
      return BadInput(options_.plan_file + ": /ranks/" + std::to_string(r) + ": peak " + std::to_string(peak) +
                      " / lower_bound " + std::to_string(lb) + " differ from this planner's " +
                      std::to_string(eval_.ranks[r].peak) + " / " + std::to_string(eval_.ranks[r].lower_bound) +
                      " (re-plan the model with this memplan)");
    }
  }
  // Layer -> rank-local saved index.
  tensor_base_.assign(p_.layers.size(), {});
  saved_index_.assign(p_.layers.size(), {});
  for (size_t l = 0; l < p_.layers.size(); ++l) {
    saved_index_[l].assign(p_.layers[l].tensors.size(), -1);
    int32_t k = 0;
    for (size_t t = 0; t < p_.layers[l].tensors.size(); ++t) {
      if (p_.layers[l].tensors[t].saved) saved_index_[l][t] = k++;
    }
  }
  for (size_t r = 0; r < p_.tensors.size(); ++r) {
    for (size_t t = 0; t < p_.tensors[r].size(); ++t) {
      const SavedTensor& st = p_.tensors[r][t];
      auto& base = tensor_base_[static_cast<size_t>(st.layer)];
      if (base.empty()) base.push_back(static_cast<int32_t>(t));
    }
  }
  // One tensor crosses each pipeline-stage boundary each way (the mailbox
  // carries one per stage, microbatch and direction).
  for (size_t l = 0; l < p_.layers.size(); ++l) {
    const LayerBuffers& lb = LB(static_cast<int64_t>(l));
    auto count = [](const std::vector<int32_t>& v) { return std::count_if(v.begin(), v.end(), [](int32_t x) { return x >= 0; }); };
    if (count(lb.export_to) > 1 || count(lb.import_from) > 1) {
      return BadInput(options_.plan_file + ": layer " + std::to_string(l) +
                      " hands more than one tensor to its neighbour layer; the runtime's stage mailbox carries one");
    }
  }
  // FP8 payloads are values then fp32 scales: the scales must be aligned.
  for (size_t r = 0; r < p_.tensors.size(); ++r) {
    for (size_t t = 0; t < p_.tensors[r].size(); ++t) {
      if (!planner::IsFp8(assign_.storage[r][t])) continue;
      const TensorSpec& spec = G(p_.tensors[r][t].layer).tensors[static_cast<size_t>(p_.tensors[r][t].graph_index)];
      if (Elements(spec.shape) % 4 != 0) {
        return BadInput(options_.plan_file + ": " + spec.name + " is stored in FP8 but its element count is not a multiple of 4 (unaligned scales)");
      }
    }
  }
  return std::monostate{};
}

int32_t Executor::SavedIndex(int64_t layer, int32_t tensor) const {
  return saved_index_[static_cast<size_t>(layer)][static_cast<size_t>(tensor)];
}

int32_t Executor::InstIndex(int64_t layer, int32_t tensor, int32_t mb) const {
  int32_t k = SavedIndex(layer, tensor);
  MEMPLAN_CHECK(k >= 0, "not a saved tensor");
  int32_t t = tensor_base_[static_cast<size_t>(layer)].front() + k;
  return t * static_cast<int32_t>(model_.train.microbatches) + mb;
}

Expected<std::monostate> Executor::MakeRanks() {
  const int32_t pp = static_cast<int32_t>(p_.tensors.size());
  for (int32_t r = 0; r < pp; ++r) {
    auto rank = std::make_unique<Rank>();
    rank->index = r;
    const auto& rb = eval_.ranks[static_cast<size_t>(r)];
    int64_t act = rb.peak - p_.statics[static_cast<size_t>(r)].total;
    std::string name = "pp" + std::to_string(r);
    // Arenas (host, and cuda by default) hold exactly the plan's bytes: an
    // allocation the plan did not predict fails the run instead of hiding
    // in slack. A CUDA pool reserves in granules beyond its used bytes,
    // hence its headroom.
    const bool exact = options_.backend == BackendKind::kHost || !options_.cuda_pool;
    const int64_t statics = p_.statics[static_cast<size_t>(r)].total;
    auto dev = backend_->MakeDevice(name, exact ? std::max<int64_t>(act, 1) : 2 * act + 64 * kMiB);
    if (!dev.ok()) return dev.error();
    rank->dev = std::move(*dev);
    auto stat = backend_->MakeDevice(name + ".static", exact ? std::max<int64_t>(statics, 1) : statics + 64 * kMiB);
    if (!stat.ok()) return stat.error();
    rank->stat = std::move(*stat);
    // Host memory for host offloads: at most every payload at once.
    int64_t host_bytes = kMiB;
    for (const Interval& iv : eval_.intervals) {
      if (iv.owner_rank == r && iv.rank == r && iv.part == IntervalPart::kMovedOut) host_bytes += iv.bytes + 256;
    }
    auto host = backend_->MakeHostArena(name + ".host", host_bytes);
    if (!host.ok()) return host.error();
    rank->host = std::move(*host);
    // The kernels' static buffers first (the plan's "gemm_workspace" and
    // "kernel_scratch"), then the parameters (InitParams).
    for (auto [buf, bytes] : {std::pair{&rank->ops_memory.gemm_workspace, kernels::GemmWorkspaceBytes()},
                              std::pair{&rank->ops_memory.scratch, kernels::KernelScratchBytes()}}) {
      auto b = rank->stat->Allocate(bytes);
      if (!b.ok()) return b.error();
      *buf = *b;
      rank->static_bytes += bytes;
    }
    rank->ops = backend_->MakeOps(*rank->dev, rank->ops_memory);
    rank->produced_at.resize(static_cast<size_t>(p_.timelines[static_cast<size_t>(r)].steps));
    for (size_t i = 0; i < p_.instances[static_cast<size_t>(r)].size(); ++i) {
      rank->produced_at[static_cast<size_t>(p_.instances[static_cast<size_t>(r)][i].prod)].push_back(
          static_cast<int32_t>(i));
    }
    ranks_.push_back(std::move(rank));
  }
  std::vector<RankMemory> mem;
  for (auto& r : ranks_) mem.push_back({r->dev.get(), r->host.get()});
  acts_ = std::make_unique<ActivationManager>(p_, assign_, eval_.intervals, std::move(mem), *backend_);
  for (auto& r : ranks_) {
    steps_total_ += p_.timelines[static_cast<size_t>(r->index)].steps;
    InitParams(*r);
    if (r->static_bytes != p_.statics[static_cast<size_t>(r->index)].total) {
      return Error{ErrorCode::kRuntime, "pp rank " + std::to_string(r->index) + ": static memory is " +
                                            std::to_string(r->static_bytes) + " bytes, the plan's " +
                                            std::to_string(p_.statics[static_cast<size_t>(r->index)].total)};
    }
  }
  return std::monostate{};
}

void Executor::InitParams(Rank& r) {
  std::vector<int64_t> layers = p_.layout.LayersOfRank(r.index);
  for (int64_t l : layers) {
    for (const auto& spec : G(l).params) {
      int64_t n = planner::LocalParamElements(model_, spec);
      if (n == 0) continue;
      ParamState ps;
      ps.spec = &spec;
      ps.elements = n;
      ps.shape = spec.shape;
      ps.tied_head = spec.kind == planner::ParamKind::kHead && model_.arch.tied_embeddings;
      if (ps.tied_head) ps.shape = {spec.shape[1], spec.shape[0]};
      auto alloc = [&](int64_t bytes) {
        auto b = r.stat->Allocate(bytes);
        if (!b.ok()) ThrowError(b.error().code, b.error().message);
        r.static_bytes += bytes;
        return *b;
      };
      int64_t bytes = n * 4;
      ps.weight = alloc(bytes);
      ps.grad = alloc(n * planner::DTypeBytes(model_.train.grad_dtype));
      int64_t opt = planner::OptimizerBytesPerParam(model_, spec);
      MEMPLAN_CHECK(opt == 8, "Adam over fp32 parameters keeps m and v");
      ps.m = alloc(bytes);
      ps.v = alloc(bytes);
      // Initial values (docs/runtime.md): norms gamma 1, beta 0; every
      // matrix U(-a, a) with a = 1/sqrt(fan_in), fan_in its input width
      // (the embedding and a tied head: hidden).
      std::vector<float> w(static_cast<size_t>(n), 0.f);
      const std::string& name = spec.name;
      bool is_bias = name.size() >= 5 && name.compare(name.size() - 5, 5, ".bias") == 0;
      if (spec.kind == planner::ParamKind::kNorm) {
        std::fill(w.begin(), w.end(), is_bias ? 0.f : 1.f);
      } else {
        int64_t fan_in = spec.shape.size() >= 3 ? spec.shape[1] : spec.shape[0];
        if (spec.kind == planner::ParamKind::kEmbedding || ps.tied_head) fan_in = model_.arch.hidden;
        float a = 1.f / std::sqrt(static_cast<float>(fan_in));
        // A tied head starts as the embedding it shares.
        uint64_t id = Fnv1a(ps.tied_head ? G(0).params.front().name : name);
        // Counter-based: any split over threads gives the same values.
        auto fill = [&](int64_t lo, int64_t hi) {
          for (int64_t i = lo; i < hi; ++i) {
            w[static_cast<size_t>(i)] = (2.f * kernels::Uniform01(options_.seed, id, static_cast<uint64_t>(i)) - 1.f) * a;
          }
        };
        int64_t threads = n < (int64_t{1} << 20) ? 1 : std::max<int64_t>(1, std::thread::hardware_concurrency());
        std::vector<std::thread> pool;
        for (int64_t t = 1; t < threads; ++t) pool.emplace_back(fill, n * t / threads, n * (t + 1) / threads);
        fill(0, n / threads);
        for (auto& th : pool) th.join();
      }
      if (options_.init_hook) options_.init_hook(ps.tied_head ? G(0).params.front().name : name, &w);
      backend_->FromHost(*r.stat, ps.weight.ptr, w.data(), bytes);
      std::vector<float> zero(static_cast<size_t>(n), 0.f);
      backend_->FromHost(*r.stat, ps.grad.ptr, zero.data(), bytes);
      backend_->FromHost(*r.stat, ps.m.ptr, zero.data(), bytes);
      backend_->FromHost(*r.stat, ps.v.ptr, zero.data(), bytes);
      r.param_index[name] = r.params.size();
      r.params.push_back(std::move(ps));
    }
  }
}

Buffer Executor::Value(Rank& r, size_t bi, int32_t t) {
  const Block& blk = p_.timelines[static_cast<size_t>(r.index)].blocks[bi];
  const LayerGraph& g = G(blk.layer);
  const LayerBuffers& lb = LB(blk.layer);
  const TensorSpec& spec = g.tensors[static_cast<size_t>(t)];
  if (!blk.forward) {
    if (spec.saved) return BwdFull(r, blk.layer, t, blk.microbatch);
    return BlockBuf(r, bi, BlockBuffer::Role::kRebuilt, t);
  }
  if (spec.saved) return FwdFull(r, blk.layer, t, blk.microbatch);
  if (lb.prod[static_cast<size_t>(t)] >= 0) {
    int32_t exp = lb.export_to[static_cast<size_t>(t)];
    if (exp >= 0 && blk.next_in_pass && G(blk.layer + 1).tensors[static_cast<size_t>(exp)].saved) {
      return FwdFull(r, blk.layer + 1, exp, blk.microbatch);
    }
    return BlockBuf(r, bi, BlockBuffer::Role::kValue, t);
  }
  int32_t src = lb.import_from[static_cast<size_t>(t)];
  if (src >= 0 && blk.prev_in_pass) {
    if (G(blk.layer - 1).tensors[static_cast<size_t>(src)].saved) {
      return FwdFull(r, blk.layer - 1, src, blk.microbatch);
    }
    return BlockBuf(r, bi - 1, BlockBuffer::Role::kValue, src);
  }
  return BlockBuf(r, bi, BlockBuffer::Role::kValue, t);
}

Buffer Executor::Grad(Rank& r, size_t bi, int32_t t) {
  const Block& blk = p_.timelines[static_cast<size_t>(r.index)].blocks[bi];
  const LayerBuffers& lb = LB(blk.layer);
  if (lb.prod[static_cast<size_t>(t)] >= 0 && lb.export_to[static_cast<size_t>(t)] >= 0 && blk.prev_in_pass) {
    return BlockBuf(r, bi - 1, BlockBuffer::Role::kGrad, lb.export_to[static_cast<size_t>(t)]);
  }
  return BlockBuf(r, bi, BlockBuffer::Role::kGrad, t);
}

const ParamState& Executor::Param(Rank& r, const OpSpec& op, std::string_view suffix) {
  // Parameters follow the op's name: "layer1.attn.qkv" -> "layer1.attn.qkv.weight";
  // a norm "layer1.attn_norm.norm" -> "layer1.attn_norm.weight"; the
  // embedding and head take their module's; "moe.experts_fc1" ->
  // "moe.experts.fc1.weight".
  std::string prefix = op.name.substr(0, op.name.rfind('.'));
  std::string last = op.name.substr(op.name.rfind('.') + 1);
  std::string dotted = last;
  if (auto u = dotted.find('_'); u != std::string::npos) dotted[u] = '.';
  std::string s(suffix);
  for (const std::string& cand : {op.name + "." + s, prefix + "." + s, prefix + "." + dotted + "." + s}) {
    auto it = r.param_index.find(cand);
    if (it != r.param_index.end()) return r.params[it->second];
  }
  // A tied head on one rank reads the embedding.
  if (op.kind == "linear" && model_.arch.tied_embeddings) {
    auto it = r.param_index.find(G(0).params.front().name);
    if (it != r.param_index.end()) return r.params[it->second];
  }
  MEMPLAN_CHECK(false, ("no parameter for op " + op.name).c_str());
  return r.params.front();
}

std::pair<const ParamState*, const ParamState*> Executor::AttnResParams(Rank& r, const OpSpec& op) {
  // "layer3.attn_res.mix" reads layer3.attn_res.{query,norm.weight};
  // "layer3.head.final_mix" reads layer3.head.attn_res.{query,norm.weight}.
  std::string prefix = op.name.substr(0, op.name.rfind('.'));
  if (!prefix.ends_with(".attn_res")) prefix += ".attn_res";
  auto q = r.param_index.find(prefix + ".query");
  auto g = r.param_index.find(prefix + ".norm.weight");
  MEMPLAN_CHECK(q != r.param_index.end() && g != r.param_index.end(), ("no AttnRes parameters for " + op.name).c_str());
  return {&r.params[q->second], &r.params[g->second]};
}

// --- Ops --------------------------------------------------------------------------------

struct Dims2 {
  int64_t rows = 1, cols = 1;
};
Dims2 RowsCols(const TensorSpec& t) {
  Dims2 d;
  d.cols = t.shape.empty() ? 1 : t.shape.back();
  d.rows = d.cols == 0 ? 0 : Elements(t.shape) / d.cols;
  return d;
}

void Executor::Forward(Rank& r, size_t bi, int32_t pos, const std::function<Buffer(int32_t)>& value, int32_t mb) {
  const Block& blk = p_.timelines[static_cast<size_t>(r.index)].blocks[bi];
  const LayerGraph& g = G(blk.layer);
  const OpSpec& op = g.ops[g.TopologicalOrder()[static_cast<size_t>(pos)]];
  kernels::Ops& k = *r.ops;
  auto idx = [&](const std::string& name) {
    const TensorSpec* t = g.FindTensor(name);
    return static_cast<int32_t>(t - g.tensors.data());
  };
  auto in = [&](size_t i) { return value(idx(op.inputs[i])); };
  auto out = [&](size_t i) { return value(idx(op.outputs[i])); };
  auto spec = [&](const std::string& name) -> const TensorSpec& { return *g.FindTensor(name); };
  const auto& a = model_.arch;
  const std::string& kind = op.kind;
  if (kind == "embedding") {
    const ParamState& w = Param(r, op);
    k.EmbeddingFwd(in(0).as<int32_t>(), w.weight.as<float>(), Elements(spec(op.inputs[0]).shape), a.hidden,
                   out(0).as<float>());
  } else if (kind == "dropout") {
    const TensorSpec& x = spec(op.inputs[0]);
    uint64_t offset = Fnv1a(op.outputs[1]) ^ (static_cast<uint64_t>(mb) << 48);
    k.DropoutFwd(in(0).as<float>(), Elements(x.shape), kDropoutP, options_.seed, offset, out(0).as<float>(),
                 out(1).as<uint8_t>());
  } else if (kind == "identity" || kind == "copy") {
    k.Copy(out(0).ptr, in(0).ptr, spec(op.outputs[0]).bytes);
  } else if (kind == "layernorm" || kind == "rmsnorm") {
    Dims2 d = RowsCols(spec(op.inputs[0]));
    const ParamState& gamma = Param(r, op);
    if (kind == "layernorm") {
      const ParamState& beta = Param(r, op, "bias");
      k.LayerNormFwd(in(0).as<float>(), gamma.weight.as<float>(), beta.weight.as<float>(), d.rows, d.cols,
                     kLayerNormEps, out(0).as<float>());
    } else {
      k.RmsNormFwd(in(0).as<float>(), gamma.weight.as<float>(), d.rows, d.cols, kRmsNormEps, out(0).as<float>());
    }
  } else if (kind == "linear") {
    const ParamState& w = Param(r, op);
    Dims2 x = RowsCols(spec(op.inputs[0]));
    Dims2 y = RowsCols(spec(op.outputs[0]));
    // A tied head reads the embedding matrix E [vocab, hidden]: logits = x E^T.
    bool tied = w.tied_head || w.spec->kind == planner::ParamKind::kEmbedding;
    k.Gemm(false, tied, x.rows, y.cols, x.cols, 1.f, in(0).as<float>(), w.weight.as<float>(), 0.f,
           out(0).as<float>(), nullptr);
  } else if (kind == "split_rope") {
    kernels::SplitShape sh{model_.train.micro_batch, model_.train.seq_len, a.heads, a.kv_heads, a.head_dim,
                           a.norm == planner::Norm::kRmsNorm};
    k.SplitHeadsFwd(in(0).as<float>(), sh, out(0).as<float>(), out(1).as<float>(), out(2).as<float>());
  } else if (kind == "batched_gemm") {
    int64_t b = model_.train.micro_batch, s = model_.train.seq_len, hq = a.heads, hkv = a.kv_heads,
            dh = a.head_dim, grp = hq / hkv;
    if (op.name.ends_with(".scores")) {
      float scale = 1.f / std::sqrt(static_cast<float>(dh));
      k.GemmStridedBatched(false, true, grp * s, s, dh, scale, in(0).as<float>(), dh, grp * s * dh,
                           in(1).as<float>(), dh, s * dh, 0.f, out(0).as<float>(), s, grp * s * s, b * hkv, nullptr);
    } else {  // pv: probs [b, hq, s, s] x v [b, hkv, s, dh] -> [b*s, hq*dh]
      for (int64_t bb = 0; bb < b; ++bb) {
        for (int64_t gq = 0; gq < hkv; ++gq) {
          const float* pr = in(0).as<float>() + (bb * hq + gq * grp) * s * s;
          const float* v = in(1).as<float>() + (bb * hkv + gq) * s * dh;
          float* o = out(0).as<float>() + bb * s * hq * dh + gq * grp * dh;
          k.GemmStridedBatched(false, false, s, dh, s, 1.f, pr, s, s * s, v, dh, 0, 0.f, o, hq * dh, dh, grp, nullptr);
        }
      }
    }
  } else if (kind == "softmax") {
    const TensorSpec& x = spec(op.inputs[0]);
    Dims2 d = RowsCols(x);
    bool attention = x.shape.size() == 4;
    k.SoftmaxFwd(in(0).as<float>(), d.rows, d.cols, 1.f, attention ? model_.train.seq_len : 0, out(0).as<float>());
  } else if (kind == "sigmoid") {
    k.SigmoidFwd(in(0).as<float>(), Elements(spec(op.inputs[0]).shape), out(0).as<float>());
  } else if (kind == "add") {
    k.Add(in(0).as<float>(), in(1).as<float>(), Elements(spec(op.outputs[0]).shape), out(0).as<float>());
  } else if (kind == "gelu") {
    k.GeluFwd(in(0).as<float>(), Elements(spec(op.inputs[0]).shape), out(0).as<float>());
  } else if (kind == "swiglu") {
    Dims2 y = RowsCols(spec(op.outputs[0]));
    k.SwigluFwd(in(0).as<float>(), y.rows, y.cols, out(0).as<float>());
  } else if (kind == "cross_entropy") {
    Dims2 d = RowsCols(spec(op.inputs[0]));
    k.CrossEntropyFwd(in(0).as<float>(), in(1).as<int32_t>(), d.rows, d.cols, out(0).as<float>(), out(1).as<float>());
    if (blk.forward) {
      std::vector<float> losses(static_cast<size_t>(d.rows));
      backend_->ToHost(*r.dev, losses.data(), out(1).ptr, d.rows * 4);
      for (float l : losses) loss_sum_ += l;
    }
  } else if (kind == "flash_attention") {
    kernels::AttentionShape sh{model_.train.micro_batch, a.heads, a.kv_heads, model_.train.seq_len, a.head_dim,
                               a.head_dim, 1.f / std::sqrt(static_cast<float>(a.head_dim)), true};
    sh.o_token_major = true;
    k.FlashAttentionFwd(sh, in(0).as<float>(), in(1).as<float>(), in(2).as<float>(), out(0).as<float>(),
                        out(1).as<float>());
  } else if (kind == "topk") {
    Dims2 d = RowsCols(spec(op.inputs[0]));
    k.TopKFwd(in(0).as<float>(), d.rows, d.cols, a.moe->top_k, kRouterRenormalize, out(0).as<int32_t>(),
              out(1).as<float>());
  } else if (kind == "dispatch") {
    const TensorSpec& x = spec(op.inputs[0]);
    Dims2 d = RowsCols(x);
    int64_t topk = a.moe->top_k;
    auto& offsets = r.routing[{blk.layer, mb}];
    offsets.assign(static_cast<size_t>(a.moe->experts + 1), 0);
    k.DispatchPlan(in(1).as<int32_t>(), d.rows, topk, a.moe->experts, out(1).as<int32_t>(), offsets.data());
    Buffer xs = out(0);
    k.DispatchFwd(in(0).as<float>(), out(1).as<int32_t>(), d.rows, topk, d.cols, xs.as<float>());
    int64_t used = d.rows * topk * d.cols * 4;
    if (spec(op.outputs[0]).bytes > used) k.Zero(xs.ptr + used, spec(op.outputs[0]).bytes - used);
  } else if (kind == "grouped_gemm") {
    const ParamState& w = Param(r, op);
    const auto& offsets = r.routing.at({blk.layer, mb});
    int64_t kin = w.shape[1], nout = w.shape[2];
    k.GroupedGemm(offsets.data(), a.moe->experts, kin, nout, in(0).as<float>(), w.weight.as<float>(),
                  out(0).as<float>(), nullptr);
  } else if (kind == "attn_res") {
    // Block AttnRes over sources [n, T, h]: h = sum_i softmax_i(w . RMSNorm(v_i)) v_i.
    Dims2 x = RowsCols(spec(op.outputs[0]));
    int64_t n = Elements(spec(op.inputs[0]).shape) / (x.rows * x.cols);
    auto [w, gamma] = AttnResParams(r, op);
    k.AttnResFwd(in(0).as<float>(), w->weight.as<float>(), gamma->weight.as<float>(), n, x.rows, x.cols, kRmsNormEps,
                 out(0).as<float>(), out(1).as<float>());
  } else if (kind == "attn_res_accumulate") {
    // next = [this layer's blocks, except a running partial block] + [partial + out].
    const TensorSpec& src = spec(op.inputs[0]);
    const TensorSpec& o = spec(op.inputs[1]);
    int64_t keep = src.bytes - (AttnResHasPartial(blk.layer) ? o.bytes : 0);
    Buffer next = out(0);
    k.Copy(next.ptr, in(0).ptr, keep);
    if (AttnResHasPartial(blk.layer)) {
      k.Add(reinterpret_cast<const float*>(in(0).ptr + keep), in(1).as<float>(), Elements(o.shape),
            reinterpret_cast<float*>(next.ptr + keep));
    } else {
      k.Copy(next.ptr + keep, in(1).ptr, o.bytes);
    }
  } else if (kind == "combine") {
    Dims2 o = RowsCols(spec(op.outputs[0]));
    k.CombineFwd(in(0).as<float>(), in(2).as<int32_t>(), in(1).as<float>(), o.rows, a.moe->top_k, o.cols,
                 out(0).as<float>());
  } else {
    MEMPLAN_CHECK(false, ("op kind " + kind + " is not executable").c_str());
  }
}

void Executor::Backward(Rank& r, size_t bi, int32_t pos) {
  const Block& blk = p_.timelines[static_cast<size_t>(r.index)].blocks[bi];
  const LayerGraph& g = G(blk.layer);
  const LayerBuffers& lb = LB(blk.layer);
  const OpSpec& op = g.ops[g.TopologicalOrder()[static_cast<size_t>(pos)]];
  kernels::Ops& k = *r.ops;
  auto idx = [&](const std::string& name) {
    return static_cast<int32_t>(g.FindTensor(name) - g.tensors.data());
  };
  auto spec = [&](const std::string& name) -> const TensorSpec& { return *g.FindTensor(name); };
  auto val = [&](const std::string& name) { return Value(r, bi, idx(name)); };
  auto dout = [&](size_t i) { return Grad(r, bi, idx(op.outputs[i])); };
  // An input gradient: written directly by the first backward that reaches
  // it, else into a temporary (summed by Finish).
  auto first_writer = [&](int32_t t) {
    return lb.last_use[static_cast<size_t>(t)] == pos && lb.export_to[static_cast<size_t>(t)] < 0;
  };
  auto din = [&](size_t i) {
    int32_t t = idx(op.inputs[i]);
    if (first_writer(t) || planner::GradAccumulates(op.kind)) return Grad(r, bi, t);
    return BlockBuf(r, bi, BlockBuffer::Role::kGradTemp, t, pos);
  };
  auto finish = [&](size_t i) {
    int32_t t = idx(op.inputs[i]);
    if (first_writer(t)) return;
    Buffer temp = BlockBuf(r, bi, BlockBuffer::Role::kGradTemp, t, pos);
    k.Accumulate(Grad(r, bi, t).as<float>(), temp.as<float>(), Elements(spec(op.inputs[i]).shape));
  };
  // Add-like ops: copy into a fresh gradient, add into a started one.
  auto pass_through = [&](size_t i, const Buffer& dy) {
    int32_t t = idx(op.inputs[i]);
    Buffer dx = Grad(r, bi, t);
    int64_t n = Elements(spec(op.inputs[i]).shape);
    if (first_writer(t)) {
      k.Copy(dx.ptr, dy.ptr, n * 4);
    } else {
      k.Accumulate(dx.as<float>(), dy.as<float>(), n);
    }
  };
  const auto& a = model_.arch;
  const std::string& kind = op.kind;
  if (kind == "embedding") {
    const ParamState& w = Param(r, op);
    k.EmbeddingBwd(val(op.inputs[0]).as<int32_t>(), dout(0).as<float>(), Elements(spec(op.inputs[0]).shape), a.hidden,
                   w.grad.as<float>());
  } else if (kind == "dropout") {
    const TensorSpec& x = spec(op.inputs[0]);
    k.DropoutBwd(dout(0).as<float>(), val(op.outputs[1]).as<uint8_t>(), Elements(x.shape), kDropoutP,
                 din(0).as<float>());
    finish(0);
  } else if (kind == "identity" || kind == "copy") {
    pass_through(0, dout(0));
  } else if (kind == "add") {
    Buffer dy = dout(0);
    pass_through(0, dy);
    pass_through(1, dy);
  } else if (kind == "layernorm" || kind == "rmsnorm") {
    Dims2 d = RowsCols(spec(op.inputs[0]));
    const ParamState& gamma = Param(r, op);
    if (kind == "layernorm") {
      const ParamState& beta = Param(r, op, "bias");
      k.LayerNormBwd(val(op.inputs[0]).as<float>(), gamma.weight.as<float>(), dout(0).as<float>(), d.rows, d.cols,
                     kLayerNormEps, din(0).as<float>(), gamma.grad.as<float>(), beta.grad.as<float>());
    } else {
      k.RmsNormBwd(val(op.inputs[0]).as<float>(), gamma.weight.as<float>(), dout(0).as<float>(), d.rows, d.cols,
                   kRmsNormEps, din(0).as<float>(), gamma.grad.as<float>());
    }
    finish(0);
  } else if (kind == "linear") {
    const ParamState& w = Param(r, op);
    Dims2 x = RowsCols(spec(op.inputs[0]));
    Dims2 y = RowsCols(spec(op.outputs[0]));
    Buffer dy = dout(0);
    Buffer xv = val(op.inputs[0]);
    // dx = dy W^T; dW += x^T dy (a tied head stores E = W^T: dE += dy^T x).
    bool tied = w.tied_head || w.spec->kind == planner::ParamKind::kEmbedding;
    k.Gemm(false, !tied, x.rows, x.cols, y.cols, 1.f, dy.as<float>(), w.weight.as<float>(), 0.f,
           din(0).as<float>(), nullptr);
    if (tied) {
      k.Gemm(true, false, y.cols, x.cols, x.rows, 1.f, dy.as<float>(), xv.as<float>(), 1.f, w.grad.as<float>(), nullptr);
    } else {
      k.Gemm(true, false, x.cols, y.cols, x.rows, 1.f, xv.as<float>(), dy.as<float>(), 1.f, w.grad.as<float>(), nullptr);
    }
    finish(0);
  } else if (kind == "split_rope") {
    kernels::SplitShape sh{model_.train.micro_batch, model_.train.seq_len, a.heads, a.kv_heads, a.head_dim,
                           a.norm == planner::Norm::kRmsNorm};
    k.SplitHeadsBwd(dout(0).as<float>(), dout(1).as<float>(), dout(2).as<float>(), sh, din(0).as<float>());
    finish(0);
  } else if (kind == "batched_gemm") {
    int64_t b = model_.train.micro_batch, s = model_.train.seq_len, hq = a.heads, hkv = a.kv_heads,
            dh = a.head_dim, grp = hq / hkv;
    if (op.name.ends_with(".scores")) {
      float scale = 1.f / std::sqrt(static_cast<float>(dh));
      Buffer ds = dout(0), q = val(op.inputs[0]), kk = val(op.inputs[1]);
      Buffer dq = din(0), dk = din(1);
      // dq = scale dS k; dk = scale sum over the group's heads dS^T q.
      k.GemmStridedBatched(false, false, grp * s, dh, s, scale, ds.as<float>(), s, grp * s * s, kk.as<float>(), dh,
                           s * dh, 0.f, dq.as<float>(), dh, grp * s * dh, b * hkv, nullptr);
      k.GemmStridedBatched(true, false, s, dh, grp * s, scale, ds.as<float>(), s, grp * s * s, q.as<float>(), dh,
                           grp * s * dh, 0.f, dk.as<float>(), dh, s * dh, b * hkv, nullptr);
      finish(0);
      finish(1);
    } else {
      Buffer d_o = dout(0), pr = val(op.inputs[0]), v = val(op.inputs[1]);
      Buffer dp = din(0), dv = din(1);
      for (int64_t bb = 0; bb < b; ++bb) {
        for (int64_t gq = 0; gq < hkv; ++gq) {
          const float* dob = d_o.as<float>() + bb * s * hq * dh + gq * grp * dh;
          const float* vb = v.as<float>() + (bb * hkv + gq) * s * dh;
          const float* pb = pr.as<float>() + (bb * hq + gq * grp) * s * s;
          // dP_h = dO_h V^T; dV = sum_h P_h^T dO_h.
          k.GemmStridedBatched(false, true, s, s, dh, 1.f, dob, hq * dh, dh, vb, dh, 0, 0.f,
                               dp.as<float>() + (bb * hq + gq * grp) * s * s, s, s * s, grp, nullptr);
          for (int64_t h = 0; h < grp; ++h) {
            k.GemmStridedBatched(true, false, s, dh, s, 1.f, pb + h * s * s, s, 0, dob + h * dh, hq * dh, 0,
                                 h == 0 ? 0.f : 1.f, dv.as<float>() + (bb * hkv + gq) * s * dh, dh, 0, 1, nullptr);
          }
        }
      }
      finish(0);
      finish(1);
    }
  } else if (kind == "softmax" || kind == "sigmoid") {
    const TensorSpec& y = spec(op.outputs[0]);
    if (kind == "softmax") {
      Dims2 d = RowsCols(y);
      k.SoftmaxBwd(val(op.outputs[0]).as<float>(), dout(0).as<float>(), d.rows, d.cols, 1.f, din(0).as<float>());
    } else {
      k.SigmoidBwd(val(op.outputs[0]).as<float>(), dout(0).as<float>(), Elements(y.shape), din(0).as<float>());
    }
    finish(0);
  } else if (kind == "gelu") {
    k.GeluBwd(val(op.inputs[0]).as<float>(), dout(0).as<float>(), Elements(spec(op.inputs[0]).shape),
              din(0).as<float>());
    finish(0);
  } else if (kind == "swiglu") {
    Dims2 y = RowsCols(spec(op.outputs[0]));
    k.SwigluBwd(val(op.inputs[0]).as<float>(), dout(0).as<float>(), y.rows, y.cols, din(0).as<float>());
    finish(0);
  } else if (kind == "cross_entropy") {
    Dims2 d = RowsCols(spec(op.inputs[0]));
    float scale = 1.f / static_cast<float>(d.rows * model_.train.microbatches);
    k.CrossEntropyBwd(val(op.outputs[0]).as<float>(), val(op.inputs[1]).as<int32_t>(), d.rows, d.cols, scale,
                      din(0).as<float>());
    finish(0);
  } else if (kind == "flash_attention") {
    kernels::AttentionShape sh{model_.train.micro_batch, a.heads, a.kv_heads, model_.train.seq_len, a.head_dim,
                               a.head_dim, 1.f / std::sqrt(static_cast<float>(a.head_dim)), true};
    sh.o_token_major = true;
    Buffer ws = BlockBuf(r, bi, BlockBuffer::Role::kWorkspace, -1, pos);
    k.FlashAttentionBwd(sh, val(op.inputs[0]).as<float>(), val(op.inputs[1]).as<float>(), val(op.inputs[2]).as<float>(),
                        val(op.outputs[0]).as<float>(), val(op.outputs[1]).as<float>(), dout(0).as<float>(),
                        din(0).as<float>(), din(1).as<float>(), din(2).as<float>(), ws.ptr);
    finish(0);
    finish(1);
    finish(2);
  } else if (kind == "topk") {
    Dims2 d = RowsCols(spec(op.inputs[0]));
    k.TopKBwd(val(op.inputs[0]).as<float>(), val(op.outputs[0]).as<int32_t>(), val(op.outputs[1]).as<float>(),
              dout(1).as<float>(), d.rows, d.cols, a.moe->top_k, kRouterRenormalize, din(0).as<float>());
    finish(0);
  } else if (kind == "dispatch") {
    Dims2 d = RowsCols(spec(op.inputs[0]));
    k.DispatchBwd(dout(0).as<float>(), val(op.outputs[1]).as<int32_t>(), d.rows, a.moe->top_k, d.cols,
                  din(0).as<float>());
    finish(0);
  } else if (kind == "grouped_gemm") {
    const ParamState& w = Param(r, op);
    const auto& offsets = r.routing.at({blk.layer, blk.microbatch});
    k.GroupedGemmBwd(offsets.data(), a.moe->experts, w.shape[1], w.shape[2], val(op.inputs[0]).as<float>(),
                     w.weight.as<float>(), dout(0).as<float>(), din(0).as<float>(), w.grad.as<float>(), nullptr);
    finish(0);
    const TensorSpec& y = spec(op.outputs[0]);
    if (!y.saved && model_.options.moe_grad_rewrite && op.name.ends_with("experts_fc2")) {
      // SonicMoE: the router gradient from the activation, not the expert output.
      const OpSpec* comb = nullptr;
      for (const auto& o : g.ops) comb = o.kind == "combine" ? &o : comb;
      int32_t gates = idx(comb->inputs[1]);
      int32_t slot = idx(comb->inputs[2]);
      Dims2 o = RowsCols(spec(comb->outputs[0]));
      Dims2 act = RowsCols(spec(op.inputs[0]));
      // dS = <dA, A> / w: dA is the weighted rows' gradient (dW2 needs it).
      k.RouterGradRewrite(din(0).as<float>(), val(op.inputs[0]).as<float>(), Value(r, bi, slot).as<int32_t>(),
                          Value(r, bi, gates).as<float>(), o.rows, a.moe->top_k, act.cols,
                          Grad(r, bi, gates).as<float>());
    }
  } else if (kind == "attn_res") {
    Dims2 x = RowsCols(spec(op.outputs[0]));
    int64_t n = Elements(spec(op.inputs[0]).shape) / (x.rows * x.cols);
    auto [w, gamma] = AttnResParams(r, op);
    k.AttnResBwd(val(op.inputs[0]).as<float>(), w->weight.as<float>(), gamma->weight.as<float>(), dout(0).as<float>(),
                 n, x.rows, x.cols, kRmsNormEps, din(0).as<float>(), w->grad.as<float>(), gamma->grad.as<float>());
    finish(0);
  } else if (kind == "attn_res_accumulate") {
    // The blocks' gradients pass through; the partial block's reaches both
    // the earlier partial and this layer's output.
    const TensorSpec& src = spec(op.inputs[0]);
    const TensorSpec& o = spec(op.inputs[1]);
    bool partial = AttnResHasPartial(blk.layer);
    int64_t keep = src.bytes - (partial ? o.bytes : 0);
    Buffer dnext = dout(0);
    auto into = [&](size_t i, std::byte* dst_base, const std::byte* src_ptr, int64_t bytes) {
      if (first_writer(idx(op.inputs[i]))) {
        k.Copy(dst_base, src_ptr, bytes);
      } else {
        k.Accumulate(reinterpret_cast<float*>(dst_base), reinterpret_cast<const float*>(src_ptr), bytes / 4);
      }
    };
    Buffer dsrc = Grad(r, bi, idx(op.inputs[0]));
    into(0, dsrc.ptr, dnext.ptr, keep);
    if (partial) into(0, dsrc.ptr + keep, dnext.ptr + keep, o.bytes);
    into(1, Grad(r, bi, idx(op.inputs[1])).ptr, dnext.ptr + keep, o.bytes);
  } else if (kind == "combine") {
    Dims2 o = RowsCols(spec(op.outputs[0]));
    bool native = spec(op.inputs[0]).saved;
    k.CombineBwd(dout(0).as<float>(), val(op.inputs[2]).as<int32_t>(), val(op.inputs[1]).as<float>(),
                 native ? val(op.inputs[0]).as<float>() : nullptr, o.rows, a.moe->top_k, o.cols, din(0).as<float>(),
                 native ? din(1).as<float>() : nullptr);
    finish(0);
    if (native) finish(1);
  } else {
    MEMPLAN_CHECK(false, ("op kind " + kind + " is not executable").c_str());
  }
}

// Re-materializes a recomputed instance at its layer's backward: the
// producer chain runs again from saved tensors, its intermediates in the
// instance's extra buffer (planner: recompute_extra_bytes).
void Executor::Recompute(Rank& r, size_t bi, int32_t inst_index) {
  const Block& blk = p_.timelines[static_cast<size_t>(r.index)].blocks[bi];
  const LayerGraph& g = G(blk.layer);
  const LayerBuffers& lb = LB(blk.layer);
  const Instance& in = p_.instances[static_cast<size_t>(r.index)][static_cast<size_t>(inst_index)];
  const SavedTensor& st = p_.tensors[static_cast<size_t>(r.index)][static_cast<size_t>(in.tensor)];
  Buffer scratch = acts_->Scratch(r.index, inst_index);
  Buffer restored = acts_->Backward(r.index, inst_index);
  int64_t extra_used = 0;
  std::unordered_map<int32_t, Buffer> local;  // chain intermediates
  std::function<void(int32_t, Buffer)> make = [&](int32_t t, Buffer dst) {
    int32_t pos = lb.prod[static_cast<size_t>(t)];
    const OpSpec& op = g.ops[g.TopologicalOrder()[static_cast<size_t>(pos)]];
    std::vector<Buffer> ins;
    for (const auto& name : op.inputs) {
      int32_t u = static_cast<int32_t>(g.FindTensor(name) - g.tensors.data());
      if (g.tensors[static_cast<size_t>(u)].saved) continue;
      Buffer b{scratch.ptr + extra_used, -1, g.tensors[static_cast<size_t>(u)].bytes};
      extra_used += b.bytes;
      MEMPLAN_CHECK(extra_used <= scratch.bytes, "recompute chain outgrew its buffer");
      make(u, b);
      local[u] = b;
    }
    auto value = [&](int32_t u) -> Buffer {
      if (u == t) return dst;
      auto it = local.find(u);
      if (it != local.end()) return it->second;
      return BwdFull(r, blk.layer, u, blk.microbatch);
    };
    Forward(r, bi, pos, value, blk.microbatch);
  };
  make(st.graph_index, restored);
  ++r.events["recomputes"];
}

// At the first step of a layer's backward: prefetches are waited for, FP8
// payloads dequantized, recomputed instances re-made (in producer order).
void Executor::RestoreLayer(Rank& r, size_t bi) {
  const Block& blk = p_.timelines[static_cast<size_t>(r.index)].blocks[bi];
  const LayerGraph& g = G(blk.layer);
  std::vector<std::pair<int64_t, int32_t>> recompute;
  for (size_t t = 0; t < g.tensors.size(); ++t) {
    if (!g.tensors[t].saved) continue;
    int32_t i = InstIndex(blk.layer, static_cast<int32_t>(t), blk.microbatch);
    acts_->Restore(r.index, i);
    const Instance& in = p_.instances[static_cast<size_t>(r.index)][static_cast<size_t>(i)];
    if (assign_.storage[static_cast<size_t>(r.index)][static_cast<size_t>(in.tensor)] == Storage::kRecompute) {
      recompute.emplace_back(p_.tensors[static_cast<size_t>(r.index)][static_cast<size_t>(in.tensor)].prod_pos, i);
    }
  }
  std::sort(recompute.begin(), recompute.end());
  for (auto [pos, i] : recompute) Recompute(r, bi, i);
}

// A model input (tokens, targets) or a value received from the previous
// pipeline stage, written into `dst` at its block's first step.
void Executor::LoadInput(Rank& r, size_t bi, int32_t t, Buffer dst) {
  const Block& blk = p_.timelines[static_cast<size_t>(r.index)].blocks[bi];
  const TensorSpec& spec = G(blk.layer).tensors[static_cast<size_t>(t)];
  if (spec.producer.empty()) {
    const auto& src = spec.name.ends_with(".targets") ? targets_ : tokens_;
    backend_->FromHost(*r.dev, dst.ptr, src[static_cast<size_t>(blk.microbatch)].data(), spec.bytes);
    return;
  }
  int32_t chunk = p_.schedules[static_cast<size_t>(r.index)]
                      [static_cast<size_t>(p_.timelines[static_cast<size_t>(r.index)].step_pass[static_cast<size_t>(blk.first)])]
                          .chunk;
  int64_t stage = chunk * model_.parallel.pp + r.index;
  auto it = mailbox_.find({stage, blk.microbatch, true});
  MEMPLAN_CHECK(it != mailbox_.end(), "activation not received");
  MEMPLAN_CHECK(static_cast<int64_t>(it->second.size()) == spec.bytes, "received activation has the wrong size");
  backend_->FromHost(*r.dev, dst.ptr, it->second.data(), spec.bytes);
  mailbox_.erase(it);
}

bool Executor::Runnable(const Rank& r) const {
  const auto& tl = p_.timelines[static_cast<size_t>(r.index)];
  if (r.next_step >= tl.steps) return false;
  size_t bi = r.block;
  if (bi + 1 < tl.blocks.size() && tl.blocks[bi + 1].first <= r.next_step) ++bi;
  const Block& blk = tl.blocks[bi];
  if (blk.first != r.next_step || blk.prev_in_pass) return true;
  int32_t chunk = p_.schedules[static_cast<size_t>(r.index)][static_cast<size_t>(tl.step_pass[static_cast<size_t>(blk.first)])].chunk;
  int64_t stage = chunk * model_.parallel.pp + r.index;
  int64_t stages = model_.parallel.pp * model_.parallel.vp;
  if (blk.forward && stage == 0) return true;
  if (!blk.forward && stage == stages - 1) return true;
  return mailbox_.count({stage, blk.microbatch, blk.forward}) > 0;
}

void Executor::Step(Rank& r) {
  const auto& tl = p_.timelines[static_cast<size_t>(r.index)];
  const int64_t s = r.next_step;
  if (r.block + 1 < tl.blocks.size() && tl.blocks[r.block + 1].first <= s) ++r.block;
  const size_t bi = r.block;
  const Block& blk = tl.blocks[bi];
  const LayerGraph& g = G(blk.layer);
  const LayerBuffers& lb = LB(blk.layer);
  const int32_t local = static_cast<int32_t>(s - blk.first);
  const int32_t n = lb.ops;
  const int32_t pos = blk.forward ? local : n - 1 - local;
  const double t_start = NowUs();
  const OpSpec& op = g.ops[g.TopologicalOrder()[static_cast<size_t>(pos)]];
  const std::string span_name = op.name + (blk.forward ? ".fwd" : ".bwd") + "@mb" + std::to_string(blk.microbatch);
  // Every kernel and copy this step launches carries the step's id in CUPTI's
  // records (the GPU timeline names them by it).
  const bool gpu_trace = cupti_ && options_.trace;
  if (gpu_trace) gpu_ops_.push_back({r.index, span_name});
  traces::ScopedGpuOp gpu_op(gpu_trace, gpu_ops_.size());
  acts_->BeginStep(r.index);
  MEMPLAN_CHECK(acts_->step(r.index) == s, "memory program out of step");

  int32_t chunk = p_.schedules[static_cast<size_t>(r.index)][static_cast<size_t>(tl.step_pass[static_cast<size_t>(s)])].chunk;
  int64_t stage = chunk * model_.parallel.pp + r.index;
  if (local == 0) {
    if (blk.forward) {
      // Inputs: the batch, or the previous stage's activation.
      for (size_t t = 0; t < g.tensors.size(); ++t) {
        const TensorSpec& spec = g.tensors[t];
        if (lb.prod[t] >= 0) continue;
        bool received = lb.import_from[t] >= 0 ? !blk.prev_in_pass : !spec.producer.empty();
        if (spec.producer.empty() || received) {
          LoadInput(r, bi, static_cast<int32_t>(t), Value(r, bi, static_cast<int32_t>(t)));
        } else if (spec.saved && lb.import_from[t] >= 0 &&
                   G(blk.layer - 1).tensors[static_cast<size_t>(lb.import_from[t])].saved) {
          // Both layers save the value: this layer keeps its own copy.
          Buffer src = FwdFull(r, blk.layer - 1, lb.import_from[t], blk.microbatch);
          r.ops->Copy(Value(r, bi, static_cast<int32_t>(t)).ptr, src.ptr, spec.bytes);
        }
      }
    } else {
      RestoreLayer(r, bi);
      if (!blk.prev_in_pass) {
        // The gradient of this chunk's output, from the next stage.
        for (size_t t = 0; t < g.tensors.size(); ++t) {
          if (lb.prod[t] < 0 || lb.export_to[t] < 0) continue;
          auto it = mailbox_.find({stage, blk.microbatch, false});
          MEMPLAN_CHECK(it != mailbox_.end(), "gradient not received");
          backend_->FromHost(*r.dev, Grad(r, bi, static_cast<int32_t>(t)).ptr, it->second.data(),
                             g.tensors[t].bytes);
          mailbox_.erase(it);
        }
      }
    }
  }
  if (blk.forward) {
    Forward(r, bi, pos, [&](int32_t t) { return Value(r, bi, t); }, blk.microbatch);
  } else {
    // Values a backward op needs that are not saved are re-made first.
    // (Value() finds rebuilt buffers; an op with several rebuilt outputs runs once.)
    // Producers re-run in topological order (a rebuilt value may feed another).
    std::set<int32_t> rerun;
    for (const auto& b : acts_->allocations(r.index)) {
      if (b.interval >= 0 || b.block != static_cast<int32_t>(bi)) continue;
      const BlockBuffer& bb = lb.backward[static_cast<size_t>(b.buffer)];
      if (bb.role == BlockBuffer::Role::kRebuilt) rerun.insert(bb.op);
    }
    for (int32_t op_pos : rerun) {
      Forward(r, bi, op_pos, [&](int32_t t) { return Value(r, bi, t); }, blk.microbatch);
      ++r.events["rebuilds"];
    }
    Backward(r, bi, pos);
  }
  if (blk.forward) {
    for (int32_t i : r.produced_at[static_cast<size_t>(s)]) acts_->Save(r.index, i);
  }
  // The end of a pass on this rank: hand the boundary tensor to the neighbour stage.
  if (local == n - 1 && !blk.next_in_pass) {
    int64_t stages = model_.parallel.pp * model_.parallel.vp;
    for (size_t t = 0; t < g.tensors.size(); ++t) {
      bool send = blk.forward ? (lb.prod[t] >= 0 && lb.export_to[t] >= 0 && stage + 1 < stages)
                              : (lb.prod[t] < 0 && lb.import_from[t] >= 0 && stage > 0);
      if (!send) continue;
      Buffer src = blk.forward ? Value(r, bi, static_cast<int32_t>(t)) : Grad(r, bi, static_cast<int32_t>(t));
      std::vector<std::byte> msg(static_cast<size_t>(g.tensors[t].bytes));
      backend_->ToHost(*r.dev, msg.data(), src.ptr, g.tensors[t].bytes);
      mailbox_[{blk.forward ? stage + 1 : stage - 1, blk.microbatch, blk.forward}] = std::move(msg);
    }
  }
  // Routing offsets live on the host until the layer's backward is over.
  if (!blk.forward && local == n - 1) r.routing.erase({blk.layer, blk.microbatch});
  acts_->EndStep(r.index);
  TakeCopies(r);
  Span(r, span_name, "kernel", t_start);
  RetireCopies(r, false);
  double now = NowUs();
  r.timeline.push_back({now, r.static_bytes + r.dev->allocated_bytes()});
  if (options_.trace) {
    traces::MemoryCounter c;
    c.pp_rank = r.index;
    c.ts_us = now;
    c.allocated_bytes = r.static_bytes + r.dev->allocated_bytes();
    c.reserved_bytes = r.static_bytes + r.dev->high_water();
    c.predicted_bytes = p_.statics[static_cast<size_t>(r.index)].total + profiles_[static_cast<size_t>(r.index)][static_cast<size_t>(s)];
    trace_.AddCounter(c);
  }
  ++r.next_step;
  ++steps_done_;
}

void Executor::RetireCopies(Rank& r, bool all) {
  auto& cs = r.copies;
  size_t k = 0;
  for (; k < cs.size(); ++k) {
    if (!all && !cs[k].event.done()) break;
    if (all) cs[k].event.Wait();
    double& q = r.queue_end_us[static_cast<int>(cs[k].stream)];
    traces::TraceSpan s;
    s.pp_rank = r.index;
    s.stream = cs[k].stream;
    s.name = cs[k].name;
    s.cat = "memcpy";
    s.ts_us = std::max(cs[k].issue_us, q);
    s.dur_us = std::max(0.0, NowUs() - s.ts_us);
    q = s.ts_us + s.dur_us;
    trace_.AddSpan(std::move(s));
  }
  cs.erase(cs.begin(), cs.begin() + static_cast<std::ptrdiff_t>(k));
}

void Executor::SyncTied() {
  // A tied head on another rank holds a copy of the embedding: the two
  // gradients are summed into both (Megatron's embedding all-reduce).
  ParamState* emb = nullptr;
  ParamState* head = nullptr;
  for (auto& r : ranks_) {
    for (auto& ps : r->params) {
      if (ps.spec->kind == planner::ParamKind::kEmbedding) emb = &ps;
      if (ps.tied_head) head = &ps;
    }
  }
  Rank* head_rank = nullptr;
  for (auto& r : ranks_) {
    for (auto& ps : r->params) head_rank = &ps == head ? r.get() : head_rank;
  }
  if (emb && head) {
    Rank& r0 = *ranks_.front();
    std::vector<float> a(static_cast<size_t>(emb->elements)), b(a.size());
    backend_->ToHost(*r0.stat, a.data(), emb->grad.ptr, emb->elements * 4);
    backend_->ToHost(*head_rank->stat, b.data(), head->grad.ptr, head->elements * 4);
    for (size_t i = 0; i < a.size(); ++i) a[i] += b[i];
    backend_->FromHost(*r0.stat, emb->grad.ptr, a.data(), emb->elements * 4);
    backend_->FromHost(*head_rank->stat, head->grad.ptr, a.data(), head->elements * 4);
  }
}

void Executor::Optimize(double* grad_norm) {
  double sum = 0;
  for (auto& r : ranks_) {
    // The norm's result lands in the kernel scratch's last granule
    // (common/workspace.h), in the plan like the rest of it.
    const Buffer& scratch = r->ops_memory.scratch;
    std::byte* result = scratch.ptr + (scratch.bytes - workspace::kScratchResultBytes);
    for (auto& ps : r->params) {
      if (ps.tied_head && r.get() != ranks_.front().get()) continue;  // counted once, with the embedding
      r->ops->SquaredNorm(ps.grad.as<float>(), ps.elements, reinterpret_cast<double*>(result));
      double v = 0;
      backend_->ToHost(*r->dev, &v, result, 8);  // in order with the ops' stream
      sum += v;
    }
  }
  *grad_norm = std::sqrt(sum);
  kernels::AdamConfig cfg;
  for (auto& r : ranks_) {
    for (auto& ps : r->params) {
      r->ops->AdamStep(ps.weight.as<float>(), ps.grad.as<float>(), ps.m.as<float>(), ps.v.as<float>(), ps.elements,
                       cfg, 1);
    }
    backend_->Finish(*r->dev);
  }
}

void Executor::MakeBatch() {
  // Tokens U{0..vocab-1} per (microbatch, position); targets are the next
  // token of each sequence (the last position wraps to the first).
  const int64_t mbs = model_.train.microbatches, b = model_.train.micro_batch, sl = model_.train.seq_len;
  const int64_t n = b * sl;
  for (int64_t m = 0; m < mbs; ++m) {
    std::vector<int32_t> tok(static_cast<size_t>(n)), tgt(tok.size());
    for (int64_t i = 0; i < n; ++i) {
      float u = kernels::Uniform01(options_.seed, Fnv1a("tokens") + static_cast<uint64_t>(m), static_cast<uint64_t>(i));
      tok[static_cast<size_t>(i)] = std::min<int32_t>(static_cast<int32_t>(model_.arch.vocab - 1),
                                                      static_cast<int32_t>(u * static_cast<float>(model_.arch.vocab)));
    }
    for (int64_t bb = 0; bb < b; ++bb) {
      for (int64_t i = 0; i < sl; ++i) {
        tgt[static_cast<size_t>(bb * sl + i)] = tok[static_cast<size_t>(bb * sl + (i + 1) % sl)];
      }
    }
    tokens_.push_back(std::move(tok));
    targets_.push_back(std::move(tgt));
  }
}

Expected<std::monostate> Executor::Dump(bool grads) {
  namespace fs = std::filesystem;
  fs::path dir(options_.dump_dir);
  std::error_code ec;
  fs::create_directories(dir / (grads ? "grads" : "weights"), ec);
  if (ec) return Error{ErrorCode::kRuntime, options_.dump_dir + ": " + ec.message()};
  for (auto& r : ranks_) {
    for (auto& ps : r->params) {
      std::vector<float> v(static_cast<size_t>(ps.elements));
      backend_->ToHost(*r->stat, v.data(), (grads ? ps.grad : ps.weight).ptr, ps.elements * 4);
      auto st = WriteNpy((dir / (grads ? "grads" : "weights") / (ps.spec->name + ".npy")).string(), v.data(), ps.shape);
      if (!st.ok()) return st.error();
    }
  }
  if (!grads) {
    fs::create_directories(dir / "batch", ec);
    if (ec) return Error{ErrorCode::kRuntime, options_.dump_dir + ": " + ec.message()};
    std::vector<int64_t> shape{model_.train.micro_batch, model_.train.seq_len};
    for (size_t m = 0; m < tokens_.size(); ++m) {
      auto a = WriteNpy((dir / "batch" / ("tokens_mb" + std::to_string(m) + ".npy")).string(), tokens_[m].data(), shape);
      if (!a.ok()) return a.error();
      auto b = WriteNpy((dir / "batch" / ("targets_mb" + std::to_string(m) + ".npy")).string(), targets_[m].data(), shape);
      if (!b.ok()) return b.error();
    }
  }
  return std::monostate{};
}

Expected<RunResult> Executor::Finish(double grad_norm, double step_s) {
  RunResult out;
  traces::Measured& m = out.measured;
  m.backend = std::string(BackendName(options_.backend));
  // Arenas follow the planner's placement; a pool is the driver's.
  m.allocator = options_.backend == BackendKind::kCuda && options_.cuda_pool ? "pool" : "arena";
  m.device = backend_->device_name();
  m.plan_digest = plan_json_.value("digest", std::string());
  m.step_s = step_s;
  m.loss = loss_sum_ / static_cast<double>(model_.train.microbatches * model_.train.micro_batch * model_.train.seq_len);
  m.grad_norm = grad_norm;
  for (auto& r : ranks_) {
    traces::MeasuredRank mr;
    mr.pp_rank = r->index;
    mr.static_bytes = r->static_bytes;
    mr.allocated_peak = r->static_bytes + r->dev->allocated_peak();
    mr.peak = r->static_bytes + r->dev->high_water();
    if (m.allocator == "pool") {
      // Both pools' own marks: the driver rounds the statics' pool too.
      mr.pool = traces::PoolMarks{r->stat->high_water() + r->dev->high_water(),
                                  r->stat->used_high_water() + r->dev->used_high_water()};
    }
    mr.timeline = std::move(r->timeline);
    mr.events = r->events;
    for (const auto& [k, v] : acts_->events(r->index)) mr.events[k] += v;
    m.ranks.push_back(std::move(mr));
  }
  if (cupti_) {
    CuptiMeasureInput in;
    in.context_bytes = context_bytes_;
    in.epoch_ns = cupti_epoch_ns_;
    for (auto& r : ranks_) {
      traces::OwnerRegions regions;
      regions.owner = r->index;
      r->dev->AddRegions(regions);
      r->stat->AddRegions(regions);
      in.regions.push_back(std::move(regions));
    }
    in.used_at_end = backend_->DeviceBytesInUse();
    cupti_->Flush();
    if (int64_t dropped = cupti_->dropped_records(); dropped > 0) {
      // A partial record set would fail the check for the wrong reason.
      warnings_.push_back("CUPTI dropped " + std::to_string(dropped) + " records; no CUPTI bytes reported");
    } else {
      AttachCupti(*cupti_, in, m);
      if (options_.trace) {
        traces::GpuTimelineInput gt{{}, std::move(gpu_ops_), cupti_epoch_ns_};
        for (auto& r : ranks_) {
          for (Device* d : {r->dev.get(), r->stat.get()}) {
            for (const auto& [name, stream] : backend_->Streams(*d)) {
              gt.lanes.push_back({traces::CuptiSource::StreamId(stream), r->index,
                                  (d == r->stat.get() ? "static " : "") + name});
            }
          }
        }
        traces::GpuTimelineCounts drawn = AddCuptiTrace(cupti_->DrainActivities(), gt, m, trace_);
        if (drawn.unowned > 0) {
          warnings_.push_back("TRACE.json: " + std::to_string(drawn.unowned) +
                              " GPU activities ran on streams no rank owns");
        }
      }
    }
  }
  if (options_.trace) {
    for (auto& r : ranks_) trace_.AddRank(r->index);
    out.trace = trace_.ToJson();
  }
  out.warnings = warnings_;
  return out;
}

Expected<std::monostate> Executor::Validate() {
  try {
    return Setup();
  } catch (const Json::exception& e) {
    return BadInput(options_.plan_file + ": not a memplan plan (" + e.what() + ")");
  } catch (const ErrorException& e) {
    return e.error();
  }
}

Expected<RunResult> Executor::Run() {
  if (auto s = Validate(); !s.ok()) return s.error();
  backend_ = options_.backend == BackendKind::kCuda ? MakeCudaBackend(!options_.cuda_pool)
                                                     : MakeHostBackend(options_.copy_jitter_us);
  if (!backend_) {
    return Error{ErrorCode::kRuntime, "--backend cuda: no CUDA device is visible, or this memplan was built without CUDA"};
  }
  if (options_.backend == BackendKind::kCuda && options_.cupti) {
    // Before any allocation: the context's bytes, and CUPTI sees the arenas
    // made. A profiler that cannot start is a warning, never a failed run.
    context_bytes_ = backend_->DeviceBytesInUse();
    traces::CuptiOptions co;
    co.gpu_timeline = options_.trace;
    if (auto s = traces::CuptiSource::Start(co); s.ok()) {
      cupti_ = std::move(*s);
    } else {
      warnings_.push_back(s.error().message + "; measured without CUPTI");
    }
  }
  try {
    if (auto s = MakeRanks(); !s.ok()) return s.error();
    MakeBatch();
    if (!options_.dump_dir.empty()) {
      if (auto d = Dump(false); !d.ok()) return d.error();
    }
    for (auto& r : ranks_) backend_->Finish(*r->stat);
    t0_ = std::chrono::steady_clock::now();
    if (cupti_) cupti_epoch_ns_ = traces::CuptiSource::TimestampNs();
    int64_t next_report = 0;
    while (steps_done_ < steps_total_) {
      // The runnable rank whose next step starts first in the plan's
      // pipeline timeline (ties: the earlier end, then the lower rank).
      Rank* pick = nullptr;
      double best_start = 0, best_end = 0;
      for (auto& r : ranks_) {
        if (!Runnable(*r)) continue;
        const auto& tl = p_.timelines[static_cast<size_t>(r->index)];
        double st = tl.start_s[static_cast<size_t>(r->next_step)], en = tl.end_s[static_cast<size_t>(r->next_step)];
        if (!pick || st < best_start || (st == best_start && en < best_end)) {
          pick = r.get();
          best_start = st;
          best_end = en;
        }
      }
      MEMPLAN_CHECK(pick != nullptr, "pipeline deadlock: no rank can run");
      Step(*pick);
      if (options_.progress && (steps_done_ >= next_report || steps_done_ == steps_total_)) {
        options_.progress("run: " + std::to_string(steps_done_) + "/" + std::to_string(steps_total_) + " steps (" +
                          std::to_string(100 * steps_done_ / steps_total_) + "%)");
        next_report = steps_done_ + std::max<int64_t>(1, steps_total_ / 10);
      }
    }
    for (auto& r : ranks_) {
      r->dev->Synchronize();
      backend_->Finish(*r->dev);
      RetireCopies(*r, true);
      MEMPLAN_CHECK(r->dev->allocated_bytes() == 0, "activation memory left allocated after the step");
    }
    SyncTied();
    if (!options_.dump_dir.empty()) {
      if (auto d = Dump(true); !d.ok()) return d.error();
    }
    double grad_norm = 0;
    Optimize(&grad_norm);
    double step_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
    return Finish(grad_norm, step_s);
  } catch (const ErrorException& e) {
    return e.error();
  }
}

}  // namespace

Expected<RunResult> RunPlan(const Json& plan, const RunOptions& options) {
  Executor e(plan, options);
  return e.Run();
}

Expected<std::monostate> ValidatePlan(const Json& plan, const std::string& plan_file) {
  RunOptions options;
  options.plan_file = plan_file;
  Executor e(plan, options);
  return e.Validate();
}

}  // namespace memplan::runtime
