// memplan calibrate (calibrate.h): each probe on the backend's own devices,
// kernels and copy queues, timed as the best of its repeats.
#include "memplan/runtime/calibrate.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <memory>
#include <utility>
#include <vector>

#include "memplan/planner/plan.h"
#include "memplan/runtime/backend.h"
#include "memplan/runtime/cuda_plugin.h"

namespace memplan::runtime {
namespace {

using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// Runs `once` until `budget` seconds have passed, at least 3 times; the best
// repeat is the measurement (the least disturbed by the rest of the machine).
template <class F>
std::pair<double, int64_t> Repeat(double budget, F&& once) {
  double best = std::numeric_limits<double>::infinity();
  int64_t n = 0;
  auto start = Clock::now();
  do {
    auto t = Clock::now();
    once();
    best = std::min(best, Since(t));
    ++n;
  } while (n < 3 || Since(start) < budget);
  return {best, n};
}

class Prober {
 public:
  Prober(Backend& backend, const CalibrateOptions& options) : backend_(backend), options_(options) {}

  Expected<std::monostate> Kernels(Calibration& c) {
    const bool cuda = options_.backend == BackendKind::kCuda;
    // GEMM shape [m, k] x [k, n]: a large square one on a GPU; on the host,
    // the sizes its runnable models have (128 tokens, hidden 64, a 256-wide
    // projection), where the reference kernel runs slower than on big ones.
    const int64_t gm = cuda ? 4096 : 128, gk = cuda ? 4096 : 64, gn = cuda ? 4096 : 256;
    const int64_t n = std::max({gm, gk, gn});
    const int64_t elems = cuda ? int64_t{64} << 20 : int64_t{4} << 20;  // add, floats
    const int64_t gemm_bytes = n * n * 4;
    const int64_t bytes = 3 * std::max(gemm_bytes, elems * 4) + kernels::GemmWorkspaceBytes() +
                          kernels::KernelScratchBytes() + (int64_t{1} << 20);
    auto dev = backend_.MakeDevice("calibrate", bytes, 256);
    if (!dev) return dev.error();
    Device& d = **dev;
    std::vector<Buffer> held;
    auto alloc = [&](int64_t b) -> Expected<Buffer> {
      auto buf = d.Allocate(b);
      if (buf) held.push_back(*buf);
      return buf;
    };
    auto ws = alloc(kernels::GemmWorkspaceBytes());
    auto scratch = alloc(kernels::KernelScratchBytes());
    if (!ws || !scratch) return Error{ErrorCode::kRuntime, "calibrate: cannot allocate the kernels' buffers"};
    std::unique_ptr<kernels::Ops> ops = backend_.MakeOps(d, OpsMemory{*ws, *scratch});
    const int64_t len = std::max(n * n, elems);
    std::vector<float> init(static_cast<size_t>(len));
    for (size_t i = 0; i < init.size(); ++i) init[i] = 0.5f + static_cast<float>((i * 2654435761u) % 1000) / 1000.0f;
    Buffer x[3];
    for (auto& b : x) {
      auto buf = alloc(len * 4);
      if (!buf) return buf.error();
      b = *buf;
      backend_.FromHost(d, b.ptr, init.data(), len * 4);
    }
    auto f = [](const Buffer& b) { return reinterpret_cast<float*>(b.ptr); };
    backend_.Finish(d);
    {
      auto [s, reps] = Repeat(options_.probe_seconds, [&] {
        ops->Gemm(false, false, gm, gn, gk, 1.0f, f(x[0]), f(x[1]), 0.0f, f(x[2]), nullptr);
        backend_.Finish(d);
      });
      double flops = 2.0 * static_cast<double>(gm) * static_cast<double>(gn) * static_cast<double>(gk);
      c.hardware.bf16_flops = flops / s;
      c.probes.push_back({"gemm",
                          "fp32 GEMM [" + std::to_string(gm) + ", " + std::to_string(gk) + "] x [" + std::to_string(gk) +
                              ", " + std::to_string(gn) + "]",
                          flops / s, "FLOP/s", s, reps});
      Report(c.probes.back());
      if (cuda) {
        // The time model's shape curve (docs/planner.md, "Time model"): the
        // same GEMM with a short reduction, whose main loop is dominated by
        // its prologue and epilogue. Each gives efficiency.gemm_k_half =
        // k (rate / rate_k - 1); the model takes their mean. Efficiency is
        // relative to the large GEMM, whose rate is bf16_flops.
        double sum = 0;
        int fits = 0;
        for (int64_t k : {int64_t{128}, int64_t{512}}) {
          auto [sk, repk] = Repeat(options_.probe_seconds, [&] {
            ops->Gemm(false, false, gm, gn, k, 1.0f, f(x[0]), f(x[1]), 0.0f, f(x[2]), nullptr);
            backend_.Finish(d);
          });
          const double fk = 2.0 * static_cast<double>(gm) * static_cast<double>(gn) * static_cast<double>(k);
          const double rate = fk / sk;
          c.probes.push_back({"gemm-k" + std::to_string(k),
                              "fp32 GEMM [" + std::to_string(gm) + ", " + std::to_string(k) + "] x [" + std::to_string(k) +
                                  ", " + std::to_string(gn) + "]: the reduction's fill",
                              rate, "FLOP/s", sk, repk});
          Report(c.probes.back());
          if (rate > 0 && rate < c.hardware.bf16_flops) {
            sum += static_cast<double>(k) * (c.hardware.bf16_flops / rate - 1);
            ++fits;
          }
        }
        if (fits > 0) c.hardware.efficiency.gemm_k_half = sum / fits;
      }
    }
    {
      auto [s, reps] = Repeat(options_.probe_seconds, [&] {
        ops->Add(f(x[0]), f(x[1]), elems, f(x[2]));
        backend_.Finish(d);
      });
      double moved = 12.0 * static_cast<double>(elems);
      c.hardware.hbm_bw = moved / s;
      c.probes.push_back({"add", "elementwise add of " + std::to_string(elems) + " floats (3 words each)", moved / s,
                          "B/s", s, reps});
      Report(c.probes.back());
    }
    ops.reset();
    for (const Buffer& b : held) d.Free(b);
    return std::monostate{};
  }

