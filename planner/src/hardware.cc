// Hardware presets and the model file's `hardware` object
// (docs/accounting.md, "Hardware presets"; docs/planner.md, "Time model").
#include "memplan/planner/model.h"

#include "model_internal.h"

#include <algorithm>

#include "memplan/common/schema.h"
#include "memplan/common/units.h"

namespace memplan::planner {

namespace {

// What real kernels and NCCL reach on each GPU (docs/planner.md, "Time
// model", which gives every source). The host preset keeps the ideal
// roofline its calibration is fitted to.
Hardware::Efficiency PresetEfficiency(std::string_view name) {
  Hardware::Efficiency e;
  if (name == "host") return e;
  const bool ampere = name == "a100";
  e.gemm = ampere ? 0.85 : 0.78;       // cuBLAS BF16, best large shapes: 271 of 312, 794 of 989
  e.sms = ampere ? 108 : name == "b200" ? 148 : 132;
  e.tile_m = ampere ? 256 : 128;       // the output tile cuBLAS favours
  e.tile_n = ampere ? 128 : 256;
  e.gemm_k_half = 128;
  e.attention_fwd = ampere ? 0.70 : 0.60;  // FlashAttention-2 on A100; cuDNN (TE) on Hopper
  e.attention_bwd = ampere ? 0.60 : 0.52;
  e.causal = true;
  e.attention_bwd_ratio = 2.5;         // FlashAttention's 5 GEMMs backward to 2 forward
  e.memory = 0.85;                     // fused elementwise and norm kernels
  e.nvlink = ampere ? 0.78 : 0.80;     // nccl-tests ring busbw: 235 of 300, 361-367 of 450 GB/s
  e.network = 0.92;                    // per-NIC busbw: 46-49 of 50 GB/s (NDR), 24 of 25 (HDR)
  e.nvlink_latency_s = 3e-6;           // an 8-GPU all-reduce's ~40 us floor over its 14 steps
  e.network_latency_s = 6e-6;
  // Mixed-precision Adam: fp32 gradient read, fp32 master, m and v read
  // and written, bf16 weight written.
  e.optimizer_bytes_per_param = 30;
  return e;
}

}  // namespace

Expected<Hardware> HardwarePreset(std::string_view name) {
  // Device memory is what the driver reports (nvidia-smi "Total"), not the
  // marketing figure; bandwidths are per direction. Sources:
  // docs/accounting.md, "Hardware presets".
  constexpr double kTB = 1e12;
  constexpr double kGB = 1e9;
  Hardware h;
  h.preset = std::string(name);
  if (name == "a100") {
    h.device_memory = 81920 * kMiB;  // A100 SXM4 80GB
    h.hbm_bw = 2.039 * kTB;
    h.bf16_flops = 312e12;
    h.d2h_bw = h.h2d_bw = 25 * kGB;  // PCIe Gen4 x16
    h.peer_bw = 300 * kGB;           // NVLink 3, 600 GB/s bidirectional
    h.pp_link_bw = 25 * kGB;         // 200 Gb/s InfiniBand HDR per GPU
    h.host_memory = 128 * kGiB;      // 1 TiB per DGX A100
  } else if (name == "h100" || name == "h800") {
    h.device_memory = 81559 * kMiB;  // H100 SXM5 80GB HBM3
    h.hbm_bw = 3.35 * kTB;
    h.bf16_flops = 989e12;
    h.d2h_bw = h.h2d_bw = 55 * kGB;  // PCIe Gen5 x16, measured-typical
    h.peer_bw = 450 * kGB;           // NVLink 4, 900 GB/s bidirectional
    h.pp_link_bw = 50 * kGB;         // 400 Gb/s InfiniBand NDR per GPU
    h.host_memory = 256 * kGiB;      // 2 TiB per 8-GPU node
    // H800: the H100 with NVLink cut to 400 GB/s bidirectional (DeepSeek-V3
    // report, section 3.2.1: 160 GB/s measured one way).
    if (name == "h800") h.peer_bw = 200 * kGB;
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
    return Error{ErrorCode::kBadInput, "expected one of a100|h100|h800|h200|b200|host"};
  }
  h.efficiency = PresetEfficiency(name);
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
    h = *HardwarePreset(r.Enum("preset", {"a100", "h100", "h800", "h200", "b200", "host"}));
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
  if (const Json* v = r.Get("efficiency")) {
    ObjectReader o(*v, r.At("efficiency"));
    Hardware::Efficiency& e = h.efficiency;
    e.gemm = o.Number("gemm", 0.01, 1, e.gemm);
    e.sms = o.Int("sms", 0, 4096, e.sms);
    e.tile_m = o.Int("tile_m", 1, 1024, e.tile_m);
    e.tile_n = o.Int("tile_n", 1, 1024, e.tile_n);
    e.gemm_k_half = o.Number("gemm_k_half", 0, 1 << 20, e.gemm_k_half);
    e.attention_fwd = o.Number("attention_fwd", 0.01, 1, e.attention_fwd);
    e.attention_bwd = o.Number("attention_bwd", 0.01, 1, e.attention_bwd);
    e.causal = o.Bool("causal", e.causal);
    e.attention_bwd_ratio = o.Number("attention_bwd_ratio", 1, 10, e.attention_bwd_ratio);
    e.memory = o.Number("memory", 0.01, 1, e.memory);
    e.nvlink = o.Number("nvlink", 0.01, 2, e.nvlink);
    e.network = o.Number("network", 0.01, 2, e.network);
    e.nvlink_latency_s = o.Number("nvlink_latency_s", 0, 1, e.nvlink_latency_s);
    e.network_latency_s = o.Number("network_latency_s", 0, 1, e.network_latency_s);
    e.optimizer_bytes_per_param = o.Number("optimizer_bytes_per_param", 0, 1024, e.optimizer_bytes_per_param);
    o.Finish();
  }
  r.Finish();
  return h;
}
Json EfficiencyJson(const Hardware::Efficiency& e) {
  return Json{{"gemm", e.gemm},
              {"sms", e.sms},
              {"tile_m", e.tile_m},
              {"tile_n", e.tile_n},
              {"gemm_k_half", e.gemm_k_half},
              {"attention_fwd", e.attention_fwd},
              {"attention_bwd", e.attention_bwd},
              {"causal", e.causal},
              {"attention_bwd_ratio", e.attention_bwd_ratio},
              {"memory", e.memory},
              {"nvlink", e.nvlink},
              {"network", e.network},
              {"nvlink_latency_s", e.nvlink_latency_s},
              {"network_latency_s", e.network_latency_s},
              {"optimizer_bytes_per_param", e.optimizer_bytes_per_param}};
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
  // Written unless ideal (the host preset, calibrations): their plans keep
  // their digests.
  if (!(h.efficiency == Hardware::Efficiency{})) j["efficiency"] = EfficiencyJson(h.efficiency);
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
