// Schedule, liveness, solver, rebalancing, bounds and verification.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include <random>

#include <cmath>
#include <set>

#include "memplan/common/best_fit_heap.h"

#include "memplan/planner/bounds.h"
#include "memplan/planner/liveness.h"
#include "memplan/planner/plan.h"
#include "memplan/planner/schedule.h"
#include "memplan/planner/solver.h"
#include "memplan/planner/templates.h"
#include "test_util.h"

using namespace memplan;
using namespace memplan::planner;
using memplan::test::MustLoad;
using memplan::test::MustParse;

namespace {

Plan MustPlan(const Model& m, PlanOptions o = {}) {
  auto p = BuildPlan(m, o);
  if (!p) throw std::runtime_error(p.error().message);
  return *p;
}

int64_t MaxOf(const std::vector<RankPlan>& ranks, int64_t RankPlan::*field) {
  int64_t m = 0;
  for (const auto& r : ranks) m = std::max(m, r.*field);
  return m;
}

const char* kSmall[] = {"examples/models/tiny-gpt.json", "examples/models/tiny-moe.json",
                        "tests/data/solver/gpt-pp2.json", "tests/data/solver/llama-pp1.json",
                        "tests/data/solver/moe-pp2-vp2.json"};

}  // namespace

TEST_CASE("1F1B schedules: warm-up counts, in-flight peak, every pass once") {
  for (int64_t pp : {2, 4, 8}) {
    for (int64_t vp : {1, 2, 3}) {
      for (int64_t m : {pp, 2 * pp, 4 * pp}) {
        auto schedules = BuildSchedules(pp, vp, m);
        for (int64_t r = 0; r < pp; ++r) {
          CAPTURE(pp);
          CAPTURE(vp);
          CAPTURE(m);
          CAPTURE(r);
          const auto& s = schedules[static_cast<size_t>(r)];
          REQUIRE(static_cast<int64_t>(s.size()) == 2 * m * vp);
          int64_t warmup = 0;
          while (s[static_cast<size_t>(warmup)].forward) ++warmup;
          int64_t expected = vp == 1 ? std::min(pp - r - 1, m) : std::min(2 * (pp - r - 1) + (vp - 1) * pp, m * vp);
          // The first backward follows the warm-up plus one steady forward.
          CHECK(warmup == std::min(expected + 1, m * vp));
          CHECK(MaxInFlight(s) == (vp == 1 ? std::min(pp - r, m) : std::min(expected + 1, m * vp)));
          // Each (microbatch, chunk) runs forward once, then backward once.
          std::set<std::pair<int, int>> fwd, bwd;
          for (const auto& p : s) {
            CHECK((p.microbatch >= 0 && p.microbatch < m && p.chunk >= 0 && p.chunk < vp));
            auto key = std::make_pair(p.microbatch, p.chunk);
            if (p.forward) {
              CHECK(fwd.insert(key).second);
            } else {
              CHECK(fwd.count(key) == 1);
              CHECK(bwd.insert(key).second);
            }
          }
          CHECK(fwd.size() == static_cast<size_t>(m * vp));
          CHECK(bwd == fwd);
        }
      }
    }
  }
  // Megatron's plain 1F1B on rank 0 of 2 with 4 microbatches.
  auto s = BuildSchedules(2, 1, 4)[0];
  std::vector<PassRef> expect{{true, 0, 0},  {true, 1, 0},  {false, 0, 0}, {true, 2, 0},
                              {false, 1, 0}, {true, 3, 0},  {false, 2, 0}, {false, 3, 0}};
  CHECK(s == expect);
}

