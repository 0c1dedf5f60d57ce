// The executor (memplan run) on the host backend: measured bytes equal the
// plan's byte for byte under every storage mix, the step's numbers do not
// depend on where saved tensors were kept, traces nest, dumps load,
// unsupported plans are refused. Gradients against finite differences:
// executor_gradients_test.cc.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <unistd.h>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "json_test_util.h"
#include "memplan/planner/plan.h"
#include "memplan/runtime/executor.h"
#include "memplan/runtime/npy.h"
#include "memplan/traces/check.h"
#include "memplan/traces/chrome_trace.h"
#include "executor_test_util.h"

namespace {

using memplan::Json;
using namespace memplan::test::exec;
namespace fs = std::filesystem;

// Feasibility, not a measurement: the arena replays the planner's own memory
// program, so peak == plan peak and allocated_peak == lower_bound by
// construction; what this shows is that execution needs nothing unplanned
// (tests/eager_test.cc measures independently).
void CheckExact(const Json& plan, const RunResult& r) {
  const auto& ranks = plan["ranks"];
  REQUIRE(r.measured.ranks.size() == ranks.size());
  for (size_t i = 0; i < ranks.size(); ++i) {
    CAPTURE(i);
    CHECK(r.measured.ranks[i].peak == ranks[i]["peak"].get<int64_t>());
    CHECK(r.measured.ranks[i].allocated_peak == ranks[i]["lower_bound"].get<int64_t>());
    CHECK(r.measured.ranks[i].static_bytes == ranks[i]["static"]["total"].get<int64_t>());
  }
  auto bounds = memplan::traces::ParsePlanBounds(plan, "plan");
  REQUIRE(bounds.ok());
  auto verdict = memplan::traces::Check(*bounds, r.measured, {std::nullopt, "plan", "measured"});
  REQUIRE(verdict.ok());
  CHECK(verdict->pass);
}

// A mix per module and the planner's own choice under a budget between its
// bounds: measured == predicted on every rank (the uniform mixes are
// checked by CheckSameNumbers's runs, which are the same arena runs).
void CheckEveryMix(const char* file) {
  {
    Json model = LoadJson(file);
    // A mix per module, as a planner would choose it.
    Json mixed = model;
    mixed["policies"] = Json::array({{{"match", "*.mlp.*"}, {"policy", "recompute"}},
                                     {{"match", "*.attn.*"}, {"policy", Json::array({"fp8", "offload_host"})}},
                                     {{"match", "*.moe.*"}, {"policy", "offload_remote"}},
                                     {{"match", "*_norm.*"}, {"policy", "fp8"}}});
    Json plan = PlanOf(mixed);
    CAPTURE(file);
    CHECK(NotKept(plan) > 0);
    CheckExact(plan, MustRun(plan));
    // The planner's own choice under a budget between its bounds.
    Json keep = PlanOf(model);
    int64_t lo = 0, hi = 0;
    for (const auto& b : keep.at("any_plan_lower_bound")) lo = std::max(lo, b.get<int64_t>());
    for (const auto& r : keep.at("ranks")) hi = std::max(hi, r.at("peak").get<int64_t>());
    CHECK(lo > 0);
    CHECK(hi > lo);
    Json tight = model;
    tight["budget"] = std::to_string(lo + (hi - lo) * 3 / 4) + "B";
    Json tplan = PlanOf(tight);
    CheckExact(tplan, MustRun(tplan));
  }
}

}  // namespace

TEST_CASE("feasibility (arena, the plan's program replayed): a mix per module and a tight budget run in exactly the planned bytes") {
  for (const char* file : kModels) CheckEveryMix(file);
}

// Every K3 mechanism at once (KDA, MLA, latent MoE, single-copy Block
// AttnRes, Muon, pp 2 x vp 2): its own Meson test (executor_k3).
TEST_CASE("feasibility: tiny-k3-fp32 runs in exactly the planned bytes under every storage mix") {
  CheckEveryMix("examples/models/tiny-k3-fp32.json");
}