  Expected<std::monostate> Copies(Calibration& c) {
    const int64_t bytes = int64_t{64} << 20;
    auto a = backend_.MakeDevice("calibrate-a", bytes + (1 << 20), 256);
    auto b = backend_.MakeDevice("calibrate-b", bytes + (1 << 20), 256);
    auto host = backend_.MakeHostArena("calibrate-host", bytes + (1 << 20));
    if (!a) return a.error();
    if (!b) return b.error();
    if (!host) return host.error();
    auto src = (*a)->Allocate(bytes);
    auto dst = (*b)->Allocate(bytes);
    auto h = (*host)->Allocate(bytes);
    if (!src || !dst || !h) return Error{ErrorCode::kRuntime, "calibrate: cannot allocate the copy buffers"};
    std::vector<std::byte> zeros(static_cast<size_t>(bytes), std::byte{1});
    backend_.FromHost(**a, src->ptr, zeros.data(), bytes);
    backend_.Finish(**a);
    auto copy = [&](const char* name, const char* what, void* to, const void* from, Queue q, double* field) {
      auto [s, reps] = Repeat(options_.probe_seconds, [&] {
        Event e = (*a)->CopyAsync(to, from, bytes, q);
        (*a)->Wait(e);
      });
      *field = static_cast<double>(bytes) / s;
      c.probes.push_back({name, what, *field, "B/s", s, reps});
      Report(c.probes.back());
    };
    copy("d2h", "64 MiB device -> host arena on the d2h queue", h->ptr, src->ptr, Queue::kD2H, &c.hardware.d2h_bw);
    copy("h2d", "64 MiB host arena -> device on the h2d queue", src->ptr, h->ptr, Queue::kH2D, &c.hardware.h2d_bw);
    copy("link", "64 MiB device -> another device on the link queue", dst->ptr, src->ptr, Queue::kLink,
         &c.hardware.pp_link_bw);
    c.hardware.peer_bw = c.hardware.pp_link_bw;
    (*host)->Free(*h);
    (*b)->Free(*dst);
    (*a)->Free(*src);
    return std::monostate{};
  }

