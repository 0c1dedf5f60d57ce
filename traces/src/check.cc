#include "memplan/traces/check.h"

#include "memplan/common/schema.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <set>

#include "memplan/common/table.h"
#include "memplan/common/units.h"

namespace memplan::traces {
namespace {

constexpr int64_t kMaxBytes = INT64_MAX;

// Largest integer byte count within `tolerance` of `bytes`: floor(bytes * (1 + tol)).
// long double keeps tolerance 0 exact for every int64.
int64_t Limit(int64_t bytes, double tolerance) {
  long double extra = std::floor(static_cast<long double>(bytes) * static_cast<long double>(tolerance));
  if (extra >= static_cast<long double>(kMaxBytes - bytes)) return kMaxBytes;
  return bytes + static_cast<int64_t>(extra);
}

// `value - reference` (INT64_MIN when it does not fit) and whether it lies
// within `tolerance` of `reference`, above or below.
struct Deviation {
  int64_t diff = 0;
  bool within = false;
};
Deviation Deviate(int64_t value, int64_t reference, double tolerance) {
  int64_t diff = 0;
  if (__builtin_sub_overflow(value, reference, &diff)) return {INT64_MIN, false};
  return {diff, std::abs(diff) <= Limit(reference, tolerance) - reference};
}

std::string Signed(int64_t v) { return (v > 0 ? "+" : "") + std::to_string(v); }

std::string RankList(const std::set<int64_t>& ranks) {
  std::string out;
  for (int64_t r : ranks) out += (out.empty() ? "" : ", ") + std::to_string(r);
  return "{" + out + "}";
}

// A framework's job profiled against its plan (docs/targets.md): each
// device is a global rank in Megatron's order (tp fastest, then cp, dp,
// pp), or with one device per pipeline stage, stage i. What CUPTI sees is
// the allocator's segments and NCCL's buffers: the plan's reserved bytes
// plus its NCCL items, within the tolerance either way.
Expected<CheckResult> CheckFrameworkProfile(const PlanBounds& plan, const Measured& measured, const CheckOptions& options) {
  CheckResult result;
  result.allocator = "pytorch";
  result.source = measured.source;
  result.tolerance = options.tolerance.value_or(kFrameworkTolerance);
  if (!std::isfinite(result.tolerance) || result.tolerance < 0 || result.tolerance > 1) {
    return Error{ErrorCode::kBadInput,
                 "--tolerance: expected a fraction in [0, 1], got " + FormatFixed(result.tolerance, 4)};
  }
  const size_t stages = plan.ranks.size();
  const size_t world = stages * static_cast<size_t>(plan.dp * plan.cp * plan.tp);
  const size_t devices = measured.ranks.size();
  if (devices != world && devices != stages) {
    return Error{ErrorCode::kBadInput, options.measured_file + ": /ranks: " + std::to_string(devices) +
                                           " devices profiled, but " + options.plan_file + " has " +
                                           std::to_string(stages) + " pipeline stages of " +
                                           std::to_string(world / stages) + " GPUs (" + std::to_string(world) +
                                           " in all): profile every GPU of the job, or one per stage"};
  }
  result.pass = true;
  for (size_t d = 0; d < devices; ++d) {
    const PlanRankBounds& p = plan.ranks[devices == world ? d / (world / stages) : d];
    const MeasuredRank& m = measured.ranks[d];
    const int64_t predicted = p.reserved + p.nccl;
    RankCheck c{p.pp_rank, std::nullopt, predicted, m.peak, p.lower_bound, m.allocated_peak, std::nullopt, true, "",
                std::nullopt, std::nullopt, std::nullopt};
    c.device = m.pp_rank;
    const Deviation dev = Deviate(m.peak, predicted, result.tolerance);
    c.pass = dev.within;
    c.verdict = c.pass ? "pass" : "FAIL: measured " + Signed(dev.diff) + " B off reserved + NCCL";
    result.pass = result.pass && c.pass;
    result.ranks.push_back(std::move(c));
  }
  return result;
}

}  // namespace

Expected<PlanBounds> ParsePlanBounds(const Json& json, const std::string& file) {
  return CatchErrors([&] {
    // Deliberately no Finish(): the plan has many keys this reader skips.
    ObjectReader r(json, JsonLocation{file, ""});
    std::string schema = r.String("schema");
    if (schema != "memplan.plan/1") ThrowAt(r.At("schema"), "expected \"memplan.plan/1\", got " + Brief(schema));
    PlanBounds plan;
    plan.digest = r.String("digest");
    const Json& ranks = ExpectArray(r.Required("ranks"), r.At("ranks"));
    if (ranks.empty()) ThrowAt(r.At("ranks"), "expected at least one rank");
    std::set<int64_t> seen;
    for (size_t i = 0; i < ranks.size(); ++i) {
      ObjectReader rr(ranks[i], r.At("ranks").Child(i));
      PlanRankBounds b{rr.Int("pp_rank", 0, 1 << 20), rr.Int("peak", 0, kMaxBytes),
                       rr.Int("lower_bound", 0, kMaxBytes)};
      if (!seen.insert(b.pp_rank).second) {
        ThrowAt(rr.At("pp_rank"), "pp_rank " + std::to_string(b.pp_rank) + " appears twice");
      }
      if (ranks[i].contains("reserved")) b.reserved = rr.Int("reserved", 0, kMaxBytes);
      if (ranks[i].contains("static") && ranks[i]["static"].is_object() && ranks[i]["static"].contains("runtime_detail") &&
          ranks[i]["static"]["runtime_detail"].is_object()) {
        for (const auto& [name, bytes] : ranks[i]["static"]["runtime_detail"].items()) {
          if (name.rfind("nccl_", 0) == 0 && bytes.is_number_integer()) b.nccl += bytes.get<int64_t>();
        }
      }
      plan.ranks.push_back(b);
      if (i == 0 && ranks[i].contains("static") && ranks[i]["static"].is_object()) {
        const Json& st = ranks[i]["static"];
        if (st.contains("runtime_detail") && st["runtime_detail"].is_object() &&
            st["runtime_detail"].contains("cuda_context") && st["runtime_detail"]["cuda_context"].is_number_integer()) {
          plan.cuda_context = st["runtime_detail"]["cuda_context"].get<int64_t>();
        }
      }
    }
    if (const Json* o = json.contains("overhead") ? &json["overhead"] : nullptr) {
      if (o->is_object() && o->contains("emulated_s") && (*o)["emulated_s"].is_number()) {
        plan.emulated_s = (*o)["emulated_s"].get<double>();
      }
    }
    if (json.contains("target") && json["target"].is_string()) plan.target = json["target"].get<std::string>();
    // The data-parallel grid; the schema below checks the model whole.
    if (const Json* m = json.contains("model") ? &json["model"] : nullptr; m && m->is_object() && m->contains("parallel")) {
      const Json& par = (*m)["parallel"];
      for (auto [key, out] : {std::pair{"dp", &plan.dp}, std::pair{"ep", &plan.ep}, std::pair{"tp", &plan.tp}, std::pair{"cp", &plan.cp}}) {
        if (!par.is_object() || !par.contains(key)) continue;
        const JsonLocation at = JsonLocation{file, "/model/parallel"}.Child(key);
        *out = ExpectInt(par[key], at, 1, 1 << 20);
      }
    }
    // The rest of the plan is not read here, but a plan is checked whole.
    if (auto valid = ValidateSchema(json, SchemaKind::kPlan, file); !valid.ok()) throw ErrorException(valid.error());
    return plan;
  });
}

Expected<CheckResult> Check(const PlanBounds& plan, const Measured& measured, const CheckOptions& options) {
  CheckResult result;
  result.allocator = AllocatorOf(measured);
  // A pool's reservation (pool, and eager on cuda) comes in the driver's
  // granules; arenas and the host's system allocator are exact.
  const bool pooled = result.allocator == "pool" || (result.allocator == "eager" && measured.backend == "cuda");
  result.tolerance = options.tolerance.value_or(pooled ? kCudaTolerance : kHostTolerance);
  result.source = measured.source;
  if (!std::isfinite(result.tolerance) || result.tolerance < 0 || result.tolerance > 1) {
    return Error{ErrorCode::kBadInput,
                 "--tolerance: expected a fraction in [0, 1], got " + FormatFixed(result.tolerance, 4)};
  }
  // A cuda run asked for CUPTI and did not get it: its measurement lacks
  // the witness it was meant to have (pass --no-cupti to measure without).
  result.cupti_missing = measured.backend == "cuda" && measured.cupti_status == "unavailable";
  const bool profile = measured.source == "cupti-injection";
  if (profile != options.ranks_from_devices) {
    return Error{ErrorCode::kBadInput,
                 profile ? options.measured_file + ": /source: a profile of another program has one entry per device: "
                                                   "compare it with --ranks-from devices"
                         : "--ranks-from devices: " + options.measured_file +
                               " is a memplan run measurement (source runtime): its entries are ranks already"};
  }
  if (plan.target != "memplan") {
    if (!profile) {
      return Error{ErrorCode::kBadInput, options.plan_file + ": /target: a plan for " + plan.target + " is checked "
                                             "against a profile of the job (memplan profile -- CMD), not a memplan run"};
    }
    return CheckFrameworkProfile(plan, measured, options);
  }
  if (profile) {
    // Devices in order stand for the plan's ranks in order.
    if (measured.ranks.size() != plan.ranks.size()) {
      return Error{ErrorCode::kBadInput, options.measured_file + ": /ranks: " + std::to_string(measured.ranks.size()) +
                                             " devices profiled, but " + options.plan_file + " has " +
                                             std::to_string(plan.ranks.size()) + " ranks"};
    }
    Measured mapped = measured;
    std::vector<int64_t> devices;
    for (size_t i = 0; i < mapped.ranks.size(); ++i) {
      devices.push_back(mapped.ranks[i].pp_rank);
      mapped.ranks[i].pp_rank = plan.ranks[i].pp_rank;
    }
    mapped.plan_digest = plan.digest;
    mapped.source = "runtime";
    CheckOptions o = options;
    o.ranks_from_devices = false;
    auto result = Check(plan, mapped, o);
    if (!result) return result.error();
    result->source = "cupti-injection";
    for (size_t i = 0; i < result->ranks.size(); ++i) result->ranks[i].device = devices[i];
    return result;
  }
  if (measured.plan_digest != plan.digest) {
    return Error{ErrorCode::kDigestMismatch, options.measured_file + ": /plan_digest: measured for plan " +
                                                 measured.plan_digest + ", but " + options.plan_file +
                                                 ": /digest is " + plan.digest + " (a different model)"};
  }
  // Every data-parallel replica of a pipeline rank against that rank.
  std::multimap<int64_t, const MeasuredRank*> by_rank;
  std::set<int64_t> measured_ranks, plan_ranks;
  bool replicas = false, tensor_ranks = false, context_ranks = false;
  for (const auto& r : measured.ranks) {
    by_rank.emplace(r.pp_rank, &r);
    measured_ranks.insert(r.pp_rank);
    replicas = replicas || r.dp_rank > 0;
    tensor_ranks = tensor_ranks || r.tp_rank > 0;
    context_ranks = context_ranks || r.cp_rank > 0;
  }
  for (const auto& r : plan.ranks) plan_ranks.insert(r.pp_rank);
  if (measured_ranks != plan_ranks) {
    return Error{ErrorCode::kBadInput, options.measured_file + ": /ranks: pp ranks " + RankList(measured_ranks) +
                                           " differ from " + options.plan_file + ": /ranks " + RankList(plan_ranks)};
  }
  // The whole grid, each rank once: every pipeline rank has the plan's dp
  // replicas 0..dp-1, each with its tp ranks 0..tp-1 (unique per pipeline
  // rank: LoadMeasured), and each replica sits at dp_rank % ep in its
  // expert-parallel group.
  std::set<int64_t> grid;
  for (int64_t d = 0; d < plan.dp * plan.cp * plan.tp; ++d) grid.insert(d);
  for (int64_t pp : plan_ranks) {
    std::set<int64_t> replicas_here;
    for (auto [it, end] = by_rank.equal_range(pp); it != end; ++it) {
      replicas_here.insert((it->second->dp_rank * plan.cp + it->second->cp_rank) * plan.tp + it->second->tp_rank);
    }
    if (replicas_here != grid && plan.tp * plan.cp == 1) {
      return Error{ErrorCode::kBadInput, options.measured_file + ": /ranks: pp rank " + std::to_string(pp) +
                                             " has data-parallel replicas " + RankList(replicas_here) + ", but " +
                                             options.plan_file + ": /model/parallel/dp " + std::to_string(plan.dp) +
                                             " makes them " + RankList(grid)};
    }
    if (replicas_here != grid) {
      return Error{ErrorCode::kBadInput, options.measured_file + ": /ranks: pp rank " + std::to_string(pp) +
                                             " has data-, context- and tensor-parallel ranks ((dp_rank * cp + cp_rank) * "
                                             "tp + tp_rank) " + RankList(replicas_here) + ", but " + options.plan_file +
                                             ": /model/parallel dp " + std::to_string(plan.dp) + " x cp " +
                                             std::to_string(plan.cp) + " x tp " + std::to_string(plan.tp) +
                                             " makes them " + RankList(grid)};
    }
  }
  for (size_t i = 0; i < measured.ranks.size(); ++i) {
    const MeasuredRank& m = measured.ranks[i];
    const int64_t grid_index = (m.dp_rank * plan.cp + m.cp_rank) * plan.tp + m.tp_rank;  // the expert grid: EP fastest
    if (m.ep_rank != grid_index % plan.ep) {
      return Error{ErrorCode::kBadInput, options.measured_file + ": /ranks/" + std::to_string(i) + "/ep_rank: " +
                                             std::to_string(m.ep_rank) + ", but " + options.plan_file +
                                             ": /model/parallel/ep " + std::to_string(plan.ep) + " puts dp_rank " +
                                             std::to_string(m.dp_rank) +
                                             (plan.tp * plan.cp > 1 ? " (cp_rank " + std::to_string(m.cp_rank) +
                                                                          ", tp_rank " + std::to_string(m.tp_rank) + ")"
                                                                    : std::string()) +
                                             " at " + std::to_string(grid_index % plan.ep)};
    }
  }
  result.pass = true;
  if (plan.emulated_s > 0 && measured.compute_s > 0) {
    result.time = TimeCheck{plan.emulated_s, measured.compute_s,
                            (measured.compute_s - plan.emulated_s) / plan.emulated_s};
  }
  for (const auto& p : plan.ranks) {
    for (auto [it, end] = by_rank.equal_range(p.pp_rank); it != end; ++it) {
    const MeasuredRank& m = *it->second;
    RankCheck c{p.pp_rank, std::nullopt, p.peak, m.peak, p.lower_bound, m.allocated_peak, std::nullopt, true, "", std::nullopt, std::nullopt, std::nullopt};
    if (replicas) c.dp_rank = m.dp_rank;
    if (tensor_ranks) c.tp_rank = m.tp_rank;
    if (context_ranks) c.cp_rank = m.cp_rank;
    std::vector<std::string> why;
    // Eager: the allocated bytes are compared step by step with the plan's
    // program (timeline_compare.h), where moved copies are accounted for.
    const bool eager = result.allocator == "eager";
    if (!eager && m.allocated_peak < p.lower_bound) {
      why.push_back("allocated " + std::to_string(p.lower_bound - m.allocated_peak) + " B below lower bound");
    }
    if (int64_t limit = Limit(p.lower_bound, result.tolerance); !eager && m.allocated_peak > limit) {
      why.push_back("allocated " + std::to_string(m.allocated_peak - limit) + " B over");
    }
    // On the host the system allocator places nothing: an eager run's peak
    // is its allocated bytes, compared step by step, copy timing apart.
    const bool host_eager = eager && measured.backend == "host";
    if (int64_t limit = Limit(p.peak, result.tolerance); !host_eager && m.peak > limit) {
      why.push_back("peak " + std::to_string(m.peak - limit) + " B over");
    }
    if (m.cupti) {
      // Arena: the rank's device allocations are its arenas. Pool: what
      // the driver reserved, against the pools' own reserved marks when
      // given (the statics' pool is rounded by the driver too).
      c.cupti_bytes = result.allocator == "arena" ? m.cupti->allocated_peak : m.cupti->reserved_peak;
      const int64_t reference = result.allocator == "pool" && m.pool ? m.pool->reserved_peak : m.peak;
      if (Deviation d = Deviate(*c.cupti_bytes, reference, result.tolerance); !d.within) {
        why.push_back("CUPTI " + Signed(d.diff) + " B off the " + result.allocator);
      }
    }
    c.pass = why.empty();
    for (const auto& w : why) c.verdict += (c.verdict.empty() ? "FAIL: " : "; ") + w;
    if (c.pass) c.verdict = host_eager ? "pass (its bytes are compared step by step)" : "pass";
    result.pass = result.pass && c.pass;
    result.ranks.push_back(std::move(c));
   }
  }
  if (measured.process) {
    ProcessCheck pc;
    pc.cupti_device_bytes = measured.process->device_bytes_peak;
    pc.context_bytes = measured.process->context_bytes;
    pc.profiler_bytes = measured.process->profiler_bytes;
    pc.planned_context = plan.cuda_context;
    for (const auto& r : measured.ranks) {
      if (__builtin_add_overflow(pc.expected_bytes, r.peak, &pc.expected_bytes)) pc.expected_bytes = kMaxBytes;
    }
    Deviation d = Deviate(pc.cupti_device_bytes, pc.expected_bytes, result.tolerance);
    pc.pass = d.within;
    pc.verdict = pc.pass ? "pass" : "FAIL: CUPTI saw " + Signed(d.diff) + " B beside the ranks' planned memory";
    result.pass = result.pass && pc.pass;
    result.process = pc;
  }
  if (result.cupti_missing) result.pass = false;
  return result;
}

std::string RenderCheckTable(const CheckResult& result, bool failures_only) {
  int64_t max_bytes = 0;
  for (const auto& r : result.ranks) max_bytes = std::max({max_bytes, r.predicted_peak, r.measured_peak});
  const bool mib = max_bytes < kGiB;
  const std::string u = mib ? "(MiB)" : "(GiB)";
  auto cell = [&](int64_t bytes) {
    return FormatFixed(static_cast<double>(bytes) / static_cast<double>(mib ? kMiB : kGiB), 2);
  };
  bool cupti = false;
  for (const auto& r : result.ranks) cupti = cupti || r.cupti_bytes.has_value();
  bool devices = false;
  for (const auto& r : result.ranks) devices = devices || r.device.has_value();
  bool replicas = false;
  for (const auto& r : result.ranks) replicas = replicas || r.dp_rank.has_value();
  bool tensor_ranks = false, context_ranks = false;
  for (const auto& r : result.ranks) tensor_ranks = tensor_ranks || r.tp_rank.has_value();
  for (const auto& r : result.ranks) context_ranks = context_ranks || r.cp_rank.has_value();
  std::vector<std::string> header{"pp_rank"};
  if (replicas) header.push_back("dp_rank");
  if (context_ranks) header.push_back("cp_rank");
  if (tensor_ranks) header.push_back("tp_rank");
  if (devices) header.push_back("device");
  for (const char* h : {"peak", "measured", "lower_bd", "allocated"}) header.push_back(h + u);
  if (cupti) header.push_back("cupti" + u);
  header.push_back("verdict");
  Table t(header);
  for (const auto& r : result.ranks) {
    if (failures_only && r.pass) continue;
    std::vector<std::string> row{std::to_string(r.pp_rank)};
    if (replicas) row.push_back(r.dp_rank ? std::to_string(*r.dp_rank) : "-");
    if (context_ranks) row.push_back(r.cp_rank ? std::to_string(*r.cp_rank) : "-");
    if (tensor_ranks) row.push_back(r.tp_rank ? std::to_string(*r.tp_rank) : "-");
    if (devices) row.push_back(r.device ? std::to_string(*r.device) : "-");
    for (int64_t b : {r.predicted_peak, r.measured_peak, r.lower_bound, r.allocated_peak}) row.push_back(cell(b));
    if (cupti) row.push_back(r.cupti_bytes ? cell(*r.cupti_bytes) : "-");
    row.push_back(r.verdict);
    t.AddRow(row);
  }
  std::string out = t.Render();
  if (result.process && !(failures_only && result.process->pass)) {
    const auto& pc = *result.process;
    out += "process: CUPTI " + cell(pc.cupti_device_bytes) + u.substr(1, 3) + " against the ranks' " +
           cell(pc.expected_bytes) + u.substr(1, 3) + " (context " + cell(pc.context_bytes) + u.substr(1, 3) +
           " and profiler " + cell(pc.profiler_bytes) + u.substr(1, 3) + " reported, not counted): " + pc.verdict +
           "\n";
    if (pc.planned_context > 0) {
      // Outside the framework (docs/accounting.md section 9b): the plan's
      // estimate against what the device held before the first allocation.
      const double diff = 100.0 * static_cast<double>(pc.context_bytes - pc.planned_context) /
                          static_cast<double>(pc.planned_context);
      char line[240];
      std::snprintf(line, sizeof line,
                    "outside the framework: CUDA context measured %.1f MiB, planned %.1f MiB (%+.1f %%; informational: "
                    "memplan calibrate --backend cuda measures it into hardware.runtime)\n",
                    static_cast<double>(pc.context_bytes) / (1 << 20), static_cast<double>(pc.planned_context) / (1 << 20),
                    diff);
      out += line;
    }
  }
  if (result.cupti_missing) {
    out += "FAIL: CUPTI did not start or dropped records during this cuda run: no witness of its device bytes "
           "(rerun it, or run with --no-cupti to measure without CUPTI)\n";
  }
  if (result.time && !failures_only) {
    const TimeCheck& tc = *result.time;
    char line[200];
    std::snprintf(line, sizeof line,
                  "time: forwards and backwards predicted %.2f ms (every rank in turn), measured %.2f ms (%+.1f %%; "
                  "informational)\n",
                  1000 * tc.predicted_s, 1000 * tc.measured_s, 100 * tc.diff);
    out += line;
  }
  return out;
}

}  // namespace memplan::traces
