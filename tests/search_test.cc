// `memplan search` (planner/search.h): the best layout against a brute force
// that plans every layout of the grid, pruning that never drops a layout
// that fits, the Pareto front's law, and SEARCH.json's round trips.
#include <doctest/doctest.h>

#include <map>
#include <numeric>
#include <random>
#include <set>

#include "memplan/planner/liveness.h"
#include "memplan/planner/plan.h"
#include "memplan/planner/search.h"
#include "memplan/planner/templates.h"
#include "json_test_util.h"
#include "test_util.h"

using namespace memplan;
using namespace memplan::planner;
using memplan::test::MustParse;
using memplan::test::ReadJson;

namespace {

struct Case {
  const char* file;
  int64_t gpus;
  std::vector<std::string> space;
  int64_t layers = 0;  // when not 0: the model with this many layers
};

Model Load(const Case& c) {
  Json j = ReadJson(c.file);
  if (c.layers > 0) j["arch"]["layers"] = c.layers;
  return MustParse(j);
}

// The any-plan bound of the model's own layout, and keep-all: budgets
// between them make some layouts fit and others not.
std::vector<int64_t> Budgets(const Model& m) {
  auto plan = BuildPlan(m);
  REQUIRE(plan.ok());
  int64_t any = 0, keep = 0;
  for (const auto& r : plan->ranks) {
    any = std::max(any, r.any_plan_lower_bound);
    keep = std::max(keep, r.keep_all_lower_bound);
  }
  return {any, (any + keep) / 2, keep, m.budget};
}

SearchOptions SearchFor(const Model& m, const Case& c, int64_t budget) {
  SearchOptions o;
  o.gpus = c.gpus;
  o.budget = budget;
  for (const auto& a : c.space) REQUIRE(ParseSpaceArgument(a, &o.space).ok());
  (void)m;
  return o;
}

std::vector<Candidate> EvaluateAll(const Model& m, const std::vector<Layout>& layouts, int64_t budget) {
  std::vector<Candidate> out;
  for (const auto& l : layouts) out.push_back(EvaluateLayout(m, l, budget));
  return out;
}

// The largest any-plan lower bound over ranks of `l`, planned with a
// budget so large that nothing is refused: what pruning must stay under.
int64_t AnyPlanBound(const Model& base, const Layout& l) {
  auto m = ModelWithLayout(base, l);
  REQUIRE(m.ok());
  PlanOptions po;
  po.budget = int64_t{1} << 50;
  auto plan = BuildPlan(*m, po);
  REQUIRE(plan.ok());
  int64_t lower = 0;
  for (const auto& r : plan->ranks) lower = std::max(lower, r.any_plan_lower_bound);
  return lower;
}

SearchResult MustSummarize(const Model& m, const SearchOptions& o, std::vector<Candidate> cs) {
  auto r = SummarizeSearch(m, o, std::move(cs));
  REQUIRE(r.ok());
  return *r;
}

// Every layout's index, one share.
std::vector<size_t> Every(const std::vector<Layout>& layouts) {
  std::vector<size_t> every(layouts.size());
  std::iota(every.begin(), every.end(), size_t{0});
  return every;
}

// The reference: `o` with --exhaustive, every layout planned.
SearchResult Exhaustive(const Model& base, SearchOptions o, const std::vector<Layout>& layouts) {
  o.exhaustive = true;
  return MustSummarize(base, o, SearchShare(base, o, layouts, Every(layouts)));
}

const Case kCases[] = {
    {"examples/models/tiny-gpt.json", 8, {}},
    {"examples/models/tiny-moe.json", 8, {"micro_batch=1,2"}},
    {"examples/models/tiny-llama.json", 4, {"zero=0,1", "pipeline_zero2=0,1", "grad_offload=none,host"}},
    {"examples/models/tiny-llama.json", 4, {"pp=1,4", "vp=1,2", "lighter_ends=0,1,2"}, 12},
};

}  // namespace

