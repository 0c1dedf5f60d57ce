// Helpers the verbs share (commands.cc, search_command.cc): one-line
// errors with their exit code, file-located messages, outputs checked
// before work and staged all-or-nothing.
#pragma once

#include <string>
#include <vector>

#include "cli.h"
#include "memplan/common/json_util.h"
#include "memplan/common/output.h"
#include "memplan/common/status.h"
#include "memplan/planner/model.h"
#include "memplan/runtime/comm.h"

namespace memplan::cli {

// Prints "memplan: MESSAGE" on stderr; returns the error's exit code.
int Fail(const Error& e);
// An error every process of an mpirun launch agreed on (null `comm`: one
// process, Fail): rank 0 says it, and every rank waits at a barrier until
// it has, so that a launcher that ends the job at the first non-zero exit
// (mpirun with odls_base_sigkill_timeout 0, srun --kill-on-bad-exit)
// cannot cut the line. Call it only where every rank just agreed: each
// must reach the barrier. Returns the error's exit code.
int FailAgreed(runtime::Communicator* comm, const Error& e);
// --budget SIZE; warns on stderr when a bare number is below a MiB (meant
// in GiB, surely).
Expected<int64_t> ParseBudget(const std::string& text);

// Every bad-input message names the file and a JSON pointer: a library
// error raised where no location was known (a total overflowing deep in
// the accounting, say) is attributed to the whole input file.
Error Located(Error e, const std::string& file);

// Every output of a command, checked before the command works
// (OutputFiles::CheckAll: writable, no two the same file); none may be the
// command's input.
Expected<bool> CheckOutputs(std::vector<std::string> files, const std::string& input,
                            std::vector<std::string> directories = {});

// Stages `doc` as `path`; a number JSON cannot spell (NaN, infinity) is a
// bug upstream and fails the command rather than being written as null.
template <class J>
Expected<bool> StageJson(OutputFiles& out, const std::string& path, const J& doc, int indent) {
  if (auto at = FindNonFinite(doc)) {
    return Error{ErrorCode::kRuntime, "internal error: " + path + ": " + *at +
                                          ": a non-finite number would be written; no output written"};
  }
  return out.Stage(path, doc.dump(indent) + "\n");
}

// --target, --headroom and --expandable-segments applied to `model`
// (plan, search, export): the target's mechanisms (planner/target.h); the
// headroom a size or a percentage of the device's memory. --storage and
// --host-memory (plan, search) too: they become the model's `storage` and
// `hardware.host_memory`, so PLAN.json's model records them and a replay
// (run, check, export) plans the same.
Expected<bool> ApplyModelOptions(const Command& c, planner::Model* model);

// `memplan search` (search_command.cc).
int RunSearch(const Command& c);

// `memplan import` (import_command.cc).
int RunImport(const Command& c);
int RunExport(const Command& c);

}  // namespace memplan::cli