// The pipeline part of the time model against the published closed forms
// (Narayanan et al., SC'21): with equal stages taking f forward and b
// backward per microbatch (each of vp chunks f/vp and b/vp), the step is
// m(f + b) plus a bubble of (pp - 1)(f + b)/vp: 1F1B's bubble fraction
// (pp - 1)/(m + pp - 1) of the step, interleaved's (pp - 1)/(vp m) of the
// ideal.
TEST_CASE("pipeline timing reproduces the 1F1B and interleaved bubble closed forms") {
  int checked = 0;
  for (int64_t pp : {2, 3, 4, 8}) {
    for (int64_t vp : {1, 2, 3}) {
      for (int64_t mult : {1, 2, 4}) {
        for (double b : {1.0, 2.0, 3.0}) {
          const int64_t m = pp * mult;
          const double f = 1.0;
          std::vector<double> fwd(static_cast<size_t>(pp * vp), f / static_cast<double>(vp));
          std::vector<double> bwd(static_cast<size_t>(pp * vp), b / static_cast<double>(vp));
          double makespan = 0;
          PassStarts(BuildSchedules(pp, vp, m), pp, vp, m, fwd, bwd, &makespan);
          CAPTURE(pp);
          CAPTURE(vp);
          CAPTURE(m);
          CAPTURE(b);
          const double ideal = static_cast<double>(m) * (f + b);
          const double pd = static_cast<double>(pp - 1);
          if (vp == 1) {
            CHECK((makespan - ideal) / makespan == doctest::Approx(pd / static_cast<double>(m + pp - 1)).epsilon(1e-12));
          } else {
            CHECK((makespan - ideal) / ideal ==
                  doctest::Approx(pd / static_cast<double>(vp * m)).epsilon(1e-12));
          }
          ++checked;
        }
      }
    }
  }
  CHECK(checked == 108);
}

TEST_CASE("FP8 blockwise footprint is 1.03125 B/element, tails padded per row") {
  CHECK(Fp8Bytes({4, 256}) * 32 == 4 * 256 * 33);
  CHECK(Fp8Bytes({3, 130}) == 3 * 130 + 3 * 2 * 4);
  CHECK(Fp8Bytes({2, 8, 16, 64}) == 2 * 8 * 16 * (64 + 4));
}

TEST_CASE("laws: peak >= lower bound >= any-plan lower bound; the plan verifies") {
  for (const char* file : kSmall) {
    CAPTURE(file);
    Model m = MustLoad(file);
    PlanOptions o;
    o.verify = true;
    Plan keep = MustPlan(m, o);
    // A budget halfway between the any-plan bound and keep-all forces decisions.
    int64_t lo = MaxOf(keep.ranks, &RankPlan::any_plan_lower_bound);
    int64_t hi = MaxOf(keep.ranks, &RankPlan::keep_all_lower_bound);
    for (int64_t budget : {hi, lo + (hi - lo) / 2, lo + (hi - lo) / 5}) {
      o.budget = budget;
      Plan p = MustPlan(m, o);
      CHECK(p.verify_errors.empty());
      for (const auto& r : p.ranks) {
        CHECK(r.peak >= r.lower_bound);
        CHECK(r.lower_bound >= r.any_plan_lower_bound);
        CHECK(r.keep_all_lower_bound >= r.any_plan_lower_bound);
        CHECK(r.budget == budget);
      }
    }
  }
}

TEST_CASE("the solver fits budgets between the any-plan bound and keep-all, at growing cost") {
  Model m = MustLoad("tests/data/solver/gpt-pp2.json");
  Plan keep = MustPlan(m);
  int64_t lo = MaxOf(keep.ranks, &RankPlan::any_plan_lower_bound);
  int64_t hi = MaxOf(keep.ranks, &RankPlan::keep_all_lower_bound);
  Plan loose = MustPlan(m, PlanOptions{hi});
  Plan tight = MustPlan(m, PlanOptions{lo + (hi - lo) / 4});
  for (const auto& r : loose.ranks) CHECK(r.fits);
  CHECK(loose.overhead.step_s == doctest::Approx(loose.overhead.base_step_s));
  for (const auto& r : tight.ranks) CHECK(r.fits);
  CHECK(tight.overhead.step_s > loose.overhead.step_s);
  int64_t changed = 0, fp8 = 0, recompute = 0;
  for (const auto& t : tight.tensors) {
    changed += t.effective != std::vector<Policy>{Policy::kKeep};
    if (t.effective == std::vector<Policy>{Policy::kKeep}) CHECK(t.device_bytes == t.bytes);
    if (t.effective == std::vector<Policy>{Policy::kFp8}) {
      ++fp8;
      CHECK(t.device_bytes < t.bytes);
    }
    if (t.effective == std::vector<Policy>{Policy::kRecompute}) {
      ++recompute;
      CHECK(t.device_bytes == 0);
    }
  }
  CHECK(changed > 0);
  CHECK(fp8 + recompute > 0);
}

