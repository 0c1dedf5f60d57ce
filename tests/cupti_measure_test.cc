// What `memplan run --backend cuda` makes of CUPTI's records (runtime/src/
// cupti_measure.h), fed synthetic records: two ranks in arena mode, one
// unplanned workspace, the context and profiler bytes.
#include <doctest/doctest.h>

#include "cupti_measure.h"
#include "memplan/traces/check.h"

using namespace memplan;
using namespace memplan::traces;

TEST_CASE("CUPTI records become per-rank bytes and the process total; check flags the unplanned") {
  const uint64_t a0 = 0x10000000, s0 = 0x20000000, a1 = 0x30000000, s1 = 0x40000000;
  VectorRecordSource source;
  // Each rank: a static arena and an activation arena (arena mode), made
  // once; a cuBLAS-like workspace outside any rank.
  source.Add(MemoryRecord{1000, s0, 300, MemoryOp::kAllocation, MemoryKind::kDevice, 0, 0, 0});
  source.Add(MemoryRecord{1100, a0, 700, MemoryOp::kAllocation, MemoryKind::kDevice, 0, 0, 0});
  source.Add(MemoryRecord{1200, s1, 200, MemoryOp::kAllocation, MemoryKind::kDevice, 0, 0, 0});
  source.Add(MemoryRecord{1300, a1, 500, MemoryOp::kAllocation, MemoryKind::kDevice, 0, 0, 0});
  source.Add(MemoryRecord{1400, 0x50000000, 64, MemoryOp::kAllocation, MemoryKind::kDevice, 0, 0, 0});
  runtime::CuptiMeasureInput in;
  in.regions = {{0, {{a0, a0 + 700}, {s0, s0 + 300}}, {}, {}}, {1, {{a1, a1 + 500}, {s1, s1 + 200}}, {}, {}}};
  in.context_bytes = 500 << 20;
  in.used_at_end = (500 << 20) + 1764 + 4096;
  Measured m;
  m.backend = "cuda";
  m.allocator = "arena";
  m.plan_digest = "sha256:" + std::string(64, 'b');
  m.ranks = {{0, 900, 1000, 300, {}, {}, {}, {}, 0, 0, {}, {}}, {1, 650, 700, 200, {}, {}, {}, {}, 0, 0, {}, {}}};
  runtime::AttachCupti(source, in, m);
  REQUIRE(m.ranks[0].cupti.has_value());
  REQUIRE(m.ranks[1].cupti.has_value());
  CHECK(m.ranks[0].cupti->allocated_peak == 1000);
  CHECK(m.ranks[1].cupti->allocated_peak == 700);
  CHECK(m.ranks[0].cupti->timeline.size() == 2);
  CHECK(m.ranks[0].cupti->timeline.front().t_us == 0);
  CHECK(m.ranks[1].cupti->timeline.back().t_us == doctest::Approx(0.3));
  REQUIRE(m.process.has_value());
  CHECK(m.process->device_bytes_peak == 1764);
  CHECK(m.process->context_bytes == 500 << 20);
  CHECK(m.process->profiler_bytes == 4096);
  // The plan: each rank's peak is its arenas. The ranks pass; the process
  // does not (64 B of device memory outside the plan).
  PlanBounds plan{m.plan_digest, {{0, 1000, 900}, {1, 700, 650}}};
  auto r = Check(plan, m, {});
  REQUIRE(r.ok());
  CHECK(r->ranks[0].pass);
  CHECK(r->ranks[1].pass);
  REQUIRE(r->process.has_value());
  CHECK_FALSE(r->process->pass);
  CHECK(r->process->verdict.find("+64 B") != std::string::npos);
  CHECK_FALSE(r->pass);
  // The plan's CUDA context item against the context the run measured
  // (informational; docs/accounting.md section 9b): none for a host plan.
  CHECK(RenderCheckTable(*r, false).find("outside the framework") == std::string::npos);
  plan.cuda_context = 400 << 20;
  auto with_item = Check(plan, m, {});
  REQUIRE(with_item.ok());
  CHECK(RenderCheckTable(*with_item, false).find("CUDA context measured 500.0 MiB, planned 400.0 MiB (+25.0 %") !=
        std::string::npos);
  // The measurement round-trips with its CUPTI objects.
  Json j = Json::parse(MeasuredToJson(m).dump());
  auto back = ParseMeasured(j, "m.json");
  REQUIRE(back.ok());
  CHECK(MeasuredToJson(*back).dump() == MeasuredToJson(m).dump());
}

TEST_CASE("CUPTI bytes share the run's time axis and sit in TRACE.json beside the prediction") {
  const uint64_t a0 = 0x10000000;
  VectorRecordSource source;
  // The arena is made before the step (set-up), the rest after the epoch.
  source.Add(MemoryRecord{1000, a0, 700, MemoryOp::kAllocation, MemoryKind::kDevice, 0, 0, 0});
  source.Add(MemoryRecord{9000, a0 + 4096, 100, MemoryOp::kAllocation, MemoryKind::kDevice, 0, 0, 0});
  runtime::CuptiMeasureInput in;
  in.regions = {{0, {{a0, a0 + (1 << 20)}}, {}, {}}};
  in.epoch_ns = 5000;
  Measured m;
  m.ranks = {{0, 800, 800, 0, {}, {}, {}, {}, 0, 0, {}, {}}};
  runtime::AttachCupti(source, in, m);
  REQUIRE(m.ranks[0].cupti.has_value());
  const auto& tl = m.ranks[0].cupti->timeline;
  REQUIRE(tl.size() == 2);
  CHECK(tl[0].t_us == 0);                          // before the epoch: at time 0
  CHECK(tl[1].t_us == doctest::Approx(4.0));       // (9000 - 5000) ns
  CHECK(tl[1].allocated_bytes == 800);

  GpuActivity k;
  k.name = "gemm";
  k.start_ns = 6000;
  k.end_ns = 8000;
  k.stream_id = 3;
  k.external_id = 1;
  ChromeTrace trace;
  GpuTimelineInput gt{{{3, 0, "compute"}}, {{0, "layer0.fwd@mb0"}}, in.epoch_ns};
  GpuTimelineCounts n = runtime::AddCuptiTrace({k}, gt, m, trace);
  CHECK(n.spans == 1);
  CHECK(n.with_op == 1);
  Json doc = Json::parse(trace.ToJson().dump());
  int cupti_samples = 0, spans = 0;
  for (const auto& e : doc["traceEvents"]) {
    if (e["ph"] == "C" && e["name"] == "cupti_device_memory") ++cupti_samples;
    if (e["ph"] == "X") {
      ++spans;
      CHECK(e["name"] == "layer0.fwd@mb0");
      CHECK(e["ts"].get<double>() == doctest::Approx(1.0));
    }
  }
  CHECK(cupti_samples == 2);
  CHECK(spans == 1);
}
