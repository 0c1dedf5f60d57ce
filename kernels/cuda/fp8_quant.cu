// FP8 E4M3 blockwise (1x128) quantize / dequantize kernels.
//
// One warp owns a group of consecutive 1x128 blocks (loads of the whole group
// first): for each block each lane holds 4 elements, the block amax is a
// shuffle reduction, lane 0 writes the scale. Bit-exactness with the CPU
// reference comes from (a) the shared detail::BlockScale, (b) IEEE division
// x / scale (nvcc's default -prec-div=true, no fast math), (c) the hardware
// cvt.rn.satfinite.e4m3x2.f32, which rounds like FloatToE4M3, and (d) exact
// E4M3 -> half -> float decoding followed by one multiplication.
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "fp8_scale.h"
#include "memplan/kernels/fp8_cuda.h"

namespace memplan::kernels {
namespace {

constexpr int kWarpSize = 32;
constexpr int kThreadsPerCta = 256;
constexpr int kWarpsPerCta = kThreadsPerCta / kWarpSize;
constexpr int kElemsPerLane = static_cast<int>(kFp8Block) / kWarpSize;
static_assert(kElemsPerLane == 4, "lane code below assumes 4 elements/lane");
// Grid cap; larger problems loop (grid-stride over blocks).
constexpr int64_t kMaxCtas = int64_t{1} << 20;

__device__ __forceinline__ float LoadOne(const float* p) { return __ldg(p); }
__device__ __forceinline__ float LoadOne(const uint16_t* p) {
  return detail::Bf16BitsToFloat(__ldg(p));
}

// Loads 4 consecutive elements with one 16-byte (fp32) or 8-byte (bf16) load.
__device__ __forceinline__ void LoadFour(const float* p, float v[4]) {
  const float4 f = __ldg(reinterpret_cast<const float4*>(p));
  v[0] = f.x;
  v[1] = f.y;
  v[2] = f.z;
  v[3] = f.w;
}
__device__ __forceinline__ void LoadFour(const uint16_t* p, float v[4]) {
  const uint2 u = __ldg(reinterpret_cast<const uint2*>(p));
  v[0] = __uint_as_float(u.x << 16);
  v[1] = __uint_as_float(u.x & 0xFFFF0000u);
  v[2] = __uint_as_float(u.y << 16);
  v[3] = __uint_as_float(u.y & 0xFFFF0000u);
}

__device__ __forceinline__ uint32_t CvtFour(const float q[4]) {
  const __nv_fp8x2_storage_t lo = __nv_cvt_float2_to_fp8x2(
      make_float2(q[0], q[1]), __NV_SATFINITE, __NV_E4M3);
  const __nv_fp8x2_storage_t hi = __nv_cvt_float2_to_fp8x2(
      make_float2(q[2], q[3]), __NV_SATFINITE, __NV_E4M3);
  return static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
}

__device__ __forceinline__ float DecodeOne(uint8_t code) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(code, __NV_E4M3);
  return __half2float(__half(h));
}
__device__ __forceinline__ float2 DecodeTwo(uint32_t codes) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(
      static_cast<__nv_fp8x2_storage_t>(codes), __NV_E4M3);
  return __half22float2(__half2(h));
}

// Where block `blk` of a row-major [rows, cols] matrix starts (`base`) and
// how many elements it has (`len`; the last block of a row may be short);
// len 0 past the last block.
__device__ __forceinline__ void BlockExtent(int64_t blk, int64_t total, int64_t cols, int64_t blocks_per_row,
                                           int64_t* base, int* len) {
  *base = 0;
  *len = 0;
  if (blk >= total) return;
  const int64_t row = blk / blocks_per_row;
  const int64_t col0 = (blk - row * blocks_per_row) * kFp8Block;
  *len = static_cast<int>(min(kFp8Block, cols - col0));
  *base = row * cols + col0;
}