TEST_CASE("a budget below the any-plan lower bound is infeasible, with the gap") {
  Model m = MustLoad("examples/models/tiny-gpt.json");
  Plan keep = MustPlan(m);
  int64_t lo = MaxOf(keep.ranks, &RankPlan::any_plan_lower_bound);
  auto p = BuildPlan(m, PlanOptions{lo - 1});
  REQUIRE_FALSE(p.ok());
  CHECK(p.error().code == ErrorCode::kInfeasible);
  CHECK(p.error().message.find("infeasible") != std::string::npos);
  CHECK(p.error().message.find("short") != std::string::npos);
  CHECK(BuildPlan(m, PlanOptions{lo}).ok());
}

TEST_CASE("annotations are constraints: pinned tensors make a rank not fit, with a warning") {
  Json j = memplan::test::BaseModel();
  j["hardware"] = {{"preset", "host"}};
  j["policies"] = {{{"match", "*"}, {"policy", "keep"}}};
  Model m = MustParse(j);
  Plan keep = MustPlan(m);
  int64_t lo = MaxOf(keep.ranks, &RankPlan::any_plan_lower_bound);
  int64_t hi = MaxOf(keep.ranks, &RankPlan::keep_all_lower_bound);
  Plan p = MustPlan(m, PlanOptions{(lo + hi) / 2});
  bool any_unfit = false;
  for (const auto& r : p.ranks) any_unfit |= !r.fits;
  CHECK(any_unfit);
  bool warned = false;
  for (const auto& w : p.warnings) warned |= w.find("do not fit") != std::string::npos;
  CHECK(warned);
  for (const auto& t : p.tensors) CHECK(t.effective == std::vector<Policy>{Policy::kKeep});
}

TEST_CASE("illegal annotations fall back to the nearest legal storage") {
  Json j = memplan::test::BaseModel();
  j["parallel"] = {{"pp", 1}};
  j["policies"] = {{{"match", "*mask*"}, {"policy", "fp8"}},
                   {{"match", "layer0.embed.tokens"}, {"policy", "recompute"}},
                   {{"match", "*.ffn_norm.x"}, {"policy", "offload_remote"}},
                   {{"match", "*.fc1_out"}, {"policy", {"fp8", "offload_host"}}}};
  Plan p = MustPlan(MustParse(j));
  int masks = 0, tokens = 0, norms = 0, fc1 = 0;
  for (const auto& t : p.tensors) {
    if (t.name.find("mask") != std::string::npos) {
      ++masks;
      CHECK(t.policy == std::vector<Policy>{Policy::kFp8});
      CHECK(t.effective == std::vector<Policy>{Policy::kKeep});  // no fp8 of a u8 mask
    }
    if (t.name == "layer0.embed.tokens") {
      ++tokens;
      CHECK(t.effective == std::vector<Policy>{Policy::kKeep});
    }
    if (t.module == "ffn_norm") {
      ++norms;
      CHECK(t.effective == std::vector<Policy>{Policy::kOffloadHost});  // pp = 1
    }
    if (t.name.find(".fc1_out") != std::string::npos) {
      ++fc1;
      CHECK(t.effective == std::vector<Policy>{Policy::kFp8, Policy::kOffloadHost});
      CHECK(t.device_bytes == 0);
    }
  }
  CHECK(masks > 0);
  CHECK(tokens == 1);
  CHECK(norms > 0);
  CHECK(fc1 > 0);
}