TEST_CASE("feasibility: the planned bytes suffice under shaken copy engines") {
  Json plan = PlanOf(WithPolicy(LoadJson("examples/models/tiny-llama.json"), Json::array({"fp8", "offload_remote"})));
  RunOptions o;
  o.copy_jitter_us = 200;
  RunResult a = MustRun(plan, o);
  CheckExact(plan, a);
  RunResult b = MustRun(plan);
  CHECK(a.measured.loss == b.measured.loss);
  CHECK(a.measured.grad_norm == b.measured.grad_norm);
}

namespace {

// `fp8_tolerance`: how far FP8 storage may move grad_norm (relative).
void CheckSameNumbers(const char* file, double fp8_tolerance = 0.05) {
  {
    CAPTURE(file);
    Json model = LoadJson(file);
    // Each run is also a feasibility check: the arena holds exactly the
    // planned bytes (CheckExact).
    Json keep_plan = PlanOf(WithPolicy(model, "keep"));
    RunResult keep = MustRun(keep_plan);
    CheckExact(keep_plan, keep);
    CHECK(std::isfinite(keep.measured.loss));
    CHECK(keep.measured.grad_norm > 0);
    for (const Json& mix : {Json("recompute"), Json("offload_host"), Json("offload_remote")}) {
      CAPTURE(mix.dump());
      Json plan = PlanOf(WithPolicy(model, mix));
      CHECK(NotKept(plan) > 0);
      RunResult r = MustRun(plan);
      CheckExact(plan, r);
      CHECK(r.measured.loss == keep.measured.loss);
      CHECK(r.measured.grad_norm == keep.measured.grad_norm);
    }
    for (const Json& mix : {Json("fp8"), Json::array({"fp8", "offload_host"}), Json::array({"fp8", "offload_remote"})}) {
      CAPTURE(mix.dump());
      Json plan = PlanOf(WithPolicy(model, mix));
      CHECK(NotKept(plan) > 0);
      RunResult r = MustRun(plan);
      CheckExact(plan, r);
      // The forward reads every activation before it is quantized: the
      // step's loss is exact; the backward reads FP8 copies.
      CHECK(r.measured.loss == keep.measured.loss);
      CHECK(r.measured.grad_norm != keep.measured.grad_norm);
      CHECK(std::abs(r.measured.grad_norm - keep.measured.grad_norm) < fp8_tolerance * keep.measured.grad_norm);
    }
  }
}

}  // namespace

TEST_CASE("loss and grad_norm are bit-identical under keep, recompute and offload; FP8 moves grad_norm a little; each runs in exactly the planned bytes") {
  for (const char* file : kModels) CheckSameNumbers(file);
}

// FP8 moves grad_norm by 12 % here: every saved tensor in FP8 includes KDA's
// per-chunk states and the q, k its L2 norms amplify, summed through eight
// layers of AttnRes blocks.
TEST_CASE("tiny-k3-fp32: loss and grad_norm do not depend on where saved tensors were kept") {
  CheckSameNumbers("examples/models/tiny-k3-fp32.json", 0.2);
}

// docs/runtime.md, KDA: with the layer as published (short convolutions
// with SiLU on q, k, v, dt_bias in the decay, the gated norm at eps 1e-5)
// and Block AttnRes per sublayer with zero pseudo-queries, tiny-k3-fp32's
// gradient norm at initialisation is 9.05, against 2.13 for the same model
// without KDA (28.5 without the convolutions and dt_bias, 96.3 at eps 1e-6
// as well); most of it is layer 0's, upstream of the KDA layers' gated
// norms. Its bf16 twin's gradients follow fp32's: median cosine 0.99 over
// the parameters (0.07 against fp64 before the KDA fixes, the issue's
// measurement; 0.83 with the gated norm's eps at 1e-7).
TEST_CASE("tiny-k3: the faithful KDA keeps the gradients tame and bf16 gradients follow fp32's") {
  const auto dir = UniqueTempDir("memplan_k3_cosine");
  std::filesystem::remove_all(dir);
  RunOptions o32, o16;
  o32.dump_dir = (dir / "fp32").string();
  o16.dump_dir = (dir / "bf16").string();
  RunResult r = MustRun(PlanOf(LoadJson("examples/models/tiny-k3-fp32.json")), o32);
  CHECK(r.measured.grad_norm < 15);
  CHECK(r.measured.grad_norm > 5);
  MustRun(PlanOf(LoadJson("examples/models/tiny-k3.json")), o16);
  std::vector<double> cosines;
  for (const auto& e : std::filesystem::directory_iterator(dir / "fp32" / "grads")) {
    const std::vector<float> a = NpyFloats(e.path()), b = NpyFloats(dir / "bf16" / "grads" / e.path().filename());
    REQUIRE(a.size() == b.size());
    double ab = 0, aa = 0, bb = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      ab += double(a[i]) * b[i];
      aa += double(a[i]) * a[i];
      bb += double(b[i]) * b[i];
    }
    if (aa > 0 && bb > 0) cosines.push_back(ab / std::sqrt(aa * bb));
  }
  std::filesystem::remove_all(dir);
  REQUIRE(cosines.size() > 150);  // 192 parameters with a gradient
  std::sort(cosines.begin(), cosines.end());
  const double median = cosines[cosines.size() / 2];
  CAPTURE(median);
  CHECK(median > 0.95);
}