TEST_CASE("search: the best layout is the brute force's, which plans every combination of the grid") {
  int grids = 0, planned = 0, fitting_grids = 0;
  for (const Case& c : kCases) {
    const Model base = Load(c);
    for (int64_t budget : Budgets(base)) {
      CAPTURE(c.file);
      CAPTURE(budget);
      const SearchOptions o = SearchFor(base, c, budget);
      const SearchSpace s = SearchSpaceDefaults(base, o);
      const int64_t g = SearchGlobalBatch(base, o);
      // Brute force: every combination of the space, built and planned with
      // no pruning; the fastest that fits, ties by key.
      std::optional<std::pair<double, std::string>> best;
      std::set<std::string> valid;
      for (int64_t tp : s.tp)
        for (int64_t pp : s.pp)
          for (int64_t vp : s.vp)
            for (int64_t cp : s.cp)
              for (int64_t ep : s.ep)
                for (int64_t mb : s.micro_batch)
                  for (int64_t zero : s.zero)
                    for (int64_t pz2 : s.pipeline_zero2)
                      for (int64_t off : s.grad_offload)
                        for (int64_t sp : s.sp)
                          for (int64_t ends : s.lighter_ends) {
                          if (ends > 0 && !LighterEndsLayout(base.arch.layers, pp, vp, ends)) continue;
                          // The space's definition: sp given, or following tp.
                          if (s.sp_follows_tp && (sp != 0) != (tp > 1)) continue;
                          Layout l;
                          l.lighter_ends = ends;
                          l.tp = tp, l.pp = pp, l.vp = vp, l.cp = cp, l.ep = ep;
                          if (c.gpus % (tp * pp * cp) != 0) continue;
                          l.dp = c.gpus / (tp * pp * cp);
                          if (g % (mb * l.dp) != 0) continue;
                          l.micro_batch = mb, l.microbatches = g / (mb * l.dp);
                          l.zero = static_cast<int>(zero), l.pipeline_zero2 = pz2, l.grad_offload_host = off;
                          l.sp = sp;
                          auto m = ModelWithLayout(base, l);
                          if (!m) continue;
                          valid.insert(l.Key());
                          PlanOptions po;
                          po.budget = budget;
                          auto plan = BuildPlan(*m, po);
                          ++planned;
                          if (!plan) continue;
                          bool fits = true;
                          for (const auto& r : plan->ranks) fits = fits && r.fits;
                          if (!fits) continue;
                          std::pair<double, std::string> key{plan->overhead.step_s, l.Key()};
                          if (!best || key < *best) best = key;
                        }
      auto layouts = EnumerateLayouts(base, o);
      REQUIRE(layouts.ok());
      const SearchResult r = MustSummarize(base, o, EvaluateAll(base, *layouts, budget));
      std::set<std::string> not_invalid;
      for (const auto& cand : r.candidates) {
        if (cand.verdict != Verdict::kInvalid) not_invalid.insert(cand.layout.Key());
      }
      CHECK(not_invalid == valid);  // enumeration and validation miss no valid layout
      REQUIRE(r.ranked.empty() == !best.has_value());
      if (best) {
        const Candidate& top = r.candidates[r.ranked.front()];
        CHECK(top.layout.Key() == best->second);
        CHECK(top.step_s == best->first);
        ++fitting_grids;
      }
      ++grids;
    }
  }
  CHECK(grids == 16);
  CHECK(fitting_grids >= 12);
  CHECK(planned >= 150);
}

TEST_CASE("search: pruning never drops a layout that fits (property over models and budgets)") {
  int pruned = 0, checked = 0;
  for (const Case& c : kCases) {
    const Model base = Load(c);
    for (int64_t budget : Budgets(base)) {
      const SearchOptions o = SearchFor(base, c, budget);
      auto layouts = EnumerateLayouts(base, o);
      REQUIRE(layouts.ok());
      for (const auto& l : *layouts) {
        const Candidate cand = EvaluateLayout(base, l, budget);
        ++checked;
        if (cand.verdict != Verdict::kStaticOverBudget && cand.verdict != Verdict::kAnyPlanOverBudget) continue;
        CAPTURE(l.Key());
        CAPTURE(budget);
        // Planned anyway: no plan of it fits the search's budget.
        CHECK(AnyPlanBound(base, l) > budget);
        ++pruned;
      }
    }
  }
  CHECK(pruned >= 20);
  CHECK(checked >= 200);
}