TEST_CASE("one storage rule: --verify refuses what the runtime refuses, with the reason") {
  // tiny-attnres (pp 2): the Block AttnRes partials and the embedding's
  // output are read in place by later layers, so they are only kept.
  Model m = MustLoad("examples/models/tiny-attnres.json");
  PlanningProblem p = BuildProblem(m, *ExpandModel(m));
  int shared = 0, checked = 0;
  for (size_t r = 0; r < p.tensors.size(); ++r) {
    for (size_t t = 0; t < p.tensors[r].size(); ++t) {
      const SavedTensor& st = p.tensors[r][t];
      for (Storage s : {Storage::kKeep, Storage::kRecompute, Storage::kFp8, Storage::kOffloadHost,
                        Storage::kOffloadRemote, Storage::kFp8OffloadHost, Storage::kFp8OffloadRemote}) {
        const int32_t other = r == 0 ? 1 : 0;
        auto why = StorageRefusal(st, s, 2, static_cast<int32_t>(r), other);
        CHECK(why.has_value() == !Legal(st, s, 2));  // one rule, two spellings
        ++checked;
      }
      if (!st.shared) continue;
      ++shared;
      auto why = StorageRefusal(st, Storage::kOffloadRemote, 2, static_cast<int32_t>(r), r == 0 ? 1 : 0);
      REQUIRE(why.has_value());
      CHECK(why->find(st.name + " cannot be stored as offload_remote (later layers read it in place") == 0);
      // --verify says the same.
      Assignment a = Assignment::KeepAll(p);
      a.storage[r][t] = Storage::kOffloadRemote;
      a.target[r][t] = r == 0 ? 1 : 0;
      Evaluation e = Evaluate(p, a, true);
      REQUIRE(!e.verify_errors.empty());
      CHECK(e.verify_errors.front().find(*why) != std::string::npos);
    }
  }
  CHECK(shared >= 2);
  CHECK(checked > 100);
  // A remote target that is not another rank.
  const SavedTensor& any = *std::find_if(p.tensors[0].begin(), p.tensors[0].end(),
                                         [](const SavedTensor& t) { return Legal(t, Storage::kOffloadRemote, 2); });
  auto self = StorageRefusal(any, Storage::kOffloadRemote, 2, 0, 0);
  REQUIRE(self.has_value());
  CHECK(self->find("to_pp_rank 0 is not another pipeline rank (0..1)") != std::string::npos);
}

// The solver corpus: small models (dense, MoE, Block AttnRes, MLA, pp 1 and
// 2, vp 1 and 2) at activation budgets a quarter, half and three quarters
// of the way from each rank's any-plan bound to its keep-all peak. Both
// solvers get the same problem (Solve with the same per-rank budgets, no
// fragmentation loop), so their objectives are comparable: the separable
// cost of docs/planner.md, "What --solver exact optimizes".
const char* kSolverCorpus[] = {"tests/data/solver/gpt-pp2.json",   "tests/data/solver/llama-pp1.json",
                               "tests/data/solver/moe-pp2-vp2.json", "examples/models/tiny-moe.json",
                               "examples/models/tiny-attnres.json",  "examples/models/tiny-mla.json",
                               "examples/models/tiny-deepseek.json"};

// Each rank's activation budget `f` of the way from its any-plan bound to
// its keep-all peak.
std::vector<int64_t> BudgetsBetweenBounds(const PlanningProblem& p, double f) {
  Evaluation keep = Evaluate(p, Assignment::KeepAll(p), false);
  std::vector<int64_t> budgets;
  for (size_t r = 0; r < p.tensors.size(); ++r) {
    const int64_t lo = p.any_plan_lower_bound[r] - p.statics[r].total, hi = keep.ranks[r].activations_peak;
    REQUIRE(lo <= hi);
    budgets.push_back(lo + static_cast<int64_t>(f * static_cast<double>(hi - lo)));
  }
  return budgets;
}