// tiny-k3 itself: bf16 activations and weights (fp32 master weights,
// gradients and optimizer state), on the host backend: its own Meson test
// (executor_k3_bf16).
TEST_CASE("feasibility: tiny-k3 in bf16 runs in exactly the planned bytes under every storage mix") {
  CheckEveryMix("examples/models/tiny-k3.json");
}

TEST_CASE("host: tiny-k3 in bf16, the same numbers under keep, recompute and offload; its loss within 1 % of fp32's") {
  CheckSameNumbers("examples/models/tiny-k3.json", 0.2);
  RunResult bf16 = MustRun(PlanOf(LoadJson("examples/models/tiny-k3.json")));
  RunResult fp32 = MustRun(PlanOf(LoadJson("examples/models/tiny-k3-fp32.json")));
  MESSAGE("tiny-k3 loss: bf16 " << bf16.measured.loss << ", fp32 " << fp32.measured.loss);
  CHECK(bf16.measured.loss != fp32.measured.loss);
  CHECK(std::abs(bf16.measured.loss - fp32.measured.loss) < 0.01 * fp32.measured.loss);
  // The same model on the CUDA backend is refused before anything runs.
  RunOptions cuda;
  cuda.backend = memplan::runtime::BackendKind::kCuda;
  auto r = RunPlan(PlanOf(LoadJson("examples/models/tiny-k3.json")), cuda);
  REQUIRE_FALSE(r.ok());
  CHECK(r.error().code == memplan::ErrorCode::kBadInput);
  CHECK(r.error().message.find("bf16 executes on the host backend only") != std::string::npos);
}

// A dense model's gradients in bf16 stay within bf16's precision of fp32's
// (tiny-llama; the MoE and KDA models route and normalize chaotically).
TEST_CASE("host: bf16 gradients of a dense model are fp32's to about 1 %") {
  const fs::path dir = UniqueTempDir("memplan_bf16");
  fs::remove_all(dir);
  Json bf16 = LoadJson("examples/models/tiny-llama.json");
  bf16["train"]["act_dtype"] = "bf16";
  bf16["train"]["param_dtype"] = "bf16";
  RunOptions a, b;
  a.dump_dir = (dir / "bf16").string();
  b.dump_dir = (dir / "fp32").string();
  MustRun(PlanOf(bf16), a);
  MustRun(PlanOf(LoadJson("examples/models/tiny-llama.json")), b);
  int compared = 0;
  for (const auto& e : fs::directory_iterator(dir / "fp32" / "grads")) {
    CAPTURE(e.path().filename().string());
    const std::vector<float> f = NpyFloats(e.path());
    const std::vector<float> h = NpyFloats(dir / "bf16" / "grads" / e.path().filename());
    double num = 0, den = 0;
    for (size_t i = 0; i < f.size(); ++i) {
      num += (double(f[i]) - h[i]) * (double(f[i]) - h[i]);
      den += double(f[i]) * f[i];
    }
    CHECK(num > 0);  // bf16 is not fp32
    CHECK(std::sqrt(num / den) < 0.03);
    ++compared;
  }
  CHECK(compared >= 15);
  fs::remove_all(dir);
}

