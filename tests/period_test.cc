// The periodic window (planner/period.h, docs/planner.md "Periodic window"):
// a plan that simulates a few microbatches must be, number for number, the
// plan that simulates all of them (the oracle, PlanOptions::full_simulation).
#include <doctest/doctest.h>

#include <cmath>
#include <random>

#include "memplan/planner/plan.h"
#include "memplan/planner/program.h"
#include "json_test_util.h"
#include "test_util.h"

using namespace memplan;
using namespace memplan::planner;
using memplan::test::MustParse;
using memplan::test::ReadJson;

namespace {

Plan MustPlan(const Model& m, PlanOptions o = {}) {
  auto p = BuildPlan(m, o);
  if (!p) throw std::runtime_error(p.error().message);
  return *p;
}

PlanOptions Full() {
  PlanOptions o;
  o.full_simulation = true;
  return o;
}

PlanOptions Verified() {
  PlanOptions o;
  o.verify = true;
  return o;
}

bool Near(double x, double y) { return std::abs(x - y) <= 1e-9 * std::max({std::abs(x), std::abs(y), 1e-300}); }

// Every number a user reads in the two plans; returns how many it compared.
int CompareWithOracle(const Plan& window, const Plan& full) {
  int checked = 0;
  REQUIRE(window.tensors.size() == full.tensors.size());
  for (size_t t = 0; t < full.tensors.size(); ++t) {
    CAPTURE(full.tensors[t].name);
    CHECK(window.tensors[t].effective == full.tensors[t].effective);
    CHECK(window.tensors[t].to_pp_rank == full.tensors[t].to_pp_rank);
    ++checked;
  }
  REQUIRE(window.ranks.size() == full.ranks.size());
  for (size_t r = 0; r < full.ranks.size(); ++r) {
    const RankPlan& w = window.ranks[r];
    const RankPlan& f = full.ranks[r];
    CAPTURE(r);
    CHECK(w.peak == f.peak);
    CHECK(w.lower_bound == f.lower_bound);
    CHECK(w.activations_peak == f.activations_peak);
    CHECK(w.any_plan_lower_bound == f.any_plan_lower_bound);
    CHECK(w.keep_all_lower_bound == f.keep_all_lower_bound);
    CHECK(Near(w.recompute_s, f.recompute_s));
    CHECK(Near(w.quantize_s, f.quantize_s));
    CHECK(Near(w.exposed_transfer_s, f.exposed_transfer_s));
    CHECK(w.resident_offloads == f.resident_offloads);
    CHECK(w.remote_offload == f.remote_offload);
    checked += 10;
  }
  CHECK(Near(window.overhead.step_s, full.overhead.step_s));
  CHECK(Near(window.overhead.emulated_s, full.overhead.emulated_s));
  CHECK(Near(window.overhead.comm_s, full.overhead.comm_s));
  return checked + 3;
}

}  // namespace

TEST_CASE("periodic window: on random small models, layouts and budgets, the window's numbers are every microbatch's") {
  std::mt19937 rng(20261203);
  auto pick = [&](std::vector<int64_t> v) { return v[std::uniform_int_distribution<size_t>(0, v.size() - 1)(rng)]; };
  const char* bases[] = {"tiny-gpt", "tiny-llama", "tiny-moe", "tiny-k3", "tiny-attnres", "tiny-deepseek", "tiny-mla"};
  int plans = 0, windows = 0, numbers = 0, identical = 0;
  double worst_ratio = 0;
  for (int trial = 0; trial < 28; ++trial) {
    Json j = ReadJson(std::string("examples/models/") + bases[trial % 7] + ".json");
    const int64_t pp = pick({2, 4});
    const int64_t vp = j["arch"]["layers"].get<int64_t>() >= 2 * pp ? pick({1, 2}) : 1;
    j["parallel"]["pp"] = pp;
    j["parallel"]["vp"] = vp;
    j["train"]["microbatches"] = pp * pick({6, 8, 12, 16});
    j.erase("pp_layout");
    j.erase("budget");
    if (!j.contains("options")) j["options"] = Json::object();
    j["options"]["pp_balance"] = pick({0, 1}) == 1;
    const Model roomy = MustParse(j);
    // A budget between the any-plan bound and keep-all, where the solver works.
    const Plan keep = MustPlan(roomy, Full());
    int64_t lo = 0, hi = 0;
    for (const RankPlan& r : keep.ranks) {
      lo = std::max(lo, r.any_plan_lower_bound);
      hi = std::max(hi, r.keep_all_lower_bound);
    }
    PlanOptions o;
    o.budget = lo + static_cast<int64_t>(std::uniform_real_distribution<double>(0.1, 1.1)(rng) * static_cast<double>(hi - lo));
    CAPTURE(trial);
    CAPTURE(j.dump());
    CAPTURE(*o.budget);
    o.verify = true;  // also checks the window's numbers against every microbatch (VerifyWindow)
    const Plan window = MustPlan(roomy, o);
    CHECK(window.verify_errors.empty());
    o.verify = false;
    o.full_simulation = true;
    const Plan full = MustPlan(roomy, o);
    CHECK(full.simulation.simulated == full.simulation.microbatches);
    windows += window.simulation.simulated < window.simulation.microbatches;
    bool same = true;
    for (size_t t = 0; t < full.tensors.size(); ++t) same &= window.tensors[t].effective == full.tensors[t].effective;
    if (same) {
      numbers += CompareWithOracle(window, full);
      ++identical;
    } else {
      // The solvers' repair passes weigh excess bytes over every step, and the
      // window has fewer: another plan, whose numbers --verify checked above
      // against every microbatch. It must be about as good (docs/planner.md:
      // the worst seen is +1.6 %, tiny-attnres with AttnRes per sublayer).
      CHECK(window.overhead.step_s <= full.overhead.step_s * 1.02);
      worst_ratio = std::max(worst_ratio, window.overhead.step_s / full.overhead.step_s);
      bool window_fits = true, full_fits = true;
      for (const RankPlan& r : window.ranks) window_fits &= r.fits;
      for (const RankPlan& r : full.ranks) full_fits &= r.fits;
      CHECK((window_fits || !full_fits));
    }
    ++plans;
  }
  CHECK(plans == 28);
  CHECK(windows >= 14);    // most of these layouts have a steady state to cut
  CHECK(identical >= 20);  // and the solvers decide the same on the window
  CHECK(numbers >= 2000);
  MESSAGE(plans << " plans, " << windows << " with a periodic window, " << identical << " with the same decisions, "
                << numbers << " numbers compared; the others' step at most " << worst_ratio << " x the full plan's");
}

