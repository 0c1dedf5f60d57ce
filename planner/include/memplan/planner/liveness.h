// Liveness on the schedule (stage 5).
//
// Glossary (XLA's heap-simulator vocabulary):
//   step      one op of a rank's flattened schedule: the forward ops of each
//             layer of a forward pass in topological order, the backward ops
//             of each layer of a backward pass in reverse order.
//   instance  one saved tensor of one microbatch (its chunk is the layer's).
//   interval  the inclusive step range during which some bytes of an
//             instance occupy a rank's device memory. A kept instance has one
//             interval [produced, end of its layer's backward]; an offloaded
//             one has two (until the copy-out completes and its forward
//             consumers ran; from the per-layer prefetch on); an FP8 one
//             holds its full size until its last forward consumer and from
//             its dequantization on, and 1.03125 B/element in between; a
//             recomputed one is freed after its last forward consumer and
//             re-materialized for its layer's backward.
//   block     the steps of one layer in one pass (forward or backward) of
//             one microbatch.
//   block buffer  a buffer a block allocates for itself (BlockBuffer): in
//             forward, every value that is not saved, from the op producing
//             it to its last consumer; in backward, the gradient of every
//             floating-point tensor, from the first op that writes it to the
//             op that consumes it, each op's backward workspace, and values
//             that are not saved but that a backward op needs (rebuilt by
//             re-running their producer). The residual stream and its
//             gradient cross blocks: a layer's output that the next layer
//             of the same pass consumes is handed over (the buffer spills
//             into the next block, or, when the next layer saves it, it is
//             written straight into that saved instance).
//   transient the bytes of block buffers live at a step.
//
// Time: every op takes its roofline time on the hardware (backward: twice the
// forward); a pipeline simulation of the schedules (each pass waits for the
// same microbatch's pass on the neighbouring virtual stage) gives every
// step a start and end time. Copies run on per-rank queues (d2h, h2d, and the
// pipeline link for remote offload), first in first out, overlapped with
// compute; a prefetch that arrives after its layer's backward starts is
// exposed time. Transfer windows come from the base timeline.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "memplan/planner/accounting.h"
#include "memplan/planner/graph.h"
#include "memplan/planner/layout.h"
#include "memplan/planner/model.h"
#include "memplan/planner/period.h"
#include "memplan/planner/schedule.h"

