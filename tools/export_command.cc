// `memplan export megatron|torchtitan PLAN.json` (planner/framework.h,
// docs/export.md): the plan's decisions as the framework's settings, the
// plan re-made under exactly those settings, and what the approximation
// costs per rank.
#include <cstdio>
#include <string>

#include "command_util.h"
#include "memplan/common/table.h"
#include "memplan/planner/framework.h"
#include "memplan/planner/model.h"
#include "memplan/planner/plan.h"
#include "memplan/planner/replay.h"

namespace memplan::cli {

namespace {

// Export re-plans the embedded model and exports that plan's decisions, so
// the file must be what this planner makes of its model: a decision or a
// peak edited by hand (or written by another memplan) is refused, as `run`
// refuses it (docs/export.md).
Expected<std::monostate> SameAsReplan(const Json& doc, const planner::Model& model, const std::string& file) {
  auto plan = planner::BuildPlan(model);
  if (!plan) return plan.error();
  const Json mine = Json::parse(planner::PlanToJson(*plan).dump());
  const std::string why = ": export re-plans the embedded model and exports that plan's decisions, so it refuses a "
                          "plan edited by hand or made by another memplan (re-plan it: memplan plan MODEL -o PLAN.json)";
  const Json* tensors = doc.contains("tensors") ? &doc["tensors"] : nullptr;
  if (tensors == nullptr || !tensors->is_array() || tensors->size() != mine["tensors"].size()) {
    return Error{ErrorCode::kBadInput, file + ": /tensors: " + std::to_string(mine["tensors"].size()) +
                                           " saved tensors expected" + why};
  }
  for (size_t i = 0; i < tensors->size(); ++i) {
    const Json& t = (*tensors)[i];
    const Json& m = mine["tensors"][i];
    for (const char* key : {"name", "effective"}) {
      if (!t.is_object() || !t.contains(key) || t[key] != m[key]) {
        return Error{ErrorCode::kBadInput, file + ": /tensors/" + std::to_string(i) + "/" + key + ": " +
                                               (t.is_object() && t.contains(key) ? t[key].dump() : "missing") +
                                               ", this planner's " + m[key].dump() + why};
      }
    }
  }
  const Json* ranks = doc.contains("ranks") ? &doc["ranks"] : nullptr;
  for (size_t r = 0; r < mine["ranks"].size(); ++r) {
    for (const char* key : {"peak", "lower_bound"}) {
      const Json& m = mine["ranks"][r][key];
      if (ranks == nullptr || !ranks->is_array() || r >= ranks->size() || !(*ranks)[r].is_object() ||
          !(*ranks)[r].contains(key) || (*ranks)[r][key] != m) {
        return Error{ErrorCode::kBadInput, file + ": /ranks/" + std::to_string(r) + "/" + key + ": differs from this "
                                               "planner's " + m.dump() + why};
      }
    }
  }
  return std::monostate{};
}

}  // namespace

int RunExport(const Command& c) {
  if (auto ok = CheckOutputs({c.output}, c.input); !ok) return Fail(ok.error());
  auto doc = ReadJsonFile(c.input);
  if (!doc) return Fail(doc.error());
  // The embedded model, read as `run` reads it (schema, digest).
  auto model = planner::ReadPlanModel(*doc, c.input);
  if (!model) return Fail(model.error());
  if (auto same = SameAsReplan(*doc, *model, c.input); !same) return Fail(same.error());
  if (c.import_kind == "megatron") {
    // What Megatron's plan keeps free (the plan's own target is the one
    // compared; the settings are chosen for Megatron).
    Command for_megatron = c;
    for_megatron.target.clear();
    if (auto ok = ApplyModelOptions(for_megatron, &*model); !ok) return Fail(ok.error());
  }
  auto plan = planner::BuildPlan(*model);
  if (!plan) return Fail(plan.error());
  auto progress = [](const std::string& line) { std::fprintf(stderr, "memplan: %s\n", line.c_str()); };
  auto exported = c.import_kind == "megatron"
                      ? planner::ExportMegatron(*plan, c.quiet ? std::function<void(const std::string&)>() : progress)
                      : planner::ExportTorchtitan(*plan);
  if (!exported) return Fail(exported.error());
  const planner::Plan* coarse = &exported->coarse_plan;

  if (c.output.empty()) {
    std::fputs(exported->text.c_str(), stdout);
  } else {
    OutputFiles out;
    if (auto st = out.Stage(c.output, exported->text); !st) return Fail(st.error());
    if (auto st = out.Commit(); !st) return Fail(st.error());
  }
  if (c.quiet) return 0;
  // The comparison goes where the settings do not.
  FILE* to = c.output.empty() ? stderr : stdout;
  const double gib = 1.0 / (1 << 30);
  auto cell = [&](int64_t b) { return FormatFixed(static_cast<double>(b) * gib, 2); };
  const bool megatron = c.import_kind == "megatron";
  std::vector<std::string> head = {"pp_rank", "plan_peak(GiB)"};
  if (megatron) {
    // Megatron's plan: what PyTorch's allocator allocates and reserves, what
    // lies outside it, and what is left (docs/targets.md).
    for (const char* h : {"megatron_allocated(GiB)", "megatron_reserved(GiB)", "runtime(GiB)", "margin(GiB)"}) head.push_back(h);
  } else {
    for (const char* h : {"exported_peak(GiB)", "difference(GiB)"}) head.push_back(h);
  }
  for (const char* h : {"budget(GiB)", "fits"}) head.push_back(h);
  Table t(head);
  bool all_fit = true;
  for (size_t r = 0; r < plan->ranks.size() && r < coarse->ranks.size(); ++r) {
    const auto& a = plan->ranks[r];
    const auto& b = coarse->ranks[r];
    all_fit &= b.fits;
    std::vector<std::string> row = {std::to_string(a.pp_rank), cell(a.reserved)};
    if (megatron) {
      for (int64_t v : {b.allocated, b.reserved, b.statics.runtime, b.margin}) row.push_back(cell(v));
    } else {
      row.push_back(cell(b.peak));
      row.push_back(cell(b.peak - a.peak));
    }
    row.push_back(cell(b.budget));
    row.push_back(b.fits ? (b.margin < coarse->headroom ? "inside headroom" : "yes") : "NO");
    t.AddRow(std::move(row));
  }
  std::string report = t.Render();
  const double s0 = plan->overhead.step_s, s1 = coarse->overhead.step_s;
  report += "step: memplan " + FormatFixed(s0 * 1e3, 2) + " ms, exported settings " + FormatFixed(s1 * 1e3, 2) +
            " ms (" + (s1 >= s0 ? "+" : "") + FormatFixed(s0 > 0 ? 100 * (s1 - s0) / s0 : 0, 1) + " %)\n";
  report += "exported settings: " +
            planner::ThroughputLine(planner::ModelledThroughput(coarse->model, coarse->totals, s1)) + "\n";
  if (!all_fit) report += "the exported settings do NOT fit: memplan's plan needs its per-tensor choices\n";
  for (const auto& w : coarse->warnings) report += "warning: " + w + "\n";
  for (const auto& a : exported->added) report += "to fit: " + a + "\n";
  for (const auto& line : exported->not_expressed) report += "not expressed: " + line + "\n";
  if (c.import_kind == "megatron") {
    report += "round trip: memplan import megatron ARGS --gpus " + std::to_string(plan->model.parallel.Processes()) +
              " --hardware " + (plan->model.hardware.preset.empty() ? "h100" : plan->model.hardware.preset) +
              " --as-written\n";
  }
  std::fputs(report.c_str(), to);
  return 0;
}

}  // namespace memplan::cli
