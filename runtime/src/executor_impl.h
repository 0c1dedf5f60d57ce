// Private to runtime/: the executor's state and its parts, one file per
// responsibility (docs/runtime.md, "Code map"):
//   executor.cc       driving the pipeline: the step loop, Step, copies
//   plan_binding.cc   reading the plan: Setup, Check, tensor -> buffer binding
//   training.cc       ranks, parameters, the batch, tied embeddings, the optimizer
//   op_exec.cc        running one op (forward, backward, recompute) through
//                     the op registry (op_impls.h)
//   measurement.cc    MEASURED.json, TRACE.json and --dump
//   shared_blocks.cc  Block AttnRes with a single copy: blocks read in place,
//                     the pp cache, the blocks' gradients (cross buffers)
#pragma once

#include "memplan/runtime/executor.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <deque>
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
#include "memplan/common/json_util.h"
#include "memplan/common/schema.h"
#include "memplan/common/units.h"
#include "memplan/common/workspace.h"
#include "memplan/kernels/ops.h"
#include "memplan/planner/accounting.h"
#include "memplan/planner/bounds.h"
#include "memplan/planner/liveness.h"
#include "memplan/planner/model.h"
#include "memplan/planner/plan.h"
#include "memplan/planner/replay.h"
#include "memplan/planner/templates.h"
#include "memplan/runtime/activation.h"
#include "memplan/runtime/backend.h"
#include "memplan/runtime/comm.h"
#include "memplan/runtime/cuda_plugin.h"
#include "memplan/runtime/npy.h"
#include "memplan/traces/chrome_trace.h"
#include "memplan/traces/gpu_profiler.h"
#include "memplan/traces/gpu_timeline.h"

#include "cupti_measure.h"

namespace memplan::runtime::exec {

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
// KDA's gated output norm: the reference code's eps (Kimi Linear / FLA's
// FusedRMSNormGated, 1e-5), not the residual norms' 1e-6 (docs/runtime.md).
constexpr float kKdaGatedNormEps = 1e-5f;
constexpr float kDropoutP = 0.1f;
constexpr bool kRouterRenormalize = true;

inline uint64_t Fnv1a(std::string_view s) {
  uint64_t h = 1469598103934665603ull;
  for (char c : s) {
    h ^= static_cast<uint8_t>(c);
    h *= 1099511628211ull;
  }
  return h;
}

inline int64_t Elements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

inline Error BadInput(const std::string& msg) { return Error{ErrorCode::kBadInput, msg}; }

// Arena alignments (Backend::MakeDevice): the planner's placement granule
// for activations; 256 B for the static arena too (what cudaMalloc gives and
// vectorized kernels and cuBLAS expect of every weight, gradient and
// workspace), with the padding as headroom: the static bytes counted are the
// requested ones, the plan's exactly.
inline constexpr int64_t kActivationAlignment = 256;
inline constexpr int64_t kStaticAlignment = 256;

// --- Static state -------------------------------------------------------------

// Tags the GPU work launched while it lives with `id` (GpuProfiler::PushOp);
// nothing without a profiler.
class ProfiledOp {
 public:
  ProfiledOp(traces::GpuProfiler* profiler, uint64_t id) : profiler_(profiler) {
    if (profiler_) profiler_->PushOp(id);
  }
  ~ProfiledOp() {
    if (profiler_) profiler_->PopOp();
  }
  ProfiledOp(const ProfiledOp&) = delete;
  ProfiledOp& operator=(const ProfiledOp&) = delete;

