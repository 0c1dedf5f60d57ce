// The assumptions block of import, plan and search (assumptions.h).
#include "memplan/planner/assumptions.h"

#include <vector>

#include "memplan/common/table.h"
#include "memplan/common/units.h"
#include "memplan/planner/accounting.h"
#include "memplan/planner/target.h"
#include "memplan/planner/templates.h"

namespace memplan::planner {

namespace {

std::string Count(int64_t n) {
  return n >= 1'000'000'000 ? FormatFixed(static_cast<double>(n) / 1e9, 2) + " B"
                            : FormatFixed(static_cast<double>(n) / 1e6, 2) + " M";
}

std::string Str(int64_t v) { return std::to_string(v); }

// One row: what, the value assumed, and what changes it for this verb
// (import's flag, else plan's and search's flag; then the model field).
struct Row {
  std::string what, value, change;
};

std::string Change(const AssumptionsContext& c, const std::string& import_flag, const std::string& plan_flag,
                   const std::string& field) {
  const std::string& flag = c.verb == AssumptionsFor::kImport ? import_flag : plan_flag;
  if (flag.empty()) return field;
  return field.empty() ? flag : flag + ", " + field;
}

std::string BudgetValue(const Model& m, const AssumptionsContext& c) {
  if (c.budget) return FormatBytes(*c.budget) + " per GPU (--budget)";
  if (m.budget_given) return FormatBytes(m.budget) + " per GPU (the model's budget)";
  const Hardware& h = m.hardware;
  const int64_t held = h.device_memory - m.budget;
  const bool counted = h.runtime.cuda_context > 0;
  return FormatBytes(m.budget) + " = " + FormatBytes(h.device_memory) + " less " + FormatBytes(held) +
         (counted ? " (max(1 GiB, 2 %) of allocator slack; CUDA context, NCCL counted apart)"
                  : " (max(2 GiB, 5 %): what no line item counts)");
}

std::string AttentionValue(const Arch& a) {
  std::string kind = a.attention == Attention::kFlash ? "flash" : "standard (scores materialized)";
  if (a.mla) {
    return kind + ", MLA: " + Str(a.heads) + " heads, kv rank " + Str(a.mla->kv_lora_rank) +
           (a.mla->q_lora_rank ? ", q rank " + Str(a.mla->q_lora_rank) : std::string(", q uncompressed"));
  }
  std::string heads = Str(a.heads) + " heads";
  if (a.kv_heads != a.heads) heads += ", " + Str(a.kv_heads) + " kv heads (" + (a.kv_heads == 1 ? "MQA" : "GQA") + ")";
  std::string out = kind + ", " + heads + ", head dim " + Str(a.head_dim);
  if (a.linear_attention) {
    out += "; " + a.linear_attention->kind + " linear attention except every " +
           Str(a.linear_attention->full_attention_every) + "th layer";
  }
  return out;
}

std::string MoeValue(const MoeConfig& moe, int64_t ep) {
  std::string out = Str(moe.experts) + " experts, top " + Str(moe.top_k) +
                    (moe.shared_experts ? ", " + Str(moe.shared_experts) + " shared" : std::string()) + "; ";
  const double f = moe.RoutedRowsFactor(ep);
  out += moe.capacity_factor ? "tokens dropped past capacity " + FormatFixed(*moe.capacity_factor, 2)
                             : "dropless, routed buffers sized for skew " + FormatFixed(f, 2) +
                                   " (most-loaded expert over the mean)";
  return out;
}

}  // namespace

std::string RenderAssumptions(const Model& m, const AssumptionsContext& c) {
  const bool import = c.verb == AssumptionsFor::kImport, search = c.verb == AssumptionsFor::kSearch;
  const Hardware& h = m.hardware;
  const Parallel& p = m.parallel;
  const Train& t = m.train;
  std::vector<Row> rows;
  if (import) {
    if (auto layers = ExpandModel(m)) {
      const ModelTotals totals = CountParameters(m, *layers);
      rows.push_back({"parameters", Count(totals.params) + " total, " + Count(totals.params_active) + " active per token",
                      "(the config)"});
    }
  }
  rows.push_back({"hardware",
                  h.preset + (h.launch_s > 0 ? " (calibrated)" : " preset") + ": " + FormatBytes(h.device_memory) +
                      " per GPU, " + FormatFixed(h.bf16_flops / 1e12, 0) + " TFLOP/s bf16, " + Str(h.gpus_per_node) +
                      " GPUs per node",
                  Change(c, "--hardware", "", "hardware.preset")});
  rows.push_back({"budget", BudgetValue(m, c), Change(c, "", "--budget", "budget")});
  const Target& target = GetTarget(m.target.kind);
  const int64_t headroom = m.headroom_given ? m.headroom : target.DefaultHeadroom(m);
  rows.push_back({"target",
                  m.target.kind == TargetKind::kMemplan
                      ? "memplan's runtime (exact arena), headroom " + FormatBytes(headroom)
                      : std::string(TargetName(m.target.kind)) + " with PyTorch's caching allocator, headroom " +
                            FormatBytes(headroom),
                  Change(c, "", "--target, --headroom", "target, headroom")});
  rows.push_back({"dtypes",
                  "activations " + std::string(DTypeName(t.act_dtype)) + ", parameters " +
                      std::string(DTypeName(t.param_dtype)) + ", gradients " + std::string(DTypeName(t.grad_dtype)),
                  "train.act_dtype, train.param_dtype, train.grad_dtype"});
  const std::string optimizer = t.optimizer == Optimizer::kAdam ? "Adam" : "Muon";
  const std::string zero = p.zero == 0 ? "no ZeRO (replicated optimizer)"
                           : p.zero == 1 ? "ZeRO-1 (distributed optimizer)"
                           : p.zero == 2 ? "ZeRO-2"
                                         : "ZeRO-3 (FSDP)";
  rows.push_back({"optimizer", optimizer + ", " + zero + (search ? "" : " over dp " + Str(p.dp)),
                  Change(c, "--optimizer, --zero", search ? "--space zero=..." : "", "train.optimizer, parallel.zero")});
  if (search) {
    rows.push_back({"layout", "searched; micro-batch and microbatches from the global batch, seq " + Str(t.seq_len),
                    "--space, --global-batch"});
    rows.push_back({"sequence parallel", "follows tp (on whenever tp > 1)", "--space sp=0 | sp=1 | sp=0,1"});
  } else {
    rows.push_back({"layout",
                    "tp " + Str(p.tp) + ", pp " + Str(p.pp) + " x vp " + Str(p.vp) + ", cp " + Str(p.cp) + ", ep " +
                        Str(p.ep) + ", dp " + Str(p.dp) + "; micro-batch " + Str(t.micro_batch) + " x " +
                        Str(t.microbatches) + " microbatches of " + Str(t.seq_len) + " tokens",
                    Change(c, "--tp --pp --vp --cp --ep, --micro-batch, --global-batch", "", "parallel, train")});
    rows.push_back({"sequence parallel", p.sp ? "on" : p.tp > 1 ? "off (tp > 1: memplan search turns it on)" : "off (tp 1)",
                    Change(c, "--sp", "", "parallel.sp")});
  }
  rows.push_back({"attention", AttentionValue(m.arch), "arch.attention, arch.mla"});
  if (m.arch.moe) rows.push_back({"MoE", MoeValue(*m.arch.moe, p.ep), "arch.moe.imbalance, arch.moe.capacity_factor"});
  std::string storage = StorageKindsText(m.storage);
  if (m.storage.fp8) storage += " (fp8 changes numerics)";
  if (!m.target.settings && m.target.kind != TargetKind::kMemplan) storage += "; as Megatron's settings allow";
  rows.push_back({"storage", storage, Change(c, "", "--storage", "storage")});
  const bool any_offload = m.storage.offload_host;
  rows.push_back({"host memory",
                  FormatBytes(h.host_memory) + " pinned per GPU (" + FormatBytes(h.host_memory * h.gpus_per_node) +
                      " per node of " + Str(h.gpus_per_node) + ")" + (any_offload ? "" : "; unused: no host offload"),
                  Change(c, "", "--host-memory", "hardware.host_memory")});

  Table table({"assumed", "value", "change with"});
  for (auto& r : rows) table.AddRow({r.what, r.value, r.change});
  return "assumptions (-q hides this):\n" + table.Render();
}

}  // namespace memplan::planner
