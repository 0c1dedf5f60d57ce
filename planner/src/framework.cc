// Framework settings (framework.h, docs/export.md): Megatron-LM's recompute
// and offload modules as memplan tensors, and the export of a plan's
// per-tensor decisions onto them.
#include "memplan/planner/framework.h"

#include <algorithm>
#include <limits>
#include <optional>
#include <map>
#include <set>
#include <sstream>

#include "memplan/common/table.h"

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
                                             " (expected attn_norm, core_attn, attn_proj, mlp_norm, expert_fc1, "
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

// The plan's decisions by suffix: bytes recomputed, offloaded (host or
// another rank), and in all.
struct Tally {
  int64_t all = 0, recompute = 0, offload = 0;
};

std::map<std::string, Tally> TallyBySuffix(const Plan& plan) {
  std::map<std::string, Tally> out;
  for (const auto& t : plan.tensors) {
    Tally& s = out[Suffix(t.name)];
    s.all += t.bytes;
    if (Has(t.effective, Policy::kRecompute)) s.recompute += t.bytes;
    if (Has(t.effective, Policy::kOffloadHost) || Has(t.effective, Policy::kOffloadRemote)) s.offload += t.bytes;
  }
  return out;
}

// Modules of `table` whose tensors the plan stores so for at least half of
// their bytes (`pick` reads the share from a tally).
template <typename Pick>
std::vector<std::string> Majority(const std::vector<FrameworkModule>& table, const std::map<std::string, Tally>& by,
                                  bool mla, Pick pick) {
  std::vector<std::string> out;
  for (const auto& m : table) {
    if (m.name == "mla_up_proj" && !mla) continue;
    int64_t all = 0, chosen = 0;
    for (auto t : m.tensors) {
      auto it = by.find(std::string(t));
      if (it == by.end()) continue;
      all += it->second.all;
      chosen += pick(it->second);
    }
    if (all > 0 && 2 * chosen >= all) out.emplace_back(m.name);
  }
  return out;
}

