// `memplan search`: the layouts of a model on N GPUs, and each one's verdict
// (search.h). Ranking and output are in search_output.cc.
#include "memplan/planner/search.h"

#include <algorithm>
#include <set>
#include <atomic>
#include <limits>
#include <mutex>
#include <numeric>
#include <sstream>

#include "memplan/common/parallel.h"
#include "memplan/common/table.h"
#include "memplan/common/units.h"
#include "memplan/planner/accounting.h"
#include "memplan/planner/layout.h"
#include "memplan/planner/liveness.h"
#include "memplan/planner/plan.h"
#include "memplan/planner/target.h"
#include "memplan/planner/templates.h"

namespace memplan::planner {
namespace {

// Bounds on a search (hostile or mistaken --space lists): values per
// dimension, and combinations the enumeration may visit.
constexpr size_t kMaxSpaceValues = 64;
constexpr double kMaxCombinations = 2e6;

std::vector<int64_t> Sorted(std::vector<int64_t> v) {
  std::sort(v.begin(), v.end());
  v.erase(std::unique(v.begin(), v.end()), v.end());
  return v;
}

std::vector<int64_t> PowersOfTwoUpTo(int64_t n) {
  std::vector<int64_t> out;
  for (int64_t v = 1; v <= n; v *= 2) out.push_back(v);
  return out;
}

bool Contains(const std::vector<int64_t>& v, int64_t x) { return std::find(v.begin(), v.end(), x) != v.end(); }

Expected<std::vector<int64_t>> ParseValues(const std::string& key, const std::string& list) {
  std::vector<int64_t> out;
  std::stringstream in(list);
  std::string item;
  while (std::getline(in, item, ',')) {
    if (key == "grad_offload") {
      if (item == "none" || item == "host") {
        out.push_back(item == "host" ? 1 : 0);
        continue;
      }
      return Error{ErrorCode::kBadInput, "--space " + key + ": expected none or host, got \"" + item + "\""};
    }
    int64_t v = 0;
    size_t used = 0;
    try {
      v = std::stoll(item, &used);
    } catch (...) {
      used = 0;
    }
    const bool flag = key == "sp" || key == "pipeline_zero2";
    const int64_t hi = flag ? 1 : key == "zero" ? 3 : 1 << 20;
    const int64_t lo = flag || key == "zero" || key == "lighter_ends" ? 0 : 1;
    if (item.empty() || used != item.size() || v < lo || v > hi) {
      return Error{ErrorCode::kBadInput, "--space " + key + ": expected integers in " + std::to_string(lo) + ".." +
                                             std::to_string(hi) + " separated by commas, got \"" + item + "\""};
    }
    out.push_back(v);
  }
  if (out.empty()) return Error{ErrorCode::kBadInput, "--space " + key + ": expected at least one value"};
  out = Sorted(out);
  if (out.size() > kMaxSpaceValues) {
    return Error{ErrorCode::kBadInput, "--space " + key + ": " + std::to_string(out.size()) + " values; at most " +
                                           std::to_string(kMaxSpaceValues) + " per dimension"};
  }
  return out;
}

// "FILE: /pointer: message" -> "/pointer".
std::string PointerOf(const std::string& message, const std::string& file) {
  std::string rest = message;
  if (!file.empty() && rest.rfind(file + ": ", 0) == 0) rest = rest.substr(file.size() + 2);
  if (rest.empty() || rest[0] != '/') return "model";
  return rest.substr(0, rest.find(": "));
}

// A layout solved but not placed: its solved step exceeds the top steps.
void MarkNotPlaced(Candidate* c) {
  const Layout l = c->layout;
  const double bound = c->base_bound_s, solved = c->solved_step_s;
  const std::vector<double> steps = c->solved_steps;
  const int64_t st = c->max_static;
  *c = Candidate{};
  c->layout = l;
  c->base_bound_s = bound;
  c->solved_step_s = solved;
  c->solved_steps = steps;
  c->max_static = st;
  c->verdict = Verdict::kStepBound;
  c->detail = "its solved step " + FormatFixed(solved * 1e3, 1) +
              " ms (before placement) exceeds the top layouts' steps: not placed";
}

// Refused by the model file's own checks: the JSON pointer is the reason.
void MarkInvalid(const std::string& message, const std::string& file, Candidate* c) {
  c->verdict = Verdict::kInvalid;
  c->reason = PointerOf(message, file);
  c->detail = message;
  if (c->detail.rfind(file + ": ", 0) == 0) c->detail = c->detail.substr(file.size() + 2);
}

}  // namespace

std::string Layout::Key() const {
  return "tp=" + std::to_string(tp) + " pp=" + std::to_string(pp) + " vp=" + std::to_string(vp) +
         " cp=" + std::to_string(cp) + " ep=" + std::to_string(ep) + " dp=" + std::to_string(dp) +
         " mb=" + std::to_string(micro_batch) + "x" + std::to_string(microbatches) + " zero=" + std::to_string(zero) +
         " sp=" + (sp ? "1" : "0") + " pz2=" + (pipeline_zero2 ? "1" : "0") +
         " offload=" + (grad_offload_host ? "host" : "none") + " ends=" + std::to_string(lighter_ends);
}

std::optional<std::vector<int64_t>> LighterEndsLayout(int64_t layers, int64_t pp, int64_t vp, int64_t k) {
  if (pp < 3 || k < 1 || layers < pp * vp) return std::nullopt;
  std::vector<int64_t> out = DefaultPipelineLayout(layers, pp, vp);
  for (size_t end : {size_t{0}, static_cast<size_t>(pp - 1)}) {
    if (out[end] - k < vp) return std::nullopt;
    out[end] -= k;
    for (int64_t moved = 0; moved < k; ++moved) {
      auto inner = std::min_element(out.begin() + 1, out.end() - 1);
      ++*inner;
    }
  }
  return out;
}

Expected<bool> ParseSpaceArgument(const std::string& arg, SearchSpace* space) {
  const size_t eq = arg.find('=');
  if (eq == std::string::npos || eq == 0) {
    return Error{ErrorCode::kBadInput, "--space: expected key=v1,v2,... (keys tp, pp, vp, cp, ep, dp, micro_batch, "
                                       "zero, sp, pipeline_zero2, grad_offload, lighter_ends), got \"" + arg + "\""};
  }
  const std::string key = arg.substr(0, eq);
  std::map<std::string, std::vector<int64_t>*> fields{
      {"tp", &space->tp},     {"pp", &space->pp},
      {"vp", &space->vp},     {"cp", &space->cp},
      {"ep", &space->ep},     {"dp", &space->dp},
      {"micro_batch", &space->micro_batch}, {"zero", &space->zero},
      {"sp", &space->sp},     {"pipeline_zero2", &space->pipeline_zero2},
      {"grad_offload", &space->grad_offload}, {"lighter_ends", &space->lighter_ends}};
  auto it = fields.find(key);
  if (it == fields.end()) {
    return Error{ErrorCode::kBadInput, "--space: unknown key \"" + key + "\" (expected tp, pp, vp, cp, ep, dp, "
                                       "micro_batch, zero, sp, pipeline_zero2, grad_offload or lighter_ends)"};
  }
  auto values = ParseValues(key, arg.substr(eq + 1));
  if (!values) return values.error();
  *it->second = *values;
  return true;
}

SearchSpace SearchSpaceDefaults(const Model& base, const SearchOptions& o) {
  const Parallel& p = base.parallel;
  const int64_t n = std::max<int64_t>(1, o.gpus);
  SearchSpace s = o.space;
  auto fill = [](std::vector<int64_t>& v, std::vector<int64_t> d) {
    if (v.empty()) v = Sorted(std::move(d));
  };
  fill(s.tp, {1, 2, 4, 8, p.tp});
  std::vector<int64_t> pp = PowersOfTwoUpTo(std::min(n, base.arch.layers));
  pp.push_back(p.pp);
  fill(s.pp, pp);
  fill(s.vp, {1, 2, p.vp});
  fill(s.cp, {1, p.cp});
  if (base.arch.moe) {
    std::vector<int64_t> ep;
    for (int64_t e : PowersOfTwoUpTo(std::min(n, base.arch.moe->experts))) {
      if (base.arch.moe->experts % e == 0) ep.push_back(e);
    }
    ep.push_back(p.ep);
    fill(s.ep, ep);
  } else {
    fill(s.ep, {1});
  }
  fill(s.micro_batch, {1, 2, base.train.micro_batch});
  fill(s.zero, {p.zero});
  if (s.sp.empty()) {
    // SP follows tp: the model's own sp is no reason to leave it off at tp > 1.
    s.sp = {0, 1};
    s.sp_follows_tp = true;
  }
  fill(s.pipeline_zero2, {p.pipeline_zero2 ? 1 : 0});
  fill(s.grad_offload, {p.grad_offload_host ? 1 : 0});
  fill(s.lighter_ends, {0, 1});
  return s;  // dp stays as given: empty means every value that completes the grid
}

int64_t SearchBudget(const Model& base, const SearchOptions& o) { return o.budget ? *o.budget : base.budget; }

int64_t SearchGlobalBatch(const Model& base, const SearchOptions& o) {
  return o.global_batch ? *o.global_batch : base.train.micro_batch * base.train.microbatches * base.parallel.dp;
}

Expected<std::vector<Layout>> EnumerateLayouts(const Model& base, const SearchOptions& o) {
  if (o.gpus < 1) return Error{ErrorCode::kBadInput, "--gpus: expected at least 1 GPU"};
  if (!base.graph.empty()) {
    return Error{ErrorCode::kBadInput, base.file + ": /graph: a model with explicit layer graphs fixes its per-device "
                                       "shapes, so its layout cannot be searched (give the architecture instead)"};
  }
  const SearchSpace s = SearchSpaceDefaults(base, o);
  const int64_t g = SearchGlobalBatch(base, o);
  if (g < 1) return Error{ErrorCode::kBadInput, "--global-batch: expected at least 1 sequence"};
  double combinations = 1;
  for (const auto* v : {&s.tp, &s.sp, &s.pp, &s.vp, &s.cp, &s.ep, &s.micro_batch, &s.zero, &s.pipeline_zero2,
                        &s.grad_offload, &s.lighter_ends}) {
    combinations *= static_cast<double>(v->size());
  }
  if (combinations > kMaxCombinations) {
    return Error{ErrorCode::kBadInput, "--space: " + FormatFixed(combinations, 0) + " combinations of values; at most " +
                                           FormatFixed(kMaxCombinations, 0) + " (narrow the lists)"};
  }
  std::vector<Layout> out;
  // Why layouts were left out, by the first rule each failed: when none is
  // left the error says which rule removed them (exit 2, not a budget).
  std::set<int64_t> grids, dps;
  int64_t shapes = 0, dividing = 0, dp_listed = 0, batch_ok = 0, offload_ok = 0;
  for (int64_t tp : s.tp)
    for (int64_t sp : s.sp) {
      if (sp && tp == 1) continue;  // sequence parallelism is over the TP group
      if (s.sp_follows_tp && (sp != 0) != (tp > 1)) continue;
      for (int64_t pp : s.pp)
        for (int64_t vp : s.vp) {
          if (vp > 1 && pp == 1) continue;  // interleaving is across pipeline ranks
          for (int64_t cp : s.cp) {
            ++shapes;
            const int64_t grid = tp * pp * cp;
            grids.insert(grid);
            if (o.gpus % grid != 0) continue;
            ++dividing;
            const int64_t dp = o.gpus / grid;
            dps.insert(dp);
            if (!s.dp.empty() && !Contains(s.dp, dp)) continue;
            ++dp_listed;
            for (int64_t ep : s.ep)
              for (int64_t mb : s.micro_batch) {
                if (g % (mb * dp) != 0) continue;
                ++batch_ok;
                for (int64_t zero : s.zero)
                  for (int64_t pz2 : s.pipeline_zero2)
                    for (int64_t off : s.grad_offload) {
                      if (off && !pz2) continue;  // host gradient offload is pipeline ZeRO-2's
                      ++offload_ok;
                      for (int64_t ends : s.lighter_ends) {
                      if (ends > 0 && !LighterEndsLayout(base.arch.layers, pp, vp, ends)) continue;
                      Layout l;
                      l.tp = tp, l.pp = pp, l.vp = vp, l.cp = cp, l.ep = ep, l.dp = dp;
                      l.micro_batch = mb;
                      l.microbatches = g / (mb * dp);
                      l.zero = static_cast<int>(zero);
                      l.sp = sp != 0;
                      l.pipeline_zero2 = pz2 != 0;
                      l.grad_offload_host = off != 0;
                      l.lighter_ends = ends;
                      out.push_back(l);
                      }
                    }
              }
          }
        }
    }
  if (!out.empty()) return out;
  auto list = [](const auto& values) {
    std::string text;
    for (int64_t v : values) text += (text.empty() ? "" : ",") + std::to_string(v);
    return "{" + text + "}";
  };
  std::string why;
  if (shapes == 0) {
    why = "the space pairs sp only with tp 1 or vp > 1 only with pp 1 (sequence parallelism needs tp > 1, "
          "interleaving pp > 1)";
  } else if (dividing == 0) {
    why = "--gpus " + std::to_string(o.gpus) + " is not a multiple of any tp x pp x cp of the space (products " +
          list(grids) + ")";
  } else if (dp_listed == 0) {
    why = "--space dp=" + list(s.dp) + ": --gpus " + std::to_string(o.gpus) + " over the space's tp x pp x cp gives dp " +
          list(dps) + " only";
  } else if (batch_ok == 0) {
    why = "the global batch " + std::to_string(g) + " is not a multiple of micro_batch x dp for any layout (micro_batch " +
          list(s.micro_batch) + ", dp " + list(dps) + ")";
  } else if (offload_ok == 0) {
    why = "grad_offload=1 needs pipeline_zero2=1, which the space leaves out";
  } else {
    why = "lighter_ends=" + list(s.lighter_ends) + " divides the " + std::to_string(base.arch.layers) +
          " layers over no pp x vp of the space with lighter first and last stages";
  }
  return Error{ErrorCode::kBadInput, "search: no layout exists: " + why};
}

std::string_view VerdictName(Verdict v) {
  switch (v) {
    case Verdict::kFits: return "fits";
    case Verdict::kInvalid: return "invalid";
    case Verdict::kStaticOverBudget: return "static_over_budget";
    case Verdict::kAnyPlanOverBudget: return "any_plan_over_budget";
    case Verdict::kDoesNotFit: return "does_not_fit";
    case Verdict::kStepBound: return "step_bound";
    case Verdict::kError: return "error";
    case Verdict::kPending: return "pending";
  }
  return "error";
}

Json ModelJsonWithLayout(const Model& base, const Layout& l) {
  Json j = NormalizedModelJson(base);
  Json& p = j["parallel"];
  const bool same_stages = l.pp == base.parallel.pp && l.vp == base.parallel.vp;
  if (!same_stages || !base.parallel.pp_layout_given) p.erase("pp_layout");
  if (l.lighter_ends > 0) {
    if (auto layout = LighterEndsLayout(base.arch.layers, l.pp, l.vp, l.lighter_ends)) p["pp_layout"] = *layout;
  }
  p["tp"] = l.tp;
  p["sp"] = l.sp;
  p["pp"] = l.pp;
  p["vp"] = l.vp;
  p["cp"] = l.cp;
  p["ep"] = l.ep;
  p["dp"] = l.dp;
  p["zero"] = l.zero;
  p["pipeline_zero2"] = l.pipeline_zero2;
  p["grad_offload"] = l.grad_offload_host ? "host" : "none";
  j["train"]["micro_batch"] = l.micro_batch;
  j["train"]["microbatches"] = l.microbatches;
  // pp_balance defaults on with pp > 1: a base on one rank said nothing.
  if (base.parallel.pp == 1) j["options"].erase("pp_balance");
  if (!base.budget_given) j.erase("budget");
  return j;
}

Expected<Model> ModelWithLayout(const Model& base, const Layout& layout) {
  return ParseModel(ModelJsonWithLayout(base, layout), base.file);
}

Candidate PrepareLayout(const Model& base, const Layout& layout, int64_t budget) {
  Candidate c;
  c.layout = layout;
  auto model = ModelWithLayout(base, layout);
  if (!model) {
    MarkInvalid(model.error().message, base.file, &c);
    return c;
  }
  // A layout the target refuses (Megatron's argument rules), with its
  // reason: the flag is the rejection's key.
  if (auto why = GetTarget(model->target.kind).Refusal(*model)) {
    c.verdict = Verdict::kInvalid;
    c.reason = std::string(TargetName(model->target.kind)) + " " + why->substr(0, why->find(':'));
    c.detail = *why;
    return c;
  }
  try {
    // Static memory alone: weights, gradients, optimizer state and buffers.
    auto layers = ExpandModel(*model);
    if (!layers) throw ErrorException(layers.error());
    const PipelineLayout pl = MakePipelineLayout(*model);
    int64_t runtime = 0;  // outside the framework: the largest rank's
    for (int64_t r = 0; r < model->parallel.pp; ++r) {
      StaticBreakdown st = AccountRank(*model, *layers, pl, r);
      GetTarget(model->target.kind).StaticBuffers(*model, r, &st);
      c.max_static = std::max(c.max_static, st.total);
      runtime = std::max(runtime, st.runtime);
    }
    if (c.max_static + runtime > budget) {
      c.verdict = Verdict::kStaticOverBudget;
      c.detail = "static memory " + FormatBytes(c.max_static) +
                 (runtime > 0 ? " plus " + FormatBytes(runtime) + " outside the framework" : std::string()) +
                 " exceeds the budget " + FormatBytes(budget);
      return c;
    }
    c.base_bound_s = BaseStepSeconds(*model, *layers);
    c.verdict = Verdict::kPending;
  } catch (const ErrorException& e) {
    c.verdict = Verdict::kError;
    c.detail = e.error().message;
  }
  return c;
}

bool PlanLayout(const Model& base, int64_t budget, Candidate* out, const std::function<bool(double)>& place_if,
                bool defer_host) {
  Candidate& c = *out;
  try {
    auto model = ModelWithLayout(base, c.layout);
    if (!model) throw ErrorException(model.error());
    PlanOptions po;
    po.budget = budget;
    bool not_placed = false;
    c.solved_steps.clear();
    if (place_if) {
      po.place_if = [&](double step_s) {
        c.solved_steps.push_back(step_s);
        return place_if(step_s);
      };
      po.not_placed = &not_placed;
    }
    bool deferred = false;
    if (defer_host) po.deferred = &deferred;
    auto plan = BuildPlan(*model, po);
    if (not_placed) {
      c.solved_step_s = c.solved_steps.back();
      MarkNotPlaced(&c);
      return false;
    }
    if (deferred) {
      c.solved_steps.clear();
      return true;
    }
    if (!plan) {
      if (plan.error().code == ErrorCode::kBadInput) {
        // Too many microbatches to simulate without a periodic window.
        MarkInvalid(plan.error().message, base.file, &c);
        return false;
      }
      c.verdict = plan.error().code == ErrorCode::kInfeasible ? Verdict::kAnyPlanOverBudget : Verdict::kError;
      c.detail = plan.error().message;
      return false;
    }
    // Never a layout inside the headroom (--headroom; docs/targets.md).
    bool fits = true;
    c.min_margin = std::numeric_limits<int64_t>::max();
    for (const auto& r : plan->ranks) {
      fits = fits && r.fits && r.margin >= plan->headroom;
      c.max_peak = std::max(c.max_peak, r.reserved);
      c.max_any_plan = std::max(c.max_any_plan, r.any_plan_lower_bound);
      c.min_margin = std::min(c.min_margin, r.margin);
    }
    if (const auto& s = plan->model.target.settings) c.settings = SettingsFlags(*s);
    const Overhead& o = plan->overhead;
    c.step_s = o.step_s;
    c.base_step_s = o.base_step_s;
    c.recompute_s = o.recompute_s;
    c.quantize_s = o.quantize_s;
    c.exposed_transfer_s = o.exposed_transfer_s;
    c.comm_s = o.comm_s;
    c.dp_exposed_s = o.dp_exposed_s;
    c.verdict = fits ? Verdict::kFits : Verdict::kDoesNotFit;
    if (!fits) {
      c.detail = "a rank's plan leaves less than the headroom of " + FormatBytes(plan->headroom) +
                 " under the budget (annotations pin its tensors, placement fragments, or no setting fits)";
    }
  } catch (const ErrorException& e) {
    c.verdict = Verdict::kError;
    c.detail = e.error().message;
  }
  return false;
}

Candidate EvaluateLayout(const Model& base, const Layout& layout, int64_t budget) {
  Candidate c = PrepareLayout(base, layout, budget);
  if (c.verdict == Verdict::kPending) PlanLayout(base, budget, &c);
  return c;
}

namespace {

// Candidates that passed the static check, by (bound, key): the order in
// which the step bound is applied.
std::vector<size_t> BoundOrder(const std::vector<Candidate>& cs, const std::vector<size_t>& among) {
  std::vector<size_t> order;
  std::vector<std::string> keys(cs.size());
  for (size_t i : among) {
    if (cs[i].base_bound_s > 0) {
      order.push_back(i);
      keys[i] = cs[i].layout.Key();
    }
  }
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    if (cs[a].base_bound_s != cs[b].base_bound_s) return cs[a].base_bound_s < cs[b].base_bound_s;
    return keys[a] < keys[b];
  });
  return order;
}

