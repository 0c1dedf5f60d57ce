// `memplan calibrate`: measures, on this machine and backend, the numbers
// the planner's time model uses (docs/planner.md, "Calibration"), and
// writes them as a hardware description (memplan.hardware/1) that a model
// file names with hardware.calibration.
//
//   bf16_flops      GEMM rate of the kernels the backend runs (fp32 SGEMM on
//                   both backends today; the field keeps its name)
//   hbm_bw          device memory bandwidth: an elementwise add, 3 words moved
//                   per element
//   d2h_bw, h2d_bw  device <-> host arena copies on the copy queues
//   peer_bw, pp_link_bw  device -> device copies on the link queue
//   efficiency.gemm_k_half  (cuda) the reduction depth at which a GEMM runs
//                   at half its large-shape rate: GEMMs with k = 128 and 512
//   launch_s        the fixed cost of one op in `memplan run`: a small model
//                   planned with the rates above and executed; the time the
//                   roofline does not explain, divided by its ops
#pragma once

#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "memplan/common/json_util.h"
#include "memplan/common/status.h"
#include "memplan/planner/model.h"
#include "memplan/runtime/executor.h"

namespace memplan::runtime {

struct CalibrateOptions {
  BackendKind backend = BackendKind::kHost;
  // Each probe repeats until it has run this long (at least 3 times).
  double probe_seconds = 0.2;
  std::function<void(std::string_view line)> progress;
};

struct Probe {
  std::string name;   // "gemm", "add", "d2h", "h2d", "link", "launch"
  std::string what;   // the measured operation, in words
  double value = 0;   // in `unit`
  std::string unit;   // "FLOP/s", "B/s", "s"
  double seconds = 0;  // best time of one repeat
  int64_t repeats = 0;
};

struct Calibration {
  std::string backend;  // "host" | "cuda"
  std::string device;   // the backend's device name
  planner::Hardware hardware;
  std::vector<Probe> probes;
};

Expected<Calibration> Calibrate(const CalibrateOptions& options);

// memplan.hardware/1 (schemas/hardware.schema.json).
OrderedJson CalibrationToJson(const Calibration& c);

}  // namespace memplan::runtime
