#include "memplan/traces/chrome_trace.h"

#include <algorithm>
#include <map>
#include <set>
#include <tuple>
#include <utility>

#include "memplan/common/check.h"

namespace memplan::traces {
namespace {

// Clock resolution: CUPTI timestamps are nanoseconds, so two ends closer than
// 1 ns are the same instant (and ts + dur in doubles may differ in the last bit).
constexpr double kEpsUs = 1e-3;

OrderedJson Metadata(std::string_view name, int64_t pid, int64_t tid, OrderedJson args) {
  OrderedJson m;
  m["ph"] = "M";
  m["name"] = name;
  m["pid"] = pid;
  if (tid >= 0) m["tid"] = tid;
  m["args"] = std::move(args);
  return m;
}

}  // namespace

std::string_view StreamName(Stream stream) {
  switch (stream) {
    case Stream::kCompute: return "compute";
    case Stream::kD2H: return "d2h";
    case Stream::kH2D: return "h2d";
    case Stream::kLink: return "link";
  }
  return "?";
}

void ChromeTrace::AddRank(int64_t pp_rank) {
  MEMPLAN_CHECK(pp_rank >= 0, "negative pp rank");
  if (std::find(ranks_.begin(), ranks_.end(), pp_rank) == ranks_.end()) ranks_.push_back(pp_rank);
}

void ChromeTrace::AddThread(int64_t pp_rank, int64_t tid, std::string name) {
  MEMPLAN_CHECK(pp_rank >= kUnownedRank && tid >= kGpuTidBase, "a thread needs a rank and a tid >= kGpuTidBase");
  if (pp_rank != kUnownedRank) AddRank(pp_rank);
  for (auto& t : threads_) {
    if (t.pp_rank == pp_rank && t.tid == tid) {
      t.name = std::move(name);
      return;
    }
  }
  threads_.push_back({pp_rank, tid, std::move(name)});
}

void ChromeTrace::AddSpan(TraceSpan span) {
  MEMPLAN_CHECK(span.ts_us >= 0 && span.dur_us >= 0, "span with negative time");
  MEMPLAN_CHECK(span.pp_rank >= kUnownedRank, "negative pp rank");
  MEMPLAN_CHECK(span.tid == 0 || span.tid >= kGpuTidBase, "a span's own tid must come from AddThread");
  if (span.pp_rank != kUnownedRank) AddRank(span.pp_rank);
  spans_.push_back(std::move(span));
}

void ChromeTrace::AddCuptiCounter(int64_t pp_rank, double ts_us, int64_t bytes) {
  MEMPLAN_CHECK(ts_us >= 0, "counter with negative time");
  AddRank(pp_rank);
  cupti_.push_back({pp_rank, ts_us, bytes});
}

void ChromeTrace::AddCounter(const MemoryCounter& counter) {
  MEMPLAN_CHECK(counter.ts_us >= 0, "counter with negative time");
  AddRank(counter.pp_rank);
  counters_.push_back(counter);
}

OrderedJson ChromeTrace::ToJson() const {
  OrderedJson events = OrderedJson::array();
  std::vector<int64_t> ranks = ranks_;
  std::sort(ranks.begin(), ranks.end());
  for (int64_t r : ranks) {
    events.push_back(Metadata("process_name", Pid(r), -1, {{"name", label_ + " " + std::to_string(r)}}));
    events.push_back(Metadata("process_sort_index", Pid(r), -1, {{"sort_index", r}}));
    for (int s = 0; s < kStreamCount; ++s) {
      auto stream = static_cast<Stream>(s);
      events.push_back(Metadata("thread_name", Pid(r), Tid(stream), {{"name", StreamName(stream)}}));
      events.push_back(Metadata("thread_sort_index", Pid(r), Tid(stream), {{"sort_index", s}}));
    }
  }
  bool unowned = std::any_of(threads_.begin(), threads_.end(), [](const Thread& t) { return t.pp_rank == kUnownedRank; });
  for (const auto& s : spans_) unowned = unowned || s.pp_rank == kUnownedRank;
  if (unowned) {
    events.push_back(Metadata("process_name", kUnownedPid, -1, {{"name", "GPU work no rank owns"}}));
    events.push_back(Metadata("process_sort_index", kUnownedPid, -1, {{"sort_index", kUnownedPid}}));
  }
  std::vector<Thread> threads = threads_;
  std::sort(threads.begin(), threads.end(),
            [](const Thread& a, const Thread& b) { return std::tie(a.pp_rank, a.tid) < std::tie(b.pp_rank, b.tid); });
  for (const auto& t : threads) {
    events.push_back(Metadata("thread_name", Pid(t.pp_rank), t.tid, {{"name", t.name}}));
    events.push_back(Metadata("thread_sort_index", Pid(t.pp_rank), t.tid, {{"sort_index", t.tid}}));
  }
  // Time order, containing spans first, so viewers (and readers) meet a parent
  // before its children; the stable sort keeps equal events in insertion order.
  std::vector<const TraceSpan*> spans;
  for (const auto& s : spans_) spans.push_back(&s);
  std::stable_sort(spans.begin(), spans.end(), [](const TraceSpan* a, const TraceSpan* b) {
    if (a->ts_us != b->ts_us) return a->ts_us < b->ts_us;
    return a->dur_us > b->dur_us;
  });
  for (const TraceSpan* s : spans) {
    OrderedJson e;
    e["ph"] = "X";
    e["name"] = s->name;
    e["cat"] = s->cat;
    e["pid"] = Pid(s->pp_rank);
    e["tid"] = s->tid != 0 ? s->tid : Tid(s->stream);
    e["ts"] = s->ts_us;
    e["dur"] = s->dur_us;
    if (s->args.is_object() && !s->args.empty()) e["args"] = s->args;
    events.push_back(std::move(e));
  }
  std::vector<MemoryCounter> counters = counters_;
  std::stable_sort(counters.begin(), counters.end(),
                   [](const MemoryCounter& a, const MemoryCounter& b) { return a.ts_us < b.ts_us; });
  for (const auto& c : counters) {
    OrderedJson e;
    e["ph"] = "C";
    e["name"] = "device_memory";
    e["pid"] = Pid(c.pp_rank);
    e["ts"] = c.ts_us;
    e["args"] = {{"allocated", c.allocated_bytes}, {"reserved", c.reserved_bytes}, {"predicted", c.predicted_bytes}};
    events.push_back(std::move(e));
  }
  std::vector<CuptiSample> cupti = cupti_;
  std::stable_sort(cupti.begin(), cupti.end(),
                   [](const CuptiSample& a, const CuptiSample& b) { return a.ts_us < b.ts_us; });
  for (const auto& c : cupti) {
    OrderedJson e;
    e["ph"] = "C";
    e["name"] = "cupti_device_memory";
    e["pid"] = Pid(c.pp_rank);
    e["ts"] = c.ts_us;
    e["args"] = {{"cupti", c.bytes}};
    events.push_back(std::move(e));
  }
  OrderedJson doc;
  doc["traceEvents"] = std::move(events);
  doc["displayTimeUnit"] = "ms";
  return doc;
}

std::vector<std::string> ValidateNesting(const Json& trace) {
  std::vector<std::string> errors;
  // The object form, or the bare array the Trace Event format also allows.
  const bool bare = trace.is_array();
  if (!bare && (!trace.is_object() || !trace.contains("traceEvents") || !trace["traceEvents"].is_array())) {
    errors.push_back("/traceEvents: expected an array of events");
    return errors;
  }
  const std::string prefix = bare ? "/" : "/traceEvents/";
  struct Span {
    double begin, end;
    size_t index;
  };
  std::map<std::pair<int64_t, int64_t>, std::vector<Span>> threads;
  const Json& events = bare ? trace : trace["traceEvents"];
  for (size_t i = 0; i < events.size(); ++i) {
    const Json& e = events[i];
    const std::string at = prefix + std::to_string(i);
    if (!e.is_object() || !e.contains("ph") || !e["ph"].is_string()) {
      errors.push_back(at + ": expected an event object with \"ph\"");
      continue;
    }
    const std::string ph = e["ph"].get<std::string>();
    if (ph != "X" && ph != "C") continue;
    auto number = [&](const char* key) -> const Json* {
      if (e.contains(key) && e[key].is_number()) return &e[key];
      errors.push_back(at + "/" + key + ": expected a number");
      return nullptr;
    };
    const Json* ts = number("ts");
    if (ts && ts->get<double>() < 0) errors.push_back(at + "/ts: negative timestamp " + Brief(*ts));
    if (ph == "C") continue;
    const Json* dur = number("dur");
    auto integer = [&](const char* key) -> const Json* {
      if (e.contains(key) && e[key].is_number_integer()) return &e[key];
      errors.push_back(at + "/" + key + ": expected an integer");
      return nullptr;
    };
    const Json* pid = integer("pid");
    const Json* tid = integer("tid");
    if (!ts || !dur || !pid || !tid) continue;
    if (dur->get<double>() < 0) {
      errors.push_back(at + "/dur: negative duration " + Brief(*dur));
      continue;
    }
    double begin = ts->get<double>();
    threads[{pid->get<int64_t>(), tid->get<int64_t>()}].push_back({begin, begin + dur->get<double>(), i});
  }
  for (auto& [thread, spans] : threads) {
    std::stable_sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) {
      if (a.begin != b.begin) return a.begin < b.begin;
      return a.end > b.end;
    });
    // Open spans, outermost first: a new span must end inside the innermost
    // one still open when it starts.
    std::vector<const Span*> open;
    for (const Span& s : spans) {
      while (!open.empty() && open.back()->end <= s.begin + kEpsUs) open.pop_back();
      if (!open.empty() && s.end > open.back()->end + kEpsUs) {
        errors.push_back(prefix + std::to_string(s.index) + ": overlaps " + prefix +
                         std::to_string(open.back()->index) + " on pid " + std::to_string(thread.first) +
                         ", tid " + std::to_string(thread.second) + " without nesting inside it");
        continue;  // report each offender once; do not let it hide later ones
      }
      open.push_back(&s);
    }
  }
  return errors;
}

}  // namespace memplan::traces
