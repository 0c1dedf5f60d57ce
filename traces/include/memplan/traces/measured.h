// MEASURED.json (`memplan.measured/1`, schemas/measured.schema.json): what
// `memplan run` measured while executing one step of a plan.
//
// Glossary: allocated_peak is the maximum of live allocated bytes (compare
// with the plan's lower_bound); peak is the allocator's high-water mark, the
// host arena's offset + size or the CUDA pool's reserved high-water (compare
// with the plan's peak).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "memplan/common/json_util.h"
#include "memplan/common/status.h"

namespace memplan::traces {

inline constexpr std::string_view kMeasuredSchema = "memplan.measured/1";

// One sample of the allocated-bytes timeline.
struct TimelinePoint {
  double t_us = 0;  // microseconds from the start of the step, >= 0
  int64_t allocated_bytes = 0;
};

// CUPTI's view of one rank's device memory: MEMORY2 / MEMORY_POOL records
// attributed to the rank by address (footprint.h). In arena mode the rank's
// arenas are its only device allocations, so allocated_peak == the rank's
// `peak`; in pool mode reserved_peak is what the driver set aside.
// One allocation or release as CUPTI recorded it (profiles only).
struct AllocationEvent {
  double t_us = 0;
  bool release = false;      // JSON "op": "alloc" | "free"
  uint64_t address = 0;      // JSON "0x..." (addresses exceed JSON's exact integers)
  int64_t bytes = 0;
  int64_t stream = -1;       // CUPTI stream id; -1: not stream-ordered
  std::string kind;          // "device", "managed", "pinned", ...
  uint64_t pool = 0;         // the pool's address; 0: not from a pool
};

// A pool created, trimmed or destroyed (profiles only).
struct PoolEvent {
  double t_us = 0;
  std::string op;            // "created" | "trimmed" | "destroyed"
  uint64_t address = 0;
  int64_t bytes = 0;         // the pool's size after the event
};

struct CuptiRankBytes {
  int64_t allocated_peak = 0;  // bytes of live device allocations, maximum
  int64_t reserved_peak = 0;   // plus pool reservations, maximum
  std::vector<TimelinePoint> timeline;  // [t_us, allocated_bytes], t_us non-decreasing
  std::vector<AllocationEvent> allocations;  // profiles: every record, in time order (JSON: omitted when empty)
  std::vector<PoolEvent> pools;              // profiles: pool events, in time order (JSON: omitted when empty)
};

// A stream-ordered pool's own marks (allocator "pool"): what it reserved
// from the driver and what its allocations used; the difference at the
// peak is the fragmentation the driver added.
// Eager execution (docs/runtime.md, "Eager execution"): one allocation or
// free of a rank's activation memory, at the rank's step (op) where it
// happened, in model terms (planner::BufferLabel). JSON: [step, bytes,
// "name", "part"], bytes < 0 for a free.
struct StepAllocation {
  int64_t step = 0;
  int64_t bytes = 0;
  std::string name, part;
  // A free: the bytes the kernels wrote (the eager witness's canary;
  // JSON: the entry's optional fifth element); -1 when not measured.
  int64_t touched = -1;
};

struct PoolMarks {
  int64_t reserved_peak = 0;  // bytes
  int64_t used_peak = 0;      // bytes
};

// MoE routing the run saw on one rank (forward passes, every MoE layer and
// microbatch): the skew the plan assumed (arch.moe.imbalance) against it.
struct MoeRoutingSeen {
  double max_expert_load = 0;  // max over layers, microbatches, experts of rows / mean rows per expert
  double max_rank_load = 0;    // expert parallelism: rows this rank received / its mean share (1 when ep = 1)
  double planned_rank_load = 0;  // the rows its buffers hold / its mean share (arch.moe RoutedRowsFactor)
  int64_t dropped_rows = 0;      // routed rows past the planned rows
};

struct MeasuredRank {
  int64_t pp_rank = 0;
  int64_t allocated_peak = 0;  // bytes
  int64_t peak = 0;            // bytes
  int64_t static_bytes = 0;    // JSON key "static"
  std::vector<TimelinePoint> timeline;  // t_us non-decreasing
  std::map<std::string, int64_t> events;  // name -> count
  std::optional<CuptiRankBytes> cupti;    // when CUPTI was collected
  std::optional<PoolMarks> pool;          // allocator "pool" (and eager on cuda)
  int64_t dp_rank = 0;  // data-parallel replica (JSON: optional, 0 when absent)
  int64_t ep_rank = 0;  // its place in its EP group, dp_rank % ep (JSON: optional, 0 when absent)
  // Allocator "eager": every allocation and free in order (JSON
  // "allocation_timeline"; omitted when empty).
  std::vector<StepAllocation> allocation_timeline;
  std::optional<MoeRoutingSeen> moe_routing;  // models with MoE layers on this rank (JSON "moe_routing")
  int64_t tp_rank = 0;  // tensor-parallel rank (JSON: optional, 0 when absent)
  int64_t cp_rank = 0;  // context-parallel rank (JSON: optional, 0 when absent)
};

// One optimizer step of a multi-step run (memplan run --steps N), one rank:
// the step's own largest live bytes (static + activations) and the
// allocator's extent so far; with eager execution, how many activation
// buffers it allocated and their bytes.
struct MeasuredStepRank {
  int64_t pp_rank = 0;
  int64_t dp_rank = 0;
  int64_t allocated_peak = 0;  // bytes, this step
  int64_t peak = 0;            // bytes, the run so far
  int64_t allocations = 0;     // eager: allocations this step (0 otherwise)
  int64_t allocated_bytes = 0;  // eager: their bytes
  int64_t tp_rank = 0;
  int64_t cp_rank = 0;
};
struct MeasuredStep {
  int64_t step = 1;  // from 1
  double loss = 0;
  double grad_norm = 0;
  double step_s = 0;
  std::vector<MeasuredStepRank> ranks;
};

// Device bytes of the whole process (CUPTI and cudaMemGetInfo): everything
// the ranks hold, plus what lies outside any plan.
struct MeasuredProcess {
  int64_t device_bytes_peak = 0;  // every device allocation CUPTI saw, maximum
  int64_t context_bytes = 0;      // cudaMemGetInfo used bytes before the first allocation
  int64_t profiler_bytes = 0;     // CUPTI's own device bytes
};

struct Measured {
  std::string backend = "host";  // "host" | "cuda"
  // Where the numbers come from: "runtime" (memplan run) or
  // "cupti-injection" (memplan profile of another program).
  std::string source = "runtime";
  // "arena" (one block per rank at the planner's offsets: a feasibility
  // check, exact by construction), "pool" (a stream-ordered pool following
  // the planner's program) or "eager" (each buffer allocated at its first
  // use and freed after its last, from a general-purpose allocator: a
  // measurement independent of the planner's liveness); empty in files
  // written before the field existed, which means what those runs used:
  // see AllocatorOf. JSON also says "measurement": "feasibility" (arena,
  // pool: the plan's own program replayed) or "independent" (eager).
  std::string allocator;
  std::string device;
  std::string plan_digest;  // "sha256:<64 hex>"
  double step_s = 0;
  // The forwards and backwards alone (no optimizer, no dumps); 0: not
  // measured (older files, `memplan profile`).
  double compute_s = 0;
  double loss = 0;
  double grad_norm = 0;
  std::vector<MeasuredRank> ranks;  // (pp_rank, dp_rank, cp_rank, tp_rank) unique
  std::optional<MeasuredProcess> process;
  // cuda runs: "collected", "off" (--no-cupti) or "unavailable" (CUPTI did
  // not start, or dropped records); empty on the host and in older files.
  // `check` fails an "unavailable" run: the measurement lacks its witness.
  std::string cupti_status;
  // memplan run --steps N > 1: every step in order (JSON "steps"; absent
  // for one step). The document's loss, grad_norm, events and allocation
  // timeline are then the last step's; peaks and timelines the whole run's.
  std::vector<MeasuredStep> steps;
};

// The measurement's allocator: `allocator`, or where it is empty "arena"
// on host and "pool" on cuda.
std::string AllocatorOf(const Measured& measured);

// Parses and validates a MEASURED.json document. Unknown keys, missing keys,
// out-of-range values, a timeline going back in time and duplicate pp ranks
// are kBadInput errors, one line: "FILE: /ranks/0/peak: expected ...".
Expected<Measured> ParseMeasured(const Json& json, const std::string& file);

// ReadJsonFile + ParseMeasured.
Expected<Measured> LoadMeasured(const std::string& path);

// The inverse of ParseMeasured: ParseMeasured(MeasuredToJson(m)) == m.
OrderedJson MeasuredToJson(const Measured& measured);

}  // namespace memplan::traces