// Grid-stride over groups of kUnroll consecutive blocks, one warp per
// group: the warp issues the loads of all kUnroll blocks before reducing any,
// so that enough bytes are in flight to cover DRAM latency (one 1x128 bf16
// block is only 256 B per warp). `blk` is warp-uniform, so the full-mask
// shuffles below are safe. The scale index of block b of row r is
// r * blocks_per_row + b == blk.
template <typename In, bool kVector, int kUnroll>
__global__ void __launch_bounds__(kThreadsPerCta)
    QuantizeKernel(const In* __restrict__ x, int64_t rows, int64_t cols,
                   int64_t blocks_per_row, ScaleMode mode,
                   uint8_t* __restrict__ values, float* __restrict__ scales) {
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int64_t total = rows * blocks_per_row;
  const int64_t groups = (total + kUnroll - 1) / kUnroll;
  const int64_t warp_stride = static_cast<int64_t>(gridDim.x) * kWarpsPerCta;
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * kWarpsPerCta +
                   threadIdx.x / kWarpSize;
       g < groups; g += warp_stride) {
    int64_t base[kUnroll];
    int len[kUnroll];
    float v[kUnroll][kElemsPerLane];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t blk = g * kUnroll + u;
      BlockExtent(blk, total, cols, blocks_per_row, &base[u], &len[u]);
      // Vector path: lane owns elements [4*lane, 4*lane+4). cols % 4 == 0
      // makes len % 4 == 0, so a lane's quad is either fully inside or fully
      // outside. Scalar path: lane owns lane + 32*j (coalesced). Missing
      // elements are 0, which cannot raise the amax.
      if constexpr (kVector) {
        if (kElemsPerLane * lane < len[u]) {
          LoadFour(x + base[u] + kElemsPerLane * lane, v[u]);
        } else {
#pragma unroll
          for (int j = 0; j < kElemsPerLane; ++j) v[u][j] = 0.f;
        }
      } else {
#pragma unroll
        for (int j = 0; j < kElemsPerLane; ++j) {
          const int idx = lane + kWarpSize * j;
          v[u][j] = idx < len[u] ? LoadOne(x + base[u] + idx) : 0.f;
        }
      }
    }

#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t blk = g * kUnroll + u;
      if (blk >= total) break;  // warp-uniform
      float amax = 0.f;
#pragma unroll
      for (int j = 0; j < kElemsPerLane; ++j) amax = fmaxf(amax, fabsf(v[u][j]));
#pragma unroll
      for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
        amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, offset));
      }
      const float scale = detail::BlockScale(amax, mode);
      if (lane == 0) scales[blk] = scale;

      float q[kElemsPerLane];
#pragma unroll
      for (int j = 0; j < kElemsPerLane; ++j) q[j] = v[u][j] / scale;

      if constexpr (kVector) {
        if (kElemsPerLane * lane < len[u]) {
          *reinterpret_cast<uint32_t*>(values + base[u] + kElemsPerLane * lane) =
              CvtFour(q);
        }
      } else {
#pragma unroll
        for (int j = 0; j < kElemsPerLane; ++j) {
          const int idx = lane + kWarpSize * j;
          if (idx < len[u]) {
            values[base[u] + idx] =
                __nv_cvt_float_to_fp8(q[j], __NV_SATFINITE, __NV_E4M3);
          }
        }
      }
    }
  }
}