TEST_CASE("search: the Pareto front holds every layout no other beats on both peak and step") {
  const Case& c = kCases[1];
  const Model base = Load(c);
  const auto budgets = Budgets(base);
  const SearchOptions o = SearchFor(base, c, budgets[2]);
  auto layouts = EnumerateLayouts(base, o);
  REQUIRE(layouts.ok());
  const SearchResult r = MustSummarize(base, o, EvaluateAll(base, *layouts, budgets[2]));
  REQUIRE(r.ranked.size() >= 4);
  const std::set<size_t> front(r.pareto.begin(), r.pareto.end());
  int checked = 0;
  for (size_t i : r.ranked) {
    bool dominated = false;
    for (size_t j : r.ranked) {
      const auto &a = r.candidates[i], &b = r.candidates[j];
      dominated |= b.max_peak <= a.max_peak && b.step_s <= a.step_s && (b.max_peak < a.max_peak || b.step_s < a.step_s);
    }
    // Equal on both: only the first by peak then step is on the front.
    if (!dominated) {
      bool twin_before = false;
      for (size_t j : r.pareto) {
        twin_before |= j != i && r.candidates[j].max_peak == r.candidates[i].max_peak &&
                       r.candidates[j].step_s == r.candidates[i].step_s;
      }
      CHECK((front.count(i) == 1 || twin_before));
    } else {
      CHECK(front.count(i) == 0);
    }
    ++checked;
  }
  CHECK(checked == static_cast<int>(r.ranked.size()));
  // Ranked: fastest first.
  for (size_t k = 1; k < r.ranked.size(); ++k) {
    CHECK(r.candidates[r.ranked[k - 1]].step_s <= r.candidates[r.ranked[k]].step_s);
  }
  CHECK(!WhyBestBeatsNext(r).empty());
}

TEST_CASE("search: candidates round-trip through JSON; SEARCH.json validates against its schema") {
  const Case& c = kCases[0];
  const Model base = Load(c);
  const SearchOptions o = SearchFor(base, c, Budgets(base)[0]);
  auto layouts = EnumerateLayouts(base, o);
  REQUIRE(layouts.ok());
  std::vector<Candidate> cands = EvaluateAll(base, *layouts, *o.budget);
  std::set<Verdict> verdicts;
  for (const auto& cand : cands) {
    auto back = CandidateFromJson(CandidateToJson(cand));
    REQUIRE(back.ok());
    CHECK(CandidateToJson(*back).dump() == CandidateToJson(cand).dump());
    CHECK(back->step_s == cand.step_s);
    verdicts.insert(cand.verdict);
  }
  CHECK(verdicts.size() >= 3);  // fits, invalid and a budget rejection at least
  const OrderedJson j = SearchToJson(MustSummarize(base, o, cands));
#ifdef MEMPLAN_HAVE_VALIJSON
  CHECK(memplan::test::SchemaErrors("schemas/search.schema.json", Json::parse(j.dump())) == "");
#endif
  CHECK(j["counts"]["layouts"] == cands.size());
  CHECK(!CandidateFromJson(Json{{"layout", 1}}).ok());
}

TEST_CASE("search: bad --space arguments are one-line usage errors") {
  SearchSpace s;
  CHECK(ParseSpaceArgument("pp=1,2,4", &s).ok());
  CHECK(s.pp == std::vector<int64_t>{1, 2, 4});
  CHECK(ParseSpaceArgument("grad_offload=host,none", &s).ok());
  CHECK(s.grad_offload == std::vector<int64_t>{0, 1});
  std::string many = "tp=1";
  for (int v = 2; v <= 65; ++v) many += "," + std::to_string(v);
  for (const std::string bad : {"pp", "=1", "pq=1", "pp=", "pp=0", "pp=1,x", "sp=2", "zero=4", "grad_offload=disk",
                                "tp=1.5", many.c_str()}) {
    CAPTURE(bad);
    auto r = ParseSpaceArgument(bad, &s);
    REQUIRE(!r.ok());
    CHECK(r.error().code == ErrorCode::kBadInput);
    CHECK(r.error().message.find("--space") == 0);
  }
}