// The top-th smallest step among `steps`, or infinity when fewer.
double KthStep(std::vector<double> steps, int top) {
  if (top < 1 || steps.size() < static_cast<size_t>(top)) return std::numeric_limits<double>::infinity();
  std::nth_element(steps.begin(), steps.begin() + (top - 1), steps.end());
  return steps[static_cast<size_t>(top - 1)];
}

void MarkStepBound(Candidate* c, double kth) {
  const Layout l = c->layout;
  const double bound = c->base_bound_s;
  const int64_t st = c->max_static;
  *c = Candidate{};
  c->layout = l;
  c->base_bound_s = bound;
  c->max_static = st;
  c->verdict = Verdict::kStepBound;
  c->detail = "its base step " + FormatFixed(bound * 1e3, 1) + " ms exceeds the top layouts' steps (up to " +
              FormatFixed(kth * 1e3, 1) + " ms): not planned";
}


}  // namespace

std::vector<Candidate> SearchShare(const Model& base, const SearchOptions& options, const std::vector<Layout>& layouts,
                                   const std::vector<size_t>& share,
                                   const std::function<void(size_t, size_t, size_t)>& progress) {
  const int64_t budget = SearchBudget(base, options);
  std::vector<Candidate> cs(share.size());
  std::atomic<size_t> done{0}, fit{0};
  ParallelFor(share.size(), [&](size_t k) {
    cs[k] = PrepareLayout(base, layouts[share[k]], budget);
    if (cs[k].verdict != Verdict::kPending) {
      const size_t n = ++done;
      if (progress) progress(n, share.size(), fit.load());
    }
  });
  std::vector<size_t> all(share.size());
  std::iota(all.begin(), all.end(), size_t{0});
  const std::vector<size_t> order = BoundOrder(cs, all);
  std::mutex mutex;
  std::vector<char> finished(order.size(), 0), deferred(order.size(), 0);
  // Two passes: layouts whose offloads pass the host's memory need rounds of
  // re-planning (FitHost), so they wait for the second pass, when the top
  // steps the first found can cut those rounds short.
  // The K-th best step among the layouts finished so far (any of them):
  // never below the whole search's.
  auto kth_now = [&] {
    std::vector<double> steps;
    std::lock_guard<std::mutex> lock(mutex);
    for (size_t q = 0; q < order.size(); ++q) {
      const Candidate& e = cs[order[q]];
      if (finished[q] && e.verdict == Verdict::kFits) steps.push_back(e.step_s);
    }
    return KthStep(std::move(steps), options.top);
  };
  auto plan_at = [&](size_t pos, bool second) {
    Candidate& c = cs[order[pos]];
    if (!options.exhaustive) {
      const double kth = kth_now();
      if (c.base_bound_s > kth) {
        std::lock_guard<std::mutex> lock(mutex);
        MarkStepBound(&c, kth);
        finished[pos] = 1;
      }
    }
    if (c.verdict == Verdict::kPending) {
      Candidate planned = c;
      // Placement is most of a plan: a layout whose solved step already
      // exceeds the top layouts' (those finished before it in bound order)
      // is not placed.
      std::function<bool(double)> place_if = [&](double step_s) { return step_s <= kth_now(); };
      // --exhaustive plans every layout as `memplan plan` would: the reference.
      const bool later = PlanLayout(base, budget, &planned, options.exhaustive ? nullptr : place_if,
                                    !options.exhaustive && !second);
      std::lock_guard<std::mutex> lock(mutex);
      if (later) {
        deferred[pos] = 1;
        return;
      }
      c = std::move(planned);
      finished[pos] = 1;
    }
    if (c.verdict == Verdict::kFits) ++fit;
    const size_t n = ++done;
    if (progress) progress(n, share.size(), fit.load());
  };
  ParallelFor(order.size(), [&](size_t pos) { plan_at(pos, false); });
  std::vector<size_t> again;
  for (size_t pos = 0; pos < order.size(); ++pos) {
    if (deferred[pos]) again.push_back(pos);
  }
  ParallelFor(again.size(), [&](size_t k) { plan_at(again[k], true); });
  return cs;
}

