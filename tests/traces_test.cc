// traces/: MEASURED.json, the plan/measurement check, the Chrome-trace writer
// and nesting validator, footprint reconstruction from allocation records.
#include <doctest/doctest.h>

#include <algorithm>
#include <random>
#include <string>

#include "memplan/common/json_util.h"
#include "memplan/traces/check.h"
#include "memplan/traces/chrome_trace.h"
#include "memplan/traces/footprint.h"
#include "memplan/traces/measured.h"
#include "memplan/traces/profile.h"
#include "json_test_util.h"

using namespace memplan;
using namespace memplan::traces;
using memplan::test::ReadJson;
using memplan::test::SourcePath;
#ifdef MEMPLAN_HAVE_VALIJSON
using memplan::test::SchemaErrors;
#endif

namespace {

const std::string kDigest = "sha256:" + std::string(64, 'a');

Measured Sample() {
  Measured m;
  m.backend = "cuda";
  m.device = "NVIDIA H200";
  m.plan_digest = kDigest;
  m.step_s = 0.25;
  m.loss = 10.5;
  m.grad_norm = 0.125;
  m.ranks = {{0, 900, 1000, 400, {{0, 400}, {12.5, 900}, {30, 400}}, {{"alloc", 3}, {"kernel", 17}}, {}, {}, 0, 0, {}, {}},
             {1, 800, 950, 300, {}, {}, {}, {}, 0, 0, {}, {}}};
  return m;
}

// The error message of parsing `j`, "" when it parses.
std::string ParseError(const Json& j) {
  auto m = ParseMeasured(j, "m.json");
  return m ? "" : m.error().message;
}

PlanBounds Bounds(int64_t peak, int64_t lower_bound) { return {kDigest, {{0, peak, lower_bound}}}; }

Measured OneRank(std::string backend, int64_t peak, int64_t allocated_peak) {
  Measured m;
  m.backend = std::move(backend);
  m.plan_digest = kDigest;
  m.ranks = {{0, allocated_peak, peak, 0, {}, {}, {}, {}, 0, 0, {}, {}}};
  return m;
}

bool Passes(const PlanBounds& plan, const Measured& m, std::optional<double> tolerance = std::nullopt) {
  auto r = Check(plan, m, {tolerance});
  REQUIRE(r.ok());
  return r->pass;
}

}  // namespace

TEST_CASE("MEASURED.json round-trips") {
  Measured m = Sample();
  Json j = Json::parse(MeasuredToJson(m).dump());
  auto back = ParseMeasured(j, "m.json");
  REQUIRE_MESSAGE(back.ok(), back.error().message);
  CHECK(back->backend == "cuda");
  CHECK(back->device == m.device);
  CHECK(back->plan_digest == kDigest);
  CHECK(back->step_s == m.step_s);
  CHECK(back->loss == m.loss);
  CHECK(back->grad_norm == m.grad_norm);
  REQUIRE(back->ranks.size() == 2);
  CHECK(back->ranks[0].allocated_peak == 900);
  CHECK(back->ranks[0].peak == 1000);
  CHECK(back->ranks[0].static_bytes == 400);
  REQUIRE(back->ranks[0].timeline.size() == 3);
  CHECK(back->ranks[0].timeline[1].t_us == 12.5);
  CHECK(back->ranks[0].timeline[1].allocated_bytes == 900);
  CHECK(back->ranks[0].events == m.ranks[0].events);
  CHECK(MeasuredToJson(*back).dump() == MeasuredToJson(m).dump());
  CHECK(j["ranks"][0].contains("static"));
#ifdef MEMPLAN_HAVE_VALIJSON
  CHECK(SchemaErrors("schemas/measured.schema.json", j) == "");
#endif
}

