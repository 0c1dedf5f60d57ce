// Eager execution (docs/runtime.md, "Eager execution"): a measurement that
// does not share the planner's liveness. Each buffer is allocated at its
// first use and freed after its last, from the system allocator, and the
// allocation timeline is compared step by step with the plan's memory
// program (traces/timeline_compare.h). These tests show that the prediction
// matches an independent measurement, and that the comparison fails when
// the planner's liveness is wrong.
#include <doctest/doctest.h>

#include "executor_test_util.h"
#include "memplan/planner/program.h"
#include "memplan/planner/replay.h"
#include "memplan/traces/timeline_compare.h"

using namespace memplan;
using namespace memplan::test::exec;

namespace {

RunResult RunEager(const Json& plan) {
  RunOptions o;
  o.eager = true;
  return MustRun(plan, o);
}

// Every rank's eager timeline against the plan's program.
std::vector<traces::TimelineComparison> Compare(const Json& plan, const traces::Measured& m) {
  auto programs = planner::ReplayPrograms(plan, "plan");
  REQUIRE(programs.ok());
  std::vector<traces::TimelineComparison> out;
  for (const auto& mr : m.ranks) {
    const auto& prog = (*programs)[static_cast<size_t>(mr.pp_rank)];
    std::vector<traces::PredictedLife> lives;
    for (const auto& b : prog.buffers) lives.push_back({b.first, b.last, b.bytes, b.label.name, b.label.part, b.copy_timed});
    out.push_back(traces::CompareTimelines(lives, mr.allocation_timeline, static_cast<int64_t>(prog.steps.size()),
                                           [](int64_t s) { return "step " + std::to_string(s); }));
  }
  return out;
}

// Every storage mix, a mix per module and the planner's own choice under a
// tight budget: the eager timeline equals the plan's at every step (copy
// completions apart), and the math is the arena run's, bit for bit.
int CheckEveryMix(const char* file) {
  // Plain fp8 and plain offload_remote are inside the compositions and the
  // mix per module below (and in tiny-k3-fp32's every-mix run of the arena).
  const Json mixes[] = {"keep", "recompute", "offload_host", Json::array({"fp8", "offload_host"}),
                        Json::array({"fp8", "offload_remote"})};
  Json model = LoadJson(file);
  std::vector<Json> plans;
  for (const Json& mix : mixes) plans.push_back(PlanOf(WithPolicy(model, mix)));
  Json mixed = model;
  mixed["policies"] = Json::array({{{"match", "*.mlp.*"}, {"policy", "recompute"}},
                                   {{"match", "*.attn.*"}, {"policy", Json::array({"fp8", "offload_host"})}},
                                   {{"match", "*.moe.*"}, {"policy", "offload_remote"}},
                                   {{"match", "*_norm.*"}, {"policy", "fp8"}}});
  plans.push_back(PlanOf(mixed));
  Json keep = plans.front();
  int64_t lo = 0, hi = 0;
  for (const auto& b : keep.at("any_plan_lower_bound")) lo = std::max(lo, b.get<int64_t>());
  for (const auto& r : keep.at("ranks")) hi = std::max(hi, r.at("peak").get<int64_t>());
  Json tight = model;
  tight["budget"] = std::to_string(lo + (hi - lo) * 3 / 4) + "B";
  plans.push_back(PlanOf(tight));
  int compared = 0;
  for (size_t k = 0; k < plans.size(); ++k) {
    CAPTURE(file);
    CAPTURE(k);
    RunResult eager = RunEager(plans[k]);
    CHECK(eager.measured.allocator == "eager");
    for (const auto& c : Compare(plans[k], eager.measured)) {
      CHECK_MESSAGE(c.pass, c.verdict);
      CHECK(c.buffers > 0);
      ++compared;
    }
    if (k + 2 == plans.size()) {  // the mix per module (recompute, fp8, offloads): the arena's numbers
      RunResult arena = MustRun(plans[k]);
      CHECK(eager.measured.loss == arena.measured.loss);
      CHECK(eager.measured.grad_norm == arena.measured.grad_norm);
    }
  }
  return compared;
}

}  // namespace

// Two test cases over the five tiny models (two Meson tests, each well
// inside the 60 s limit on a loaded machine).
TEST_CASE("eager: the allocation timeline equals the plan's step by step, every storage mix: gpt llama deepseek") {
  int compared = 0;
  for (const char* file : {kModels[0], kModels[1], kModels[2]}) compared += CheckEveryMix(file);
  CHECK(compared == 3 * 7 * 2);  // three models, seven plans, two pipeline ranks
}

TEST_CASE("eager: the allocation timeline equals the plan's step by step, every storage mix: attnres mla") {
  int compared = 0;
  for (const char* file : {kModels[3], kModels[4]}) compared += CheckEveryMix(file);
  CHECK(compared == 2 * 7 * 2);
}

TEST_CASE("eager: tiny-k3-fp32 (every K3 mechanism), the timeline equals the plan's for every storage mix") {
  CHECK(CheckEveryMix("examples/models/tiny-k3-fp32.json") == 7 * 2);
}

