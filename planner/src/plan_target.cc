// Planning for a target whose storage is set by module-level settings
// (Megatron-LM's recompute and offload flags; target.h): the settings are
// chosen over what the framework can say, each candidate planned whole
// (docs/targets.md, "Choosing the settings").
#include <algorithm>
#include <limits>
#include <map>
#include <optional>
#include <set>

#include "memplan/common/parallel.h"
#include "memplan/common/units.h"
#include "memplan/planner/framework.h"
#include "memplan/planner/layout.h"
#include "memplan/planner/megatron_args.h"
#include "memplan/planner/target.h"
#include "plan_internal.h"

namespace memplan::planner {
namespace {

// Candidates planned per round of the module-by-module choice.
constexpr size_t kPlannedPerRound = 4;

bool Has(const std::vector<std::string>& v, std::string_view x) { return std::find(v.begin(), v.end(), x) != v.end(); }

// How far the plan is from fitting with its headroom: the largest
// (headroom - margin) over the ranks; <= 0 fits. A rank whose host side
// does not fit counts as short by its host excess.
int64_t Deficit(const Plan& p) {
  int64_t worst = std::numeric_limits<int64_t>::min();
  for (const auto& r : p.ranks) {
    worst = std::max(worst, p.headroom - r.margin);
    if (r.host_peak > p.model.hardware.host_memory) worst = std::max(worst, r.host_peak - p.model.hardware.host_memory);
  }
  return worst;
}

// The modules' tensor suffixes the model has (a module naming none changes
// nothing and is not tried).
std::set<std::string> Suffixes(const Plan& p) {
  std::set<std::string> out;
  for (const auto& t : p.tensors) {
    if (t.name.rfind("layer", 0) != 0) continue;
    const size_t dot = t.name.find('.');
    if (dot != std::string::npos) out.insert(t.name.substr(dot + 1));
  }
  return out;
}

bool Applies(const FrameworkModule& m, const std::set<std::string>& suffixes) {
  for (auto t : m.tensors) {
    if (suffixes.count(std::string(t))) return true;
  }
  return false;
}

void InTableOrder(const std::vector<FrameworkModule>& table, std::vector<std::string>& v) {
  std::vector<std::string> out;
  for (const auto& m : table) {
    if (Has(v, m.name)) out.emplace_back(m.name);
  }
  v = std::move(out);
}

}  // namespace

Plan PlanFrameworkSettings(const Model& input, const PlanOptions& options) {
  std::vector<std::pair<FrameworkSettings, int64_t>> tried;
  auto progress = [&](const char* phase, const Plan& best) {
    if (!options.on_progress) return;
    const int64_t d = Deficit(best);
    options.on_progress(std::string(TargetName(input.target.kind)) + " settings: " + phase + ", " +
                        std::to_string(tried.size() + 1) + " planned; best " +
                        SettingsFlags(best.model.target.settings.value_or(FrameworkSettings{})) +
                        (d <= 0 ? " (fits)" : " (" + FormatBytes(d) + " short on its fullest rank)"));
  };
  auto plan_with = [&](const FrameworkSettings& s) {
    Model m = input;
    m.target.settings = s;
    auto policies = SettingsPolicies(m, s);
    if (!policies) throw ErrorException(policies.error());
    m.policies = *policies;
    Plan p = BuildPlanOrThrow(m, options);
    // The plan's model is the input with these settings fixed: planning it
    // again gives this plan (the annotations are the settings').
    Model shown = input;
    shown.target.settings = s;
    shown.budget = p.model.budget;
    shown.budget_given = p.model.budget_given;
    shown.headroom = p.model.headroom;
    shown.headroom_given = p.model.headroom_given;
    p.model = std::move(shown);
    p.digest = ModelDigest(p.model);
    return p;
  };
  // --storage: recompute settings need recompute, offload modules host offload.
  auto allowed = [&](const FrameworkSettings& s) {
    return (input.storage.recompute || s.granularity.empty()) && (input.storage.offload_host || s.offload_modules.empty());
  };
  if (input.target.settings) {
    if (!allowed(*input.target.settings)) {
      ThrowError(ErrorCode::kBadInput, "/target/settings: " + SettingsFlags(*input.target.settings) +
                                           " uses a storage kind --storage leaves out (storage: " +
                                           StorageKindsText(input.storage) + ")");
    }
    return plan_with(*input.target.settings);
  }

  auto valid = [&](const FrameworkSettings& s) {
    return allowed(s) && !ValidateMegatronArgs(MegatronArgsOf(input, s)).has_value();
  };
  FrameworkSettings current;
  Plan best = plan_with(current);
  const std::set<std::string> suffixes = Suffixes(best);
  // Where even every module recomputed or offloaded does not fit, only
  // full recompute can: no module-by-module rounds.
  bool selective_can_fit = Deficit(best) <= 0;
  std::optional<Plan> maximal;
  FrameworkSettings maximal_settings;
  if (!selective_can_fit) {
    FrameworkSettings most;
    if (input.storage.recompute) {  // --storage: offload modules alone otherwise
      most.granularity = "selective";
      for (const auto& mod : MegatronRecomputeModules()) {
        if (Applies(mod, suffixes)) most.recompute_modules.emplace_back(mod.name);
      }
    }
    for (const auto& mod : MegatronOffloadModules()) {
      if (!Applies(mod, suffixes)) continue;
      FrameworkSettings s = most;
      s.offload_modules.emplace_back(mod.name);
      if (valid(s)) most = std::move(s);
    }
    if (!valid(most)) most.offload_modules.clear();
    if (valid(most)) {
      Plan q = plan_with(most);
      tried.emplace_back(most, -Deficit(q));
      selective_can_fit = Deficit(q) <= 0;
      if (selective_can_fit) {
        maximal = std::move(q), maximal_settings = std::move(most);
      } else if (!input.storage.recompute && Deficit(q) < Deficit(best)) {
        best = std::move(q);  // without recompute, the closest there is (below)
      }
    }
  }
  // Selective recompute and fine-grained offload, one module at a time:
  // the candidate that fits and is fastest, else the one that brings the
  // furthest rank closest to fitting (then the faster; docs/targets.md).
  for (int round = 0; round < 24 && selective_can_fit && Deficit(best) > 0; ++round) {
    std::vector<FrameworkSettings> candidates;
    for (const auto& mod : MegatronRecomputeModules()) {
      if (Has(current.recompute_modules, mod.name) || !Applies(mod, suffixes)) continue;
      FrameworkSettings s = current;
      s.granularity = "selective";
      s.recompute_modules.emplace_back(mod.name);
      InTableOrder(MegatronRecomputeModules(), s.recompute_modules);
      if (valid(s)) candidates.push_back(std::move(s));
    }
    for (const auto& mod : MegatronOffloadModules()) {
      if (Has(current.offload_modules, mod.name) || !Applies(mod, suffixes)) continue;
      FrameworkSettings s = current;
      s.offload_modules.emplace_back(mod.name);
      InTableOrder(MegatronOffloadModules(), s.offload_modules);
      // attn_proj offloads only beside core_attn (transformer_config.py).
      if (mod.name == "attn_proj" && !Has(s.offload_modules, "core_attn")) continue;
      if (valid(s)) candidates.push_back(std::move(s));
    }
    // Only the few candidates that drop the most kept bytes on the rank
    // furthest from fitting are planned (a whole plan each).
    {
      int64_t worst_rank = 0, worst = std::numeric_limits<int64_t>::min();
      for (const auto& r : best.ranks) {
        if (best.headroom - r.margin > worst) worst = best.headroom - r.margin, worst_rank = r.pp_rank;
      }
      std::map<std::string, int64_t> kept;  // suffix -> kept bytes per microbatch on that rank
      for (const auto& t : best.tensors) {
        if (t.pp_rank != worst_rank || t.effective != std::vector<Policy>{Policy::kKeep}) continue;
        const size_t dot = t.name.find('.');
        if (dot != std::string::npos) kept[t.name.substr(dot + 1)] += t.bytes;
      }
      auto freed = [&](const FrameworkSettings& s) {
        int64_t bytes = 0;
        std::set<std::string> seen;
        for (const auto& [table, names] : {std::pair{&MegatronRecomputeModules(), &s.recompute_modules},
                                           std::pair{&MegatronOffloadModules(), &s.offload_modules}}) {
          for (const auto& mod : *table) {
            if (!Has(*names, mod.name)) continue;
            for (auto t : mod.tensors) {
              if (seen.insert(std::string(t)).second) {
                auto it = kept.find(std::string(t));
                if (it != kept.end()) bytes += it->second;
              }
            }
          }
        }
        return bytes;
      };
      std::stable_sort(candidates.begin(), candidates.end(),
                       [&](const FrameworkSettings& a, const FrameworkSettings& b) { return freed(a) > freed(b); });
      const int64_t before = freed(current);
      std::erase_if(candidates, [&](const FrameworkSettings& s) { return freed(s) <= before; });
      if (candidates.size() > kPlannedPerRound) candidates.resize(kPlannedPerRound);
    }
    std::optional<Plan> pick;
    FrameworkSettings pick_settings;
    const int64_t base_deficit = Deficit(best);
    // The round's candidates planned side by side (each plan then runs on
    // one thread: common/parallel.h), compared in their order.
    std::vector<std::optional<Plan>> planned(candidates.size());
    ParallelFor(candidates.size(), [&](size_t i) { planned[i] = plan_with(candidates[i]); });
    for (size_t i = 0; i < candidates.size(); ++i) {
      const FrameworkSettings& s = candidates[i];
      Plan q = std::move(*planned[i]);
      tried.emplace_back(s, -Deficit(q));
      auto better = [&](const Plan& a, const Plan& b) {
        const bool fa = Deficit(a) <= 0, fb = Deficit(b) <= 0;
        if (fa != fb) return fa;
        if (fa || Deficit(a) == Deficit(b)) return a.overhead.step_s < b.overhead.step_s;
        return Deficit(a) < Deficit(b);
      };
      if (!pick || better(q, *pick)) {
        pick = std::move(q);
        pick_settings = s;
      }
    }
    if (!pick || Deficit(*pick) >= base_deficit) break;
    best = std::move(*pick);
    current = std::move(pick_settings);
    progress("adding modules", best);
  }
  if (Deficit(best) > 0 && maximal) {
    // The rounds stalled, but every module together fits: start there.
    best = std::move(*maximal);
    current = std::move(maximal_settings);
  }
  // Then drop what the fit does not need: each module's removal planned
  // side by side, the fastest that still fits kept, while one helps.
  for (int round = 0; round < 8 && Deficit(best) <= 0 && !current.empty(); ++round) {
    std::vector<FrameworkSettings> fewer;
    for (size_t i = 0; i < current.recompute_modules.size(); ++i) {
      FrameworkSettings s = current;
      s.recompute_modules.erase(s.recompute_modules.begin() + static_cast<std::ptrdiff_t>(i));
      if (s.recompute_modules.empty()) s.granularity.clear();
      if (valid(s)) fewer.push_back(std::move(s));
    }
    for (size_t i = 0; i < current.offload_modules.size(); ++i) {
      FrameworkSettings s = current;
      s.offload_modules.erase(s.offload_modules.begin() + static_cast<std::ptrdiff_t>(i));
      if (valid(s)) fewer.push_back(std::move(s));
    }
    std::vector<std::optional<Plan>> planned(fewer.size());
    ParallelFor(fewer.size(), [&](size_t i) { planned[i] = plan_with(fewer[i]); });
    std::optional<size_t> pick;
    for (size_t i = 0; i < fewer.size(); ++i) {
      tried.emplace_back(fewer[i], -Deficit(*planned[i]));
      if (Deficit(*planned[i]) > 0 || planned[i]->overhead.step_s > best.overhead.step_s) continue;
      if (!pick || planned[i]->overhead.step_s < planned[*pick]->overhead.step_s) pick = i;
    }
    if (!pick) break;
    best = std::move(*planned[*pick]);
    current = std::move(fewer[*pick]);
    progress("dropping what the fit does not need", best);
  }
  if (Deficit(best) > 0 && !input.storage.recompute) {
    best.warnings.push_back("no Megatron offload settings fit the budget with its headroom of " +
                            FormatBytes(best.headroom) + ", and --storage leaves out recompute; the plan shows the "
                            "settings that come closest");
  } else if (Deficit(best) > 0) {
    // Full recompute, method block: the fewest checkpointed layers per
    // chunk that fit (memory falls as layers are added: bisection).
    const PipelineLayout layout = MakePipelineLayout(input);
    int64_t most = 1;
    for (const auto& rank : layout.chunks) {
      for (const auto& chunk : rank) most = std::max<int64_t>(most, static_cast<int64_t>(chunk.size()));
    }
    auto full = [&](int64_t k) {
      FrameworkSettings s;
      s.granularity = "full";
      s.method = "block";
      s.num_layers = k;
      return s;
    };
    Plan all = plan_with(full(most));
    tried.emplace_back(full(most), -Deficit(all));
    if (Deficit(all) > 0) {
      if (Deficit(all) < Deficit(best)) best = std::move(all);
      best.warnings.push_back("no Megatron recompute or offload settings fit the budget with its headroom of " +
                              FormatBytes(best.headroom) + "; the plan shows the settings that come closest");
    } else {
      Plan fit = std::move(all);
      int64_t lo = 1, hi = most - 1;
      while (lo <= hi) {
        const int64_t k = (lo + hi) / 2;
        Plan q = plan_with(full(k));
        tried.emplace_back(full(k), -Deficit(q));
        if (Deficit(q) <= 0) {
          fit = std::move(q);
          hi = k - 1;
        } else {
          lo = k + 1;
        }
      }
      best = std::move(fit);
    }
    progress("full recompute", best);
  }
  best.settings_tried = std::move(tried);
  return best;
}

}  // namespace memplan::planner
