// The executor's gradients against central differences of the step's loss
// (host backend). The kernels' own backwards are checked element by element
// in the kernel suites; what this suite proves is the executor's wiring:
// that every kind of parameter of every executable template receives the
// gradient of the loss through the whole pipeline (both stages, the
// hand-off between them, recompute and tied weights).
//
// Each finite difference costs two full training steps, so the suite takes
// one parameter per role (the name without its "layer<i>." prefix), in the
// earliest layer holding it with a measurable gradient: its gradient flows
// back through every later layer and across the stage boundary, so a later
// layer's copy of the same role adds no wiring the earliest one did not
// already cross.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "executor_test_util.h"
#include "memplan/runtime/npy.h"

namespace {

using memplan::Json;
using namespace memplan::test::exec;

// "layer12.attn.qkv.weight" -> {12, "attn.qkv.weight"}.
std::pair<int, std::string> SplitLayer(const std::string& name) {
  size_t dot = name.find('.');
  if (name.rfind("layer", 0) != 0 || dot == std::string::npos) return {0, name};
  return {std::stoi(name.substr(5, dot - 5)), name.substr(dot + 1)};
}

// Parameter names (dump file stems) of `dir`/grads grouped by role, each
// group in layer order; roles not starting with `only` are skipped.
std::map<std::string, std::vector<std::string>> ByRole(const std::filesystem::path& dir, const std::string& only) {
  std::map<std::string, std::map<int, std::string>> sorted;  // role -> layer -> name
  for (const auto& entry : std::filesystem::directory_iterator(dir / "grads")) {
    std::string name = entry.path().stem().string();
    auto [layer, role] = SplitLayer(name);
    if (role.rfind(only, 0) == 0) sorted[role][layer] = name;
  }
  std::map<std::string, std::vector<std::string>> out;
  for (const auto& [role, layers] : sorted) {
    for (const auto& [layer, name] : layers) out[role].push_back(name);
  }
  return out;
}

// The gradient's element of largest magnitude: (index, value).
std::pair<size_t, float> LargestElement(const std::filesystem::path& file) {
  const std::vector<float> grad = NpyFloats(file);
  size_t at = static_cast<size_t>(
      std::max_element(grad.begin(), grad.end(), [](float a, float b) { return std::abs(a) < std::abs(b); }) -
      grad.begin());
  return {at, grad[at]};
}

struct Case {
  std::string label;
  Json model;
  std::string only;  // roles checked: those starting with this ("" = all)
  // The finite difference's step: small enough for curvature (the embedding
  // feeds every AttnRes mix; KDA L2-normalizes q and k), large enough to
  // stand above fp32 rounding of the loss.
  float eps = 3e-3f;
};

// Initial values other than the runtime's (applied in every run of a case).
using InitEdit = std::function<void(const std::string&, std::vector<float>*)>;

// Checks one model variant; returns the number of roles checked.
int CheckCase(const Case& c, const InitEdit& init = nullptr) {
  namespace fs = std::filesystem;
  CAPTURE(c.label);
  // Two microbatches (the models' four would only double every run): the
  // accumulation over microbatches and the pipeline's 1F1B order are the
  // same property, at half the suite's time.
  Json model = c.model;
  model["train"]["microbatches"] = std::min<int64_t>(model["train"]["microbatches"].get<int64_t>(), 2);
  Json plan = PlanOf(model);
  fs::path dir = UniqueTempDir("memplan_fd_" + c.label);
  fs::remove_all(dir);
  RunOptions o;
  o.dump_dir = dir.string();
  o.init_hook = init;
  MustRun(plan, o);
  int checked = 0, tiny = 0;
  for (const auto& [role, layers] : ByRole(dir, c.only)) {
    // A tied head is the embedding's copy: checked through the embedding.
    if (c.model["arch"].value("tied_embeddings", false) && role == "head.weight") continue;
    // The earliest layer whose largest gradient element stands well above
    // fp32 noise for a finite difference (an AttnRes query in the first
    // layer mixes a single block: its gradient is zero).
    std::string name;
    size_t at = 0;
    float grad_at = 0;
    for (const std::string& candidate : layers) {
      auto [i, g] = LargestElement(dir / "grads" / (candidate + ".npy"));
      if (std::abs(g) >= 1e-3f) {
        name = candidate;
        at = i;
        grad_at = g;
        break;
      }
    }
    if (name.empty()) {
      ++tiny;
      continue;
    }
    const float eps = c.eps;
    double loss[2];
    for (int side = 0; side < 2; ++side) {
      RunOptions p;
      p.init_hook = [&](const std::string& param, std::vector<float>* w) {
        if (init) init(param, w);
        if (param == name) (*w)[at] += side == 0 ? eps : -eps;
      };
      loss[side] = MustRun(plan, p).measured.loss;
    }
    double fd = (loss[0] - loss[1]) / (2 * eps);
    CAPTURE(name);
    CAPTURE(grad_at);
    CAPTURE(fd);
    CHECK(std::abs(fd - grad_at) <= 0.05 * std::abs(grad_at) + 2e-4);
    ++checked;
  }
  MESSAGE(c.label << ": " << checked << " parameter roles checked, " << tiny << " with gradients below 1e-3");
  CHECK(checked >= 4);
  CHECK(tiny == 0);
  fs::remove_all(dir);
  return checked;
}

Json DenseRouting(Json moe) {
  moe["arch"]["moe"]["top_k"] = moe["arch"]["moe"]["experts"];
  return moe;
}

}  // namespace