namespace memplan::planner {

// How every instance of one saved tensor is stored.
enum class Storage : uint8_t {
  kKeep,
  kRecompute,
  kFp8,
  kOffloadHost,
  kFp8OffloadHost,
  kOffloadRemote,
  kFp8OffloadRemote,
};
inline constexpr int kStorageCount = 7;

std::vector<Policy> StoragePolicies(Storage s);
Storage StorageFrom(const std::vector<Policy>& policies);
bool IsRemote(Storage s);
bool IsOffload(Storage s);
bool IsFp8(Storage s);

// FP8 1x128 blockwise footprint: E4M3 values plus one fp32 scale per block
// of the last dimension (1.03125 B/element when it divides by 128).
int64_t Fp8Bytes(const std::vector<int64_t>& shape);

struct SavedTensor {
  std::string name;
  // Later layers read it in place (Block AttnRes's blocks with a single
  // copy): it stays resident, kept, until its own layer's backward.
  bool shared = false;
  int64_t layer = 0;
  int32_t chunk = 0;
  int32_t graph_index = 0;  // index in the layer graph's tensors
  int64_t bytes = 0;
  int64_t fp8_bytes = 0;
  bool can_fp8 = false;        // a floating-point activation
  bool can_recompute = false;  // a producer chain inside the chunk
  StorageKinds allowed;        // the model's `storage` (--storage)
  double recompute_s = 0;      // one instance: the chain's ops, roofline
  int64_t recompute_extra_bytes = 0;  // chain intermediates at re-materialization
  double fp8_s = 0;            // one instance: quantize + dequantize at HBM bandwidth
  std::optional<double> cost_recompute_s, cost_fp8_s, cost_offload_s;  // model `costs`
  bool annotated = false;
  std::vector<Policy> annotation;  // as written
  std::string annotation_glob;
  Storage annotated_storage = Storage::kKeep;  // after legal fallback
  int64_t prod_pos = -1;  // producer op's position in the layer's forward
};

struct Instance {
  int32_t tensor = 0;  // index into the rank's tensors
  int32_t microbatch = 0;
  int64_t prod = 0;      // step that produces it
  int64_t f_last = 0;    // last forward step that reads it (>= prod)
  int64_t b_first = 0;   // first step of its layer's backward
  int64_t b_last = 0;    // last step of its layer's backward
  int64_t pf_start = 0;  // step at which its layer's prefetch is issued
  double prod_end_s = 0;   // time the producing op ends
  double pf_start_s = 0;   // time the prefetch may start
  double need_s = 0;       // time its layer's backward starts
};

// One buffer of a block (see the glossary). Steps are local to the block,
// in execution order (backward: step j runs the backward of the op at
// topological position n - 1 - j).
struct BlockBuffer {
  enum class Role : uint8_t {
    kValue,      // a forward value that is not saved
    kGrad,       // the gradient of `tensor`
    kWorkspace,  // the backward workspace of the op at topological position `op`
    kRebuilt,    // a value that is not saved, re-made for backward by its producer `op`
    kGradTemp,   // op `op`'s gradient for its input `tensor`, summed into kGrad
  };
  // When the buffer exists, depending on the neighbouring blocks of the pass.
  enum class When : uint8_t { kAlways, kPrevInPass, kPrevNotInPass, kNextInPass, kNextNotInPass };
  Role role = Role::kValue;
  When when = When::kAlways;
  int32_t tensor = -1;  // index into the layer graph's tensors
  int32_t op = -1;      // topological position of the op it belongs to
  int32_t first = 0;    // local steps, inclusive
  int32_t last = 0;
  int32_t next_last = -1;  // kNextInPass: lasts until this local step of the next block
  int64_t bytes = 0;
};

// The block buffers of one layer, for both passes, in allocation order.
struct LayerBuffers {
  int32_t ops = 0;  // steps per block
  std::vector<BlockBuffer> forward, backward;
  // Per tensor of the layer graph: its producer's and last local consumer's
  // topological positions (-1: none here), the next layer's tensor it
  // becomes (-1: none) and the previous layer's tensor it is (-1: none).
  std::vector<int32_t> prod, last_use, export_to, import_from;
  // Shared tensors (Block AttnRes with a single copy): per tensor, the
  // earlier layer whose saved tensor it is, read in place, and its index
  // there (-1: a tensor of this layer); whether later layers read this
  // layer's tensor in place (its gradient is then a cross buffer, summed
  // over every reader, not a block buffer).
  std::vector<int32_t> share_layer, share_index;
  std::vector<uint8_t> shared_out;
  // Per saved tensor: the local backward step of its last reader (an op's
  // backward, a producer re-run for a rebuilt value, or the recompute
  // chains at step 0). Its backward copy lives until then, not until the
  // layer's backward ends (found by eager execution, docs/runtime.md).
  std::vector<int32_t> bwd_last;
};

// Ops whose backward adds into its input gradients without a temporary
// (OpDef::grad_accumulates); the others overwrite theirs.
bool GradAccumulates(OpKind kind);

// The tensors (by graph index) a backward op reads besides the gradients of
// its outputs (OpDef::backward_reads): these must be resident when it runs
// (saved, or rebuilt).
std::vector<int32_t> BackwardReads(const LayerGraph& g, const OpSpec& op);

// A block of a rank's timeline.
struct Block {
  int64_t first = 0;  // first step
  int64_t layer = 0;
  int32_t microbatch = 0;
  bool forward = true;
  bool prev_in_pass = false;  // the block before it runs the previous op of the same pass
  bool next_in_pass = false;
};

struct RankTimeline {
  int64_t steps = 0;
  std::vector<Block> blocks;               // in step order
  std::vector<int64_t> transient;          // block-buffer bytes per step
  std::vector<double> start_s, end_s;      // per step, pipeline time
  std::vector<int32_t> step_pass;          // index into the rank's schedule
  double compute_s = 0;                    // sum of op times, without communication
  double comm_s = 0;                       // time its steps wait on TP / CP / EP groups (comm.h)
  // The data-parallel gradient reduction left after overlap with its last
  // microbatch's backward passes (comm.h).
  double dp_exposed_s = 0;
};

// A buffer that spans blocks and is the same under every storage decision
// (Block AttnRes with a single copy, docs/design.md "Shared blocks"). For a
// shared instance (a saved tensor later layers read in place):
//   kSharedGrad  on its rank: its gradient, summed over every reader's
//                backward (and the other ranks' cache gradients, added at
//                its layer's first backward step), until its producer's
//                backward consumes it;
//   kCache       on a rank that reads it but does not own it: the pp cache's
//                copy, from the first reader's forward to the last reader's
//                backward of the microbatch (only new blocks travel);
//   kCacheGrad   there: the cached copy's gradient, over the readers'
//                backwards, then sent to the owner;
//   kGradInbox   on the owner, for its layer's first backward step when
//                other ranks read it: where each cache gradient lands before
//                it is added into kSharedGrad.
struct CrossBuffer {
  enum class Role : uint8_t { kSharedGrad, kCache, kCacheGrad, kGradInbox };
  Role role = Role::kSharedGrad;
  int32_t rank = 0;  // where the bytes live
  int64_t first = 0, last = 0;  // steps of that rank, inclusive
  int64_t bytes = 0;
  int32_t owner_rank = 0;  // the shared instance
  int32_t instance = 0;
};

// Everything the solver, the rebalancer and the bounds need, built once.
struct PlanningProblem {
  const Model* model = nullptr;
  std::vector<LayerGraph> layers;
  PipelineLayout layout;
  std::vector<RankSchedule> schedules;
  std::vector<StaticBreakdown> statics;
  std::vector<RankTimeline> timelines;
  std::vector<std::vector<SavedTensor>> tensors;    // per rank
  std::vector<std::vector<Instance>> instances;     // per rank, grouped by tensor
  std::vector<std::vector<int32_t>> first_instance;  // per rank, per tensor; one past the end appended
  // Base step time: the pipeline, then each rank's exposed data-parallel
  // reduction.
  double makespan_s = 0;
  // PCIe contention (docs/planner.md, "PCIe contention"): the share of the
  // host link's d2h/h2d bandwidth left to offload copies once inter-node
  // traffic, which crosses the same PCIe link to the NIC, takes its
  // average rate on the busiest rank. 1 where no group leaves the node.
  double offload_bw_share = 1;
  double inter_node_bytes_per_s = 0;  // that average rate, bytes/s per direction
  // Per virtual stage (chunk * pp + rank): one microbatch's forward and
  // backward pass times.
  std::vector<double> stage_fwd_s, stage_bwd_s;
  // Per rank: static + the any-plan profile's maximum (filled by BuildProblem).
  std::vector<int64_t> any_plan_lower_bound;
  // Per rank, per tensor, per storage: InstanceCost summed over the tensor's
  // instances (the solvers' objective coefficients), computed once.
  std::vector<std::vector<std::array<double, kStorageCount>>> tensor_cost_s;
  std::vector<LayerBuffers> layer_buffers;  // per global layer
  // Per rank, sorted by first step (included in the timelines' transient).
  std::vector<std::vector<CrossBuffer>> cross;
  // Microbatches simulated: the model's, or its periodic window's (period.h).
  int64_t microbatches = 0;
  // The periodic window, when the problem simulates one; per rank, the
  // window's step where the left-out periods go (`cut`) and the steps of
  // one period: the model's steps are the window's before the cut, the
  // period before it `window->periods` more times, then the rest.
  std::optional<PeriodicWindow> window;
  struct PeriodSteps {
    int64_t cut = 0, period = 0;
  };
  std::vector<PeriodSteps> period_steps;
};

// How many of the model's instances instance `instance` of `rank` stands
// for: 1, or 1 + periods in a periodic window's repeated period.
int64_t InstanceWeight(const PlanningProblem& p, int32_t rank, int32_t instance);

// Host-offload capacity of a rank, so that copies hide behind compute: the
// prefetches of one layer's instances must fit its prefetch window at h2d
// bandwidth, and a chunk's copy-outs must drain within one forward pass of
// that chunk at d2h bandwidth (warm-up runs forwards back to back).
struct OffloadCapacity {
  std::vector<double> layer_in_bytes;   // per global layer (0 off this rank)
  std::vector<double> chunk_out_bytes;  // per chunk of the rank
  std::vector<double> layer_in_used, chunk_out_used;
  bool Fits(const SavedTensor& t, int64_t moved) const;
  void Add(const SavedTensor& t, int64_t moved, double sign);
};
OffloadCapacity HostCapacity(const PlanningProblem& p, int32_t rank);

// Throws ErrorException on bad input (e.g. overflowing sizes). kPeriodic
// simulates a periodic window of the microbatches when the model has one
// (period.h), kFull every microbatch (the oracle, and what the runtime
// executes).
enum class Simulation : uint8_t { kFull, kPeriodic };
PlanningProblem BuildProblem(const Model& model, std::vector<LayerGraph> layers,
                             Simulation simulation = Simulation::kFull);

// The base step BuildProblem computes (makespan_s: pipeline, communication
// and exposed DP reduction), without the instances: a lower bound of any
// plan's step_s, in milliseconds even at K3 scale (`memplan search`).
double BaseStepSeconds(const Model& model, const std::vector<LayerGraph>& layers);

// Storage decision per rank and tensor, plus the target rank of remote ones.
struct Assignment {
  std::vector<std::vector<Storage>> storage;
  std::vector<std::vector<int32_t>> target;
  static Assignment KeepAll(const PlanningProblem& p);
  // Annotated tensors take their (legal) annotation, the rest keep.
  static Assignment Annotated(const PlanningProblem& p);
};

// What an interval holds of its instance.
enum class IntervalPart : uint8_t {
  kFull,      // the tensor as produced, until its last use before backward (or all along when kept)
  kCompact,   // the FP8 encoding
  kMovedOut,  // the offloaded payload on the device until its copy-out is over
  kFetched,   // the offloaded payload brought back by the prefetch
  kRestored,  // the full tensor again, for its layer's backward (recompute, dequantize)
  kExtra,     // the recompute chain's intermediates
  kLanded,    // a remote offload's payload on its target rank
};

struct Interval {
  IntervalPart part = IntervalPart::kFull;
  int32_t rank = 0;   // where the bytes live
  int64_t first = 0;  // inclusive steps of that rank
  int64_t last = 0;
  int64_t bytes = 0;
  int32_t owner_rank = 0;  // the instance's rank
  int32_t instance = 0;    // index into problem.instances[owner_rank]
  bool transfer_late = false;  // copy-out did not finish before the prefetch window
};

struct TransferStats {
  double exposed_s = 0;  // prefetches arriving after their layer's backward starts
  int64_t late_copies = 0;
};

// Intervals of every instance owned by `rank` under `a`, with copy queues
// simulated (first in, first out). Appends to `out`; remote intervals land
// on their target rank.
void InstanceIntervals(const PlanningProblem& p, const Assignment& a, int32_t rank, std::vector<Interval>* out,
                       TransferStats* stats);

// Intervals of one instance under `s` with copy-outs ending at `out_done`
// (source rank steps) and `remote_first/remote_last` on the target. Used by
// the solver for a queue-free estimate.
void IntervalsOf(const PlanningProblem& p, int32_t rank, int32_t instance, Storage s, int32_t target,
                 int64_t out_done, std::vector<Interval>* out);

// Queue-free copy-out completion step of one instance moving `bytes` at `bw`.
int64_t CopyDoneStep(const RankTimeline& t, const Instance& inst, int64_t bytes, double bw);
// The step of `rank` running at time `s` (clamped to the timeline).
int64_t StepAt(const RankTimeline& t, double s);

// Per rank: live activation bytes per step (transients + intervals).
std::vector<std::vector<int64_t>> Profiles(const PlanningProblem& p, const std::vector<Interval>& intervals);

// Whether block buffer `b` of `layer_buffers` exists in `block`, and its
// steps on the rank's timeline.
bool BlockBufferSteps(const Block& block, const LayerBuffers& layer_buffers, const BlockBuffer& b, int64_t* first,
                      int64_t* last);

// Per rank: the any-plan profile, every instance at its smallest footprint
// (resident from its production to its last forward reader, and during its
// layer's backward).
std::vector<std::vector<int64_t>> AnyPlanProfiles(const PlanningProblem& p);

// Seconds one instance of tensor t adds under storage s, by the separable
// cost model the solvers optimise (offload: the prefetch that does not fit
// its window on an otherwise idle link).
double InstanceCost(const PlanningProblem& p, int32_t rank, int32_t instance, Storage s);

// The one rule of what each storage can hold, used by the solvers, the
// pipeline rebalancer, --verify and the runtime's plan reader: why tensor
// `t` of pipeline rank `rank` cannot be stored as `s` (remote: at `target`;
// -1 for either when not chosen yet), or nullopt when it can. A tensor
// later layers read in place (shared) is only kept; fp8 needs a
// floating-point tensor; recompute a producer chain in its layer; a remote
// offload another pipeline rank.
std::optional<std::string> StorageRefusal(const SavedTensor& t, Storage s, int64_t pp, int32_t rank = -1,
                                          int32_t target = -1);
bool Legal(const SavedTensor& t, Storage s, int64_t pp);

// Bytes one instance keeps on its device between forward and backward: all
// of them when kept, the FP8 footprint, 0 when recomputed or offloaded.
int64_t StoredBytes(const SavedTensor& t, Storage s);

}  // namespace memplan::planner