TEST_CASE("exact is optimal for its objective: never worse than the heuristic; the heuristic's gap is bounded") {
  if (!ExactSolverAvailable()) {
    // A skip, not a pass: Meson counts exit 77 as skipped.
    std::fprintf(stderr, "SKIPPED: built without CBC, no exact solver to compare with\n");
    std::exit(77);
  }
  int compared = 0, nonzero = 0, heuristic_misses = 0, within_1pct = 0;
  double worst_gap = 0, sum_h = 0, sum_x = 0;
  for (const char* file : kSolverCorpus) {
    Model m = MustLoad(file);
    auto expanded = ExpandModel(m);
    REQUIRE(expanded.ok());
    PlanningProblem p = BuildProblem(m, std::move(*expanded));
    for (double f : {0.25, 0.5, 0.75}) {
      const std::vector<int64_t> budgets = BudgetsBetweenBounds(p, f);
      Assignment ah = Assignment::Annotated(p), ax = Assignment::Annotated(p);
      auto h = Solve(p, budgets, SolverKind::kHeuristic, &ah);
      auto x = Solve(p, budgets, SolverKind::kExact, &ax);
      REQUIRE(h.size() == x.size());
      for (size_t r = 0; r < h.size(); ++r) {
        CAPTURE(std::string(file));
        CAPTURE(f);
        CAPTURE(r);
        CAPTURE(h[r].cost_s);
        CAPTURE(x[r].cost_s);
        // Both must fit: the budgets lie above the any-plan bound.
        heuristic_misses += h[r].fits ? 0 : 1;
        CHECK(x[r].fits);
        // The MILP starts from the heuristic's solution: never worse.
        CHECK(x[r].cost_s <= h[r].cost_s * (1 + 1e-9) + 1e-12);
        double gap = x[r].cost_s > 0 ? h[r].cost_s / x[r].cost_s - 1 : (h[r].cost_s > 0 ? 1.0 : 0.0);
        worst_gap = std::max(worst_gap, gap);
        within_1pct += gap <= 0.01 ? 1 : 0;
        sum_h += h[r].cost_s;
        sum_x += x[r].cost_s;
        nonzero += x[r].cost_s > 0 ? 1 : 0;
        ++compared;
      }
    }
  }
  MESSAGE("solver corpus: " << compared << " rank problems (" << nonzero << " with a cost), heuristic "
                            << 1e3 * sum_h << " ms against exact " << 1e3 * sum_x << " ms in total, worst gap "
                            << 100 * worst_gap << " %, " << within_1pct << " within 1 %");
  CHECK(compared == 39);  // 7 models x 3 budgets, 13 ranks
  CHECK(nonzero >= 20);
  // Measured 2026-12-03, with the excess-area repair on small ranks
  // (docs/planner.md, "Heuristic vs MILP"): total +0.02 %, 38 of 39
  // problems within 1 %, the worst +2.1 % (tiny-moe, 25 % between the
  // bounds, rank 0); the day before, with the peak-step greedy alone:
  // +90 %, worst +176 %, one budget missed.
  // 2026-12-06, the exchange trial repaired by the excess area where the
  // peak greedy does not pay, and a third start from free host offloads:
  // every problem at the exact cost.
  CHECK(heuristic_misses == 0);
  CHECK(sum_h <= 1.001 * sum_x);
  CHECK(within_1pct == 39);
  CHECK(worst_gap <= 0.001);
}

// End to end (fragmentation loop, queues, rebalancing outside the MILP):
// where exact's plan fits, the heuristic's fits too.
TEST_CASE("end to end: where the exact plan fits, the heuristic's fits") {
  if (!ExactSolverAvailable()) {
    MESSAGE("SKIPPED: built without CBC");
    return;
  }
  int compared = 0;
  for (const char* file : {"tests/data/solver/gpt-pp2.json", "tests/data/solver/llama-pp1.json",
                           "tests/data/solver/moe-pp2-vp2.json", "examples/models/tiny-moe.json"}) {
    Model m = MustLoad(file);
    Plan keep = MustPlan(m);
    int64_t lo = MaxOf(keep.ranks, &RankPlan::any_plan_lower_bound);
    int64_t hi = MaxOf(keep.ranks, &RankPlan::keep_all_lower_bound);
    for (double f : {0.2, 0.5, 0.8}) {
      int64_t budget = lo + static_cast<int64_t>(f * static_cast<double>(hi - lo));
      CAPTURE(file);
      CAPTURE(f);
      PlanOptions h{budget};
      PlanOptions x{budget};
      x.solver = SolverKind::kExact;
      Plan ph = MustPlan(m, h);
      Plan px = MustPlan(m, x);
      bool h_fits = true, x_fits = true;
      for (const auto& r : ph.ranks) h_fits &= r.fits;
      for (const auto& r : px.ranks) x_fits &= r.fits;
      CHECK((h_fits || !x_fits));
      ++compared;
    }
  }
  CHECK(compared == 12);
}

