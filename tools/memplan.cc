// memplan: the command line. A thin main over the planner library: parse
// arguments, call one library entry point, turn its Error into a one-line
// message and an exit code (design.md, "Command line and exit codes").
#include <CLI/CLI.hpp>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <optional>
#include <string>

#include "memplan/common/json_util.h"
#include "memplan/common/status.h"
#include "memplan/common/table.h"
#include "memplan/common/units.h"
#include "memplan/planner/model.h"
#include "memplan/planner/plan.h"
#include "memplan/runtime/executor.h"
#include "memplan/traces/check.h"
#include "memplan/traces/measured.h"

namespace {

using memplan::Error;
using memplan::ErrorCode;

int Fail(const Error& e) {
  std::fprintf(stderr, "memplan: %s\n", e.message.c_str());
  return static_cast<int>(e.code);
}

int RunPlan(const std::string& model_path, const std::string& out_path, const std::string& budget_text,
            const std::string& solver, bool sweep, bool verify, bool quiet) {
  auto model = memplan::planner::LoadModel(model_path);
  if (!model) return Fail(model.error());
  memplan::planner::PlanOptions options;
  if (!budget_text.empty()) {
    auto bytes = memplan::ParseBytes(budget_text);
    if (!bytes) return Fail({ErrorCode::kBadInput, "--budget: " + bytes.error().message});
    options.budget = *bytes;
  }
  options.solver = solver == "exact" ? memplan::planner::SolverKind::kExact : memplan::planner::SolverKind::kHeuristic;
  options.sweep = sweep;
  options.verify = verify;
  if (std::getenv("MEMPLAN_TIMING")) {
    options.on_stage = [](std::string_view stage, double ms) {
      std::fprintf(stderr, "memplan: timing: %-13.*s %8.1f ms\n", static_cast<int>(stage.size()), stage.data(), ms);
    };
  }
  auto plan = memplan::planner::BuildPlan(*model, options);
  if (!plan) return Fail(plan.error());
  for (const auto& w : plan->warnings) std::fprintf(stderr, "memplan: warning: %s\n", w.c_str());
  if (verify && !plan->verify_errors.empty()) {
    for (const auto& e : plan->verify_errors) std::fprintf(stderr, "memplan: verify: %s\n", e.c_str());
    return Fail({ErrorCode::kRuntime, "the plan failed verification (" + std::to_string(plan->verify_errors.size()) +
                                          " errors); no plan written"});
  }
  if (!out_path.empty()) {
    auto written = memplan::WriteFileAtomic(out_path, memplan::planner::PlanToJson(*plan).dump(1) + "\n");
    if (!written) return Fail(written.error());
  }
  if (!quiet) std::fputs(memplan::planner::RenderPlanTable(*plan).c_str(), stdout);
  return 0;
}

int RunExpand(const std::string& model_path, const std::string& out_path) {
  auto model = memplan::planner::LoadModel(model_path);
  if (!model) return Fail(model.error());
  auto expanded = memplan::planner::ExpandedModelJson(*model);
  if (!expanded) return Fail(expanded.error());
  std::string text = expanded->dump(1) + "\n";
  if (out_path.empty()) {
    std::fputs(text.c_str(), stdout);
    return 0;
  }
  auto written = memplan::WriteFileAtomic(out_path, text);
  return written ? 0 : Fail(written.error());
}

// Exit 0 when every rank passes, 1 with the offending ranks otherwise.
int RunCheck(const std::string& plan_path, const std::string& measured_path, std::optional<double> tolerance) {
  auto plan_json = memplan::ReadJsonFile(plan_path);
  if (!plan_json) return Fail(plan_json.error());
  auto bounds = memplan::traces::ParsePlanBounds(*plan_json, plan_path);
  if (!bounds) return Fail(bounds.error());
  auto measured = memplan::traces::LoadMeasured(measured_path);
  if (!measured) return Fail(measured.error());
  auto result = memplan::traces::Check(*bounds, *measured, {tolerance, plan_path, measured_path});
  if (!result) return Fail(result.error());
  std::fputs(memplan::traces::RenderCheckTable(*result, !result->pass).c_str(), stdout);
  const std::string tol = memplan::FormatFixed(100 * result->tolerance, 2) + " %";
  if (!result->pass) {
    size_t failed = 0;
    for (const auto& r : result->ranks) failed += r.pass ? 0 : 1;
    return Fail({ErrorCode::kCheckFailed, "check failed: " + std::to_string(failed) + " of " +
                                              std::to_string(result->ranks.size()) +
                                              " ranks outside the plan's bounds (tolerance " + tol + ")"});
  }
  std::printf("check passed: %zu ranks within the plan's bounds (tolerance %s, %s backend)\n", result->ranks.size(),
              tol.c_str(), measured->backend.c_str());
  return 0;
}


// Executes one training step of PLAN.json; writes MEASURED.json and the
// trace; prints predicted against measured per rank.
int RunExecute(const std::string& plan_path, const std::string& backend, const std::string& out_path,
               const std::string& trace_path, const std::string& dump_dir, bool quiet) {
  auto plan_json = memplan::ReadJsonFile(plan_path);
  if (!plan_json) return Fail(plan_json.error());
  memplan::runtime::RunOptions options;
  options.backend = backend == "cuda" ? memplan::runtime::BackendKind::kCuda : memplan::runtime::BackendKind::kHost;
  options.plan_file = plan_path;
  options.trace = !trace_path.empty();
  options.dump_dir = dump_dir;
  if (!quiet) options.progress = [](std::string_view line) { std::fprintf(stderr, "%.*s\n", static_cast<int>(line.size()), line.data()); };
  auto result = memplan::runtime::RunPlan(*plan_json, options);
  if (!result) return Fail(result.error());
  const auto& m = result->measured;
  if (!out_path.empty()) {
    auto st = memplan::WriteFileAtomic(out_path, memplan::traces::MeasuredToJson(m).dump(2) + "\n");
    if (!st) return Fail(st.error());
  }
  if (!trace_path.empty()) {
    auto st = memplan::WriteFileAtomic(trace_path, result->trace.dump() + "\n");
    if (!st) return Fail(st.error());
  }
  if (quiet) return 0;
  memplan::Table t({"pp_rank", "static(MiB)", "lower_bd(MiB)", "alloc_peak(MiB)", "peak(MiB)", "meas_peak(MiB)",
                    "diff(%)"});
  const auto& ranks = (*plan_json)["ranks"];
  for (size_t r = 0; r < m.ranks.size(); ++r) {
    const auto& mr = m.ranks[r];
    int64_t lb = ranks[r].value("lower_bound", int64_t{0}), peak = ranks[r].value("peak", int64_t{0});
    double mib = 1024.0 * 1024.0;
    t.AddRow({std::to_string(mr.pp_rank), memplan::FormatFixed(static_cast<double>(mr.static_bytes) / mib, 3),
              memplan::FormatFixed(static_cast<double>(lb) / mib, 3),
              memplan::FormatFixed(static_cast<double>(mr.allocated_peak) / mib, 3),
              memplan::FormatFixed(static_cast<double>(peak) / mib, 3),
              memplan::FormatFixed(static_cast<double>(mr.peak) / mib, 3),
              memplan::FormatFixed(peak ? 100.0 * static_cast<double>(mr.peak - peak) / static_cast<double>(peak) : 0.0, 3)});
  }
  std::fputs(t.Render().c_str(), stdout);
  std::printf("\n%s backend (%s): step %s ms, loss %.6f, grad_norm %.6f\n", m.backend.c_str(), m.device.c_str(),
              memplan::FormatFixed(1000 * m.step_s, 2).c_str(), m.loss, m.grad_norm);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"memplan: plan, execute and verify the GPU memory of LLM training"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("memplan 0.1.0"));

