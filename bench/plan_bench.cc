// Planner speed as users meet it: what `memplan plan FILE -o PLAN.json`
// does (load the file, plan with its own budget and options, serialize
// PLAN.json), on the bundled examples, and on kimi-k3-like.json itself
// with its layers x microbatches swept (same budget, pp_balance, Muon,
// pipeline ZeRO-2), and as written on 1, 2 and 4 threads. Results and the
// commands that reproduce them, with the CLI's own wall time:
// docs/planner.md, "Speed".
#include <benchmark/benchmark.h>

#include <stdexcept>
#include <string>

#include "memplan/common/json_util.h"
#include "memplan/common/parallel.h"
#include "memplan/planner/model.h"
#include "memplan/planner/plan.h"

namespace {

const std::string kModels = MEMPLAN_SOURCE_ROOT "/examples/models/";

// The whole command minus the file write: plan, then PLAN.json's text.
void PlanAndSerialize(benchmark::State& state, const memplan::planner::Model& model) {
  int64_t tensors = 0;
  for (auto _ : state) {
    auto plan = memplan::planner::BuildPlan(model);
    if (!plan) {
      state.SkipWithError(plan.error().message.c_str());
      return;
    }
    std::string text = memplan::planner::PlanToJson(*plan).dump(1);
    tensors = static_cast<int64_t>(plan->tensors.size());
    benchmark::DoNotOptimize(text.data());
  }
  state.counters["instances"] = static_cast<double>(tensors * model.train.microbatches);
}

void BM_Example(benchmark::State& state, const std::string& file) {
  auto model = memplan::planner::LoadModel(kModels + file);
  if (!model) {
    state.SkipWithError(model.error().message.c_str());
    return;
  }
  PlanAndSerialize(state, *model);
}

// kimi-k3-like.json with arch.layers and train.microbatches replaced.
void BM_KimiK3Like(benchmark::State& state) {
  auto doc = memplan::ReadJsonFile(kModels + "kimi-k3-like.json");
  if (!doc) throw std::runtime_error(doc.error().message);
  (*doc)["arch"]["layers"] = state.range(0);
  (*doc)["train"]["microbatches"] = state.range(1);
  auto model = memplan::planner::ParseModel(*doc, "kimi-k3-like.json");
  if (!model) {
    state.SkipWithError(model.error().message.c_str());
    return;
  }
  PlanAndSerialize(state, *model);
  state.counters["layers_x_microbatches"] = static_cast<double>(state.range(0) * state.range(1));
}

BENCHMARK_CAPTURE(BM_Example, tiny_llama, std::string("tiny-llama.json"))->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Example, tiny_k3, std::string("tiny-k3.json"))->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Example, llama3_70b, std::string("llama3-70b.json"))->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Example, deepseek_v3, std::string("deepseek-v3.json"))
    ->Unit(benchmark::kMillisecond)->Iterations(3);
BENCHMARK_CAPTURE(BM_Example, kimi_k3_like, std::string("kimi-k3-like.json"))
    ->Unit(benchmark::kMillisecond)->Iterations(3);

// kimi-k3-like.json as written, its per-rank stages on 1, 2 and 4 threads
// (common/parallel.h; the plan is the same for any count).
void BM_KimiK3LikeThreads(benchmark::State& state) {
  auto model = memplan::planner::LoadModel(kModels + "kimi-k3-like.json");
  if (!model) {
    state.SkipWithError(model.error().message.c_str());
    return;
  }
  memplan::SetThreads(static_cast<int>(state.range(0)));
  PlanAndSerialize(state, *model);
  memplan::SetThreads(0);
}

BENCHMARK(BM_KimiK3LikeThreads)->ArgName("threads")->Arg(1)->Arg(2)->Arg(4)->Unit(benchmark::kMillisecond)->Iterations(2);

BENCHMARK(BM_KimiK3Like)
    ->ArgNames({"layers", "microbatches"})
    ->ArgsProduct({{47, 62, 93}, {32, 64, 128, 256, 512}})
    ->Unit(benchmark::kMillisecond)
    ->Iterations(2);

}  // namespace

BENCHMARK_MAIN();
