// Targets: the runtime a plan is for (docs/targets.md).
//
// The planner's core (schedule, liveness, solver, placement, bounds) is the
// same for every target; a target says what differs between the job memplan
// executes itself and the job a user launches with a framework:
//   - which model options (memplan-only mechanisms) it has,
//   - its argument rules (what layouts it accepts, with its reasons),
//   - whether storage is decided per tensor or through the framework's
//     module-level settings (FrameworkSettings),
//   - the static buffers it holds besides weights, gradients and optimizer
//     state, and the memory outside it (CUDA context, NCCL communicators),
//   - its allocator: memplan's exact best-fit arena, or PyTorch's caching
//     allocator replayed for reserved bytes.
// `memplan` is memplan's own runtime (the default); `megatron` is
// Megatron-LM (Megatron-Core with Transformer Engine). Adding a target is
// one implementation of `Target` and one entry in GetTarget
// (docs/design.md, "Adding a target").
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "memplan/common/caching_allocator.h"
#include "memplan/common/status.h"
#include "memplan/planner/accounting.h"
#include "memplan/planner/model.h"

namespace memplan::planner {

class Target {
 public:
  virtual ~Target() = default;
  virtual TargetKind Kind() const = 0;
  std::string_view Name() const { return TargetName(Kind()); }

  // Why the target cannot run this model as it is laid out (its argument
  // rules, each citing the framework's source in docs/targets.md), or
  // nullopt. The message is the framework's reason.
  virtual std::optional<std::string> Refusal(const Model& model) const = 0;
  // True: the solver decides each saved tensor's storage (keep, recompute,
  // FP8, host or remote offload). False: storage comes from
  // FrameworkSettings, chosen over the settings the framework has.
  virtual bool PerTensorStorage() const = 0;
  // Whether memplan's own runtime mechanisms exist under this target (the
  // model options dispatch recompute and AttnRes's single copy, checkpoint
  // and cache); the MoE gradient rewrite is Megatron's math too.
  virtual bool HasRuntimeMechanisms() const = 0;
  // Whether MLA's down-projections run, and are saved, on the
  // sequence-parallel shard (Megatron) rather than on every token.
  virtual bool MlaDownProjectionsOnShard() const = 0;
  // Replaces `st`'s buffers by the ones this target holds (the framework's
  // buckets, workspaces and communication buffers) and fills the memory
  // outside it (runtime_detail: CUDA context, one NCCL communicator per
  // process group). `total` and `runtime` are recomputed.
  virtual void StaticBuffers(const Model& model, int64_t rank, StaticBreakdown* st) const = 0;
  // The allocator the framework's activations go through: nullopt for
  // memplan's best-fit arena (reserved is the placed peak), else PyTorch's
  // caching allocator with this configuration.
  virtual std::optional<CachingAllocatorConfig> Allocator(const Model& model) const = 0;
  // The headroom `plan` and `search` keep under the budget when none is
  // given (docs/targets.md says why).
  virtual int64_t DefaultHeadroom(const Model& model) const = 0;
};

const Target& GetTarget(TargetKind kind);

// `model` as planned for `kind` (plan/search/export --target): another
// target turns memplan's own mechanisms off (model options); memplan drops
// the allocator and framework settings.
void ApplyTarget(Model* model, TargetKind kind);

// The settings as Megatron's flags ("--recompute-granularity selective
// --recompute-modules core_attn ..."), or "none" when they change nothing.
std::string SettingsFlags(const FrameworkSettings& settings);

// Megatron-LM's argument rules for a layout (megatron/training/arguments.py
// validate_args and megatron/core; each rule cited in docs/targets.md).
// Returns the first rule the model breaks, worded as Megatron words it, or
// nullopt. Used by plan/search/export under --target megatron and by
// `import megatron`.
std::optional<std::string> MegatronRefusal(const Model& model);

// The policy annotations under which memplan's templates store tensors as
// `settings` do on this model (every tensor the settings do not name kept).
Expected<std::vector<PolicyAnnotation>> SettingsPolicies(const Model& model, const FrameworkSettings& settings);

}  // namespace memplan::planner
