#include "memplan/planner/plan.h"
#include "memplan/planner/runtime_limits.h"

#include <fnmatch.h>

#include <algorithm>
#include <cmath>
#include <chrono>
#include <functional>
#include <map>
#include <set>

#include "memplan/common/parallel.h"
#include "memplan/common/table.h"
#include "memplan/common/units.h"
#include "memplan/planner/accounting.h"
#include "memplan/planner/bounds.h"
#include "memplan/planner/layout.h"
#include "memplan/planner/liveness.h"
#include "memplan/planner/target.h"
#include "memplan/planner/templates.h"
#include "plan_internal.h"

namespace memplan::planner {

bool GlobMatch(const std::string& pattern, const std::string& name) {
  return ::fnmatch(pattern.c_str(), name.c_str(), 0) == 0;
}

namespace {

constexpr double kFragmentationReserve = 0.08;

struct Solved {
  Assignment assignment;
  Evaluation eval;
  RebalanceResult rebalance;
};

// Reports a stage's wall time to options.on_stage (bench/, MEMPLAN_TIMING).
class StageClock {
 public:
  explicit StageClock(const PlanOptions& o) : on_stage_(o.on_stage) {}
  void Mark(const char* stage) {
    if (!on_stage_) return;
    auto now = std::chrono::steady_clock::now();
    on_stage_(stage, std::chrono::duration<double, std::milli>(now - last_).count());
    last_ = now;
  }