 private:
  traces::GpuProfiler* profiler_;
};

struct ParamState {
  const planner::ParamSpec* spec = nullptr;
  std::vector<int64_t> shape;  // as stored (a tied head stores the embedding's [vocab, hidden])
  int64_t elements = 0;
  Buffer weight, grad, m, v;
  Buffer master;  // bf16 parameters: the fp32 master the optimizer updates (weight = its bf16 rounding)
  // Pipeline ZeRO-2: this replica's reduced gradient range (host with
  // grad_offload host); `grad` is then bound to the double buffer during
  // each backward pass of the parameter's chunk.
  Buffer part;
  // ZeRO-3: this replica's range of the weight (fp32: what the optimizer
  // updates; bf16: the rounding of the master's range); `weight` is bound
  // into the plan's fsdp_params buffer while the parameter's unit is
  // gathered (docs/runtime.md, "ZeRO-3"), and `grad` into fsdp_grads while
  // its unit's backward runs.
  Buffer shard;
  int64_t unit = -1;  // ZeRO-3's unit: 3 * layer + (0 embedding, 1 block, 2 head)
  // What the optimizer updates: the master, else the (fp32) weight itself.
  float* Master() const { return master.empty() ? weight.as<float>() : master.as<float>(); }
  bool tied_head = false;  // stores the embedding matrix; logits = x * E^T
  bool muon = false;       // Muon (m: momentum; no v), else AdamW (m, v)
  bool expert = false;     // a routed expert: this EP rank's experts, reduced over the expert data-parallel group
};

// How a tp_split parameter's full tensor [rows, cols] divides over the
// tensor-parallel ranks (tensor_parallel.cc): by rows, or by columns with
// each segment of the columns divided on its own.
struct TpLayout {
  int64_t rows = 1, cols = 1;
  bool by_rows = false;
  std::vector<int64_t> segments;
};

// Muon (docs/runtime.md, "Optimizer"): Moonlight's recipe. Momentum 0.95
// with Nesterov, Newton-Schulz with the quintic coefficients of Keller
// Jordan's Muon (a, b, c) = (3.4445, -4.7750, 2.0315), five iterations,
// the update scaled by 0.2 sqrt(max(rows, cols)) so that its RMS matches
// AdamW's.
inline constexpr float kMuonMomentum = 0.95f;
inline constexpr float kMuonNsA = 3.4445f, kMuonNsB = -4.7750f, kMuonNsC = 2.0315f;
inline constexpr int kMuonNsSteps = 5;
inline constexpr double kMuonNormEps = 1e-7;
inline constexpr double kMuonRmsScale = 0.2;

// One layer and microbatch's routing (op_impls.cc, experts.cc): the grouped
// GEMMs' rows per local expert, and under expert parallelism how this
// rank's routed rows were exchanged (docs/runtime.md, "Expert parallelism").
struct Routing {
  std::vector<int64_t> offsets;  // local experts + 1: each expert's first row in the grouped GEMMs' input
  // ep > 1 only.
  std::vector<int64_t> token_offsets;   // experts + 1: this rank's routed rows by (global) expert, as dispatched
  std::vector<int64_t> received, kept;  // [ep rank s * local experts + e]: rows s sent for e; those within capacity
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
  std::unique_ptr<HostArena> grad_host;  // pipeline ZeRO-2 with grad_offload host: the partitions
  int64_t grad_passes = 0;               // pipeline ZeRO-2: which half of the double buffer is next
  std::unique_ptr<kernels::Ops> ops;
  int64_t static_bytes = 0;
  OpsMemory ops_memory;  // planned static buffers: cuBLAS workspace, kernel scratch
  std::map<std::string, Buffer> static_buffers;  // every static.buffer_detail entry of the plan, by name
  std::vector<ParamState> params;
  std::unordered_map<std::string, size_t> param_index;
  std::map<std::pair<int64_t, int32_t>, Routing> routing;  // (layer, mb) -> its routing (host)
  int64_t dropped_rows = 0;  // expert parallelism: routed rows past an expert rank's capacity
  std::map<int64_t, std::vector<float>> router_bias;  // layer -> arch.moe.selection_bias's bias (host)
  // (layer, mb) -> tokens per expert its top-k chose this step (selection_bias).
  std::map<std::pair<int64_t, int32_t>, std::vector<float>> expert_load;
  bool routing_seen = false;  // MoE: the skew its forwards saw (MEASURED.json moe_routing)
  double max_expert_load = 0, max_rank_load = 0;
  std::vector<std::vector<int32_t>> produced_at;  // step -> instances produced there
  // Eager: the values each backward block has re-made so far (a rebuilt
  // value is made once per block, whatever the allocator has freed).
  std::map<size_t, std::set<int32_t>> rebuilt;
  size_t block = 0;
  int64_t next_step = 0;
  // Measurement.
  std::vector<traces::TimelinePoint> timeline;
  std::map<std::string, int64_t> events;  // the executor's own; the manager's are merged at the end
  std::vector<CopySpan> copies;
  double queue_end_us[traces::kStreamCount] = {0, 0, 0, 0};
  // --steps: the largest of the steps' peaks (the device's allocated peak
  // starts again with each step).
  int64_t run_allocated_peak = 0, run_high_water = 0;
  int64_t gathered_unit = -1, grad_unit = -1;  // ZeRO-3: the unit whose weights / gradients are bound
  // ZeRO-3 without resharding after forward: every unit gathered so far in
  // the step, each at its own place in fsdp_params (units in rank order).
  std::set<int64_t> kept_units;
};

class Executor {
  friend class ExecOpContext;  // op_exec.cc: an op's view of the executor