TEST_CASE("search: the step bound keeps the top K of an exhaustive search, on any split into shares") {
  int compared = 0, skipped_total = 0;
  for (const Case& c : kCases) {
    const Model base = Load(c);
    for (int top : {1, 3}) {
      CAPTURE(c.file);
      CAPTURE(top);
      SearchOptions o = SearchFor(base, c, Budgets(base)[2]);
      o.top = top;
      auto layouts = EnumerateLayouts(base, o);
      REQUIRE(layouts.ok());
      const SearchResult full = Exhaustive(base, o, *layouts);
      // One share, and three interleaved shares as three processes would
      // take them: the same candidates once the bound is applied.
      std::vector<std::string> dumps;
      for (size_t shares : {size_t{1}, size_t{3}}) {
        std::vector<Candidate> all(layouts->size());
        for (size_t s = 0; s < shares; ++s) {
          std::vector<size_t> mine;
          for (size_t i = s; i < layouts->size(); i += shares) mine.push_back(i);
          auto got = SearchShare(base, o, *layouts, mine);
          for (size_t k = 0; k < mine.size(); ++k) all[mine[k]] = got[k];
        }
        const SearchResult r = MustSummarize(base, o, all);
        dumps.push_back(SearchToJson(r).dump());
        // The top K are the exhaustive search's, in the same order.
        REQUIRE(r.ranked.size() >= std::min<size_t>(static_cast<size_t>(top), full.ranked.size()));
        for (size_t k = 0; k < static_cast<size_t>(top) && k < full.ranked.size(); ++k) {
          CHECK(r.ranked[k] == full.ranked[k]);
        }
        int skipped = 0;
        for (const auto& cand : r.candidates) skipped += cand.verdict == Verdict::kStepBound;
        skipped_total += skipped;
        ++compared;
      }
      CHECK(dumps[0] == dumps[1]);
    }
  }
  CHECK(compared == 16);
  CHECK(skipped_total >= 20);  // the bound did prune
}

TEST_CASE("search: the step bound is the plan's base step, exactly") {
  int checked = 0;
  for (const char* file : {"examples/models/tiny-gpt.json", "examples/models/tiny-moe.json",
                           "examples/models/tiny-k3-ep.json", "examples/models/llama3-70b.json"}) {
    CAPTURE(file);
    const Model m = MustParse(ReadJson(file));
    auto layers = ExpandModel(m);
    REQUIRE(layers.ok());
    auto plan = BuildPlan(m);
    REQUIRE(plan.ok());
    CHECK(BaseStepSeconds(m, *layers) == plan->overhead.base_step_s);
    CHECK(plan->overhead.step_s >= plan->overhead.base_step_s);
    ++checked;
  }
  CHECK(checked == 4);
}

TEST_CASE("search: lighter pipeline ends move layers from the first and last rank to the inner ones") {
  CHECK(LighterEndsLayout(12, 4, 1, 1) == std::vector<int64_t>{2, 4, 4, 2});
  CHECK(LighterEndsLayout(12, 4, 1, 2) == std::vector<int64_t>{1, 5, 5, 1});
  CHECK(LighterEndsLayout(12, 4, 2, 1) == std::vector<int64_t>{2, 4, 4, 2});
  CHECK(!LighterEndsLayout(12, 4, 2, 2));  // an end would hold 1 < vp layers
  CHECK(!LighterEndsLayout(12, 2, 1, 1));  // no inner rank
  // Default [4, 6 x 14, 5]; each end gives one more to the first inner ranks.
  CHECK(LighterEndsLayout(93, 16, 2, 1) == std::optional<std::vector<int64_t>>(
                                               {3, 7, 7, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 4}));
  int sums = 0;
  for (int64_t layers : {9, 12, 31, 93}) {
    for (int64_t pp : {3, 4, 8}) {
      for (int64_t k : {1, 2}) {
        auto l = LighterEndsLayout(layers, pp, 1, k);
        if (!l) continue;
        CHECK(std::accumulate(l->begin(), l->end(), int64_t{0}) == layers);
        ++sums;
      }
    }
  }
  CHECK(sums >= 15);
}

TEST_CASE("search: a space too large to enumerate is refused before any work") {
  const Model m = MustParse(ReadJson("examples/models/tiny-moe.json"));
  SearchOptions o;
  o.gpus = 1 << 20;
  for (const char* dim : {"tp", "pp", "vp", "cp", "ep"}) {
    std::string arg = std::string(dim) + "=1";
    for (int v = 2; v <= 60; ++v) arg += "," + std::to_string(v);
    REQUIRE(ParseSpaceArgument(arg, &o.space).ok());
  }
  auto layouts = EnumerateLayouts(m, o);
  REQUIRE(!layouts.ok());
  CHECK(layouts.error().code == ErrorCode::kBadInput);
  CHECK(layouts.error().message.find("combinations") != std::string::npos);
}

