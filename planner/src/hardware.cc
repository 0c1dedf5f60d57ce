// Hardware presets and the model file's `hardware` object
// (docs/accounting.md, "Hardware presets"; docs/planner.md, "Time model").
#include "memplan/planner/model.h"

#include "model_internal.h"

#include <algorithm>

#include "memplan/common/schema.h"
#include "memplan/common/units.h"

namespace memplan::planner {

Expected<Hardware> HardwarePreset(std::string_view name) {
  // Device memory is what the driver reports (nvidia-smi "Total"), not the
  // marketing figure; bandwidths are per direction. Sources:
  // docs/accounting.md, "Hardware presets".
  constexpr double kTB = 1e12;
  constexpr double kGB = 1e9;
  Hardware h;
  h.preset = std::string(name);
  if (name == "h100") {
    h.device_memory = 81559 * kMiB;  // H100 SXM5 80GB HBM3
    h.hbm_bw = 3.35 * kTB;
    h.bf16_flops = 989e12;
    h.d2h_bw = h.h2d_bw = 55 * kGB;  // PCIe Gen5 x16, measured-typical
    h.peer_bw = 450 * kGB;           // NVLink 4, 900 GB/s bidirectional
    h.pp_link_bw = 50 * kGB;         // 400 Gb/s InfiniBand NDR per GPU
    h.host_memory = 256 * kGiB;      // 2 TiB per 8-GPU node
  } else if (name == "h200") {
    h.device_memory = 143771 * kMiB;  // H200 SXM 141GB HBM3e
    h.hbm_bw = 4.8 * kTB;
    h.bf16_flops = 989e12;
    h.d2h_bw = h.h2d_bw = 55 * kGB;
    h.peer_bw = 450 * kGB;
    h.pp_link_bw = 50 * kGB;
    h.host_memory = 256 * kGiB;
  } else if (name == "b200") {
    h.device_memory = 183359 * kMiB;  // B200 SXM 180GB HBM3e
    h.hbm_bw = 8.0 * kTB;
    h.bf16_flops = 2250e12;
    h.d2h_bw = h.h2d_bw = 55 * kGB;
    h.peer_bw = 900 * kGB;  // NVLink 5, 1.8 TB/s bidirectional
    h.pp_link_bw = 50 * kGB;
    h.host_memory = 256 * kGiB;  // 2 TiB per 8-GPU DGX B200 node (standard)
  } else if (name == "host") {
    // The host backend: "device" memory is a host arena.
    h.device_memory = 8 * kGiB;
    h.hbm_bw = 20 * kGB;
    h.bf16_flops = 50e9;
    h.d2h_bw = h.h2d_bw = 10 * kGB;
    h.peer_bw = 10 * kGB;
    h.pp_link_bw = 10 * kGB;
    h.host_memory = 16 * kGiB;
  } else {
    return Error{ErrorCode::kBadInput, "expected one of h100|h200|b200|host"};
  }
  if (name != "host") {
    // Estimates until `memplan calibrate --backend cuda` measures them
    // (docs/accounting.md, "Memory outside the framework"): a CUDA 12/13
    // context with lazy module loading; NCCL's defaults (32 channels on
    // NVLink, NCCL_BUFFSIZE 4 MiB, 2 channels per point-to-point peer).
    h.runtime.cuda_context = 512 * kMiB;
    h.runtime.nccl_channels = 32;
    h.runtime.nccl_buffsize = 4 * kMiB;
    h.runtime.nccl_p2p_channels = 2;
  }
  return h;
}

int64_t DefaultReserveBytes(const Hardware& h) {
  // What no line item counts. Where the CUDA context and NCCL's buffers are
  // line items (hardware.runtime, the GPU presets), only the allocator's
  // slack: 1 GiB or 2% of the device. Otherwise 2 GiB or 5%, which also
  // stood for them. cuBLAS's workspace is planned, not here.
  if (h.runtime.cuda_context > 0) return std::max<int64_t>(kGiB, h.device_memory / 50);
  return std::max<int64_t>(2 * kGiB, h.device_memory / 20);
}

namespace {

// Directory part of `file` ("" for none), to resolve paths a file names.
std::string DirOf(const std::string& file) {
  auto slash = file.rfind('/');
  return slash == std::string::npos ? std::string() : file.substr(0, slash + 1);
}

}  // namespace

// `calibration`: a memplan.hardware/1 file (relative to the file naming it)
// whose numbers are the base; the other keys override them, as they
// override a preset's.
Hardware ParseHardwareObject(ObjectReader& r) {
  Hardware h;
  if (r.Has("calibration")) {
    std::string path = r.String("calibration");
    if (path.empty() || path[0] != '/') path = DirOf(r.where().file) + path;
    auto loaded = LoadHardwareFile(path);
    if (!loaded) ThrowAt(r.At("calibration"), loaded.error().message);
    h = *loaded;
    if (r.Has("preset")) ThrowAt(r.At("preset"), "give either preset or calibration, not both");
  } else {
    h = *HardwarePreset(r.Enum("preset", {"h100", "h200", "b200", "host"}));
  }
  if (auto v = r.OptBytes("device_memory")) h.device_memory = *v;
  if (auto v = r.OptBandwidth("hbm_bw")) h.hbm_bw = *v;
  if (auto v = r.OptFlopRate("bf16_flops")) h.bf16_flops = *v;
  if (auto v = r.OptBandwidth("d2h_bw")) h.d2h_bw = *v;
  if (auto v = r.OptBandwidth("h2d_bw")) h.h2d_bw = *v;
  if (auto v = r.OptBandwidth("peer_bw")) h.peer_bw = *v;
  if (auto v = r.OptBandwidth("pp_link_bw")) h.pp_link_bw = *v;
  if (auto v = r.OptBytes("host_memory")) h.host_memory = *v;
  if (r.Has("launch_s")) h.launch_s = r.Number("launch_s", 0, 1, 0);
  h.gpus_per_node = r.Int("gpus_per_node", 1, 1024, h.gpus_per_node);
  if (const Json* v = r.Get("runtime")) {
    ObjectReader o(*v, r.At("runtime"));
    if (auto b = o.OptBytes("cuda_context")) h.runtime.cuda_context = *b;
    h.runtime.nccl_channels = o.Int("nccl_channels", 0, 64, h.runtime.nccl_channels);
    if (auto b = o.OptBytes("nccl_buffsize")) h.runtime.nccl_buffsize = *b;
    h.runtime.nccl_p2p_channels = o.Int("nccl_p2p_channels", 0, 64, h.runtime.nccl_p2p_channels);
    if (h.runtime.cuda_context > (int64_t{1} << 40) || h.runtime.nccl_buffsize > (int64_t{1} << 34)) {
      ThrowAt(r.At("runtime"), "expected a CUDA context under 1 TiB and an NCCL buffer under 16 GiB");
    }
    o.Finish();
  }
  r.Finish();
  return h;
}
Json HardwareJson(const Hardware& h) {
  Json j{{"preset", h.preset},         {"device_memory", h.device_memory},
         {"hbm_bw", h.hbm_bw},         {"bf16_flops", h.bf16_flops},
         {"d2h_bw", h.d2h_bw},         {"h2d_bw", h.h2d_bw},
         {"peer_bw", h.peer_bw},       {"pp_link_bw", h.pp_link_bw},
         {"host_memory", h.host_memory}};
  if (h.launch_s > 0) j["launch_s"] = h.launch_s;  // calibrated only: preset plans keep their digest
  if (h.gpus_per_node != 8) j["gpus_per_node"] = h.gpus_per_node;  // likewise
  // Written where it differs from the preset's: preset models keep their digest.
  auto preset = HardwarePreset(h.preset);
  if (!preset || !(preset->runtime == h.runtime)) {
    j["runtime"] = {{"cuda_context", h.runtime.cuda_context},
                    {"nccl_channels", h.runtime.nccl_channels},
                    {"nccl_buffsize", h.runtime.nccl_buffsize},
                    {"nccl_p2p_channels", h.runtime.nccl_p2p_channels}};
  }
  return j;
}
Expected<Hardware> LoadHardwareFile(const std::string& path) {
  auto doc = ReadJsonFile(path);
  if (!doc) return doc.error();
  return ParseHardwareFile(*doc, path);
}

Expected<Hardware> ParseHardwareFile(const Json& json, const std::string& path) {
  const Json* doc = &json;
  if (auto valid = ValidateSchema(*doc, SchemaKind::kHardware, path); !valid) return valid.error();
  return CatchErrors([&] {
    ObjectReader top(*doc, JsonLocation{path, ""});
    if (top.String("schema") != "memplan.hardware/1") {
      ThrowAt(top.At("schema"), "expected \"memplan.hardware/1\"");
    }
    top.Get("backend");
    top.Get("device");
    top.Get("probes");
    const Json& hw = top.Required("hardware");
    ObjectReader r(hw, top.At("hardware"));
    if (r.Has("calibration")) ThrowAt(r.At("calibration"), "a calibration file cannot name another one");
    Hardware h = ParseHardwareObject(r);
    top.Finish();
    return h;
  });
}
}  // namespace memplan::planner