Expected<bool> ApplyStepBound(std::vector<Candidate>* candidates, int top) {
  std::vector<Candidate>& cs = *candidates;
  // The K-th best step of the whole search. Every layout of the true top K
  // was planned by every share (its bounds are below its step, and a
  // share's K-th best is never below the whole search's), so this is the
  // same whichever shares planned what.
  std::vector<double> steps;
  for (const Candidate& c : cs) {
    if (c.verdict == Verdict::kFits) steps.push_back(c.step_s);
  }
  const double kth = KthStep(std::move(steps), top);
  std::vector<size_t> all(cs.size());
  std::iota(all.begin(), all.end(), size_t{0});
  for (size_t i : BoundOrder(cs, all)) {
    if (cs[i].base_bound_s > kth) {
      MarkStepBound(&cs[i], kth);  // again: a share's message names its own bound
      continue;
    }
    // A layout that fits within the K-th best step is among the top K: its
    // own earlier rounds (under a framework target, settings that were
    // dropped later) may have solved slower than it ends, and must not
    // demote it (DeepSeek-V3 on 2,048 H800 lost its only fitting layout so).
    if (cs[i].verdict == Verdict::kFits && cs[i].step_s <= kth) continue;
    // Solved, not placed: canonical whichever share planned it. A share
    // stops at the first round whose solved step exceeds the K-th best step
    // it knew of, never below this one: the first round past this bound is
    // among the rounds it recorded.
    if (auto past = std::find_if(cs[i].solved_steps.begin(), cs[i].solved_steps.end(),
                                 [&](double s) { return s > kth; });
        past != cs[i].solved_steps.end()) {
      cs[i].solved_steps.erase(past + 1, cs[i].solved_steps.end());
      cs[i].solved_step_s = *past;
      MarkNotPlaced(&cs[i]);
      continue;
    }
    if (cs[i].verdict == Verdict::kStepBound || cs[i].verdict == Verdict::kPending) {
      return Error{ErrorCode::kRuntime, "internal error: search: " + cs[i].layout.Key() +
                                            " was not planned, though the step bound keeps it"};
    }
  }
  return true;
}

