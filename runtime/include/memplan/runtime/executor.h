// The executor: runs one training step of a planned model exactly as its
// PLAN.json says, and measures it.
//
// What it does
//   - Rebuilds the planner's problem from the plan's embedded model (the
//     same templates, schedule and intervals; the plan's digest and per-rank
//     bytes are checked against the rebuilt ones), and binds every saved
//     tensor to the storage the plan chose (`tensors[].effective`).
//   - Emulates the pipeline ranks in one process, one device (memory pool
//     and copy engines) per rank, and runs every rank's steps in the
//     pipeline order of the plan's schedule (Megatron 1F1B / interleaved
//     1F1B). Activations and their gradients cross ranks through a mailbox
//     outside the pools, as a network link would carry them. With a
//     communicator (RunOptions::comm: launched by mpirun) this process runs
//     one rank of the tp x cp x dp x pp grid and the messages go through it.
//   - Interprets the layer graph op by op (`kernels::Ops`: CPU references on
//     the host backend, CUDA kernels and cuBLAS on the cuda backend). Every
//     buffer a step uses is allocated and freed at the steps of the plan's
//     memory program (planner::ProgramWalker): saved instances by their
//     intervals (quantized to FP8 after their producer, copied out to the
//     host or another rank, prefetched one layer ahead, re-computed at their
//     layer's backward), the rest as block buffers. A free waits for the
//     copies that touch it.
//   - Computes the mean cross-entropy over the step's microbatches, the
//     global gradient norm, and takes one AdamW step.
//
// The model code never names a policy: op handlers ask for tensors by name
// and the storage bound by the plan decides where their bytes are.
//
// Limits (refused with ErrorCode::kBadInput and a reason): dp, ep, tp or
// cp > 1 without a communicator; the few tensor/context-parallel
// combinations docs/runtime.md lists; ZeRO-2's reduce bucket too small for a
// layer; fp16 and 16-bit gradients; bf16 on the cuda backend; MLA without
// flash attention; Block AttnRes without checkpointing (docs/runtime.md,
// "Limits"). A plan that is malformed, whose storages are illegal, or whose
// bytes differ from this planner's is refused too.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "memplan/common/json_util.h"
#include "memplan/common/status.h"
#include "memplan/traces/measured.h"

namespace memplan::runtime {

class Communicator;  // comm.h
struct EagerKey;     // activation.h

enum class BackendKind { kHost, kCuda };
std::string_view BackendName(BackendKind kind);  // "host", "cuda"

struct RunOptions {
  BackendKind backend = BackendKind::kHost;
  // cuda: each rank's memory is one block of exactly the plan's bytes with
  // buffers at the planner's offsets (arena, exact), or a stream-ordered
  // pool (framework-like). The host backend is always an arena.
  bool cuda_pool = false;
  // Eager execution (docs/runtime.md, "Eager execution"): every buffer
  // allocated at its first use and freed after its last, by the runtime's
  // own record of the step, from a general-purpose allocator (host: the
  // system allocator; cuda: the stream-ordered pool). The plan supplies
  // decisions only; MEASURED.json gets the allocation timeline, which
  // `check` compares with the plan step by step.
  bool eager = false;
  // Internal to eager execution: the record pass's log (RunPlan runs the
  // record pass first when eager is set and this is null).
  const std::vector<std::map<EagerKey, int64_t>>* eager_last_access = nullptr;
  bool eager_record_only = false;
  // cuda: collect CUPTI's memory records (MEASURED.json's per-rank `cupti`
  // and `process`); a CUPTI that cannot start is a warning.
  bool cupti = true;
  std::string plan_file = "PLAN.json";  // named in error messages
  // Seed of the initial weights, the batch and the dropout masks.
  uint64_t seed = 1234;
  // Optimizer steps, each on fresh microbatches (docs/runtime.md,
  // "Several steps"); MEASURED.json's `steps` lists them when > 1.
  int64_t steps = 1;
  // Build the Chrome trace (RunResult::trace).
  bool trace = false;
  // When not empty: write the initial weights, the batch and every
  // parameter's gradient there as .npy files (docs/runtime.md).
  std::string dump_dir;
  // Progress lines for a person (e.g. to stderr); may be empty.
  std::function<void(std::string_view line)> progress;
  // Host backend, tests: each copy first sleeps a pseudo-random 0..N us.
  int64_t copy_jitter_us = 0;
  // One process per rank (docs/runtime.md, "One process per rank"): this
  // process runs rank comm->rank() of the plan's grid, and messages and
  // collectives go through `comm` (not owned). Failures found before any
  // rank executes are agreed: every rank returns the same Error. A rank
  // that fails later says so on stderr ("memplan: rank N: ...") and ends
  // every process (Communicator::Abort). The measurement of every rank is
  // gathered on rank 0 (RunResult on other ranks: their own rank only).
  // Null: every rank emulated in this process.
  Communicator* comm = nullptr;
  // Set to true when RunPlan's error is such an agreed one (every rank
  // returns it, before any work): the caller may then have the ranks wait
  // for rank 0 to report it before they exit.
  bool* agreed_error = nullptr;
  // Tests: may edit a parameter's initial values (e.g. to take finite
  // differences), called once per parameter, in rank order.
  std::function<void(const std::string& param, std::vector<float>* values)> init_hook;
};

struct RunResult {
  traces::Measured measured;  // memplan.measured/1
  OrderedJson trace;          // Chrome Trace Event document (options.trace)
  std::vector<std::string> warnings;  // one line each (e.g. CUPTI could not start)
};

// Executes one training step of `plan` (a parsed PLAN.json).
// Errors: kBadInput for a plan this runtime cannot execute or that does not
// match this planner; kRuntime for device failures (exhausted memory...).
Expected<RunResult> RunPlan(const Json& plan, const RunOptions& options);

// What RunPlan checks before it executes anything: the plan against its
// schema, the embedded model, the digest, what this runtime can execute,
// and that this planner rebuilds the same bytes. Errors as RunPlan's.
Expected<std::monostate> ValidatePlan(const Json& plan, const std::string& plan_file);

}  // namespace memplan::runtime