  std::string model_path;
  std::string out_path;
  std::string budget;
  bool quiet = false;
  std::string solver = "heuristic";
  bool sweep = false;
  bool verify = false;
  auto* plan = app.add_subcommand("plan", "Plan memory for MODEL.json; print the per-rank table");
  plan->add_option("model", model_path, "model file (memplan.model/1)")->required();
  plan->add_option("-o,--output", out_path, "write PLAN.json (memplan.plan/1)");
  plan->add_option("--budget", budget, "device budget, e.g. 120GiB (overrides the model's)");
  plan->add_option("--solver", solver, "heuristic (default) or exact (MILP through CBC; small models)")
      ->check(CLI::IsMember({"heuristic", "exact"}));
  plan->add_flag("--sweep", sweep, "also print the budget / added step time trade-off curve");
  plan->add_flag("--verify", verify, "verify the plan (residency, placement, transfer windows)");
  plan->add_flag("-q,--quiet", quiet, "no table");

  std::string expand_model;
  std::string expand_out;
  auto* expand = app.add_subcommand("expand", "Print the model with every layer's graph expanded");
  expand->add_option("model", expand_model, "model file (memplan.model/1)")->required();
  expand->add_option("-o,--output", expand_out, "write to a file instead of stdout");

  std::string check_plan;
  std::string check_measured;
  double tolerance = 0;
  auto* check =
      app.add_subcommand("check", "Compare MEASURED.json with PLAN.json; exit 1 when a rank is out of bounds");
  check->add_option("plan", check_plan, "plan file (memplan.plan/1)")->required();
  check->add_option("measured", check_measured, "measurement (memplan.measured/1)")->required();
  auto* tolerance_opt = check->add_option("--tolerance", tolerance,
                                          "relative tolerance (default 0 for host, 0.02 for cuda measurements)")
                            ->check(CLI::Range(0.0, 1.0));

  std::string run_plan, run_backend = "host", run_out, run_trace, run_dump;
  bool run_quiet = false;
  auto* run = app.add_subcommand("run", "Execute one training step of PLAN.json and measure its memory");
  run->add_option("plan", run_plan, "plan file (memplan.plan/1)")->required();
  run->add_option("--backend", run_backend, "host (default: CPU reference kernels) or cuda")
      ->check(CLI::IsMember({"host", "cuda"}));
  run->add_option("-o,--output", run_out, "write MEASURED.json (memplan.measured/1)");
  run->add_option("--trace", run_trace, "write a Chrome trace (chrome://tracing, Perfetto)");
  run->add_option("--dump", run_dump, "write initial weights, batch and gradients as .npy files into DIR");
  run->add_flag("-q,--quiet", run_quiet, "no table, no progress");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help, --version
    std::fprintf(stderr, "memplan: %s (see memplan --help)\n", e.what());
    return static_cast<int>(ErrorCode::kBadInput);
  }
  // Libraries return errors; anything thrown past them is a bug, reported
  // in one line rather than as a crash.
  try {
    if (plan->parsed()) return RunPlan(model_path, out_path, budget, solver, sweep, verify, quiet);
    if (expand->parsed()) return RunExpand(expand_model, expand_out);
    if (run->parsed()) return RunExecute(run_plan, run_backend, run_out, run_trace, run_dump, run_quiet);
    if (check->parsed()) {
      return RunCheck(check_plan, check_measured, tolerance_opt->count() ? std::optional(tolerance) : std::nullopt);
    }
  } catch (const std::exception& e) {
    return Fail({ErrorCode::kRuntime, std::string("internal error: ") + e.what()});
  }
  return static_cast<int>(ErrorCode::kBadInput);
}
