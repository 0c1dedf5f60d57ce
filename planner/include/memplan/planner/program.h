// The planner -> runtime contract: a rank's memory program, the one order
// of allocations and frees that the planner's placement (bounds.cc) and the
// runtime's activation manager (runtime/src/activation.cc) both follow, so
// that the same deterministic best-fit heap reaches the same bytes and
// offsets. Everything else the runtime reads of a plan it rebuilds with the
// planner's own code (BuildProblem, Evaluate).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "memplan/planner/liveness.h"

namespace memplan::planner {

// One allocation of a rank's memory program.
struct ProgramBuffer {
  int64_t first = 0;  // steps of the rank, inclusive
  int64_t last = 0;
  int64_t bytes = 0;
  int64_t interval = -1;  // index into the intervals, or -1
  int32_t cross = -1;     // index into the rank's cross buffers, or -1
  int32_t block = -1;     // block buffers: index into the timeline's blocks
  int32_t buffer = -1;    // and into that layer's forward or backward buffers
  int64_t tag = -1;       // the caller's (e.g. the offset it placed the buffer at)
};

// A rank's memory program: the canonical order in which its buffers are
// allocated and freed, which the planner's placement (bounds.h) and the
// runtime's executor both follow, so that the same deterministic allocator
// reaches the same bytes. At each step: first the intervals that start
// there (in the order of `intervals`), then the rank's cross buffers that
// start there (PlanningProblem::cross order), then the block buffers that
// start there (blocks in step order, each block's buffers in list order) are
// allocated; the step's op runs; then every buffer whose last step it is is
// freed (the order of frees does not change a best-fit heap's state).
// O(log n) per buffer.
//
//   while (walk.Next()) {
//     for (auto& b : walk.allocations()) b.tag = Allocate(b.bytes);
//     ... run the step ...
//     for (const auto& b : walk.Frees()) Free(b.tag);
//   }
class ProgramWalker {
 public:
  // `mine`: the indices of the intervals that live on `rank`.
  ProgramWalker(const PlanningProblem& p, int32_t rank, const std::vector<Interval>& intervals,
                std::vector<size_t> mine);
  // Advances to the next step; false after the last one.
  bool Next();
  int64_t step() const { return step_; }
  // What starts at this step, in allocation order; the caller may set tags.
  std::vector<ProgramBuffer>& allocations() { return allocs_; }
  const std::vector<ProgramBuffer>& allocations() const { return allocs_; }
  // What ends at this step (tags as set), once per step after allocations().
  const std::vector<ProgramBuffer>& Frees();

 private:
  const PlanningProblem& p_;
  const RankTimeline& tl_;
  const std::vector<Interval>& ivs_;
  const std::vector<CrossBuffer>& cross_;
  std::vector<size_t> mine_;  // sorted by first step (stable)
  size_t next_interval_ = 0;
  size_t next_cross_ = 0;
  size_t next_block_ = 0;
  int64_t step_ = -1;
  int64_t seq_ = 0;
  // Block buffers waiting for their first step: a (step, sequence) min-heap.
  std::vector<std::pair<std::pair<int64_t, int64_t>, ProgramBuffer>> pending_;
  // Live buffers waiting for their last step: a (step, sequence, slot)
  // min-heap over a slab of buffers (slots are reused).
  struct Live {
    int64_t last, seq;
    int32_t slot;
    bool operator>(const Live& o) const { return last != o.last ? last > o.last : seq > o.seq; }
  };
  std::vector<Live> live_;
  std::vector<ProgramBuffer> slab_;
  std::vector<int32_t> free_slots_;
  std::vector<ProgramBuffer> allocs_, frees_;
};

}  // namespace memplan::planner

namespace memplan::planner {

// A buffer in model terms, as `check`, eager execution and viz name it
// (docs/runtime.md, "Eager execution"): `name` is the tensor (or, for a
// workspace, the op) and its microbatch, "layer3.mlp.fc1_out@mb1"; `part`
// what the buffer holds of it: "full", "fp8", "staging" (the payload until
// its copy-out is over), "fetched", "restored", "recompute", "landed",
// "value", "rebuilt", "grad", "grad_temp <op>", "workspace", "cache",
// "shared_grad", "cache_grad", "grad_inbox".
struct BufferLabel {
  std::string name, part;
};
BufferLabel InstancePartLabel(const PlanningProblem& p, int32_t owner_rank, int32_t instance, IntervalPart part);
BufferLabel BlockBufferLabel(const PlanningProblem& p, int32_t rank, int64_t block, BlockBuffer::Role role,
                             int32_t tensor, int32_t op);
BufferLabel CrossBufferLabel(const PlanningProblem& p, int32_t rank, int32_t index);

// One buffer of a rank's predicted memory program, in model terms.
struct PredictedBuffer {
  int64_t first = 0, last = 0, bytes = 0;  // the rank's steps, inclusive
  BufferLabel label;
  bool copy_timed = false;  // its end is a copy-out's completion (the time model's)
};
// Every buffer of `rank`'s memory program under the plan's intervals, in
// allocation order.
std::vector<PredictedBuffer> PredictedBuffers(const PlanningProblem& p, int32_t rank,
                                              const std::vector<Interval>& intervals);

namespace testing {
// Test-only: while set, InstanceIntervals extends the `part` interval of
// every instance of the saved tensor named `tensor` by `steps` (its last
// step), as a planner with a liveness bug would. Not a user setting.
void PerturbLiveness(const std::string& tensor, IntervalPart part, int64_t steps);
void ClearLivenessPerturbation();
// Test-only: while non-zero, the periodic placement (bounds.cc) moves the
// last step of every buffer from before a window's repeated period by this
// many steps, as an expansion with a wrong rule would.
void SkewPeriodicExpansion(int64_t steps);
// How many times the periodic placement has found its best-fit state
// recurring and jumped over the repeating copies (bounds.cc), in this process.
int64_t PeriodicJumps();
// Test-only: planner bugs the eager witness must catch (tests/
// eager_witness_test.cc), while set: the templates' routed rows times
// `routed_capacity`; the backward workspace of every op of kind
// `workspace_kind` times `workspace_factor` (0: left out of the plan); the
// ops of kind `spurious_read_kind` declaring that their backward reads
// their inputs (BackwardReads). Not a user setting.
struct PlannerMutation {
  double routed_capacity = 1.0;
  std::string workspace_kind;
  double workspace_factor = 1.0;
  std::string spurious_read_kind;
};
void SetPlannerMutation(const PlannerMutation& m);
void ClearPlannerMutation();
const PlannerMutation& ActivePlannerMutation();
}  // namespace testing

}  // namespace memplan::planner