 private:
  std::function<void(std::string_view, double)> on_stage_;
  std::chrono::steady_clock::time_point last_ = std::chrono::steady_clock::now();
};

// --verify on a periodic window: simulate every microbatch with the same
// decisions, run the verifier there, and require the window's numbers to be
// the full simulation's.
void VerifyWindow(const PlanningProblem& window, const Assignment& a, Evaluation* e) {
  const PlanningProblem full = BuildProblem(*window.model, std::vector<LayerGraph>(window.layers), Simulation::kFull);
  const Evaluation all = Evaluate(full, a, true);
  for (const auto& err : all.verify_errors) e->verify_errors.push_back("every microbatch: " + err);
  for (size_t r = 0; r < all.ranks.size(); ++r) {
    const RankBounds& w = e->ranks[r];
    const RankBounds& f = all.ranks[r];
    auto differs = [&](const char* what, double x, double y) {
      if (std::abs(x - y) <= 1e-9 * std::max(std::abs(x), std::abs(y))) return;
      e->verify_errors.push_back("pp rank " + std::to_string(r) + ": the periodic window's " + what + " " +
                                 std::to_string(x) + " differs from every microbatch's " + std::to_string(y));
    };
    differs("lower bound", static_cast<double>(w.lower_bound), static_cast<double>(f.lower_bound));
    differs("peak", static_cast<double>(w.peak), static_cast<double>(f.peak));
    differs("recompute seconds", w.recompute_s, f.recompute_s);
    differs("quantize seconds", w.quantize_s, f.quantize_s);
    differs("exposed transfer seconds", w.exposed_transfer_s, f.exposed_transfer_s);
    differs("resident offloads", static_cast<double>(w.resident_offloads), static_cast<double>(f.resident_offloads));
  }
}

// Stages 6-8 for one budget: decide, rebalance across pipeline ranks
// (pp_balance, pp > 1) and decide again if tensors moved, then bound;
// re-solve with a margin where the placed peak (fragmentation) exceeds the
// budget, and run the verifier when asked.
Overhead OverheadOf(const PlanningProblem& problem, const Evaluation& e);

Solved SolveForBudget(const PlanningProblem& problem, int64_t budget, const PlanOptions& options, StageClock& clock) {
  const Model& model = *problem.model;
  Solved out{Assignment::Annotated(problem), {}, {}};
  const size_t pp = problem.tensors.size();
  // Placement adds fragmentation on top of the lower bound: start with
  // kFragmentationReserve of each rank's activation budget held back, and
  // re-solve a rank whose placed peak still exceeds the budget.
  std::vector<int64_t> margin(pp, 0);
  for (size_t r = 0; r < pp; ++r) {
    margin[r] = static_cast<int64_t>(kFragmentationReserve *
                                     static_cast<double>(std::max<int64_t>(0, budget - problem.statics[r].total)));
  }
  auto budgets = [&] {
    std::vector<int64_t> b(pp);
    for (size_t r = 0; r < pp; ++r) b[r] = budget - problem.statics[r].total - margin[r];
    return b;
  };
  // The profiles, built once and kept in step by every solve and rebalance.
  ProfileCache cache(problem, out.assignment);
  std::vector<SolveResult> results = Solve(problem, budgets(), options.solver, &out.assignment, &cache);
  clock.Mark("solve");
  if (model.options.pp_balance && pp > 1) {
    out.rebalance = Rebalance(problem, budget, &out.assignment, &cache);
    clock.Mark("rebalance");
    if (out.rebalance.moved_tensors > 0) results = Solve(problem, budgets(), options.solver, &out.assignment, &cache);
    clock.Mark("re-solve");
  }
  if (options.place_if &&
      !options.place_if(OverheadOf(problem, EvaluateUnplaced(problem, out.assignment)).step_s)) {
    if (options.not_placed) *options.not_placed = true;
    ThrowError(ErrorCode::kInfeasible, "not placed: its solved step cannot enter the search's top layouts");
  }
  // Fragmentation: where the placed peak exceeds the budget although the
  // lower bound fits, tighten that rank's budget by the gap and re-solve it.
  out.eval = Evaluate(problem, out.assignment, false);
  clock.Mark("evaluate");
  for (int attempt = 0; attempt < 4; ++attempt) {
    std::vector<bool> redo(pp, false);
    bool any = false;
    for (size_t r = 0; r < pp; ++r) {
      const RankBounds& b = out.eval.ranks[r];
      if (results[r].fits && b.peak > budget) {
        // The lower bound must leave room for the fragmentation the
        // placement showed, growing with each attempt.
        margin[r] = std::max(margin[r] + (b.peak - budget), (b.peak - b.lower_bound) * (attempt + 1));
        redo[r] = any = true;
      }
    }
    if (!any) break;
    results = Solve(problem, budgets(), options.solver, &out.assignment, &cache);
    Evaluation next = Evaluate(problem, out.assignment, false, &out.eval, &redo);
    out.eval = std::move(next);
    clock.Mark("fragmentation");
  }
  if (options.verify) {
    Evaluation verified = Evaluate(problem, out.assignment, true);
    if (problem.window) {
      for (size_t r = 0; r < verified.ranks.size(); ++r) {
        verified.ranks[r].peak = out.eval.ranks[r].peak;  // the model's, streamed (bounds.cc)
        verified.ranks[r].periodic = out.eval.ranks[r].periodic;
      }
      VerifyWindow(problem, out.assignment, &verified);
    }
    out.eval = std::move(verified);
  }
  return out;
}

// Whether every rank's window stood for the model (RankBounds::periodic).
bool Periodic(const Evaluation& e) {
  return std::all_of(e.ranks.begin(), e.ranks.end(), [](const RankBounds& b) { return b.periodic; });
}

Overhead OverheadOf(const PlanningProblem& problem, const Evaluation& e) {
  Overhead o;
  o.base_step_s = problem.makespan_s;
  double worst = -1;
  for (const auto& b : e.ranks) {
    double added = b.recompute_s + b.quantize_s + b.exposed_transfer_s;
    if (added > worst) {
      worst = added;
      o.recompute_s = b.recompute_s;
      o.quantize_s = b.quantize_s;
      o.exposed_transfer_s = b.exposed_transfer_s;
    }
  }
  o.step_s = problem.makespan_s + std::max(0.0, worst);
  o.offload_bw_share = problem.offload_bw_share;
  o.inter_node_bytes_per_s = problem.inter_node_bytes_per_s;
  for (size_t r = 0; r < e.ranks.size(); ++r) {
    const RankTimeline& tl = problem.timelines[r];
    o.emulated_s += tl.compute_s + e.ranks[r].recompute_s + e.ranks[r].quantize_s;
    o.comm_s = std::max(o.comm_s, tl.comm_s);
    o.dp_exposed_s = std::max(o.dp_exposed_s, tl.dp_exposed_s);
  }
  return o;
}

// ", plus N outside the framework (CUDA context, NCCL)" where there is any.
std::string RuntimeNote(int64_t runtime) {
  return runtime > 0 ? " plus " + FormatBytes(runtime) + " outside the framework (CUDA context, NCCL)" : "";
}

std::vector<int64_t> LowerBounds(const PlanningProblem& problem, const Assignment& a) {
  std::vector<std::vector<Interval>> own(problem.tensors.size());
  ParallelFor(own.size(), [&](size_t r) { InstanceIntervals(problem, a, static_cast<int32_t>(r), &own[r], nullptr); });
  std::vector<Interval> ivs;
  for (const auto& v : own) ivs.insert(ivs.end(), v.begin(), v.end());
  auto prof = planner::Profiles(problem, ivs);
  std::vector<int64_t> out;
  for (size_t r = 0; r < prof.size(); ++r) {
    out.push_back(problem.statics[r].total + (prof[r].empty() ? 0 : *std::max_element(prof[r].begin(), prof[r].end())));
  }
  return out;
}

// What PyTorch's caching allocator reserves for a rank's static memory:
// the framework allocates each item whole at start-up (Megatron's
// contiguous parameter and gradient buffers, the optimizer's state as
// master weights and two moments), each in its own segment.
int64_t StaticReservedBytes(const StaticBreakdown& st) {
  auto seg = [](int64_t bytes) {
    return bytes > 0 ? CachingAllocatorModel::SegmentSize(CachingAllocatorModel::RoundSize(bytes)) : 0;
  };
  int64_t out = seg(st.weights) + seg(st.grads);
  for (int k = 0; k < 3; ++k) out += seg(st.optimizer / 3 + (k < st.optimizer % 3 ? 1 : 0));
  for (const auto& [name, bytes] : st.buffer_detail) out += seg(bytes);
  return out;
}

}  // namespace

Plan BuildPlanOrThrow(const Model& input, const PlanOptions& options) {
  Plan plan;
  plan.model = input;
  Model& model = plan.model;
  if (options.budget) {
    model.budget = *options.budget;
    model.budget_given = true;
  }
  if (options.headroom) {
    model.headroom = *options.headroom;
    model.headroom_given = true;
  }
  const Target& target = GetTarget(model.target.kind);
  plan.headroom = model.headroom_given ? model.headroom : target.DefaultHeadroom(model);
  if (model.budget > model.hardware.device_memory) {
    plan.warnings.push_back("budget " + FormatBytes(model.budget) + " exceeds device memory " +
                            FormatBytes(model.hardware.device_memory) + " (what-if plan)");
  }
  if (model.target.kind == TargetKind::kMemplan) {
    // What `memplan run` would refuse, said now (planner/runtime_limits.h).
    std::string gaps;
    for (const std::string& g : RuntimeLayoutGaps(model)) gaps += (gaps.empty() ? "" : "; ") + g;
    if (!gaps.empty()) plan.warnings.push_back("memplan run does not execute this layout yet: " + gaps);
  }
  plan.digest = ModelDigest(model);
  plan.solver = options.solver;
  StageClock clock(options);

  auto expanded = ExpandModel(model);
  if (!expanded) throw ErrorException(expanded.error());
  plan.totals = CountParameters(model, *expanded);
  clock.Mark("expand");
  // Static memory as the target holds it (its buffers, and the memory
  // outside it: the CUDA context, NCCL).
  const PipelineLayout cheap_layout = MakePipelineLayout(model);
  std::vector<StaticBreakdown> cheap_statics;
  for (int64_t r = 0; r < model.parallel.pp; ++r) {
    cheap_statics.push_back(AccountRank(model, *expanded, cheap_layout, r));
    target.StaticBuffers(model, r, &cheap_statics.back());
  }
  // Memory outside the framework comes off the budget before anything is
  // planned: the plan's own numbers (static, peak, bounds) are what the
  // framework allocates and CUPTI measures. The largest rank's: a
  // target's groups can differ by rank.
  int64_t runtime = 0;
  for (const auto& st : cheap_statics) runtime = std::max(runtime, st.runtime);
  const int64_t budget = model.budget - runtime;
  // Refused cheaply first: a rank whose static memory (weights, gradients,
  // optimizer state, buffers) alone exceeds the budget, before the
  // liveness and the schedule (the work that grows with layers x
  // microbatches) are built.
  {
    for (int64_t r = 0; r < model.parallel.pp; ++r) {
      const StaticBreakdown& st = cheap_statics[static_cast<size_t>(r)];
      if (st.host > model.hardware.host_memory) {
        const int64_t n = model.hardware.gpus_per_node;
        ThrowError(ErrorCode::kInfeasible,
                   "infeasible: pp rank " + std::to_string(r) + "'s training state on the host (gradient partitions) is " +
                       FormatBytes(st.host) + " per GPU, host_memory is " + FormatBytes(model.hardware.host_memory) +
                       " per GPU (" + FormatBytes(st.host * n) + " of " + FormatBytes(model.hardware.host_memory * n) +
                       " on a node of " + std::to_string(n) + " GPUs)");
      }
      if (st.total > budget) {
        ThrowError(ErrorCode::kInfeasible,
                   "infeasible: pp rank " + std::to_string(r) + "'s static memory alone is " + FormatBytes(st.total) +
                       " (weights, gradients, optimizer state)" + RuntimeNote(runtime) + ", budget is " +
                       FormatBytes(model.budget) + ", " + FormatBytes(st.total - budget) + " short");
      }
    }
  }
  PlanningProblem problem = BuildProblem(model, std::move(*expanded),
                                         options.full_simulation ? Simulation::kFull : Simulation::kPeriodic);
  problem.statics = cheap_statics;
  clock.Mark("liveness");
  const std::vector<LayerGraph>& layers = problem.layers;
  const PipelineLayout& layout = problem.layout;
  plan.schedules = problem.window ? BuildSchedules(model.parallel.pp, model.parallel.vp, model.train.microbatches)
                                  : problem.schedules;
  plan.simulation.microbatches = model.train.microbatches;
  plan.simulation.simulated = problem.microbatches;
  plan.simulation.period_microbatches = problem.window ? problem.window->unit : 0;

  // Infeasible: some rank cannot fit whatever the policies.
  std::vector<int64_t> any = AnyPlanLowerBounds(problem);
  {
    size_t worst = 0;
    for (size_t r = 1; r < any.size(); ++r) {
      if (any[r] > any[worst]) worst = r;
    }
    if (any[worst] > budget) {
      ThrowError(ErrorCode::kInfeasible,
                 "infeasible: pp rank " + std::to_string(worst) + " needs at least " + FormatBytes(any[worst]) +
                     " (any-plan lower bound: static " + FormatBytes(problem.statics[worst].total) +
                     " + activations at their smallest footprint)" + RuntimeNote(runtime) + ", budget is " +
                     FormatBytes(model.budget) + ", " + FormatBytes(any[worst] - budget) + " short");
    }
  }

  std::vector<int64_t> keep_all = LowerBounds(problem, Assignment::KeepAll(problem));
  clock.Mark("keep-all");
  // The solver keeps the headroom free where it decides storage.
  const int64_t solver_budget = budget - (target.PerTensorStorage() ? plan.headroom : 0);
  Solved solved = SolveForBudget(problem, solver_budget, options, clock);
  if (problem.window && !Periodic(solved.eval)) {
    // The window's period after its cut is not the one before it: it does
    // not stand for the model. Simulate every microbatch.
    for (size_t r = 0; r < solved.eval.ranks.size(); ++r) {
      if (solved.eval.ranks[r].periodic) continue;
      plan.simulation.fallback = "pp rank " + std::to_string(r) + "'s memory program does not repeat its period";
      break;
    }
    problem = BuildProblem(model, std::vector<LayerGraph>(problem.layers), Simulation::kFull);
    problem.statics = cheap_statics;
    plan.simulation.simulated = problem.microbatches;
    plan.simulation.period_microbatches = 0;
    keep_all = LowerBounds(problem, Assignment::KeepAll(problem));
    PlanOptions once = options;
    once.place_if = nullptr;  // asked of the first solve only
    solved = SolveForBudget(problem, solver_budget, once, clock);
    clock.Mark("full simulation");
  }
  const Evaluation& e = solved.eval;
  // Never write a plan the runtime refuses: every decision passes the one
  // storage rule (liveness.h), --verify or not.
  for (size_t r = 0; r < problem.tensors.size(); ++r) {
    for (size_t t = 0; t < problem.tensors[r].size(); ++t) {
      if (auto why = StorageRefusal(problem.tensors[r][t], solved.assignment.storage[r][t], model.parallel.pp,
                                    static_cast<int32_t>(r), solved.assignment.target[r][t])) {
        ThrowError(ErrorCode::kRuntime, "internal error: the planner decided on pp rank " + std::to_string(r) + " that " + *why);
      }
    }
  }
  plan.rebalance = solved.rebalance;
  {
    // The structural imbalance (every activation kept) before and after the
    // remote offloads the rebalancer chose.
    auto ratio = [](const std::vector<int64_t>& v) {
      int64_t lo = *std::min_element(v.begin(), v.end());
      return lo > 0 ? static_cast<double>(*std::max_element(v.begin(), v.end())) / static_cast<double>(lo) : 1.0;
    };
    Assignment moved = Assignment::KeepAll(problem);
    for (size_t r = 0; r < moved.storage.size(); ++r) {
      for (size_t t = 0; t < moved.storage[r].size(); ++t) {
        if (!IsRemote(solved.assignment.storage[r][t])) continue;
        moved.storage[r][t] = Storage::kOffloadRemote;
        moved.target[r][t] = solved.assignment.target[r][t];
      }
    }
    plan.rebalance.ratio_before = ratio(keep_all);
    plan.rebalance.ratio_after = ratio(LowerBounds(problem, moved));
  }
  plan.overhead = OverheadOf(problem, e);
  plan.verify_errors = e.verify_errors;
  // Reserved bytes: the target's allocator replayed over each rank's memory
  // program, up to what is left of the budget after static memory and the
  // runtime (past it, PyTorch frees its cached segments and retries).
  std::vector<AllocatorReplay> replay;
  std::vector<int64_t> static_reserved;
  if (auto allocator = target.Allocator(model)) {
    std::vector<int64_t> capacity;
    for (const auto& st : problem.statics) {
      static_reserved.push_back(StaticReservedBytes(st));
      capacity.push_back(std::max<int64_t>(0, model.budget - st.runtime - static_reserved.back()));
    }
    replay = ReplayCachingAllocator(problem, e, *allocator, capacity);
    clock.Mark("allocator");
  }
  plan.verified = options.verify;

  for (int64_t r = 0; r < model.parallel.pp; ++r) {
    const size_t ri = static_cast<size_t>(r);
    RankPlan rp;
    rp.pp_rank = r;
    rp.chunks = layout.chunks[ri];
    rp.layers = layout.LayersOfRank(r);
    rp.statics = problem.statics[ri];
    rp.in_flight_chunks = InFlightPerChunk(model.parallel.pp, model.parallel.vp, r, model.train.microbatches);
    for (size_t c = 0; c < rp.chunks.size(); ++c) {
      int64_t bytes = 0;
      for (int64_t layer : rp.chunks[c]) bytes = CheckedAdd(bytes, layers[static_cast<size_t>(layer)].SavedBytes(), "activations");
      rp.chunk_activation_bytes.push_back(bytes);
      rp.activations_per_microbatch += bytes;
    }
    const RankBounds& b = e.ranks[ri];
    rp.activations_peak = b.activations_peak;
    rp.lower_bound = b.lower_bound;
    rp.peak = b.peak;
    rp.keep_all_lower_bound = keep_all[ri];
    rp.any_plan_lower_bound = b.any_plan_lower_bound;
    rp.budget = model.budget;
    rp.allocated = rp.reserved = rp.peak;
    if (!replay.empty()) {
      rp.allocated = rp.statics.total + replay[ri].allocated_peak;
      rp.reserved = static_reserved[ri] + replay[ri].reserved_peak;
    }
    rp.margin = rp.budget - rp.reserved - rp.statics.runtime;
    rp.fits = rp.margin >= 0;
    rp.host_peak = rp.statics.host + b.host_activations_peak;
    rp.fits = rp.fits && rp.host_peak <= model.hardware.host_memory;
    rp.recompute_s = b.recompute_s;
    rp.quantize_s = b.quantize_s;
    rp.exposed_transfer_s = b.exposed_transfer_s;
    rp.remote_offload = b.remote_offload;
    // Offloads that stay resident, in instance order (tensor, then microbatch).
    std::vector<std::pair<int32_t, int32_t>> late;  // (tensor, model microbatch)
    for (const Interval& iv : e.intervals) {
      if (!iv.transfer_late || iv.owner_rank != r) continue;
      const Instance& in = problem.instances[ri][static_cast<size_t>(iv.instance)];
      if (!problem.window) {
        late.emplace_back(in.tensor, in.microbatch);
        continue;
      }
      const int32_t chunk = problem.tensors[ri][static_cast<size_t>(in.tensor)].chunk;
      for (int32_t mb : problem.window->ModelMicrobatches(static_cast<int32_t>(r), chunk, in.microbatch)) {
        late.emplace_back(in.tensor, mb);
      }
    }
    std::sort(late.begin(), late.end());
    for (const auto& [t, mb] : late) rp.resident_offloads.emplace_back(problem.tensors[ri][static_cast<size_t>(t)].name, mb);
    plan.ranks.push_back(std::move(rp));
  }

  for (size_t r = 0; r < problem.tensors.size(); ++r) {
    for (size_t t = 0; t < problem.tensors[r].size(); ++t) {
      const SavedTensor& st = problem.tensors[r][t];
      const TensorSpec& spec = layers[static_cast<size_t>(st.layer)].tensors[static_cast<size_t>(st.graph_index)];
      Storage s = solved.assignment.storage[r][t];
      TensorEntry entry;
      entry.name = st.name;
      entry.layer = st.layer;
      entry.module = spec.module;
      entry.pp_rank = static_cast<int64_t>(r);
      entry.chunk = st.chunk;
      entry.shape = spec.shape;
      entry.dtype = spec.dtype;
      entry.bytes = st.bytes;
      entry.policy = st.annotated ? st.annotation : StoragePolicies(s);
      entry.annotation = st.annotation_glob;
      entry.effective = StoragePolicies(s);
      entry.device_bytes = StoredBytes(st, s);
      if (IsRemote(s)) entry.to_pp_rank = solved.assignment.target[r][t];
      plan.tensors.push_back(std::move(entry));
    }
  }
  std::stable_sort(plan.tensors.begin(), plan.tensors.end(),
                   [](const TensorEntry& x, const TensorEntry& y) { return x.layer < y.layer; });

  // An offload that cannot leave in time stays on the device: say so.
  int64_t resident = 0;
  std::string where;
  for (const auto& rp : plan.ranks) {
    resident += static_cast<int64_t>(rp.resident_offloads.size());
    if (!rp.resident_offloads.empty() && where.empty()) {
      where = " (first: pp rank " + std::to_string(rp.pp_rank) + ", " + rp.resident_offloads.front().first + "@mb" +
              std::to_string(rp.resident_offloads.front().second) + ")";
    }
  }
  if (resident > 0) {
    plan.warnings.push_back(std::to_string(resident) +
                            " offloaded instances stay on the device: their copy-out cannot finish before their "
                            "prefetch window opens; PLAN.json lists them per rank (ranks[].resident_offloads)" +
                            where);
  }

  int64_t over = 0;
  const RankPlan* worst = nullptr;
  for (const auto& rp : plan.ranks) {
    if (rp.host_peak > model.hardware.host_memory) {
      // The training state on the host was refused before planning; what
      // is over is offloaded activations (docs/accounting.md §7).
      const int64_t n = model.hardware.gpus_per_node;
      plan.warnings.push_back("pp rank " + std::to_string(rp.pp_rank) + "'s host side needs " +
                              FormatBytes(rp.host_peak) + " per GPU (offloaded activations at their peak " +
                              FormatBytes(rp.host_peak - rp.statics.host) + "), the hardware has " +
                              FormatBytes(model.hardware.host_memory) + " per GPU: " + FormatBytes(rp.host_peak * n) +
                              " of " + FormatBytes(model.hardware.host_memory * n) + " on a node of " +
                              std::to_string(n) + " GPUs");
    }
    if (rp.fits && rp.margin < plan.headroom) {
      plan.warnings.push_back("pp rank " + std::to_string(rp.pp_rank) + " leaves " + FormatBytes(rp.margin) +
                              " at its peak, inside the headroom of " + FormatBytes(plan.headroom) +
                              " (--headroom; docs/targets.md)");
    }
    if (rp.fits) continue;
    ++over;
    if (!worst || rp.peak > worst->peak) worst = &rp;
  }
  if (worst) {
    plan.warnings.push_back(std::to_string(over) + " of " + std::to_string(plan.ranks.size()) +
                            " pp ranks do not fit: " +
                            (model.storage.All() ? std::string("annotations pin what they would need to save")
                                                 : "--storage allows only " + StorageKindsText(model.storage) +
                                                       ", and annotations pin the rest") +
                            " (worst: rank " +
                            std::to_string(worst->pp_rank) + " peaks at " + FormatBytes(worst->peak) + ", budget " +
                            FormatBytes(worst->budget) + ")");
  }

  if (options.sweep) {
    int64_t hi = *std::max_element(keep_all.begin(), keep_all.end());
    int64_t lo = *std::max_element(any.begin(), any.end());
    int n = std::max(2, options.sweep_points);
    PlanOptions quiet = options;
    quiet.verify = false;
    quiet.place_if = nullptr;
    for (int k = 0; k < n; ++k) {
      int64_t framework = hi - static_cast<int64_t>(static_cast<double>(hi - lo) * k / (n - 1));
      StageClock silent(PlanOptions{});
      Solved s = SolveForBudget(problem, framework, quiet, silent);
      SweepPoint pt;
      pt.budget = framework + runtime;  // the device budget that leaves `framework` to the framework
      pt.fits = true;
      for (const auto& b : s.eval.ranks) {
        pt.max_peak = std::max(pt.max_peak, b.peak);
        pt.fits &= b.peak <= framework;
      }
      Overhead o = OverheadOf(problem, s.eval);
      pt.step_s = o.step_s;
      pt.added_s = o.step_s - o.base_step_s;
      plan.sweep.push_back(pt);
    }
  }
  return plan;
}

namespace {

OrderedJson PolicyJson(const std::vector<Policy>& policy) {
  OrderedJson j = OrderedJson::array();
  for (Policy p : policy) j.push_back(PolicyName(p));
  return j;
}

}  // namespace

namespace {

// The host side must fit too (docs/accounting.md section 7): where a rank's
// offloaded activations pass hardware.host_memory at their peak, its
// largest host-offloaded tensors are pinned to recompute (a tensor without
// a recompute chain falls back to keep) and the model re-planned, until
// every rank's host side fits or nothing is left to pin. The pins are
// annotations in the plan's model, so the plan re-makes itself.
Plan FitHost(const Model& input, const PlanOptions& options) {
  if (!GetTarget(input.target.kind).PerTensorStorage()) return PlanFrameworkSettings(input, options);
  Plan plan = BuildPlanOrThrow(input, options);
  const int64_t host = input.hardware.host_memory;
  if (options.deferred &&
      std::any_of(plan.ranks.begin(), plan.ranks.end(),
                  [&](const RankPlan& rp) { return rp.host_peak > host && rp.statics.host <= host; })) {
    *options.deferred = true;
    ThrowError(ErrorCode::kInfeasible, "deferred: its offloads pass the host's memory");
  }
  std::vector<PolicyAnnotation> pins;
  std::set<int64_t> ranks;
  for (int round = 0; round < 8; ++round) {
    size_t added = 0;
    for (const auto& rp : plan.ranks) {
      if (rp.host_peak <= host || rp.statics.host > host) continue;
      ranks.insert(rp.pp_rank);
      int64_t in_flight = 1;
      for (int64_t n : rp.in_flight_chunks) in_flight = std::max(in_flight, n);
      std::vector<const TensorEntry*> offloaded;
      for (const auto& t : plan.tensors) {
        if (t.pp_rank == rp.pp_rank && std::find(t.effective.begin(), t.effective.end(), Policy::kOffloadHost) != t.effective.end()) {
          offloaded.push_back(&t);
        }
      }
      std::stable_sort(offloaded.begin(), offloaded.end(), [](const TensorEntry* a, const TensorEntry* b) { return a->bytes > b->bytes; });
      int64_t freed = 0;
      for (const TensorEntry* t : offloaded) {
        if (freed >= rp.host_peak - host) break;
        pins.push_back({t->name, {Policy::kRecompute}});
        freed += t->bytes * in_flight;
        ++added;
      }
    }
    if (added == 0) break;
    Model pinned = input;
    pinned.policies.insert(pinned.policies.begin(), pins.begin(), pins.end());
    plan = BuildPlanOrThrow(pinned, options);  // options.place_if is asked again: pins only add cost
  }
  if (!pins.empty()) {
    std::string list;
    for (int64_t r : ranks) list += (list.empty() ? "" : ", ") + std::to_string(r);
    plan.warnings.push_back("host memory: " + std::to_string(pins.size()) + " host-offloaded tensors on pp rank(s) " +
                            list + " pinned to recompute so that offloaded activations fit hardware.host_memory (" +
                            FormatBytes(host) + " per GPU); PLAN.json tensors[].annotation names each");
  }
  return plan;
}

}  // namespace

Expected<Plan> BuildPlan(const Model& model, const PlanOptions& options) {
  return CatchErrors([&] {
    if (auto why = GetTarget(model.target.kind).Refusal(model)) {
      // The target in effect is the one at fault: its field, in the model's file.
      ThrowError(ErrorCode::kBadInput, (model.file.empty() ? std::string() : model.file + ": ") + "/target: " +
                                           std::string(TargetName(model.target.kind)) + " refuses the model: " + *why);
    }
    return FitHost(model, options);
  });
}

OrderedJson PlanToJson(const Plan& plan) {
  OrderedJson j;
  j["schema"] = kPlanSchema;
  j["name"] = plan.model.name;
  j["digest"] = plan.digest;
  j["generator"] = "memplan 0.1.0";
  j["activation_model"] = "planned";
  j["solver"] = plan.solver == SolverKind::kExact ? "exact" : "heuristic";
  j["budget"] = plan.model.budget;
  // Written for another target or a given headroom only: memplan's own
  // plans keep their digests (their reserved is their peak).
  const bool reserved_shown = plan.model.target.kind != TargetKind::kMemplan || plan.model.headroom_given;
  if (reserved_shown) {
    j["target"] = TargetName(plan.model.target.kind);
    if (plan.model.target.settings) j["target_settings"] = OrderedJson::parse(SettingsJson(*plan.model.target.settings).dump());
    j["headroom"] = plan.headroom;
  }
  j["totals"] = {{"params", plan.totals.params},
                 {"params_active", plan.totals.params_active},
                 {"layers", plan.model.arch.layers}};
  OrderedJson ranks = OrderedJson::array();
  OrderedJson any = OrderedJson::array();
  for (const auto& r : plan.ranks) {
    OrderedJson rj;
    rj["pp_rank"] = r.pp_rank;
    rj["layers"] = r.layers;
    rj["chunks"] = r.chunks;
    rj["params"] = r.statics.params;
    OrderedJson detail = OrderedJson::object();
    for (const auto& [k, v] : r.statics.buffer_detail) detail[k] = v;
    rj["static"] = {{"weights", r.statics.weights},     {"grads", r.statics.grads},
                    {"optimizer", r.statics.optimizer}, {"buffers", r.statics.buffers},
                    {"total", r.statics.total},         {"buffer_detail", detail}};
    if (r.statics.runtime > 0) {
      // Outside the framework, not in `total` (docs/accounting.md): written
      // only where there is any, so host-preset plans keep their bytes.
      OrderedJson items = OrderedJson::object();
      for (const auto& [k, v] : r.statics.runtime_detail) items[k] = v;
      rj["static"]["runtime"] = r.statics.runtime;
      rj["static"]["runtime_detail"] = std::move(items);
    }
    rj["host"] = r.statics.host;
    rj["host_peak"] = r.host_peak;
    rj["activations_per_microbatch"] = r.activations_per_microbatch;
    rj["in_flight_chunks"] = r.in_flight_chunks;
    rj["activations_peak"] = r.activations_peak;
    rj["peak"] = r.peak;
    if (r.statics.runtime > 0) rj["device_peak"] = r.peak + r.statics.runtime;
    rj["lower_bound"] = r.lower_bound;
    rj["keep_all_lower_bound"] = r.keep_all_lower_bound;
    rj["budget"] = r.budget;
    if (reserved_shown) {
      rj["allocated"] = r.allocated;
      rj["reserved"] = r.reserved;
      rj["margin"] = r.margin;
    }
    rj["fits"] = r.fits;
    OrderedJson remote = OrderedJson::array();
    for (const auto& [to, bytes] : r.remote_offload) remote.push_back({{"to_pp_rank", to}, {"bytes", bytes}});
    rj["remote_offload"] = std::move(remote);
    OrderedJson stuck = OrderedJson::array();
    for (const auto& [tensor, mb] : r.resident_offloads) stuck.push_back({{"tensor", tensor}, {"microbatch", mb}});
    rj["resident_offloads"] = std::move(stuck);
    rj["added_s"] = {{"recompute_s", r.recompute_s},
                     {"quantize_s", r.quantize_s},
                     {"exposed_transfer_s", r.exposed_transfer_s}};
    ranks.push_back(std::move(rj));
    any.push_back(r.any_plan_lower_bound);
  }
  j["ranks"] = std::move(ranks);
  j["any_plan_lower_bound"] = std::move(any);
  j["overhead"] = {{"recompute_s", plan.overhead.recompute_s},
                   {"quantize_s", plan.overhead.quantize_s},
                   {"exposed_transfer_s", plan.overhead.exposed_transfer_s},
                   {"step_s", plan.overhead.step_s},
                   {"base_step_s", plan.overhead.base_step_s},
                   {"emulated_s", plan.overhead.emulated_s},
                   {"comm_s", plan.overhead.comm_s},
                   {"dp_exposed_s", plan.overhead.dp_exposed_s}};
  if (plan.overhead.offload_bw_share < 1) {
    j["overhead"]["offload_bw_share"] = plan.overhead.offload_bw_share;
    j["overhead"]["inter_node_bytes_per_s"] = plan.overhead.inter_node_bytes_per_s;
  }
  {
    const Throughput t = ModelledThroughput(plan.model, plan.totals, plan.overhead.step_s);
    j["throughput"] = {{"tokens_per_s_per_gpu", t.tokens_per_s_per_gpu},
                       {"mfu", t.mfu},
                       {"flops_per_token", t.flops_per_token},
                       {"source", t.source}};
  }
  j["rebalance"] = {{"ratio_before", plan.rebalance.ratio_before},
                    {"ratio_after", plan.rebalance.ratio_after},
                    {"moved_tensors", plan.rebalance.moved_tensors}};
  OrderedJson tensors = OrderedJson::array();
  for (const auto& t : plan.tensors) {
    OrderedJson tj{{"name", t.name},
                   {"layer", t.layer},
                   {"module", t.module},
                   {"pp_rank", t.pp_rank},
                   {"chunk", t.chunk},
                   {"shape", t.shape},
                   {"dtype", DTypeName(t.dtype)},
                   {"bytes", t.bytes},
                   {"policy", PolicyJson(t.policy)},
                   {"effective", PolicyJson(t.effective)},
                   {"device_bytes", t.device_bytes}};
    if (!t.annotation.empty()) tj["annotation"] = t.annotation;
    if (t.to_pp_rank >= 0) tj["to_pp_rank"] = t.to_pp_rank;
    tensors.push_back(std::move(tj));
  }
  j["tensors"] = std::move(tensors);
  OrderedJson schedule = OrderedJson::array();
  for (const auto& rs : plan.schedules) {
    OrderedJson list = OrderedJson::array();
    for (const auto& pass : rs) list.push_back(OrderedJson::array({pass.forward ? "F" : "B", pass.microbatch, pass.chunk}));
    schedule.push_back(std::move(list));
  }
  j["schedule"] = std::move(schedule);
  {
    OrderedJson sim{{"microbatches", plan.simulation.microbatches}, {"simulated", plan.simulation.simulated}};
    if (plan.simulation.period_microbatches > 0) sim["period_microbatches"] = plan.simulation.period_microbatches;
    if (!plan.simulation.fallback.empty()) sim["fallback"] = plan.simulation.fallback;
    j["simulation"] = std::move(sim);
  }
  if (!plan.sweep.empty()) {
    OrderedJson sweep = OrderedJson::array();
    for (const auto& pt : plan.sweep) {
      sweep.push_back({{"budget", pt.budget}, {"fits", pt.fits}, {"max_peak", pt.max_peak},
                       {"added_s", pt.added_s}, {"step_s", pt.step_s}});
    }
    j["sweep"] = std::move(sweep);
  }
  if (plan.verified) j["verified"] = plan.verify_errors.empty();
  if (!plan.warnings.empty()) j["warnings"] = plan.warnings;
  j["model"] = NormalizedModelJson(plan.model);
  return j;
}

Expected<Json> ExpandedModelJson(const Model& model) {
  auto layers = ExpandModel(model);
  if (!layers) return layers.error();
  Json j = NormalizedModelJson(model);
  Json list = Json::array();
  for (const auto& g : *layers) list.push_back(Json::parse(g.ToJson().dump()));
  j["graph"] = {{"layers", list}};
  return j;
}

}  // namespace memplan::planner