  // The GEMM rate and the per-op cost as `memplan run` meets them: two
  // dense probe models (one small enough that op costs dominate, one whose
  // GEMMs dominate) executed by the executor, and (bf16_flops, launch_s)
  // solved so that the time model predicts both measured compute times.
  // The kernel probes above time a kernel alone, hot in cache; inside a
  // step the same GEMM runs slower and every op carries the runtime's work.
  Expected<std::monostate> Fit(Calibration& c) {
    struct ProbeModel {
      const char* name;
      int64_t hidden, heads, ffn, vocab, seq, micro_batch;
      double measured_s = 0;
      int64_t repeats = 0;
      double launches = 0;
      double roofline_s = 0;  // predicted at the kernel probe's rate, launch_s 0
    };
    ProbeModel models[2] = {{"launch", 32, 2, 64, 64, 16, 1}, {"gemm-step", 128, 4, 256, 256, 64, 2}};
    auto plan_of = [&](const ProbeModel& pm, double flops, double launch_s) -> Expected<Json> {
      planner::Hardware hw = c.hardware;
      hw.bf16_flops = flops;
      hw.launch_s = launch_s;
      Json j{{"schema", "memplan.model/1"},
             {"name", std::string("calibration-") + pm.name},
             {"arch", {{"layers", 2}, {"hidden", pm.hidden}, {"heads", pm.heads}, {"ffn_hidden", pm.ffn},
                       {"vocab", pm.vocab}, {"ffn_act", "swiglu"}, {"norm", "rmsnorm"}}},
             {"train", {{"seq_len", pm.seq}, {"micro_batch", pm.micro_batch}, {"microbatches", 2},
                        {"act_dtype", "fp32"}, {"param_dtype", "fp32"}, {"grad_dtype", "fp32"},
                        {"optimizer", "adam"}}},
             {"parallel", {{"pp", 1}}},
             {"hardware", planner::HardwareJson(hw)}};
      auto m = planner::ParseModel(j, std::string("calibration-") + pm.name);
      if (!m) return m.error();
      auto p = planner::BuildPlan(*m);
      if (!p) return p.error();
      return Json::parse(planner::PlanToJson(*p).dump());
    };
    auto predicted = [&](const ProbeModel& pm, double flops, double launch_s) -> Expected<double> {
      auto plan = plan_of(pm, flops, launch_s);
      if (!plan) return plan.error();
      return (*plan)["overhead"]["emulated_s"].get<double>();
    };
    const double f0 = c.hardware.bf16_flops;
    constexpr double kUnit = 1e-3;  // launches: the prediction's growth per second of launch_s
    RunOptions run;
    run.backend = options_.backend;
    run.cupti = false;
    for (ProbeModel& pm : models) {
      auto plan = plan_of(pm, f0, 0);
      auto unit = predicted(pm, f0, kUnit);
      if (!plan) return plan.error();
      if (!unit) return unit.error();
      pm.roofline_s = (*plan)["overhead"]["emulated_s"].get<double>();
      pm.launches = std::round((*unit - pm.roofline_s) / kUnit);
      run.plan_file = std::string("calibration-") + pm.name;
      // The median step, as a user's single `memplan run` most likely sees
      // it (the best one is rarer on a shared machine).
      std::vector<double> times;
      auto start = Clock::now();
      do {
        auto r = RunPlan(*plan, run);
        if (!r) return r.error();
        times.push_back(r->measured.compute_s);
      } while (times.size() < 5 || Since(start) < 8 * options_.probe_seconds);
      std::sort(times.begin(), times.end());
      pm.repeats = static_cast<int64_t>(times.size());
      pm.measured_s = times[times.size() / 2];
    }
    // launch_s: what the small step's roofline (at the kernel probe's rate:
    // its GEMMs are as small and hot) leaves unexplained, per launch. Then
    // the GEMM rate at which the GEMM-heavy step is predicted exactly: the
    // prediction falls as the rate grows, so bisect on its logarithm.
    const double launch_s = std::max(0.0, (models[0].measured_s - models[0].roofline_s) / models[0].launches);
    double lo = std::max(1e6, f0 / 20), hi = f0 * 20;  // the model format takes >= 1 MFLOP/s
    for (int i = 0; i < 40; ++i) {
      double mid = std::sqrt(lo * hi);
      auto p = predicted(models[1], mid, launch_s);
      if (!p) return p.error();
      (*p > models[1].measured_s ? lo : hi) = mid;
    }
    const double flops = std::sqrt(lo * hi);
    c.hardware.bf16_flops = flops;
    c.hardware.launch_s = launch_s;
    for (const ProbeModel& pm : models) {
      c.probes.push_back({std::string("step-") + pm.name,
                          std::string("forwards and backwards of a 2-layer dense model, hidden ") +
                              std::to_string(pm.hidden) + ", " + std::to_string(pm.seq * pm.micro_batch) +
                              " tokens (" + std::to_string(static_cast<int64_t>(pm.launches)) + " op launches)",
                          pm.measured_s, "s (median)", pm.measured_s, pm.repeats});
      Report(c.probes.back());
    }
    c.probes.push_back({"fit-launch", "per-op cost: the small step less its roofline, per launch", launch_s, "s", 0, 1});
    c.probes.push_back({"fit-gemm", "GEMM rate at which the GEMM-heavy step is predicted exactly", flops, "FLOP/s", 0, 1});
    Report(c.probes[c.probes.size() - 2]);
    Report(c.probes.back());
    return std::monostate{};
  }

