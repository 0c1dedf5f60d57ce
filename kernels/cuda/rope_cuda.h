// Private to kernels/cuda: RoPE's cos and sin, shared by the split-heads
// kernels (ops.cu) and the MLA kernels (mla.cu). The reference's definition
// (ops.h, SplitShape): the angle in double, cos and sin rounded to float once.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace memplan::kernels::cuda {

// ops.h's CpPosition on the device.
__device__ __forceinline__ int64_t CpPositionDevice(int64_t pos, int64_t s, int64_t cp, int64_t cp_rank) {
  if (cp <= 1) return pos;
  const int64_t c = s / 2;
  return pos < c ? cp_rank * c + pos : (2 * cp - 1 - cp_rank) * c + (pos - c);
}

// Pair i (of rotated width `dim`) at position `pos`.
__device__ __forceinline__ void RopeCosSin(int64_t pos, int64_t i, int64_t dim, float theta, float* c, float* s) {
  const double angle =
      static_cast<double>(pos) * pow(static_cast<double>(theta), -static_cast<double>(2 * i) / static_cast<double>(dim));
  *c = __double2float_rn(cos(angle));
  *s = __double2float_rn(sin(angle));
}

}  // namespace memplan::kernels::cuda
