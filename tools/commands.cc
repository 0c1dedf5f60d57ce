// The memplan verbs: each a thin call into a library, its Error turned into
// a one-line message and an exit code (docs/design.md, "Command line and
// exit codes"). Outputs are written all or nothing (common/output.h): every
// output path is checked before any work, and nothing is written unless
// the whole command succeeds.
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>

#include "cli.h"
#include "command_util.h"
#include "memplan/common/cleanup.h"
#include "memplan/common/json_util.h"
#include "memplan/common/output.h"
#include "memplan/common/parallel.h"
#include "memplan/common/table.h"
#include "memplan/common/units.h"
#include "memplan/planner/model.h"
#include "memplan/planner/assumptions.h"
#include "memplan/planner/plan.h"
#include "memplan/planner/target.h"
#include "memplan/runtime/calibrate.h"
#include "memplan/runtime/comm.h"
#include "memplan/runtime/executor.h"
#include "memplan/viz/report.h"
#include "memplan/planner/replay.h"
#include "memplan/traces/check.h"
#include "memplan/traces/timeline_compare.h"
#include "memplan/traces/measured.h"

namespace memplan::cli {

int Fail(const Error& e) {
  std::fprintf(stderr, "memplan: %s\n", OneLine(e.message).c_str());
  return static_cast<int>(e.code);
}

int FailAgreed(runtime::Communicator* comm, const Error& e) {
  if (comm == nullptr) return Fail(e);
  const int code = comm->rank() == 0 ? Fail(e) : static_cast<int>(e.code);
  comm->Barrier();
  return code;
}

Expected<int64_t> ParseBudget(const std::string& text) {
  auto bytes = ParseBytes(text);
  if (!bytes) return Error{ErrorCode::kBadInput, "--budget: " + bytes.error().message};
  // A bare number is bytes; below a MiB it is almost surely meant in GiB.
  const bool bare = !text.empty() && std::all_of(text.begin(), text.end(), [](char ch) { return ch >= '0' && ch <= '9'; });
  if (bare && *bytes < (int64_t{1} << 20)) {
    std::fprintf(stderr, "memplan: warning: --budget %s is %s bytes (a number without a unit is bytes; for gibibytes "
                 "write %sGiB)\n", text.c_str(), text.c_str(), text.c_str());
  }
  return bytes;
}

Error Located(Error e, const std::string& file) {
  if (e.code == ErrorCode::kBadInput && e.message.rfind(file + ": ", 0) != 0 &&
      e.message.rfind(file + " /", 0) != 0 && e.message.rfind("rank ", 0) != 0) {  // rank N: another rank's
    e.message = file + ": /: " + e.message;
  }
  return e;
}

static bool SameFile(const std::string& a, const std::string& b) {
  struct stat sa {}, sb {};
  return ::stat(a.c_str(), &sa) == 0 && ::stat(b.c_str(), &sb) == 0 && sa.st_dev == sb.st_dev &&
         sa.st_ino == sb.st_ino && S_ISREG(sa.st_mode);
}

Expected<bool> CheckOutputs(std::vector<std::string> files, const std::string& input,
                            std::vector<std::string> directories) {
  std::erase(files, std::string());
  std::erase(directories, std::string());
  for (const auto& p : files) {
    if (!input.empty() && SameFile(p, input)) {
      return Error{ErrorCode::kBadInput, p + ": is the command's input " + input + "; refusing to overwrite it"};
    }
  }
  return OutputFiles::CheckAll(files, directories);
}

Expected<bool> ApplyModelOptions(const Command& c, planner::Model* model) {
  if (!c.target.empty()) planner::ApplyTarget(model, *planner::TargetFromName(c.target));
  if (c.expandable_segments) {
    if (model->target.kind == planner::TargetKind::kMemplan) {
      return Error{ErrorCode::kBadInput, "--expandable-segments: PyTorch's allocator setting; memplan's own runtime "
                                         "allocates from an exact arena (use --target megatron)"};
    }
    model->target.expandable_segments = true;
  }
  if (!c.headroom.empty()) {
    int64_t bytes = 0;
    if (c.headroom.back() == '%') {
      double pct = -1;
      size_t used = 0;
      try {
        pct = std::stod(c.headroom.substr(0, c.headroom.size() - 1), &used);
      } catch (const std::exception&) {
        used = 0;
      }
      if (used + 1 != c.headroom.size() || !(pct >= 0 && pct < 100)) {
        return Error{ErrorCode::kBadInput, "--headroom: expected a size (2GiB) or a percentage in [0, 100) (3%), got " +
                                               c.headroom.substr(0, 40)};
      }
      bytes = static_cast<int64_t>(pct / 100 * static_cast<double>(model->hardware.device_memory));
    } else {
      auto b = ParseBytes(c.headroom);
      if (!b) return Error{ErrorCode::kBadInput, "--headroom: " + b.error().message};
      bytes = *b;
    }
    model->headroom = bytes;
    model->headroom_given = true;
  }
  if (!c.storage.empty()) {
    auto kinds = planner::ParseStorageKinds(c.storage);
    if (!kinds) return kinds.error();
    model->storage = *kinds;
  }
  if (!c.host_memory.empty()) {
    auto bytes = ParseBytes(c.host_memory);
    if (!bytes) return Error{ErrorCode::kBadInput, "--host-memory: " + bytes.error().message};
    model->hardware.host_memory = *bytes;
  }
  return true;
}

namespace {

int RunPlan(const Command& c) {
  if (auto ok = CheckOutputs({c.output}, c.input); !ok) return Fail(ok.error());
  auto model = planner::LoadModel(c.input);
  if (!model) return Fail(Located(model.error(), c.input));
  if (auto ok = ApplyModelOptions(c, &*model); !ok) return Fail(ok.error());
  planner::PlanOptions options;
  if (!c.budget.empty()) {
    auto bytes = ParseBudget(c.budget);
    if (!bytes) return Fail(bytes.error());
    options.budget = *bytes;
  }
  options.solver = c.solver == "exact" ? planner::SolverKind::kExact : planner::SolverKind::kHeuristic;
  options.sweep = c.sweep;
  options.verify = c.verify;
  options.full_simulation = c.full_simulation;
  if (c.threads > 0) SetThreads(c.threads);
  if (std::getenv("MEMPLAN_TIMING")) {
    options.on_stage = [](std::string_view stage, double ms) {
      std::fprintf(stderr, "memplan: timing: %-13.*s %8.1f ms\n", static_cast<int>(stage.size()), stage.data(), ms);
    };
  }
  if (!c.quiet) {
    options.on_progress = [](const std::string& line) { std::fprintf(stderr, "memplan: %s\n", line.c_str()); };
  }
  auto plan = planner::BuildPlan(*model, options);
  if (std::getenv("MEMPLAN_TIMING")) {
    // The planner's own memory: the process's peak resident set so far.
    struct rusage usage {};
    if (::getrusage(RUSAGE_SELF, &usage) == 0) {
      std::fprintf(stderr, "memplan: timing: %-13s %8.1f MiB\n", "peak RSS", static_cast<double>(usage.ru_maxrss) / 1024);
    }
  }
  if (!plan) return Fail(plan.error().code == ErrorCode::kBadInput ? Located(plan.error(), c.input) : plan.error());
  if (!c.quiet) {
    // What the plan took for granted (after planning: an error stays one line).
    planner::AssumptionsContext context;
    context.budget = options.budget;
    std::fputs(planner::RenderAssumptions(plan->model, context).c_str(), stderr);
  }
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
  if (auto ok = CheckOutputs({c.output}, c.input); !ok) return Fail(ok.error());
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

// REPORT.html (viz/report.h): written whole or not at all.
int RunViz(const Command& c) {
  if (auto ok = CheckOutputs({c.output}, c.input); !ok) return Fail(ok.error());
  for (const auto& in : {c.measured, c.trace}) {
    if (!in.empty() && SameFile(c.output, in)) {
      return Fail({ErrorCode::kBadInput, c.output + ": is the command's input " + in + "; refusing to overwrite it"});
    }
  }
  viz::ReportOptions options;
  options.plan_file = c.input;
  options.measured_file = c.measured;
  options.trace_file = c.trace;
  options.force = c.force;
  std::vector<std::string> warnings;
  auto data = viz::BuildReportData(options, &warnings);
  if (!data) return Fail(data.error());
  for (const auto& w : warnings) std::fprintf(stderr, "memplan: warning: %s\n", w.c_str());
  OutputFiles out;
  if (auto at = FindNonFinite(*data)) {
    return Fail({ErrorCode::kRuntime, "internal error: " + c.output + ": " + *at + ": a non-finite number; no report written"});
  }
  if (auto st = out.Stage(c.output, viz::RenderReportHtml(*data)); !st) return Fail(st.error());
  if (auto st = out.Commit(); !st) return Fail(st.error());
  std::printf("wrote %s (%zu ranks, %zu tensors%s%s)\n", c.output.c_str(), (*data)["ranks"].size(),
              (*data)["tensors"].size(), c.measured.empty() ? "" : ", measured", c.trace.empty() ? "" : ", trace");
  return 0;
}

// Eager runs (docs/runtime.md, "Eager execution"): each rank's allocation
// timeline against the plan's memory program, step by step; prints a table
// and every failing rank's first divergence. Whether all pass.
Expected<bool> CheckEagerTimelines(const Json& plan_json, const std::string& plan_file, const traces::Measured& m) {
  auto programs = planner::ReplayPrograms(plan_json, plan_file);
  if (!programs) return programs.error();
  Table t({"pp_rank", "dp_rank", "cp_rank", "tp_rank", "steps", "buffers", "divergent", "moved copies", "pred_alloc(MiB)",
           "meas_alloc(MiB)", "timeline"});
  bool all = true;
  std::vector<std::string> failures;
  for (const auto& mr : m.ranks) {
    if (mr.pp_rank < 0 || static_cast<size_t>(mr.pp_rank) >= programs->size()) {
      return Error{ErrorCode::kBadInput, "pp_rank " + std::to_string(mr.pp_rank) + " is not a rank of " + plan_file};
    }
    const planner::RankProgram& prog = (*programs)[static_cast<size_t>(mr.pp_rank)];
    std::vector<traces::PredictedLife> lives;
    lives.reserve(prog.buffers.size());
    for (const auto& b : prog.buffers) lives.push_back({b.first, b.last, b.bytes, b.label.name, b.label.part, b.copy_timed});
    const int64_t steps = static_cast<int64_t>(prog.steps.size());
    auto describe = [&](int64_t s) {
      return s >= 0 && s < steps ? prog.steps[static_cast<size_t>(s)] : std::string("after the last step");
    };
    traces::TimelineComparison cmp = traces::CompareTimelines(lives, mr.allocation_timeline, steps, describe);
    all = all && cmp.pass;
    auto mib = [](int64_t b) { return FormatFixed(static_cast<double>(b) / (1 << 20), 3); };
    t.AddRow({std::to_string(mr.pp_rank), std::to_string(mr.dp_rank), std::to_string(mr.cp_rank), std::to_string(mr.tp_rank),
              std::to_string(cmp.steps),
              std::to_string(cmp.buffers), std::to_string(cmp.divergent_steps), std::to_string(cmp.moved.size()),
              mib(cmp.predicted_peak), mib(cmp.measured_peak), cmp.pass ? "pass" : "FAIL"});
    if (!cmp.pass) failures.push_back("pp rank " + std::to_string(mr.pp_rank) + " dp rank " + std::to_string(mr.dp_rank) + " cp rank " + std::to_string(mr.cp_rank) + " tp rank " + std::to_string(mr.tp_rank) + ": " + cmp.verdict);
    if (!cmp.moved.empty()) {
      int64_t earlier = 0, most = 0;
      for (const auto& mv : cmp.moved) {
        earlier += mv.measured_last < mv.predicted_last;
        most = std::max<int64_t>(most, std::llabs(mv.measured_last - mv.predicted_last));
      }
      failures.push_back("pp rank " + std::to_string(mr.pp_rank) + " dp rank " + std::to_string(mr.dp_rank) + " cp rank " + std::to_string(mr.cp_rank) + " tp rank " + std::to_string(mr.tp_rank) + ": " +
                         std::to_string(cmp.moved.size()) + " copy-timed lifetimes moved (" + std::to_string(earlier) +
                         " copies finished earlier than the time model predicts, " +
                         std::to_string(cmp.moved.size() - static_cast<size_t>(earlier)) + " later; at most " +
                         std::to_string(most) + " steps)");
    }
  }
  std::printf("\neager timeline against the plan, step by step (allocated activation bytes):\n%s", t.Render().c_str());
  for (const auto& f : failures) std::printf("  %s\n", f.c_str());
  return all;
}

// The eager witness's bytes (docs/runtime.md, "What each measurement
// sees"): every freed buffer's planned bytes against the bytes its kernels
// and copies wrote. A buffer the plan makes larger than anything wrote is
// an over-prediction, named per tensor (its microbatches together). A
// tail of kCanarySlack bytes may hold values equal to the canary by chance.
bool CheckTouchedBytes(const traces::Measured& m, const std::vector<planner::RankProgram>& programs) {
  constexpr int64_t kCanarySlack = 4;
  struct Over {
    int64_t buffers = 0, planned = 0, touched = 0;
  };
  Table t({"pp_rank", "dp_rank", "cp_rank", "tp_rank", "buffers", "planned(MiB)", "touched(MiB)", "routed_reserve(MiB)",
           "over-predicted"});
  std::map<std::pair<std::string, std::string>, Over> over;
  int64_t measured = 0;
  for (const auto& mr : m.ranks) {
    int64_t buffers = 0, planned = 0, touched = 0, bad = 0, reserve = 0;
    const std::set<std::string>* routed = mr.pp_rank >= 0 && static_cast<size_t>(mr.pp_rank) < programs.size()
                                              ? &programs[static_cast<size_t>(mr.pp_rank)].routed_reserve
                                              : nullptr;
    for (const auto& e : mr.allocation_timeline) {
      if (e.bytes >= 0 || e.touched < 0) continue;
      ++buffers;
      planned += -e.bytes;
      touched += e.touched;
      if (-e.bytes - e.touched <= kCanarySlack) continue;
      const size_t at = e.name.find("@mb");
      const std::string base = at == std::string::npos ? e.name : e.name.substr(0, at);
      if (routed != nullptr && routed->contains(base)) {  // rows the routing did not send here
        reserve += -e.bytes - e.touched;
        continue;
      }
      ++bad;
      Over& o = over[{base, e.part}];
      ++o.buffers;
      o.planned = std::max(o.planned, -e.bytes);
      o.touched = std::max(o.touched, e.touched);
    }
    measured += buffers;
    auto mib = [](int64_t b) { return FormatFixed(static_cast<double>(b) / (1 << 20), 3); };
    t.AddRow({std::to_string(mr.pp_rank), std::to_string(mr.dp_rank), std::to_string(mr.cp_rank),
              std::to_string(mr.tp_rank), std::to_string(buffers), mib(planned), mib(touched), mib(reserve),
              std::to_string(bad)});
  }
  if (measured == 0) {
    std::printf("\nbytes touched: not measured (a run without the eager witness)\n");
    return true;
  }
  std::printf("\nbytes the kernels wrote against the plan, per freed buffer (eager witness):\n%s", t.Render().c_str());
  int shown = 0;
  for (const auto& [key, o] : over) {
    if (++shown > 20) {
      std::printf("  ... and %zu more tensors\n", over.size() - 20);
      break;
    }
    std::printf("  over-predicted: %s (%s): planned %lld bytes, the kernels wrote %lld (%lld buffers)\n",
                key.first.c_str(), key.second.c_str(), static_cast<long long>(o.planned),
                static_cast<long long>(o.touched), static_cast<long long>(o.buffers));
  }
  return over.empty();
}

// Exit 0 when every rank passes, 1 with the offending ranks otherwise.
int RunCheck(const Command& c) {
  auto plan_json = ReadJsonFile(c.input);
  if (!plan_json) return Fail(plan_json.error());
  auto bounds = traces::ParsePlanBounds(*plan_json, c.input);
  if (!bounds) return Fail(bounds.error());
  auto measured = traces::LoadMeasured(c.measured);
  if (!measured) return Fail(measured.error());
  traces::CheckOptions options;
  options.tolerance = c.tolerance;
  options.ranks_from_devices = c.ranks_from_devices;
  options.plan_file = c.input;
  options.measured_file = c.measured;
  auto result = traces::Check(*bounds, *measured, options);
  if (!result) return Fail(result.error());
  std::fputs(traces::RenderCheckTable(*result, !result->pass).c_str(), stdout);
  if (measured->allocator == "eager") {
    // An independent measurement: its timeline against the plan's program.
    auto eager = CheckEagerTimelines(*plan_json, c.input, *measured);
    if (!eager) return Fail(eager.error());
    if (!*eager) {
      return Fail({ErrorCode::kCheckFailed, "check failed: the eager run's allocation timeline diverges from the plan "
                                            "(first divergence above)"});
    }
    auto programs = planner::ReplayPrograms(*plan_json, c.input);
    if (!programs) return Fail(programs.error());
    if (!CheckTouchedBytes(*measured, *programs)) {
      return Fail({ErrorCode::kCheckFailed, "check failed: the plan gives buffers more bytes than the kernels wrote "
                                            "(over-predicted tensors above)"});
    }
  }
  const std::string tol = FormatFixed(100 * result->tolerance, 2) + " %";
  if (!result->pass) {
    size_t failed = 0;
    for (const auto& r : result->ranks) failed += r.pass ? 0 : 1;
    // Each rule that failed, in one line.
    std::vector<std::string> why;
    if (failed > 0) {
      why.push_back(std::to_string(failed) + " of " + std::to_string(result->ranks.size()) +
                    " ranks outside the plan's bounds");
    }
    if (result->process && !result->process->pass) {
      why.push_back("the process's CUPTI total is off the ranks' planned memory");
    }
    if (result->cupti_missing) why.push_back("CUPTI gave no witness of this cuda run");
    std::string all;
    for (const auto& w : why) all += (all.empty() ? "" : "; ") + w;
    return Fail({ErrorCode::kCheckFailed, "check failed: " + all + " (tolerance " + tol + ")"});
  }
  std::printf("check passed: %zu ranks within the plan's bounds (tolerance %s, %s backend, %s allocator, %s)\n",
              result->ranks.size(), tol.c_str(), measured->backend.c_str(), result->allocator.c_str(),
              result->source.c_str());
  return 0;
}

void PrintRunTable(const Json& plan_json, const traces::Measured& m) {
  // Data-parallel replicas (mpirun) each get a row beside their pipeline rank.
  const bool replicas = std::any_of(m.ranks.begin(), m.ranks.end(), [](const auto& r) { return r.dp_rank > 0; });
  std::vector<std::string> header{"pp_rank"};
  if (replicas) header.push_back("dp_rank");
  const bool experts = std::any_of(m.ranks.begin(), m.ranks.end(), [](const auto& r) { return r.ep_rank > 0; });
  if (experts) header.push_back("ep_rank");
  const bool context = std::any_of(m.ranks.begin(), m.ranks.end(), [](const auto& r) { return r.cp_rank > 0; });
  if (context) header.push_back("cp_rank");
  const bool tensor = std::any_of(m.ranks.begin(), m.ranks.end(), [](const auto& r) { return r.tp_rank > 0; });
  if (tensor) header.push_back("tp_rank");
  for (const char* h : {"static(MiB)", "lower_bd(MiB)", "alloc_peak(MiB)", "peak(MiB)", "meas_peak(MiB)", "diff(%)"}) {
    header.push_back(h);
  }
  Table t(header);
  const auto& ranks = plan_json["ranks"];
  const double mib = 1024.0 * 1024.0;
  for (const auto& mr : m.ranks) {
    const Json& pr = static_cast<size_t>(mr.pp_rank) < ranks.size() ? ranks[static_cast<size_t>(mr.pp_rank)] : Json::object();
    int64_t lb = pr.value("lower_bound", int64_t{0}), peak = pr.value("peak", int64_t{0});
    std::vector<std::string> row{std::to_string(mr.pp_rank)};
    if (replicas) row.push_back(std::to_string(mr.dp_rank));
    if (experts) row.push_back(std::to_string(mr.ep_rank));
    if (context) row.push_back(std::to_string(mr.cp_rank));
    if (tensor) row.push_back(std::to_string(mr.tp_rank));
    std::vector<std::string> cells{FormatFixed(static_cast<double>(mr.static_bytes) / mib, 3),
              FormatFixed(static_cast<double>(lb) / mib, 3), FormatFixed(static_cast<double>(mr.allocated_peak) / mib, 3),
              FormatFixed(static_cast<double>(peak) / mib, 3), FormatFixed(static_cast<double>(mr.peak) / mib, 3),
              FormatFixed(peak ? 100.0 * static_cast<double>(mr.peak - peak) / static_cast<double>(peak) : 0.0, 3)};
    row.insert(row.end(), cells.begin(), cells.end());
    t.AddRow(row);
  }
  std::fputs(t.Render().c_str(), stdout);
  if (!m.steps.empty()) {
    // --steps: one row per step, each rank's own peak of that step.
    std::vector<std::string> sh{"step", "loss", "grad_norm", "time(ms)"};
    for (const auto& sr : m.steps.front().ranks) {
      sh.push_back("pp" + std::to_string(sr.pp_rank) + (replicas ? "/dp" + std::to_string(sr.dp_rank) : "") +
                   (context ? "/cp" + std::to_string(sr.cp_rank) : "") + (tensor ? "/tp" + std::to_string(sr.tp_rank) : "") +
                   " alloc_peak(MiB)");
    }
    Table st(sh);
    for (const auto& s : m.steps) {
      std::vector<std::string> row{std::to_string(s.step), FormatFixed(s.loss, 6), FormatFixed(s.grad_norm, 6),
                                   FormatFixed(1000 * s.step_s, 2)};
      for (const auto& sr : s.ranks) row.push_back(FormatFixed(static_cast<double>(sr.allocated_peak) / mib, 3));
      st.AddRow(row);
    }
    std::fputs(("\n" + st.Render()).c_str(), stdout);
  }
  const std::string which = m.steps.empty() ? "" : " (the last, step " + std::to_string(m.steps.back().step) + ")";
  std::printf("\n%s backend (%s): step %s ms, loss %.6f, grad_norm %.6f%s\n", m.backend.c_str(), m.device.c_str(),
              FormatFixed(1000 * m.step_s, 2).c_str(), m.loss, m.grad_norm, which.c_str());
}

// Every rank of one launch was started with the same options (cli.h).
Expected<std::monostate> AgreeOnOptions(runtime::Communicator& comm, const Command& c) {
  if (auto why = LaunchMismatch(comm.AllGather(LaunchOptions(c)))) return Error{ErrorCode::kBadInput, *why};
  return std::monostate{};
}

// Executes one training step of PLAN.json; writes MEASURED.json, the trace
// and the dump together, or none of them.
//
// Launched by mpirun: one process per rank of the plan's grid
// (runtime/comm.h). Rank 0 writes the outputs and prints; a failure every
// rank sees (a bad plan, the wrong -np) is said once, by rank 0, and every
// rank exits with its code.
int RunExecute(const Command& c) {
  std::unique_ptr<runtime::Communicator> comm;
  if (runtime::LaunchedByMpi()) {
    auto made = runtime::MakeMpiCommunicator();
    if (!made) return Fail(made.error());
    comm = std::move(*made);
  }
  const bool lead = !comm || comm->rank() == 0;
  // An error every rank has: rank 0 says it, every rank exits with its code.
  auto fail = [&](const Error& e) { return lead ? Fail(e) : static_cast<int>(e.code); };
  // An error the ranks agreed on: rank 0 says it, the others wait until it has.
  auto fail_agreed = [&](const Error& e) { return FailAgreed(comm.get(), e); };
  // Before anything else (the options decide which collectives follow):
  // every rank was started with the same options.
  if (comm) {
    if (auto same = AgreeOnOptions(*comm, c); !same) return fail_agreed(same.error());
  }
  Expected<std::monostate> local = std::monostate{};
  if (c.backend == "host" && c.allocator == "pool") {
    local = Error{ErrorCode::kBadInput, "--allocator pool: the host backend is always an arena (pools are cuda's)"};
  } else if (lead) {
    if (auto ok = CheckOutputs({c.output, c.trace}, c.input, {c.dump}); !ok) local = ok.error();
  }
  auto plan_json = ReadJsonFile(c.input);
  if (local.ok() && !plan_json) local = plan_json.error();
  if (comm) local = runtime::Agree(*comm, local);
  if (!local.ok()) return fail_agreed(local.error());
  OutputFiles out;
  runtime::RunOptions options;
  options.backend = c.backend == "cuda" ? runtime::BackendKind::kCuda : runtime::BackendKind::kHost;
  options.cuda_pool = c.allocator == "pool" || c.allocator == "eager";
  options.eager = c.allocator == "eager";
  options.cupti = !c.no_cupti;
  options.plan_file = c.input;
  options.trace = !c.trace.empty();
  options.steps = c.steps;
  options.comm = comm.get();
  if (!c.dump.empty()) {
    // Under mpirun rank 0 stages the directory and every rank writes its
    // own parameters there (one file system, as on one node).
    Expected<std::string> staged = std::string();
    if (lead) staged = out.StageDirectory(c.dump);
    if (comm) {
      Expected<std::monostate> st = std::monostate{};
      if (!staged) st = staged.error();
      if (auto agreed = runtime::Agree(*comm, st); !agreed) return fail_agreed(agreed.error());
      staged = comm->AllGather(*staged).front();
    }
    if (!staged) return Fail(staged.error());
    options.dump_dir = *staged;
  }
  if (!c.quiet && lead) {
    options.progress = [](std::string_view line) {
      std::fprintf(stderr, "%.*s\n", static_cast<int>(line.size()), line.data());
    };
  }
  bool agreed = false;
  options.agreed_error = &agreed;
  auto result = runtime::RunPlan(*plan_json, options);
  if (!result) {
    const Error e = Located(result.error(), c.input);
    return agreed ? fail_agreed(e) : fail(e);
  }
  if (!lead) return 0;
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

// The profiled program's exit status as a shell reports it.
int ChildStatus(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

// Runs the program with libmemplan_inject.so (beside this executable) as
// its CUDA injection library; the library writes the profile when the
// program exits. Exit status: the program's (also when it failed and left
// no profile or trace: memplan says so on stderr); 5 when it succeeded but
// left no profile (it never allocated device memory, or CUPTI could not
// attach, which the library says on stderr); 127 when it could not be run.
// SIGTERM, SIGINT or SIGHUP is forwarded to the program and every process
// it started (its own process group); once it ended,
// memplan removes its temporary directory and ends by the same signal.
int RunProfile(const Command& c) {
  namespace fs = std::filesystem;
  if (auto ok = CheckOutputs({c.output, c.trace}, ""); !ok) return Fail(ok.error());
  std::error_code ec;
  fs::path lib = fs::read_symlink("/proc/self/exe", ec).parent_path() / "libmemplan_inject.so";
  if (ec || !fs::exists(lib)) {
    return Fail({ErrorCode::kRuntime, lib.string() + ": the CUPTI injection library is missing (memplan built without "
                                                     "CUPTI?)"});
  }
  std::string dir_template = (fs::temp_directory_path() / "memplan-profile-XXXXXX").string();
  if (::mkdtemp(dir_template.data()) == nullptr) {
    return Fail({ErrorCode::kRuntime, "profile: cannot create a temporary directory: " + std::string(std::strerror(errno))});
  }
  const fs::path dir(dir_template);
  const int dir_slot = AddCleanupPath(dir);  // removed if a signal ends memplan before the program starts
  const std::string profile = (dir / "profile.json").string();
  const std::string trace = (dir / "trace.json").string();
  std::fflush(nullptr);
  // Signals that end a command (timeout's SIGTERM, ^C) are blocked from
  // before the fork until they are forwarded to the program: it ends, this
  // process removes its directory and ends by the same signal (cleanup.h).
  sigset_t terminating, previous;
  sigemptyset(&terminating);
  for (int sig : {SIGTERM, SIGINT, SIGHUP}) sigaddset(&terminating, sig);
  ::sigprocmask(SIG_BLOCK, &terminating, &previous);
  pid_t pid = ::fork();
  if (pid < 0) {
    ::sigprocmask(SIG_SETMASK, &previous, nullptr);
    DropCleanupPath(dir_slot);
    fs::remove_all(dir, ec);
    return Fail({ErrorCode::kRuntime, "profile: fork failed: " + std::string(std::strerror(errno))});
  }
  if (pid == 0) {
    ::setpgid(0, 0);  // its own process group: a forwarded signal reaches its children too
    ::sigprocmask(SIG_SETMASK, &previous, nullptr);
    ::setenv("CUDA_INJECTION64_PATH", lib.c_str(), 1);
    ::setenv("MEMPLAN_PROFILE_OUT", profile.c_str(), 1);
    if (!c.trace.empty()) ::setenv("MEMPLAN_PROFILE_TRACE", trace.c_str(), 1);
    std::vector<char*> argv;
    for (const auto& a : c.child) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    ::execvp(argv[0], argv.data());
    std::fprintf(stderr, "memplan: profile: cannot run %s: %s\n", OneLine(c.child[0]).c_str(), std::strerror(errno));
    std::_Exit(127);
  }
  ::setpgid(pid, pid);  // as the child does, whichever runs first
  ForwardSignalsTo(pid);
  ::sigprocmask(SIG_SETMASK, &previous, nullptr);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  ForwardSignalsTo(0);
  const int child = ChildStatus(status);
  // The program wrote these files, or something else in their place: only
  // regular files are read (a FIFO there would block).
  auto regular = [](const std::string& path) {
    std::error_code e;
    return fs::is_regular_file(fs::symlink_status(path, e));
  };
  auto measured = regular(profile) ? traces::LoadMeasured(profile) : Expected<traces::Measured>(Error{});
  auto trace_json = !c.trace.empty() && regular(trace) ? ReadJsonFile(trace) : Expected<Json>(Error{});
  const bool replaced = (fs::exists(fs::symlink_status(profile, ec)) && !regular(profile)) ||
                        (!c.trace.empty() && fs::exists(fs::symlink_status(trace, ec)) && !regular(trace));
  fs::remove_all(dir, ec);
  DropCleanupPath(dir_slot);
  if (const int sig = ForwardedSignal(); sig != 0) EndBySignal(sig);
  // A program that failed keeps its own exit status: what it left is
  // written when it can be, and nothing it failed to leave turns its
  // status into memplan's.
  auto failed = [&](const std::string& what) {
    if (child != 0) {
      std::fprintf(stderr, "memplan: profile: %s\n", OneLine(what).c_str());
      return child;
    }
    return Fail({ErrorCode::kRuntime, "profile: " + what});
  };
  if (replaced) return failed(OneLine(c.child[0]) + " replaced its profile or trace file by something other than a regular file");
  if (!measured) {
    if (!measured.error().message.empty()) return failed(measured.error().message);
    return failed(OneLine(c.child[0]) + " made no device allocation CUPTI saw (no CUDA, or CUPTI could not attach); no profile written");
  }
  OutputFiles out;
  if (!c.output.empty()) {
    if (auto st = StageJson(out, c.output, traces::MeasuredToJson(*measured), 2); !st) return Fail(st.error());
  }
  if (!c.trace.empty()) {
    if (!trace_json) return failed("CUPTI recorded no GPU timeline for " + OneLine(c.child[0]) + "; no trace written");
    if (auto st = StageJson(out, c.trace, *trace_json, -1); !st) return Fail(st.error());
  }
  if (auto st = out.Commit(); !st) return Fail(st.error());
  Table t({"device", "allocated_peak(MiB)", "reserved_peak(MiB)", "allocations", "releases"});
  for (const auto& r : measured->ranks) {
    auto count = [&](const char* k) { auto it = r.events.find(k); return it == r.events.end() ? 0 : it->second; };
    t.AddRow({std::to_string(r.pp_rank), FormatFixed(static_cast<double>(r.allocated_peak) / (1 << 20), 3),
              FormatFixed(static_cast<double>(r.peak) / (1 << 20), 3), std::to_string(count("allocations")),
              std::to_string(count("releases"))});
  }
  std::fputs(t.Render().c_str(), stdout);
  return child;
}

// Measures the time model's numbers; writes HW.json whole or not at all.
int RunCalibrate(const Command& c) {
  if (auto ok = CheckOutputs({c.output}, ""); !ok) return Fail(ok.error());
  runtime::CalibrateOptions options;
  options.backend = c.backend == "cuda" ? runtime::BackendKind::kCuda : runtime::BackendKind::kHost;
  if (!c.quiet) options.progress = [](std::string_view line) { std::fprintf(stderr, "%.*s\n", static_cast<int>(line.size()), line.data()); };
  auto cal = runtime::Calibrate(options);
  if (!cal) return Fail(cal.error());
  if (!c.output.empty()) {
    OutputFiles out;
    if (auto st = StageJson(out, c.output, runtime::CalibrationToJson(*cal), 2); !st) return Fail(st.error());
    if (auto st = out.Commit(); !st) return Fail(st.error());
  }
  if (!c.quiet) {
    const planner::Hardware& h = cal->hardware;
    Table t({"quantity", "value", "unit"});
    t.AddRow({"GEMM rate (bf16_flops)", FormatFixed(h.bf16_flops / 1e9, 3), "GFLOP/s"});
    t.AddRow({"memory bandwidth (hbm_bw)", FormatFixed(h.hbm_bw / 1e9, 3), "GB/s"});
    t.AddRow({"device -> host (d2h_bw)", FormatFixed(h.d2h_bw / 1e9, 3), "GB/s"});
    t.AddRow({"host -> device (h2d_bw)", FormatFixed(h.h2d_bw / 1e9, 3), "GB/s"});
    t.AddRow({"device -> device (pp_link_bw, peer_bw)", FormatFixed(h.pp_link_bw / 1e9, 3), "GB/s"});
    t.AddRow({"per-op cost (launch_s)", FormatFixed(h.launch_s * 1e6, 3), "us"});
    std::fputs(t.Render().c_str(), stdout);
    std::printf("\n%s backend (%s)%s\n", cal->backend.c_str(), cal->device.c_str(),
                c.output.empty() ? "" : ("; a model file uses it with \"hardware\": {\"calibration\": \"" + c.output + "\"}").c_str());
  }
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
      case Verb::kViz: return RunViz(c);
      case Verb::kProfile: return RunProfile(c);
      case Verb::kCalibrate: return RunCalibrate(c);
      case Verb::kSearch: return RunSearch(c);
      case Verb::kImport: return RunImport(c);
      case Verb::kExport: return RunExport(c);
    }
  } catch (const std::bad_alloc&) {
    return Fail({ErrorCode::kRuntime, "out of host memory"});
  } catch (const std::exception& e) {
    return Fail({ErrorCode::kRuntime, std::string("internal error: ") + e.what()});
  }
  return static_cast<int>(ErrorCode::kBadInput);
}

}  // namespace memplan::cli