// Two cases, registered as two Meson tests (tests/meson.build) so that each
// stays far below the 60 s limit on a loaded 2-core machine.
TEST_CASE("gradients match central differences: dense models") {
  int total = CheckCase({"tiny-gpt", LoadJson(kModels[0]), ""});
  total += CheckCase({"tiny-llama", LoadJson(kModels[1]), ""});
  CHECK(total >= 18);
}

// Top-k routing is piecewise: a perturbation that moves a token to another
// expert jumps the loss. The MoE model is checked with every expert
// selected (top_k = experts), where routing is smooth; the native router
// gradient and the K3 rewrite both (they differ in the MoE block only, so
// the native variant checks its MoE roles).
TEST_CASE("gradients match central differences: MoE and Block AttnRes") {
  Json moe = DenseRouting(LoadJson(kModels[2]));
  int total = CheckCase({"tiny-deepseek-dense-routing", moe, ""});
  moe["options"] = {{"moe_grad_rewrite", false}, {"moe_recompute_dispatch", false}};
  total += CheckCase({"tiny-deepseek-native-router-gradient", moe, "moe."});
  // Block AttnRes's pseudo-queries start at zero, where the key norms'
  // weights get no gradient (the logits are q . norm(v)): here they start at
  // 0.3 so that every role is checked.
  total += CheckCase({"tiny-attnres", LoadJson(kModels[3]), ""}, [](const std::string& param, std::vector<float>* w) {
    if (param.ends_with(".query")) std::fill(w->begin(), w->end(), 0.3f);
  });
  CHECK(total >= 25);
}

// DeepSeek-V3's routing (docs/runtime.md, "MoE routing"): the gates times
// routed_scaling (2.5) and the selection by score + bias. The bias enters
// the selection only, so with every expert selected it changes nothing and
// the router's gradient is the scaled gates' (the MoE roles).
TEST_CASE("gradients match central differences: DeepSeek-V3 routing") {
  Json moe = DenseRouting(LoadJson(kModels[2]));
  moe["arch"]["moe"]["routed_scaling"] = 2.5;
  moe["arch"]["moe"]["selection_bias"] = true;
  int total = CheckCase({"tiny-deepseek-v3-routing", moe, "moe."});
  CHECK(total >= 5);
}

// MLA: low-rank q and kv, the decoupled RoPE key shared by the heads.
TEST_CASE("gradients match central differences: MLA") {
  int total = CheckCase({"tiny-mla", LoadJson("examples/models/tiny-mla.json"), ""});
  CHECK(total >= 12);
}

// KDA (tiny-k3-fp32 at four layers: KDA and MLA layers, latent MoE,
// single-copy Block AttnRes, Muon, pp 2 x vp 2), every KDA role: the projections and their
// short convolutions' taps, the low-rank gates, beta, a_log, dt_bias, the
// gated norm (15 roles). Two microbatches and every
// expert selected keep it short and smooth. The L2 norms of q and k curve
// the loss strongly: at a step of 3e-3 the differences of q's largest
// element are 30 % off the (correct) gradient, at 3e-4 0.5 %.
TEST_CASE("gradients match central differences: KDA") {
  Json k3 = DenseRouting(LoadJson("examples/models/tiny-k3-fp32.json"));
  k3["train"]["microbatches"] = 2;
  // Four layers (MLA, then three KDA layers with MoE, one per pipeline
  // chunk) hold every KDA role: the other four only lengthened each run.
  k3["arch"]["layers"] = 4;
  int total = CheckCase({"tiny-k3-fp32-kda", k3, "kda.", 3e-4f});
  CHECK(total == 15);
}
