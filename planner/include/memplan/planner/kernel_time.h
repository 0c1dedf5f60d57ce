// The compute time of one op on one device (docs/planner.md, "Time model").
//
// GEMMs (linear, grouped expert GEMMs, batched attention GEMMs) are timed
// from their shapes: the forward GEMM and, in backward, the data-gradient
// and weight-gradient GEMMs, each at the efficiency its shape reaches on
// the hardware (a large GEMM's fraction of the peak, wave and tile
// quantization over the SMs, a short reduction's pipeline fill), and never
// faster than its bytes at memory bandwidth. Flash attention runs at its
// own measured efficiency on the work a causal kernel does. Every other op
// is memory-bound. With Hardware::Efficiency's defaults (the host preset,
// calibrations) this is the plain roofline max(FLOPs / bf16_flops,
// bytes / hbm_bw), backward twice the forward.
#pragma once

#include "memplan/planner/graph.h"
#include "memplan/planner/model.h"

namespace memplan::planner {

struct OpTime {
  double fwd_s = 0, bwd_s = 0;
};

// Seconds of one op's forward and backward (no communication: comm.h).
OpTime OpComputeSeconds(const Hardware& hw, const LayerGraph& g, const OpSpec& op, const Parallel& par);

// A GEMM shape: `groups` independent products of [m, k] x [k, n].
struct GemmShape {
  double groups = 1, m = 0, n = 0, k = 0;
};
// The fraction of bf16_flops `s` reaches (Efficiency::gemm at most).
double GemmEfficiency(const Hardware& hw, const GemmShape& s);
// Seconds of `s`, moving at least `bytes` (operands and result).
double GemmSeconds(const Hardware& hw, const GemmShape& s, double bytes);
// The shape of a GEMM op, from its output tensor and FLOPs (linear:
// [.., n] rows of k; grouped: the rows split over the rank's experts;
// batched: the leading dimensions are groups). nullopt when the op's FLOPs
// do not match a GEMM of its output (a hand-written graph).
std::optional<GemmShape> GemmShapeOf(const LayerGraph& g, const OpSpec& op, const Parallel& par);

// Seconds of a memory-bound kernel moving `bytes`.
double MemoryBoundSeconds(const Hardware& hw, double bytes);

}  // namespace memplan::planner
