// The memplan command line, as data: ParseCommandLine turns argv into one
// Command (or a usage error), RunCommand executes it. Parsing does no I/O,
// so the argument parser can be fuzzed on its own (tests/fuzz).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "memplan/common/status.h"

namespace memplan::cli {

enum class Verb { kPlan, kExpand, kRun, kCheck, kProfile, kCalibrate, kViz, kSearch, kImport, kExport, kPrint };

struct Command {
  Verb verb = Verb::kPrint;
  std::string text;  // kPrint: --help or --version output for stdout

  // plan / expand / run / check inputs and outputs.
  std::string input;       // MODEL.json (plan, expand) or PLAN.json (run, check)
  std::string measured;    // check: MEASURED.json
  std::string output;      // -o
  bool quiet = false;

  // plan
  std::string budget;  // --budget, validated by RunCommand (a size)
  // plan, search, export: --target memplan|megatron ("" keeps the model's),
  // --headroom SIZE or PCT of device memory, and the caching allocator's
  // --expandable-segments (target megatron).
  std::string target;
  std::string headroom;
  bool expandable_segments = false;
  // plan, search: --storage (allowed kinds, planner::ParseStorageKinds) and
  // --host-memory SIZE; "" keeps the model's.
  std::string storage;
  std::string host_memory;
  std::string solver = "heuristic";
  int threads = 0;  // --threads (0: the default, common/parallel.h)
  bool sweep = false;
  bool verify = false;
  bool full_simulation = false;

  // search (and --budget, --threads, -o, -q above)
  int64_t gpus = 0;
  int64_t global_batch = 0;          // 0: the model's
  std::vector<std::string> space;    // "key=v1,v2" each
  int top = 10;
  std::string best_model;            // --best-model
  bool exhaustive = false;           // --exhaustive

  // import: "hf" or "megatron" (input: CONFIG.json or ARGS.txt; --gpus,
  // --global-batch above); the layout of an hf import
  std::string import_kind;
  int64_t seq = 0;
  int64_t micro_batch = 1;
  int64_t tp = 1, pp = 1, vp = 1, ep = 1, cp = 1;
  bool sp = false;
  int zero = 1;
  std::string optimizer = "adam";
  std::string hardware = "h100";
  bool no_mtp = false;
  bool as_written = false;  // import megatron
  std::string name;

  // run, calibrate
  std::string backend = "host";
  std::string allocator = "arena";  // cuda: arena (exact) or pool
  bool no_cupti = false;            // cuda: do not collect CUPTI records
  std::string trace;
  std::string dump;
  int64_t steps = 1;  // run: optimizer steps

  // check
  std::optional<double> tolerance;
  bool ranks_from_devices = false;  // --ranks-from devices

  // viz: MEASURED.json (measured) and TRACE.json (trace) are optional
  bool force = false;  // draw a measurement of another plan, with a warning banner

  // profile: the program and its arguments (after --)
  std::vector<std::string> child;
};

// Errors: kBadInput with CLI11's message ("... (see memplan --help)").
Expected<Command> ParseCommandLine(const std::vector<std::string>& args);

// Under mpirun every process of one launch must take the same `run`
// options (they decide which collectives follow, and what is written).
// LaunchOptions is a `run` command's options as "name=value" lines (the
// plan's path excepted: the ranks compare what it decides; -q is rank 0's
// alone); each process gathers every rank's. LaunchMismatch names the first
// rank and option that differ from rank 0's, in one line, or nullopt when
// all agree. Lines from another memplan (garbage included) are a mismatch,
// never an exception.
std::string LaunchOptions(const Command& command);
// A `search` command's: the model's digest (after --target options) and
// every option that changes which layouts exist or how they rank (the
// processes split the layouts by index and rank 0 merges their verdicts).
std::string SearchLaunchOptions(const Command& command, const std::string& model_digest);
std::optional<std::string> LaunchMismatch(const std::vector<std::string>& gathered);

// Executes `command`; returns the process exit status (design: 0 success,
// 1 check failed, 2 bad input, 3 infeasible, 4 digest mismatch, 5 runtime;
// `profile` returns its program's status) after printing any error as one
// line on stderr.
int RunCommand(const Command& command);

}  // namespace memplan::cli
