#include "memplan/traces/measured.h"

#include "memplan/common/schema.h"

#include <cmath>
#include <cstdio>
#include <set>
#include <tuple>
#include <string>
#include <vector>

namespace memplan::traces {
namespace {

constexpr int64_t kMaxBytes = INT64_MAX;

double NonNegative(const Json& v, const JsonLocation& where) {
  if (!v.is_number() || !std::isfinite(v.get<double>()) || v.get<double>() < 0) {
    ThrowAt(where, "expected a non-negative number, got " + Brief(v));
  }
  return v.get<double>();
}

double NonNegative(ObjectReader& r, std::string_view key) { return NonNegative(r.Required(key), r.At(key)); }

// ExpectInt's range message would print INT64_MAX; say what is meant instead.
int64_t ByteCount(const Json& v, const JsonLocation& where) {
  if (!v.is_number() || v.get<double>() < 0) ThrowAt(where, "expected a byte count (integer >= 0), got " + Brief(v));
  return ExpectInt(v, where, 0, kMaxBytes);
}

int64_t ByteCount(ObjectReader& r, std::string_view key) { return ByteCount(r.Required(key), r.At(key)); }

bool IsDigest(const std::string& s) {
  if (s.size() != 7 + 64 || !s.starts_with("sha256:")) return false;
  for (char c : s.substr(7)) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

// [[t_us, bytes], ...] with t_us non-decreasing.
std::vector<TimelinePoint> ParseTimeline(const Json& json, const JsonLocation& where) {
  const Json& timeline = ExpectArray(json, where);
  std::vector<TimelinePoint> out;
  for (size_t i = 0; i < timeline.size(); ++i) {
    JsonLocation at = where.Child(i);
    const Json& pair = timeline[i];
    if (!pair.is_array() || pair.size() != 2) ThrowAt(at, "expected [t_us, allocated_bytes], got " + Brief(pair));
    TimelinePoint p{NonNegative(pair[0], at.Child(size_t{0})), ByteCount(pair[1], at.Child(1))};
    if (!out.empty() && p.t_us < out.back().t_us) {
      ThrowAt(at.Child(size_t{0}), "timeline goes back in time (" + Brief(pair[0]) + " after " +
                                       Brief(timeline[i - 1][0]) + ")");
    }
    out.push_back(p);
  }
  return out;
}

std::string Hex(uint64_t v) {
  char buf[24];
  std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(v));
  return buf;
}

uint64_t ParseAddress(ObjectReader& r, std::string_view key) {
  const std::string s = r.String(key);
  uint64_t v = 0;
  bool ok = s.size() > 2 && s.size() <= 18 && s.starts_with("0x");
  for (size_t i = 2; ok && i < s.size(); ++i) {
    const char c = s[i];
    const int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
    ok = d >= 0;
    v = v * 16 + static_cast<uint64_t>(d < 0 ? 0 : d);
  }
  if (!ok) ThrowAt(r.At(key), "expected an address \"0x\" and 1 to 16 lower-case hex digits, got " + Brief(s));
  return v;
}

constexpr const char* kKindNames[] = {"unknown", "pageable", "pinned", "device", "array", "managed",
                                      "device_static", "managed_static"};

// A list of time-stamped event objects in time order: `fill` reads the
// other keys of one event.
template <class Event, class Fill>
std::vector<Event> ParseEvents(const Json& json, const JsonLocation& where, std::string_view what, Fill fill) {
  const Json& list = ExpectArray(json, where);
  std::vector<Event> out;
  for (size_t i = 0; i < list.size(); ++i) {
    ObjectReader r(list[i], where.Child(i));
    Event e;
    e.t_us = NonNegative(r, "t_us");
    if (!out.empty() && e.t_us < out.back().t_us) ThrowAt(r.At("t_us"), std::string(what) + " go back in time");
    fill(r, e);
    r.Finish();
    out.push_back(std::move(e));
  }
  return out;
}

std::vector<AllocationEvent> ParseAllocations(const Json& json, const JsonLocation& where) {
  return ParseEvents<AllocationEvent>(json, where, "allocations", [](ObjectReader& r, AllocationEvent& e) {
    e.release = r.Enum("op", {"alloc", "free"}) == "free";
    e.address = ParseAddress(r, "address");
    e.bytes = ByteCount(r, "bytes");
    e.stream = r.Int("stream", -1, int64_t{UINT32_MAX} - 1);  // CUPTI's ids are uint32 (UINT32_MAX: none)
    e.kind = r.Enum("kind", {kKindNames[0], kKindNames[1], kKindNames[2], kKindNames[3], kKindNames[4],
                             kKindNames[5], kKindNames[6], kKindNames[7]});
    if (r.Get("pool")) e.pool = ParseAddress(r, "pool");
  });
}

std::vector<PoolEvent> ParsePoolEvents(const Json& json, const JsonLocation& where) {
  return ParseEvents<PoolEvent>(json, where, "pool events", [](ObjectReader& r, PoolEvent& e) {
    e.op = r.Enum("op", {"created", "trimmed", "destroyed"});
    e.address = ParseAddress(r, "address");
    e.bytes = ByteCount(r, "bytes");
  });
}

CuptiRankBytes ParseCupti(const Json& json, const JsonLocation& where) {
  ObjectReader r(json, where);
  CuptiRankBytes c;
  c.allocated_peak = ByteCount(r, "allocated_peak");
  c.reserved_peak = ByteCount(r, "reserved_peak");
  if (c.reserved_peak < c.allocated_peak) {
    ThrowAt(r.At("reserved_peak"), "expected at least allocated_peak (" + std::to_string(c.allocated_peak) +
                                       "), got " + std::to_string(c.reserved_peak));
  }
  c.timeline = ParseTimeline(r.Required("timeline"), r.At("timeline"));
  if (const Json* a = r.Get("allocations")) c.allocations = ParseAllocations(*a, r.At("allocations"));
  if (const Json* p = r.Get("pools")) c.pools = ParsePoolEvents(*p, r.At("pools"));
  r.Finish();
  return c;
}

MoeRoutingSeen ParseRouting(const Json& json, const JsonLocation& where) {
  ObjectReader r(json, where);
  MoeRoutingSeen m;
  m.max_expert_load = r.Number("max_expert_load", 0, 1 << 20, 0);
  m.max_rank_load = r.Number("max_rank_load", 0, 1 << 20, 0);
  m.planned_rank_load = r.Number("planned_rank_load", 0, 1 << 20, 0);
  m.dropped_rows = r.Int("dropped_rows", 0, kMaxBytes, 0);
  r.Finish();
  return m;
}

PoolMarks ParsePool(const Json& json, const JsonLocation& where) {
  ObjectReader r(json, where);
  PoolMarks p{ByteCount(r, "reserved_peak"), ByteCount(r, "used_peak")};
  if (p.reserved_peak < p.used_peak) {
    ThrowAt(r.At("reserved_peak"), "expected at least used_peak (" + std::to_string(p.used_peak) + "), got " +
                                       std::to_string(p.reserved_peak));
  }
  r.Finish();
  return p;
}

MeasuredProcess ParseProcess(const Json& json, const JsonLocation& where) {
  ObjectReader r(json, where);
  MeasuredProcess p{ByteCount(r, "device_bytes_peak"), ByteCount(r, "context_bytes"), ByteCount(r, "profiler_bytes")};
  r.Finish();
  return p;
}

MeasuredStep ParseStep(const Json& json, const JsonLocation& where) {
  ObjectReader r(json, where);
  MeasuredStep s;
  s.step = r.Int("step", 1, int64_t{1} << 30);
  s.loss = NonNegative(r, "loss");
  s.grad_norm = NonNegative(r, "grad_norm");
  s.step_s = NonNegative(r, "step_s");
  const Json& ranks = ExpectArray(r.Required("ranks"), r.At("ranks"));
  for (size_t i = 0; i < ranks.size(); ++i) {
    ObjectReader k(ranks[i], r.At("ranks").Child(i));
    MeasuredStepRank sr;
    sr.pp_rank = k.Int("pp_rank", 0, 1 << 20);
    sr.dp_rank = k.Int("dp_rank", 0, 1 << 20, 0);
    sr.allocated_peak = ByteCount(k, "allocated_peak");
    sr.peak = ByteCount(k, "peak");
    sr.allocations = k.Int("allocations", 0, kMaxBytes, 0);
    sr.allocated_bytes = k.Int("allocated_bytes", 0, kMaxBytes, 0);
    sr.tp_rank = k.Int("tp_rank", 0, 1 << 20, 0);
    sr.cp_rank = k.Int("cp_rank", 0, 1 << 20, 0);
    k.Finish();
    s.ranks.push_back(sr);
  }
  r.Finish();
  return s;
}

MeasuredRank ParseRank(const Json& json, const JsonLocation& where) {
  ObjectReader r(json, where);
  MeasuredRank rank;
  rank.pp_rank = r.Int("pp_rank", 0, 1 << 20);
  if (r.Has("dp_rank")) rank.dp_rank = r.Int("dp_rank", 0, 1 << 20);
  if (r.Has("ep_rank")) rank.ep_rank = r.Int("ep_rank", 0, 1 << 20);
  if (r.Has("tp_rank")) rank.tp_rank = r.Int("tp_rank", 0, 1 << 20);
  if (r.Has("cp_rank")) rank.cp_rank = r.Int("cp_rank", 0, 1 << 20);
  rank.allocated_peak = ByteCount(r, "allocated_peak");
  rank.peak = ByteCount(r, "peak");
  rank.static_bytes = ByteCount(r, "static");
  rank.timeline = ParseTimeline(r.Required("timeline"), r.At("timeline"));
  const Json& events = r.Required("events");
  if (!events.is_object()) ThrowAt(r.At("events"), "expected an object of event counts, got " + Brief(events));
  for (auto it = events.begin(); it != events.end(); ++it) {
    const Json& count = it.value();
    JsonLocation at = r.At("events").Child(it.key());
    if (!count.is_number() || count.get<double>() < 0) {
      ThrowAt(at, "expected a count (integer >= 0), got " + Brief(count));
    }
    rank.events[it.key()] = ExpectInt(count, at, 0, kMaxBytes);
  }
  if (const Json* c = r.Get("cupti")) rank.cupti = ParseCupti(*c, r.At("cupti"));
  if (const Json* p = r.Get("pool")) rank.pool = ParsePool(*p, r.At("pool"));
  if (const Json* p = r.Get("moe_routing")) rank.moe_routing = ParseRouting(*p, r.At("moe_routing"));
  if (const Json* a = r.Get("allocation_timeline")) {
    const JsonLocation at = r.At("allocation_timeline");
    const Json& list = ExpectArray(*a, at);
    int64_t live = 0;
    for (size_t i = 0; i < list.size(); ++i) {
      const Json& e = list[i];
      const JsonLocation ei = at.Child(i);
      if (!e.is_array() || e.size() < 4 || e.size() > 5 || !e[2].is_string() || !e[3].is_string()) {
        ThrowAt(ei, "expected [step, bytes, \"name\", \"part\"] or, for a free, [step, bytes, \"name\", \"part\", "
                    "touched_bytes], got " + Brief(e));
      }
      StepAllocation s{ExpectInt(e[0], ei.Child(size_t{0}), 0, kMaxBytes),
                       ExpectInt(e[1], ei.Child(size_t{1}), -kMaxBytes, kMaxBytes), e[2].get<std::string>(),
                       e[3].get<std::string>()};
      if (e.size() == 5) {
        if (s.bytes >= 0) ThrowAt(ei.Child(size_t{4}), "touched_bytes belongs to a free (negative bytes)");
        s.touched = ExpectInt(e[4], ei.Child(size_t{4}), 0, -s.bytes);
      }
      if (!rank.allocation_timeline.empty() && s.step < rank.allocation_timeline.back().step) {
        ThrowAt(ei.Child(size_t{0}), "the allocation timeline goes back in steps");
      }
      live += s.bytes;
      if (live < 0) ThrowAt(ei.Child(size_t{1}), "frees more bytes than were allocated");
      rank.allocation_timeline.push_back(std::move(s));
    }
  }
  r.Finish();
  return rank;
}

}  // namespace

Expected<Measured> ParseMeasured(const Json& json, const std::string& file) {
  return CatchErrors([&] {
    ObjectReader r(json, JsonLocation{file, ""});
    std::string schema = r.String("schema");
    if (schema != kMeasuredSchema) {
      ThrowAt(r.At("schema"), "expected \"" + std::string(kMeasuredSchema) + "\", got " + Brief(schema));
    }
    Measured m;
    m.backend = r.Enum("backend", {"host", "cuda"});
    m.source = r.Enum("source", {"runtime", "cupti-injection"}, "runtime");
    m.allocator = r.Enum("allocator", {"arena", "pool", "eager"}, "");
    if (r.Has("measurement")) {
      const std::string kind = r.Enum("measurement", {"feasibility", "independent"});
      if (kind != (m.allocator == "eager" ? "independent" : "feasibility")) {
        ThrowAt(r.At("measurement"), "\"" + kind + "\" does not match the allocator \"" + AllocatorOf(m) + "\"");
      }
    }
    m.device = r.String("device");
    m.plan_digest = r.String("plan_digest");
    // A profile of another program (memplan profile) executed no plan.
    if (!IsDigest(m.plan_digest) && !(m.source == "cupti-injection" && m.plan_digest.empty())) {
      ThrowAt(r.At("plan_digest"), "expected \"sha256:\" and 64 lower-case hex digits, got " + Brief(m.plan_digest));
    }
    m.step_s = NonNegative(r, "step_s");
    if (r.Has("compute_s")) m.compute_s = NonNegative(r, "compute_s");
    m.loss = NonNegative(r, "loss");
    m.grad_norm = NonNegative(r, "grad_norm");
    const Json& ranks = ExpectArray(r.Required("ranks"), r.At("ranks"));
    if (ranks.empty()) ThrowAt(r.At("ranks"), "expected at least one rank");
    std::set<std::tuple<int64_t, int64_t, int64_t, int64_t>> seen;
    for (size_t i = 0; i < ranks.size(); ++i) {
      m.ranks.push_back(ParseRank(ranks[i], r.At("ranks").Child(i)));
      const MeasuredRank& mr = m.ranks.back();
      if (!seen.insert({mr.pp_rank, mr.dp_rank, mr.cp_rank, mr.tp_rank}).second) {
        ThrowAt(r.At("ranks").Child(i).Child("pp_rank"),
                "pp_rank " + std::to_string(mr.pp_rank) + " (dp_rank " + std::to_string(mr.dp_rank) + ", cp_rank " +
                    std::to_string(mr.cp_rank) + ", tp_rank " + std::to_string(mr.tp_rank) + ") appears twice");
      }
    }
    for (size_t i = 0; i < m.ranks.size(); ++i) {
      if (m.ranks[i].pool && AllocatorOf(m) == "arena") {
        ThrowAt(r.At("ranks").Child(i).Child("pool"), "pool marks in a measurement whose allocator is \"" +
                                                          AllocatorOf(m) + "\"");
      }
    }
    if (const Json* p = r.Get("process")) m.process = ParseProcess(*p, r.At("process"));
    m.cupti_status = r.Enum("cupti_status", {"collected", "off", "unavailable"}, "");
    if (const Json* s = r.Get("steps")) {
      const Json& list = ExpectArray(*s, r.At("steps"));
      for (size_t i = 0; i < list.size(); ++i) {
        m.steps.push_back(ParseStep(list[i], r.At("steps").Child(i)));
        if (m.steps.back().step != static_cast<int64_t>(i) + 1) {
          ThrowAt(r.At("steps").Child(i).Child("step"), "expected " + std::to_string(i + 1) + ", got " +
                                                            std::to_string(m.steps.back().step));
        }
      }
    }
    r.Finish();
    // The reader above gives the specific messages; the schema is the net
    // for anything it does not look at.
    if (auto valid = ValidateSchema(json, SchemaKind::kMeasured, file); !valid.ok()) throw ErrorException(valid.error());
    return m;
  });
}

std::string AllocatorOf(const Measured& m) {
  if (!m.allocator.empty()) return m.allocator;
  return m.backend == "cuda" ? "pool" : "arena";
}

Expected<Measured> LoadMeasured(const std::string& path) {
  auto json = ReadJsonFile(path);
  if (!json) return json.error();
  return ParseMeasured(*json, path);
}

OrderedJson MeasuredToJson(const Measured& m) {
  OrderedJson j;
  j["schema"] = kMeasuredSchema;
  j["backend"] = m.backend;
  j["source"] = m.source;
  if (!m.allocator.empty()) {
    j["allocator"] = m.allocator;
    j["measurement"] = m.allocator == "eager" ? "independent" : "feasibility";
  }
  j["device"] = m.device;
  j["plan_digest"] = m.plan_digest;
  j["step_s"] = m.step_s;
  if (m.compute_s > 0) j["compute_s"] = m.compute_s;
  j["loss"] = m.loss;
  j["grad_norm"] = m.grad_norm;
  j["ranks"] = OrderedJson::array();
  for (const auto& rank : m.ranks) {
    OrderedJson r;
    r["pp_rank"] = rank.pp_rank;
    r["dp_rank"] = rank.dp_rank;
    if (rank.ep_rank > 0) r["ep_rank"] = rank.ep_rank;
    if (rank.tp_rank > 0) r["tp_rank"] = rank.tp_rank;
    if (rank.cp_rank > 0) r["cp_rank"] = rank.cp_rank;
    r["allocated_peak"] = rank.allocated_peak;
    r["peak"] = rank.peak;
    r["static"] = rank.static_bytes;
    r["timeline"] = OrderedJson::array();
    for (const auto& p : rank.timeline) r["timeline"].push_back({p.t_us, p.allocated_bytes});
    r["events"] = OrderedJson::object();
    for (const auto& [name, count] : rank.events) r["events"][name] = count;
    if (rank.cupti) {
      OrderedJson c;
      c["allocated_peak"] = rank.cupti->allocated_peak;
      c["reserved_peak"] = rank.cupti->reserved_peak;
      c["timeline"] = OrderedJson::array();
      for (const auto& p : rank.cupti->timeline) c["timeline"].push_back({p.t_us, p.allocated_bytes});
      if (!rank.cupti->allocations.empty()) {
        OrderedJson list = OrderedJson::array();
        for (const auto& e : rank.cupti->allocations) {
          OrderedJson a;
          a["t_us"] = e.t_us;
          a["op"] = e.release ? "free" : "alloc";
          a["address"] = Hex(e.address);
          a["bytes"] = e.bytes;
          a["stream"] = e.stream;
          a["kind"] = e.kind;
          if (e.pool != 0) a["pool"] = Hex(e.pool);
          list.push_back(std::move(a));
        }
        c["allocations"] = std::move(list);
      }
      if (!rank.cupti->pools.empty()) {
        OrderedJson list = OrderedJson::array();
        for (const auto& e : rank.cupti->pools) {
          list.push_back({{"t_us", e.t_us}, {"op", e.op}, {"address", Hex(e.address)}, {"bytes", e.bytes}});
        }
        c["pools"] = std::move(list);
      }
      r["cupti"] = std::move(c);
    }
    if (rank.pool) r["pool"] = {{"reserved_peak", rank.pool->reserved_peak}, {"used_peak", rank.pool->used_peak}};
    if (const auto& m = rank.moe_routing) {
      r["moe_routing"] = {{"max_expert_load", m->max_expert_load},
                          {"max_rank_load", m->max_rank_load},
                          {"planned_rank_load", m->planned_rank_load},
                          {"dropped_rows", m->dropped_rows}};
    }
    if (!rank.allocation_timeline.empty()) {
      OrderedJson list = OrderedJson::array();
      for (const auto& e : rank.allocation_timeline) {
        OrderedJson entry = {e.step, e.bytes, e.name, e.part};
        if (e.bytes < 0 && e.touched >= 0) entry.push_back(e.touched);
        list.push_back(std::move(entry));
      }
      r["allocation_timeline"] = std::move(list);
    }
    j["ranks"].push_back(std::move(r));
  }
  if (!m.cupti_status.empty()) j["cupti_status"] = m.cupti_status;
  if (m.process) {
    j["process"] = {{"device_bytes_peak", m.process->device_bytes_peak},
                    {"context_bytes", m.process->context_bytes},
                    {"profiler_bytes", m.process->profiler_bytes}};
  }
  if (!m.steps.empty()) {
    j["steps"] = OrderedJson::array();
    for (const auto& s : m.steps) {
      OrderedJson o;
      o["step"] = s.step;
      o["loss"] = s.loss;
      o["grad_norm"] = s.grad_norm;
      o["step_s"] = s.step_s;
      o["ranks"] = OrderedJson::array();
      for (const auto& sr : s.ranks) {
        OrderedJson k = {{"pp_rank", sr.pp_rank},
                         {"dp_rank", sr.dp_rank},
                         {"allocated_peak", sr.allocated_peak},
                         {"peak", sr.peak},
                         {"allocations", sr.allocations},
                         {"allocated_bytes", sr.allocated_bytes}};
        if (sr.tp_rank > 0) k["tp_rank"] = sr.tp_rank;
        if (sr.cp_rank > 0) k["cp_rank"] = sr.cp_rank;
        o["ranks"].push_back(std::move(k));
      }
      j["steps"].push_back(std::move(o));
    }
  }
  return j;
}

}  // namespace memplan::traces
