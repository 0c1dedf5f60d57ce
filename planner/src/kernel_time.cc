#include "memplan/planner/kernel_time.h"

#include <algorithm>
#include <cmath>

namespace memplan::planner {
namespace {

const ParamSpec* FindParam(const LayerGraph& g, const std::string& name) {
  for (const auto& p : g.params) {
    if (p.name == name) return &p;
  }
  return nullptr;
}

double Elements(const TensorSpec& t) {
  double e = 1;
  for (int64_t d : t.shape) e *= static_cast<double>(d);
  return e;
}

}  // namespace

double MemoryBoundSeconds(const Hardware& hw, double bytes) { return bytes / (hw.hbm_bw * hw.efficiency.memory); }

double GemmEfficiency(const Hardware& hw, const GemmShape& s) {
  const Hardware::Efficiency& e = hw.efficiency;
  double eff = e.gemm;
  if (e.sms > 0 && s.m > 0 && s.n > 0) {
    // Tile quantization: each group's output is cut into tile_m x tile_n
    // tiles, the last row and column of tiles partly empty. Wave
    // quantization: the tiles of all groups run sms at a time, the last
    // wave partly idle (NVIDIA, "Matrix Multiplication Background User's
    // Guide", tile and wave quantization).
    const double tm = static_cast<double>(e.tile_m), tn = static_cast<double>(e.tile_n);
    const double tiles = s.groups * std::ceil(s.m / tm) * std::ceil(s.n / tn);
    const double waves = std::ceil(tiles / static_cast<double>(e.sms));
    eff *= s.groups * s.m * s.n / (waves * static_cast<double>(e.sms) * tm * tn);
  }
  // The main loop's prologue and epilogue amortized over the reduction.
  if (e.gemm_k_half > 0 && s.k > 0) eff *= s.k / (s.k + e.gemm_k_half);
  return eff;
}

double GemmSeconds(const Hardware& hw, const GemmShape& s, double bytes) {
  const double flops = 2 * s.groups * s.m * s.n * s.k;
  return std::max(flops / (hw.bf16_flops * GemmEfficiency(hw, s)), MemoryBoundSeconds(hw, bytes));
}

std::optional<GemmShape> GemmShapeOf(const LayerGraph& g, const OpSpec& op, const Parallel& par) {
  if (op.outputs.empty() || op.flops <= 0) return std::nullopt;
  const TensorSpec* out = g.FindTensor(op.outputs.front());
  if (out == nullptr || out->shape.empty()) return std::nullopt;
  GemmShape s;
  const double elements = Elements(*out);
  if (op.op == OpKind::kBatchedGemm && out->shape.size() >= 2) {
    s.n = static_cast<double>(out->shape.back());
    s.m = static_cast<double>(out->shape[out->shape.size() - 2]);
    s.groups = elements / (s.m * s.n);
  } else {
    s.n = static_cast<double>(out->shape.back());
    s.m = elements / s.n;
    if (op.op == OpKind::kGroupedGemm && !op.params.empty()) {
      // The rows are the tokens routed to this rank's experts.
      if (const ParamSpec* w = FindParam(g, op.params.front()); w != nullptr && !w->shape.empty()) {
        s.groups = std::max(1.0, static_cast<double>(w->shape.front()) / static_cast<double>(std::max<int64_t>(1, par.ep)));
        s.m /= s.groups;
      }
    }
  }
  if (s.m <= 0 || s.n <= 0 || s.groups <= 0) return std::nullopt;
  s.k = op.flops / (2 * s.groups * s.m * s.n);
  if (s.k < 1) return std::nullopt;
  return s;
}

OpTime OpComputeSeconds(const Hardware& hw, const LayerGraph& g, const OpSpec& op, const Parallel& par) {
  const double bytes = static_cast<double>(op.bytes_read + op.bytes_written);
  const double roofline = std::max(op.flops / hw.bf16_flops, MemoryBoundSeconds(hw, bytes));
  OpTime t{roofline, 2 * roofline};
  switch (op.op) {
    case OpKind::kLinear:
    case OpKind::kGroupedGemm:
    case OpKind::kBatchedGemm: {
      const auto s = GemmShapeOf(g, op, par);
      if (!s) break;
      t.fwd_s = GemmSeconds(hw, *s, bytes);
      // Backward: the input's gradient [m, n] x [n, k] and the weight's
      // [k, m] x [m, n], each moving about the forward's bytes.
      t.bwd_s = GemmSeconds(hw, GemmShape{s->groups, s->m, s->k, s->n}, bytes) +
                GemmSeconds(hw, GemmShape{s->groups, s->k, s->n, s->m}, bytes);
      break;
    }
    case OpKind::kFlashAttention: {
      const Hardware::Efficiency& e = hw.efficiency;
      const double work = op.flops * (e.causal ? 0.5 : 1.0);
      t.fwd_s = std::max(work / (hw.bf16_flops * e.attention_fwd), MemoryBoundSeconds(hw, bytes));
      t.bwd_s = std::max(e.attention_bwd_ratio * work / (hw.bf16_flops * e.attention_bwd), MemoryBoundSeconds(hw, 2 * bytes));
      break;
    }
    default:
      break;
  }
  t.fwd_s += hw.launch_s;
  t.bwd_s += 2 * hw.launch_s;
  return t;
}

}  // namespace memplan::planner
