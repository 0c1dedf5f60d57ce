// Targets (planner/target.h, docs/targets.md): memplan's own runtime is
// unchanged; a plan for Megatron stores tensors only as Megatron's settings
// can, holds Megatron's buffers, reserves what PyTorch's allocator
// reserves, keeps its headroom, and search ranks only what Megatron accepts.
#include <doctest/doctest.h>

#include <sstream>

#include "memplan/planner/framework.h"
#include "memplan/planner/megatron_args.h"
#include "memplan/planner/megatron_theory.h"
#include "memplan/planner/plan.h"
#include "memplan/planner/search.h"
#include "memplan/planner/target.h"
#include "test_util.h"

namespace memplan::planner {
namespace {

Plan MustPlan(const Model& m, const PlanOptions& o = {}) {
  auto p = BuildPlan(m, o);
  if (!p) FAIL(p.error().message);
  return *p;
}

Model ForMegatron(const std::string& example) {
  Model m = memplan::test::MustLoad(example);
  ApplyTarget(&m, TargetKind::kMegatron);
  return m;
}

}  // namespace

TEST_CASE("target megatron: every rank keeps its headroom, reserved covers allocated, and only Megatron's storage") {
  // Budgets where Megatron needs settings (llama3-70b at 30 GiB, DeepSeek-V3
  // at 40 GiB) and one where it needs none (gpt3-175b).
  int checked = 0;
  for (auto [example, budget] : std::vector<std::pair<std::string, int64_t>>{
           {"examples/models/llama3-70b.json", int64_t{30} << 30},
           {"examples/models/deepseek-v3.json", int64_t{40} << 30},
           {"examples/models/gpt3-175b.json", 0}}) {
    CAPTURE(example);
    Model m = ForMegatron(example);
    if (budget) m.budget = budget;
    const Plan p = MustPlan(m);
    REQUIRE(p.model.target.settings.has_value());
    CHECK(p.model.options.moe_grad_rewrite == m.arch.moe.has_value());
    CHECK_FALSE(p.model.options.moe_recompute_dispatch);
    CHECK(p.headroom == std::max<int64_t>(int64_t{2} << 30, m.hardware.device_memory / 40));
    for (const auto& r : p.ranks) {
      CAPTURE(r.pp_rank);
      CHECK(r.fits);
      CHECK(r.margin >= p.headroom);
      CHECK(r.margin == r.budget - r.reserved - r.statics.runtime);
      CHECK(r.reserved >= r.allocated);
      CHECK(r.allocated >= r.lower_bound);  // rounded blocks hold at least the live bytes
      CHECK(r.statics.buffer_detail.count("te_cublas_workspace") == 1);
      CHECK(r.statics.buffer_detail.count("gemm_workspace") == 0);
      ++checked;
    }
    // Neither FP8 nor remote offload: Megatron has no per-tensor setting.
    for (const auto& t : p.tensors) {
      for (Policy x : t.effective) CHECK((x == Policy::kKeep || x == Policy::kRecompute || x == Policy::kOffloadHost));
    }
    // The plan's model fixes its settings: planning it again is the plan.
    const Plan again = MustPlan(p.model);
    REQUIRE(again.ranks.size() == p.ranks.size());
    for (size_t r = 0; r < p.ranks.size(); ++r) CHECK(again.ranks[r].reserved == p.ranks[r].reserved);
    CHECK(again.digest == p.digest);
    // And the settings pass Megatron's rules.
    CHECK_FALSE(ValidateMegatronArgs(MegatronArgsOf(p.model, *p.model.target.settings)).has_value());
  }
  CHECK(checked > 20);
}

TEST_CASE("target megatron: no dispatch recompute, so Megatron's MoE layer saves more; the FC2 output neither saves") {
  // DeepSeek-V3 with every tensor kept: the same layout saves more bytes per
  // microbatch as Megatron runs it (the dispatched rows are saved, not
  // rebuilt), and neither saves FC2's output (Megatron weights the
  // activation by the gates: memplan's gradient rewrite; docs/targets.md).
  Model own = memplan::test::MustLoad("examples/models/deepseek-v3.json");
  own.policies = {{"*", {Policy::kKeep}}};
  own.budget = int64_t{1} << 45;
  Model meg = own;
  ApplyTarget(&meg, TargetKind::kMegatron);
  meg.policies.clear();
  meg.target.settings = FrameworkSettings{};
  const Plan a = MustPlan(own), b = MustPlan(meg);
  int64_t own_bytes = 0, meg_bytes = 0;
  for (const auto& r : a.ranks) own_bytes += r.activations_per_microbatch;
  for (const auto& r : b.ranks) meg_bytes += r.activations_per_microbatch;
  CHECK(meg_bytes > own_bytes);
  int64_t fc2_out = 0, fc1_in = 0;
  for (const auto& t : b.tensors) {
    if (t.name.ends_with("moe.fc2_out")) fc2_out += t.device_bytes;
    if (t.name.ends_with("moe.fc1_in")) fc1_in += t.device_bytes;
  }
  CHECK(fc2_out == 0);
  CHECK(fc1_in > 0);
}

TEST_CASE("target megatron: what Megatron cannot run is refused with the reason") {
  auto refused = [](const std::string& example) {
    Model m = ForMegatron(example);
    auto p = BuildPlan(m);
    REQUIRE_FALSE(p.ok());
    CHECK(p.error().code == ErrorCode::kBadInput);
    return p.error().message;
  };
  CHECK(refused("examples/models/tiny-k3.json").find("KDA") != std::string::npos);
  CHECK(refused("examples/models/tiny-attnres.json").find("attention residuals") != std::string::npos);
  Model m = ForMegatron("examples/models/llama3-70b.json");
  m.parallel.tp = 3;  // 64 heads
  auto p = BuildPlan(m);
  REQUIRE_FALSE(p.ok());
  CHECK(p.error().message.ends_with(
      "llama3-70b.json: /target: megatron refuses the model: --num-attention-heads: num_attention_heads (64) must be "
      "a multiple of tensor_model_parallel_size (3)"));
  // Per-tensor annotations are memplan's: Megatron takes settings.
  Model annotated = ForMegatron("examples/models/gpt3-175b.json");
  annotated.policies = {{"layer1.attn.probs", {Policy::kFp8}}};
  auto q = BuildPlan(annotated);
  REQUIRE_FALSE(q.ok());
  CHECK(q.error().message.find("policies: Megatron stores tensors by module settings") != std::string::npos);
}

TEST_CASE("headroom: memplan's solver keeps it free; a rank inside it is warned") {
  Model m = memplan::test::MustLoad("examples/models/llama3-70b.json");
  m.budget = int64_t{30} << 30;
  const Plan tight = MustPlan(m);
  PlanOptions o;
  o.headroom = int64_t{4} << 30;
  const Plan roomy = MustPlan(m, o);
  CHECK(roomy.headroom == o.headroom);
  for (size_t r = 0; r < roomy.ranks.size(); ++r) {
    CHECK(roomy.ranks[r].margin >= *o.headroom);
    CHECK(roomy.ranks[r].reserved == roomy.ranks[r].peak);  // memplan's arena: reserved is the peak
    CHECK(roomy.ranks[r].reserved <= tight.ranks[r].reserved);
  }
  // Megatron with settings fixed that leave less than the headroom: fits,
  // with a warning that names the rank.
  Model g = ForMegatron("examples/models/gpt3-175b.json");
  g.target.settings = FrameworkSettings{};
  const Plan fixed = MustPlan(g);
  int64_t least = INT64_MAX;
  for (const auto& r : fixed.ranks) least = std::min(least, r.margin);
  PlanOptions within;
  within.headroom = least + (int64_t{1} << 20);
  const Plan warned = MustPlan(g, within);
  bool said = false;
  for (const auto& w : warned.warnings) said |= w.find("inside the headroom") != std::string::npos;
  CHECK(said);
}

TEST_CASE("search --target megatron: every ranked layout is one Megatron accepts, keeps the headroom, and the "
          "export of the best reproduces its row") {
  Model base = ForMegatron("examples/models/llama3-70b.json");
  SearchOptions o;
  o.gpus = 512;
  o.top = 3;
  auto layouts = EnumerateLayouts(base, o);
  REQUIRE(layouts.ok());
  std::vector<size_t> all(layouts->size());
  for (size_t i = 0; i < all.size(); ++i) all[i] = i;
  auto cs = SearchShare(base, o, *layouts, all);
  auto r = SummarizeSearch(base, o, std::move(cs));
  REQUIRE(r.ok());
  REQUIRE(!r->ranked.empty());
  int megatron_refused = 0;
  for (const auto& c : r->candidates) megatron_refused += c.reason.rfind("megatron", 0) == 0;
  for (size_t i : r->ranked) {
    const Candidate& c = r->candidates[i];
    CAPTURE(c.layout.Key());
    CHECK(c.min_margin >= r->headroom);
    auto m = ModelWithLayout(base, c.layout);
    REQUIRE(m.ok());
    CHECK_FALSE(MegatronRefusal(*m).has_value());
  }
  // The best layout, planned and exported: the same reserved peak and step.
  const Candidate& best = r->candidates[r->ranked.front()];
  auto m = ModelWithLayout(base, best.layout);
  REQUIRE(m.ok());
  const Plan p = MustPlan(*m);
  auto e = ExportMegatron(p);
  REQUIRE(e.ok());
  int64_t reserved = 0;
  for (const auto& rank : e->coarse_plan.ranks) reserved = std::max(reserved, rank.reserved);
  CHECK(reserved == best.max_peak);
  CHECK(e->coarse_plan.overhead.step_s == doctest::Approx(best.step_s).epsilon(1e-12));
  std::istringstream words(SettingsFlags(*e->coarse.target.settings));
  for (std::string w; words >> w;) {
    if (w != "none") CHECK(e->text.find(w) != std::string::npos);
  }
  MESSAGE("layouts refused by Megatron's rules: " << megatron_refused);
}

TEST_CASE("search --target megatron: layouts Megatron refuses are rejected with its reason") {
  // tiny-moe without its AttnRes, tp 1 or 2 and no sequence parallelism:
  // MoE under tensor parallelism needs it (moe_layer.py), so every tp 2
  // layout is Megatron's refusal and only tp 1 is ranked.
  Model base = ForMegatron("examples/models/tiny-moe.json");
  base.arch.attn_res.reset();
  SearchOptions o;
  o.gpus = 8;
  o.top = 3;
  REQUIRE(ParseSpaceArgument("tp=1,2", &o.space).ok());
  REQUIRE(ParseSpaceArgument("sp=0", &o.space).ok());
  auto layouts = EnumerateLayouts(base, o);
  REQUIRE(layouts.ok());
  std::vector<size_t> all(layouts->size());
  for (size_t i = 0; i < all.size(); ++i) all[i] = i;
  auto r = SummarizeSearch(base, o, SearchShare(base, o, *layouts, all));
  REQUIRE(r.ok());
  int refused = 0;
  for (const auto& c : r->candidates) {
    if (c.reason.rfind("megatron", 0) != 0) continue;
    CHECK(c.layout.tp == 2);
    CHECK(c.detail.find("without also enabling sequence parallelism") != std::string::npos);
    ++refused;
  }
  CHECK(refused > 0);
  for (size_t i : r->ranked) CHECK(r->candidates[i].layout.tp == 1);
  CHECK(RenderSearchTable(*r).find("Megatron refuses --sequence-parallel") != std::string::npos);
}

TEST_CASE("Megatron's own estimate: the first stage's parameters are memplan's, term for term") {
  // report_theoretical_memory (megatron_theory.h) puts a share of the final
  // norm on every stage (ns h / pp) and leaves out learned position
  // embeddings; memplan's rank 0 holds neither the final norm nor less than
  // the whole position table. Those are the only differences
  // (docs/targets.md, "Against Megatron's own estimate").
  int checked = 0;
  for (const char* example : {"examples/models/llama3-70b.json", "examples/models/gpt3-175b.json"}) {
    CAPTURE(example);
    Model m = ForMegatron(example);
    FrameworkSettings selective;
    selective.granularity = "selective";
    selective.recompute_modules = {"core_attn"};
    m.target.settings = selective;
    const Plan p = MustPlan(m);
    const MegatronArgs args = MegatronArgsOf(m, selective);
    const MegatronTheory t = MegatronTheoreticalMemory(m, args);
    const double ns = m.arch.norm == Norm::kRmsNorm ? 1 : 2;
    const double megatron = t.tp_split_params + t.replicated_params + t.expert_params;
    const double positions = static_cast<double>(m.arch.position_embeddings * m.arch.hidden);
    const double explained = positions - ns * static_cast<double>(m.arch.hidden) / static_cast<double>(m.parallel.pp);
    CHECK(static_cast<double>(p.ranks.front().statics.params) - megatron == doctest::Approx(explained).epsilon(1e-9));
    // Selective recompute of core attention with SP: 18 + 4F/h bytes per
    // token of a layer (Korthikanti's 34 for F = 4h) for GPT-3's layers,
    // as memplan stores them.
    if (m.arch.ffn_act == FfnAct::kGelu) CHECK(t.per_layer_coefficient == doctest::Approx(34));
    ++checked;
  }
  CHECK(checked == 2);
}

TEST_CASE("target megatron: MLA's down-projections are saved on the sequence-parallel shard") {
  // multi_latent_attention.py runs them in duplicated mode on the SP-local
  // input; memplan's own runtime computes them on every token.
  Model own = memplan::test::MustLoad("examples/models/tiny-mla.json");
  own.parallel.tp = 2;
  own.parallel.sp = true;
  own.parallel.dp = std::max<int64_t>(1, own.parallel.dp / 2);
  Model meg = own;
  ApplyTarget(&meg, TargetKind::kMegatron);
  const Plan a = MustPlan(own), b = MustPlan(meg);
  auto rows = [](const Plan& p, const std::string& suffix) {
    for (const auto& t : p.tensors) {
      if (t.name.ends_with(suffix)) return t.shape.front();
    }
    return int64_t{-1};
  };
  int checked = 0;
  for (const char* t : {".attn.kv_a", ".attn.kv_b_in"}) {
    CAPTURE(t);
    REQUIRE(rows(a, t) > 0);
    CHECK(rows(b, t) * 2 == rows(a, t));
    ++checked;
  }
  CHECK(checked == 2);
}

TEST_CASE("throughput: model FLOPs per token are Korthikanti et al.'s for GPT-3 175B") {
  // arXiv 2205.05198, section 5 (model FLOPs per iteration): 72 B s l h^2
  // (1 + s / 6h + V / 12 l h); per token, B s = 1.
  const Model m = memplan::test::MustLoad("examples/models/gpt3-175b.json");
  const Plan p = MustPlan(m);
  const double l = 96, h = 12288, s = 2048, v = 51200;
  const double paper = 72 * l * h * h * (1 + s / (6 * h) + v / (12 * l * h));
  CHECK(ModelFlopsPerToken(m, p.totals) == doctest::Approx(paper).epsilon(0.002));
  const Throughput t = ModelledThroughput(m, p.totals, p.overhead.step_s);
  const double gpus = static_cast<double>(m.parallel.Processes());
  CHECK(t.tokens_per_s_per_gpu * p.overhead.step_s * gpus ==
        doctest::Approx(static_cast<double>(m.train.micro_batch * m.train.microbatches * m.parallel.dp) * s));
  CHECK(t.mfu == doctest::Approx(t.tokens_per_s_per_gpu * t.flops_per_token / m.hardware.bf16_flops));
  CHECK(ThroughputLine(t).rfind("modelled: ", 0) == 0);
}

}  // namespace memplan::planner