 public:
  Executor(const Json& plan, const RunOptions& options) : plan_json_(plan), options_(options) {}

  Expected<RunResult> Run();
  // Eager execution's record pass: when each buffer was last used.
  const EagerAccessLog& access_log() const { return acts_->access_log(); }
  // The backend (cuda: from the plugin, with a device), or why not.
  Expected<std::monostate> MakeBackend();
  // Run's work in this process (Run adds the ranks' agreement around it).
  Expected<RunResult> RunHere();
  Expected<std::monostate> RunStep(double* grad_norm, double* step_s);
  // With a communicator: every rank's Validate outcome, the same plan on
  // every rank, as many processes as the plan's grid has ranks.
  Expected<std::monostate> AgreeAcrossRanks(const Expected<std::monostate>& local);
  // A rank failing after the agreement: "memplan: rank N: ..." on stderr,
  // then every process ends (Communicator::Abort).
  [[noreturn]] void FailAlone(const Error& e);
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
  void MuonStep(Rank& r, ParamState& ps, const kernels::AdamConfig& cfg);
  // muon.cc: Newton-Schulz on the NS scratch's X slot; every Muon matrix of
  // this rank across data-parallel replicas (ZeRO-1: the gather).
  void Orthogonalize(Rank& r, int64_t rows, int64_t cols);
  void MuonStepsSharded(Rank& r, const kernels::AdamConfig& cfg);
  // sum x_i^2 in double (Ops::SquaredNorm) through the planned kernel scratch.
  double SquaredNorm(Rank& r, const float* x, int64_t n);
  void MakeBatch();

