// The memplan verbs: each a thin call into a library, its Error turned into
// a one-line message and an exit code (docs/design.md, "Command line and
// exit codes"). Outputs are written all or nothing (common/output.h): every
// output path is checked before any work, and nothing is written unless
// the whole command succeeds.
#include <cstdio>
#include <cstdlib>
#include <string>

#include "cli.h"
#include "memplan/common/json_util.h"
#include "memplan/common/output.h"
#include "memplan/common/table.h"
#include "memplan/common/units.h"
#include "memplan/planner/model.h"
#include "memplan/planner/plan.h"
#include "memplan/runtime/executor.h"
#include "memplan/traces/check.h"
#include "memplan/traces/measured.h"

namespace memplan::cli {
namespace {

int Fail(const Error& e) {
  std::fprintf(stderr, "memplan: %s\n", OneLine(e.message).c_str());
  return static_cast<int>(e.code);
}

// Every bad-input message names the file and a JSON pointer: a library
// error raised where no location was known (a total overflowing deep in
// the accounting, say) is attributed to the whole input file.
Error Located(Error e, const std::string& file) {
  if (e.code == ErrorCode::kBadInput && e.message.rfind(file + ": ", 0) != 0 &&
      e.message.rfind(file + " /", 0) != 0) {
    e.message = file + ": /: " + e.message;
  }
  return e;
}

// Every output path of a command, checked before the command works.
Expected<bool> CheckOutputs(std::initializer_list<const std::string*> paths) {
  for (const std::string* p : paths) {
    if (p->empty()) continue;
    if (auto ok = OutputFiles::CheckWritable(*p); !ok) return ok.error();
  }
  return true;
}

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

int RunPlan(const Command& c) {
  if (auto ok = CheckOutputs({&c.output}); !ok) return Fail(ok.error());
  auto model = planner::LoadModel(c.input);
  if (!model) return Fail(Located(model.error(), c.input));
  planner::PlanOptions options;
  if (!c.budget.empty()) {
    auto bytes = ParseBytes(c.budget);
    if (!bytes) return Fail({ErrorCode::kBadInput, "--budget: " + bytes.error().message});
    options.budget = *bytes;
  }
  options.solver = c.solver == "exact" ? planner::SolverKind::kExact : planner::SolverKind::kHeuristic;
  options.sweep = c.sweep;
  options.verify = c.verify;
  if (std::getenv("MEMPLAN_TIMING")) {
    options.on_stage = [](std::string_view stage, double ms) {
      std::fprintf(stderr, "memplan: timing: %-13.*s %8.1f ms\n", static_cast<int>(stage.size()), stage.data(), ms);
    };
  }
  auto plan = planner::BuildPlan(*model, options);
  if (!plan) return Fail(plan.error().code == ErrorCode::kBadInput ? Located(plan.error(), c.input) : plan.error());
  for (const auto& w : plan->warnings) std::fprintf(stderr, "memplan: warning: %s\n", w.c_str());
  if (c.verify && !plan->verify_errors.empty()) {
    for (const auto& e : plan->verify_errors) std::fprintf(stderr, "memplan: verify: %s\n", e.c_str());
    return Fail({ErrorCode::kRuntime, "the plan failed verification (" + std::to_string(plan->verify_errors.size()) +
                                          " errors); no plan written"});
  }
  if (!c.output.empty()) {
    OutputFiles out;
    if (auto st = StageJson(out, c.output, planner::PlanToJson(*plan), 1); !st) return Fail(st.error());
    if (auto st = out.Commit(); !st) return Fail(st.error());
  }
  if (!c.quiet) std::fputs(planner::RenderPlanTable(*plan).c_str(), stdout);
  return 0;
}

int RunExpand(const Command& c) {
  if (auto ok = CheckOutputs({&c.output}); !ok) return Fail(ok.error());
  auto model = planner::LoadModel(c.input);
  if (!model) return Fail(Located(model.error(), c.input));
  auto expanded = planner::ExpandedModelJson(*model);
  if (!expanded) return Fail(Located(expanded.error(), c.input));
  if (c.output.empty()) {
    if (auto at = FindNonFinite(*expanded)) return Fail({ErrorCode::kRuntime, "internal error: non-finite " + *at});
    std::fputs((expanded->dump(1) + "\n").c_str(), stdout);
    return 0;
  }
  OutputFiles out;
  if (auto st = StageJson(out, c.output, *expanded, 1); !st) return Fail(st.error());
  if (auto st = out.Commit(); !st) return Fail(st.error());
  return 0;
}

// Exit 0 when every rank passes, 1 with the offending ranks otherwise.
int RunCheck(const Command& c) {
  auto plan_json = ReadJsonFile(c.input);
  if (!plan_json) return Fail(plan_json.error());
  auto bounds = traces::ParsePlanBounds(*plan_json, c.input);
  if (!bounds) return Fail(bounds.error());
  auto measured = traces::LoadMeasured(c.measured);
  if (!measured) return Fail(measured.error());
  auto result = traces::Check(*bounds, *measured, {c.tolerance, c.input, c.measured});
  if (!result) return Fail(result.error());
  std::fputs(traces::RenderCheckTable(*result, !result->pass).c_str(), stdout);
  const std::string tol = FormatFixed(100 * result->tolerance, 2) + " %";
  if (!result->pass) {
    size_t failed = 0;
    for (const auto& r : result->ranks) failed += r.pass ? 0 : 1;
    return Fail({ErrorCode::kCheckFailed, "check failed: " + std::to_string(failed) + " of " +
                                              std::to_string(result->ranks.size()) +
                                              " ranks outside the plan's bounds (tolerance " + tol + ")"});
  }
  std::printf("check passed: %zu ranks within the plan's bounds (tolerance %s, %s backend, %s allocator, %s)\n",
              result->ranks.size(), tol.c_str(), measured->backend.c_str(), result->allocator.c_str(),
              result->source.c_str());
  return 0;
}

void PrintRunTable(const Json& plan_json, const traces::Measured& m) {
  Table t({"pp_rank", "static(MiB)", "lower_bd(MiB)", "alloc_peak(MiB)", "peak(MiB)", "meas_peak(MiB)", "diff(%)"});
  const auto& ranks = plan_json["ranks"];
  const double mib = 1024.0 * 1024.0;
  for (size_t r = 0; r < m.ranks.size(); ++r) {
    const auto& mr = m.ranks[r];
    int64_t lb = ranks[r].value("lower_bound", int64_t{0}), peak = ranks[r].value("peak", int64_t{0});
    t.AddRow({std::to_string(mr.pp_rank), FormatFixed(static_cast<double>(mr.static_bytes) / mib, 3),
              FormatFixed(static_cast<double>(lb) / mib, 3), FormatFixed(static_cast<double>(mr.allocated_peak) / mib, 3),
              FormatFixed(static_cast<double>(peak) / mib, 3), FormatFixed(static_cast<double>(mr.peak) / mib, 3),
              FormatFixed(peak ? 100.0 * static_cast<double>(mr.peak - peak) / static_cast<double>(peak) : 0.0, 3)});
  }
  std::fputs(t.Render().c_str(), stdout);
  std::printf("\n%s backend (%s): step %s ms, loss %.6f, grad_norm %.6f\n", m.backend.c_str(), m.device.c_str(),
              FormatFixed(1000 * m.step_s, 2).c_str(), m.loss, m.grad_norm);
}

// Executes one training step of PLAN.json; writes MEASURED.json, the trace
// and the dump together, or none of them.
int RunExecute(const Command& c) {
  if (c.backend == "host" && c.allocator == "pool") {
    return Fail({ErrorCode::kBadInput, "--allocator pool: the host backend is always an arena (pools are cuda's)"});
  }
  if (auto ok = CheckOutputs({&c.output, &c.trace}); !ok) return Fail(ok.error());
  auto plan_json = ReadJsonFile(c.input);
  if (!plan_json) return Fail(plan_json.error());
  OutputFiles out;
  runtime::RunOptions options;
  options.backend = c.backend == "cuda" ? runtime::BackendKind::kCuda : runtime::BackendKind::kHost;
  options.cuda_pool = c.allocator == "pool";
  options.cupti = !c.no_cupti;
  options.plan_file = c.input;
  options.trace = !c.trace.empty();
  if (!c.dump.empty()) {
    auto staged = out.StageDirectory(c.dump);
    if (!staged) return Fail(staged.error());
    options.dump_dir = *staged;
  }
  if (!c.quiet) {
    options.progress = [](std::string_view line) {
      std::fprintf(stderr, "%.*s\n", static_cast<int>(line.size()), line.data());
    };
  }
  auto result = runtime::RunPlan(*plan_json, options);
  if (!result) return Fail(Located(result.error(), c.input));
  for (const auto& w : result->warnings) std::fprintf(stderr, "memplan: warning: %s\n", OneLine(w).c_str());
  const auto& m = result->measured;
  if (!c.output.empty()) {
    if (auto st = StageJson(out, c.output, traces::MeasuredToJson(m), 2); !st) return Fail(st.error());
  }
  if (!c.trace.empty()) {
    if (auto st = StageJson(out, c.trace, result->trace, -1); !st) return Fail(st.error());
  }
  if (auto st = out.Commit(); !st) return Fail(st.error());
  if (!c.quiet) PrintRunTable(*plan_json, m);
  return 0;
}

}  // namespace

int RunCommand(const Command& c) {
  // Libraries return errors; anything thrown past them is a bug, reported
  // in one line rather than as a crash.
  try {
    switch (c.verb) {
      case Verb::kPrint:
        std::fputs(c.text.c_str(), stdout);
        return 0;
      case Verb::kPlan: return RunPlan(c);
      case Verb::kExpand: return RunExpand(c);
      case Verb::kRun: return RunExecute(c);
      case Verb::kCheck: return RunCheck(c);
    }
  } catch (const std::bad_alloc&) {
    return Fail({ErrorCode::kRuntime, "out of host memory"});
  } catch (const std::exception& e) {
    return Fail({ErrorCode::kRuntime, std::string("internal error: ") + e.what()});
  }
  return static_cast<int>(ErrorCode::kBadInput);
}

}  // namespace memplan::cli
