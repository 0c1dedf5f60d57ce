// The unified activation manager: every tensor saved for backward is an
// instance (one per microbatch) bound to the storage the plan chose —
// keep, recompute, fp8, offload_host, offload_remote, or fp8 composed with
// an offload — and the model code only asks for instances; it never names a
// policy (docs/runtime.md, "How it executes a plan"; docs/design.md, Layout).
//
// Memory follows the plan's memory program (planner::ProgramWalker) rank by
// rank: BeginStep allocates every buffer that starts at the rank's next
// step, EndStep frees every buffer whose last step it is. A buffer is
// either an interval of a saved instance (planner::IntervalPart says which
// part of it: the tensor as produced, its FP8 encoding, the payload until
// its copy-out is over, the prefetched payload, the restored tensor, a
// recompute chain's scratch, a remote payload landed on another rank), a
// cross buffer (planner::CrossBuffer: a shared block's gradient, the pp
// cache) or a block buffer of a layer pass (values, gradients,
// workspaces). Because the
// allocation sequence is the one the planner placed, a device whose
// allocator is the planner's best-fit heap reaches exactly the predicted
// bytes.
//
// What happens to an instance, call by call:
//
//   Save      after its producer wrote Forward(): quantize into the compact
//             buffer (fp8); start the copy-out (d2h into the host arena, or
//             link into the target rank's buffer).
//   (steps)   the device copy is freed at the plan's `done` step, after the
//             copy; the prefetch is issued when the fetched buffer is
//             allocated, one layer ahead of the layer's backward.
//   Restore   at its layer's first backward step: wait for the prefetch,
//             dequantize (fp8). A recomputed instance is then re-made by the
//             caller into Backward(), its chain's intermediates in Scratch().
//
// Remote payloads between emulated ranks: the target's buffer exists only
// during the steps the plan gives it; a payload that leaves its source
// before that buffer exists, or that the target frees before the owner
// fetched it, waits on a wire (host memory outside the pools), as it would
// be in flight on a link.
//
// Threading: one thread drives all ranks; copy engines run concurrently,
// and every free waits for the copies that touch its buffer.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "memplan/planner/liveness.h"
#include "memplan/planner/program.h"
#include "memplan/runtime/backend.h"
#include "memplan/runtime/device.h"
#include "memplan/runtime/host_device.h"

namespace memplan::runtime {

// One rank's memory as the manager drives it (not owned).
struct RankMemory {
  Device* device = nullptr;  // activations
  HostArena* host = nullptr; // receives host offloads
};

// Eager execution (docs/runtime.md, "Eager execution"): a buffer of the
// executed program by identity, independent of the planner's intervals: a
// part of a saved instance, a block buffer by (block, role, tensor, op), or
// a cross buffer.
struct EagerKey {
  int8_t kind = 0;  // 0 instance part, 1 block buffer, 2 cross buffer
  int32_t a = 0, b = 0, c = 0, d = 0;
  auto operator<=>(const EagerKey&) const = default;
};
// The record pass's log: per rank, each buffer's last access (rank step).
using EagerAccessLog = std::vector<std::map<EagerKey, int64_t>>;

// One allocation or free of eager execution, in model terms.
struct AllocationEvent {
  int64_t step = 0;   // the rank's step (op) at which it happened
  int64_t bytes = 0;  // > 0 allocated, < 0 freed
  std::string name;   // planner::BufferName's
  std::string part;   // planner::BufferName's
  // A free under the eager witness (Device::Witness): the bytes the
  // kernels and copies wrote (-1: not measured).
  int64_t touched = -1;
};

// How the manager allocates: the plan's memory program (arena, pool), or
// eagerly (each buffer at its first use, freed after its last, from the
// device's own allocator). Eager runs twice: the record pass frees nothing
// and logs every buffer's last access; the measured pass frees each buffer
// at the end of its last-access step, once the copies reading it are done.
struct MemoryMode {
  bool eager = false;
  const EagerAccessLog* last_access = nullptr;  // the measured pass; null: record
};

// A copy the manager started, for traces.
struct CopyRecord {
  Queue queue = Queue::kD2H;
  std::string what;  // e.g. "offload layer1.mlp.fc1_out@mb2"
  Event event;
};

class ActivationManager {
 public:
  // All references must outlive the manager. `intervals` are the plan's
  // (planner::Evaluate), `ranks` one per pipeline rank.
  ActivationManager(const planner::PlanningProblem& problem, const planner::Assignment& assignment,
                    const std::vector<planner::Interval>& intervals, std::vector<RankMemory> ranks, Backend& backend,
                    MemoryMode mode = {});
  ~ActivationManager();
  ActivationManager(const ActivationManager&) = delete;
  ActivationManager& operator=(const ActivationManager&) = delete;