// The comparison is independent of the planner's liveness: one tensor's
// predicted lifetime moved by one step makes `check` fail naming it, while
// the eager measurement is unchanged.
TEST_CASE("eager: a planner liveness off by one step is caught, naming the tensor") {
  Json plan = PlanOf(LoadJson("examples/models/tiny-llama.json"));
  RunResult before = RunEager(plan);
  for (const auto& c : Compare(plan, before.measured)) REQUIRE(c.pass);
  int caught = 0;
  for (int64_t steps : {+1, -1}) {
    CAPTURE(steps);
    planner::testing::PerturbLiveness("layer1.mlp.fc1_out", planner::IntervalPart::kFull, steps);
    RunResult after = RunEager(plan);  // the runtime re-plans with the perturbed planner
    std::vector<traces::TimelineComparison> cmp = Compare(plan, after.measured);
    planner::testing::ClearLivenessPerturbation();
    // The measurement does not move...
    REQUIRE(after.measured.ranks.size() == before.measured.ranks.size());
    for (size_t r = 0; r < after.measured.ranks.size(); ++r) {
      const auto& a = after.measured.ranks[r].allocation_timeline;
      const auto& b = before.measured.ranks[r].allocation_timeline;
      REQUIRE(a.size() == b.size());
      for (size_t i = 0; i < a.size(); ++i) {
        CHECK(a[i].step == b[i].step);
        CHECK(a[i].bytes == b[i].bytes);
        CHECK(a[i].name == b[i].name);
      }
    }
    // ... the check fails on the rank that holds layer 1, at that tensor.
    bool named = false;
    for (const auto& c : cmp) {
      if (c.pass) continue;
      const auto& only = steps > 0 ? c.only_predicted : c.only_measured;
      for (const auto& b : only) named = named || (b.name == "layer1.mlp.fc1_out@mb0" && b.part == "full");
      CHECK(c.verdict.find("layer1.mlp.fc1_out@mb") != std::string::npos);
    }
    CHECK(named);
    caught += named;
  }
  CHECK(caught == 2);
}

TEST_CASE("eager: a plan whose numbers differ from this planner's still runs eagerly; the arena refuses it") {
  Json plan = PlanOf(LoadJson("examples/models/tiny-gpt.json"));
  plan["ranks"][0]["peak"] = plan["ranks"][0]["peak"].get<int64_t>() + 256;
  auto arena = RunPlan(plan, {});
  CHECK_FALSE(arena.ok());
  RunOptions o;
  o.eager = true;
  auto eager = RunPlan(plan, o);
  CHECK(eager.ok());
}

// memplan run --steps (docs/runtime.md, "Several steps"): three steps of
// tiny-k3 (bf16, every K3 mechanism, offloads and recompute under a tight
// budget) on fresh microbatches from the system allocator. Every rank
// allocates the same buffers, the same bytes and reaches the same peak in
// each step; no step leaves memory behind (the executor checks it after
// each); the last step's timeline still equals the plan's; the losses
// differ (the batches do).
TEST_CASE("eager: several steps of tiny-k3 on fresh microbatches, memory identical from step 2 on") {
  Json model = LoadJson("examples/models/tiny-k3.json");
  Json keep = PlanOf(model);
  int64_t lo = 0, hi = 0;
  for (const auto& b : keep.at("any_plan_lower_bound")) lo = std::max(lo, b.get<int64_t>());
  for (const auto& r : keep.at("ranks")) hi = std::max(hi, r.at("peak").get<int64_t>());
  model["budget"] = std::to_string(lo + (hi - lo) * 3 / 4) + "B";
  Json plan = PlanOf(model);
  RunOptions o;
  o.eager = true;
  o.steps = 3;
  RunResult run = MustRun(plan, o);
  const auto& steps = run.measured.steps;
  REQUIRE(steps.size() == 3);
  int compared = 0;
  for (size_t s = 1; s < steps.size(); ++s) {
    CAPTURE(s);
    CHECK(steps[s].loss != steps[s - 1].loss);
    REQUIRE(steps[s].ranks.size() == steps[1].ranks.size());
    for (size_t r = 0; r < steps[s].ranks.size(); ++r) {
      const auto& a = steps[1].ranks[r];
      const auto& b = steps[s].ranks[r];
      CHECK(b.allocated_peak == a.allocated_peak);
      CHECK(b.allocations == a.allocations);
      CHECK(b.allocated_bytes == a.allocated_bytes);
      CHECK(b.allocations > 0);
      ++compared;
    }
  }
  CHECK(compared == 2 * 2);  // steps 2 and 3 against step 2, two pipeline ranks
  // The first step needs what the others need, no more (nothing is made
  // lazily in the first step here).
  for (size_t r = 0; r < steps[0].ranks.size(); ++r) CHECK(steps[0].ranks[r].allocated_peak == steps[1].ranks[r].allocated_peak);
  for (const auto& c : Compare(plan, run.measured)) CHECK_MESSAGE(c.pass, c.verdict);
}