TEST_CASE("MEASURED.json bad input names the file and the pointer") {
  const Json good = Json::parse(MeasuredToJson(Sample()).dump());
  struct Case {
    const char* pointer;
    Json value;
    const char* message;
  };
  const Case cases[] = {
      {"/schema", "memplan.measured/2", "m.json: /schema: expected \"memplan.measured/1\""},
      {"/backend", "rocm", "m.json: /backend: expected one of host|cuda"},
      {"/plan_digest", "sha256:abc", "m.json: /plan_digest: expected \"sha256:\""},
      {"/step_s", -1, "m.json: /step_s: expected a non-negative number"},
      {"/loss", "high", "m.json: /loss: expected a non-negative number"},
      {"/ranks", Json::array(), "m.json: /ranks: expected at least one rank"},
      {"/ranks/1/peak", -5, "m.json: /ranks/1/peak: expected a byte count"},
      {"/ranks/0/allocated_peak", 1.5, "m.json: /ranks/0/allocated_peak: expected an integer"},
      {"/ranks/0/peek", 1, "m.json: /ranks/0/peek: unknown key \"peek\""},
      {"/extra", 1, "m.json: /extra: unknown key \"extra\""},
      {"/ranks/0/timeline/1", Json::array({1}), "m.json: /ranks/0/timeline/1: expected [t_us, allocated_bytes]"},
      {"/ranks/0/timeline/2/0", 3, "m.json: /ranks/0/timeline/2/0: timeline goes back in time"},
      {"/ranks/0/events/kernel", -1, "m.json: /ranks/0/events/kernel: expected a count"},
      {"/ranks/1/pp_rank", 0, "m.json: /ranks/1/pp_rank: pp_rank 0 (dp_rank 0, cp_rank 0, tp_rank 0) appears twice"},
  };
  for (const auto& c : cases) {
    CAPTURE(c.pointer);
    Json j = good;
    j[Json::json_pointer(c.pointer)] = c.value;
    std::string e = ParseError(j);
    CHECK(e.starts_with(c.message));
    CHECK(e.find('\n') == std::string::npos);
#ifdef MEMPLAN_HAVE_VALIJSON
    // The schema agrees, except on what it cannot express (order, uniqueness).
    if (std::string(c.pointer) != "/ranks/0/timeline/2/0" && std::string(c.pointer) != "/ranks/1/pp_rank") {
      CHECK(SchemaErrors("schemas/measured.schema.json", j) != "");
    }
#endif
  }
  Json missing = good;
  missing["ranks"][0].erase("timeline");
  CHECK(ParseError(missing) == "m.json: /ranks/0: missing required key \"timeline\"");
  auto not_found = LoadMeasured(SourcePath("tests/data/check/no-such-file.json"));
  REQUIRE(!not_found.ok());
  CHECK(not_found.error().code == ErrorCode::kBadInput);
}

TEST_CASE("check passes exactly at the bounds with tolerance 0 and fails one byte beyond") {
  const PlanBounds plan = Bounds(1000, 800);
  CHECK(Passes(plan, OneRank("host", 1000, 800)));
  CHECK(Passes(plan, OneRank("host", 999, 800)));  // the allocator may beat its simulation
  CHECK_FALSE(Passes(plan, OneRank("host", 1001, 800)));
  CHECK_FALSE(Passes(plan, OneRank("host", 1000, 801)));
  CHECK_FALSE(Passes(plan, OneRank("host", 1000, 799)));  // below the lower bound: something was missed

  auto r = Check(plan, OneRank("host", 1001, 801));
  REQUIRE(r.ok());
  CHECK(r->tolerance == 0);
  CHECK(r->ranks[0].verdict == "FAIL: allocated 1 B over; peak 1 B over");
  r = Check(plan, OneRank("host", 1000, 799));
  CHECK(r->ranks[0].verdict == "FAIL: allocated 1 B below lower bound");
  // Exact at the extremes of int64.
  const int64_t big = INT64_MAX - 1;
  CHECK(Passes(Bounds(big, big), OneRank("host", big, big)));
  CHECK_FALSE(Passes(Bounds(big, big), OneRank("host", big + 1, big)));
}