  // Messages between pipeline ranks (messages.cc): in one process a
  // mailbox, across processes the communicator. A message is named by its
  // kind and an id (activations and their gradients: the receiving stage
  // and the microbatch; Block AttnRes caches and their gradients: the
  // owner's instance; the tied embedding's gradient: 0).
  enum class Msg : int {
    kActivation = 0, kGradient = 1, kBlockCache = 2, kBlockGrad = 3, kTiedGrad = 4, kRemotePut = 5, kRemoteReturn = 6
  };
  static constexpr int kMsgKinds = 7;
  int64_t StageMsgId(int64_t stage, int32_t mb) const { return stage * model_.train.microbatches + mb; }
  int32_t RankOfStage(int64_t stage) const { return static_cast<int32_t>(stage % model_.parallel.pp); }
  bool Local(int32_t rank) const { return !options_.comm || rank == pp_rank_; }
  // The process of pipeline rank `pp` in this process's data-parallel
  // replica and tensor-parallel place (Megatron's order, tp fastest:
  // world rank = ((pp * dp + dp rank) * cp + cp rank) * tp + tp rank).
  int World(int32_t pp) const {
    return static_cast<int>(((pp * model_.parallel.dp + dp_rank_) * model_.parallel.cp + cp_rank_) * model_.parallel.tp +
                            tp_rank_);
  }
  // Tensor parallelism (tensor_parallel.cc, docs/runtime.md "Tensor
  // parallelism"). A tp_split parameter holds this rank's slice of the full
  // tensor; TpSlice cuts it from the full values, TpWhole gathers every
  // rank's slice into the full tensor (a collective of the group).
  bool TpSplit(const ParamState& ps) const;
  TpLayout TpLayoutOf(const ParamState& ps) const;
  std::vector<float> TpSlice(const ParamState& ps, const std::vector<float>& full) const;
  std::vector<float> TpWhole(const ParamState& ps, const std::vector<float>& mine);
  // Collectives over the group on device floats, staged through the host:
  // every rank's n floats (TpGather, on the host), their sum in place, every
  // rank's n floats into `whole` (n * tp) in rank order, and this rank's
  // block of n of the sum of every rank's `whole`.
  std::vector<float> GatherOver(Rank& r, Communicator& comm, const char* event, const float* data, int64_t n);
  void SumOver(Rank& r, Communicator& comm, DeviceCommunicator* nccl, const char* event, float* data, int64_t n);
  std::vector<float> TpGather(Rank& r, const float* data, int64_t n);
  void TpAllReduce(Rank& r, float* data, int64_t n);
  void TpAllGather(Rank& r, const float* mine, int64_t n, float* whole);
  void TpReduceScatter(Rank& r, float* whole, int64_t n, float* mine);  // `whole` is scratch (NCCL sums in place)
  // Parameters whose gradient each rank holds a part of (FindTpPartials),
  // summed over the group before the data-parallel reduction.
  void FindTpPartials();
  void ReduceTpPartial(Rank& r, ParamState& ps);
  std::set<std::string> tp_partial_;
  int64_t tp_rank_ = 0;
  std::unique_ptr<Communicator> tp_comm_;
  // Context parallelism (context_parallel.cc, docs/runtime.md "Context
  // parallelism"): this rank's place, its group (the ranks holding the
  // other chunks of the same sequences) and its collectives on device
  // floats, staged through the host: every rank's n floats (rank order),
  // and their sum in place.
  int64_t cp_rank_ = 0;
  std::unique_ptr<Communicator> cp_comm_;
  std::vector<float> CpGather(Rank& r, const float* data, int64_t n);
  void CpAllReduce(Rank& r, float* data, int64_t n);
  // The microbatch's index in the global batch (data, dropout masks).
  // A microbatch's index in the whole run: optimizer step, data-parallel
  // replica, then microbatch (the batch, dropout masks and dumps use it).
  int32_t GlobalMicrobatch(int32_t mb) const {
    const int64_t mbs = model_.train.microbatches;
    return static_cast<int32_t>((step_ * model_.parallel.dp + dp_rank_) * mbs + mb);
  }
  // The data-parallel group a parameter's gradient is reduced over and its
  // optimizer state divided across (docs/runtime.md, "Expert
  // parallelism"): the dp replicas of its pipeline rank, or for routed
  // experts the dp / ep replicas that hold the same experts. EP is carved
  // out of DP: data-parallel rank d is EP rank d % ep of EP group d / ep.
  struct DpGroup {
    int64_t size = 1, rank = 0;
    Communicator* comm = nullptr;          // null: one process
    DeviceCommunicator* device = nullptr;  // cuda with dp > 1: NCCL over the same ranks
  };
  const DpGroup& GroupOf(const ParamState& ps) const { return ps.expert ? expert_group_ : dense_group_; }
  // The expert grid (executor.cc Run): this process's place among the dp x
  // tp ranks of its pipeline rank, and its EP rank there.
  int64_t ExpertGridIndex() const { return DenseRank() * model_.parallel.tp + tp_rank_; }
  // The replicas a dense parameter's gradient is reduced over: dp x cp,
  // this process's place among them.
  int64_t Replicas() const { return model_.parallel.dp * model_.parallel.cp; }
  // A rank's place in the grid on its measured records (MeasuredRank,
  // MeasuredStepRank).
  template <typename Record>
  void SetGridPlace(Record& rec, const Rank& r) const {
    rec.pp_rank = r.index;
    rec.dp_rank = dp_rank_;
    rec.tp_rank = tp_rank_;
    rec.cp_rank = cp_rank_;
  }
  int64_t DenseRank() const { return dp_rank_ * model_.parallel.cp + cp_rank_; }
  int64_t EpRank() const { return ExpertGridIndex() % model_.parallel.ep; }
  // ZeRO-1: the elements of a parameter this replica's optimizer owns,
  // [RangeStart, + Owned), Shard each in its group.
  int64_t Shard(const ParamState& ps) const { return (ps.elements + GroupOf(ps).size - 1) / GroupOf(ps).size; }
  int64_t Owned(const ParamState& ps) const {
    return std::clamp<int64_t>(ps.elements - RangeStart(ps), 0, Shard(ps));
  }
  int64_t RangeStart(const ParamState& ps) const { return Shard(ps) * GroupOf(ps).rank; }
  // Across the parameter's group, staged through the host as every message
  // is (training.cc): this replica's range of the sum of every replica's
  // gradient at `grad` (Shard floats; a group of one: the gradient itself);
  // and every replica's range of `width`-byte elements (this one's at
  // `mine`) in order, the whole in the first elements * width bytes.
  std::vector<float> ReduceScatterRange(Rank& r, const ParamState& ps, const std::byte* grad);
  std::vector<std::byte> GatherRanges(Rank& r, const ParamState& ps, const void* mine, int64_t width);
  // Expert parallelism: the all-to-all of this rank's EP group (out[d] to
  // EP rank d; what each sent this rank, in rank order).
  std::vector<std::vector<std::byte>> ExchangeExperts(std::vector<std::vector<std::byte>> out);
  // The tokens of the step's global batch (every replica's), the loss's divisor.
  double GlobalTokens() const {
    return static_cast<double>(model_.train.microbatches * model_.parallel.dp * model_.train.micro_batch *
                               model_.train.seq_len);
  }
  // One process: the runnable rank whose next step starts first in the
  // plan's timeline; one process per rank: this process's rank.
  Rank* NextRank();
  bool Zero1() const {
    return (Replicas() > 1 && (model_.parallel.zero >= 1 || model_.parallel.pipeline_zero2)) || Zero3();
  }
  // ZeRO-3 / FSDP (docs/runtime.md, "ZeRO-3"): parameters, gradients and
  // optimizer state sharded over the replicas (with dp 1: one shard, the
  // whole), every unit gathered before its ops and its gradients
  // reduce-scattered after its backward.
  bool Zero3() const { return model_.parallel.zero >= 3; }
  bool PipelineZero2() const { return model_.parallel.pipeline_zero2; }
  // ZeRO-2 with dp > 1 (without pipeline ZeRO-2): gradients partitioned,
  // reduced through the plan's reduce bucket layer by layer.
  bool Zero2Bucket() const {
    return !PipelineZero2() && model_.parallel.zero == 2 && Replicas() > 1;
  }
  // Whether the reduced gradients live in per-replica partitions (`part`).
  bool GradPartitions() const { return PipelineZero2() || Zero2Bucket() || Zero3(); }
  // This replica's reduced gradient at element `from` of the parameter
  // (inside its range under ZeRO-1 / pipeline ZeRO-2).
  float* OwnGrad(const ParamState& ps, int64_t from) const {
    return GradPartitions() ? ps.part.as<float>() + (from - RangeStart(ps)) : ps.grad.as<float>() + from;
  }
  // Pipeline ZeRO-2 (training.cc): at the first backward step of a chunk's
  // pass its parameters' gradients are bound to one half of the double
  // buffer and zeroed; at its last the half is reduce-scattered across the
  // replicas and added into the partitions.
  std::vector<ParamState*> ChunkParams(Rank& r, int32_t chunk);
  void BeginGradPass(Rank& r, int32_t chunk);
  void EndGradPass(Rank& r, int32_t chunk);
  // ZeRO-2 (training.cc): at a layer's first backward step its parameters'
  // gradients are bound to the next free room of the reduce bucket (zeroed),
  // the bucket first flushed if they do not fit; at the end of each chunk's
  // pass the bucket is flushed. A flush reduce-scatters each bound gradient
  // and adds this replica's range into its partition.
  void BindToBucket(Rank& r, int64_t layer);
  // Binds `params`' gradients one after the other in [start, end) of a
  // static buffer, zeroed (`too_small`: the message when they do not fit).
  void BindGrads(Rank& r, const std::vector<ParamState*>& params, const Buffer& buffer, int64_t start, int64_t end,
                 const char* too_small);
  // ZeRO-3 (training.cc): before each op, its parameters' unit gathered
  // into fsdp_params (the previous unit released: one at a time) and, in
  // backward, its gradients bound to fsdp_grads (the previous unit's
  // reduce-scattered into the partitions first); at the step's end the
  // last unit's flushed.
  void PrepareParams(Rank& r, const OpSpec& op, bool backward);
  void GatherUnit(Rank& r, int64_t unit);
  std::vector<ParamState*> UnitParams(Rank& r, int64_t unit);  // in the rank's order
  void FlushUnitGrads(Rank& r);
  void ReleaseUnits(Rank& r);
  void FlushGrads(Rank& r, const std::vector<ParamState*>& params);
  std::vector<ParamState*> bucket_;  // the gradients bound to the reduce bucket, in order
  // The data-parallel gradient reduction: all-reduce, or (ZeRO-1) each
  // replica's shard reduce-scattered into its place in the gradient.
  void ReduceGradients();
  // ZeRO-1: every replica's updated shard of each weight, gathered.
  void GatherWeights();
  void Post(int32_t from, int32_t to, Msg kind, int64_t id, std::vector<std::byte> bytes);
  // One process only: whether the message is in the mailbox.
  bool Arrived(int32_t from, int32_t to, Msg kind, int64_t id) const;
  // The message, taken (across processes: waits for it).
  std::vector<std::byte> Take(int32_t from, int32_t to, Msg kind, int64_t id);
  // Remote offloads between processes (messages.cc): the owner sends the
  // payload after Save; the target lands it in its buffer and returns it at
  // the step of its timeline that starts last before the owner's fetch;
  // the owner waits for it before the step that allocates the fetch.
  void SetupRemote();
  void ReceiveRemoteFetches(Rank& r, int64_t step);  // before BeginStep
  void ReturnRemotePayloads(Rank& r, int64_t step);  // after BeginStep
  void SendRemotePayload(Rank& r, int32_t inst);     // after Save
  // Per rank and step: the (owner rank, instance) payloads handled there;
  // per owner rank, the target of each instance shipped away.
  std::vector<std::map<int64_t, std::vector<std::pair<int32_t, int32_t>>>> remote_returns_, remote_fetches_;
  std::vector<std::map<int32_t, int32_t>> remote_target_;
  // With a communicator: the largest message id of any kind fits a tag.
  Expected<std::monostate> CheckTags() const;
  // Every rank's `mine`, in rank order (one process: `mine` alone).
  std::vector<double> GatherDoubles(double mine);
  // --dump: the initial weights and the batch (kWeights), the gradients
  // after the step (kGrads), the weights after the optimizer (kUpdated).
  enum class DumpWhat { kWeights, kGrads, kUpdated };
  Expected<std::monostate> Dump(DumpWhat what);
  // MEASURED.json from the last step's record (RecordStep) and the run's.
  Expected<RunResult> Finish();
  // With a communicator: every rank's measurement, trace and warnings into
  // rank 0's result (the loss and the times agreed on every rank).
  void GatherRanks(RunResult& out);

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
  // The parameter bound to `op`'s role `role` (OpSpec::params) on rank `r`.
  const ParamState& ParamOf(Rank& r, const OpSpec& op, size_t role);

