// TRACE.json's GPU side (traces/gpu_timeline.h), fed activities as CUPTI
// would give them: lanes per rank, ops by external id, work before the
// epoch, a stream no rank owns; the document must parse and nest.
#include <doctest/doctest.h>

#include <map>
#include <string>

#include "memplan/traces/chrome_trace.h"
#include "memplan/traces/gpu_timeline.h"

using namespace memplan;
using namespace memplan::traces;

namespace {

GpuActivity Kernel(std::string name, int64_t start, int64_t end, int32_t stream, uint32_t corr, uint64_t ext) {
  GpuActivity a;
  a.name = std::move(name);
  a.start_ns = start;
  a.end_ns = end;
  a.stream_id = stream;
  a.correlation_id = corr;
  a.external_id = ext;
  return a;
}

}  // namespace

TEST_CASE("GPU timeline: spans on their streams, under their ranks, named by their ops") {
  const int64_t epoch = 1'000'000;
  GpuTimelineInput in;
  in.epoch_ns = epoch;
  in.lanes = {{11, 0, "compute"}, {12, 0, "d2h"}, {21, 1, "compute"}, {-1, 1, "unknown to CUPTI"}};
  in.ops = {{0, "layer0.attn.fwd@mb0"}, {1, "layer2.mlp.fwd@mb0"}};
  std::vector<GpuActivity> acts = {
      Kernel("weight_init", 10, 500, 11, 1, 0),                            // before the epoch
      Kernel("sgemm_128x64", epoch + 1000, epoch + 3000, 11, 2, 1),       // rank 0 compute, op 1
      Kernel("softmax", epoch + 3000, epoch + 3500, 11, 3, 1),            // back to back
      Kernel("sgemm_128x64", epoch + 2000, epoch + 6000, 21, 4, 2),       // rank 1 compute, op 2
      Kernel("nccl_like", epoch + 100, epoch + 200, 99, 5, 0),            // nobody's stream, no op
      Kernel("cublas_internal", epoch + 7000, epoch + 7100, 98, 6, 2),    // unknown stream, op 2 -> rank 1
      Kernel("straddles", epoch - 500, epoch + 500, 12, 7, 0),            // clipped at the epoch
  };
  acts[6].kind = GpuActivity::Kind::kMemcpy;
  acts[6].name = "memcpy DtoH";
  acts[6].bytes = 4096;
  ChromeTrace trace;
  GpuTimelineCounts n = AddGpuTimeline(acts, in, trace);
  CHECK(n.before_epoch == 1);
  CHECK(n.spans == 6);
  CHECK(n.with_op == 4);
  CHECK(n.unowned == 1);

  Json doc = Json::parse(trace.ToJson().dump());
  CHECK(ValidateNesting(doc).empty());
  std::map<std::pair<int64_t, int64_t>, std::string> threads;
  std::map<int64_t, std::string> processes;
  int spans = 0;
  std::map<std::string, int> seen;  // kernel (sgemm: @pid) -> spans
  for (const auto& e : doc["traceEvents"]) {
    if (e["ph"] == "M" && e["name"] == "thread_name") threads[{e["pid"], e["tid"]}] = e["args"]["name"];
    if (e["ph"] == "M" && e["name"] == "process_name") processes[e["pid"]] = e["args"]["name"];
    if (e["ph"] != "X") continue;
    ++spans;
    const std::string kernel = e["args"]["kernel"];
    const std::string thread = threads.at({e["pid"], e["tid"]});
    ++seen[kernel == "sgemm_128x64" ? kernel + "@" + std::to_string(e["pid"].get<int>()) : kernel];
    if (kernel == "softmax") {
      CHECK(e["pid"] == ChromeTrace::Pid(0));
      CHECK(thread == "gpu compute");
      CHECK(e["name"] == "layer0.attn.fwd@mb0");
      CHECK(e["cat"] == "gpu_kernel");
      CHECK(e["ts"].get<double>() == doctest::Approx(3.0));
      CHECK(e["dur"].get<double>() == doctest::Approx(0.5));
      CHECK(e["args"]["correlation"] == 3);
    } else if (kernel == "sgemm_128x64" && e["pid"] == ChromeTrace::Pid(1)) {
      CHECK(thread == "gpu compute");
      CHECK(e["name"] == "layer2.mlp.fwd@mb0");
    } else if (kernel == "cublas_internal") {
      CHECK(e["pid"] == ChromeTrace::Pid(1));
      CHECK(thread == "gpu stream 98");
    } else if (kernel == "nccl_like") {
      CHECK(e["pid"] == ChromeTrace::kUnownedPid);
      CHECK(e["name"] == "nccl_like");
    } else if (kernel == "memcpy DtoH") {
      CHECK(thread == "gpu d2h");
      CHECK(e["cat"] == "gpu_memcpy");
      CHECK(e["ts"].get<double>() == 0);
      CHECK(e["dur"].get<double>() == doctest::Approx(0.5));
      CHECK(e["args"]["bytes"] == 4096);
    }
  }
  CHECK(spans == 6);
  CHECK(seen["softmax"] == 1);
  CHECK(seen["sgemm_128x64@" + std::to_string(ChromeTrace::Pid(1))] == 1);
  CHECK(seen["cublas_internal"] == 1);
  CHECK(seen["nccl_like"] == 1);
  CHECK(seen["memcpy DtoH"] == 1);
  CHECK(processes.at(ChromeTrace::kUnownedPid) == "GPU work no rank owns");
  CHECK(processes.at(ChromeTrace::Pid(1)) == "pp rank 1");
  // Named lanes come first on each rank, in their order, from kGpuTidBase.
  CHECK(threads.at({ChromeTrace::Pid(0), kGpuTidBase}) == "gpu compute");
  CHECK(threads.at({ChromeTrace::Pid(0), kGpuTidBase + 1}) == "gpu d2h");
  CHECK(threads.at({ChromeTrace::Pid(1), kGpuTidBase}) == "gpu compute");
  CHECK(threads.at({ChromeTrace::Pid(1), kGpuTidBase + 1}) == "gpu stream 98");
}

