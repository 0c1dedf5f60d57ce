// Private to kernels/cuda/: what the CUDA kernels share (ops.cu, norm.cu,
// attn_res.cu, mla.cu): block shape and grid constants, the RNG of ops.h,
// vectorized loads and stores, flat and per-row loops, warp and block
// reductions with a fixed tree, grids and the shared-memory opt-in.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "ops_launch.h"

namespace memplan::kernels::cuda {

constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xFFFFFFFFu;
constexpr int kThreads = 256;  // every kernel but DispatchPlan
constexpr int kWarps = kThreads / kWarpSize;
constexpr int kBlocksPerSm = 2048 / kThreads;  // one full-occupancy wave
// Elementwise grids: up to this many waves, then grid-stride.
constexpr int kFlatWaves = 4;
constexpr int kPlanThreads = 1024;
constexpr int kPlanWarps = kPlanThreads / kWarpSize;
// Dynamic shared memory a kernel gets without opting in.
constexpr int64_t kDefaultSmemBytes = 48 * 1024;
// Upper bound on the static __shared__ arrays of the kernels that also take
// dynamic shared memory (a few reduction slots each).
constexpr int64_t kStaticSmemBytes = 1024;

// ---------------------------------------------------------------------------
// RNG: the exact definition of ops.h, so device masks equal the CPU's.

__device__ __forceinline__ uint64_t SplitMix64Device(uint64_t x) {
  uint64_t z = x + 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

__device__ __forceinline__ float Uniform01Device(uint64_t seed, uint64_t offset, uint64_t index) {
  // 24 random bits to a float is exact, and so is the power-of-two scale.
  const uint64_t bits = SplitMix64Device(seed ^ SplitMix64Device(offset + index)) >> 40;
  return static_cast<float>(bits) * 0x1p-24f;
}

// ---------------------------------------------------------------------------
// Vector access. W is 4 (one float4; the address must be 16-byte aligned) or
// 1. LoadRo uses the read-only path and must not see memory the same kernel
// writes at another address; Load is the plain coherent load.

template <int W>
using Width = std::integral_constant<int, W>;

template <int W>
__device__ __forceinline__ void LoadRo(const float* p, float (&v)[W]) {
  if constexpr (W == 4) {
    const float4 f = __ldg(reinterpret_cast<const float4*>(p));
    v[0] = f.x;
    v[1] = f.y;
    v[2] = f.z;
    v[3] = f.w;
  } else {
    static_assert(W == 1);
    v[0] = __ldg(p);
  }
}

template <int W>
__device__ __forceinline__ void Load(const float* p, float (&v)[W]) {
  if constexpr (W == 4) {
    const float4 f = *reinterpret_cast<const float4*>(p);
    v[0] = f.x;
    v[1] = f.y;
    v[2] = f.z;
    v[3] = f.w;
  } else {
    static_assert(W == 1);
    v[0] = *p;
  }
}

template <int W>
__device__ __forceinline__ void Store(float* p, const float (&v)[W]) {
  if constexpr (W == 4) {
    // Explicit st.global.v4 (a float4 assignment through the cast pointer was
    // split into four stores by nvcc 13 in fp8_quant.cu).
    __stwb(reinterpret_cast<float4*>(p), make_float4(v[0], v[1], v[2], v[3]));
  } else {
    static_assert(W == 1);
    *p = v[0];
  }
}

// Shared-memory variant of Store (__stwb is for global memory only).
template <int W>
__device__ __forceinline__ void StoreShared(float* p, const float (&v)[W]) {
  if constexpr (W == 4) {
    *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
  } else {
    *p = v[0];
  }
}

// std::min is host-only without --expt-relaxed-constexpr.
__device__ __forceinline__ int64_t MinI64(int64_t a, int64_t b) { return a < b ? a : b; }

inline bool Aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// True when every pointer is 16-byte aligned (nullptr counts as aligned).
template <typename... P>
bool AllAligned16(const P*... p) {
  return (Aligned(p, 16) && ...);
}

// Runs launch(Width<4>) when the data allow four-wide vectors (`vec4`), else
// launch(Width<1>), and returns the launch's error.
template <typename Launch>
cudaError_t LaunchByWidth(bool vec4, Launch&& launch) {
  if (vec4) {
    launch(Width<4>{});
  } else {
    launch(Width<1>{});
  }
  return cudaGetLastError();
}

// ---------------------------------------------------------------------------
// Loops.

// Calls body(i, Width<W>) for the aligned vectors [i, i+W) of [0, n), then
// body(i, Width<1>) for the n % W tail elements, grid-stride.
template <int W, typename Body>
__device__ __forceinline__ void ForEachFlat(int64_t n, Body&& body) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t n_vec = n / W;
  for (int64_t v = first; v < n_vec; v += stride) body(v * W, Width<W>{});
  if constexpr (W > 1) {
    const int64_t i = n_vec * W + first;
    if (i < n) body(i, Width<1>{});
  }
}

// Calls body(c) for this thread's vectors c, c+W... of a row of `cols`
// (cols % W == 0). The same thread always gets the same columns, which the
// per-thread accumulators below rely on.
template <int W, typename Body>
__device__ __forceinline__ void ForEachInRow(int64_t cols, Body&& body) {
  for (int64_t c = static_cast<int64_t>(threadIdx.x) * W; c < cols; c += static_cast<int64_t>(kThreads) * W) body(c);
}

// ---------------------------------------------------------------------------
// Reductions. Every thread of the warp/block gets the same total: the xor
// butterfly adds the same pairs in every lane (commutativity), and every
// warp then reduces the same per-warp partials.

__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int o = kWarpSize / 2; o > 0; o /= 2) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}