// As QuantizeKernel: kUnroll consecutive blocks per warp, loads first.
template <bool kVector, int kUnroll>
__global__ void __launch_bounds__(kThreadsPerCta)
    DequantizeKernel(const uint8_t* __restrict__ values,
                     const float* __restrict__ scales, int64_t rows,
                     int64_t cols, int64_t blocks_per_row,
                     float* __restrict__ y) {
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int64_t total = rows * blocks_per_row;
  const int64_t groups = (total + kUnroll - 1) / kUnroll;
  const int64_t warp_stride = static_cast<int64_t>(gridDim.x) * kWarpsPerCta;
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * kWarpsPerCta +
                   threadIdx.x / kWarpSize;
       g < groups; g += warp_stride) {
    int64_t base[kUnroll];
    int len[kUnroll];
    float scale[kUnroll];
    uint32_t codes[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t blk = g * kUnroll + u;
      BlockExtent(blk, total, cols, blocks_per_row, &base[u], &len[u]);
      scale[u] = 0.f;
      codes[u] = 0;
      if (blk < total) {
        scale[u] = __ldg(scales + blk);
        if constexpr (kVector) {
          const int i = kElemsPerLane * lane;
          if (i < len[u]) {
            codes[u] = __ldg(reinterpret_cast<const unsigned int*>(values + base[u] + i));
          }
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if constexpr (kVector) {
        const int i = kElemsPerLane * lane;
        if (i < len[u]) {
          const float2 a = DecodeTwo(codes[u] & 0xFFFFu);
          const float2 b = DecodeTwo(codes[u] >> 16);
          // Explicit vector store: a plain float4 assignment through the cast
          // pointer was split into four 4-byte stores by nvcc 13.
          __stcs(reinterpret_cast<float4*>(y + base[u] + i),
                 make_float4(a.x * scale[u], a.y * scale[u], b.x * scale[u],
                             b.y * scale[u]));
        }
      } else {
#pragma unroll
        for (int j = 0; j < kElemsPerLane; ++j) {
          const int idx = lane + kWarpSize * j;
          if (idx < len[u]) {
            y[base[u] + idx] = DecodeOne(values[base[u] + idx]) * scale[u];
          }
        }
      }
    }
  }
}

// Blocks per warp in the vector kernels: enough independent 1x128 blocks in
// flight per warp (bf16 in: 4 x 256 B, fp32 in: 2 x 512 B, fp8 in: 4 x 128 B).
// The scalar fallbacks (misaligned or cols % 4 != 0) keep one.
template <typename In>
constexpr int QuantizeUnroll() { return sizeof(In) == 2 ? 4 : 2; }
constexpr int kDequantizeUnroll = 4;

bool IsAligned(const void* p, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

// Returns the grid size for `unroll` blocks per warp, or 0 when there is
// nothing to launch.
unsigned GridFor(Fp8BlockLayout layout, int unroll) {
  const int64_t groups = (layout.rows * layout.BlocksPerRow() + unroll - 1) / unroll;
  return static_cast<unsigned>(
      std::min((groups + kWarpsPerCta - 1) / kWarpsPerCta, kMaxCtas));
}

// Shared argument checks; returns cudaSuccess when the launch may proceed.
cudaError_t CheckLayout(Fp8BlockLayout layout) {
  if (layout.rows < 0 || layout.cols < 0) return cudaErrorInvalidValue;
  return cudaSuccess;
}

template <typename In>
int LaunchQuantize(const In* x, Fp8BlockLayout layout, ScaleMode mode,
                   uint8_t* values, float* scales, cudaStream_t stream) {
  if (const cudaError_t err = CheckLayout(layout); err != cudaSuccess) {
    return static_cast<int>(err);
  }
  if (layout.ValueBytes() == 0) return static_cast<int>(cudaSuccess);
  if (x == nullptr || values == nullptr || scales == nullptr ||
      (mode != ScaleMode::kAmax && mode != ScaleMode::kPow2)) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  const bool vector = layout.cols % kElemsPerLane == 0 &&
                      IsAligned(x, kElemsPerLane * sizeof(In)) &&
                      IsAligned(values, kElemsPerLane);
  if (vector) {
    constexpr int kUnroll = QuantizeUnroll<In>();
    QuantizeKernel<In, true, kUnroll><<<GridFor(layout, kUnroll), kThreadsPerCta, 0, stream>>>(
        x, layout.rows, layout.cols, layout.BlocksPerRow(), mode, values,
        scales);
  } else {
    QuantizeKernel<In, false, 1><<<GridFor(layout, 1), kThreadsPerCta, 0, stream>>>(
        x, layout.rows, layout.cols, layout.BlocksPerRow(), mode, values,
        scales);
  }
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

int QuantizeFp8BlockwiseCuda(const float* x, Fp8BlockLayout layout,
                             ScaleMode mode, uint8_t* values, float* scales,
                             CUstream_st* stream) {
  return LaunchQuantize(x, layout, mode, values, scales, stream);
}

int QuantizeFp8BlockwiseCuda(const uint16_t* x_bf16, Fp8BlockLayout layout,
                             ScaleMode mode, uint8_t* values, float* scales,
                             CUstream_st* stream) {
  return LaunchQuantize(x_bf16, layout, mode, values, scales, stream);
}

int DequantizeFp8BlockwiseCuda(const uint8_t* values, const float* scales,
                               Fp8BlockLayout layout, float* y,
                               CUstream_st* stream) {
  if (const cudaError_t err = CheckLayout(layout); err != cudaSuccess) {
    return static_cast<int>(err);
  }
  if (layout.ValueBytes() == 0) return static_cast<int>(cudaSuccess);
  if (values == nullptr || scales == nullptr || y == nullptr) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  const bool vector = layout.cols % kElemsPerLane == 0 &&
                      IsAligned(values, kElemsPerLane) &&
                      IsAligned(y, kElemsPerLane * sizeof(float));
  if (vector) {
    DequantizeKernel<true, kDequantizeUnroll><<<GridFor(layout, kDequantizeUnroll), kThreadsPerCta, 0, stream>>>(
        values, scales, layout.rows, layout.cols, layout.BlocksPerRow(), y);
  } else {
    DequantizeKernel<false, 1><<<GridFor(layout, 1), kThreadsPerCta, 0, stream>>>(
        values, scales, layout.rows, layout.cols, layout.BlocksPerRow(), y);
  }
  return static_cast<int>(cudaGetLastError());
}

}  // namespace memplan::kernels
