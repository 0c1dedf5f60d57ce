// The argument parser of the memplan command line (CLI11), without I/O.
#include "cli.h"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <optional>
#include <sstream>

namespace memplan::cli {

namespace {

// Integers as a person writes them: decimal digits only (CLI11 would read
// 0x10 as 16 and 1e3 as 1000).
const CLI::Validator kDecimal(
    [](std::string& s) -> std::string {
      const bool digits = !s.empty() && std::all_of(s.begin(), s.end(), [](char ch) { return ch >= '0' && ch <= '9'; });
      return digits ? std::string() : "expected a decimal integer, got " + s.substr(0, 40);
    },
    "INT");

}  // namespace

Expected<Command> ParseCommandLine(const std::vector<std::string>& args) {
  Command c;
  CLI::App app{"memplan: plan, execute and verify the GPU memory of LLM training", "memplan"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("memplan 0.1.0"));

  std::string plan_model, plan_out;
  auto* plan = app.add_subcommand("plan", "Plan memory for MODEL.json; print the per-rank table");
  plan->add_option("model", plan_model, "model file (memplan.model/1)")->required();
  plan->add_option("-o,--output", plan_out, "write PLAN.json (memplan.plan/1)");
  plan->add_option("--budget", c.budget, "device budget, e.g. 120GiB (overrides the model's)");
  // The runtime the answer is for, the margin kept, the allocator's mode.
  auto target_options = [&](CLI::App* sub) {
    sub->add_option("--target", c.target,
                     "memplan (memplan's own runtime; the model's default) or megatron (Megatron-LM: its saved tensors, "
                     "buffers, settings, argument rules and PyTorch's caching allocator; docs/targets.md)")
        ->check(CLI::IsMember({"memplan", "megatron"}));
    sub->add_option("--headroom", c.headroom,
                    "bytes kept free under the budget, a size (2GiB) or a share of device memory (3%); default: the "
                    "target's (megatron: max(2 GiB, 2.5 %) on GPU presets, memplan: 0)");
    sub->add_flag("--expandable-segments", c.expandable_segments,
                  "target megatron: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True");
  };
  target_options(plan);
  // What may be done with saved tensors and how much host memory is there.
  auto storage_options = [&](CLI::App* sub) {
    sub->add_option("--storage", c.storage,
                    "storage kinds the planner may choose, comma-separated from keep, recompute, fp8, offload_host, "
                    "offload_remote (default: all; keep always). fp8 changes numerics; offloads need pinned host "
                    "memory or another rank's");
    sub->add_option("--host-memory", c.host_memory,
                    "pinned host memory per GPU for offloads, a size (default: the hardware preset's); PLAN.json's "
                    "model records it as hardware.host_memory");
  };
  storage_options(plan);
  plan->add_option("--solver", c.solver, "heuristic (default) or exact (MILP through CBC; small models)")
      ->check(CLI::IsMember({"heuristic", "exact"}));
  plan->add_flag("--sweep", c.sweep, "also print the budget / added step time trade-off curve");
  plan->add_flag("--verify", c.verify,
                 "verify the plan (every instance resident when read; no placed buffers overlap; a periodic window's "
                 "numbers equal every microbatch simulated)");
  plan->add_flag("--full-simulation", c.full_simulation,
                 "simulate every microbatch instead of a periodic window of them (slower; the same numbers)");
  plan->add_option("--threads", c.threads,
                   "threads for the per-rank stages (default: MEMPLAN_THREADS, else every core); any count gives the "
                   "same plan")
      ->check(kDecimal)->check(CLI::Range(1, 1024));
  bool plan_quiet = false;
  plan->add_flag("-q,--quiet", plan_quiet, "no table, no assumptions, no progress");

  std::string search_model, search_out;
  bool search_quiet = false;
  auto* search = app.add_subcommand(
      "search", "Find the fastest parallel layout of MODEL.json that fits on N GPUs; print the top layouts, the "
                "Pareto front and why layouts were rejected (under mpirun: layouts shared among the processes)");
  search->add_option("model", search_model, "model file (memplan.model/1)")->required();
  search->add_option("--gpus", c.gpus, "GPUs in the job (tp x pp x cp x dp)")->required()->check(kDecimal)->check(CLI::Range(1, 1 << 20));
  search->add_option("--budget", c.budget, "device budget, e.g. 120GiB (default: the model's)");
  target_options(search);
  storage_options(search);
  search->add_option("--global-batch", c.global_batch,
                     "sequences per step (default: the model's micro_batch x microbatches x dp)")
      ->check(kDecimal)->check(CLI::Range(int64_t{1}, int64_t{1} << 40));
  search->add_option("--space", c.space,
                     "values to try, e.g. pp=1,2,4 vp=1,2 tp=1,2 cp=1 ep=1,8 dp=... micro_batch=1,2 zero=0,1 sp=0,1 "
                     "pipeline_zero2=0,1 grad_offload=none,host lighter_ends=0,1,2 (default: from the model and --gpus)")
      ->expected(1, 64);
  search->add_option("--top", c.top, "layouts in the table (default 10)")->check(kDecimal)->check(CLI::Range(1, 1000));
  search->add_option("-o,--output", search_out, "write SEARCH.json (memplan.search/1)");
  search->add_option("--best-model", c.best_model, "write the best layout as a model file for memplan plan");
  search->add_option("--threads", c.threads, "threads (default: MEMPLAN_THREADS, else every core); any count gives "
                                             "the same result")
      ->check(kDecimal)->check(CLI::Range(1, 1024));
  search->add_flag("--exhaustive", c.exhaustive,
                   "plan every layout (default: stop planning layouts whose base step exceeds the top K's steps; "
                   "the best K are the same, the Pareto front then covers every layout)");
  search->add_flag("-q,--quiet", search_quiet, "no table, no assumptions, no progress");

  std::string import_in, import_out;
  auto* import = app.add_subcommand(
      "import", "Write a model file from a Hugging Face config.json or a Megatron-LM argument list");
  import->require_subcommand(1);
  auto* hf = import->add_subcommand("hf", "From a Hugging Face config.json and the run's layout");
  hf->add_option("config", import_in, "config.json")->required();
  hf->add_option("--gpus", c.gpus, "GPUs in the run (tp x pp x cp x dp)")->required()->check(kDecimal)->check(CLI::Range(1, 1 << 20));
  hf->add_option("--global-batch", c.global_batch, "sequences per optimizer step")
      ->required()
      ->check(kDecimal)->check(CLI::Range(int64_t{1}, int64_t{1} << 40));
  hf->add_option("--seq", c.seq, "sequence length")->required()->check(kDecimal)->check(CLI::Range(1, 1 << 24));
  hf->add_option("--micro-batch", c.micro_batch, "sequences per microbatch (default 1)")->check(kDecimal)->check(CLI::Range(1, 1 << 16));
  for (auto [flag, field] : {std::pair{"--tp", &c.tp}, {"--pp", &c.pp}, {"--vp", &c.vp}, {"--ep", &c.ep}, {"--cp", &c.cp}}) {
    hf->add_option(flag, *field, std::string(flag + 2) + " size (default 1)")->check(kDecimal)->check(CLI::Range(1, 1 << 20));
  }
  hf->add_flag("--sp", c.sp, "sequence parallelism with tp");
  hf->add_option("--zero", c.zero, "ZeRO stage 0, 1 (default: the distributed optimizer), 2 or 3 (FSDP)")
      ->check(kDecimal)->check(CLI::Range(0, 3));
  hf->add_option("--optimizer", c.optimizer, "adam (default) or muon")->check(CLI::IsMember({"adam", "muon"}));
  hf->add_option("--hardware", c.hardware, "h100 (default), a100, h800, h200, b200, host (the CPU backend's)")
      ->check(CLI::IsMember({"a100", "h100", "h800", "h200", "b200", "host"}));
  hf->add_flag("--no-mtp", c.no_mtp, "plan without the checkpoint's multi-token-prediction layers");
  hf->add_option("--name", c.name, "the model's name (default: the config's _name_or_path, else the file's)");
  hf->add_option("-o,--output", import_out, "write MODEL.json (default: stdout)");
  hf->add_flag("-q,--quiet", c.quiet, "no assumptions block on stderr");
  auto* megatron = import->add_subcommand("megatron", "From a Megatron-LM argument list (pretrain_gpt.py's)");
  megatron->add_option("args", import_in, "a file of arguments")->required();
  megatron->add_option("--gpus", c.gpus, "the world size (Megatron takes it from its launcher)")
      ->required()
      ->check(kDecimal)->check(CLI::Range(1, 1 << 20));
  megatron->add_option("--hardware", c.hardware, "h100 (default), a100, h800, h200, b200, host (the CPU backend's)")
      ->check(CLI::IsMember({"a100", "h100", "h800", "h200", "b200", "host"}));
  megatron->add_option("--name", c.name, "the model's name (default: the file's)");
  megatron->add_flag("--as-written", c.as_written,
                     "store every tensor as the arguments say (their recompute and offload modules, the rest "
                     "kept, as Megatron does) instead of letting memplan decide the rest");
  megatron->add_option("-o,--output", import_out, "write MODEL.json (default: stdout)");
  megatron->add_flag("-q,--quiet", c.quiet, "no assumptions block on stderr");

  std::string export_in, export_out;
  auto* exp = app.add_subcommand(
      "export", "Map a plan's decisions onto a framework's settings and re-plan under them (docs/export.md)");
  exp->require_subcommand(1);
  auto* exp_megatron = exp->add_subcommand("megatron", "A Megatron-LM argument list");
  auto* exp_titan = exp->add_subcommand("torchtitan", "TorchTitan TOML sections");
  for (auto* sub : {exp_megatron, exp_titan}) {
    sub->add_option("plan", export_in, "PLAN.json (memplan plan -o)")->required();
    sub->add_option("-o,--output", export_out, "write the settings to a file (default: stdout)");
    sub->add_flag("-q,--quiet", c.quiet, "no comparison table");
  }
  exp_megatron->add_option("--headroom", c.headroom,
                           "bytes kept free under the budget when choosing Megatron's settings (see plan --headroom)");
  exp_megatron->add_flag("--expandable-segments", c.expandable_segments,
                         "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True");

  std::string expand_model, expand_out;
  auto* expand = app.add_subcommand("expand", "Print the model with every layer's graph expanded");
  expand->add_option("model", expand_model, "model file (memplan.model/1)")->required();
  expand->add_option("-o,--output", expand_out, "write to a file instead of stdout");

  std::string check_plan, check_measured;
  double tolerance = 0;
  auto* check =
      app.add_subcommand("check", "Compare MEASURED.json with PLAN.json; exit 1 when a rank is out of bounds");
  check->add_option("plan", check_plan, "plan file (memplan.plan/1)")->required();
  check->add_option("measured", check_measured, "measurement (memplan.measured/1)")->required();
  auto* tolerance_opt = check->add_option("--tolerance", tolerance,
                                          "relative tolerance (default 0 for host, 0.02 for cuda measurements)")
                            ->check(CLI::Range(0.0, 1.0));

  std::string ranks_from;
  check->add_option("--ranks-from", ranks_from,
                    "devices: the measurement is a profile (memplan profile); device i stands for rank i")
      ->check(CLI::IsMember({"devices"}));

  std::string profile_out, profile_trace;
  auto* profile = app.add_subcommand(
      "profile", "Run a program with CUPTI attached and write its device-memory profile (memplan.measured/1)");
  profile->add_option("-o,--output", profile_out, "write the profile (MEASURED.json, source cupti-injection)");
  profile->add_option("--trace", profile_trace,
                      "also write the GPU's kernels, copies and memsets per device and stream (Chrome trace)");
  profile->add_option("command", c.child, "the program and its arguments, after --")->required()->expected(-1);

  std::string run_plan, run_out;
  bool run_quiet = false;
  auto* run = app.add_subcommand("run", "Execute training steps of PLAN.json and measure their memory (under mpirun: one process per rank, mpirun -np pp*dp)");
  run->add_option("plan", run_plan, "plan file (memplan.plan/1)")->required();
  run->add_option("--backend", c.backend, "host (default: CPU reference kernels) or cuda")
      ->check(CLI::IsMember({"host", "cuda"}));
  run->add_option("--allocator", c.allocator,
                  "arena (default; one block per rank, the planner's placement: a feasibility check, exact by "
                  "construction), pool (cuda: a stream-ordered pool following the plan's program) or eager (each "
                  "buffer allocated at its first use and freed after its last, from the system allocator or the "
                  "CUDA pool: a measurement independent of the plan)")
      ->check(CLI::IsMember({"arena", "pool", "eager"}));
  run->add_flag("--no-cupti", c.no_cupti, "cuda: do not collect CUPTI's memory records");
  run->add_option("-o,--output", run_out, "write MEASURED.json (memplan.measured/1)");
  run->add_option("--trace", c.trace, "write a Chrome trace (chrome://tracing, Perfetto)");
  run->add_option("--dump", c.dump,
                  "write initial weights, batch, gradients and updated weights as .npy files into DIR (with --steps "
                  "N > 1: DIR/step<k>/ per step)");
  run->add_option("--steps", c.steps, "optimizer steps, each on fresh microbatches (default 1); MEASURED.json lists "
                                      "each step's loss and peaks")
      ->check(kDecimal)->check(CLI::Range(int64_t{1}, int64_t{10000}));
  run->add_flag("-q,--quiet", run_quiet, "no table, no progress");

  std::string calibrate_out;
  bool calibrate_quiet = false;
  auto* calibrate = app.add_subcommand(
      "calibrate", "Measure this machine's GEMM rate, bandwidths and per-op cost for the planner's time model");
  calibrate->add_option("--backend", c.backend, "host (default) or cuda")->check(CLI::IsMember({"host", "cuda"}));
  calibrate->add_option("-o,--output", calibrate_out,
                        "write HW.json (memplan.hardware/1; a model file names it with hardware.calibration)");
  calibrate->add_flag("-q,--quiet", calibrate_quiet, "no table, no progress");

  std::string viz_plan, viz_measured, viz_trace, viz_out;
  auto* viz = app.add_subcommand(
      "viz", "Write REPORT.html: the plan, its bounds and the measurement side by side (one self-contained file)");
  viz->add_option("plan", viz_plan, "plan file (memplan.plan/1)")->required();
  viz->add_option("measured", viz_measured, "measurement of a run of the plan (memplan.measured/1)");
  viz->add_option("trace", viz_trace, "TRACE.json of that run (memplan run --trace)");
  viz->add_option("-o,--output", viz_out, "write REPORT.html")->required();
  viz->add_flag("--force", c.force, "draw a measurement of another plan (digest mismatch) with a warning banner");

  // CLI11 takes arguments in reverse order, without the program name.
  std::vector<std::string> reversed(args.rbegin(), args.rend());
  try {
    app.parse(reversed);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) {  // --help, --version
      std::ostringstream out, err;
      app.exit(e, out, err);
      c.verb = Verb::kPrint;
      c.text = out.str() + err.str();
      return c;
    }
    return Error{ErrorCode::kBadInput, OneLine(e.what()) + " (see memplan --help)"};
  }
  // An empty path is a mistake (a shell variable that was not set), not
  // "no output".
  for (const auto* app_part : {plan, expand, check, run, profile, calibrate, viz, search, hf, megatron}) {
    for (const CLI::Option* opt : app_part->get_options()) {
      if (opt->count() == 0 || opt->get_type_size() == 0) continue;
      for (const std::string& v : opt->results()) {
        if (v.empty()) {
          return Error{ErrorCode::kBadInput, opt->get_name() + ": expected a value, got an empty string (see memplan --help)"};
        }
      }
    }
  }
  if (plan->parsed()) {
    c.verb = Verb::kPlan;
    c.input = plan_model;
    c.output = plan_out;
    c.quiet = plan_quiet;
  } else if (search->parsed()) {
    c.verb = Verb::kSearch;
    c.input = search_model;
    c.output = search_out;
    c.quiet = search_quiet;
  } else if (import->parsed()) {
    c.verb = Verb::kImport;
    c.import_kind = hf->parsed() ? "hf" : "megatron";
    c.input = import_in;
    c.output = import_out;
  } else if (exp->parsed()) {
    c.verb = Verb::kExport;
    c.import_kind = exp_megatron->parsed() ? "megatron" : "torchtitan";
    c.input = export_in;
    c.output = export_out;
  } else if (expand->parsed()) {
    c.verb = Verb::kExpand;
    c.input = expand_model;
    c.output = expand_out;
  } else if (run->parsed()) {
    c.verb = Verb::kRun;
    c.input = run_plan;
    c.output = run_out;
    c.quiet = run_quiet;
  } else if (check->parsed()) {
    c.verb = Verb::kCheck;
    c.input = check_plan;
    c.measured = check_measured;
    if (tolerance_opt->count()) c.tolerance = tolerance;
    c.ranks_from_devices = ranks_from == "devices";
  } else if (viz->parsed()) {
    c.verb = Verb::kViz;
    c.input = viz_plan;
    c.measured = viz_measured;
    c.trace = viz_trace;
    c.output = viz_out;
  } else if (calibrate->parsed()) {
    c.verb = Verb::kCalibrate;
    c.output = calibrate_out;
    c.quiet = calibrate_quiet;
  } else if (profile->parsed()) {
    c.verb = Verb::kProfile;
    c.output = profile_out;
    c.trace = profile_trace;
  } else {
    return Error{ErrorCode::kBadInput, "a subcommand is required (see memplan --help)"};
  }
  return c;
}

