// Planner speed against model size: a K3-scale hybrid MoE (896 experts,
// MLA every 4th layer, KDA otherwise, Block AttnRes, pp 16 x vp 2) planned
// end to end (expand, liveness, solve, rebalance, bounds) for layers x
// microbatches. Results and the command that reproduces them:
// docs/planner.md.
#include <benchmark/benchmark.h>

#include <string>

#include "memplan/planner/model.h"
#include "memplan/planner/plan.h"

namespace {

memplan::planner::Model K3Scale(int64_t layers, int64_t microbatches) {
  memplan::Json j = {
      {"schema", "memplan.model/1"},
      {"name", "k3-scale"},
      {"arch",
       {{"layers", layers},
        {"hidden", 7168},
        {"heads", 96},
        {"head_dim", 128},
        {"ffn_hidden", 18432},
        {"vocab", 163840},
        {"mla", {{"q_lora_rank", 1536}, {"kv_lora_rank", 512}, {"qk_nope_head_dim", 128},
                 {"qk_rope_head_dim", 64}, {"v_head_dim", 128}}},
        {"moe", {{"experts", 896}, {"top_k", 16}, {"expert_ffn_hidden", 3072}, {"shared_experts", 2},
                 {"first_dense_layers", 1}, {"latent_dim", 3584}, {"router", "sigmoid"}}},
        {"attn_res", {{"block_layers", 12}}},
        {"linear_attention", {{"kind", "kda"}, {"full_attention_every", 4}, {"head_dim", 128}}}}},
      {"train", {{"seq_len", 8192}, {"micro_batch", 1}, {"microbatches", microbatches}, {"optimizer", "muon"}}},
      {"parallel", {{"pp", 16}, {"vp", 2}, {"dp", 64}, {"ep", 64}, {"cp", 2}, {"zero", 1},
                    {"pipeline_zero2", true}, {"grad_offload", "host"}}},
      {"hardware", {{"preset", "h200"}}}};
  auto m = memplan::planner::ParseModel(j, "k3-scale");
  if (!m) throw std::runtime_error(m.error().message);
  return *m;
}

void BM_PlanK3Scale(benchmark::State& state) {
  memplan::planner::Model model = K3Scale(state.range(0), state.range(1));
  int64_t tensors = 0;
  for (auto _ : state) {
    auto plan = memplan::planner::BuildPlan(model);
    if (!plan) {
      state.SkipWithError(plan.error().message.c_str());
      return;
    }
    tensors = static_cast<int64_t>(plan->tensors.size());
    benchmark::DoNotOptimize(plan->ranks.front().peak);
  }
  state.counters["layers_x_microbatches"] = static_cast<double>(state.range(0) * state.range(1));
  state.counters["instances"] = static_cast<double>(tensors * state.range(1));
}

BENCHMARK(BM_PlanK3Scale)
    ->ArgNames({"layers", "microbatches"})
    ->ArgsProduct({{32, 64, 96}, {32, 64, 128}})
    ->Unit(benchmark::kMillisecond)
    ->Iterations(3);

}  // namespace

BENCHMARK_MAIN();