TEST_CASE("pipeline rebalancing offloads from early ranks into later ranks' spare memory") {
  // Interleaved 1F1B loads rank 0 far more than the last rank.
  // On the host preset the pipeline link is fast relative to compute, so
  // remote copies hide inside the prefetch windows; a slow PCIe link makes
  // host offload useless, so without rebalancing rank 0 pays in recompute
  // and fp8.
  Json j = memplan::test::BaseModel();
  j["hardware"] = {{"preset", "host"}, {"d2h_bw", "1MB/s"}, {"h2d_bw", "1MB/s"}};
  j["arch"]["layers"] = 16;
  j["parallel"] = {{"pp", 4}, {"vp", 2}};
  j["train"]["microbatches"] = 16;
  Model balanced = MustParse(j);
  j["options"] = {{"pp_balance", false}};
  Model plain = MustParse(j);
  Plan keep = MustPlan(plain);
  // A budget rank 0 cannot meet keeping everything, the last rank easily can.
  int64_t budget = (keep.ranks[0].keep_all_lower_bound + keep.ranks[3].keep_all_lower_bound) / 2;
  Plan without = MustPlan(plain, PlanOptions{budget});
  Plan with = MustPlan(balanced, PlanOptions{budget});
  CHECK(with.rebalance.moved_tensors > 0);
  CHECK(with.rebalance.ratio_after < with.rebalance.ratio_before);
  CHECK(with.overhead.step_s < without.overhead.step_s);
  int64_t remote = 0;
  for (const auto& t : with.tensors) {
    if (t.effective.back() != Policy::kOffloadRemote) continue;
    CHECK(t.to_pp_rank > t.pp_rank);
    ++remote;
  }
  CHECK(remote == with.rebalance.moved_tensors);
  CHECK_FALSE(with.ranks[0].remote_offload.empty());
  for (const auto& r : with.ranks) CHECK(r.fits);
}

TEST_CASE("sweep: from keep-all (no added time) down to the any-plan lower bound") {
  Model m = MustLoad("tests/data/solver/gpt-pp2.json");
  PlanOptions o;
  o.sweep = true;
  o.sweep_points = 6;
  Plan p = MustPlan(m, o);
  REQUIRE(p.sweep.size() == 6);
  CHECK(p.sweep.front().fits);
  CHECK(p.sweep.front().added_s == doctest::Approx(0));
  CHECK(p.sweep.back().budget == MaxOf(p.ranks, &RankPlan::any_plan_lower_bound));
  for (size_t i = 1; i < p.sweep.size(); ++i) CHECK(p.sweep[i].budget < p.sweep[i - 1].budget);
  // At the any-plan bound something must cost time (or no longer fit).
  CHECK((p.sweep.back().added_s > 0 || !p.sweep.back().fits));
  // A smaller budget never costs less time.
  for (size_t i = 1; i < p.sweep.size(); ++i) {
    CAPTURE(i);
    CHECK(p.sweep[i].added_s >= p.sweep[i - 1].added_s - 1e-12);
  }
}

TEST_CASE("a budget above device memory is a what-if plan with a warning") {
  Model m = MustLoad("examples/models/tiny-gpt.json");
  Plan p = MustPlan(m, PlanOptions{m.hardware.device_memory * 2});
  bool warned = false;
  for (const auto& w : p.warnings) warned |= w.find("what-if") != std::string::npos;
  CHECK(warned);
  for (const auto& r : p.ranks) CHECK(r.fits);
}

TEST_CASE("offloaded instances leave the device between copy-out and prefetch") {
  Json j = memplan::test::BaseModel();
  j["hardware"] = {{"preset", "host"}};
  j["parallel"] = {{"pp", 1}};
  j["train"]["microbatches"] = 4;
  j["policies"] = {{{"match", "*.fc1_out"}, {"policy", "offload_host"}}};
  Model m = MustParse(j);
  auto layers = *ExpandModel(m);
  PlanningProblem prob = BuildProblem(m, layers);
  Assignment a = Assignment::Annotated(prob);
  std::vector<Interval> ivs;
  TransferStats stats;
  InstanceIntervals(prob, a, 0, &ivs, &stats);
  int64_t split = 0;
  for (size_t t = 0; t < prob.tensors[0].size(); ++t) {
    if (prob.tensors[0][t].name.find("fc1_out") == std::string::npos) continue;
    CHECK(a.storage[0][t] == Storage::kOffloadHost);
    for (int32_t i = prob.first_instance[0][t]; i < prob.first_instance[0][t + 1]; ++i) {
      int n = 0;
      for (const auto& iv : ivs) n += iv.instance == i && iv.owner_rank == 0;
      split += n == 2;
    }
  }
  CHECK(split > 0);
  // The host preset's copy queues hide these copies; at 1 MB/s they cannot.
  CHECK(stats.exposed_s == doctest::Approx(0));
  j["hardware"] = {{"preset", "host"}, {"d2h_bw", "1MB/s"}, {"h2d_bw", "1MB/s"}};
  Model slow_m = MustParse(j);
  PlanningProblem slow = BuildProblem(slow_m, *ExpandModel(slow_m));
  std::vector<Interval> slow_ivs;
  TransferStats slow_stats;
  InstanceIntervals(slow, Assignment::Annotated(slow), 0, &slow_ivs, &slow_stats);
  CHECK(slow_stats.exposed_s > stats.exposed_s);
}

