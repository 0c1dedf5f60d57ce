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

// cuBLAS workspace handed to GEMMs (NVIDIA's recommendation on Hopper). It
// is allocated once per device, so the planner counts it in the reserve
// held back from device memory, not per op.
constexpr int64_t GemmBytes() { return int64_t{32} << 20; }

}  // namespace memplan::workspace