  // Shared blocks (shared_blocks.cc): tensors later layers read in place.
  void SetupShared();
  bool IsShared(const LayerBuffers& lb, int32_t t) const {
    return lb.share_layer[static_cast<size_t>(t)] >= 0 || lb.shared_out[static_cast<size_t>(t)] != 0;
  }
  // The value / gradient of shared tensor `t` of block `bi`'s layer on rank
  // `r`: the owner's instance and summed gradient, or this rank's pp cache.
  Buffer SharedValue(Rank& r, size_t bi, int32_t t);
  Buffer SharedGrad(Rank& r, size_t bi, int32_t t);
  // After BeginStep: zero the new gradient buffers, fill the new caches.
  // Before EndStep: send the cache gradients whose last reader ran.
  void BeginCross(Rank& r);
  // Cross buffer `index` of `r`, and what a new one starts with (zeroed
  // gradients, the cached block from its owner).
  Buffer CrossBuf(Rank& r, int32_t index);
  void InitCross(Rank& r, int32_t index, Buffer buf);
  void EndCross(Rank& r);
  // At a layer's first backward step: the other ranks' gradients of its
  // shared tensors, added into their sums.
  void ReceiveSharedGrads(Rank& r, size_t bi);
  // After instance `inst` of rank `r` is saved: a block other ranks cache
  // goes to each of them.
  void SendBlockCaches(Rank& r, int32_t inst);