Json CandidateToJson(const Candidate& c) {
  const Layout& l = c.layout;
  Json j{{"layout",
          {{"tp", l.tp},
           {"pp", l.pp},
           {"vp", l.vp},
           {"cp", l.cp},
           {"ep", l.ep},
           {"dp", l.dp},
           {"micro_batch", l.micro_batch},
           {"microbatches", l.microbatches},
           {"zero", l.zero},
           {"sp", l.sp},
           {"pipeline_zero2", l.pipeline_zero2},
           {"grad_offload", l.grad_offload_host ? "host" : "none"},
           {"lighter_ends", l.lighter_ends}}},
         {"key", l.Key()},
         {"verdict", VerdictName(c.verdict)}};
  if (!c.reason.empty()) j["reason"] = c.reason;
  if (!c.detail.empty()) j["detail"] = c.detail;
  if (c.max_static > 0) j["max_static"] = c.max_static;
  if (c.base_bound_s > 0) j["base_bound_s"] = c.base_bound_s;
  if (c.solved_step_s > 0) j["solved_step_s"] = c.solved_step_s;
  if (!c.solved_steps.empty()) j["solved_steps"] = c.solved_steps;
  if (c.verdict == Verdict::kFits || c.verdict == Verdict::kDoesNotFit) {
    j["max_peak"] = c.max_peak;
    j["min_margin"] = c.min_margin;
    if (!c.settings.empty()) j["settings"] = c.settings;
    j["max_any_plan_lower_bound"] = c.max_any_plan;
    j["step_s"] = c.step_s;
    j["base_step_s"] = c.base_step_s;
    j["recompute_s"] = c.recompute_s;
    j["quantize_s"] = c.quantize_s;
    j["exposed_transfer_s"] = c.exposed_transfer_s;
    j["comm_s"] = c.comm_s;
    j["dp_exposed_s"] = c.dp_exposed_s;
  }
  return j;
}