// What neither framework says: FP8 storage of single tensors, offload into
// another rank, and per-tensor choices the module settings override.
std::vector<std::string> NotExpressed(const Plan& plan, const Model& coarse) {
  std::vector<std::string> out;
  int64_t fp8 = 0, fp8_n = 0, remote = 0, remote_n = 0, differ = 0, differ_bytes = 0;
  for (const auto& t : plan.tensors) {
    if (Has(t.effective, Policy::kFp8)) fp8 += t.bytes, ++fp8_n;
    if (Has(t.effective, Policy::kOffloadRemote)) remote += t.bytes, ++remote_n;
    std::vector<Policy> want = {Policy::kKeep};
    for (const auto& a : coarse.policies) {
      if (GlobMatch(a.match, t.name)) {
        want = a.policy;
        break;
      }
    }
    if (want != t.effective) differ += 1, differ_bytes += t.bytes;
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

Expected<ExportedSettings> ExportMegatron(const Plan& plan) {
  const Model& m = plan.model;
  const Arch& a = m.arch;
  const Parallel& p = m.parallel;
  ExportedSettings e;
  e.framework = "megatron";
  const auto by = TallyBySuffix(plan);
  const bool mla = a.mla.has_value();
  e.recompute = Majority(MegatronRecomputeModules(), by, mla, [](const Tally& t) { return t.recompute; });
  e.offload = Majority(MegatronOffloadModules(), by, mla, [](const Tally& t) { return t.offload; });
  auto coarse = [&](const std::vector<std::string>& r, const std::vector<std::string>& o) -> Expected<Model> {
    auto policies = MegatronPolicies(mla, r, o, true, "export");
    if (!policies) return policies.error();
    return Coarse(plan, *policies);
  };
  // Where the majority's settings do not fit, add the module (recomputed
  // or offloaded) that brings the worst rank closest to its budget, until
  // they fit or no module helps (docs/export.md).
  auto excess = [](const Plan& q) {
    int64_t worst = std::numeric_limits<int64_t>::min();
    for (const auto& r : q.ranks) worst = std::max(worst, r.peak + r.statics.runtime - r.budget);
    return worst;
  };
  auto base = coarse(e.recompute, e.offload);
  if (!base) return base.error();
  auto current = BuildPlan(*base);
  if (!current) return current.error();
  for (int round = 0; round < 16 && excess(*current) > 0; ++round) {
    std::optional<Plan> best;
    std::vector<std::string> best_r, best_o;
    auto consider = [&](std::vector<std::string> r, std::vector<std::string> o) -> Expected<bool> {
      auto m = coarse(r, o);
      if (!m) return m.error();
      auto q = BuildPlan(*m);
      if (!q) return q.error();
      // A candidate that fits beats one that does not, then the faster;
      // among those that do not fit, the most bytes per second added.
      auto better = [&](const Plan& a, const Plan& b) {
        const bool fa = excess(a) <= 0, fb = excess(b) <= 0;
        if (fa != fb) return fa;
        if (fa) return a.overhead.step_s < b.overhead.step_s;
        auto rate = [&](const Plan& x) {
          const double saved = static_cast<double>(excess(*current) - excess(x));
          return saved / (std::max(0.0, x.overhead.step_s - current->overhead.step_s) + 1e-3);
        };
        return rate(a) > rate(b);
      };
      if (!best || better(*q, *best)) {
        best = std::move(*q);
        best_r = std::move(r);
        best_o = std::move(o);
      }
      return true;
    };
    for (const auto& mod : MegatronRecomputeModules()) {
      if ((mod.name == "mla_up_proj" && !mla) ||
          std::find(e.recompute.begin(), e.recompute.end(), mod.name) != e.recompute.end()) continue;
      auto r = e.recompute;
      r.emplace_back(mod.name);
      if (auto ok = consider(r, e.offload); !ok) return ok.error();
    }
    for (const auto& mod : MegatronOffloadModules()) {
      if (std::find(e.offload.begin(), e.offload.end(), mod.name) != e.offload.end()) continue;
      auto o = e.offload;
      o.emplace_back(mod.name);
      if (auto ok = consider(e.recompute, o); !ok) return ok.error();
    }
    if (!best || excess(*best) >= excess(*current)) break;
    e.added.push_back(best_r.size() > e.recompute.size() ? "recompute " + best_r.back() : "offload " + best_o.back());
    e.recompute = std::move(best_r);
    e.offload = std::move(best_o);
    current = std::move(*best);
  }
  // Megatron's order for the lists: the table's.
  auto order = [](const std::vector<FrameworkModule>& table, std::vector<std::string>& v) {
    std::vector<std::string> out;
    for (const auto& m : table) {
      if (std::find(v.begin(), v.end(), m.name) != v.end()) out.emplace_back(m.name);
    }
    v = std::move(out);
  };
  order(MegatronRecomputeModules(), e.recompute);
  order(MegatronOffloadModules(), e.offload);
  // The settings' policies do not depend on the lists' order: `current` is
  // their plan.
  auto final_model = coarse(e.recompute, e.offload);
  if (!final_model) return final_model.error();
  e.coarse = std::move(*final_model);
  e.coarse_plan = std::move(*current);
  e.not_expressed = NotExpressed(plan, e.coarse);

  std::vector<std::string> lines;
  auto arg = [&](const std::string& name, const std::string& value = "") {
    lines.push_back(value.empty() ? name : name + " " + value);
  };
  auto num = [](int64_t v) { return std::to_string(v); };
  arg("--num-layers", num(a.layers));
  arg("--hidden-size", num(a.hidden));
  arg("--num-attention-heads", num(a.heads));
  if (a.kv_heads != a.heads) {
    arg("--group-query-attention");
    arg("--num-query-groups", num(a.kv_heads));
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
  if (a.position_embeddings > 0) {
    arg("--position-embedding-type", "learned_absolute");
    arg("--max-position-embeddings", num(a.position_embeddings));
  } else {
    arg("--position-embedding-type", "rope");
  }
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
    if (moe.latent_dim) e.not_expressed.push_back("the experts' latent projection (arch.moe.latent_dim): Megatron has none");
    if (!moe.capacity_factor && moe.imbalance != MoeConfig::kDefaultMoeImbalance) {
      e.not_expressed.push_back("the assumed routing skew (arch.moe.imbalance " + FormatFixed(moe.imbalance, 2) +
                                "): a planning assumption, not a setting; the import restores the default");
    }
  }
  if (a.mtp_layers > 0) arg("--mtp-num-layers", num(a.mtp_layers));
  if (a.attn_res) e.not_expressed.push_back("Block AttnRes (arch.attn_res): Megatron has no attention residuals");
  if (a.linear_attention) e.not_expressed.push_back("KDA layers (arch.linear_attention): Megatron has no KDA");
  arg("--seq-length", num(m.train.seq_len));
  arg("--micro-batch-size", num(m.train.micro_batch));
  arg("--global-batch-size", num(m.train.micro_batch * m.train.microbatches * p.dp));
  if (m.train.param_dtype == DType::kBF16) arg("--bf16");
  if (m.train.param_dtype == DType::kFP16) arg("--fp16");
  if (m.train.grad_dtype != DType::kFP32) {
    e.not_expressed.push_back("16-bit gradient accumulation (train.grad_dtype): Megatron accumulates main gradients in fp32");
  }
  arg("--optimizer", m.train.optimizer == Optimizer::kMuon ? "muon" : "adam");
  arg("--tensor-model-parallel-size", num(p.tp));
  if (p.sp) arg("--sequence-parallel");
  arg("--pipeline-model-parallel-size", num(p.pp));
  if (p.vp > 1) arg("--num-virtual-stages-per-pipeline-rank", num(p.vp));
  arg("--context-parallel-size", num(p.cp));
  if (a.moe) {
    arg("--expert-model-parallel-size", num(p.ep));
    arg("--expert-tensor-parallel-size", "1");
  }
  if (p.zero >= 1) arg("--use-distributed-optimizer");
  if (p.zero >= 3) {
    e.not_expressed.push_back("ZeRO-3 (parallel.zero 3): Megatron's FSDP (--use-torch-fsdp2, Megatron-FSDP) is not "
                              "written; the arguments say the distributed optimizer (ZeRO-1)");
  } else if (p.zero >= 2 || p.pipeline_zero2 || p.grad_offload_host) {
    e.not_expressed.push_back("ZeRO-2, pipeline ZeRO-2 and host gradients (parallel.zero, pipeline_zero2, "
                              "grad_offload): Megatron's distributed optimizer is ZeRO-1");
  }
  // The layout: even, first/last, or not said.
  const std::vector<int64_t>& layout = e.coarse.parallel.pp_layout;
  if (p.pp > 1 && std::adjacent_find(layout.begin(), layout.end(), std::not_equal_to<>()) != layout.end()) {
    const int64_t mid = layout[layout.size() / 2];
    bool first_last = p.vp == 1;
    for (size_t i = 1; i + 1 < layout.size(); ++i) first_last &= layout[i] == mid;
    if (first_last) {
      if (layout.front() != mid) arg("--decoder-first-pipeline-num-layers", num(layout.front()));
      if (layout.back() != mid || layout.front() == mid) arg("--decoder-last-pipeline-num-layers", num(layout.back()));
    } else {
      std::vector<std::string> per;
      for (int64_t n : layout) per.push_back(num(n));
      e.not_expressed.push_back("the pipeline layout " + Join(per, ",") +
                                " layers per rank (--pipeline-model-parallel-layout can say it; not written yet)");
    }
  }
  if (!e.recompute.empty()) {
    arg("--recompute-granularity", "selective");
    arg("--recompute-modules", Join(e.recompute, " "));
  }
  if (!e.offload.empty()) {
    arg("--fine-grained-activation-offloading");
    arg("--offload-modules", Join(e.offload, " "));
  }
  if (m.options.moe_grad_rewrite && a.moe) {
    e.not_expressed.push_back("memplan's MoE gradient rewrite and dispatch recompute (options): Megatron has neither; "
                              "the re-plan and the import keep them");
  }
  std::string text = "# memplan export megatron: " + m.name + " (" + num(p.Processes()) + " GPUs)\n";
  for (size_t i = 0; i < lines.size(); ++i) text += lines[i] + (i + 1 < lines.size() ? " \\\n" : "\n");
  e.text = std::move(text);
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
