// `memplan search`: ranking, the Pareto front, SEARCH.json and the table
// (search.h).
#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>

#include "memplan/common/table.h"
#include "memplan/common/units.h"
#include "memplan/planner/search.h"
#include "memplan/planner/accounting.h"
#include "memplan/planner/templates.h"
#include "memplan/planner/plan.h"
#include "memplan/planner/target.h"

namespace memplan::planner {
namespace {

OrderedJson SpaceJson(const SearchSpace& s) {
  OrderedJson j = OrderedJson::object();
  auto put = [&](const char* key, const std::vector<int64_t>& v) {
    if (!v.empty()) j[key] = v;
  };
  put("tp", s.tp);
  put("pp", s.pp);
  put("vp", s.vp);
  put("cp", s.cp);
  put("ep", s.ep);
  put("dp", s.dp);
  put("micro_batch", s.micro_batch);
  put("zero", s.zero);
  put("sp", s.sp);
  put("pipeline_zero2", s.pipeline_zero2);
  put("grad_offload", s.grad_offload);
  put("lighter_ends", s.lighter_ends);
  if (s.sp_follows_tp) j["sp_follows_tp"] = true;
  return j;
}

std::string Ms(double s) { return FormatFixed(s * 1e3, 1); }

std::string RejectionKey(const Candidate& c) {
  std::string key(VerdictName(c.verdict));
  if (c.verdict == Verdict::kInvalid) key += " " + c.reason;
  return key;
}

// What a person reads for a rejection key.
std::string RejectionText(const std::string& key) {
  if (key.rfind("invalid megatron ", 0) == 0) return "Megatron refuses " + key.substr(17);
  if (key.rfind("invalid ", 0) == 0) return "the model file refuses " + key.substr(8);
  if (key == "static_over_budget") return "static memory alone over the budget";
  if (key == "any_plan_over_budget") return "any-plan lower bound over the budget";
  if (key == "does_not_fit") return "planned, does not fit";
  if (key == "step_bound") return "base step above the top layouts' steps: not planned";
  return "planner error";
}

std::string LayoutCells(const Layout& l) {
  return std::to_string(l.micro_batch) + "x" + std::to_string(l.microbatches);
}

}  // namespace

Expected<SearchResult> SummarizeSearch(const Model& base, const SearchOptions& options,
                                       std::vector<Candidate> candidates) {
  if (!options.exhaustive) {
    if (auto ok = ApplyStepBound(&candidates, options.top); !ok) return ok.error();
  }
  SearchResult r;
  r.model = base.name;
  r.target = base.target.kind;
  r.headroom = base.headroom_given ? base.headroom : GetTarget(base.target.kind).DefaultHeadroom(base);
  r.digest = ModelDigest(base);
  if (auto layers = ExpandModel(base)) {
    const Throughput t = ModelledThroughput(base, CountParameters(base, *layers), 0);
    r.flops_per_token = t.flops_per_token;
    r.step_source = t.source;
  }
  r.bf16_flops = base.hardware.bf16_flops;
  r.seq_len = base.train.seq_len;
  r.gpus = options.gpus;
  r.budget = SearchBudget(base, options);
  r.global_batch = SearchGlobalBatch(base, options);
  r.space = SearchSpaceDefaults(base, options);
  r.top = options.top;
  r.exhaustive = options.exhaustive;
  r.candidates = std::move(candidates);
  const auto& cs = r.candidates;
  for (size_t i = 0; i < cs.size(); ++i) {
    if (cs[i].verdict == Verdict::kFits) {
      r.ranked.push_back(i);
      continue;
    }
    auto& entry = r.rejected[RejectionKey(cs[i])];
    if (entry.first++ == 0) entry.second = cs[i].detail;
  }
  auto faster = [&](size_t a, size_t b) {
    if (cs[a].step_s != cs[b].step_s) return cs[a].step_s < cs[b].step_s;
    return cs[a].layout.Key() < cs[b].layout.Key();
  };
  std::sort(r.ranked.begin(), r.ranked.end(), faster);
  // Pareto front: by peak ascending (then faster first); keep each layout
  // strictly faster than every one with a smaller or equal peak.
  std::vector<size_t> by_peak = r.ranked;
  std::stable_sort(by_peak.begin(), by_peak.end(), [&](size_t a, size_t b) { return cs[a].max_peak < cs[b].max_peak; });
  double best = std::numeric_limits<double>::infinity();
  for (size_t i : by_peak) {
    if (cs[i].step_s < best) {
      r.pareto.push_back(i);
      best = cs[i].step_s;
    }
  }
  return r;
}

std::string WhyBestBeatsNext(const SearchResult& r) {
  if (r.ranked.size() < 2) return r.ranked.empty() ? "" : "#1 is the only layout that fits";
  const Candidate& a = r.candidates[r.ranked[0]];
  const Candidate& b = r.candidates[r.ranked[1]];
  struct Term {
    const char* name;
    double delta;
  };
  // The step is the base step (compute, bubbles, communication) plus the
  // critical rank's added time; the terms that differ most come first.
  const double compute_a = a.base_step_s - a.comm_s - a.dp_exposed_s;
  const double compute_b = b.base_step_s - b.comm_s - b.dp_exposed_s;
  std::vector<Term> terms{{"compute and bubbles", compute_b - compute_a},
                          {"TP/CP/EP communication", b.comm_s - a.comm_s},
                          {"exposed DP reduction", b.dp_exposed_s - a.dp_exposed_s},
                          {"recompute", b.recompute_s - a.recompute_s},
                          {"fp8", b.quantize_s - a.quantize_s},
                          {"exposed transfers", b.exposed_transfer_s - a.exposed_transfer_s}};
  std::stable_sort(terms.begin(), terms.end(),
                   [](const Term& x, const Term& y) { return std::abs(x.delta) > std::abs(y.delta); });
  std::string out = "#1 is " + Ms(b.step_s - a.step_s) + " ms faster than #2";
  // What differs between the two layouts.
  const std::string ka = a.layout.Key(), kb = b.layout.Key();
  std::string differs;
  {
    std::vector<std::string> fa, fb;
    std::string w;
    std::stringstream sa(ka), sb(kb);
    while (sa >> w) fa.push_back(w);
    while (sb >> w) fb.push_back(w);
    for (size_t i = 0; i < fa.size() && i < fb.size(); ++i) {
      if (fa[i] != fb[i]) differs += (differs.empty() ? "" : ", ") + fa[i] + " vs " + fb[i].substr(fb[i].find('=') + 1);
    }
  }
  if (!differs.empty()) out += " (" + differs + ")";
  out += ":";
  int shown = 0;
  for (const Term& t : terms) {
    if (shown == 3 || std::abs(t.delta) < 5e-5) break;
    out += std::string(shown ? "," : "") + " " + t.name + " " + (t.delta > 0 ? "-" : "+") + Ms(std::abs(t.delta)) +
           " ms";
    ++shown;
  }
  if (shown == 0) out += " the same terms within 0.05 ms; the key breaks the tie";
  return out;
}

OrderedJson SearchToJson(const SearchResult& r) {
  OrderedJson j;
  j["schema"] = kSearchSchema;
  j["model"] = r.model;
  j["digest"] = r.digest;
  j["gpus"] = r.gpus;
  j["budget"] = r.budget;
  j["global_batch"] = r.global_batch;
  j["top"] = r.top;
  j["exhaustive"] = r.exhaustive;
  j["space"] = SpaceJson(r.space);
  int64_t planned = 0;
  for (const auto& c : r.candidates) planned += c.verdict == Verdict::kFits || c.verdict == Verdict::kDoesNotFit;
  j["counts"] = {{"layouts", r.candidates.size()}, {"planned", planned}, {"fit", r.ranked.size()}};
  OrderedJson ranked = OrderedJson::array();
  for (size_t i : r.ranked) ranked.push_back(i);
  j["ranked"] = std::move(ranked);
  OrderedJson pareto = OrderedJson::array();
  for (size_t i : r.pareto) pareto.push_back(i);
  j["pareto"] = std::move(pareto);
  if (!r.ranked.empty()) {
    j["best"] = r.ranked.front();
    j["why"] = WhyBestBeatsNext(r);
  }
  OrderedJson rejected = OrderedJson::array();
  for (const auto& [key, entry] : r.rejected) {
    rejected.push_back({{"reason", key}, {"count", entry.first}, {"example", entry.second}});
  }
  j["rejected"] = std::move(rejected);
  OrderedJson layouts = OrderedJson::array();
  for (const auto& c : r.candidates) layouts.push_back(OrderedJson::parse(CandidateToJson(c).dump()));
  j["layouts"] = std::move(layouts);
  return j;
}

std::string DefaultSpaceNote(const Model& base, const SearchOptions& o) {
  const SearchSpace given = o.space;
  const SearchSpace s = SearchSpaceDefaults(base, o);
  auto list = [](const std::vector<int64_t>& v) {
    std::string text;
    for (int64_t x : v) text += (text.empty() ? "" : ",") + std::to_string(x);
    return text;
  };
  std::string tried, left;
  auto key = [&](const char* name, const std::vector<int64_t>& mine, const std::vector<int64_t>& values,
                 const std::string& out) {
    if (!mine.empty()) return;
    tried += (tried.empty() ? "" : " ") + std::string(name) + "=" + list(values);
    if (!out.empty()) left += (left.empty() ? "" : "; ") + out;
  };
  key("tp", given.tp, s.tp, "");
  if (given.sp.empty()) tried += std::string(tried.empty() ? "" : " ") + "sp=follows-tp";
  key("pp", given.pp, s.pp, "");
  key("vp", given.vp, s.vp, s.vp.back() < 4 ? "vp > " + std::to_string(s.vp.back()) : "");
  key("cp", given.cp, s.cp, s.cp.back() < 2 ? "context parallelism (cp=2,4,...)" : "");
  key("ep", given.ep, s.ep, "");
  key("micro_batch", given.micro_batch, s.micro_batch, "micro-batches > " + std::to_string(s.micro_batch.back()));
  key("zero", given.zero, s.zero, "other ZeRO stages (zero=0,1,2,3)");
  key("pipeline_zero2", given.pipeline_zero2, s.pipeline_zero2,
      s.pipeline_zero2.size() < 2 ? "pipeline ZeRO-2 (pipeline_zero2=0,1)" : "");
  key("grad_offload", given.grad_offload, s.grad_offload,
      s.grad_offload.size() < 2 ? "host gradient offload (grad_offload=0,1 with pipeline_zero2=1)" : "");
  key("lighter_ends", given.lighter_ends, s.lighter_ends, "ends lighter by more than one layer");
  if (tried.empty()) return "";
  std::string out = "search space (defaults): " + tried + (given.dp.empty() ? "; dp completes the grid" : "") + "\n";
  if (!left.empty()) out += "left out: " + left + " (add with --space key=v1,v2)\n";
  return out;
}

std::string RenderSearchTable(const SearchResult& r) {
  const auto& cs = r.candidates;
  int64_t planned = 0;
  for (const auto& c : cs) planned += c.verdict == Verdict::kFits || c.verdict == Verdict::kDoesNotFit;
  std::string out = "search " + r.model + " on " + std::to_string(r.gpus) + " GPUs, global batch " +
                    std::to_string(r.global_batch) + " sequences, budget " + FormatBytes(r.budget) + ": " +
                    std::to_string(cs.size()) + " layouts, " + std::to_string(planned) + " planned, " +
                    std::to_string(r.ranked.size()) + " fit\n";
  // GiB, or MiB when every planned peak is under 1 GiB (tiny models).
  int64_t largest = 0;
  for (size_t i : r.ranked) largest = std::max(largest, cs[i].max_peak);
  const bool mib = largest < (int64_t{1} << 30);
  // Under a framework target the peak is what its allocator reserves.
  const bool framework = r.target != TargetKind::kMemplan;
  const std::string peak_header = std::string(framework ? "reserved" : "peak") + (mib ? " MiB" : " GiB");
  auto peak = [&](int64_t bytes) {
    return mib ? FormatFixed(static_cast<double>(bytes) / (1 << 20), 2) : FormatGiB(bytes);
  };
  if (!r.ranked.empty()) {
    std::vector<std::string> head = {"#", "tp", "pp", "ends", "vp", "cp", "ep", "dp", "mb x n", "zero", peak_header,
                                     std::string("margin") + (mib ? " MiB" : " GiB"), "step ms", "tok/s/GPU", "MFU %",
                                     "base ms", "comm ms", "dp ms", "recompute ms", "fp8 ms", "transfers ms"};
    if (framework) head.push_back("settings");
    Table t(head);
    const size_t shown = std::min(r.ranked.size(), static_cast<size_t>(std::max(1, r.top)));
    // Tokens per second per GPU of a step (the global batch is the search's).
    auto per_gpu = [&](double step_s) {
      return step_s > 0 ? static_cast<double>(r.global_batch * r.seq_len) / step_s / static_cast<double>(r.gpus) : 0.0;
    };
    for (size_t k = 0; k < shown; ++k) {
      const Candidate& c = cs[r.ranked[k]];
      const Layout& l = c.layout;
      std::vector<std::string> row = {std::to_string(k + 1), std::to_string(l.tp) + (l.sp ? "+sp" : ""), std::to_string(l.pp),
                std::to_string(l.lighter_ends),
                std::to_string(l.vp), std::to_string(l.cp), std::to_string(l.ep), std::to_string(l.dp),
                LayoutCells(l),
                std::to_string(l.zero) + (l.pipeline_zero2 ? "+pz2" : "") + (l.grad_offload_host ? "+host" : ""),
                peak(c.max_peak), peak(c.min_margin), Ms(c.step_s), FormatFixed(per_gpu(c.step_s), 0),
                FormatFixed(100 * per_gpu(c.step_s) * r.flops_per_token / std::max(1.0, r.bf16_flops), 1),
                Ms(c.base_step_s), Ms(c.comm_s),
                Ms(c.dp_exposed_s), Ms(c.recompute_s), Ms(c.quantize_s), Ms(c.exposed_transfer_s)};
      if (framework) row.push_back(c.settings);
      t.AddRow(std::move(row));
    }
    out += "\n" + t.Render();
    out += "steps, tokens/s and MFU are modelled (6N + attention FLOPs per token; " + r.step_source +
           "'s step model, not a measurement; docs/planner.md)\n";
    out += "\n" + WhyBestBeatsNext(r) + "\n";
    out += "\nPareto front of the planned layouts (peak memory against step time; nothing both smaller and faster):\n";
    Table p({"#", "layout", peak_header, "step ms"});
    for (size_t i : r.pareto) {
      const size_t rank = static_cast<size_t>(std::find(r.ranked.begin(), r.ranked.end(), i) - r.ranked.begin()) + 1;
      p.AddRow({std::to_string(rank), cs[i].layout.Key(), peak(cs[i].max_peak), Ms(cs[i].step_s)});
    }
    out += p.Render();
  } else {
    out += "\nno layout fits the budget\n";
  }
  if (!r.rejected.empty()) {
    out += "\nrejected:\n";
    Table rej({"layouts", "reason", "example"});
    for (const auto& [key, entry] : r.rejected) {
      std::string example = entry.second;
      if (example.size() > 100) example = example.substr(0, 97) + "...";
      rej.AddRow({std::to_string(entry.first), RejectionText(key), example});
    }
    out += rej.Render();
  }
  return out;
}

}  // namespace memplan::planner
