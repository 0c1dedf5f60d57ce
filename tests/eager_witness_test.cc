// The eager witness sees bytes and buffer sets, not only lifetimes
// (docs/runtime.md, "What each measurement sees"): every eager buffer
// carries a canary and red zones, so MEASURED.json says how many bytes the
// kernels wrote; every op states the sizes its kernels need and the
// executor checks the plan against them; every backward's reads are
// checked against the op registry both ways. These tests plant the
// planner bugs an audit found invisible before (routed capacity and a
// workspace too large or too small, a workspace left out, a read declared
// that no kernel makes) and require each to fail with a named message.
#include <doctest/doctest.h>

#include <cstring>

#include "executor_test_util.h"
#include "memplan/planner/program.h"
#include "memplan/runtime/host_device.h"

using namespace memplan;
using namespace memplan::test::exec;

namespace {

RunOptions Eager() {
  RunOptions o;
  o.eager = true;
  return o;
}

// The run of `model` planned and executed under `m` (the planner's bug is
// the runtime's too: it rebuilds the problem with the same templates).
std::string FailureUnder(const char* model, const planner::testing::PlannerMutation& m, bool eager) {
  planner::testing::SetPlannerMutation(m);
  Json plan = PlanOf(LoadJson(model));
  auto r = RunPlan(plan, eager ? Eager() : RunOptions{});
  planner::testing::ClearPlannerMutation();
  const std::string why = r.ok() ? std::string() : r.error().message;
  MESSAGE((std::string(model) + ": " + why));
  return why;
}

}  // namespace

TEST_CASE("eager witness: every freed buffer of the bundled models was written to its planned size") {
  int64_t buffers = 0;
  int models = 0;
  for (const char* file : {"examples/models/tiny-gpt.json", "examples/models/tiny-llama.json",
                           "examples/models/tiny-moe.json", "examples/models/tiny-mla.json",
                           "examples/models/tiny-attnres.json", "examples/models/tiny-k3-fp32.json"}) {
    CAPTURE(file);
    RunResult r = MustRun(PlanOf(LoadJson(file)), Eager());
    int64_t here = 0;
    for (const auto& rank : r.measured.ranks) {
      for (const auto& e : rank.allocation_timeline) {
        if (e.bytes >= 0) continue;
        CAPTURE(e.name);
        CAPTURE(e.part);
        REQUIRE(e.touched >= 0);  // every free is measured
        // A tail of up to 4 bytes may equal the canary by chance.
        CHECK(-e.bytes - e.touched <= 4);
        CHECK(e.touched <= -e.bytes);
        ++here;
      }
    }
    CHECK(here > 100);
    buffers += here;
    ++models;
  }
  CHECK(models == 6);
  MESSAGE(buffers << " buffers measured");
}

TEST_CASE("eager witness: MoE routed capacity x2 and x0.5 fail at the dispatch, naming it and its output") {
  for (double f : {2.0, 0.5}) {
    CAPTURE(f);
    planner::testing::PlannerMutation m;
    m.routed_capacity = f;
    const std::string why = FailureUnder("examples/models/tiny-moe.json", m, true);
    CHECK(why.find("op layer1.moe.dispatch (dispatch), layer 1 forward, microbatch 0") != std::string::npos);
    CHECK(why.find("its output layer1.moe.fc1_in") != std::string::npos);
    CHECK(why.find("its kernel writes") != std::string::npos);
  }
}

TEST_CASE("eager witness: a flash-attention backward workspace x2, x0.5 or left out fails naming the op") {
  const char* model = "examples/models/tiny-llama.json";
  for (double f : {2.0, 0.5}) {
    CAPTURE(f);
    planner::testing::PlannerMutation m;
    m.workspace_kind = "flash_attention";
    m.workspace_factor = f;
    const std::string why = FailureUnder(model, m, true);
    CHECK(why.find("(flash_attention), layer") != std::string::npos);
    CHECK(why.find("backward") != std::string::npos);
    CHECK(why.find("the plan gives its workspace") != std::string::npos);
  }
  planner::testing::PlannerMutation dropped;
  dropped.workspace_kind = "flash_attention";
  dropped.workspace_factor = 0;
  const std::string why = FailureUnder(model, dropped, true);
  CHECK(why.find("(flash_attention) in layer") != std::string::npos);
  CHECK(why.find("needs a workspace, and the plan has none") != std::string::npos);
  // The arena run fails the same way: the sizes are the kernels', whatever
  // the allocator.
  planner::testing::PlannerMutation doubled = dropped;
  doubled.workspace_factor = 2.0;
  CHECK(FailureUnder(model, doubled, false).find("the plan gives its workspace") != std::string::npos);
}

TEST_CASE("eager witness: a backward read the registry declares but no kernel makes fails naming op and tensor") {
  planner::testing::PlannerMutation m;
  m.spurious_read_kind = "add";
  for (const char* model : {"examples/models/tiny-llama.json", "examples/models/tiny-moe.json"}) {
    CAPTURE(model);
    const std::string why = FailureUnder(model, m, true);
    CHECK(why.find("(add), layer") != std::string::npos);
    CHECK(why.find("the op registry declares that its backward reads") != std::string::npos);
    CHECK(why.find("which it never read") != std::string::npos);
  }
}

TEST_CASE("eager witness: red zones catch a write past either end and the canary counts the bytes written") {
  runtime::HostDevice::Options o;
  o.system_allocator = true;
  runtime::HostDevice dev(o);
  REQUIRE(dev.EnableWitness());
  auto b = dev.Allocate(1000);
  REQUIRE(b.ok());
  auto w = dev.Witness(*b, true);
  REQUIRE(w);
  CHECK(w->touched_bytes == 0);
  std::memset(b->ptr, 0, 600);
  w = dev.Witness(*b, true);
  CHECK(w->touched_bytes == 600);
  CHECK(w->overrun_bytes == 0);
  CHECK(dev.allocated_bytes() == 1000);  // the red zones are the witness's, not the program's
  b->ptr[1000 + 7] = std::byte{0};        // 8 bytes past the end
  w = dev.Witness(*b, false);
  CHECK(w->overrun_bytes == 8);
  b->ptr[1000 + 7] = std::byte{runtime::kWitnessCanary};
  b->ptr[-1] = std::byte{0};
  w = dev.Witness(*b, false);
  CHECK(w->overrun_bytes == 0);
  CHECK(w->underrun_bytes == 1);
  b->ptr[-1] = std::byte{runtime::kWitnessCanary};
  dev.Free(*b);
  // The arena (the planner's placement) has no witness.
  runtime::HostDevice arena(runtime::HostDevice::Options{});
  CHECK_FALSE(arena.EnableWitness());
}