  // The memory program of `rank`: BeginStep advances to its next step and
  // allocates what starts there (throws ErrorException kRuntime when the
  // device is exhausted); EndStep frees what ends there.
  void BeginStep(int32_t rank);
  void EndStep(int32_t rank);
  // The current step of `rank` (-1 before the first BeginStep).
  int64_t step(int32_t rank) const;
  // What the last BeginStep of `rank` allocated.
  const std::vector<planner::ProgramBuffer>& allocations(int32_t rank) const;

  // A live block buffer of block `block` of `rank`'s timeline: the entry of
  // its layer's forward/backward list with this role, tensor (and op, for
  // kGradTemp/kWorkspace) whose condition holds in that block. Aborts when
  // it is not live (a bug in the caller or the planner); throws
  // ErrorException kCheckFailed naming the op, layer, microbatch and tensor
  // when the plan has no such buffer at all.
  // Eager: the buffer of (block, role, tensor, op), allocated at its first
  // use.
  Buffer BlockBuffer(int32_t rank, int64_t block, planner::BlockBuffer::Role role, int32_t tensor,
                     int32_t op = -1);
  // Cross buffer `index` of `rank` (problem.cross[rank][index]), live. The
  // manager only binds them; the executor fills, zeroes and sends them.
  // Eager: allocated at its first use, which sets *fresh.
  Buffer Cross(int32_t rank, int32_t index, bool* fresh = nullptr);

  // Saved instances (index into problem.instances[rank]).
  // The full tensor from its producer to its last forward reader.
  Buffer Forward(int32_t rank, int32_t instance);
  // The full tensor through its layer's backward (after Restore).
  Buffer Backward(int32_t rank, int32_t instance);
  // A recomputed instance's chain scratch (recompute_extra_bytes), at its
  // layer's first backward step.
  Buffer Scratch(int32_t rank, int32_t instance);
  void Save(int32_t rank, int32_t instance);
  void Restore(int32_t rank, int32_t instance);

  // One process per rank: the executor carries remote payloads between
  // processes. TakeWire: the payload Save left on the owner's wire (its
  // target is in another process); PutWire: the payload back on the
  // owner's wire before its fetch; Landed: the target's buffer of the
  // owner's instance (live on the target's rank).
  std::vector<std::byte> TakeWire(int32_t rank, int32_t instance);
  void PutWire(int32_t rank, int32_t instance, std::vector<std::byte> bytes);
  Buffer Landed(int32_t owner, int32_t instance) const;

  // Copies started on `rank` since the last call.
  std::vector<CopyRecord> TakeCopies(int32_t rank);
  // Counts: allocations, frees, d2h/h2d/link copies, quantizes, dequantizes.
  const std::map<std::string, int64_t>& events(int32_t rank) const;

  // Eager: after the last step, frees what is left (waiting for copies);
  // the record pass's log (every rank's, others' empty); each rank's
  // allocations and frees in order.
  void FinishEager();
  const EagerAccessLog& access_log() const { return log_; }
  const std::vector<AllocationEvent>& allocation_events(int32_t rank) const;
  bool eager() const { return mode_.eager; }
  // Eager, after each op (`what` names it): the red zones of every buffer
  // the op was handed are intact, else throws ErrorException kCheckFailed
  // naming the op, the buffer and how far it wrote past it.
  void AfterOp(int32_t rank, const std::string& what);

 private:
  struct Instance;
  struct Rank;
  Instance& Inst(int32_t rank, int32_t instance);
  const Instance& Inst(int32_t rank, int32_t instance) const;
  void Allocate(Rank& r, const planner::ProgramBuffer& b);
  void Free(Rank& r, const planner::ProgramBuffer& b);
  Buffer BlockBufferAt(int32_t rank, int64_t block, int32_t index) const;
  // Eager (activation_eager.cc).
  struct EagerBuffer;
  Buffer Access(Rank& r, const EagerKey& key, int64_t bytes);
  Buffer InstancePart(int32_t rank, int32_t instance, planner::IntervalPart part);
  void Fence(Rank& r, const EagerKey& key, const Event& e);  // a copy reading or writing it
  void EagerEndStep(Rank& r);
  void EagerFree(Rank& r, const EagerKey& key);
  // The witness's reading of a buffer; throws when its red zones were hit.
  int64_t Witnessed(Rank& r, const Buffer& buf, bool scan, const std::string& name, const std::string& part,
                    const std::string& when);
  std::pair<std::string, std::string> EagerName(const Rank& r, const EagerKey& key) const;

  const planner::PlanningProblem& p_;
  const planner::Assignment& a_;
  const std::vector<planner::Interval>& ivs_;
  Backend& backend_;
  std::vector<std::unique_ptr<Rank>> ranks_;
  MemoryMode mode_;
  EagerAccessLog log_;
};

}  // namespace memplan::runtime