TEST_CASE("the best-fit heap reuses freed space and reports its high-water mark") {
  BestFitHeap heap(1);
  int64_t a = heap.Allocate(100);
  int64_t b = heap.Allocate(50);
  int64_t c = heap.Allocate(100);
  CHECK(a == 0);
  CHECK(b == 100);
  CHECK(c == 150);
  heap.Free(b);
  CHECK(heap.Allocate(40) == 100);  // best fit: the 50-byte hole
  heap.Free(c);
  heap.AllocateAndFree(500);  // from the top, absorbing c's hole: 140 + 500
  CHECK(heap.high_water() == 640);
  CHECK(heap.allocated_bytes() == 140);
  heap.Free(a);
  CHECK(heap.Allocate(100) == 0);
}

TEST_CASE("an untracked best-fit heap places exactly as a tracked one") {
  // Random interleavings of allocations and frees, coalescing on both sides.
  std::mt19937 rng(7);
  BestFitHeap tracked, untracked(256, /*track_allocations=*/false);
  std::vector<std::pair<int64_t, int64_t>> live;  // (offset, bytes)
  int64_t max_end = 0;                            // highest offset + aligned size
  for (int i = 0; i < 20000; ++i) {
    if (live.empty() || rng() % 3 != 0) {
      int64_t bytes = 1 + static_cast<int64_t>(rng() % 5000);
      int64_t off = tracked.Allocate(bytes);
      REQUIRE(untracked.Allocate(bytes) == off);
      live.emplace_back(off, bytes);
      max_end = std::max(max_end, off + tracked.AlignedSize(bytes));
    } else {
      size_t k = rng() % live.size();
      tracked.Free(live[k].first, live[k].second);
      untracked.Free(live[k].first, live[k].second);
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(k));
    }
    REQUIRE(tracked.allocated_bytes() == untracked.allocated_bytes());
  }
  CHECK(tracked.high_water() == untracked.high_water());
  CHECK(tracked.high_water() == max_end);
}