// Pipeline ZeRO-2 in one process (dp 1): each chunk's backward pass in one
// half of the fp32 double buffer, added into the partitions (host memory
// with grad_offload host) at the pass's end; the device holds no gradient.
TEST_CASE("feasibility: pipeline ZeRO-2 with host gradients in the planned bytes, and the same step") {
  int checked = 0;
  for (const char* file : {"examples/models/tiny-llama.json", "examples/models/tiny-k3-fp32.json"}) {
    CAPTURE(file);
    Json model = LoadJson(file);
    model.erase("budget");
    Json pz2 = model;
    pz2["parallel"]["pipeline_zero2"] = true;
    pz2["parallel"]["grad_offload"] = "host";
    Json plain_plan = PlanOf(model), plan = PlanOf(pz2);
    for (const auto& r : plan["ranks"]) {
      CHECK(r["static"]["grads"] == 0);
      CHECK(r["host"].get<int64_t>() > 0);
      CHECK(r["static"]["buffer_detail"]["grad_double_buffer"].get<int64_t>() > 0);
    }
    RunResult plain = MustRun(plain_plan), got = MustRun(plan);
    for (size_t i = 0; i < got.measured.ranks.size(); ++i) {
      const auto& m = got.measured.ranks[i];
      CHECK(m.peak == plan["ranks"][i]["peak"].get<int64_t>());
      CHECK(m.static_bytes == plan["ranks"][i]["static"]["total"].get<int64_t>());
      CHECK(m.events.at("grad_passes_reduced") == model["train"]["microbatches"].get<int64_t>() * model["parallel"]["vp"].get<int64_t>());
    }
    // The loss is computed before any gradient; the gradients are summed
    // pass by pass instead of in place (fp32 order).
    CHECK(got.measured.loss == plain.measured.loss);
    CHECK(got.measured.grad_norm == doctest::Approx(plain.measured.grad_norm).epsilon(1e-6));
    ++checked;
  }
  CHECK(checked == 2);
}

TEST_CASE("the dump holds weights, batch and gradients with their shapes") {
  namespace fs = std::filesystem;
  Json plan = PlanOf(LoadJson("examples/models/tiny-gpt.json"));
  fs::path dir = UniqueTempDir("memplan_dump_test");
  fs::remove_all(dir);
  RunOptions o;
  o.dump_dir = dir.string();
  MustRun(plan, o);
  auto w = memplan::runtime::ReadNpy((dir / "weights" / "layer1.attn.qkv.weight.npy").string());
  REQUIRE(w.ok());
  CHECK(w->descr == "<f4");
  CHECK(w->shape == std::vector<int64_t>{64, 192});
  CHECK(w->bytes.size() == 64 * 192 * 4);
  auto g = memplan::runtime::ReadNpy((dir / "grads" / "layer1.attn.qkv.weight.npy").string());
  REQUIRE(g.ok());
  CHECK(g->shape == w->shape);
  auto t = memplan::runtime::ReadNpy((dir / "batch" / "tokens_mb3.npy").string());
  REQUIRE(t.ok());
  CHECK(t->descr == "<i4");
  CHECK(t->shape == std::vector<int64_t>{2, 64});
  auto count = [&](const char* sub) {
    size_t n = 0;
    for (const auto& e : fs::directory_iterator(dir / sub)) n += e.is_regular_file();
    return n;
  };
  // Every parameter of every rank (4 layers of 8, the embedding and the
  // tied head's copy, the head norm's 2), and 4 microbatches x (tokens + targets).
  CHECK(count("weights") == 4 * 8 + 2 + 2);
  CHECK(count("grads") == count("weights"));
  CHECK(count("batch") == 8);
  fs::remove_all(dir);
}

TEST_CASE("MEASURED.json is schema-valid and the trace nests per thread") {
  Json plan = PlanOf(WithPolicy(LoadJson("examples/models/tiny-gpt.json"), Json::array({"fp8", "offload_host"})));
  RunOptions o;
  o.trace = true;
  RunResult r = MustRun(plan, o);
  Json measured = Json::parse(memplan::traces::MeasuredToJson(r.measured).dump());
#ifdef MEMPLAN_HAVE_VALIJSON
  CHECK(memplan::test::SchemaErrors("schemas/measured.schema.json", measured) == "");
#endif
  CHECK(measured["plan_digest"] == plan["digest"]);
  CHECK(measured["ranks"][0]["timeline"].size() > 100);
  Json trace = Json::parse(r.trace.dump());
  CHECK(memplan::traces::ValidateNesting(trace).empty());
  std::map<std::string, int> kinds;
  std::map<int64_t, int> pids;
  for (const auto& e : trace["traceEvents"]) {
    kinds[e["ph"].get<std::string>()]++;
    if (e["ph"] == "X") pids[e["pid"].get<int64_t>()]++;
  }
  CHECK(kinds["X"] > 0);
  CHECK(kinds["C"] > 0);
  CHECK(kinds["M"] > 0);
  CHECK(pids.size() == 2);  // one process per rank
  bool copies = false;
  for (const auto& e : trace["traceEvents"]) copies |= e["ph"] == "X" && e["cat"] == "memcpy";
  CHECK(copies);
}