TEST_CASE("GPU timeline: CUPTI's memory counter sits beside the predicted one") {
  ChromeTrace trace;
  trace.AddCounter({0, 5, 100, 200, 150});
  trace.AddCuptiCounter(0, 7, 4096);
  trace.AddCuptiCounter(0, 2, 1024);
  Json doc = Json::parse(trace.ToJson().dump());
  CHECK(ValidateNesting(doc).empty());
  std::vector<double> cupti_ts;
  int predicted = 0;
  for (const auto& e : doc["traceEvents"]) {
    if (e["ph"] != "C") continue;
    CHECK(e["pid"] == ChromeTrace::Pid(0));
    if (e["name"] == "cupti_device_memory") {
      cupti_ts.push_back(e["ts"]);
      CHECK(e["args"].size() == 1);
      CHECK((e["args"]["cupti"] == 1024 || e["args"]["cupti"] == 4096));
    } else {
      ++predicted;
      CHECK(e["args"]["predicted"] == 150);
    }
  }
  CHECK(predicted == 1);
  CHECK(cupti_ts == std::vector<double>{2, 7});
}

TEST_CASE("GPU timeline of a profile: activities go under their devices, one thread per stream") {
  GpuTimelineInput in;
  in.by_device = true;
  in.epoch_ns = 100;
  std::vector<GpuActivity> acts = {Kernel("k0", 200, 300, 7, 1, 0), Kernel("k1", 400, 500, 7, 2, 0),
                                   Kernel("k2", 250, 450, 3, 3, 0)};
  acts[2].device_id = 1;
  ChromeTrace trace;
  trace.SetProcessLabel("device");
  GpuTimelineCounts n = AddGpuTimeline(acts, in, trace);
  CHECK(n.spans == 3);
  CHECK(n.unowned == 0);
  Json doc = Json::parse(trace.ToJson().dump());
  CHECK(ValidateNesting(doc).empty());
  std::map<int64_t, std::string> processes;
  int on_device1 = 0;
  for (const auto& e : doc["traceEvents"]) {
    if (e["ph"] == "M" && e["name"] == "process_name") processes[e["pid"]] = e["args"]["name"];
    if (e["ph"] == "X" && e["pid"] == ChromeTrace::Pid(1)) {
      ++on_device1;
      CHECK(e["name"] == "k2");
    }
  }
  CHECK(on_device1 == 1);
  CHECK(processes.at(ChromeTrace::Pid(0)) == "device 0");
  CHECK(processes.at(ChromeTrace::Pid(1)) == "device 1");
}
