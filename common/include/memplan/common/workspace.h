// Op workspace sizes: the one place the planner (to account them on the
// timeline) and the kernels/runtime (to size what they are given) read them.
// Header-only, so that kernels-only builds need nothing else from common/.
#pragma once

#include <cstdint>

namespace memplan::workspace {

// Standard attention backward: the score gradients dS, fp32
// [b, heads, s_q, s_kv].
constexpr int64_t AttentionBwdBytes(int64_t b, int64_t heads, int64_t s_q, int64_t s_kv) {
  return b * heads * s_q * s_kv * 4;
}

// Flash-style attention backward: D = rowsum(dO * O), fp32 [b, heads, s_q].
constexpr int64_t FlashAttentionBwdBytes(int64_t b, int64_t heads, int64_t s_q) { return b * heads * s_q * 4; }

// Block AttnRes backward (kernels::Ops::AttnResBwd): the dw/dgamma partial
// sums, one fp32 row of `d` per group of tokens, at most kAttnResBwdGroups
// groups (a constant, so that plans do not depend on the GPU's SM count).
// One op attends over at most kMaxAttnResSources blocks (the kernels take
// the blocks' addresses as launch arguments).
inline constexpr int64_t kAttnResBwdGroups = 256;
inline constexpr int64_t kMaxAttnResSources = 64;
constexpr int64_t AttnResBwdBytes(int64_t tokens, int64_t d) {
  return (tokens < kAttnResBwdGroups ? tokens : kAttnResBwdGroups) * d * 4;
}

// KDA backward (kernels::Ops::KdaBwd): the state before each token of one
// chunk, for every sequence and head, re-made from the chunk's saved start
// (fp32 [batch, heads, chunk, dk, dv]), plus one da_log partial per sequence
// and head (summed in a fixed order).
constexpr int64_t KdaBwdBytes(int64_t batch, int64_t heads, int64_t chunk, int64_t dk, int64_t dv) {
  return (batch * heads * chunk * dk * dv + batch * heads) * 4;
}
// KDA's gated RMSNorm backward: the normalized values and their gradient
// before the gate, fp32 [rows, cols] each.
constexpr int64_t GatedRmsNormBwdBytes(int64_t rows, int64_t cols) { return 2 * rows * cols * 4; }

// cuBLAS workspace handed to GEMMs (NVIDIA's recommendation on Hopper). One
// per rank for the whole run: a static buffer of every rank's plan
// ("gemm_workspace", docs/accounting.md) that the runtime hands to cuBLAS
// with cublasSetWorkspace, so that cuBLAS allocates nothing of its own.
constexpr int64_t GemmBytes() { return int64_t{32} << 20; }

// Kernel scratch one rank's ops hold for the whole run, also a static
// buffer of every plan ("kernel_scratch"): DispatchPlan stages the routing
// offsets on their way to the host through kStagedOffsets int64 entries,
// SquaredNorm reduces through kNormPartials double partial sums, and the
// norm's own result takes one 256-byte granule (the arenas' alignment, so
// that the buffer ends on a granule).
inline constexpr int64_t kStagedOffsets = 1024;
inline constexpr int64_t kNormPartials = 1024;
inline constexpr int64_t kScratchResultBytes = 256;
constexpr int64_t StagedOffsetsBytes() { return kStagedOffsets * 8; }
constexpr int64_t NormPartialsBytes() { return kNormPartials * 8; }
constexpr int64_t KernelScratchBytes() { return StagedOffsetsBytes() + NormPartialsBytes() + kScratchResultBytes; }

}  // namespace memplan::workspace
