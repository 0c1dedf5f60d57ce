// Megatron's report_theoretical_memory, ported (megatron_theory.h). Line
// references are to megatron/training/theoretical_memory_usage.py (TMU) at
// NVIDIA/Megatron-LM d98e8a64; docs/targets.md has the comparison.
#include "memplan/planner/megatron_theory.h"

#include <algorithm>

namespace memplan::planner {

MegatronTheory MegatronTheoreticalMemory(const Model& model, const MegatronArgs& args) {
  const Arch& a = model.arch;
  const double h = static_cast<double>(a.hidden), heads = static_cast<double>(a.heads);
  const double groups = args.group_query_attention ? static_cast<double>(args.query_groups) : heads;  // TMU:17-18
  const double d = static_cast<double>(a.head_dim);
  const double ns = a.norm == Norm::kRmsNorm ? 1 : 2;
  const double glu = a.ffn_act == FfnAct::kSwiglu ? 1.5 : 1;
  const double vocab = static_cast<double>(a.vocab);
  const double pp = static_cast<double>(args.pp), tp = static_cast<double>(args.tp);
  // Attention parameters (TMU:62-93).
  double attention = 2 * h * h * (1 + groups / heads) * (heads * d / h);
  if (a.mla) {
    const MlaConfig& m = *a.mla;
    const double qk = static_cast<double>(m.qk_nope_head_dim), pe = static_cast<double>(m.qk_rope_head_dim);
    const double v = static_cast<double>(m.v_head_dim), kv = static_cast<double>(m.kv_lora_rank);
    const double q = m.q_lora_rank == 0 ? h * heads * (qk + pe)
                                        : static_cast<double>(m.q_lora_rank) * (h + heads * (qk + pe) + ns);
    attention = q + kv * (h + heads * (qk + v) + ns) + h * pe + heads * v * h;
  }
  // MLP, experts, norms, router (TMU:102-137).
  const double mlp = 2 * h * static_cast<double>(a.ffn_hidden) * glu;
  const double norms = 2 * h * ns;
  double shared = 0, routed = 0, router = 0;
  if (a.moe) {
    const MoeConfig& m = *a.moe;
    shared = 2 * h * static_cast<double>(m.shared_experts * m.shared_ffn_hidden) * glu;
    routed = 2 * h * static_cast<double>(m.expert_ffn_hidden) * static_cast<double>(m.experts) * glu;
    router = h * static_cast<double>(m.experts) + (m.selection_bias ? static_cast<double>(m.experts) : 0);
  }
  double dense_layers = 0, moe_layers = 0;
  for (int64_t l = 0; l < a.layers; ++l) (a.IsMoeLayer(l) ? moe_layers : dense_layers) += 1;
  // MTP layers count as MoE when the last layer is (TMU:51-57).
  const double mtp = static_cast<double>(a.mtp_layers);
  const bool mtp_moe = a.moe && a.IsMoeLayer(a.layers - 1);
  MegatronTheory t;
  // The most loaded rank (TMU:205-266).
  t.tp_split_params = ((attention + mlp) * dense_layers + (attention + shared) * moe_layers) / pp +
                      mtp * (attention + (mtp_moe ? shared : mlp)) + h * vocab;
  if (!a.tied_embeddings && args.pp == 1) t.tp_split_params += h * vocab;
  t.tp_split_params /= tp;
  t.replicated_params = (norms * dense_layers + (norms + router) * moe_layers) / pp + mtp * (norms + (mtp_moe ? router : 0)) +
                        ns * h / pp;
  const double etp = static_cast<double>(args.expert_tp > 0 ? args.expert_tp : args.tp);
  t.expert_params = (routed * moe_layers / pp + (mtp_moe ? routed * mtp : 0)) / (etp * static_cast<double>(args.ep));
  // Bytes per parameter (TMU:293-303).
  const double dp = static_cast<double>(args.DataParallel());
  const double edp = static_cast<double>(args.world_size) / (etp * static_cast<double>(args.ep) * pp);
  auto per_param = [&](double shards) { return args.distributed_optimizer ? 6 + 12 / shards : 18; };
  t.weights_and_optimizer_bytes =
      (t.tp_split_params + t.replicated_params) * per_param(dp) + t.expert_params * per_param(edp);
  // Activations (TMU:308-453): selective recompute with SP, or the other
  // formula for everything else.
  const double s = static_cast<double>(args.seq_len), b = static_cast<double>(args.micro_batch);
  const double layers = static_cast<double>(a.layers);
  const double f = static_cast<double>(a.ffn_hidden > 0 ? a.ffn_hidden : a.moe ? a.moe->expert_ffn_hidden : 4 * a.hidden);
  const double vpp = static_cast<double>(args.VirtualStages());
  const double microbatches = static_cast<double>(model.train.microbatches);
  t.sequence_parallel_formula = args.sequence_parallel && args.recompute_granularity == "selective";
  // Both formulas: L layers of the per-layer term, the embedding's token
  // ids and dropout mask per in-flight stage, the interleaving or
  // microbatch factor, then the last stage's head when pp is 1.
  t.per_layer_coefficient = t.sequence_parallel_formula ? 18 + 4 * f / h : 10 + 24 / tp;
  double act = s * b * h * t.per_layer_coefficient * layers;
  act += 8 * s * b * pp + s * b * h * pp;
  if (vpp > 1) {
    act *= 1 + (pp - 1) / (pp * vpp);
  } else if (pp > 1) {
    act *= std::min(1.0, microbatches / pp);
  }
  if (t.sequence_parallel_formula) {
    if (args.pp == 1) act += 4 * s * b * h * (1 + vocab / h);
    act /= tp;
  } else {
    if (args.pp == 1) act += (s * b * vocab / tp + s * b * h) * 2;
    act *= 1.05;  // "optimizer and miscellaneous temporaries", off the SP path only
  }
  t.activation_bytes = act;
  return t;
}

}  // namespace memplan::planner
