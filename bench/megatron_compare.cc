// megatron_compare: memplan's plan for Megatron against Megatron-LM's own
// estimate (report_theoretical_memory, planner/megatron_theory.h) on the
// bundled large models and four public configurations, the first pipeline
// stage of each (the rank Megatron's formula describes). Prints the
// markdown table of docs/targets.md, "Against Megatron's own estimate".
//
//   build/bench/megatron_compare
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "memplan/common/table.h"
#include "memplan/planner/import.h"
#include "memplan/planner/megatron_args.h"
#include "memplan/planner/megatron_theory.h"
#include "memplan/planner/plan.h"
#include "memplan/planner/target.h"

using namespace memplan;
using namespace memplan::planner;

namespace {

struct Case {
  std::string name;
  std::string file;  // a bundled model, or a Hugging Face config
  ImportOptions layout;  // for configs
};

Expected<Model> Load(const Case& c) {
  const std::string path = std::string(MEMPLAN_SOURCE_ROOT) + "/" + c.file;
  if (c.file.rfind("examples/", 0) == 0) return LoadModel(path);
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  auto doc = ImportHuggingFace(Json::parse(text.str()), path, c.layout);
  if (!doc) return doc.error();
  return ParseModel(Json::parse(doc->dump()), path);
}

ImportOptions Layout(int64_t gpus, int64_t gbs, int64_t seq, int64_t tp, int64_t pp, int64_t ep, int64_t vp = 1) {
  ImportOptions o;
  o.gpus = gpus, o.global_batch = gbs, o.seq_len = seq, o.tp = tp, o.pp = pp, o.ep = ep, o.vp = vp;
  o.sp = tp > 1;
  o.no_mtp = true;
  return o;
}

}  // namespace

int main() {
  const std::vector<Case> cases = {
      {"gpt3-175b (bundled)", "examples/models/gpt3-175b.json", {}},
      {"llama3-70b (bundled)", "examples/models/llama3-70b.json", {}},
      {"deepseek-v3 (bundled)", "examples/models/deepseek-v3.json", {}},
      {"Llama-3-70B", "tests/data/hf/llama-3-70b.json", Layout(512, 512, 8192, 8, 4, 1, 5)},
      {"Mixtral-8x7B", "tests/data/hf/mixtral-8x7b.json", Layout(64, 256, 4096, 2, 4, 8)},
      {"DeepSeek-V3", "tests/data/hf/deepseek-v3.json", Layout(1024, 1024, 4096, 1, 16, 64)},
      {"Qwen3-30B-A3B", "tests/data/hf/qwen3-30b-a3b.json", Layout(64, 512, 4096, 1, 2, 8)},
  };
  const double gib = 1.0 / (1 << 30);
  Table t({"model", "layout", "rank-0 params Megatron (M)", "memplan (M)", "weights+grads+optimizer Megatron (GiB)",
           "memplan (GiB)", "difference", "memplan largest rank (GiB)", "per-layer x Megatron", "memplan",
           "activations Megatron (GiB)", "memplan (GiB)", "difference"});
  for (const auto& c : cases) {
    auto loaded = Load(c);
    if (!loaded) {
      std::fprintf(stderr, "%s: %s\n", c.name.c_str(), loaded.error().message.c_str());
      return 1;
    }
    Model m = *loaded;
    ApplyTarget(&m, TargetKind::kMegatron);
    // Megatron's formula assumes selective recompute of core attention
    // (flash attention saves no score matrix either way) and no budget.
    FrameworkSettings selective;
    selective.granularity = "selective";
    selective.recompute_modules = {"core_attn"};
    m.target.settings = selective;
    m.budget = int64_t{1} << 50;
    m.budget_given = true;
    auto plan = BuildPlan(m);
    if (!plan) {
      std::fprintf(stderr, "%s: %s\n", c.name.c_str(), plan.error().message.c_str());
      return 1;
    }
    const MegatronArgs args = MegatronArgsOf(m, selective);
    const MegatronTheory theory = MegatronTheoreticalMemory(m, args);
    const RankPlan& r0 = plan->ranks.front();
    const double ours = static_cast<double>(r0.statics.weights + r0.statics.grads + r0.statics.optimizer);
    double largest = 0;
    for (const auto& r : plan->ranks) {
      largest = std::max(largest, static_cast<double>(r.statics.weights + r.statics.grads + r.statics.optimizer));
    }
    // memplan's per-layer coefficient: a middle layer's saved bytes per
    // microbatch over s b h / tp (rank 0's second layer: past the embedding),
    // as stored (core attention recomputed).
    const int64_t layer = r0.layers.size() > 1 ? r0.layers[1] : r0.layers.front();
    double layer_bytes = 0;
    for (const auto& te : plan->tensors) {
      if (te.layer == layer && te.name.find(".embed.") == std::string::npos) layer_bytes += static_cast<double>(te.device_bytes);
    }
    const double sbh = static_cast<double>(m.train.seq_len * m.train.micro_batch * m.arch.hidden);
    const double x = layer_bytes * static_cast<double>(m.parallel.tp) / sbh;
    auto pct = [](double a, double b) { return (a >= b ? "+" : "") + FormatFixed(100 * (a - b) / b, 1) + " %"; };
    const Parallel& p = m.parallel;
    const std::string layout = "tp" + std::to_string(p.tp) + (p.sp ? "+sp" : "") + " pp" + std::to_string(p.pp) +
                               (p.vp > 1 ? " vp" + std::to_string(p.vp) : "") +
                               (p.ep > 1 ? " ep" + std::to_string(p.ep) : "") + " dp" + std::to_string(p.dp);
    t.AddRow({c.name, layout, FormatFixed((theory.tp_split_params + theory.replicated_params + theory.expert_params) / 1e6, 1),
              FormatFixed(static_cast<double>(r0.statics.params) / 1e6, 1),
              FormatFixed(theory.weights_and_optimizer_bytes * gib, 2), FormatFixed(ours * gib, 2),
              pct(ours, theory.weights_and_optimizer_bytes), FormatFixed(largest * gib, 2),
              FormatFixed(theory.per_layer_coefficient, 1),
              FormatFixed(x, 1), FormatFixed(theory.activation_bytes * gib, 2),
              FormatFixed(static_cast<double>(r0.activations_peak) * gib, 2),
              pct(static_cast<double>(r0.activations_peak), theory.activation_bytes)});
  }
  std::fputs(t.Render().c_str(), stdout);
  return 0;
}