__device__ __forceinline__ float WarpMax(float v) {
#pragma unroll
  for (int o = kWarpSize / 2; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, o));
  return v;
}

__device__ __forceinline__ int WarpSumInt(int v) {
#pragma unroll
  for (int o = kWarpSize / 2; o > 0; o /= 2) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}

// N sums at once; `red` is __shared__ float[N * kWarps]. Block-uniform call.
template <int N>
__device__ __forceinline__ void BlockSum(float (&v)[N], float* red) {
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
#pragma unroll
  for (int k = 0; k < N; ++k) v[k] = WarpSum(v[k]);
  __syncthreads();  // readers of the previous call are done with `red`
  if (lane == 0) {
#pragma unroll
    for (int k = 0; k < N; ++k) red[k * kWarps + warp] = v[k];
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < N; ++k) v[k] = WarpSum(lane < kWarps ? red[k * kWarps + lane] : 0.f);
}

__device__ __forceinline__ float BlockSum1(float v, float* red) {
  float a[1] = {v};
  BlockSum<1>(a, red);
  return a[0];
}

__device__ __forceinline__ float BlockMax(float v, float* red) {
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  v = WarpMax(v);
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  return WarpMax(lane < kWarps ? red[lane] : -INFINITY);
}

// ---------------------------------------------------------------------------
// Grids.

inline unsigned RowGrid(const LaunchContext& ctx, int64_t rows) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(rows, int64_t{ctx.sm_count} * kBlocksPerSm)));
}

inline unsigned FlatGrid(const LaunchContext& ctx, int64_t items) {
  const int64_t blocks = (items + kThreads - 1) / kThreads;
  return static_cast<unsigned>(
      std::max<int64_t>(1, std::min<int64_t>(blocks, int64_t{ctx.sm_count} * kBlocksPerSm * kFlatWaves)));
}

// Dynamic shared memory for `kernel`: true when `bytes` fit next to the
// kernel's static shared memory (at most kStaticSmemBytes), opting in above
// the default 48 KiB; false means the caller takes its global-memory path.
template <typename Kernel>
bool UseSharedMemory(const LaunchContext& ctx, Kernel kernel, int64_t bytes, cudaError_t* err) {
  *err = cudaSuccess;
  if (bytes + kStaticSmemBytes <= kDefaultSmemBytes) return true;
  if (bytes + kStaticSmemBytes > ctx.max_smem_per_block_bytes) return false;
  *err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  return *err == cudaSuccess;
}

__device__ __forceinline__ float Sigmoid(float x) { return 1.f / (1.f + expf(-x)); }

}  // namespace memplan::kernels::cuda
