// What REPORT.html draws (report.h): the plan replayed through the planner
// (its per-step live bytes, schedule and copies, which the plan file does
// not store), the plan's own numbers, and the measurement and trace.
#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>

#include "memplan/planner/bounds.h"
#include "memplan/planner/liveness.h"
#include "memplan/planner/replay.h"
#include "memplan/planner/templates.h"
#include "memplan/traces/check.h"
#include "memplan/traces/measured.h"
#include "memplan/traces/timeline_compare.h"
#include "memplan/planner/program.h"
#include "memplan/viz/report.h"

namespace memplan::viz {
namespace {

using planner::IntervalPart;
using planner::Storage;

// Times to the nanosecond: shorter JSON, the same picture.
double Ns(double s) { return std::round(s * 1e9) / 1e9; }

// A plan tensor's effective storage, "fp8+offload_host" for compositions.
std::string EffectivePolicy(const Json& tensor) {
  std::string policy;
  for (const auto& p : tensor["effective"]) policy += (policy.empty() ? "" : "+") + p.get<std::string>();
  return policy;
}

std::string StorageName(Storage s) {
  std::string out;
  for (planner::Policy p : planner::StoragePolicies(s)) {
    out += (out.empty() ? "" : "+") + std::string(planner::PolicyName(p));
  }
  return out;
}

// [x, y] pairs reduced to at most `max` buckets of consecutive points, each
// keeping its largest y at its first x (the peak survives).
Json Downsample(const std::vector<double>& x, const std::vector<int64_t>& y, int64_t max, bool* reduced) {
  const size_t n = std::min(x.size(), y.size());
  const size_t buckets = static_cast<size_t>(std::max<int64_t>(1, max));
  Json xs = Json::array(), ys = Json::array();
  if (n <= buckets) {
    for (size_t i = 0; i < n; ++i) {
      xs.push_back(Ns(x[i]));
      ys.push_back(y[i]);
    }
    return Json{xs, ys};
  }
  *reduced = true;
  for (size_t b = 0; b < buckets; ++b) {
    const size_t lo = n * b / buckets, hi = n * (b + 1) / buckets;
    if (lo >= hi) continue;
    xs.push_back(Ns(x[lo]));
    ys.push_back(*std::max_element(y.begin() + static_cast<std::ptrdiff_t>(lo), y.begin() + static_cast<std::ptrdiff_t>(hi)));
  }
  return Json{xs, ys};
}

// The plan's ranks: static parts, bounds, activations by policy.
Json RankSummaries(const Json& plan) {
  std::map<int64_t, std::map<std::string, int64_t>> by_policy;  // rank -> policy -> device bytes per microbatch
  for (const auto& t : plan["tensors"]) {
    by_policy[t.value("pp_rank", int64_t{0})][EffectivePolicy(t)] += t.value("device_bytes", int64_t{0});
  }
  Json out = Json::array();
  const Json& any = plan.value("any_plan_lower_bound", Json::array());
  for (size_t r = 0; r < plan["ranks"].size(); ++r) {
    const Json& rk = plan["ranks"][r];
    const Json& st = rk["static"];
    const Json& added = rk.value("added_s", Json::object());
    Json policies = Json::object();
    for (const auto& [k, v] : by_policy[static_cast<int64_t>(r)]) policies[k] = v;
    out.push_back({{"pp_rank", r},
                   {"weights", st.value("weights", int64_t{0})},
                   {"grads", st.value("grads", int64_t{0})},
                   {"optimizer", st.value("optimizer", int64_t{0})},
                   {"buffers", st.value("buffers", int64_t{0})},
                   {"buffer_detail", st.value("buffer_detail", Json::object())},
                   {"static", st.value("total", int64_t{0})},
                   // Outside the framework (CUDA context, NCCL): not in `static`.
                   {"runtime", st.value("runtime", int64_t{0})},
                   {"runtime_detail", st.value("runtime_detail", Json::object())},
                   {"host", rk.value("host", int64_t{0})},
                   {"host_peak", rk.value("host_peak", rk.value("host", int64_t{0}))},
                   {"activations_peak", rk.value("activations_peak", int64_t{0})},
                   {"activations_by_policy", policies},
                   {"peak", rk.value("peak", int64_t{0})},
                   {"lower_bound", rk.value("lower_bound", int64_t{0})},
                   {"keep_all_lower_bound", rk.value("keep_all_lower_bound", int64_t{0})},
                   {"any_plan_lower_bound", r < any.size() ? any[r] : Json(0)},
                   {"budget", rk.value("budget", int64_t{0})},
                   {"fits", rk.value("fits", true)},
                   {"added_ms", 1e3 * (added.value("recompute_s", 0.0) + added.value("quantize_s", 0.0) +
                                       added.value("exposed_transfer_s", 0.0))},
                   {"remote_offload", rk.value("remote_offload", Json::array())}});
  }
  return out;
}

// Per rank: predicted live bytes through the step, the live buffers at the
// peak, the schedule's passes and the copies the plan simulated.
void Replayed(const planner::PlanningProblem& p, const planner::Assignment& a, const planner::Evaluation& eval,
              const ReportOptions& o, Json* memory, Json* schedule, bool* reduced) {
  const auto profiles = planner::Profiles(p, eval.intervals);
  const auto& hw = p.model->hardware;
  for (size_t r = 0; r < p.timelines.size(); ++r) {
    const planner::RankTimeline& tl = p.timelines[r];
    const int64_t stat = p.statics[r].total;
    std::vector<int64_t> live(profiles[r].size());
    for (size_t s = 0; s < live.size(); ++s) live[s] = stat + profiles[r][s];
    const size_t peak_step = static_cast<size_t>(std::max_element(live.begin(), live.end()) - live.begin());
    // The buffers live at the peak step, largest first.
    std::vector<std::pair<int64_t, Json>> at_peak;
    for (const planner::Interval& iv : eval.intervals) {
      if (iv.rank != static_cast<int32_t>(r) || iv.first > static_cast<int64_t>(peak_step) ||
          iv.last < static_cast<int64_t>(peak_step)) {
        continue;
      }
      const planner::Instance& in = p.instances[static_cast<size_t>(iv.owner_rank)][static_cast<size_t>(iv.instance)];
      const planner::SavedTensor& st = p.tensors[static_cast<size_t>(iv.owner_rank)][static_cast<size_t>(in.tensor)];
      static constexpr const char* kPart[] = {"full", "fp8", "moved out", "fetched", "restored", "recompute chain",
                                              "landed"};
      at_peak.push_back({iv.bytes,
                         {{"name", st.name}, {"mb", in.microbatch}, {"owner", iv.owner_rank},
                          {"policy", StorageName(a.storage[static_cast<size_t>(iv.owner_rank)][static_cast<size_t>(in.tensor)])},
                          {"part", kPart[static_cast<int>(iv.part)]}, {"bytes", iv.bytes}}});
    }
    std::stable_sort(at_peak.begin(), at_peak.end(), [](const auto& x, const auto& y) { return x.first > y.first; });
    Json peak_buffers = Json::array();
    for (size_t i = 0; i < at_peak.size() && i < 40; ++i) peak_buffers.push_back(at_peak[i].second);
    std::vector<double> t(tl.start_s.begin(), tl.start_s.end());
    memory->push_back({{"pp_rank", r},
                       {"steps", tl.steps},
                       {"static", stat},
                       {"reserved", eval.ranks[r].peak},
                       {"predicted", Downsample(t, live, o.max_points, reduced)},
                       {"peak_step", peak_step},
                       {"peak_t", peak_step < t.size() ? t[peak_step] : 0.0},
                       {"peak_bytes", live.empty() ? stat : live[peak_step]},
                       {"transient_at_peak", peak_step < tl.transient.size() ? tl.transient[peak_step] : 0},
                       {"live_at_peak", peak_buffers},
                       {"live_at_peak_count", at_peak.size()},
                       {"step_s", tl.end_s.empty() ? 0.0 : tl.end_s.back()}});
    // Passes: [kind, microbatch, chunk, start_s, end_s].
    const auto& sched = p.schedules[r];
    std::vector<double> lo(sched.size(), 1e300), hi(sched.size(), -1e300);
    for (size_t s = 0; s < tl.step_pass.size(); ++s) {
      const size_t k = static_cast<size_t>(tl.step_pass[s]);
      lo[k] = std::min(lo[k], tl.start_s[s]);
      hi[k] = std::max(hi[k], tl.end_s[s]);
    }
    Json passes = Json::array();
    for (size_t k = 0; k < sched.size() && static_cast<int64_t>(passes.size()) < o.max_spans; ++k) {
      if (hi[k] < lo[k]) continue;
      passes.push_back({sched[k].forward ? "F" : "B", sched[k].microbatch, sched[k].chunk, Ns(lo[k]), Ns(hi[k])});
    }
    // Copies the plan simulated: [queue, start_s, end_s, tensor, microbatch]
    // (tensor: an index into the rank's `tensors`).
    Json copies = Json::array(), names = Json::array();
    for (const auto& st : p.tensors[r]) names.push_back(st.name);
    for (const planner::Interval& iv : eval.intervals) {
      if (iv.owner_rank != static_cast<int32_t>(r) || static_cast<int64_t>(copies.size()) >= o.max_spans) continue;
      if (iv.part != IntervalPart::kMovedOut && iv.part != IntervalPart::kFetched) continue;
      if (iv.rank != static_cast<int32_t>(r)) continue;
      const planner::Instance& in = p.instances[r][static_cast<size_t>(iv.instance)];
      const Storage s = a.storage[r][static_cast<size_t>(in.tensor)];
      const bool remote = planner::IsRemote(s);
      const size_t first = static_cast<size_t>(iv.first), last = static_cast<size_t>(iv.last);
      if (first >= tl.start_s.size() || last >= tl.end_s.size()) continue;
      if (iv.part == IntervalPart::kMovedOut) {
        copies.push_back({remote ? "link" : "d2h", Ns(tl.start_s[first]), Ns(tl.end_s[last]), in.tensor, in.microbatch});
      } else {
        const double bw = remote ? hw.pp_link_bw : hw.h2d_bw;
        const double start = tl.start_s[first];
        copies.push_back({remote ? "link" : "h2d", Ns(start), Ns(start + (bw > 0 ? static_cast<double>(iv.bytes) / bw : 0.0)),
                          in.tensor, in.microbatch});
      }
    }
    schedule->push_back({{"pp_rank", r}, {"passes", passes}, {"copies", copies}, {"tensors", names}});
  }
}

// The per-tensor table: [name, module, layer, pp_rank, bytes, device_bytes,
// policy, to_pp_rank, added_ms (its storage's time, every microbatch)].
Json TensorRows(const Json& plan, const planner::PlanningProblem& p, const planner::Assignment& a) {
  std::map<std::string, double> cost_ms;
  for (size_t r = 0; r < p.tensors.size(); ++r) {
    for (size_t t = 0; t < p.tensors[r].size(); ++t) {
      cost_ms[p.tensors[r][t].name] = 1e3 * p.tensor_cost_s[r][t][static_cast<size_t>(a.storage[r][t])];
    }
  }
  Json rows = Json::array();
  for (const auto& t : plan["tensors"]) {
    const std::string policy = EffectivePolicy(t);
    const std::string name = t.value("name", std::string());
    auto c = cost_ms.find(name);
    rows.push_back({name, t.value("module", std::string()), t.value("layer", int64_t{0}), t.value("pp_rank", int64_t{0}),
                    t.value("bytes", int64_t{0}), t.value("device_bytes", int64_t{0}), policy,
                    t.contains("to_pp_rank") ? t["to_pp_rank"] : Json(nullptr), c == cost_ms.end() ? 0.0 : c->second});
  }
  return rows;
}

}  // namespace

// TRACE.json's complete events ("X"), per pid: [name, cat, tid, ts_us, dur_us].
// A trace is the object form ({"traceEvents": [...]}) or the bare array
// the Trace Event format also allows. Every field read is type-checked:
// a hostile trace is refused (kBadInput, its JSON path), never thrown past.
Expected<Json> TraceSpans(const Json& trace_doc, const std::string& file, int64_t max_spans, bool* reduced) {
  const Json* trace = &trace_doc;
  const bool bare = trace->is_array();
  if (!bare && (!trace->is_object() || !trace->contains("traceEvents") || !(*trace)["traceEvents"].is_array())) {
    return Error{ErrorCode::kBadInput, file + ": /traceEvents: expected an array (a Chrome trace)"};
  }
  const Json& events = bare ? *trace : (*trace)["traceEvents"];
  const std::string prefix = file + (bare ? ": /" : ": /traceEvents/");
  std::map<int64_t, Json> by_pid;
  std::map<std::pair<int64_t, int64_t>, std::string> thread_names;
  for (size_t i = 0; i < events.size(); ++i) {
    const Json& e = events[i];
    const std::string where = prefix + std::to_string(i);
    if (!e.is_object() || !e.contains("ph") || !e["ph"].is_string()) return Error{ErrorCode::kBadInput, where + "/ph: expected a string"};
    auto integer = [&](const char* k, int64_t* v) -> Expected<std::monostate> {
      *v = 0;
      if (!e.contains(k)) return std::monostate{};
      if (!e[k].is_number_integer()) return Error{ErrorCode::kBadInput, where + "/" + k + ": expected an integer"};
      *v = e[k].get<int64_t>();
      return std::monostate{};
    };
    auto text = [&](const Json& o, const char* k, const std::string& at, std::string* v) -> Expected<std::monostate> {
      v->clear();
      if (!o.contains(k)) return std::monostate{};
      if (!o[k].is_string()) return Error{ErrorCode::kBadInput, at + "/" + k + ": expected a string"};
      *v = o[k].get<std::string>();
      return std::monostate{};
    };
    const std::string ph = e["ph"].get<std::string>();
    if (ph != "X" && ph != "M") continue;
    int64_t pid = 0, tid = 0;
    std::string name, cat;
    for (auto st : {integer("pid", &pid), integer("tid", &tid), text(e, "name", where, &name)}) {
      if (!st) return st.error();
    }
    if (ph == "M") {
      if (name != "thread_name" || !e.contains("args")) continue;
      if (!e["args"].is_object()) return Error{ErrorCode::kBadInput, where + "/args: expected an object"};
      std::string thread;
      if (auto st = text(e["args"], "name", where + "/args", &thread); !st) return st.error();
      thread_names[{pid, tid}] = thread;
      continue;
    }
    if (auto st = text(e, "cat", where, &cat); !st) return st.error();
    for (const char* k : {"ts", "dur"}) {
      if (!e.contains(k) || !e[k].is_number()) return Error{ErrorCode::kBadInput, where + "/" + k + ": expected a number"};
    }
    Json& spans = by_pid[pid];
    if (spans.is_null()) spans = Json::array();
    if (static_cast<int64_t>(spans.size()) >= max_spans) {
      *reduced = true;
      continue;
    }
    spans.push_back({std::move(name), std::move(cat), tid, e["ts"].get<double>(), e["dur"].get<double>()});
  }
  Json out = Json::array();
  for (auto& [pid, spans] : by_pid) {
    Json threads = Json::object();
    for (const auto& [key, name] : thread_names) {
      if (key.first == pid) threads[std::to_string(key.second)] = name;
    }
    out.push_back({{"pid", pid}, {"threads", threads}, {"spans", std::move(spans)}});
  }
  return out;
}

Expected<Json> BuildReportData(const ReportOptions& o, std::vector<std::string>* warnings) {
  auto plan = ReadJsonFile(o.plan_file);
  if (!plan) return plan.error();
  auto model = planner::ReadPlanModel(*plan, o.plan_file);
  if (!model) return model.error();
  auto layers = planner::ExpandModel(*model);
  if (!layers) return layers.error();
  // Too many microbatches to draw one by one: draw the plan's periodic
  // window (docs/planner.md, "Periodic window"); without one, BuildProblem
  // refuses at /train/microbatches.
  const bool too_many = static_cast<int64_t>(layers->size()) * model->train.microbatches >
                        planner::kMaxSimulatedLayerMicrobatches;
  planner::PlanningProblem p;
  try {
    p = planner::BuildProblem(*model, std::move(*layers),
                              too_many ? planner::Simulation::kPeriodic : planner::Simulation::kFull);
  } catch (const ErrorException& e) {
    return e.error();
  }
  if (p.window) {
    warnings->push_back("memory over the step and the schedule show the periodic window of " +
                        std::to_string(p.microbatches) + " microbatches standing for the plan's " +
                        std::to_string(model->train.microbatches) +
                        " (too many to draw one by one); peaks and bounds are the plan's");
  }
  auto assigned = planner::ReadPlanAssignment(*plan, o.plan_file, p);
  if (!assigned) return assigned.error();
  planner::Evaluation eval = planner::Evaluate(p, *assigned, false);

  Json data;
  bool reduced = false;
  data["name"] = plan->value("name", std::string());
  data["digest"] = plan->value("digest", std::string());
  data["generator"] = plan->value("generator", std::string());
  data["solver"] = plan->value("solver", std::string());
  data["budget"] = plan->value("budget", int64_t{0});
  data["parallel"] = (*plan)["model"].value("parallel", Json::object());
  // The header's facts: batch and dtypes, hardware, storage kinds, target.
  data["train"] = (*plan)["model"].value("train", Json::object());
  data["hardware"] = (*plan)["model"].value("hardware", Json::object());
  data["storage"] = (*plan)["model"].value("storage", Json{"keep", "recompute", "fp8", "offload_host", "offload_remote"});
  data["target"] = (*plan)["model"].contains("target") ? (*plan)["model"]["target"].value("name", std::string("memplan"))
                                                      : std::string("memplan");
  data["totals"] = plan->value("totals", Json::object());
  data["overhead"] = plan->value("overhead", Json::object());
  data["throughput"] = plan->value("throughput", Json(nullptr));  // plans since 2026-12-06
  data["ranks"] = RankSummaries(*plan);
  Json memory = Json::array(), schedule = Json::array();
  Replayed(p, *assigned, eval, o, &memory, &schedule, &reduced);
  data["memory"] = std::move(memory);
  data["schedule"] = std::move(schedule);
  data["tensors"] = TensorRows(*plan, p, *assigned);
  data["sweep"] = plan->value("sweep", Json(nullptr));
  data["measured"] = nullptr;
  data["check"] = nullptr;
  data["trace"] = nullptr;
  data["warnings"] = Json::array();

  if (!o.measured_file.empty()) {
    auto measured = traces::LoadMeasured(o.measured_file);
    if (!measured) return measured.error();
    auto bounds = traces::ParsePlanBounds(*plan, o.plan_file);
    if (!bounds) return bounds.error();
    traces::CheckOptions co;
    co.plan_file = o.plan_file;
    co.measured_file = o.measured_file;
    auto check = traces::Check(*bounds, *measured, co);
    if (!check && check.error().code == ErrorCode::kDigestMismatch && o.force) {
      warnings->push_back(check.error().message + " (drawn anyway: --force)");
    } else if (!check) {
      return check.error();
    } else {
      Json rows = Json::array();
      for (const auto& c : check->ranks) {
        rows.push_back({{"pp_rank", c.pp_rank}, {"dp_rank", c.dp_rank ? Json(*c.dp_rank) : Json(nullptr)},
                        {"pass", c.pass}, {"verdict", c.verdict}, {"predicted_peak", c.predicted_peak},
                        {"measured_peak", c.measured_peak}});
      }
      data["check"] = {{"pass", check->pass}, {"tolerance", check->tolerance}, {"ranks", rows}};
    }
    Json ranks = Json::array();
    for (const auto& mr : measured->ranks) {
      std::vector<double> t;
      std::vector<int64_t> bytes;
      for (const auto& pt : mr.timeline) {
        t.push_back(pt.t_us * 1e-6);
        bytes.push_back(pt.allocated_bytes);  // static included
      }
      Json rank = {{"pp_rank", mr.pp_rank}, {"dp_rank", mr.dp_rank}, {"peak", mr.peak},
                   {"allocated_peak", mr.allocated_peak}, {"static", mr.static_bytes},
                   {"allocated", Downsample(t, bytes, o.max_points, &reduced)}};
      if (!mr.allocation_timeline.empty() && mr.pp_rank >= 0 && static_cast<size_t>(mr.pp_rank) < p.timelines.size()) {
        // Eager: the measured live bytes step by step on the plan's clock,
        // and the first step where they diverge from the plan's program.
        const planner::RankTimeline& tl = p.timelines[static_cast<size_t>(mr.pp_rank)];
        std::vector<int64_t> d(static_cast<size_t>(tl.steps) + 2, 0), live(static_cast<size_t>(tl.steps));
        for (const auto& e : mr.allocation_timeline) {
          const size_t at = static_cast<size_t>(std::min<int64_t>(e.step + (e.bytes < 0 ? 1 : 0), tl.steps));
          d[at] += e.bytes;  // a free takes effect after its step
        }
        int64_t run = mr.static_bytes;
        for (size_t s = 0; s < live.size(); ++s) live[s] = run += d[s];
        std::vector<double> st(tl.start_s.begin(), tl.start_s.end());
        rank["eager"] = Downsample(st, live, o.max_points, &reduced);
        std::vector<traces::PredictedLife> lives;
        for (const auto& b : planner::PredictedBuffers(p, static_cast<int32_t>(mr.pp_rank), eval.intervals)) {
          lives.push_back({b.first, b.last, b.bytes, b.label.name, b.label.part, b.copy_timed});
        }
        auto cmp = traces::CompareTimelines(lives, mr.allocation_timeline, tl.steps,
                                            [](int64_t s) { return "step " + std::to_string(s); });
        Json c = {{"pass", cmp.pass}, {"verdict", cmp.verdict}, {"moved", cmp.moved.size()}};
        if (cmp.first_step && *cmp.first_step < tl.steps) {
          c["step"] = *cmp.first_step;
          c["t"] = st[static_cast<size_t>(*cmp.first_step)];
          c["bytes"] = live[static_cast<size_t>(*cmp.first_step)];
        }
        rank["eager_check"] = std::move(c);
      }
      if (mr.cupti) {
        // CUPTI's own view of the device's allocations (cuda), when collected.
        std::vector<double> ct;
        std::vector<int64_t> cb;
        for (const auto& pt : mr.cupti->timeline) {
          ct.push_back(pt.t_us * 1e-6);
          cb.push_back(pt.allocated_bytes);
        }
        rank["cupti_peak"] = mr.cupti->allocated_peak;
        rank["cupti"] = Downsample(ct, cb, o.max_points, &reduced);
      }
      ranks.push_back(std::move(rank));
    }
    data["measured"] = {{"backend", measured->backend}, {"allocator", traces::AllocatorOf(*measured)},
                        {"step_s", measured->step_s}, {"compute_s", measured->compute_s}, {"ranks", ranks}};
  }
  if (!o.trace_file.empty()) {
    auto trace = ReadJsonFile(o.trace_file);
    if (!trace) return trace.error();
    auto spans = TraceSpans(*trace, o.trace_file, o.max_spans, &reduced);
    if (!spans) return spans.error();
    data["trace"] = std::move(*spans);
  }
  data["downsampled"] = reduced;
  data["max_points"] = o.max_points;
  for (const auto& w : *warnings) data["warnings"].push_back(w);
  return data;
}

}  // namespace memplan::viz