std::string LaunchOptions(const Command& c) {
  auto given = [](bool yes) { return std::string(yes ? "given" : "not given"); };
  const std::pair<const char*, std::string> options[] = {
      {"--backend", c.backend},  {"--allocator", c.allocator},      {"--no-cupti", given(c.no_cupti)},
      {"-o", given(!c.output.empty())}, {"--trace", given(!c.trace.empty())}, {"--dump", given(!c.dump.empty())},
      {"--steps", std::to_string(c.steps)}};
  std::string out;
  for (const auto& [name, value] : options) out += std::string(name) + "=" + value + "\n";
  return out;
}

std::string SearchLaunchOptions(const Command& c, const std::string& model_digest) {
  std::string space;
  for (const auto& a : c.space) space += (space.empty() ? "" : " ") + a;
  const std::pair<const char*, std::string> options[] = {
      {"model digest", model_digest},
      {"--gpus", std::to_string(c.gpus)},
      {"--budget", c.budget.empty() ? "the model's" : c.budget},
      {"--global-batch", c.global_batch > 0 ? std::to_string(c.global_batch) : "the model's"},
      {"--space", space.empty() ? "the default" : space},
      {"--top", std::to_string(c.top)},
      {"--exhaustive", c.exhaustive ? "given" : "not given"},
      {"--target", c.target.empty() ? "the model's" : c.target},
      {"--headroom", c.headroom.empty() ? "the default" : c.headroom},
      {"--expandable-segments", c.expandable_segments ? "given" : "not given"},
      {"--storage", c.storage.empty() ? "the model's" : c.storage},
      {"--host-memory", c.host_memory.empty() ? "the model's" : c.host_memory}};
  std::string out;
  for (const auto& [name, value] : options) out += std::string(name) + "=" + value + "\n";
  return out;
}

