// The per-rank table `memplan plan` prints (plan.h RenderPlanTable): the
// ranks, the memory outside the framework, the target's allocator and
// settings, the MoE routing assumption, the policy summary, the step and
// the trade-off curve.
#include <algorithm>
#include <map>

#include "memplan/common/table.h"
#include "memplan/common/units.h"
#include "memplan/planner/plan.h"
#include "memplan/planner/target.h"

namespace memplan::planner {

std::string RenderPlanTable(const Plan& plan) {
  // GiB for real models; MiB when every peak is below 1 GiB (tiny models).
  int64_t max_peak = 0;
  for (const auto& r : plan.ranks) max_peak = std::max({max_peak, r.peak, r.keep_all_lower_bound});
  const bool mib = max_peak < kGiB;
  const std::string u = mib ? "(MiB)" : "(GiB)";
  auto cell = [&](int64_t bytes) {
    return FormatFixed(static_cast<double>(bytes) / static_cast<double>(mib ? kMiB : kGiB), 2);
  };
  // Memory outside the framework gets its column where there is any.
  const bool runtime = std::any_of(plan.ranks.begin(), plan.ranks.end(), [](const RankPlan& r) { return r.statics.runtime > 0; });
  std::vector<std::string> head = {"pp_rank", "layers", "static" + u, "activ." + u, "peak" + u};
  if (runtime) head.push_back("runtime" + u);
  // Another target's allocator, or a headroom: allocated, reserved and
  // what is left at the peak.
  const bool reserved = plan.model.target.kind != TargetKind::kMemplan || plan.headroom > 0;
  if (reserved) {
    for (const char* c : {"allocated", "reserved", "margin"}) head.push_back(c + u);
  }
  const std::vector<std::string> rest = {"lower_bd" + u, "any_plan" + u, "keep_all" + u, "budget" + u, "fits",
                                         "remote_out" + u, "resident", "host_peak" + u, "added(ms)"};
  head.insert(head.end(), rest.begin(), rest.end());
  Table t(head);
  for (const auto& r : plan.ranks) {
    int64_t remote = 0;
    for (const auto& [to, bytes] : r.remote_offload) remote += bytes;
    std::vector<std::string> row = {std::to_string(r.pp_rank), std::to_string(r.layers.size()), cell(r.statics.total),
                                    cell(r.activations_peak), cell(r.peak)};
    if (runtime) row.push_back(cell(r.statics.runtime));
    if (reserved) {
      for (int64_t v : {r.allocated, r.reserved, r.margin}) row.push_back(cell(v));
    }
    for (std::string c : {cell(r.lower_bound), cell(r.any_plan_lower_bound), cell(r.keep_all_lower_bound),
                          cell(r.budget), std::string(r.fits ? "yes" : "NO"), cell(remote),
                          std::to_string(r.resident_offloads.size()), cell(r.host_peak),
                          FormatFixed(1e3 * (r.recompute_s + r.quantize_s + r.exposed_transfer_s), 2)}) {
      row.push_back(std::move(c));
    }
    t.AddRow(row);
  }
  std::string out = t.Render();
  if (runtime && !plan.ranks.empty()) {
    // The items of the rank with the most (a target's groups can differ by
    // rank: accounting.h RuntimeItems, target.h).
    const StaticBreakdown* st = &plan.ranks.front().statics;
    for (const auto& r : plan.ranks) {
      if (r.statics.runtime > st->runtime) st = &r.statics;
    }
    std::string items;
    for (const auto& [name, bytes] : st->runtime_detail) items += (items.empty() ? "" : ", ") + name + " " + FormatBytes(bytes);
    out += std::string("\noutside the framework, per GPU (fits: ") + (reserved ? "reserved" : "peak") +
           " + runtime <= budget): " + items + " = " + FormatBytes(st->runtime) + " (hardware.runtime; docs/accounting.md)\n";
  }
  if (plan.model.target.kind != TargetKind::kMemplan) {
    const TargetConfig& tc = plan.model.target;
    out += "target " + std::string(TargetName(tc.kind)) + ": reserved is PyTorch's caching allocator replayed over "
           "the step (" + (tc.expandable_segments ? "expandable_segments:True" : "expandable_segments:False") +
           (tc.max_split_size_mb > 0 ? ", max_split_size_mb:" + std::to_string(tc.max_split_size_mb) : "") +
           "); headroom " + FormatBytes(plan.headroom) + " (docs/targets.md)\n";
    if (tc.settings) {
      const std::string flags = SettingsFlags(*tc.settings);
      out += "settings: " + (flags == "none" ? std::string("none (every saved tensor kept)") : flags) + " (" +
             std::to_string(plan.settings_tried.size()) + " other settings planned)\n";
    }
  } else if (plan.headroom > 0) {
    out += "headroom " + FormatBytes(plan.headroom) + " kept free under the budget (--headroom)\n";
  }

  if (const auto& moe = plan.model.arch.moe) {
    const double f = moe->RoutedRowsFactor(plan.model.parallel.ep);
    out += moe->capacity_factor
               ? "moe routing: tokens dropped past capacity_factor " + FormatFixed(f, 2) +
                     "; routed buffers hold " + FormatFixed(f, 2) + "x each EP rank's mean share\n"
               : "moe routing: dropless, assumed skew imbalance " + FormatFixed(moe->imbalance, 2) +
                     " (most-loaded expert over the mean); routed buffers hold " + FormatFixed(f, 2) +
                     "x each EP rank's mean share (docs/accounting.md section 8b)\n";
  }

  // Policy summary: what the plan does with the saved tensors.
  struct Row {
    int64_t tensors = 0, bytes = 0, device = 0;
  };
  std::map<std::string, Row> rows;
  for (const auto& e : plan.tensors) {
    std::string name;
    for (Policy p : e.effective) name += (name.empty() ? "" : "+") + std::string(PolicyName(p));
    Row& r = rows[name];
    ++r.tensors;
    r.bytes += e.bytes;
    r.device += e.device_bytes;
  }
  Table pol({"policy", "tensors", "bytes/mb" + u, "device/mb" + u});
  for (const auto& [name, r] : rows) {
    pol.AddRow({name, std::to_string(r.tensors), cell(r.bytes), cell(r.device)});
  }
  out += "\n" + pol.Render();
  auto count = [](int64_t n) {
    return n >= 1'000'000'000 ? FormatFixed(static_cast<double>(n) / 1e9, 2) + " B"
                              : FormatFixed(static_cast<double>(n) / 1e6, 2) + " M";
  };
  const Overhead& o = plan.overhead;
  out += "\nmodel " + plan.model.name + ": " + count(plan.totals.params) + " params (" +
         count(plan.totals.params_active) + " active), pp " + std::to_string(plan.model.parallel.pp) + " x vp " +
         std::to_string(plan.model.parallel.vp) + ", " + std::to_string(plan.model.train.microbatches) +
         " microbatches\n";
  out += "step " + FormatFixed(o.step_s * 1e3, 2) + " ms (base " + FormatFixed(o.base_step_s * 1e3, 2) +
         " ms; critical rank adds recompute " + FormatFixed(o.recompute_s * 1e3, 2) + " ms, fp8 " +
         FormatFixed(o.quantize_s * 1e3, 2) + " ms, exposed transfers " + FormatFixed(o.exposed_transfer_s * 1e3, 2) +
         " ms)\n";
  out += ThroughputLine(ModelledThroughput(plan.model, plan.totals, o.step_s)) + "\n";
  if (o.comm_s > 0 || o.dp_exposed_s > 0) {
    out += "communication: " + FormatFixed(o.comm_s * 1e3, 2) + " ms of TP/CP/EP on the busiest rank, " +
           FormatFixed(o.dp_exposed_s * 1e3, 2) + " ms of data-parallel reduction exposed (in the base step)\n";
  }
  if (o.offload_bw_share < 1) {
    const double link = std::min(plan.model.hardware.d2h_bw, plan.model.hardware.h2d_bw);
    out += "pcie: offload copies get " + FormatFixed(link * o.offload_bw_share / 1e9, 1) + " of " +
           FormatFixed(link / 1e9, 1) + " GB/s per direction; inter-node traffic (EP, DP, PP) through the same link "
           "averages " + FormatFixed(o.inter_node_bytes_per_s / 1e9, 1) + " GB/s on the busiest rank\n";
  }
  if (plan.model.parallel.pp > 1) {
    out += "pp balance: max/min lower bound " + FormatFixed(plan.rebalance.ratio_before, 2) + " -> " +
           FormatFixed(plan.rebalance.ratio_after, 2) + " (" + std::to_string(plan.rebalance.moved_tensors) +
           " tensors offloaded remotely)\n";
  }
  if (!plan.sweep.empty()) {
    Table sw({"budget" + u, "fits", "max_peak" + u, "added(ms)", "step(ms)"});
    for (const auto& pt : plan.sweep) {
      sw.AddRow({cell(pt.budget), pt.fits ? "yes" : "NO", cell(pt.max_peak), FormatFixed(pt.added_s * 1e3, 2),
                 FormatFixed(pt.step_s * 1e3, 2)});
    }
    out += "\ntrade-off (--sweep): budget vs added step time\n" + sw.Render();
  }
  return out;
}

double ModelFlopsPerToken(const Model& model, const ModelTotals& totals) {
  const Arch& a = model.arch;
  // The input embedding and position tables are lookups, not products; the
  // head's product counts (a tied head's weights, counted once in
  // params_active, are the head's: nothing to take off).
  const double embedding =
      static_cast<double>((a.tied_embeddings ? 0 : a.vocab) + a.position_embeddings) * static_cast<double>(a.hidden);
  const double n = std::max(0.0, static_cast<double>(totals.params_active) - embedding);
  double dqk = static_cast<double>(a.head_dim), dv = dqk;
  if (a.mla) {
    dqk = static_cast<double>(a.mla->qk_nope_head_dim + a.mla->qk_rope_head_dim);
    dv = static_cast<double>(a.mla->v_head_dim);
  }
  int64_t attention_layers = 0;
  for (int64_t l = 0; l < a.layers; ++l) attention_layers += !a.IsLinearAttentionLayer(l);
  return 6 * n + 6 * static_cast<double>(attention_layers) * static_cast<double>(a.heads) * (dqk + dv) *
                     static_cast<double>(model.train.seq_len);
}

Throughput ModelledThroughput(const Model& model, const ModelTotals& totals, double step_s) {
  Throughput t;
  t.flops_per_token = ModelFlopsPerToken(model, totals);
  const Parallel& p = model.parallel;
  const double tokens = static_cast<double>(model.train.micro_batch * model.train.microbatches * p.dp) *
                        static_cast<double>(model.train.seq_len);
  const double gpus = static_cast<double>(p.Processes());
  if (step_s > 0 && gpus > 0) t.tokens_per_s_per_gpu = tokens / step_s / gpus;
  if (model.hardware.bf16_flops > 0) t.mfu = t.tokens_per_s_per_gpu * t.flops_per_token / model.hardware.bf16_flops;
  t.source = model.hardware.launch_s > 0 ? "calibrated hardware" : "preset " + model.hardware.preset;
  return t;
}

std::string ThroughputLine(const Throughput& t) {
  return "modelled: " + FormatFixed(t.tokens_per_s_per_gpu, 0) + " tokens/s per GPU, MFU " +
         FormatFixed(100 * t.mfu, 1) + " % (6N + attention FLOPs per token; " + t.source +
         "'s step model, not a measurement; docs/planner.md)";
}

}  // namespace memplan::planner