Expected<Candidate> CandidateFromJson(const Json& j) {
  try {
    Candidate c;
    const Json& l = j.at("layout");
    c.layout.tp = l.at("tp").get<int64_t>();
    c.layout.pp = l.at("pp").get<int64_t>();
    c.layout.vp = l.at("vp").get<int64_t>();
    c.layout.cp = l.at("cp").get<int64_t>();
    c.layout.ep = l.at("ep").get<int64_t>();
    c.layout.dp = l.at("dp").get<int64_t>();
    c.layout.micro_batch = l.at("micro_batch").get<int64_t>();
    c.layout.microbatches = l.at("microbatches").get<int64_t>();
    c.layout.zero = l.at("zero").get<int>();
    c.layout.sp = l.at("sp").get<bool>();
    c.layout.pipeline_zero2 = l.at("pipeline_zero2").get<bool>();
    c.layout.grad_offload_host = l.at("grad_offload").get<std::string>() == "host";
    c.layout.lighter_ends = l.at("lighter_ends").get<int64_t>();
    const std::string v = j.at("verdict").get<std::string>();
    bool known = false;
    for (Verdict k : {Verdict::kFits, Verdict::kInvalid, Verdict::kStaticOverBudget, Verdict::kAnyPlanOverBudget,
                      Verdict::kDoesNotFit, Verdict::kStepBound, Verdict::kError}) {
      if (VerdictName(k) == v) c.verdict = k, known = true;
    }
    if (!known) return Error{ErrorCode::kBadInput, "candidate: unknown verdict \"" + v + "\""};
    c.reason = j.value("reason", "");
    c.detail = j.value("detail", "");
    c.max_static = j.value("max_static", int64_t{0});
    c.base_bound_s = j.value("base_bound_s", 0.0);
    c.solved_step_s = j.value("solved_step_s", 0.0);
    c.solved_steps = j.value("solved_steps", std::vector<double>{});
    c.max_peak = j.value("max_peak", int64_t{0});
    c.min_margin = j.value("min_margin", int64_t{0});
    c.settings = j.value("settings", "");
    c.max_any_plan = j.value("max_any_plan_lower_bound", int64_t{0});
    c.step_s = j.value("step_s", 0.0);
    c.base_step_s = j.value("base_step_s", 0.0);
    c.recompute_s = j.value("recompute_s", 0.0);
    c.quantize_s = j.value("quantize_s", 0.0);
    c.exposed_transfer_s = j.value("exposed_transfer_s", 0.0);
    c.comm_s = j.value("comm_s", 0.0);
    c.dp_exposed_s = j.value("dp_exposed_s", 0.0);
    return c;
  } catch (const std::exception& e) {
    return Error{ErrorCode::kBadInput, std::string("candidate: ") + e.what()};
  }
}

}  // namespace memplan::planner
