// A model file's `target` (model.h TargetConfig, docs/targets.md): read,
// validated and written back.
#include "memplan/planner/model.h"
#include "model_internal.h"

namespace memplan::planner {

// `target`: "memplan" | "megatron", or an object naming it with the
// caching allocator's settings and, optionally, fixed framework settings.
void ParseTarget(const Json* value, const JsonLocation& where, Model& m) {
  if (!value) return;
  TargetConfig& t = m.target;
  auto kind_of = [&](const std::string& name, const JsonLocation& at) {
    auto k = TargetFromName(name);
    if (!k) ThrowAt(at, "expected \"memplan\" or \"megatron\", got \"" + name + "\"");
    return *k;
  };
  if (value->is_string()) {
    t.kind = kind_of(value->get<std::string>(), where);
    return;
  }
  ObjectReader r(*value, where);
  t.kind = kind_of(r.String("name"), r.At("name"));
  t.expandable_segments = r.Bool("expandable_segments", false);
  t.max_split_size_mb = r.Int("max_split_size_mb", 0, int64_t{1} << 30, 0);
  if (t.max_split_size_mb > 0 && t.max_split_size_mb < 20) {  // PyTorch's own floor (c10/core/AllocatorConfig.cpp)
    ThrowAt(r.At("max_split_size_mb"), "expected 0 (unlimited) or at least 20, as PyTorch requires, got " +
                                           std::to_string(t.max_split_size_mb));
  }
  if (const Json* sv = r.Get("settings")) {
    ObjectReader sr(*sv, r.At("settings"));
    FrameworkSettings fs;
    fs.granularity = sr.Enum("recompute_granularity", {"none", "selective", "full"}, "none");
    if (fs.granularity == "none") fs.granularity.clear();
    fs.method = sr.Enum("recompute_method", {"none", "uniform", "block"}, "none");
    if (fs.method == "none") fs.method.clear();
    fs.num_layers = sr.Int("recompute_num_layers", 0, kMaxLayers, 0);
    if (const Json* v = sr.Get("recompute_modules")) fs.recompute_modules = ExpectStrings(*v, sr.At("recompute_modules"));
    if (const Json* v = sr.Get("offload_modules")) fs.offload_modules = ExpectStrings(*v, sr.At("offload_modules"));
    sr.Finish();
    if (fs.granularity == "full" && (fs.method.empty() || fs.num_layers < 1)) {
      ThrowAt(r.At("settings"), "expected recompute_method and recompute_num_layers >= 1 with full recompute");
    }
    if (fs.granularity == "selective" && fs.recompute_modules.empty()) {
      ThrowAt(r.At("settings").Child("recompute_modules"), "expected at least one module with selective recompute");
    }
    if (fs.granularity != "selective" && !fs.recompute_modules.empty()) {
      ThrowAt(r.At("settings").Child("recompute_modules"), "expected recompute_granularity selective with modules");
    }
    t.settings = std::move(fs);
  }
  r.Finish();
  if (t.kind == TargetKind::kMemplan && (t.settings || t.expandable_segments || t.max_split_size_mb)) {
    ThrowAt(where, "expected no allocator or framework settings under target memplan (its arena is exact)");
  }
}

std::string_view TargetName(TargetKind kind) {
  switch (kind) {
    case TargetKind::kMemplan:
      return "memplan";
    case TargetKind::kMegatron:
      return "megatron";
  }
  return "memplan";
}

std::optional<TargetKind> TargetFromName(std::string_view name) {
  if (name == "memplan") return TargetKind::kMemplan;
  if (name == "megatron") return TargetKind::kMegatron;
  return std::nullopt;
}

Json SettingsJson(const FrameworkSettings& s) {
  Json j{{"recompute_granularity", s.granularity.empty() ? "none" : s.granularity},
         {"recompute_modules", s.recompute_modules},
         {"offload_modules", s.offload_modules}};
  if (s.granularity == "full") {
    j["recompute_method"] = s.method;
    j["recompute_num_layers"] = s.num_layers;
  }
  return j;
}

Json TargetJson(const TargetConfig& t) {
  Json j{{"name", TargetName(t.kind)},
         {"expandable_segments", t.expandable_segments},
         {"max_split_size_mb", t.max_split_size_mb}};
  if (t.settings) j["settings"] = SettingsJson(*t.settings);
  return j;
}

}  // namespace memplan::planner
