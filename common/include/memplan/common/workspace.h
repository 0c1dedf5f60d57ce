// Op workspace sizes: the one place the planner (to account them on the
// timeline) and the kernels/runtime (to size what they are given) read them.
// Header-only, so that kernels-only builds need nothing else from common/.
#pragma once

#include <cstdint>

namespace memplan::workspace {

// Sub-buffers packed into one workspace start at multiples of this many
// bytes (cudaMalloc's own alignment is 256).
inline constexpr int64_t kSubBufferAlign = 256;

constexpr int64_t AlignUp(int64_t bytes, int64_t align = kSubBufferAlign) { return (bytes + align - 1) / align * align; }

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

// MoE routing: DispatchPlan's slot_of (int32 [tokens * top_k]) at offset 0,
// then the E+1 int64 expert offsets, each part rounded up to 256 bytes. The
// executor passes this buffer where slot_of lives.
constexpr int64_t MoeRoutingBytes(int64_t tokens, int64_t top_k, int64_t experts) {
  return AlignUp(tokens * top_k * 4) + AlignUp((experts + 1) * 8);
}

}  // namespace memplan::workspace