TEST_CASE("periodic window: the model's program is streamed, not the window's: a wrong expansion rule is caught") {
  Json j = ReadJson("examples/models/tiny-gpt.json");
  j["train"]["microbatches"] = 64;
  const Model m = MustParse(j);
  const Plan good = MustPlan(m, Verified());
  REQUIRE(good.simulation.simulated < 64);
  CHECK(good.simulation.period_microbatches == 1);
  CHECK(good.verify_errors.empty());
  const Plan full = MustPlan(m, Full());
  CompareWithOracle(good, full);
  // Buffers from before the repeated period kept one period longer: the
  // streamed peak grows and --verify says where.
  testing::SkewPeriodicExpansion(70);
  const Plan bad = MustPlan(m, Verified());
  testing::SkewPeriodicExpansion(0);
  REQUIRE(!bad.verify_errors.empty());
  CHECK(bad.verify_errors.front().find("peak") != std::string::npos);
  CHECK(bad.ranks[0].peak > full.ranks[0].peak);
}

TEST_CASE("periodic window: too few microbatches for a steady state simulate every one") {
  Json j = ReadJson("examples/models/tiny-gpt.json");
  for (int64_t mbs : {2, 4, 6}) {
    j["train"]["microbatches"] = mbs;
    const Plan p = MustPlan(MustParse(j));
    CAPTURE(mbs);
    CHECK(p.simulation.microbatches == mbs);
    CHECK(p.simulation.simulated == mbs);
    CHECK(p.simulation.period_microbatches == 0);
    const OrderedJson out = PlanToJson(p);
    CHECK(out["simulation"]["simulated"] == mbs);
    CHECK(!out["simulation"].contains("period_microbatches"));
  }
}

TEST_CASE("periodic window: past the simulated limit a window is required, and --full-simulation is refused there") {
  Json j = ReadJson("examples/models/tiny-gpt.json");
  j["train"]["microbatches"] = 20000;  // 80 000 layer-microbatches
  j["budget"] = "1TiB";
  const Model m = MustParse(j);
  const auto windowed = BuildPlan(m);
  REQUIRE(windowed.ok());
  CHECK(windowed->simulation.simulated < 100);
  PlanOptions full;
  full.full_simulation = true;
  const auto refused = BuildPlan(m, full);
  REQUIRE(!refused.ok());
  CHECK(refused.error().code == ErrorCode::kBadInput);
  CHECK(refused.error().message.find("test.json: /train/microbatches: 20000 microbatches of 4 layers is 80000 "
                                     "layer-microbatches to simulate one by one, over the limit of 50000") == 0);
}

TEST_CASE("periodic window: where best fit's state recurs, placement jumps over the repeating periods, exactly") {
  // tiny-gpt's best fit settles into a cycle of two periods within a few
  // hundred (bench: big models never do, and stream every period).
  Json j = ReadJson("examples/models/tiny-gpt.json");
  j["train"]["microbatches"] = 2000;
  const Model m = MustParse(j);
  const int64_t jumps = testing::PeriodicJumps();
  const Plan windowed = MustPlan(m, Verified());  // --verify: every number equals every microbatch's
  CHECK(testing::PeriodicJumps() > jumps);
  CHECK(windowed.simulation.simulated < 100);
  CHECK(windowed.verify_errors.empty());
  CHECK(CompareWithOracle(windowed, MustPlan(m, Full())) > 20);
}