// Random small models the corpus has not seen (dense, MoE, MLA, AttnRes;
// 1-4 pipeline stages, interleaved or not) at random budgets between the
// any-plan bound and keep-all: the heuristic's cost against the exact
// solver's, per rank. Prints the worst case's seed; MEMPLAN_SOLVER_SEED=S
// replays one case.
TEST_CASE("exact is optimal on random small models: the heuristic's gap, seeded") {
  if (!ExactSolverAvailable()) {
    std::fprintf(stderr, "SKIPPED: built without CBC, no exact solver to compare with\n");
    std::exit(77);
  }
  const char* kinds[] = {"examples/models/tiny-llama.json", "examples/models/tiny-moe.json",
                         "examples/models/tiny-mla.json", "examples/models/tiny-attnres.json"};
  constexpr uint32_t kBase = 20261206;
  std::vector<uint32_t> seeds;
  if (const char* one = std::getenv("MEMPLAN_SOLVER_SEED")) {
    seeds.push_back(static_cast<uint32_t>(std::strtoul(one, nullptr, 10)));
  } else {
    for (uint32_t i = 0; i < 48; ++i) seeds.push_back(kBase + i);
  }
  int compared = 0, with_cost = 0, within_1pct = 0, heuristic_misses = 0, infeasible = 0;
  double worst = 1, sum_h = 0, sum_x = 0;
  uint32_t worst_seed = 0;
  std::set<std::string> kinds_seen;
  for (uint32_t seed : seeds) {
    std::mt19937 rng(seed);
    auto pick = [&](std::vector<int64_t> v) { return v[std::uniform_int_distribution<size_t>(0, v.size() - 1)(rng)]; };
    const char* file = kinds[seed % 4];
    Json j = memplan::test::ReadJson(file);
    const int64_t pp = pick({1, 2, 3, 4});
    const int64_t vp = pp > 1 ? pick({1, 2}) : 1;
    j["arch"]["layers"] = pp * vp * pick({1, 2});
    if (j["arch"].contains("moe") && j["arch"]["moe"].contains("first_dense_layers")) j["arch"]["moe"]["first_dense_layers"] = 0;
    j["train"]["micro_batch"] = pick({1, 2, 4});
    j["train"]["microbatches"] = pp * pick({1, 2, 3});
    j["train"]["seq_len"] = pick({32, 64, 128, 256});
    j["train"]["act_dtype"] = pick({0, 1}) ? "bf16" : "fp32";
    j["arch"]["ffn_hidden"] = pick({128, 256, 512});
    if (j["arch"].contains("moe")) {
      j["arch"]["moe"]["experts"] = pick({4, 8, 16});
      j["arch"]["moe"]["top_k"] = pick({1, 2});
      j["arch"]["moe"]["expert_ffn_hidden"] = pick({32, 64, 128});
    }
    j["parallel"]["pp"] = pp;
    j["parallel"]["vp"] = vp;
    j["parallel"].erase("pp_layout");
    j.erase("budget");
    j.erase("policies");
    // From a quarter of the way above the any-plan bound (the bound is not
    // always reachable by per-rank decisions) to near keep-all.
    const double f = std::uniform_real_distribution<double>(0.25, 0.9)(rng);
    CAPTURE(seed);
    CAPTURE(file);
    CAPTURE(pp);
    CAPTURE(vp);
    CAPTURE(f);
    auto parsed = ParseModel(j, file);
    REQUIRE(parsed.ok());
    auto expanded = ExpandModel(*parsed);
    REQUIRE(expanded.ok());
    PlanningProblem p = BuildProblem(*parsed, std::move(*expanded));
    const std::vector<int64_t> budgets = BudgetsBetweenBounds(p, f);
    Assignment ah = Assignment::Annotated(p), ax = Assignment::Annotated(p);
    auto h = Solve(p, budgets, SolverKind::kHeuristic, &ah);
    auto x = Solve(p, budgets, SolverKind::kExact, &ax);
    REQUIRE(h.size() == x.size());
    kinds_seen.insert(file);
    for (size_t r = 0; r < h.size(); ++r) {
      CAPTURE(r);
      if (!x[r].fits) {  // no decisions fit: nothing to compare
        CHECK(!h[r].fits);
        ++infeasible;
        continue;
      }
      CHECK(x[r].cost_s <= h[r].cost_s * (1 + 1e-9) + 1e-12);
      heuristic_misses += h[r].fits ? 0 : 1;
      const double ratio = x[r].cost_s > 0 ? h[r].cost_s / x[r].cost_s : (h[r].cost_s > 0 ? 2.0 : 1.0);
      if (ratio > worst) worst = ratio, worst_seed = seed;
      within_1pct += ratio <= 1.01 ? 1 : 0;
      with_cost += x[r].cost_s > 0 ? 1 : 0;
      sum_h += h[r].cost_s;
      sum_x += x[r].cost_s;
      ++compared;
    }
  }
  MESSAGE("random small models: " << compared << " rank problems (" << with_cost << " with a cost), heuristic "
                                  << 1e3 * sum_h << " ms against exact " << 1e3 * sum_x << " ms, worst "
                                  << worst << "x (MEMPLAN_SOLVER_SEED=" << worst_seed << "), " << within_1pct
                                  << " within 1 %, " << infeasible << " infeasible for both");
  if (seeds.size() > 1) {
    CHECK(kinds_seen.size() == 4);
    CHECK(compared >= 40);
    CHECK(with_cost >= 15);
  }
  // Measured 2026-12-06 (docs/planner.md, "Heuristic vs MILP"): 122 rank
  // problems, total +0.14 %, 121 within 1 %, worst 1.055x (seed 20261213).
  // The goal is 1.01x everywhere: not met yet.
  CHECK(heuristic_misses == 0);
  CHECK(sum_h <= 1.005 * sum_x);
  CHECK(worst <= 1.06);
  if (seeds.size() > 1) CHECK(within_1pct >= compared * 95 / 100);
}