TEST_CASE("plans the runtime cannot execute are refused with a reason") {
  Json base = LoadJson("examples/models/tiny-gpt.json");
  struct Case {
    const char* what;
    std::function<void(Json&)> edit;
    const char* says;
  } cases[] = {
      {"tp", [](Json& m) { m["parallel"]["tp"] = 2; }, "tp"},
      {"dp", [](Json& m) { m["parallel"]["dp"] = 2; }, "dp"},
      {"fp16", [](Json& m) { m["train"]["act_dtype"] = "fp16"; }, "fp32 or bf16"},
      {"bf16 gradients", [](Json& m) { m["train"]["grad_dtype"] = "bf16"; }, "grad_dtype bf16"},
  };
  for (const auto& c : cases) {
    CAPTURE(c.what);
    Json m = base;
    c.edit(m);
    auto r = RunPlan(PlanOf(m), {});
    REQUIRE_FALSE(r.ok());
    CHECK(r.error().code == memplan::ErrorCode::kBadInput);
    CHECK(r.error().message.find(c.says) != std::string::npos);
  }
  Json unchecked = LoadJson("examples/models/tiny-attnres.json");
  unchecked["options"]["attn_res_checkpoint"] = false;
  auto decomposed = RunPlan(PlanOf(unchecked), {});
  REQUIRE_FALSE(decomposed.ok());
  CHECK(decomposed.error().message.find("not executable") != std::string::npos);
  // The op registry's reason comes with it.
  CHECK(decomposed.error().message.find("attn_res_checkpoint") != std::string::npos);
  // Every reason at once, in one line.
  Json many = base;
  many["parallel"]["tp"] = 2;
  many["train"]["act_dtype"] = "fp16";
  auto all = RunPlan(PlanOf(many), {});
  REQUIRE_FALSE(all.ok());
  CHECK(all.error().message.find('\n') == std::string::npos);
  CHECK(all.error().message.find("/model/parallel/tp") != std::string::npos);
  CHECK(all.error().message.find("act_dtype fp16") != std::string::npos);
  // Malformed or illegal plans: exit 2 with the JSON path, never a crash.
  Json good = PlanOf(LoadJson("examples/models/tiny-llama.json"));
  auto index_of = [&](const std::string& name) {
    for (size_t i = 0; i < good["tensors"].size(); ++i) {
      if (good["tensors"][i]["name"] == name) return i;
    }
    FAIL("no tensor " << name);
    return size_t{0};
  };
  struct Edit {
    const char* what;
    std::function<void(Json&)> edit;
    const char* says;
  } edits[] = {
      {"tensors not an array", [](Json& p) { p["tensors"] = 3; }, "/tensors: expected an array"},
      {"digest missing", [](Json& p) { p.erase("digest"); }, "/digest"},
      {"peak a string", [](Json& p) { p["ranks"][0]["peak"] = "big"; }, "/ranks/0"},
      {"two keeps", [&](Json& p) { p["tensors"][0]["effective"] = {"keep", "keep"}; }, "/tensors/0/effective"},
      {"fp8 token ids", [&](Json& p) { p["tensors"][index_of("layer0.embed.tokens")]["effective"] = {"fp8"}; },
       "floating-point"},
      {"recompute a stage input",
       [&](Json& p) { p["tensors"][index_of("layer1.attn_norm.x")]["effective"] = {"recompute"}; },
       "no producer chain"},
      {"remote to nowhere",
       [&](Json& p) {
         auto& t = p["tensors"][index_of("layer0.mlp.fc1_out")];
         t["effective"] = {"offload_remote"};
         t["to_pp_rank"] = 99;
       },
       "to_pp_rank 99"},
      {"listed twice", [](Json& p) { p["tensors"].push_back(p["tensors"][0]); }, "listed twice"},
  };
  for (const auto& e : edits) {
    CAPTURE(std::string(e.what));
    Json p = good;
    e.edit(p);
    auto r = RunPlan(p, {});
    REQUIRE_FALSE(r.ok());
    CAPTURE(r.error().message);
    CHECK(r.error().code == memplan::ErrorCode::kBadInput);
    CHECK(r.error().message.find(e.says) != std::string::npos);
  }
  // A plan whose bytes were edited no longer matches this planner.
  Json plan = PlanOf(base);
  plan["ranks"][0]["peak"] = plan["ranks"][0]["peak"].get<int64_t>() + 1;
  auto edited = RunPlan(plan, {});
  REQUIRE_FALSE(edited.ok());
  CHECK(edited.error().message.find("differ") != std::string::npos);
}