TEST_CASE("search: on random small models and budgets, the bounded search finds the exhaustive best, and pruning drops nothing that fits") {
  std::mt19937 rng(20261203);
  auto pick = [&](std::vector<int64_t> v) { return v[std::uniform_int_distribution<size_t>(0, v.size() - 1)(rng)]; };
  int models = 0, layouts_checked = 0, pruned_checked = 0, best_compared = 0;
  for (int trial = 0; trial < 8; ++trial) {
    Json j = ReadJson(trial % 2 ? "examples/models/tiny-moe.json" : "examples/models/tiny-llama.json");
    j["arch"]["layers"] = pick({4, 6, 8});
    j["train"]["micro_batch"] = pick({1, 2});
    j["train"]["microbatches"] = pick({2, 4, 8});
    j["parallel"]["pp"] = 1;
    j["parallel"]["vp"] = 1;
    j["parallel"]["dp"] = 1;
    j["parallel"]["ep"] = 1;
    j.erase("budget");
    const Model base = MustParse(j);
    const std::vector<int64_t> budgets = Budgets(base);
    const int64_t lo = budgets[0] * 3 / 4, hi = budgets[2];
    SearchOptions o;
    o.gpus = pick({2, 4, 8});
    o.budget = std::uniform_int_distribution<int64_t>(lo, hi)(rng);
    o.top = static_cast<int>(pick({1, 2, 5}));
    CAPTURE(trial);
    CAPTURE(*o.budget);
    auto layouts = EnumerateLayouts(base, o);
    REQUIRE(layouts.ok());
    std::optional<std::pair<double, std::string>> best;
    for (const auto& l : *layouts) {
      const Candidate c = EvaluateLayout(base, l, *o.budget);
      ++layouts_checked;
      if (c.verdict == Verdict::kFits) {
        std::pair<double, std::string> key{c.step_s, l.Key()};
        if (!best || key < *best) best = key;
      }
      if (c.verdict != Verdict::kStaticOverBudget && c.verdict != Verdict::kAnyPlanOverBudget) continue;
      CHECK(AnyPlanBound(base, l) > *o.budget);
      ++pruned_checked;
    }
    const SearchResult r = MustSummarize(base, o, SearchShare(base, o, *layouts, Every(*layouts)));
    REQUIRE(r.ranked.empty() == !best.has_value());
    if (best) {
      CHECK(r.candidates[r.ranked.front()].layout.Key() == best->second);
      ++best_compared;
    }
    ++models;
  }
  CHECK(models == 8);
  CHECK(layouts_checked >= 100);
  CHECK(best_compared >= 5);
  CHECK(pruned_checked >= 5);
}

TEST_CASE("search: where offloads pass the host's memory, the bounded search keeps the exhaustive top K") {
  // Not placing a layout whose solved step cannot enter the top, and the
  // host-side rounds cut short in a search (docs/planner.md, "Search at
  // cluster scale"), against --exhaustive, which does neither. A small
  // host memory makes plans pin host offloads to recompute.
  int compared = 0, pinned_plans = 0;
  for (const char* file : {"examples/models/tiny-llama.json", "examples/models/tiny-moe.json"}) {
    for (const char* host : {"128KiB", "256KiB", "1MiB"}) {
      Json j = ReadJson(file);
      j["hardware"]["host_memory"] = host;
      j.erase("budget");
      const Model base = MustParse(j);
      for (int64_t budget : Budgets(base)) {
        CAPTURE(file);
        CAPTURE(host);
        CAPTURE(budget);
        PlanOptions po;
        po.budget = budget;
        if (auto plan = BuildPlan(base, po); plan.ok()) {
          for (const auto& w : plan->warnings) pinned_plans += w.rfind("host memory:", 0) == 0;
        }
        SearchOptions o;
        o.gpus = 4;
        o.budget = budget;
        o.top = 5;
        auto layouts = EnumerateLayouts(base, o);
        REQUIRE(layouts.ok());
        const SearchResult full = Exhaustive(base, o, *layouts);
        const SearchResult r = MustSummarize(base, o, SearchShare(base, o, *layouts, Every(*layouts)));
        REQUIRE(r.ranked.size() >= std::min<size_t>(5, full.ranked.size()));
        for (size_t k = 0; k < 5 && k < full.ranked.size(); ++k) {
          CHECK(r.candidates[r.ranked[k]].layout.Key() == full.candidates[full.ranked[k]].layout.Key());
          CHECK(r.candidates[r.ranked[k]].step_s == full.candidates[full.ranked[k]].step_s);
          ++compared;
        }
      }
    }
  }
  MESSAGE("host-limited searches: " << compared << " ranked layouts compared, " << pinned_plans
                                    << " base plans with host offloads pinned");
  CHECK(compared >= 40);
  CHECK(pinned_plans >= 3);
}