 private:
  void Report(const Probe& p) {
    if (!options_.progress) return;
    char line[256];
    std::snprintf(line, sizeof line, "calibrate: %-6s %12.4g %-7s (%s; best of %lld)", p.name.c_str(), p.value,
                  p.unit.c_str(), p.what.c_str(), static_cast<long long>(p.repeats));
    options_.progress(line);
  }

  Backend& backend_;
  const CalibrateOptions& options_;
};

}  // namespace

Expected<Calibration> Calibrate(const CalibrateOptions& options) {
  std::unique_ptr<Backend> backend;
  if (options.backend == BackendKind::kCuda) {
    auto plugin = LoadCudaPlugin();
    if (!plugin) return plugin.error();
    backend = (*plugin)->make_backend(true);
    if (!backend) return Error{ErrorCode::kRuntime, "--backend cuda: no CUDA device is visible"};
  } else {
    backend = MakeHostBackend();
  }
  Calibration c;
  c.backend = std::string(BackendName(options.backend));
  c.device = backend->device_name();
  std::string preset = "host";
  if (options.backend == BackendKind::kCuda) {
    preset = c.device.find("H200") != std::string::npos   ? "h200"
             : c.device.find("B200") != std::string::npos ? "b200"
                                                          : "h100";
  }
  c.hardware = *planner::HardwarePreset(preset);
  if (options.backend == BackendKind::kCuda) {
    // The CUDA context: device bytes in use once the backend holds it and
    // before anything is allocated (cudaMemGetInfo; on a GPU no other
    // process uses). It replaces the preset's estimate
    // (docs/accounting.md section 9b); NCCL's items stay estimates.
    const int64_t context = backend->DeviceBytesInUse();
    if (context > 0) {
      c.hardware.runtime.cuda_context = context;
      c.probes.push_back({"cuda_context", "device bytes in use after the CUDA context is created", static_cast<double>(context),
                          "B", 0, 1});
    }
  }
  try {
    Prober probe(*backend, options);
    if (auto s = probe.Kernels(c); !s) return s.error();
    if (auto s = probe.Copies(c); !s) return s.error();
    backend.reset();  // the step probes run the executor, which makes its own
    if (auto s = probe.Fit(c); !s) return s.error();
  } catch (const ErrorException& e) {
    return e.error();
  }
  return c;
}

OrderedJson CalibrationToJson(const Calibration& c) {
  OrderedJson hw = OrderedJson::parse(planner::HardwareJson(c.hardware).dump());
  hw["launch_s"] = c.hardware.launch_s;
  OrderedJson probes = OrderedJson::array();
  for (const Probe& p : c.probes) {
    probes.push_back({{"name", p.name}, {"what", p.what}, {"value", p.value}, {"unit", p.unit},
                      {"seconds", p.seconds}, {"repeats", p.repeats}});
  }
  return {{"schema", "memplan.hardware/1"}, {"backend", c.backend}, {"device", c.device}, {"hardware", hw},
          {"probes", probes}};
}

}  // namespace memplan::runtime