TEST_CASE("DeepSeek-V3 routing: the bias chooses the experts, the gates stay the unbiased scores, times the scale") {
  // docs/runtime.md "MoE routing". tiny-deepseek: 8 experts, top 2, sigmoid
  // scores. A bias of +100 on expert 0 of every MoE layer puts every token
  // on it: the most-loaded expert carries experts / top_k = 4 x the mean.
  Json base = LoadJson("examples/models/tiny-deepseek.json");
  base["arch"]["moe"]["selection_bias"] = true;
  RunOptions o;
  int biased = 0;
  o.init_hook = [&](const std::string& name, std::vector<float>* v) {
    if (name.size() > 12 && name.compare(name.size() - 12, 12, ".router.bias") == 0) {
      (*v)[0] = 100.f;
      ++biased;
    }
  };
  RunResult skewed = MustRun(PlanOf(base), o);
  CHECK(biased == 3);  // the MoE layers (the first is dense)
  for (const auto& r : skewed.measured.ranks) {
    if (!r.moe_routing) continue;
    CHECK(r.moe_routing->max_expert_load == doctest::Approx(4.0));
  }
  // A zero bias selects as the kernel does: the same loss as without it;
  // the scale changes the step.
  RunResult plain = MustRun(PlanOf(LoadJson("examples/models/tiny-deepseek.json")));
  RunResult zero = MustRun(PlanOf(base));
  CHECK(zero.measured.loss == doctest::Approx(plain.measured.loss).epsilon(1e-6));
  CHECK(skewed.measured.loss != doctest::Approx(plain.measured.loss).epsilon(1e-4));
  Json scaled = base;
  scaled["arch"]["moe"]["routed_scaling"] = 2.5;
  CHECK(MustRun(PlanOf(scaled)).measured.loss != doctest::Approx(plain.measured.loss).epsilon(1e-4));
}

// The bias's update after each step (docs/runtime.md "MoE routing"):
// b_i += rate * sign(mean load - load_i). With +100 on expert 0 every token
// picks expert 0 (load T, the mean T·top_k/experts = T/4), so after step 1
// its bias is 100 - rate and every other expert's moves by exactly ±rate;
// after step 2 expert 0 is still overloaded (100 - 2·rate). The biases are
// dumped before and after each step.
TEST_CASE("DeepSeek-V3 routing: the selection bias moves towards balance after each step") {
  Json base = LoadJson("examples/models/tiny-deepseek.json");
  base["arch"]["moe"]["selection_bias"] = true;
  base["arch"]["moe"]["bias_update_rate"] = 0.01;
  RunOptions o;
  o.steps = 2;
  o.init_hook = [&](const std::string& name, std::vector<float>* v) {
    if (name.ends_with(".router.bias")) (*v)[0] = 100.f;
  };
  const auto dir = UniqueTempDir("memplan_bias_update");
  std::filesystem::remove_all(dir);
  o.dump_dir = dir.string();
  MustRun(PlanOf(base), o);
  int layers = 0, raised = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir / "step1" / "updated")) {
    const std::string name = e.path().filename().string();
    if (!name.ends_with(".router.bias.npy")) continue;
    CAPTURE(name);
    const std::vector<float> before = NpyFloats(dir / "step1" / "weights" / name), after = NpyFloats(e.path());
    const std::vector<float> second = NpyFloats(dir / "step2" / "updated" / name);
    REQUIRE(after.size() == 8);
    CHECK(before[0] == 100.f);
    CHECK(after[0] == 100.f - 0.01f);
    CHECK(second[0] == (100.f - 0.01f) - 0.01f);
    CHECK(NpyFloats(dir / "step2" / "weights" / name) == after);
    for (size_t i = 1; i < after.size(); ++i) {
      CHECK(std::abs(std::abs(after[i]) - 0.01f) < 1e-9f);
      if (after[i] > 0) ++raised;
    }
    ++layers;
  }
  std::filesystem::remove_all(dir);
  CHECK(layers == 3);
  CHECK(raised >= 3 * 4);  // most of the starved experts are raised (each gets its share of second choices)
}

