// Megatron-LM's own memory estimate, report_theoretical_memory
// (megatron/training/theoretical_memory_usage.py at d98e8a64), ported to
// compare with memplan's plan for Megatron (docs/targets.md, "Against
// Megatron's own estimate"). It estimates one rank: the first pipeline
// stage, assumed to hold num_layers / pp layers, the embedding and the
// whole MTP block, in bytes.
#pragma once

#include <cstdint>

#include "memplan/planner/megatron_args.h"
#include "memplan/planner/model.h"

namespace memplan::planner {

struct MegatronTheory {
  // Parameters on the most loaded rank: split by tensor parallelism,
  // replicated (norms, router), and routed experts (split by etp x ep).
  double tp_split_params = 0, replicated_params = 0, expert_params = 0;
  // Weights, gradients and optimizer state: 18 B per parameter, or 6 + 12/d
  // with the distributed optimizer (d: data parallel, without cp; experts:
  // world / (etp ep pp)).
  double weights_and_optimizer_bytes = 0;
  // Activations of the first stage with its in-flight microbatches; which
  // of Megatron's two formulas applied.
  double activation_bytes = 0;
  bool sequence_parallel_formula = false;
  // The per-layer coefficient x in s b h x / tp (18 + 4F/h with SP and
  // selective recompute, else 10 + 24/tp before the division).
  double per_layer_coefficient = 0;
};

// The estimate for `model` launched with `args` (MegatronArgsOf), with
// `microbatches` per step.
MegatronTheory MegatronTheoreticalMemory(const Model& model, const MegatronArgs& args);

}  // namespace memplan::planner