TEST_CASE("check tolerance: 2 % on cuda by default, explicit override, range") {
  const PlanBounds plan = Bounds(1'000'000, 500'000);
  CHECK(Passes(plan, OneRank("cuda", 1'020'000, 510'000)));
  CHECK_FALSE(Passes(plan, OneRank("cuda", 1'020'001, 510'000)));
  CHECK_FALSE(Passes(plan, OneRank("cuda", 1'020'000, 510'001)));
  CHECK_FALSE(Passes(plan, OneRank("cuda", 1'000'000, 499'999)));  // the lower side has no tolerance
  CHECK_FALSE(Passes(plan, OneRank("host", 1'000'001, 500'000)));
  CHECK(Passes(plan, OneRank("host", 1'020'000, 510'000), 0.02));
  CHECK_FALSE(Passes(plan, OneRank("cuda", 1'020'000, 510'000), 0.0));
  for (double bad : {-0.1, 1.5, std::nan("")}) {
    auto r = Check(plan, OneRank("host", 1, 1), {bad});
    REQUIRE(!r.ok());
    CHECK(r.error().code == ErrorCode::kBadInput);
  }
}

TEST_CASE("check: digest mismatch and differing rank sets are errors") {
  Measured m = OneRank("host", 1000, 800);
  m.plan_digest = "sha256:" + std::string(64, 'b');
  auto r = Check(Bounds(1000, 800), m, {std::nullopt, "p.json", "m.json"});
  REQUIRE(!r.ok());
  CHECK(r.error().code == ErrorCode::kDigestMismatch);
  CHECK(r.error().message.starts_with("m.json: /plan_digest: "));
  CHECK(r.error().message.find("p.json: /digest") != std::string::npos);

  PlanBounds two = Bounds(1000, 800);
  two.ranks.push_back({1, 900, 700});
  r = Check(two, OneRank("host", 1000, 800), {std::nullopt, "p.json", "m.json"});
  REQUIRE(!r.ok());
  CHECK(r.error().code == ErrorCode::kBadInput);
  CHECK(r.error().message == "m.json: /ranks: pp ranks {0} differ from p.json: /ranks {0, 1}");
}

TEST_CASE("check table: units, verdicts, failures only") {
  PlanBounds plan = Bounds(1000, 800);
  plan.ranks.push_back({1, 900, 700});
  Measured m = OneRank("host", 1000, 800);
  m.ranks.push_back({1, 700, 901, 0, {}, {}, {}, {}, 0, 0, {}, {}});
  auto r = Check(plan, m);
  REQUIRE(r.ok());
  CHECK_FALSE(r->pass);
  std::string all = RenderCheckTable(*r);
  CHECK(all.find("peak(MiB)") != std::string::npos);
  CHECK(all.find("allocated(MiB)") != std::string::npos);
  CHECK(all.find("pass") != std::string::npos);
  CHECK(all.find("FAIL: peak 1 B over") != std::string::npos);
  std::string failures = RenderCheckTable(*r, true);
  CHECK(failures.find("pass") == std::string::npos);
  CHECK(failures.find("FAIL") != std::string::npos);
  r = Check(Bounds(int64_t{2} << 30, 1 << 30), OneRank("host", int64_t{2} << 30, 1 << 30));
  CHECK(RenderCheckTable(*r).find("peak(GiB)") != std::string::npos);
}

TEST_CASE("plan bounds and the check fixtures (what `memplan check` sees)") {
  const std::string dir = "tests/data/check/";
  auto plan = ParsePlanBounds(ReadJson(dir + "plan.json"), "plan.json");
  REQUIRE_MESSAGE(plan.ok(), plan.error().message);
  REQUIRE(plan->ranks.size() == 2);
  CHECK(plan->digest.starts_with("sha256:"));
  for (const auto& r : plan->ranks) CHECK(r.peak >= r.lower_bound);

  struct Case {
    const char* file;
    int code;  // the exit code memplan check gives
  };
  for (const Case& c : {Case{"measured-pass.json", 0}, Case{"measured-cuda-1pct.json", 0},
                        Case{"measured-peak-over.json", 1}, Case{"measured-below-bound.json", 1},
                        Case{"measured-digest.json", 4}, Case{"measured-missing-rank.json", 2},
                        Case{"measured-unknown-key.json", 2}, Case{"measured-bad-value.json", 2}}) {
    CAPTURE(c.file);
    int code = 0;
    auto m = LoadMeasured(SourcePath(dir + c.file));
    if (!m) {
      code = static_cast<int>(m.error().code);
    } else {
#ifdef MEMPLAN_HAVE_VALIJSON
      CHECK(SchemaErrors("schemas/measured.schema.json", ReadJson(dir + c.file)) == "");
#endif
      auto r = Check(*plan, *m);
      code = r ? (r->pass ? 0 : 1) : static_cast<int>(r.error().code);
    }
    CHECK(code == c.code);
  }
  auto m = LoadMeasured(SourcePath(dir + "measured-cuda-1pct.json"));
  REQUIRE(m.ok());
  auto tight = Check(*plan, *m, {0.005});
  REQUIRE(tight.ok());
  CHECK_FALSE(tight->pass);

  Json bad = ReadJson(dir + "plan.json");
  bad["ranks"][1].erase("lower_bound");
  auto e = ParsePlanBounds(bad, "plan.json");
  REQUIRE(!e.ok());
  CHECK(e.error().message == "plan.json: /ranks/1: missing required key \"lower_bound\"");
  bad = ReadJson(dir + "plan.json");
  bad["schema"] = "memplan.measured/1";
  e = ParsePlanBounds(bad, "plan.json");
  REQUIRE(!e.ok());
  CHECK(e.error().message.starts_with("plan.json: /schema: expected \"memplan.plan/1\""));
}

TEST_CASE("Chrome trace: metadata, spans, counters; the document parses and nests") {
  ChromeTrace t;
  t.AddRank(1);  // no events: still named
  t.AddSpan({0, Stream::kCompute, "layer0.fwd", "kernel", 0, 100, {{"microbatch", 0}}});
  t.AddSpan({0, Stream::kCompute, "layer0.attn.fwd", "kernel", 10, 40, {}});
  t.AddSpan({0, Stream::kCompute, "layer0.mlp.fwd", "kernel", 50, 50, {}});  // ends with its parent
  t.AddSpan({0, Stream::kD2H, "offload layer0.mlp.fc1_out@mb0", "memcpy", 30, 60, {{"bytes", 4096}}});
  t.AddSpan({0, Stream::kCompute, "layer1.fwd", "kernel", 100, 5, {}});  // starts as the last one ends
  t.AddCounter({0, 0, 100, 200, 150});
  t.AddCounter({0, 50, 300, 400, 350});

  Json doc = Json::parse(t.ToJson().dump());
  CHECK(doc["displayTimeUnit"] == "ms");
  REQUIRE(doc["traceEvents"].is_array());
  int process_names = 0, thread_names = 0, sort_indices = 0, spans = 0, counters = 0;
  int named_layer = 0, named_op = 0, copies = 0;
  for (const auto& e : doc["traceEvents"]) {
    const std::string ph = e["ph"];
    if (ph == "M" && e["name"] == "process_name") {
      ++process_names;
      CHECK(e["args"]["name"] == "pp rank " + std::to_string(e["pid"].get<int>() - 1));
    }
    if (ph == "M" && e["name"] == "thread_name") ++thread_names;
    if (ph == "M" && (e["name"] == "process_sort_index" || e["name"] == "thread_sort_index")) ++sort_indices;
    if (ph == "X") {
      ++spans;
      CHECK(e.contains("ts"));
      CHECK(e.contains("dur"));
      CHECK(e.contains("cat"));
      CHECK(e["pid"] == 1);
      if (e["name"] == "layer0.fwd") {
        ++named_layer;
        CHECK(e["args"]["microbatch"] == 0);
      }
      if (e["name"] == "layer0.attn.fwd") {
        ++named_op;
        CHECK_FALSE(e.contains("args"));
      }
      if (e["cat"] == "memcpy") {
        ++copies;
        CHECK(e["tid"] == ChromeTrace::Tid(Stream::kD2H));
      }
    }
    if (ph == "C") {
      ++counters;
      CHECK(e["name"] == "device_memory");
      CHECK(e["args"].contains("allocated"));
      CHECK(e["args"].contains("reserved"));
      CHECK(e["args"].contains("predicted"));
    }
  }
  CHECK(process_names == 2);
  CHECK(thread_names == 2 * kStreamCount);
  CHECK(sort_indices == 2 + 2 * kStreamCount);
  CHECK(spans == 5);
  CHECK(named_layer == 1);
  CHECK(named_op == 1);
  CHECK(copies == 1);
  CHECK(counters == 2);
  CHECK(ValidateNesting(doc).empty());
}

TEST_CASE("nesting validator rejects partial overlap and negative times") {
  auto x = [](int tid, double ts, double dur) {
    return Json{{"ph", "X"}, {"name", "k"}, {"pid", 1}, {"tid", tid}, {"ts", ts}, {"dur", dur}};
  };
  auto doc = [](Json events) { return Json{{"traceEvents", std::move(events)}}; };
  CHECK(ValidateNesting(doc({x(1, 0, 10), x(1, 2, 3), x(1, 5, 5), x(1, 10, 1)})).empty());
  CHECK(ValidateNesting(doc({x(1, 0, 10), x(2, 5, 10)})).empty());  // other stream
  auto errors = ValidateNesting(doc({x(1, 0, 10), x(1, 5, 10)}));
  REQUIRE(errors.size() == 1);
  CHECK(errors[0].find("/traceEvents/1: overlaps /traceEvents/0") == 0);
  CHECK(ValidateNesting(doc({x(1, 0, 10), x(1, 2, 3), x(1, 4, 7)})).size() == 1);  // overlaps the parent's end
  CHECK(ValidateNesting(doc({x(1, -1, 1)})).size() == 1);
  CHECK(ValidateNesting(doc({x(1, 1, -1)})).size() == 1);
  CHECK(ValidateNesting(doc({Json{{"ph", "C"}, {"name", "device_memory"}, {"pid", 1}, {"ts", -2}}})).size() == 1);
  CHECK(ValidateNesting(Json::object()).size() == 1);
  // The Trace Event format's bare array is a trace too, its paths without
  // /traceEvents; pid and tid are integers.
  CHECK(ValidateNesting(Json{x(1, 0, 10), x(1, 2, 3)}).empty());
  auto bare = ValidateNesting(Json{x(1, 0, 10), x(1, 5, 10)});
  REQUIRE(bare.size() == 1);
  CHECK(bare[0].find("/1: overlaps /0") == 0);
  Json text_tid = x(1, 0, 1);
  text_tid["tid"] = "main";
  auto typed = ValidateNesting(doc({text_tid}));
  REQUIRE(typed.size() == 1);
  CHECK(typed[0] == "/traceEvents/0/tid: expected an integer");
}

TEST_CASE("footprint: sort, ties, pools, releases, filters") {
  const uint64_t pool = 0x7000;
  std::vector<MemoryRecord> memory = {
      {0, 0xA, 100, MemoryOp::kAllocation, MemoryKind::kDevice, 0, 0, 0},          // cudaMalloc
      {10, 0xB, 200, MemoryOp::kAllocation, MemoryKind::kDevice, 0, pool, 1024},
      {20, 0xB, 0, MemoryOp::kRelease, MemoryKind::kDevice, 0, pool, 1024},         // tie: applied after C
      {20, 0xC, 300, MemoryOp::kAllocation, MemoryKind::kDevice, 0, pool, 1024},
      {30, 0xA, 0, MemoryOp::kRelease, MemoryKind::kDevice, 0, 0, 0},
      {35, 0xD, 5000, MemoryOp::kAllocation, MemoryKind::kPinned, 0, 0, 0},        // host memory: not counted
      {36, 0xE, 7000, MemoryOp::kAllocation, MemoryKind::kDevice, 1, 0, 0},        // another device
      {50, 0xC, 0, MemoryOp::kRelease, MemoryKind::kDevice, 0, pool, 512},
  };
  std::vector<PoolRecord> pools = {
      {5, pool, 0, PoolOp::kCreated, 0},
      {40, pool, 512, PoolOp::kTrimmed, 0},
      {60, pool, 0, PoolOp::kDestroyed, 0},
  };
  // Out of order on input, as CUPTI's per-thread buffers deliver them.
  std::mt19937 rng(7);
  std::shuffle(memory.begin(), memory.end(), rng);
  // Keep the tie's input order adversarial: the release before the allocation.
  std::stable_partition(memory.begin(), memory.end(), [](const MemoryRecord& r) { return r.op == MemoryOp::kRelease; });
  VectorRecordSource source;
  for (const auto& r : memory) source.Add(r);
  for (const auto& r : pools) source.Add(r);

  Footprint f = ReconstructFootprint(source, {0});
  CHECK(f.warnings.empty());
  CHECK(f.allocated_peak == 600);   // A + B + C at t = 20
  CHECK(f.reserved_peak == 1124);   // A + the 1 KiB pool
  CHECK(f.allocated_bytes == 0);
  CHECK(f.reserved_bytes == 0);
  REQUIRE(f.samples.size() == 9);
  auto earlier = [](const FootprintSample& a, const FootprintSample& b) { return a.timestamp_ns < b.timestamp_ns; };
  CHECK(std::is_sorted(f.samples.begin(), f.samples.end(), earlier));
  auto at = [&](int64_t t) {
    FootprintSample last{};
    for (const auto& s : f.samples) {
      if (s.timestamp_ns <= t) last = s;
    }
    return last;
  };
  CHECK(at(20).allocated_bytes == 400);
  CHECK(at(30).allocated_bytes == 300);
  CHECK(at(30).reserved_bytes == 1024);
  CHECK(at(40).reserved_bytes == 512);
  CHECK(at(50).allocated_bytes == 0);

  // Drained: a second reconstruction sees nothing.
  CHECK(ReconstructFootprint(source).samples.empty());

  // Without the device filter the other device's 7000 B count too.
  CHECK(ReconstructFootprint(memory, pools).allocated_peak == 7300);

  // A release without its allocation and a reused live address are reported.
  Footprint w = ReconstructFootprint({{1, 0xF, 0, MemoryOp::kRelease}, {2, 0x1, 8, MemoryOp::kAllocation},
                                      {3, 0x1, 16, MemoryOp::kAllocation}},
                                     {});
  CHECK(w.warnings.size() == 2);
  CHECK(w.allocated_bytes == 16);
  CHECK(w.allocated_peak == 16);
}

TEST_CASE("MEASURED.json sources: allocator, CUPTI bytes per rank, pool marks, the process") {
  // A file written before these fields existed reads as its run was made.
  Json old = Json::parse(MeasuredToJson(Sample()).dump());
  old.erase("source");
  auto back = ParseMeasured(old, "m.json");
  REQUIRE(back.ok());
  CHECK(back->source == "runtime");
  CHECK(AllocatorOf(*back) == "pool");  // Sample() is a cuda run
  Measured host = OneRank("host", 1000, 600);
  CHECK(AllocatorOf(host) == "arena");
  // Every new field round-trips and is schema-valid.
  Measured m = Sample();
  m.allocator = "pool";
  m.ranks[0].cupti = CuptiRankBytes{900, 1000, {{0, 100}, {5, 900}}, {}, {}};
  m.ranks[0].pool = PoolMarks{1000, 900};
  m.process = MeasuredProcess{2100, 500, 150};
  Json j = Json::parse(MeasuredToJson(m).dump());
  auto again = ParseMeasured(j, "m.json");
  REQUIRE(again.ok());
  CHECK(MeasuredToJson(*again).dump() == MeasuredToJson(m).dump());
#ifdef MEMPLAN_HAVE_VALIJSON
  CHECK(SchemaErrors("schemas/measured.schema.json", j) == "");
  CHECK(SchemaErrors("schemas/measured.schema.json", old) == "");
#endif
  // Bad input at its pointer.
  struct Case {
    const char* pointer;
    Json value;
    const char* message;
  } cases[] = {
      {"/allocator", "slab", "m.json: /allocator: expected one of arena|pool"},
      {"/source", "nsys", "m.json: /source: expected one of runtime|cupti-injection"},
      {"/ranks/0/cupti/reserved_peak", 10, "m.json: /ranks/0/cupti/reserved_peak: expected at least allocated_peak"},
      {"/ranks/0/pool/reserved_peak", 10, "m.json: /ranks/0/pool/reserved_peak: expected at least used_peak"},
      {"/ranks/0/cupti/extra", 1, "m.json: /ranks/0/cupti/extra: unknown key"},
      {"/process/context_bytes", -1, "m.json: /process/context_bytes: expected a byte count"},
      {"/allocator", "arena", "m.json: /ranks/0/pool: pool marks in a measurement whose allocator is \"arena\""},
  };
  for (const auto& c : cases) {
    CAPTURE(c.pointer);
    Json bad = j;
    bad[Json::json_pointer(c.pointer)] = c.value;
    std::string e = ParseError(bad);
    CAPTURE(e);
    CHECK(e.starts_with(c.message));
  }
}

TEST_CASE("check compares CUPTI's bytes with the allocator's, and the process total") {
  PlanBounds plan = Bounds(1000, 600);
  // Arena: CUPTI's live allocations are the arenas, exactly.
  Measured arena = OneRank("cuda", 1000, 600);
  arena.allocator = "arena";
  arena.ranks[0].cupti = CuptiRankBytes{1000, 1000, {}, {}, {}};
  auto r = Check(plan, arena, {});
  REQUIRE(r.ok());
  CHECK(r->tolerance == 0);
  CHECK(r->pass);
  CHECK(r->ranks[0].cupti_bytes == 1000);
  CHECK(RenderCheckTable(*r).find("cupti(MiB)") != std::string::npos);
  arena.ranks[0].cupti->allocated_peak = 1001;
  r = Check(plan, arena, {});
  REQUIRE(r.ok());
  CHECK_FALSE(r->pass);
  CHECK(r->ranks[0].verdict.find("CUPTI +1 B off the arena") != std::string::npos);
  // Pool: CUPTI's reserved bytes against the pool's mark, at 2 %.
  Measured pool = OneRank("cuda", 1000, 600);
  pool.ranks[0].cupti = CuptiRankBytes{600, 1015, {}, {}, {}};
  r = Check(plan, pool, {});
  REQUIRE(r.ok());
  CHECK(r->allocator == "pool");
  CHECK(r->pass);
  pool.ranks[0].cupti->reserved_peak = 1030;
  CHECK_FALSE(Passes(plan, pool));
  // The process: CUPTI's bytes are the ranks'; context and profiler are
  // reported, not counted.
  Measured proc = OneRank("host", 1000, 600);
  proc.process = MeasuredProcess{1000, 300, 200};
  r = Check(plan, proc, {});
  REQUIRE(r.ok());
  REQUIRE(r->process.has_value());
  CHECK(r->process->expected_bytes == 1000);
  CHECK(r->pass);
  CHECK(RenderCheckTable(*r).find("process: CUPTI") != std::string::npos);
  proc.process->device_bytes_peak = 1100;
  r = Check(plan, proc, {});
  REQUIRE(r.ok());
  CHECK_FALSE(r->pass);
  CHECK(r->process->verdict.find("+100 B") != std::string::npos);
}

TEST_CASE("footprint by owner: arenas by address range, pools by pool, the rest apart") {
  // Rank 0 owns an arena block [0x1000, 0x5000); rank 1 allocates from pool
  // 0xP; a cuBLAS-like workspace belongs to nobody.
  const uint64_t pool = 0xB0000;
  std::vector<MemoryRecord> memory = {
      {10, 0x1000, 0x4000, MemoryOp::kAllocation, MemoryKind::kDevice, 0, 0, 0},
      {20, 0xC0000, 1000, MemoryOp::kAllocation, MemoryKind::kDevice, 0, pool, 4096},
      {30, 0x90000, 512, MemoryOp::kAllocation, MemoryKind::kDevice, 0, 0, 0},
      {40, 0xC0000, 0, MemoryOp::kRelease, MemoryKind::kDevice, 0, pool, 4096},
      {50, 0x8000, 64, MemoryOp::kAllocation, MemoryKind::kPinned, 0, 0, 0},  // host: not device bytes
  };
  std::vector<PoolRecord> pools = {{5, pool, 0, PoolOp::kCreated, 0}, {60, pool, 0, PoolOp::kTrimmed, 0}};
  std::vector<OwnerRegions> regions = {{0, {{0x1000, 0x5000}}, {}, {}}, {1, {}, {pool}, {}}, {2, {}, {}, {}}};
  AttributedFootprint f = ReconstructByOwner(memory, pools, regions);
  REQUIRE(f.by_owner.size() == 3);
  CHECK(f.by_owner[0].allocated_peak == 0x4000);
  CHECK(f.by_owner[0].reserved_peak == 0x4000);
  CHECK(f.by_owner[1].allocated_peak == 1000);
  CHECK(f.by_owner[1].reserved_peak == 4096);
  CHECK(f.by_owner[1].reserved_bytes == 0);  // trimmed
  CHECK(f.by_owner[2].allocated_peak == 0);
  CHECK(f.unattributed.allocated_peak == 512);
  CHECK(f.total.allocated_peak == 0x4000 + 1000 + 512);
  CHECK(f.total.reserved_peak == 0x4000 + 4096 + 512);
  // Every device record is counted once: the owners plus the rest make the total.
  int64_t sum = f.unattributed.allocated_bytes;
  for (const auto& [o, fp] : f.by_owner) sum += fp.allocated_bytes;
  CHECK(sum == f.total.allocated_bytes);
  // Pool mode without the pool's base: the owner's allocation addresses
  // claim the pool, and with it the pool's events.
  std::vector<OwnerRegions> by_address = {{1, {}, {}, {0xC0000}}};
  AttributedFootprint g = ReconstructByOwner(memory, pools, by_address);
  CHECK(g.by_owner[1].reserved_peak == 4096);
  CHECK(g.by_owner[1].reserved_bytes == 0);
  CHECK(g.unattributed.allocated_peak == 0x4000 + 512);
}

TEST_CASE("a profile has one entry per device; check maps devices to ranks only when asked") {
  // Device 0: 1 MiB then 2 MiB live; device 1: a pool allocation.
  std::vector<MemoryRecord> memory = {
      {100, 0x1000, 1 << 20, MemoryOp::kAllocation, MemoryKind::kDevice, 0, 0, 0},
      {200, 0x900000, 2 << 20, MemoryOp::kAllocation, MemoryKind::kDevice, 0, 0, 0},
      {300, 0x1000, 0, MemoryOp::kRelease, MemoryKind::kDevice, 0, 0, 0},
      {150, 0xA000000, 4096, MemoryOp::kAllocation, MemoryKind::kDevice, 1, 0xA000000, 1 << 21, 7},
      {160, 0x5000, 64, MemoryOp::kAllocation, MemoryKind::kPinned, 0, 0, 0},
  };
  Measured m = ProfileFromRecords(memory, {});
  REQUIRE(m.ranks.size() == 2);
  CHECK(m.source == "cupti-injection");
  CHECK(m.plan_digest.empty());
  CHECK(m.ranks[0].pp_rank == 0);
  CHECK(m.ranks[0].allocated_peak == 3 << 20);
  CHECK(m.ranks[0].events["allocations"] == 2);
  CHECK(m.ranks[0].events["releases"] == 1);
  CHECK(m.ranks[0].timeline.front().t_us == 0);
  CHECK(m.ranks[1].allocated_peak == 4096);
  CHECK(m.ranks[1].peak == 1 << 21);
  // Every record of a device, in time order, with its address, size,
  // stream and kind; the pool allocation names its pool.
  REQUIRE(m.ranks[0].cupti.has_value());
  const auto& list = m.ranks[0].cupti->allocations;
  REQUIRE(list.size() == 4);
  CHECK(list[0].address == 0x1000);
  CHECK(list[0].bytes == 1 << 20);
  CHECK(list[1].kind == "pinned");
  CHECK(list[1].t_us == doctest::Approx(0.06));
  CHECK(list[3].release);
  CHECK(list[3].t_us == doctest::Approx(0.2));
  REQUIRE(m.ranks[1].cupti->allocations.size() == 1);
  CHECK(m.ranks[1].cupti->allocations[0].pool == 0xA000000);
  CHECK(m.ranks[1].cupti->allocations[0].stream == 7);
  // It is a valid MEASURED.json (no digest: a profile ran no plan), and the
  // lists round-trip with 64-bit addresses intact.
  m.ranks[1].cupti->allocations[0].address = 0xffff800000001000ull;
  m.ranks[1].cupti->allocations[0].stream = 4000000000;  // CUPTI stream ids are uint32
  m.ranks[1].cupti->pools.push_back({0.5, "trimmed", 0xA000000, 1 << 20});
  Json j = Json::parse(MeasuredToJson(m).dump());
  CHECK(j["ranks"][1]["cupti"]["allocations"][0]["address"] == "0xffff800000001000");
  auto back = ParseMeasured(j, "p.json");
  REQUIRE(back.ok());
  CHECK(MeasuredToJson(*back).dump() == MeasuredToJson(m).dump());
  Json bad = j;
  bad["ranks"][1]["cupti"]["allocations"][0]["address"] = "0xABC";
  CHECK(ParseError(bad).find("/ranks/1/cupti/allocations/0/address: expected an address") != std::string::npos);
  bad = j;
  bad["ranks"][1]["cupti"]["pools"][0]["op"] = "grown";
  CHECK(ParseError(bad).find("/ranks/1/cupti/pools/0/op") != std::string::npos);
#ifdef MEMPLAN_HAVE_VALIJSON
  CHECK(SchemaErrors("schemas/measured.schema.json", j) == "");
#endif
  // A runtime measurement still needs its digest.
  j["source"] = "runtime";
  CHECK(ParseError(j).starts_with("m.json: /plan_digest: expected \"sha256:\""));
  // check: devices stand for ranks in order, only with --ranks-from devices.
  PlanBounds plan{kDigest, {{0, 4 << 20, 3 << 20}, {1, 2 << 20, 4096}}};
  auto refused = Check(plan, m, {});
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.error().message.find("--ranks-from devices") != std::string::npos);
  CheckOptions o;
  o.ranks_from_devices = true;
  auto r = Check(plan, m, o);
  REQUIRE(r.ok());
  CHECK(r->source == "cupti-injection");
  CHECK(r->pass);
  CHECK(r->ranks[1].device == 1);
  CHECK(RenderCheckTable(*r).find("device") != std::string::npos);
  PlanBounds one{kDigest, {{0, 4 << 20, 3 << 20}}};
  auto counts = Check(one, m, o);
  REQUIRE_FALSE(counts.ok());
  CHECK(counts.error().message.find("2 devices profiled") != std::string::npos);
  auto runtime_with_flag = Check(Bounds(1000, 600), OneRank("host", 1000, 600), o);
  REQUIRE_FALSE(runtime_with_flag.ok());
}

TEST_CASE("a plan for Megatron is checked against a profile of its job: reserved plus NCCL, device by device") {
  // Two GPUs of one pipeline stage (dp 2): device 0 saw 3 MiB, device 1
  // 2 MiB; the plan predicts 2.9 MiB reserved + 0.1 MiB of NCCL buffers.
  std::vector<MemoryRecord> memory = {
      {100, 0x1000, 1 << 20, MemoryOp::kAllocation, MemoryKind::kDevice, 0, 0, 0},
      {200, 0x900000, 2 << 20, MemoryOp::kAllocation, MemoryKind::kDevice, 0, 0, 0},
      {150, 0xA00000, 2 << 20, MemoryOp::kAllocation, MemoryKind::kDevice, 1, 0, 0},
  };
  Measured m = ProfileFromRecords(memory, {});
  REQUIRE(m.ranks.size() == 2);
  PlanBounds plan{kDigest, {{0, 3 << 20, 2 << 20, (3 << 20) - (100 << 10), 100 << 10}}};
  plan.target = "megatron";
  plan.dp = 2;
  CheckOptions o;
  o.ranks_from_devices = true;
  auto r = Check(plan, m, o);
  REQUIRE(r.ok());
  REQUIRE(r->ranks.size() == 2);
  CHECK(r->tolerance == doctest::Approx(kFrameworkTolerance));
  CHECK(r->ranks[0].pass);
  CHECK(r->ranks[0].predicted_peak == 3 << 20);
  CHECK_FALSE(r->ranks[1].pass);  // 1 MiB under the prediction: a third off
  CHECK(r->ranks[1].verdict.find("off reserved + NCCL") != std::string::npos);
  CHECK_FALSE(r->pass);
  // A wider tolerance passes both; a memplan run cannot stand for the job;
  // three devices are neither the world (2) nor one per stage (1).
  o.tolerance = 0.5;
  CHECK(Check(plan, m, o)->pass);
  auto run = Check(plan, OneRank("host", 1000, 600), {});
  REQUIRE_FALSE(run.ok());
  CHECK(run.error().message.find("a plan for megatron is checked against a profile") != std::string::npos);
  memory.push_back({300, 0xB00000, 4096, MemoryOp::kAllocation, MemoryKind::kDevice, 2, 0, 0});
  auto three = Check(plan, ProfileFromRecords(memory, {}), o);
  REQUIRE_FALSE(three.ok());
  CHECK(three.error().message.find("3 devices profiled") != std::string::npos);
}

TEST_CASE("a cuda run whose CUPTI did not start fails check, unless it was run with --no-cupti") {
  const PlanBounds plan = Bounds(1'000'000, 500'000);
  Measured m = OneRank("cuda", 1'000'000, 500'000);
  m.allocator = "arena";
  m.cupti_status = "collected";
  CHECK(Passes(plan, m));
  m.cupti_status = "off";
  CHECK(Passes(plan, m));
  m.cupti_status = "unavailable";
  auto r = Check(plan, m, {});
  REQUIRE(r.ok());
  CHECK_FALSE(r->pass);
  CHECK(r->cupti_missing);
  CHECK(RenderCheckTable(*r, true).find("--no-cupti") != std::string::npos);
  // The field survives MEASURED.json and is refused with another value.
  Json j = Json::parse(MeasuredToJson(m).dump());
  auto back = ParseMeasured(j, "m.json");
  REQUIRE(back.ok());
  CHECK(back->cupti_status == "unavailable");
  j["cupti_status"] = "maybe";
  CHECK_FALSE(ParseMeasured(j, "m.json").ok());
}

TEST_CASE("an eager allocation timeline round-trips; a free of more than was allocated is refused") {
  Measured m = OneRank("host", 1'000'000, 500'000);
  m.allocator = "eager";
  m.ranks[0].allocation_timeline = {{0, 256, "layer0.x@mb0", "full"}, {3, -256, "layer0.x@mb0", "full"}};
  Json j = Json::parse(MeasuredToJson(m).dump());
  CHECK(j["measurement"] == "independent");
  auto back = ParseMeasured(j, "m.json");
  REQUIRE_MESSAGE(back.ok(), back.error().message);
  REQUIRE(back->ranks[0].allocation_timeline.size() == 2);
  CHECK(back->ranks[0].allocation_timeline[1].bytes == -256);
  j["ranks"][0]["allocation_timeline"][1][1] = -512;
  auto bad = ParseMeasured(j, "m.json");
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.error().message.find("/ranks/0/allocation_timeline/1/1") != std::string::npos);
}
