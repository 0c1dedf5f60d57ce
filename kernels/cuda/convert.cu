// bf16 storage conversions (ops.h WidenBf16 / RoundToBf16): exact widening,
// round to nearest even with CUDA's own intrinsic, one thread per element.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "ops_launch.h"

namespace memplan::kernels::cuda {
namespace {

__global__ void WidenBf16Kernel(const uint16_t* x, int64_t n, float* y) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    y[i] = __uint_as_float(static_cast<uint32_t>(x[i]) << 16);
  }
}

__global__ void RoundToBf16Kernel(const float* x, int64_t n, uint16_t* y) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    y[i] = __bfloat16_as_ushort(__float2bfloat16_rn(x[i]));
  }
}

unsigned Blocks(const LaunchContext& ctx, int64_t n) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>((n + 255) / 256, int64_t{ctx.sm_count} * 32)));
}

}  // namespace

cudaError_t LaunchWidenBf16(const LaunchContext& ctx, const uint16_t* x, int64_t n, float* y) {
  if (n <= 0) return cudaSuccess;
  WidenBf16Kernel<<<Blocks(ctx, n), 256, 0, ctx.stream>>>(x, n, y);
  return cudaGetLastError();
}

cudaError_t LaunchRoundToBf16(const LaunchContext& ctx, const float* x, int64_t n, uint16_t* y) {
  if (n <= 0) return cudaSuccess;
  RoundToBf16Kernel<<<Blocks(ctx, n), 256, 0, ctx.stream>>>(x, n, y);
  return cudaGetLastError();
}

}  // namespace memplan::kernels::cuda