  // Ops.
  void Forward(Rank& r, size_t bi, int32_t pos, const std::function<Buffer(int32_t)>& value, int32_t mb);
  void Backward(Rank& r, size_t bi, int32_t pos);
  void Recompute(Rank& r, size_t bi, int32_t inst);
  void RestoreLayer(Rank& r, size_t bi);
  // An input of the block: the batch, or the previous stage's activation
  // (`inbox`, taken once per pass).
  void LoadInput(Rank& r, size_t bi, int32_t tensor, Buffer dst, const std::vector<std::byte>* inbox);

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
  const CudaPlugin* cuda_ = nullptr;  // --backend cuda
  std::vector<std::unique_ptr<Rank>> ranks_;
  std::unique_ptr<ActivationManager> acts_;
  std::vector<std::vector<int32_t>> tensor_base_;  // layer -> rank-local index of its first saved tensor
  std::vector<std::vector<int32_t>> saved_index_;  // layer -> per graph tensor, index among saved or -1
  // (from rank, to rank, kind, id) -> messages in the order posted.
  std::map<std::tuple<int32_t, int32_t, Msg, int64_t>, std::deque<std::vector<std::byte>>> mailbox_;
  // Shared blocks: (rank, owner rank, instance, role) -> index into
  // p_.cross[rank]; per rank and step, the cross buffers ending there; per
  // shared instance, the cache gradients on their way to it.
  std::map<std::tuple<int32_t, int32_t, int32_t, planner::CrossBuffer::Role>, int32_t> cross_index_;
  std::vector<std::vector<std::vector<int32_t>>> cross_ends_;
  // Per (owner rank, instance): the other ranks that cache the block, and
  // those that send it a gradient (ascending: the sum's order).
  std::map<std::pair<int32_t, int32_t>, std::vector<int32_t>> cache_readers_, grad_senders_;
  std::vector<std::vector<int32_t>> tokens_, targets_;  // per microbatch
  double loss_sum_ = 0;
  int64_t steps_total_ = 0, steps_done_ = 0;
  int64_t step_ = 0;  // the optimizer step running, from 0 (RunOptions::steps)
  // --steps: the activation manager of a step, made again for the next
  // (MakeManager); each rank's counters back to the step's start, its
  // gradients zeroed (BeginNextStep); the step's record (RecordStep).
  void MakeManager();
  void BeginNextStep();
  // arch.moe.selection_bias: layer `layer`'s bias on rank `r` (zeros, or the
  // test's init hook, at its first use); after each step every expert's
  // bias moves by bias_update_rate towards balance over the step's tokens
  // (every replica's: summed over the data-parallel group).
  std::vector<float>& RouterBias(Rank& r, int64_t layer);
  void UpdateRouterBias();
  void RecordStep(double grad_norm, double step_s);
  std::vector<traces::MeasuredStep> step_records_;
  std::string DumpDir() const;
  std::chrono::steady_clock::time_point t0_;
  traces::ChromeTrace trace_;
  // cuda: CUPTI's view of the step (started before any device memory).
  std::unique_ptr<traces::GpuProfiler> cupti_;
  // One process per rank: this process's coordinates and its data-parallel
  // group (the replicas of its pipeline rank).
  int32_t pp_rank_ = -1;
  int64_t dp_rank_ = 0;
  std::unique_ptr<Communicator> dp_comm_, ep_comm_, edp_comm_;  // data-parallel, EP, expert data-parallel
  std::unique_ptr<DeviceCommunicator> dense_nccl_, expert_nccl_;  // cuda: the groups' gradients on the device
  // cuda: the tensor- and context-parallel groups' sums, gathers and
  // reduce-scatters of device buffers (tensor_parallel.cc).
  std::unique_ptr<DeviceCommunicator> tp_nccl_, cp_nccl_;
  // Waits for the NCCL work enqueued on the rank's ops stream (none: nothing).
  void SynchronizeNccl(Rank& r) {
    for (auto* nccl : {dense_nccl_.get(), expert_nccl_.get(), tp_nccl_.get(), cp_nccl_.get()}) {
      if (nccl) nccl->Synchronize(OpsStream(r));
    }
  }
  // The stream the rank's ops run on (cuda: a cudaStream_t; host: null).
  void* OpsStream(Rank& r) {
    auto streams = backend_->Streams(*r.dev);
    return streams.empty() ? nullptr : streams.front().second;
  }
  DpGroup dense_group_, expert_group_;
  int64_t context_bytes_ = 0;
  double compute_s_ = 0;  // the forwards and backwards of the step
  int64_t cupti_epoch_ns_ = 0;               // CUPTI's clock at t0_
  std::vector<traces::GpuOpName> gpu_ops_;  // ScopedGpuOp id k -> gpu_ops_[k - 1]
  std::vector<std::string> warnings_;
};

}  // namespace memplan::runtime::exec
