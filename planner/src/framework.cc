// Framework settings (framework.h, docs/export.md): Megatron-LM's recompute
// and offload modules as memplan tensors, and the export of a plan's
// per-tensor decisions onto them.
#include "memplan/planner/framework.h"

#include <algorithm>
#include <functional>
#include <cmath>
#include <limits>
#include <optional>
#include <map>
#include <set>
#include <sstream>

#include "memplan/common/table.h"
#include "memplan/planner/megatron_args.h"
#include "memplan/planner/target.h"

namespace memplan::planner {
namespace {

bool Has(const std::vector<Policy>& p, Policy x) { return std::find(p.begin(), p.end(), x) != p.end(); }

// "layer12.attn.q" -> "attn.q"; empty for names outside a layer.
std::string Suffix(const std::string& name) {
  if (name.rfind("layer", 0) != 0) return "";
  const size_t dot = name.find('.');
  return dot == std::string::npos ? "" : name.substr(dot + 1);
}

std::string Join(const std::vector<std::string>& v, const std::string& sep) {
  std::string out;
  for (const auto& s : v) out += (out.empty() ? "" : sep) + s;
  return out;
}

}  // namespace

// Megatron-LM's selective recompute modules (docs/export.md, which cites
// Megatron's definitions): a recomputed module keeps its input and drops
// what it saved inside.
const std::vector<FrameworkModule>& MegatronRecomputeModules() {
  static const std::vector<FrameworkModule> m = {
      {"core_attn", {"attn.lse", "attn.softmax_out", "attn.attn_dropout_mask", "attn.probs"}},
      {"layernorm", {"attn.qkv_in", "mlp.fc1_in", "moe.x"}},
      {"mla_up_proj", {"attn.q", "attn.k", "attn.v"}},
      {"mlp", {"mlp.fc1_out", "mlp.fc2_in"}},
      {"moe_act", {"moe.fc2_in"}},
      {"moe",
       {"moe.probs", "moe.topk_idx", "moe.topk_weights", "moe.latent", "moe.fc1_in", "moe.slot_of", "moe.fc1_out",
        "moe.fc2_in", "moe.fc2_out", "moe.combine_out", "moe.shared_fc1_out", "moe.shared_fc2_in"}},
      {"shared_experts", {"moe.shared_fc1_out", "moe.shared_fc2_in"}},
  };
  return m;
}

// Megatron-LM's fine-grained offload modules (docs/export.md): a module in
// --offload-modules offloads the tensors it saves for backward (its input).
const std::vector<FrameworkModule>& MegatronOffloadModules() {
  static const std::vector<FrameworkModule> m = {
      {"attn_norm", {"attn_norm.x"}},
      {"qkv_linear", {"attn.qkv_in"}},
      {"core_attn", {"attn.q", "attn.k", "attn.v", "attn.lse", "attn.softmax_out", "attn.attn_dropout_mask", "attn.probs"}},
      {"attn_proj", {"attn.out", "attn.proj_in"}},
      {"mlp_norm", {"ffn_norm.x"}},
      {"expert_fc1", {"moe.fc1_in"}},
      {"moe_act", {"moe.fc1_out"}},
  };
  return m;
}

namespace {

const FrameworkModule* Find(const std::vector<FrameworkModule>& table, std::string_view name) {
  for (const auto& m : table) {
    if (m.name == name) return &m;
  }
  return nullptr;
}

// Which suffixes each choice covers (mla_up_proj's only on MLA models,
// where attn.q/k/v are the up-projections' outputs).
std::map<std::string, Policy> StorageOf(bool mla, const std::vector<std::string>& recompute,
                                      const std::vector<std::string>& offload) {
  std::map<std::string, Policy> out;
  for (const auto& name : offload) {
    for (auto t : Find(MegatronOffloadModules(), name)->tensors) out[std::string(t)] = Policy::kOffloadHost;
  }
  for (const auto& name : recompute) {
    if (name == "mla_up_proj" && !mla) continue;
    for (auto t : Find(MegatronRecomputeModules(), name)->tensors) out[std::string(t)] = Policy::kRecompute;
  }
  return out;
}

}  // namespace

Expected<std::vector<PolicyAnnotation>> MegatronPolicies(bool mla, const std::vector<std::string>& recompute,
                                                         const std::vector<std::string>& offload, bool keep_rest,
                                                         const std::string& where) {
  for (const auto& n : recompute) {
    if (!Find(MegatronRecomputeModules(), n)) {
      return Error{ErrorCode::kBadInput, where + ": --recompute-modules: unknown module " + n +
                                             " (expected core_attn, layernorm, mla_up_proj, mlp, moe_act, moe, "
                                             "shared_experts)"};
    }
  }
  for (const auto& n : offload) {
    if (!Find(MegatronOffloadModules(), n)) {
      return Error{ErrorCode::kBadInput, where + ": --offload-modules: unknown module " + n +
                                             " (expected attn_norm, qkv_linear, core_attn, attn_proj, mlp_norm, expert_fc1, "
                                             "moe_act)"};
    }
  }
  std::vector<PolicyAnnotation> out;
  for (const auto& [suffix, policy] : StorageOf(mla, recompute, offload)) {
    out.push_back({"layer*." + suffix, {policy}});
  }
  if (keep_rest) out.push_back({"*", {Policy::kKeep}});  // Megatron saves everything else
  return out;
}

namespace {

// What neither framework says: FP8 storage of single tensors, offload into
// another rank, and per-tensor choices the settings store otherwise
// (`stored(name)` is the settings' storage of a tensor, or nullopt).
std::vector<std::string> NotExpressedBy(
    const Plan& plan, const std::function<std::optional<std::vector<Policy>>(const std::string&)>& stored) {
  std::vector<std::string> out;
  int64_t fp8 = 0, fp8_n = 0, remote = 0, remote_n = 0, differ = 0, differ_bytes = 0;
  for (const auto& t : plan.tensors) {
    if (Has(t.effective, Policy::kFp8)) fp8 += t.bytes, ++fp8_n;
    if (Has(t.effective, Policy::kOffloadRemote)) remote += t.bytes, ++remote_n;
    if (stored(t.name) != t.effective) differ += 1, differ_bytes += t.bytes;
  }
  const double g = 1.0 / (1 << 30);
  if (fp8_n) {
    out.push_back("FP8 storage of " + std::to_string(fp8_n) + " saved tensors (" + FormatFixed(fp8 * g, 2) +
                  " GiB per microbatch): no per-tensor setting; kept or as their module says");
  }
  if (remote_n) {
    out.push_back("offload into another pipeline rank's memory of " + std::to_string(remote_n) + " tensors (" +
                  FormatFixed(remote * g, 2) + " GiB per microbatch): to host where their module is offloaded, else kept");
  }
  if (differ) {
    out.push_back(std::to_string(differ) + " of " + std::to_string(plan.tensors.size()) + " saved tensors (" +
                  FormatFixed(differ_bytes * g, 2) + " GiB per microbatch) are stored otherwise than memplan's plan stores them");
  }
  return out;
}

// Against a model's annotations (the first glob that matches; kept if none).
std::vector<std::string> NotExpressed(const Plan& plan, const Model& coarse) {
  return NotExpressedBy(plan, [&](const std::string& name) -> std::optional<std::vector<Policy>> {
    for (const auto& a : coarse.policies) {
      if (GlobMatch(a.match, name)) return a.policy;
    }
    return std::vector<Policy>{Policy::kKeep};
  });
}

// Against a plan of the settings: each tensor's storage there.
std::vector<std::string> NotExpressed(const Plan& plan, const Plan& coarse) {
  std::map<std::string, std::vector<Policy>> by;
  for (const auto& t : coarse.tensors) by[t.name] = t.effective;
  return NotExpressedBy(plan, [&](const std::string& name) -> std::optional<std::vector<Policy>> {
    auto it = by.find(name);
    if (it == by.end()) return std::nullopt;
    return it->second;
  });
}

// The coarse model: the plan's, with its final layout fixed and the
// storage given by the settings (every other tensor kept).
Model Coarse(const Plan& plan, std::vector<PolicyAnnotation> policies) {
  Model m = plan.model;
  m.policies = std::move(policies);
  m.parallel.pp_layout.clear();
  for (const auto& r : plan.ranks) m.parallel.pp_layout.push_back(static_cast<int64_t>(r.layers.size()));
  m.parallel.pp_layout_given = true;
  return m;
}

}  // namespace

namespace {

// The argument list for `args` of model `m` (docs/export.md): every flag
// that changes memory or the model, in Megatron's spelling. What the flags
// cannot say goes to `not_expressed`.
std::string MegatronArgsText(const Model& m, const MegatronArgs& args, std::vector<std::string>* not_expressed) {
  const Arch& a = m.arch;
  const Parallel& p = m.parallel;
  const bool mla = a.mla.has_value();
  std::vector<std::string> lines;
  auto arg = [&](const std::string& name, const std::string& value = "") {
    lines.push_back(value.empty() ? name : name + " " + value);
  };
  auto num = [](int64_t v) { return std::to_string(v); };
  arg("--num-layers", num(a.layers));
  arg("--hidden-size", num(a.hidden));
  arg("--num-attention-heads", num(a.heads));
  if (args.group_query_attention) {
    arg("--group-query-attention");
    arg("--num-query-groups", num(args.query_groups));
  }
  if (!mla && a.head_dim != a.hidden / a.heads) arg("--kv-channels", num(a.head_dim));
  const int64_t ffn = a.ffn_hidden > 0 ? a.ffn_hidden : a.moe ? a.moe->expert_ffn_hidden : 4 * a.hidden;
  arg("--ffn-hidden-size", num(ffn));
  if (a.ffn_act == FfnAct::kSwiglu) arg("--swiglu");
  arg("--normalization", a.norm == Norm::kRmsNorm ? "RMSNorm" : "LayerNorm");
  arg("--attention-backend", a.attention == Attention::kStandard ? "unfused" : "flash");
  arg("--attention-dropout", a.dropout ? "0.1" : "0.0");
  arg("--hidden-dropout", a.dropout ? "0.1" : "0.0");
  arg("--vocab-size", num(a.vocab));
  arg("--make-vocab-size-divisible-by", "1");  // the model's vocabulary is already padded
  if (!a.tied_embeddings) arg("--untie-embeddings-and-output-weights");
  auto real = [](double v) {
    std::ostringstream o;
    o << v;
    return o.str();
  };
  if (a.position_embeddings > 0) {
    arg("--position-embedding-type", "learned_absolute");
    arg("--max-position-embeddings", num(a.position_embeddings));
  } else {
    arg("--position-embedding-type", "rope");
    // --rotary-base is an integer in Megatron (arguments.py).
    if (a.rope_base && *a.rope_base == std::floor(*a.rope_base)) {
      arg("--rotary-base", num(static_cast<int64_t>(*a.rope_base)));
    } else if (a.rope_base) {
      not_expressed->push_back("the rotary base " + real(*a.rope_base) + ": Megatron's --rotary-base is an integer");
    }
    if (a.rope_scaling_factor) {
      arg("--use-rope-scaling");
      arg("--rope-scaling-factor", real(*a.rope_scaling_factor));
    }
  }
  // Megatron adds biases to every linear unless told not to; memplan's
  // models have none unless they say so.
  if (!a.linear_bias) arg("--disable-bias-linear");
  if (a.qkv_bias && !a.linear_bias) arg("--add-qkv-bias");
  if (a.qk_norm) arg("--qk-layernorm");
  if (a.norm_eps) arg("--norm-epsilon", real(*a.norm_eps));
  if (mla) {
    arg("--multi-latent-attention");
    arg("--q-lora-rank", num(a.mla->q_lora_rank));
    arg("--kv-lora-rank", num(a.mla->kv_lora_rank));
    arg("--qk-head-dim", num(a.mla->qk_nope_head_dim));
    arg("--qk-pos-emb-head-dim", num(a.mla->qk_rope_head_dim));
    arg("--v-head-dim", num(a.mla->v_head_dim));
  }
  if (a.moe) {
    const MoeConfig& moe = *a.moe;
    arg("--num-experts", num(moe.experts));
    arg("--moe-router-topk", num(moe.top_k));
    arg("--moe-ffn-hidden-size", num(moe.expert_ffn_hidden));
    if (moe.shared_experts > 0) arg("--moe-shared-expert-intermediate-size", num(moe.shared_experts * moe.shared_ffn_hidden));
    std::string pattern = "[";
    for (int64_t l = 0; l < a.layers; ++l) pattern += std::string(l ? "," : "") + (a.IsMoeLayer(l) ? "1" : "0");
    arg("--moe-layer-freq", "\"" + pattern + "]\"");
    arg("--moe-router-score-function", moe.router == Router::kSigmoid ? "sigmoid" : "softmax");
    if (moe.capacity_factor) arg("--moe-expert-capacity-factor", FormatFixed(*moe.capacity_factor, 2));
    if (moe.routed_scaling != 1.0) {
      std::ostringstream v;
      v << moe.routed_scaling;
      arg("--moe-router-topk-scaling-factor", v.str());
    }
    if (moe.selection_bias) arg("--moe-router-enable-expert-bias");
    if (moe.selection_bias && moe.bias_update_rate != 1e-3) {
      std::ostringstream v;
      v << moe.bias_update_rate;
      arg("--moe-router-bias-update-rate", v.str());
    }
    arg("--moe-grouped-gemm");
    arg("--moe-token-dispatcher-type", "alltoall");
    if (moe.load_balancing) arg("--moe-router-load-balancing-type", *moe.load_balancing);
    if (moe.aux_loss_coeff) arg("--moe-aux-loss-coeff", real(*moe.aux_loss_coeff));
    if (!moe.capacity_factor && moe.imbalance != MoeConfig::kDefaultMoeImbalance) {
      not_expressed->push_back("the assumed routing skew (arch.moe.imbalance " + FormatFixed(moe.imbalance, 2) +
                               "): a planning assumption, not a setting; the import restores the default");
    }
  }
  if (a.mtp_layers > 0) arg("--mtp-num-layers", num(a.mtp_layers));
  arg("--seq-length", num(m.train.seq_len));
  arg("--micro-batch-size", num(args.micro_batch));
  arg("--global-batch-size", num(args.global_batch));
  if (args.bf16) arg("--bf16");
  if (args.fp16) arg("--fp16");
  arg("--optimizer", m.train.optimizer == Optimizer::kMuon ? "muon" : "adam");
  arg("--tensor-model-parallel-size", num(p.tp));
  if (args.sequence_parallel) arg("--sequence-parallel");
  arg("--pipeline-model-parallel-size", num(p.pp));
  if (args.virtual_stages_per_rank) arg("--num-virtual-stages-per-pipeline-rank", num(*args.virtual_stages_per_rank));
  if (args.first_stage_layers) arg("--decoder-first-pipeline-num-layers", num(*args.first_stage_layers));
  if (args.last_stage_layers) arg("--decoder-last-pipeline-num-layers", num(*args.last_stage_layers));
  if (!args.pipeline_layout.empty()) arg("--pipeline-model-parallel-layout", "\"" + args.pipeline_layout + "\"");
  arg("--context-parallel-size", num(p.cp));
  if (a.moe) {
    arg("--expert-model-parallel-size", num(p.ep));
    arg("--expert-tensor-parallel-size", num(args.expert_tp));
  }
  if (args.distributed_optimizer) arg("--use-distributed-optimizer");
  if (args.overlap_grad_reduce) arg("--overlap-grad-reduce");
  if (args.overlap_param_gather) arg("--overlap-param-gather");
  if (args.recompute_granularity == "selective") {
    arg("--recompute-granularity", "selective");
    arg("--recompute-modules", Join(args.recompute_modules, " "));
  } else if (args.recompute_granularity == "full") {
    arg("--recompute-granularity", "full");
    arg("--recompute-method", args.recompute_method);
    arg("--recompute-num-layers", num(*args.recompute_num_layers));
  }
  if (args.fine_grained_offloading) {
    arg("--fine-grained-activation-offloading");
    arg("--offload-modules", Join(args.offload_modules, " "));
  }
  std::string text = "# memplan export megatron: " + m.name + " (" + num(p.Processes()) + " GPUs)\n";
  for (size_t i = 0; i < lines.size(); ++i) text += lines[i] + (i + 1 < lines.size() ? " \\\n" : "\n");
  return text;
}

}  // namespace

Expected<ExportedSettings> ExportMegatron(const Plan& plan, const std::function<void(const std::string&)>& progress) {
  ExportedSettings e;
  e.framework = "megatron";
  // The plan for Megatron: this one if it is one, else its model planned
  // under target megatron with its pipeline layout fixed (the settings
  // chosen as `plan --target megatron` chooses them; docs/targets.md).
  if (plan.model.target.kind == TargetKind::kMegatron) {
    e.coarse_plan = plan;
  } else {
    Model m = Coarse(plan, {});
    ApplyTarget(&m, TargetKind::kMegatron);
    if (auto why = MegatronRefusal(m)) {
      return Error{ErrorCode::kBadInput, "export megatron: Megatron cannot run this model: " + *why};
    }
    PlanOptions o;
    o.on_progress = progress;
    auto q = BuildPlan(m, o);
    if (!q) return q.error();
    e.coarse_plan = std::move(*q);
  }
  e.coarse = e.coarse_plan.model;
  const FrameworkSettings settings = e.coarse.target.settings.value_or(FrameworkSettings{});
  e.recompute = settings.granularity == "full"
                    ? std::vector<std::string>{"full " + settings.method + " " + std::to_string(settings.num_layers)}
                    : settings.recompute_modules;
  e.offload = settings.offload_modules;
  MegatronArgs args = MegatronArgsOf(e.coarse, settings);
  // Megatron's overlap of the gradient reduce-scatter and the parameter
  // all-gather with the distributed optimizer: no memory of their own (the
  // buckets are views of the contiguous buffers), the step time model's
  // assumption (docs/planner.md).
  if (args.distributed_optimizer && args.DataParallel() * args.cp > 1) {
    args.overlap_grad_reduce = args.overlap_param_gather = true;
  }
  if (auto why = ValidateMegatronArgs(args)) {
    return Error{ErrorCode::kRuntime, "internal error: export megatron would write arguments Megatron refuses: " + *why};
  }
  if (plan.model.target.kind != TargetKind::kMegatron) {
    e.not_expressed = NotExpressed(plan, e.coarse_plan);
    if (plan.model.options.moe_recompute_dispatch) {
      e.not_expressed.push_back("memplan's MoE dispatch recompute (options): Megatron saves the dispatched rows; its "
                                "plan does too");
    }
  }
  e.text = MegatronArgsText(e.coarse, args, &e.not_expressed);
  return e;
}

Expected<ExportedSettings> ExportTorchtitan(const Plan& plan) {
  const Model& m = plan.model;
  const Parallel& p = m.parallel;
  ExportedSettings e;
  e.framework = "torchtitan";
  // TorchTitan's [activation_checkpoint] (docs/export.md):
  // "full" recomputes every block from its input; "selective" with an
  // integer N every N-th block; with "op" it saves matmul and attention
  // outputs and recomputes the rest (norms, activations). Per layer: the
  // share of its saved bytes the plan recomputes.
  std::map<int64_t, std::pair<int64_t, int64_t>> layer;  // layer -> (recomputed, all)
  for (const auto& t : plan.tensors) {
    if (Suffix(t.name).empty() || t.name.find(".attn_norm.x") != std::string::npos) continue;
    auto& [r, all] = layer[t.layer];
    all += t.bytes;
    if (Has(t.effective, Policy::kRecompute)) r += t.bytes;
  }
  int64_t heavy = 0, any = 0;
  for (const auto& [l, v] : layer) {
    heavy += 2 * v.first >= v.second;
    any += v.first > 0;
  }
  const int64_t n = static_cast<int64_t>(layer.size());
  // The settings as policies: "none", "op", an integer N, or "full".
  auto policies_of = [&](const std::string& choice) {
    std::vector<PolicyAnnotation> policies;
    if (choice == "full") {
      policies.push_back({"layer*.attn_norm.x", {Policy::kKeep}});  // the block's input
      for (const char* keep : {"layer*.embed.*", "layer*.head.*", "layer*.loss.*"}) policies.push_back({keep, {Policy::kKeep}});
      policies.push_back({"layer*", {Policy::kRecompute}});
    } else if (choice == "op") {
      for (const char* t : {"attn.qkv_in", "mlp.fc1_in", "moe.x", "mlp.fc2_in", "moe.fc2_in", "attn.lse"}) {
        policies.push_back({std::string("layer*.") + t, {Policy::kRecompute}});
      }
    } else if (choice != "none") {
      const int64_t every = std::stoll(choice);
      for (int64_t l = 0; l < m.arch.layers; l += every) {
        policies.push_back({"layer" + std::to_string(l) + ".attn_norm.x", {Policy::kKeep}});
        policies.push_back({"layer" + std::to_string(l) + ".*", {Policy::kRecompute}});
      }
    }
    policies.push_back({"*", {Policy::kKeep}});
    return policies;
  };
  std::string choice = "none";
  if (n > 0 && 2 * heavy >= n) {
    choice = "full";
  } else if (heavy > 0) {
    choice = std::to_string(std::max<int64_t>(1, n / heavy));
  } else if (any > 0) {
    choice = "op";
  }
  // Where that does not fit, more recomputation, step by step.
  std::vector<std::string> ladder = {"none", "op", "4", "2", "full"};
  auto at = std::find(ladder.begin(), ladder.end(), choice);
  std::vector<std::string> next = {choice};
  if (at != ladder.end()) next.insert(next.end(), at + 1, ladder.end());
  else next.push_back("full");
  for (const auto& c : next) {
    choice = c;
    auto q = BuildPlan(Coarse(plan, policies_of(c)));
    if (!q) return q.error();
    e.coarse_plan = std::move(*q);
    bool fits = true;
    for (const auto& r : e.coarse_plan.ranks) fits &= r.fits;
    if (fits) break;
    if (c != next.back()) e.added.push_back("activation_checkpoint " + c + " did not fit: more recomputation");
  }
  std::vector<PolicyAnnotation> policies = policies_of(choice);
  const std::string mode = choice == "none" || choice == "full" ? choice : "selective";
  const std::string option = mode == "selective" ? choice : "";
  e.recompute = {mode + (option.empty() ? "" : " " + option)};
  e.coarse = Coarse(plan, policies);
  e.not_expressed = NotExpressed(plan, e.coarse);
  int64_t offloaded = 0;
  for (const auto& t : plan.tensors) {
    offloaded += Has(t.effective, Policy::kOffloadHost) || Has(t.effective, Policy::kOffloadRemote);
  }
  if (offloaded) {
    e.not_expressed.push_back("activation offload of " + std::to_string(offloaded) +
                              " tensors: TorchTitan has no activation offload setting; kept or recomputed");
  }
  if (p.zero != 3) {
    e.not_expressed.push_back("TorchTitan shards parameters with FSDP (ZeRO-3) over data_parallel_shard_degree; the "
                              "plan has ZeRO-" + std::to_string(p.zero) +
                              ": the static bytes differ (plan with parallel.zero 3 to compare)");
  }
  std::ostringstream t;
  t << "# memplan export torchtitan: " << m.name << " (" << p.Processes() << " GPUs)\n";
  t << "[training]\nlocal_batch_size = " << m.train.micro_batch * m.train.microbatches << "\nseq_len = "
    << m.train.seq_len << "\nmixed_precision_param = \"" << (m.train.param_dtype == DType::kFP32 ? "float32" : "bfloat16")
    << "\"\n\n";
  t << "[parallelism]\ndata_parallel_shard_degree = " << p.dp << "\ntensor_parallel_degree = " << p.tp
    << "\npipeline_parallel_degree = " << p.pp << "\ncontext_parallel_degree = " << p.cp
    << "\nexpert_parallel_degree = " << p.ep << "\n";
  if (p.pp > 1) {
    t << "pipeline_parallel_schedule = \"" << (p.vp > 1 ? "Interleaved1F1B" : "1F1B")
      << "\"\npipeline_parallel_microbatch_size = " << m.train.micro_batch << "\n";
  }
  t << "\n[activation_checkpoint]\nmode = \"" << mode << "\"\n";
  if (!option.empty()) t << "selective_ac_option = \"" << option << "\"\n";
  e.text = t.str();
  return e;
}

}  // namespace memplan::planner