namespace {

// "name=value" lines; a line without '=' keeps its text as the name.
std::vector<std::pair<std::string, std::string>> OptionLines(const std::string& text) {
  std::vector<std::pair<std::string, std::string>> out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line) && out.size() < 64) {
    const size_t eq = line.find('=');
    out.emplace_back(line.substr(0, std::min(eq, size_t{64})), eq == std::string::npos ? "" : line.substr(eq + 1, 64));
  }
  return out;
}

// Printable: control characters and bytes past ASCII as '?'.
std::string Printable(std::string s) {
  for (char& ch : s) {
    if (static_cast<unsigned char>(ch) < 0x20 || static_cast<unsigned char>(ch) >= 0x7f) ch = '?';
  }
  return s;
}

}  // namespace

std::optional<std::string> LaunchMismatch(const std::vector<std::string>& gathered) {
  if (gathered.empty()) return std::nullopt;
  const auto zero = OptionLines(gathered[0]);
  for (size_t r = 1; r < gathered.size(); ++r) {
    if (gathered[r] == gathered[0]) continue;
    const auto theirs = OptionLines(gathered[r]);
    const std::string rank = "rank " + std::to_string(r);
    for (size_t k = 0; k < zero.size() && k < theirs.size(); ++k) {
      if (theirs[k].first != zero[k].first) break;
      if (theirs[k].second == zero[k].second) continue;
      const std::string& name = zero[k].first;
      return rank + " was started with " + Printable(name) + " " + Printable(theirs[k].second) + ", rank 0 with " +
             Printable(name) + " " + Printable(zero[k].second) + ": every process of one launch takes the same options";
    }
    return rank + " was started by another memplan (its options do not read as rank 0's): every process of one "
                  "launch runs the same memplan with the same options";
  }
  return std::nullopt;
}

}  // namespace memplan::cli
