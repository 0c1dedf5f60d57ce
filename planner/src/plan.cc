#include "memplan/planner/plan.h"

#include <fnmatch.h>

#include <algorithm>

#include "memplan/common/table.h"
#include "memplan/common/units.h"
#include "memplan/planner/templates.h"

namespace memplan::planner {

bool GlobMatch(const std::string& pattern, const std::string& name) {
  return ::fnmatch(pattern.c_str(), name.c_str(), 0) == 0;
}

namespace {

Plan BuildPlanOrThrow(const Model& input, const PlanOptions& options) {
  Plan plan;
  plan.model = input;
  Model& model = plan.model;
  if (options.budget) {
    model.budget = *options.budget;
    model.budget_given = true;
  }
  if (model.budget > model.hardware.device_memory) {
    plan.warnings.push_back("budget " + FormatBytes(model.budget) + " exceeds device memory " +
                            FormatBytes(model.hardware.device_memory) + " (what-if plan)");
  }
  plan.digest = ModelDigest(model);

  auto expanded = ExpandModel(model);
  if (!expanded) throw ErrorException(expanded.error());
  const std::vector<LayerGraph>& layers = *expanded;
  PipelineLayout layout = MakePipelineLayout(model);
  plan.totals = CountParameters(model, layers);

  for (int64_t r = 0; r < model.parallel.pp; ++r) {
    RankPlan rp;
    rp.pp_rank = r;
    rp.chunks = layout.chunks[static_cast<size_t>(r)];
    rp.layers = layout.LayersOfRank(r);
    rp.statics = AccountRank(model, layers, layout, r);
    rp.in_flight_chunks = InFlightPerChunk(model.parallel.pp, model.parallel.vp, r, model.train.microbatches);
    for (size_t c = 0; c < rp.chunks.size(); ++c) {
      int64_t bytes = 0;
      for (int64_t layer : rp.chunks[c]) bytes = CheckedAdd(bytes, layers[static_cast<size_t>(layer)].SavedBytes(), "activations");
      rp.chunk_activation_bytes.push_back(bytes);
      rp.activations_per_microbatch += bytes;
      rp.activations_peak = CheckedAdd(rp.activations_peak, CheckedMul(bytes, rp.in_flight_chunks[c], "activations"),
                                       "activations");
    }
    rp.lower_bound = CheckedAdd(rp.statics.total, rp.activations_peak, "peak");
    rp.peak = rp.lower_bound;
    rp.budget = model.budget;
    rp.fits = rp.peak <= rp.budget;
    plan.ranks.push_back(std::move(rp));
  }

  for (const auto& g : layers) {
    for (const auto& t : g.tensors) {
      if (!t.saved) continue;
      TensorEntry e;
      e.name = t.name;
      e.layer = g.index;
      e.module = t.module;
      e.pp_rank = layout.rank_of_layer[static_cast<size_t>(g.index)];
      e.chunk = layout.chunk_of_layer[static_cast<size_t>(g.index)];
      e.shape = t.shape;
      e.dtype = t.dtype;
      e.bytes = t.bytes;
      e.policy = {Policy::kKeep};
      for (const auto& a : model.policies) {
        if (GlobMatch(a.match, t.name)) {  // first match wins
          e.policy = a.policy;
          e.annotation = a.match;
          break;
        }
      }
      e.effective = {Policy::kKeep};  // keep-all until the solver lands
      e.device_bytes = t.bytes;
      plan.tensors.push_back(std::move(e));
    }
  }
  for (const auto& rp : plan.ranks) {
    if (rp.statics.host > model.hardware.host_memory) {
      plan.warnings.push_back("pp rank " + std::to_string(rp.pp_rank) + " needs " + FormatBytes(rp.statics.host) +
                              " of host memory; the hardware has " + FormatBytes(model.hardware.host_memory) +
                              " per GPU");
    }
  }
  // One warning for all ranks that do not fit, naming the worst.
  const RankPlan* worst = nullptr;
  int64_t over = 0;
  for (const auto& rp : plan.ranks) {
    if (rp.fits) continue;
    ++over;
    if (!worst || rp.peak > worst->peak) worst = &rp;
  }
  if (worst) {
    plan.warnings.push_back(std::to_string(over) + " of " + std::to_string(plan.ranks.size()) +
                            " pp ranks exceed the budget with every activation kept (worst: rank " +
                            std::to_string(worst->pp_rank) + " needs " + FormatBytes(worst->peak) +
                            ", budget " + FormatBytes(worst->budget) + ")");
  }
  return plan;
}

OrderedJson PolicyJson(const std::vector<Policy>& policy) {
  OrderedJson j = OrderedJson::array();
  for (Policy p : policy) j.push_back(PolicyName(p));
  return j;
}

}  // namespace

Expected<Plan> BuildPlan(const Model& model, const PlanOptions& options) {
  return CatchErrors([&] { return BuildPlanOrThrow(model, options); });
}

OrderedJson PlanToJson(const Plan& plan) {
  OrderedJson j;
  j["schema"] = kPlanSchema;
  j["name"] = plan.model.name;
  j["digest"] = plan.digest;
  j["generator"] = "memplan 0.1.0";
  j["activation_model"] = "keep_all";
  j["budget"] = plan.model.budget;
  j["totals"] = {{"params", plan.totals.params},
                 {"params_active", plan.totals.params_active},
                 {"layers", plan.model.arch.layers}};
  OrderedJson ranks = OrderedJson::array();
  for (const auto& r : plan.ranks) {
    OrderedJson rj;
    rj["pp_rank"] = r.pp_rank;
    rj["layers"] = r.layers;
    rj["chunks"] = r.chunks;
    rj["params"] = r.statics.params;
    OrderedJson detail = OrderedJson::object();
    for (const auto& [k, v] : r.statics.buffer_detail) detail[k] = v;
    rj["static"] = {{"weights", r.statics.weights},     {"grads", r.statics.grads},
                    {"optimizer", r.statics.optimizer}, {"buffers", r.statics.buffers},
                    {"total", r.statics.total},         {"buffer_detail", detail}};
    rj["host"] = r.statics.host;
    rj["activations_per_microbatch"] = r.activations_per_microbatch;
    rj["in_flight_chunks"] = r.in_flight_chunks;
    rj["activations_peak"] = r.activations_peak;
    rj["peak"] = r.peak;
    rj["lower_bound"] = r.lower_bound;
    rj["budget"] = r.budget;
    rj["fits"] = r.fits;
    rj["remote_offload"] = OrderedJson::array();
    ranks.push_back(std::move(rj));
  }
  j["ranks"] = std::move(ranks);
  OrderedJson tensors = OrderedJson::array();
  for (const auto& t : plan.tensors) {
    OrderedJson tj{{"name", t.name},
                   {"layer", t.layer},
                   {"module", t.module},
                   {"pp_rank", t.pp_rank},
                   {"chunk", t.chunk},
                   {"shape", t.shape},
                   {"dtype", DTypeName(t.dtype)},
                   {"bytes", t.bytes},
                   {"policy", PolicyJson(t.policy)},
                   {"effective", PolicyJson(t.effective)},
                   {"device_bytes", t.device_bytes}};
    if (!t.annotation.empty()) tj["annotation"] = t.annotation;
    tensors.push_back(std::move(tj));
  }
  j["tensors"] = std::move(tensors);
  if (!plan.warnings.empty()) j["warnings"] = plan.warnings;
  j["model"] = NormalizedModelJson(plan.model);
  return j;
}

std::string RenderPlanTable(const Plan& plan) {
  // GiB for real models; MiB when every peak is below 1 GiB (tiny models).
  int64_t max_peak = 0;
  for (const auto& r : plan.ranks) max_peak = std::max(max_peak, r.peak);
  const bool mib = max_peak < kGiB;
  const std::string u = mib ? "(MiB)" : "(GiB)";
  auto cell = [&](int64_t bytes) {
    return FormatFixed(static_cast<double>(bytes) / static_cast<double>(mib ? kMiB : kGiB), 2);
  };
  Table t({"pp_rank", "layers", mib ? "params(M)" : "params(B)", "weights" + u, "grads" + u, "optim" + u,
           "buffers" + u, "static" + u, "act/mb" + u, "in_flight", "activ." + u, "peak" + u, "budget" + u,
           "fits", "host" + u});
  for (const auto& r : plan.ranks) {
    int64_t in_flight = 0;
    for (int64_t n : r.in_flight_chunks) in_flight += n;
    t.AddRow({std::to_string(r.pp_rank), std::to_string(r.layers.size()),
              FormatFixed(static_cast<double>(r.statics.params) / (mib ? 1e6 : 1e9), 3), cell(r.statics.weights),
              cell(r.statics.grads), cell(r.statics.optimizer), cell(r.statics.buffers), cell(r.statics.total),
              cell(r.activations_per_microbatch), std::to_string(in_flight), cell(r.activations_peak),
              cell(r.peak), cell(r.budget), r.fits ? "yes" : "NO", cell(r.statics.host)});
  }
  std::string out = t.Render();
  auto count = [](int64_t n) {
    return n >= 1'000'000'000 ? FormatFixed(static_cast<double>(n) / 1e9, 2) + " B"
                              : FormatFixed(static_cast<double>(n) / 1e6, 2) + " M";
  };
  out += "model " + plan.model.name + ": " + count(plan.totals.params) + " params (" +
         count(plan.totals.params_active) + " active), pp " + std::to_string(plan.model.parallel.pp) + " x vp " +
         std::to_string(plan.model.parallel.vp) + ", " + std::to_string(plan.model.train.microbatches) +
         " microbatches; activations: every saved tensor kept\n";
  return out;
}

Expected<Json> ExpandedModelJson(const Model& model) {
  auto layers = ExpandModel(model);
  if (!layers) return layers.error();
  Json j = NormalizedModelJson(model);
  Json list = Json::array();
  for (const auto& g : *layers) list.push_back(Json::parse(g.ToJson().dump()));
  j["graph"] = {{"layers", list}};
  return j;
}

}  // namespace memplan::planner