// ZeRO-3 (docs/runtime.md, "ZeRO-3") in one process (dp 1: one shard, the
// whole): every unit gathered into fsdp_params before its ops and its
// gradients reduce-scattered from fsdp_grads, the same loss as ZeRO-0 and
// exactly the plan's bytes; what it does not execute yet is refused by name.
TEST_CASE("ZeRO-3 in one process: the step of ZeRO-0 in the plan's bytes; what is not executed is refused") {
  Json model = LoadJson("examples/models/tiny-llama.json");
  model.erase("budget");
  Json z3 = model;
  z3["parallel"]["zero"] = 3;
  const Json plan = PlanOf(z3);
  RunResult a = MustRun(PlanOf(model)), b = MustRun(plan);
  CHECK(a.measured.loss == b.measured.loss);
  CHECK(std::abs(a.measured.grad_norm - b.measured.grad_norm) <= 1e-6 * a.measured.grad_norm);
  for (size_t r = 0; r < b.measured.ranks.size(); ++r) {
    CHECK(b.measured.ranks[r].static_bytes == plan["ranks"][r]["static"]["total"].get<int64_t>());
    CHECK(b.measured.ranks[r].peak == plan["ranks"][r]["peak"].get<int64_t>());
    CHECK(b.measured.ranks[r].events.at("fsdp_gathers") > 0);
  }
  // Without resharding after forward every unit stays gathered, each at
  // its own place in the (larger) planned buffer: one gather per unit.
  Json kept = z3;
  kept["parallel"]["fsdp_reshard_after_forward"] = false;
  const Json kept_plan = PlanOf(kept);
  RunResult c = MustRun(kept_plan);
  CHECK(c.measured.loss == a.measured.loss);
  for (size_t r = 0; r < c.measured.ranks.size(); ++r) {
    CHECK(c.measured.ranks[r].static_bytes == kept_plan["ranks"][r]["static"]["total"].get<int64_t>());
    CHECK(c.measured.ranks[r].events.at("fsdp_gathers") < b.measured.ranks[r].events.at("fsdp_gathers"));
  }
  Json bf16_grads = z3;
  bf16_grads["train"]["grad_dtype"] = "bf16";
  auto refused = RunPlan(PlanOf(bf16_grads), {});
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.error().code == memplan::ErrorCode::kBadInput);
  CHECK(refused.error().message.find("/model/train/grad_dtype") != std::string::npos);
}

// A prefetch reads its payload only once the copy-out that wrote it is done
// (activation.cc): with copy engines slowed by up to 20 ms per copy, eager
// (whose prefetches are not spaced by the plan's arena), the host payloads
// of tiny-attnres's offloaded attention tensors (fp8 then host) are still
// the values saved. Without that wait this test reads half-written payloads
// (grad_norm 141.5 against 2.08), as a loaded CI machine did (8.38,
// 2026-12-05).
TEST_CASE("a prefetch waits for its payload's copy-out, even on slow copy engines") {
  Json plan = PlanOf(WithPolicy(LoadJson("examples/models/tiny-attnres.json"), Json::array({"fp8", "offload_host"}),
                                "*.attn.*"));
  RunOptions slow;
  slow.copy_jitter_us = 20000;
  slow.eager = true;
  RunResult a = MustRun(plan, slow), b = MustRun(plan);
  CHECK(a.measured.loss == b.measured.loss);
  CHECK(a.measured.grad_norm == b.measured.grad_norm);
  CHECK(a.measured.ranks[0].events.at("d2h_copies") > 0);
}
