// The training frameworks' storage settings and what they mean in memplan's
// terms (docs/export.md): Megatron-LM's selective recompute modules and
// fine-grained offload modules, TorchTitan's activation checkpointing.
//
// `memplan export` maps a plan's per-tensor decisions onto these coarser
// settings; `memplan import megatron` reads them back as policy
// annotations. Both go through MegatronPolicies, so an exported argument
// list imports to exactly the model the export re-planned.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "memplan/common/status.h"
#include "memplan/planner/model.h"
#include "memplan/planner/plan.h"

namespace memplan::planner {

// A framework module and the memplan tensors it stores, by suffix after
// "layer<i>." (templates' names, docs/templates.md).
struct FrameworkModule {
  std::string_view name;
  std::vector<std::string_view> tensors;
};

// `--recompute-modules` (with `--recompute-granularity selective`): the
// tensors a recomputed module no longer saves. `mla` selects
// mla_up_proj's (MLA models only).
const std::vector<FrameworkModule>& MegatronRecomputeModules();
// `--offload-modules` (with `--fine-grained-activation-offloading`): the
// tensors the module saves for backward ("offloads its input").
const std::vector<FrameworkModule>& MegatronOffloadModules();

// Policy annotations under which memplan stores tensors as those settings
// do: the modules' tensors recomputed (recompute wins over offload) or
// offloaded to host and, with `keep_rest`, every other tensor kept (what
// Megatron does; without it memplan decides the rest). Unknown names are a
// kBadInput error naming `where` and the name.
Expected<std::vector<PolicyAnnotation>> MegatronPolicies(bool mla, const std::vector<std::string>& recompute,
                                                         const std::vector<std::string>& offload, bool keep_rest,
                                                         const std::string& where);

// What an export chose and what it could not say.
struct ExportedSettings {
  std::string framework;                // "megatron" | "torchtitan"
  std::string text;                     // the argument list, or the TOML sections
  std::vector<std::string> recompute;   // modules (Megatron) or the TorchTitan mode
  std::vector<std::string> offload;     // modules (Megatron)
  // Modules added to the majority's choice until the settings fit, in the
  // order added ("recompute moe_act", "offload expert_fc1").
  std::vector<std::string> added;
  std::vector<std::string> not_expressed;  // one line each: what the settings cannot say
  Model coarse;                         // the plan's model under exactly these settings
  Plan coarse_plan;                     // its plan (BuildPlan(coarse))
};

// From a plan: a module's tensors are recomputed (offloaded) in the export
// when the plan recomputes (offloads) at least half of their bytes; where
// that does not fit, Megatron's modules are added greedily (re-planning each
// candidate) until it fits or none helps.
// `progress` gets a line per round of choosing Megatron's settings.
Expected<ExportedSettings> ExportMegatron(const Plan& plan,
                                          const std::function<void(const std::string&)>& progress = nullptr);
Expected<ExportedSettings> ExportTorchtitan(const Plan& plan);

}  // namespace memplan::planner
