// CUDA kernels of the Ops interface (ops.h), except attention
// (attention.cu) and the GEMMs (cuBLAS, cuda_ops.cc).
//
// Shapes of the kernels:
//   - Elementwise ops (GELU, SwiGLU, dropout, add, cross-entropy backward)
//     are memory bound: grid-stride loops over 16-byte float4 vectors when
//     every pointer is aligned (and, for row-structured ops, the row length is
//     a multiple of 4), scalar coalesced accesses otherwise.
//   - Row ops (norms, cross-entropy forward, gathers, AttnRes) run one
//     256-thread block per row (grid-stride over rows); row reductions are
//     warp shuffles, then one shuffle across the block's warps. The tree has
//     a fixed shape, so results do not change from run to run.
//   - Router and top-k ops run one warp per token (shared selection and
//     gradient code). Softmax runs one block per row like the norms.
//   - Deterministic by construction where the contract asks for bits:
//     EmbeddingBwd (one thread per column, tokens in order, no atomics),
//     AdamStep (explicit __f*_rn intrinsics, the reference's roundings) and
//     SquaredNorm (a fixed grid of double partial sums, fixed trees).
//   - No kernel allocates. Where an op reduces across rows into a weight
//     gradient (norm dgamma/dbeta, AttnRes dw/dgamma) and has no workspace,
//     the per-block partial sums are parked in the input-gradient output,
//     which is only written afterwards (see NormBwd / AttnResBwd).
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <type_traits>

#include "memplan/common/workspace.h"
#include "ops_launch.h"
#include "rope_cuda.h"

namespace memplan::kernels::cuda {
namespace {

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

bool Aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

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

unsigned RowGrid(const LaunchContext& ctx, int64_t rows) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(rows, int64_t{ctx.sm_count} * kBlocksPerSm)));
}

unsigned FlatGrid(const LaunchContext& ctx, int64_t items) {
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

// ---------------------------------------------------------------------------
// LayerNorm / RMSNorm. kLn selects LayerNorm (mean subtracted, beta); RMSNorm
// is the same code with mean 0.

struct RowStats {
  float mean;
  float rstd;
};

// Mean (LayerNorm) and 1/sqrt(biased variance + eps), two passes over the row
// (the second re-reads it from L1/L2), so a large mean does not cancel.
template <int W, bool kLn>
__device__ RowStats ComputeRowStats(const float* xr, int64_t cols, float eps, float* red) {
  float mean = 0.f;
  if constexpr (kLn) {
    float s = 0.f;
    ForEachInRow<W>(cols, [&](int64_t c) {
      float v[W];
      LoadRo<W>(xr + c, v);
#pragma unroll
      for (int j = 0; j < W; ++j) s += v[j];
    });
    mean = BlockSum1(s, red) / static_cast<float>(cols);
  }
  float q = 0.f;
  ForEachInRow<W>(cols, [&](int64_t c) {
    float v[W];
    LoadRo<W>(xr + c, v);
#pragma unroll
    for (int j = 0; j < W; ++j) {
      const float dv = v[j] - mean;
      q += dv * dv;
    }
  });
  const float var = BlockSum1(q, red) / static_cast<float>(cols);
  return {mean, 1.f / sqrtf(var + eps)};
}

template <int W, bool kLn>
__global__ void __launch_bounds__(kThreads) NormFwdKernel(const float* x, const float* gamma, const float* beta,
                                                          int64_t rows, int64_t cols, float eps, float* y) {
  __shared__ float red[kWarps];
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const float* xr = x + row * cols;
    float* yr = y + row * cols;
    const RowStats st = ComputeRowStats<W, kLn>(xr, cols, eps, red);
    ForEachInRow<W>(cols, [&](int64_t c) {
      float v[W], g[W], b[W];
      LoadRo<W>(xr + c, v);
      LoadRo<W>(gamma + c, g);
      if constexpr (kLn) LoadRo<W>(beta + c, b);
#pragma unroll
      for (int j = 0; j < W; ++j) {
        v[j] = (v[j] - st.mean) * st.rstd * g[j];
        if constexpr (kLn) v[j] += b[j];
      }
      Store<W>(yr + c, v);
    });
  }
}

// The forward with the row held in registers (kSlots float4 per thread,
// cols % 4 == 0, cols <= kSlots * 4 * kThreads): x is read from memory once,
// which keeps the op at copy speed for model widths up to 8192.
template <bool kLn, int kSlots>
__global__ void __launch_bounds__(kThreads) NormFwdCachedKernel(const float* x, const float* gamma, const float* beta,
                                                                int64_t rows, int64_t cols, float eps, float* y) {
  __shared__ float red[kWarps];
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const float* xr = x + row * cols;
    float* yr = y + row * cols;
    float v[kSlots][4];
    float s = 0.f;
#pragma unroll
    for (int k = 0; k < kSlots; ++k) {
      const int64_t c = (static_cast<int64_t>(k) * kThreads + threadIdx.x) * 4;
      if (c < cols) {
        LoadRo<4>(xr + c, v[k]);
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) v[k][j] = 0.f;
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) s += v[k][j];
    }
    const float mean = kLn ? BlockSum1(s, red) / static_cast<float>(cols) : 0.f;
    float q = 0.f;
#pragma unroll
    for (int k = 0; k < kSlots; ++k) {
      const int64_t c = (static_cast<int64_t>(k) * kThreads + threadIdx.x) * 4;
      if (c < cols) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float dv = v[k][j] - mean;
          q += dv * dv;
        }
      }
    }
    const float rstd = 1.f / sqrtf(BlockSum1(q, red) / static_cast<float>(cols) + eps);
#pragma unroll
    for (int k = 0; k < kSlots; ++k) {
      const int64_t c = (static_cast<int64_t>(k) * kThreads + threadIdx.x) * 4;
      if (c < cols) {
        float g[4], b[4];
        LoadRo<4>(gamma + c, g);
        if constexpr (kLn) LoadRo<4>(beta + c, b);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          v[k][j] = (v[k][j] - mean) * rstd * g[j];
          if constexpr (kLn) v[k][j] += b[j];
        }
        Store<4>(yr + c, v[k]);
      }
    }
  }
}

// Pass 1 of the norm backward: block b sums dy * xhat (-> dgamma) and dy
// (-> dbeta) over its rows [b * rows_per_block, ...) in row order, each
// thread owning fixed columns, into shared memory (use_smem) or directly in
// global memory. The block's sums end up at part_g/part_b + b * part_stride:
// overwritten, or added to when `direct` (then the partial rows are dgamma
// and dbeta themselves, with one block).
template <int W, bool kLn>
__global__ void __launch_bounds__(kThreads)
    NormBwdPartialKernel(const float* x, const float* dy, int64_t rows, int64_t cols, float eps, int64_t rows_per_block,
                         float* part_g, float* part_b, int64_t part_stride, bool use_smem, bool direct) {
  __shared__ float red[kWarps];
  extern __shared__ float4 smem_raw[];
  float* smem = reinterpret_cast<float*>(smem_raw);
  float* out_g = part_g + static_cast<int64_t>(blockIdx.x) * part_stride;
  float* out_b = kLn ? part_b + static_cast<int64_t>(blockIdx.x) * part_stride : nullptr;
  float* acc_g = use_smem ? smem : out_g;
  float* acc_b = kLn ? (use_smem ? smem + cols : out_b) : nullptr;
  const float zero[W] = {};
  if (use_smem || !direct) {
    ForEachInRow<W>(cols, [&](int64_t c) {
      if (use_smem) {
        StoreShared<W>(acc_g + c, zero);
        if constexpr (kLn) StoreShared<W>(acc_b + c, zero);
      } else {
        Store<W>(acc_g + c, zero);
        if constexpr (kLn) Store<W>(acc_b + c, zero);
      }
    });
  }
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * rows_per_block;
  const int64_t r1 = r0 + rows_per_block < rows ? r0 + rows_per_block : rows;
  for (int64_t row = r0; row < r1; ++row) {
    const float* xr = x + row * cols;
    const float* dyr = dy + row * cols;
    const RowStats st = ComputeRowStats<W, kLn>(xr, cols, eps, red);
    ForEachInRow<W>(cols, [&](int64_t c) {
      float v[W], d[W], ag[W];
      LoadRo<W>(xr + c, v);
      LoadRo<W>(dyr + c, d);
      Load<W>(acc_g + c, ag);
#pragma unroll
      for (int j = 0; j < W; ++j) ag[j] += d[j] * ((v[j] - st.mean) * st.rstd);
      if (use_smem) {
        StoreShared<W>(acc_g + c, ag);
      } else {
        Store<W>(acc_g + c, ag);
      }
      if constexpr (kLn) {
        float ab[W];
        Load<W>(acc_b + c, ab);
#pragma unroll
        for (int j = 0; j < W; ++j) ab[j] += d[j];
        if (use_smem) {
          StoreShared<W>(acc_b + c, ab);
        } else {
          Store<W>(acc_b + c, ab);
        }
      }
    });
  }
  if (use_smem) {
    // Each thread copies out the columns it accumulated: no barrier needed.
    ForEachInRow<W>(cols, [&](int64_t c) {
      float a[W], o[W];
      Load<W>(acc_g + c, a);
      if (direct) {
        Load<W>(out_g + c, o);
#pragma unroll
        for (int j = 0; j < W; ++j) a[j] += o[j];
      }
      Store<W>(out_g + c, a);
      if constexpr (kLn) {
        Load<W>(acc_b + c, a);
        if (direct) {
          Load<W>(out_b + c, o);
#pragma unroll
          for (int j = 0; j < W; ++j) a[j] += o[j];
        }
        Store<W>(out_b + c, a);
      }
    });
  }
}

// out[c] += sum over b of part[b * cols + c], b ascending.
__global__ void __launch_bounds__(kThreads)
    AddColumnSumsKernel(const float* part, int64_t blocks, int64_t cols, float* out) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < cols; c += stride) {
    float s = 0.f;
    for (int64_t b = 0; b < blocks; ++b) s += part[b * cols + c];
    out[c] += s;
  }
}

// Pass 3: dx, one block per row. With xhat = (x - mean) * rstd and
// g = gamma * dy: LayerNorm dx = rstd * (g - mean(g) - xhat * mean(g * xhat)),
// RMSNorm dx = rstd * (g - xhat * mean(g * xhat)).
template <int W, bool kLn>
__global__ void __launch_bounds__(kThreads) NormBwdDxKernel(const float* x, const float* gamma, const float* dy,
                                                            int64_t rows, int64_t cols, float eps, float* dx) {
  __shared__ float red[2 * kWarps];
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const float* xr = x + row * cols;
    const float* dyr = dy + row * cols;
    float* dxr = dx + row * cols;
    const RowStats st = ComputeRowStats<W, kLn>(xr, cols, eps, red);
    float sums[2] = {0.f, 0.f};
    ForEachInRow<W>(cols, [&](int64_t c) {
      float v[W], d[W], g[W];
      LoadRo<W>(xr + c, v);
      LoadRo<W>(dyr + c, d);
      LoadRo<W>(gamma + c, g);
#pragma unroll
      for (int j = 0; j < W; ++j) {
        const float gd = g[j] * d[j];
        sums[0] += gd;
        sums[1] += gd * ((v[j] - st.mean) * st.rstd);
      }
    });
    BlockSum<2>(sums, red);
    const float inv_cols = 1.f / static_cast<float>(cols);
    const float mean_g = kLn ? sums[0] * inv_cols : 0.f;
    const float mean_gx = sums[1] * inv_cols;
    ForEachInRow<W>(cols, [&](int64_t c) {
      float v[W], d[W], g[W];
      LoadRo<W>(xr + c, v);
      LoadRo<W>(dyr + c, d);
      LoadRo<W>(gamma + c, g);
#pragma unroll
      for (int j = 0; j < W; ++j) {
        const float xhat = (v[j] - st.mean) * st.rstd;
        v[j] = st.rstd * (g[j] * d[j] - mean_g - xhat * mean_gx);
      }
      Store<W>(dxr + c, v);
    });
  }
}

template <int W, bool kLn>
cudaError_t NormFwd(const LaunchContext& ctx, const float* x, const float* gamma, const float* beta, int64_t rows,
                    int64_t cols, float eps, float* y) {
  const unsigned grid = RowGrid(ctx, rows);
  constexpr int64_t kSlotCols = 4 * kThreads;
  if (W == 4 && cols <= 1 * kSlotCols) {
    NormFwdCachedKernel<kLn, 1><<<grid, kThreads, 0, ctx.stream>>>(x, gamma, beta, rows, cols, eps, y);
  } else if (W == 4 && cols <= 2 * kSlotCols) {
    NormFwdCachedKernel<kLn, 2><<<grid, kThreads, 0, ctx.stream>>>(x, gamma, beta, rows, cols, eps, y);
  } else if (W == 4 && cols <= 4 * kSlotCols) {
    NormFwdCachedKernel<kLn, 4><<<grid, kThreads, 0, ctx.stream>>>(x, gamma, beta, rows, cols, eps, y);
  } else if (W == 4 && cols <= 8 * kSlotCols) {
    NormFwdCachedKernel<kLn, 8><<<grid, kThreads, 0, ctx.stream>>>(x, gamma, beta, rows, cols, eps, y);
  } else {
    NormFwdKernel<W, kLn><<<grid, kThreads, 0, ctx.stream>>>(x, gamma, beta, rows, cols, eps, y);
  }
  return cudaGetLastError();
}

// The deterministic three-pass backward (see NormBwdPartialKernel). The
// partial rows live in dx: LayerNorm needs 2 * blocks <= rows, RMSNorm
// blocks <= rows; a one-row LayerNorm accumulates straight into dgamma/dbeta.
template <int W, bool kLn>
cudaError_t NormBwd(const LaunchContext& ctx, const float* x, const float* gamma, const float* dy, int64_t rows,
                    int64_t cols, float eps, float* dx, float* dgamma, float* dbeta) {
  constexpr int64_t kAccs = kLn ? 2 : 1;
  const bool direct = rows < kAccs;
  int64_t blocks = direct ? 1 : std::min<int64_t>(rows / kAccs, int64_t{ctx.sm_count} * 2);
  const int64_t rows_per_block = (rows + blocks - 1) / blocks;
  blocks = (rows + rows_per_block - 1) / rows_per_block;
  const int64_t acc_bytes = kAccs * cols * static_cast<int64_t>(sizeof(float));
  cudaError_t err = cudaSuccess;
  auto* partial = &NormBwdPartialKernel<W, kLn>;
  const bool use_smem = UseSharedMemory(ctx, partial, acc_bytes, &err);
  if (err != cudaSuccess) return err;
  float* part_g = direct ? dgamma : dx;
  float* part_b = direct ? dbeta : dx + blocks * cols;
  partial<<<static_cast<unsigned>(blocks), kThreads, use_smem ? acc_bytes : 0, ctx.stream>>>(
      x, dy, rows, cols, eps, rows_per_block, part_g, part_b, direct ? 0 : cols, use_smem, direct);
  if (err = cudaGetLastError(); err != cudaSuccess) return err;
  if (!direct) {
    const unsigned grid = FlatGrid(ctx, cols);
    AddColumnSumsKernel<<<grid, kThreads, 0, ctx.stream>>>(part_g, blocks, cols, dgamma);
    if constexpr (kLn) AddColumnSumsKernel<<<grid, kThreads, 0, ctx.stream>>>(part_b, blocks, cols, dbeta);
    if (err = cudaGetLastError(); err != cudaSuccess) return err;
  }
  NormBwdDxKernel<W, kLn><<<RowGrid(ctx, rows), kThreads, 0, ctx.stream>>>(x, gamma, dy, rows, cols, eps, dx);
  return cudaGetLastError();
}

// ---------------------------------------------------------------------------
// Elementwise.

constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kGeluCubic = 0.044715f;

__device__ __forceinline__ float Gelu(float x) {
  const float u = kSqrt2OverPi * (x + kGeluCubic * x * x * x);
  return 0.5f * x * (1.f + tanhf(u));
}

__device__ __forceinline__ float GeluGrad(float x) {
  const float x2 = x * x;
  const float t = tanhf(kSqrt2OverPi * (x + kGeluCubic * x2 * x));
  return 0.5f * (1.f + t) + 0.5f * x * (1.f - t * t) * kSqrt2OverPi * (1.f + 3.f * kGeluCubic * x2);
}

__device__ __forceinline__ float Sigmoid(float x) { return 1.f / (1.f + expf(-x)); }

// The elementwise ops as functors of (a, b) (unary ones ignore b).
struct GeluOp {
  __device__ float operator()(float x, float) const { return Gelu(x); }
};
struct GeluGradOp {  // (x, dy)
  __device__ float operator()(float x, float dy) const { return dy * GeluGrad(x); }
};
struct AddOp {
  __device__ float operator()(float a, float b) const { return a + b; }
};
struct AxpbyOp {  // (x, y): a * x + b * y, no fused multiply-add (as the reference)
  float a, b;
  __device__ float operator()(float x, float y) const { return __fadd_rn(__fmul_rn(a, x), __fmul_rn(b, y)); }
};
struct ScaleOp {  // (x, -): a * x
  float a;
  __device__ float operator()(float x, float) const { return __fmul_rn(a, x); }
};
struct SigmoidOp {
  __device__ float operator()(float x, float) const { return Sigmoid(x); }
};
struct SigmoidGradOp {  // (y, dy): dy * (y * (1 - y)), as the reference (no fused multiply-add)
  __device__ float operator()(float y, float dy) const { return __fmul_rn(dy, __fmul_rn(y, __fsub_rn(1.f, y))); }
};

// y[i] = op(a[i], b[i]) (b may be null for a unary op), vectors of W. `a`
// is read through the coherent path, so y may alias it (Accumulate).
template <int W, typename Op>
__global__ void __launch_bounds__(kThreads) MapKernel(const float* a, const float* b, int64_t n, float* y, Op op) {
  ForEachFlat<W>(n, [&](int64_t i, auto width) {
    constexpr int kW = decltype(width)::value;
    float u[kW], v[kW] = {};
    Load<kW>(a + i, u);
    if (b != nullptr) LoadRo<kW>(b + i, v);
#pragma unroll
    for (int j = 0; j < kW; ++j) u[j] = op(u[j], v[j]);
    Store<kW>(y + i, u);
  });
}

template <typename Op>
cudaError_t LaunchMap(const LaunchContext& ctx, const float* a, const float* b, int64_t n, float* y, Op op) {
  if (n <= 0) return cudaSuccess;
  return LaunchByWidth(AllAligned16(a, y) && (b == nullptr || AllAligned16(b)), [&](auto width) {
    constexpr int kW = decltype(width)::value;
    MapKernel<kW><<<FlatGrid(ctx, kW == 4 ? n / 4 + 1 : n), kThreads, 0, ctx.stream>>>(a, b, n, y, op);
  });
}

template <int W>
__device__ __forceinline__ void StoreMask(uint8_t* p, const uint8_t (&m)[W]) {
  if constexpr (W == 4) {
    *reinterpret_cast<uint32_t*>(p) = static_cast<uint32_t>(m[0]) | (static_cast<uint32_t>(m[1]) << 8) |
                                      (static_cast<uint32_t>(m[2]) << 16) | (static_cast<uint32_t>(m[3]) << 24);
  } else {
    *p = m[0];
  }
}

template <int W>
__device__ __forceinline__ void LoadMask(const uint8_t* p, uint8_t (&m)[W]) {
  if constexpr (W == 4) {
    const uint32_t u = __ldg(reinterpret_cast<const unsigned int*>(p));
#pragma unroll
    for (int j = 0; j < 4; ++j) m[j] = static_cast<uint8_t>(u >> (8 * j));
  } else {
    m[0] = __ldg(p);
  }
}

// y = x * mask / keep with keep = 1 - p, written as a select so that p == 1
// gives zeros rather than 0 * inf.
template <int W>
__global__ void __launch_bounds__(kThreads) DropoutFwdKernel(const float* x, int64_t n, float p, float keep,
                                                             uint64_t seed, uint64_t offset, float* y, uint8_t* mask) {
  ForEachFlat<W>(n, [&](int64_t i, auto width) {
    constexpr int kW = decltype(width)::value;
    float v[kW];
    uint8_t m[kW];
    LoadRo<kW>(x + i, v);
#pragma unroll
    for (int j = 0; j < kW; ++j) {
      m[j] = Uniform01Device(seed, offset, static_cast<uint64_t>(i + j)) >= p ? 1 : 0;
      v[j] = m[j] ? v[j] / keep : 0.f;
    }
    Store<kW>(y + i, v);
    StoreMask<kW>(mask + i, m);
  });
}

template <int W>
__global__ void __launch_bounds__(kThreads)
    DropoutBwdKernel(const float* dy, const uint8_t* mask, int64_t n, float keep, float* dx) {
  ForEachFlat<W>(n, [&](int64_t i, auto width) {
    constexpr int kW = decltype(width)::value;
    float v[kW];
    uint8_t m[kW];
    LoadRo<kW>(dy + i, v);
    LoadMask<kW>(mask + i, m);
#pragma unroll
    for (int j = 0; j < kW; ++j) v[j] = m[j] ? v[j] / keep : 0.f;
    Store<kW>(dx + i, v);
  });
}

// SwiGLU over the output index space [rows, f], vectors of W within a row
// (f % W == 0). Index is uint32_t when rows * f / W fits, so the row split is
// a 32-bit division.
template <int W, typename Index>
__global__ void __launch_bounds__(kThreads) SwigluFwdKernel(const float* x, int64_t rows, int64_t f, float* y) {
  const Index f_vec = static_cast<Index>(f / W);
  const Index total = static_cast<Index>(rows) * f_vec;
  const Index stride = static_cast<Index>(gridDim.x) * kThreads;
  for (Index v = static_cast<Index>(blockIdx.x) * kThreads + threadIdx.x; v < total; v += stride) {
    const Index r = v / f_vec;
    const int64_t c = static_cast<int64_t>(v - r * f_vec) * W;
    const float* gate = x + static_cast<int64_t>(r) * 2 * f + c;
    float g[W], u[W];
    LoadRo<W>(gate, g);
    LoadRo<W>(gate + f, u);
#pragma unroll
    for (int j = 0; j < W; ++j) g[j] = g[j] * Sigmoid(g[j]) * u[j];
    Store<W>(y + static_cast<int64_t>(r) * f + c, g);
  }
}

// d gate = dy * up * s * (1 + gate * (1 - s)), d up = dy * gate * s, s = sigmoid(gate).
template <int W, typename Index>
__global__ void __launch_bounds__(kThreads)
    SwigluBwdKernel(const float* x, const float* dy, int64_t rows, int64_t f, float* dx) {
  const Index f_vec = static_cast<Index>(f / W);
  const Index total = static_cast<Index>(rows) * f_vec;
  const Index stride = static_cast<Index>(gridDim.x) * kThreads;
  for (Index v = static_cast<Index>(blockIdx.x) * kThreads + threadIdx.x; v < total; v += stride) {
    const Index r = v / f_vec;
    const int64_t c = static_cast<int64_t>(v - r * f_vec) * W;
    const int64_t in = static_cast<int64_t>(r) * 2 * f + c;
    float g[W], u[W], d[W];
    LoadRo<W>(x + in, g);
    LoadRo<W>(x + in + f, u);
    LoadRo<W>(dy + static_cast<int64_t>(r) * f + c, d);
#pragma unroll
    for (int j = 0; j < W; ++j) {
      const float s = Sigmoid(g[j]);
      const float dgate = d[j] * u[j] * s * (1.f + g[j] * (1.f - s));
      u[j] = d[j] * g[j] * s;
      g[j] = dgate;
    }
    Store<W>(dx + in, g);
    Store<W>(dx + in + f, u);
  }
}

// True when the vector index of a [rows, f] output fits uint32_t together
// with the grid stride.
bool FitsUint32(const LaunchContext& ctx, int64_t total) {
  return total + int64_t{FlatGrid(ctx, total)} * kThreads < (int64_t{1} << 32);
}

template <int W>
void SwigluFwdLaunch(const LaunchContext& ctx, const float* x, int64_t rows, int64_t f, float* y) {
  const int64_t total = rows * (f / W);
  if (FitsUint32(ctx, total)) {
    SwigluFwdKernel<W, uint32_t><<<FlatGrid(ctx, total), kThreads, 0, ctx.stream>>>(x, rows, f, y);
  } else {
    SwigluFwdKernel<W, int64_t><<<FlatGrid(ctx, total), kThreads, 0, ctx.stream>>>(x, rows, f, y);
  }
}

template <int W>
void SwigluBwdLaunch(const LaunchContext& ctx, const float* x, const float* dy, int64_t rows, int64_t f, float* dx) {
  const int64_t total = rows * (f / W);
  if (FitsUint32(ctx, total)) {
    SwigluBwdKernel<W, uint32_t><<<FlatGrid(ctx, total), kThreads, 0, ctx.stream>>>(x, dy, rows, f, dx);
  } else {
    SwigluBwdKernel<W, int64_t><<<FlatGrid(ctx, total), kThreads, 0, ctx.stream>>>(x, dy, rows, f, dx);
  }
}

// ---------------------------------------------------------------------------
// Router and top-k, one warp per token.

// Rank order of (prob, expert): higher probability first, then lower index.
__device__ __forceinline__ bool RanksBefore(float av, int ai, float bv, int bi) {
  return av > bv || (av == bv && ai < bi);
}

// The top-k selection of one token's probabilities pr[experts], shared by
// RouterFwd and TopKFwd; warp-uniform call. Selection i is the best entry
// ranking after selection i - 1; lane 0 writes idx[i], w[i] and then the
// renormalization (summed best first). A lane reads only pr[lane + 32 j], so
// a caller that just wrote pr from the same lanes needs no barrier.
__device__ __forceinline__ void WarpTopK(const float* pr, int64_t experts, int64_t top_k, bool renormalize,
                                         int32_t* idx, float* w) {
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  float prev_v = INFINITY;
  int prev_i = -1;
  for (int64_t i = 0; i < top_k; ++i) {
    float best_v = -INFINITY;
    int best_i = INT_MAX;
    for (int64_t e = lane; e < experts; e += kWarpSize) {
      const float v = pr[e];
      const int ei = static_cast<int>(e);
      if (RanksBefore(prev_v, prev_i, v, ei) && RanksBefore(v, ei, best_v, best_i)) {
        best_v = v;
        best_i = ei;
      }
    }
#pragma unroll
    for (int o = kWarpSize / 2; o > 0; o /= 2) {
      const float ov = __shfl_xor_sync(kFullMask, best_v, o);
      const int oi = __shfl_xor_sync(kFullMask, best_i, o);
      if (RanksBefore(ov, oi, best_v, best_i)) {
        best_v = ov;
        best_i = oi;
      }
    }
    if (lane == 0) {
      idx[i] = best_i;
      w[i] = best_v;
    }
    prev_v = best_v;
    prev_i = best_i;
  }
  if (renormalize && lane == 0) {
    float s = 0.f;
    for (int64_t i = 0; i < top_k; ++i) s += w[i];
    for (int64_t i = 0; i < top_k; ++i) w[i] /= s;
  }
}

// The gradient of one token's top-k weights with respect to its
// probabilities, shared by RouterBwd and TopKBwd. With S = sum of the
// selected probabilities and w = p / S (renormalize):
// dp_i = (dw_i - sum_j dw_j w_j) / S, else dp_i = dw_i; zero off the
// selection. Every lane computes the k-term sums (same order, same values).
struct TopKGrad {
  const int32_t* idx;
  const float* dw;
  int64_t top_k;
  bool renormalize;
  float sel_sum = 1.f;
  float dot = 0.f;

  __device__ TopKGrad(const float* pr, const int32_t* idx_in, const float* w, const float* dw_in, int64_t k,
                      bool renorm)
      : idx(idx_in), dw(dw_in), top_k(k), renormalize(renorm) {
    if (renormalize) {
      sel_sum = 0.f;
      for (int64_t i = 0; i < top_k; ++i) {
        sel_sum += pr[idx[i]];
        dot += dw[i] * w[i];
      }
    }
  }
  // dp of selection i.
  __device__ float Selected(int64_t i) const { return renormalize ? (dw[i] - dot) / sel_sum : dw[i]; }
  // dp of expert e (0 when not selected).
  __device__ float At(int64_t e) const {
    float d = 0.f;
    for (int64_t i = 0; i < top_k; ++i) {
      if (idx[i] == e) d += Selected(i);
    }
    return d;
  }
};

__global__ void __launch_bounds__(kThreads)
    RouterFwdKernel(const float* logits, int64_t tokens, int64_t experts, int64_t top_k, bool sigmoid, bool renormalize,
                    float* probs, int32_t* topk_idx, float* topk_weights) {
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int64_t warp_stride = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / kWarpSize; t < tokens; t += warp_stride) {
    const float* lg = logits + t * experts;
    float* pr = probs + t * experts;
    if (sigmoid) {
      for (int64_t e = lane; e < experts; e += kWarpSize) pr[e] = Sigmoid(lg[e]);
    } else {
      float m = -INFINITY;
      for (int64_t e = lane; e < experts; e += kWarpSize) m = fmaxf(m, lg[e]);
      m = WarpMax(m);
      float s = 0.f;
      for (int64_t e = lane; e < experts; e += kWarpSize) s += expf(lg[e] - m);
      s = WarpSum(s);
      for (int64_t e = lane; e < experts; e += kWarpSize) pr[e] = expf(lg[e] - m) / s;
    }
    WarpTopK(pr, experts, top_k, renormalize, topk_idx + t * top_k, topk_weights + t * top_k);
  }
}

__global__ void __launch_bounds__(kThreads)
    TopKFwdKernel(const float* probs, int64_t tokens, int64_t experts, int64_t top_k, bool renormalize, int32_t* idx,
                  float* weights) {
  const int64_t warp_stride = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / kWarpSize; t < tokens; t += warp_stride) {
    WarpTopK(probs + t * experts, experts, top_k, renormalize, idx + t * top_k, weights + t * top_k);
  }
}

// dp from TopKGrad, then softmax: dlogit_e = p_e (dp_e - sum_i p_i dp_i);
// sigmoid: dlogit_e = dp_e p_e (1 - p_e).
__global__ void __launch_bounds__(kThreads)
    RouterBwdKernel(const float* probs, const int32_t* topk_idx, const float* topk_weights, const float* d_topk_weights,
                    int64_t tokens, int64_t experts, int64_t top_k, bool sigmoid, bool renormalize, float* dlogits) {
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int64_t warp_stride = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / kWarpSize; t < tokens; t += warp_stride) {
    const float* pr = probs + t * experts;
    const int32_t* idx = topk_idx + t * top_k;
    const TopKGrad grad(pr, idx, topk_weights + t * top_k, d_topk_weights + t * top_k, top_k, renormalize);
    float inner = 0.f;
    if (!sigmoid) {
      for (int64_t i = 0; i < top_k; ++i) inner += pr[idx[i]] * grad.Selected(i);
    }
    for (int64_t e = lane; e < experts; e += kWarpSize) {
      const float dpe = grad.At(e);
      const float p = pr[e];
      dlogits[t * experts + e] = sigmoid ? dpe * p * (1.f - p) : p * (dpe - inner);
    }
  }
}

__global__ void __launch_bounds__(kThreads)
    TopKBwdKernel(const float* probs, const int32_t* idx, const float* weights, const float* d_weights, int64_t tokens,
                  int64_t experts, int64_t top_k, bool renormalize, float* dprobs) {
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int64_t warp_stride = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / kWarpSize; t < tokens; t += warp_stride) {
    const TopKGrad grad(probs + t * experts, idx + t * top_k, weights + t * top_k, d_weights + t * top_k, top_k,
                        renormalize);
    for (int64_t e = lane; e < experts; e += kWarpSize) dprobs[t * experts + e] = grad.At(e);
  }
}

// ---------------------------------------------------------------------------
// Dispatch / combine.

// Block e of the window: offsets[e] = #{pairs with 0 <= expert < e}, then,
// for e < experts, a stable scatter of expert e's pairs: chunk by chunk in
// pair order, each pair's rank is the popcount of the ballots before it.
__global__ void __launch_bounds__(kPlanThreads)
    DispatchPlanKernel(const int32_t* topk_idx, int64_t n_pairs, int64_t experts, int64_t first_offset,
                       int32_t* slot_of, int64_t* staged_offsets) {
  __shared__ int warp_counts[kPlanWarps];
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  const int64_t e = first_offset + blockIdx.x;

  int below = 0;
  for (int64_t i = threadIdx.x; i < n_pairs; i += kPlanThreads) {
    const int32_t x = topk_idx[i];
    below += (x >= 0 && x < e) ? 1 : 0;
  }
  below = WarpSumInt(below);
  if (lane == 0) warp_counts[warp] = below;
  __syncthreads();
  int64_t base = 0;
  for (int w = 0; w < kPlanWarps; ++w) base += warp_counts[w];
  if (threadIdx.x == 0) staged_offsets[blockIdx.x] = base;
  if (e >= experts) return;  // the final offset only

  const unsigned lanes_below = (1u << lane) - 1u;
  for (int64_t chunk = 0; chunk < n_pairs; chunk += kPlanThreads) {
    __syncthreads();  // everyone is done reading warp_counts
    const int64_t i = chunk + threadIdx.x;
    const bool mine = i < n_pairs && topk_idx[i] == e;
    const unsigned ballot = __ballot_sync(kFullMask, mine);
    if (lane == 0) warp_counts[warp] = __popc(ballot);
    __syncthreads();
    int before = 0, in_chunk = 0;
    for (int w = 0; w < kPlanWarps; ++w) {
      const int c = warp_counts[w];
      in_chunk += c;
      if (w < warp) before += c;
    }
    if (mine) slot_of[base + before + __popc(ballot & lanes_below)] = static_cast<int32_t>(i);
    base += in_chunk;
  }
}

// x_sorted[j] = x[slot_of[j] / k], one block per sorted row.
template <int W>
__global__ void __launch_bounds__(kThreads) DispatchFwdKernel(const float* x, const int32_t* slot_of, int64_t n_rows,
                                                              int64_t top_k, int64_t d, float* x_sorted) {
  for (int64_t j = blockIdx.x; j < n_rows; j += gridDim.x) {
    const float* src = x + (slot_of[j] / top_k) * d;
    float* dst = x_sorted + j * d;
    ForEachInRow<W>(d, [&](int64_t c) {
      float v[W];
      LoadRo<W>(src + c, v);
      Store<W>(dst + c, v);
    });
  }
}

// Pass 1 of the gather-sums (DispatchBwd, CombineFwd): the inverse
// permutation, row (t, i) -> j, written as int32 into out[t * d + i] (the
// first top_k entries of token t's own output row; d >= top_k).
__global__ void __launch_bounds__(kThreads)
    InverseIntoRowsKernel(const int32_t* slot_of, int64_t n_rows, int64_t top_k, int64_t d, int32_t* out) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < n_rows; j += stride) {
    const int64_t slot = slot_of[j];
    const int64_t t = slot / top_k;
    out[t * d + (slot - t * top_k)] = static_cast<int32_t>(j);
  }
}

// Pass 2: out[t] = sum over i ascending of weight(t, i) * rows[inv(t, i)]
// (weight 1 when `weights` is nullptr). The block reads token t's inverse
// entries from its own output row before overwriting that row.
template <int W>
__global__ void __launch_bounds__(kThreads)
    GatherSumKernel(const float* rows, const float* weights, int64_t tokens, int64_t top_k, int64_t d, float* out) {
  extern __shared__ int32_t gather_smem[];
  int32_t* inv = gather_smem;
  float* wts = reinterpret_cast<float*>(gather_smem + top_k);
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    float* dst = out + t * d;
    for (int64_t i = threadIdx.x; i < top_k; i += kThreads) {
      inv[i] = reinterpret_cast<const int32_t*>(dst)[i];
      wts[i] = weights != nullptr ? weights[t * top_k + i] : 1.f;
    }
    __syncthreads();
    ForEachInRow<W>(d, [&](int64_t c) {
      float acc[W] = {};
      for (int64_t i = 0; i < top_k; ++i) {
        float v[W];
        LoadRo<W>(rows + static_cast<int64_t>(inv[i]) * d + c, v);
#pragma unroll
        for (int j = 0; j < W; ++j) acc[j] += wts[i] * v[j];
      }
      Store<W>(dst + c, acc);
    });
    __syncthreads();  // inv/wts are reused for the next token
  }
}

// Fallback for d < top_k (no room for the inverse): out is zeroed first,
// then atomics; the summation order is unspecified.
__global__ void __launch_bounds__(kThreads)
    GatherSumAtomicKernel(const float* rows, const int32_t* slot_of, const float* weights, int64_t n_rows,
                          int64_t top_k, int64_t d, float* out) {
  const int64_t total = n_rows * d;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < total; e += stride) {
    const int64_t j = e / d;
    const int64_t c = e - j * d;
    const int64_t slot = slot_of[j];
    const float w = weights != nullptr ? weights[slot] : 1.f;
    atomicAdd(out + (slot / top_k) * d + c, w * rows[e]);
  }
}

cudaError_t GatherSum(const LaunchContext& ctx, const float* rows, const int32_t* slot_of, const float* weights,
                      int64_t tokens, int64_t top_k, int64_t d, float* out) {
  const int64_t n_rows = tokens * top_k;
  if (tokens == 0 || d == 0) return cudaSuccess;
  if (d < top_k) {
    if (const cudaError_t err = cudaMemsetAsync(out, 0, tokens * d * sizeof(float), ctx.stream); err != cudaSuccess) {
      return err;
    }
    if (n_rows == 0) return cudaSuccess;
    GatherSumAtomicKernel<<<FlatGrid(ctx, n_rows * d), kThreads, 0, ctx.stream>>>(rows, slot_of, weights, n_rows, top_k,
                                                                                  d, out);
    return cudaGetLastError();
  }
  InverseIntoRowsKernel<<<FlatGrid(ctx, n_rows), kThreads, 0, ctx.stream>>>(slot_of, n_rows, top_k, d,
                                                                            reinterpret_cast<int32_t*>(out));
  if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  const int64_t smem_bytes = top_k * static_cast<int64_t>(sizeof(int32_t) + sizeof(float));
  cudaError_t err = cudaSuccess;
  const bool vec = d % 4 == 0 && AllAligned16(rows, out);
  if (vec) {
    if (!UseSharedMemory(ctx, &GatherSumKernel<4>, smem_bytes, &err)) {
      return err != cudaSuccess ? err : cudaErrorInvalidValue;
    }
    GatherSumKernel<4>
        <<<RowGrid(ctx, tokens), kThreads, smem_bytes, ctx.stream>>>(rows, weights, tokens, top_k, d, out);
  } else {
    if (!UseSharedMemory(ctx, &GatherSumKernel<1>, smem_bytes, &err)) {
      return err != cudaSuccess ? err : cudaErrorInvalidValue;
    }
    GatherSumKernel<1>
        <<<RowGrid(ctx, tokens), kThreads, smem_bytes, ctx.stream>>>(rows, weights, tokens, top_k, d, out);
  }
  return cudaGetLastError();
}

// One block per sorted row j of token t = slot / k: dy_sorted[j] =
// w[slot] * dout[t], and, when y_sorted is given, d_topk_weights[slot] =
// <dout[t], y_sorted[j]>.
template <int W>
__global__ void __launch_bounds__(kThreads)
    CombineBwdKernel(const float* dout, const int32_t* slot_of, const float* topk_weights, const float* y_sorted,
                     int64_t n_rows, int64_t top_k, int64_t d, float* dy_sorted, float* d_topk_weights) {
  __shared__ float red[kWarps];
  for (int64_t j = blockIdx.x; j < n_rows; j += gridDim.x) {
    const int64_t slot = slot_of[j];
    const float* g = dout + (slot / top_k) * d;
    const float wt = topk_weights[slot];
    float dot = 0.f;
    ForEachInRow<W>(d, [&](int64_t c) {
      float v[W];
      LoadRo<W>(g + c, v);
      if (y_sorted != nullptr) {
        float y[W];
        LoadRo<W>(y_sorted + j * d + c, y);
#pragma unroll
        for (int k = 0; k < W; ++k) dot += v[k] * y[k];
      }
#pragma unroll
      for (int k = 0; k < W; ++k) v[k] *= wt;
      Store<W>(dy_sorted + j * d + c, v);
    });
    if (y_sorted != nullptr) {
      dot = BlockSum1(dot, red);
      if (threadIdx.x == 0) d_topk_weights[slot] = dot;
    }
  }
}

// d_topk_weights[slot_of[j]] = <a[j], b[j]>, one block per sorted row.
template <int W>
__global__ void __launch_bounds__(kThreads)
    RowDotKernel(const float* a, const float* b, const int32_t* slot_of, const float* divisor, int64_t n_rows, int64_t f,
                 float* out) {
  __shared__ float red[kWarps];
  for (int64_t j = blockIdx.x; j < n_rows; j += gridDim.x) {
    float dot = 0.f;
    ForEachInRow<W>(f, [&](int64_t c) {
      float u[W], v[W];
      LoadRo<W>(a + j * f + c, u);
      LoadRo<W>(b + j * f + c, v);
#pragma unroll
      for (int k = 0; k < W; ++k) dot += u[k] * v[k];
    });
    dot = BlockSum1(dot, red);
    if (threadIdx.x == 0) {
      int32_t slot = slot_of[j];
      if (divisor != nullptr) dot = divisor[slot] == 0.f ? 0.f : __fdiv_rn(dot, divisor[slot]);
      out[slot] = dot;
    }
  }
}

// ---------------------------------------------------------------------------
// Cross-entropy, one block per token row.

// probs = softmax(logits); loss = log(sum exp(l - max)) - (l[target] - max),
// the same value as -log(probs[target]) without underflowing to inf.
template <int W>
__global__ void __launch_bounds__(kThreads)
    CrossEntropyFwdKernel(const float* logits, const int32_t* targets, int64_t tokens, int64_t vocab, float* probs,
                          float* loss) {
  __shared__ float red[kWarps];
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    const float* lg = logits + t * vocab;
    float* pr = probs + t * vocab;
    float m = -INFINITY;
    ForEachInRow<W>(vocab, [&](int64_t c) {
      float v[W];
      LoadRo<W>(lg + c, v);
#pragma unroll
      for (int j = 0; j < W; ++j) m = fmaxf(m, v[j]);
    });
    m = BlockMax(m, red);
    float s = 0.f;
    ForEachInRow<W>(vocab, [&](int64_t c) {
      float v[W];
      LoadRo<W>(lg + c, v);
#pragma unroll
      for (int j = 0; j < W; ++j) s += expf(v[j] - m);
    });
    s = BlockSum1(s, red);
    ForEachInRow<W>(vocab, [&](int64_t c) {
      float v[W];
      LoadRo<W>(lg + c, v);
#pragma unroll
      for (int j = 0; j < W; ++j) v[j] = expf(v[j] - m) / s;
      Store<W>(pr + c, v);
    });
    if (threadIdx.x == 0) {
      // An out-of-range target (outside the contract) gives NaN, not a stray read.
      const int64_t target = targets[t];
      loss[t] = target >= 0 && target < vocab ? logf(s) - (lg[target] - m) : NAN;
    }
  }
}

template <int W>
__global__ void __launch_bounds__(kThreads)
    CrossEntropyBwdKernel(const float* probs, const int32_t* targets, int64_t tokens, int64_t vocab, float scale,
                          float* dlogits) {
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    const int64_t target = targets[t];
    const float* pr = probs + t * vocab;
    float* dl = dlogits + t * vocab;
    ForEachInRow<W>(vocab, [&](int64_t c) {
      float v[W];
      LoadRo<W>(pr + c, v);
#pragma unroll
      for (int j = 0; j < W; ++j) v[j] = (v[j] - (c + j == target ? 1.f : 0.f)) * scale;
      Store<W>(dl + c, v);
    });
  }
}

// ---------------------------------------------------------------------------
// Block AttnRes, one block per token. Source i of token t is src.p[i] + t * d
// (the blocks are separate tensors, read in place). With
// r_i = 1/sqrt(mean(v_i^2) + eps), z_i = sum_c w_c gamma_c v_ic:
// logit_i = r_i z_i, a = softmax(logit).
// Backward, with da_i = <dh, v_i> and dlogit_i = a_i (da_i - sum_j a_j da_j):
//   dv_ic += a_i dh_c + dlogit_i r_i (w_c gamma_c - v_ic r_i^2 z_i / d)
//   dw_c += gamma_c U_c, dgamma_c += w_c U_c, U_c = sum_{t,i} dlogit_i r_i v_ic.

// The blocks' addresses, passed by value (__grid_constant__: read in place
// from the launch's parameter space).
struct AttnResSources {
  const float* p[workspace::kMaxAttnResSources];
};
struct AttnResGrads {
  float* p[workspace::kMaxAttnResSources];
};

// Per-token statistics in shared memory, n floats each.
struct AttnResShared {
  float* a;     // softmax weights
  float* r;     // rstd of each source
  float* z;     // w . (gamma * v_i)
  float* coef;  // dlogit_i * r_i (backward only)

  __device__ static AttnResShared At(float* base, int64_t n) { return {base, base + n, base + 2 * n, base + 3 * n}; }
};
constexpr int64_t kAttnResStatArrays = 4;

// Fills s.a, s.r, s.z (and s.coef when dh != nullptr) for token t. Ends with
// a barrier, so every thread may read them.
template <int W>
__device__ void AttnResTokenStats(const AttnResSources& src, const float* w, const float* gamma, const float* dh,
                                  int64_t n, int64_t d, float eps, int64_t t, AttnResShared s, float* red) {
  for (int64_t i = 0; i < n; ++i) {
    const float* v = src.p[i] + t * d;
    float sums[3] = {0.f, 0.f, 0.f};  // sum v^2, z, <dh, v>
    ForEachInRow<W>(d, [&](int64_t c) {
      float x[W], wc[W], g[W], h[W] = {};
      LoadRo<W>(v + c, x);
      LoadRo<W>(w + c, wc);
      LoadRo<W>(gamma + c, g);
      if (dh != nullptr) LoadRo<W>(dh + t * d + c, h);
#pragma unroll
      for (int j = 0; j < W; ++j) {
        sums[0] += x[j] * x[j];
        sums[1] += wc[j] * g[j] * x[j];
        if (dh != nullptr) sums[2] += h[j] * x[j];
      }
    });
    BlockSum<3>(sums, red);
    if (threadIdx.x == 0) {
      s.r[i] = 1.f / sqrtf(sums[0] / static_cast<float>(d) + eps);
      s.z[i] = sums[1];
      s.coef[i] = sums[2];  // da_i for now
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float m = -INFINITY;
    for (int64_t i = 0; i < n; ++i) m = fmaxf(m, s.r[i] * s.z[i]);
    float sum = 0.f;
    for (int64_t i = 0; i < n; ++i) sum += expf(s.r[i] * s.z[i] - m);
    for (int64_t i = 0; i < n; ++i) s.a[i] = expf(s.r[i] * s.z[i] - m) / sum;
    if (dh != nullptr) {
      float mean_da = 0.f;
      for (int64_t i = 0; i < n; ++i) mean_da += s.a[i] * s.coef[i];
      for (int64_t i = 0; i < n; ++i) s.coef[i] = s.a[i] * (s.coef[i] - mean_da) * s.r[i];
    }
  }
  __syncthreads();
}

template <int W>
__global__ void __launch_bounds__(kThreads)
    AttnResFwdKernel(const __grid_constant__ AttnResSources src, int64_t n, const float* w, const float* gamma,
                     int64_t tokens, int64_t d, float eps, float* h, float* weights) {
  __shared__ float red[3 * kWarps];
  extern __shared__ float4 attn_res_fwd_smem[];
  const AttnResShared s = AttnResShared::At(reinterpret_cast<float*>(attn_res_fwd_smem), n);
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    AttnResTokenStats<W>(src, w, gamma, nullptr, n, d, eps, t, s, red);
    if (weights != nullptr) {
      for (int64_t i = threadIdx.x; i < n; i += kThreads) weights[t * n + i] = s.a[i];
    }
    ForEachInRow<W>(d, [&](int64_t c) {
      float acc[W] = {};
      for (int64_t i = 0; i < n; ++i) {
        float v[W];
        LoadRo<W>(src.p[i] + t * d + c, v);
#pragma unroll
        for (int j = 0; j < W; ++j) acc[j] += s.a[i] * v[j];
      }
      Store<W>(h + t * d + c, acc);
    });
    __syncthreads();  // s is reused for the next token
  }
}

// Pass 1: block b sums U over its tokens into shared memory or directly into
// part + b * d (the planned workspace), each thread owning fixed columns.
template <int W>
__global__ void __launch_bounds__(kThreads)
    AttnResBwdPartialKernel(const __grid_constant__ AttnResSources src, int64_t n, const float* w, const float* gamma,
                            const float* dh, int64_t tokens, int64_t d, float eps, int64_t tokens_per_block,
                            float* part, bool use_smem) {
  __shared__ float red[3 * kWarps];
  extern __shared__ float4 attn_res_bwd_smem[];
  float* smem = reinterpret_cast<float*>(attn_res_bwd_smem);
  // Layout: [U accumulators (d, when use_smem)] [stats].
  const AttnResShared s = AttnResShared::At(smem + (use_smem ? d : 0), n);
  float* out = part + static_cast<int64_t>(blockIdx.x) * d;
  float* acc = use_smem ? smem : out;
  const float zero[W] = {};
  ForEachInRow<W>(d, [&](int64_t c) {
    if (use_smem) {
      StoreShared<W>(acc + c, zero);
    } else {
      Store<W>(acc + c, zero);
    }
  });
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * tokens_per_block;
  const int64_t t1 = t0 + tokens_per_block < tokens ? t0 + tokens_per_block : tokens;
  for (int64_t t = t0; t < t1; ++t) {
    AttnResTokenStats<W>(src, w, gamma, dh, n, d, eps, t, s, red);
    ForEachInRow<W>(d, [&](int64_t c) {
      float u[W];
      Load<W>(acc + c, u);
      for (int64_t i = 0; i < n; ++i) {
        float v[W];
        LoadRo<W>(src.p[i] + t * d + c, v);
#pragma unroll
        for (int j = 0; j < W; ++j) u[j] += s.coef[i] * v[j];
      }
      if (use_smem) {
        StoreShared<W>(acc + c, u);
      } else {
        Store<W>(acc + c, u);
      }
    });
    __syncthreads();  // s is reused for the next token
  }
  if (use_smem) {
    ForEachInRow<W>(d, [&](int64_t c) {
      float u[W];
      Load<W>(acc + c, u);
      Store<W>(out + c, u);
    });
  }
}

// Pass 2: U = fixed-order sum of the partial rows; dw += gamma U, dgamma += w U.
__global__ void __launch_bounds__(kThreads)
    AttnResWeightGradKernel(const float* part, int64_t blocks, const float* w, const float* gamma, int64_t d, float* dw,
                            float* dgamma) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < d; c += stride) {
    float u = 0.f;
    for (int64_t b = 0; b < blocks; ++b) u += part[b * d + c];
    dw[c] += gamma[c] * u;
    dgamma[c] += w[c] * u;
  }
}

// Pass 3: dsources (added into).
template <int W>
__global__ void __launch_bounds__(kThreads)
    AttnResBwdDsKernel(const __grid_constant__ AttnResSources src, int64_t n, const float* w, const float* gamma,
                       const float* dh, int64_t tokens, int64_t d, float eps, const __grid_constant__ AttnResGrads ds) {
  __shared__ float red[3 * kWarps];
  extern __shared__ float4 attn_res_ds_smem[];
  const AttnResShared s = AttnResShared::At(reinterpret_cast<float*>(attn_res_ds_smem), n);
  const float inv_d = 1.f / static_cast<float>(d);
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    AttnResTokenStats<W>(src, w, gamma, dh, n, d, eps, t, s, red);
    ForEachInRow<W>(d, [&](int64_t c) {
      float g[W], wc[W], h[W];
      LoadRo<W>(gamma + c, g);
      LoadRo<W>(w + c, wc);
      LoadRo<W>(dh + t * d + c, h);
      for (int64_t i = 0; i < n; ++i) {
        const float k = s.r[i] * s.r[i] * s.z[i] * inv_d;
        float v[W], acc[W];
        LoadRo<W>(src.p[i] + t * d + c, v);
        Load<W>(ds.p[i] + t * d + c, acc);
#pragma unroll
        for (int j = 0; j < W; ++j) acc[j] += s.a[i] * h[j] + s.coef[i] * (wc[j] * g[j] - v[j] * k);
        Store<W>(ds.p[i] + t * d + c, acc);
      }
    });
    __syncthreads();  // s is reused for the next token
  }
}

template <int W>
cudaError_t AttnResBwd(const LaunchContext& ctx, const AttnResSources& src, int64_t n, const float* w,
                       const float* gamma, const float* dh, int64_t tokens, int64_t d, float eps,
                       const AttnResGrads& ds, float* dw, float* dgamma, float* workspace) {
  const int64_t stat_bytes = kAttnResStatArrays * n * static_cast<int64_t>(sizeof(float));
  // A fixed number of token groups (workspace::AttnResBwdBytes), not one per SM.
  int64_t blocks = std::min<int64_t>(tokens, workspace::kAttnResBwdGroups);
  const int64_t tokens_per_block = (tokens + blocks - 1) / blocks;
  blocks = (tokens + tokens_per_block - 1) / tokens_per_block;
  cudaError_t err = cudaSuccess;
  auto* partial = &AttnResBwdPartialKernel<W>;
  int64_t partial_bytes = stat_bytes + d * static_cast<int64_t>(sizeof(float));
  bool use_smem = UseSharedMemory(ctx, partial, partial_bytes, &err);
  if (err != cudaSuccess) return err;
  if (!use_smem) {
    partial_bytes = stat_bytes;
    if (!UseSharedMemory(ctx, partial, partial_bytes, &err)) {
      return err != cudaSuccess ? err : cudaErrorInvalidValue;
    }
  }
  partial<<<static_cast<unsigned>(blocks), kThreads, partial_bytes, ctx.stream>>>(
      src, n, w, gamma, dh, tokens, d, eps, tokens_per_block, workspace, use_smem);
  if (err = cudaGetLastError(); err != cudaSuccess) return err;
  AttnResWeightGradKernel<<<FlatGrid(ctx, d), kThreads, 0, ctx.stream>>>(workspace, blocks, w, gamma, d, dw, dgamma);
  if (err = cudaGetLastError(); err != cudaSuccess) return err;
  if (!UseSharedMemory(ctx, &AttnResBwdDsKernel<W>, stat_bytes, &err)) {
    return err != cudaSuccess ? err : cudaErrorInvalidValue;
  }
  AttnResBwdDsKernel<W>
      <<<RowGrid(ctx, tokens), kThreads, stat_bytes, ctx.stream>>>(src, n, w, gamma, dh, tokens, d, eps, ds);
  return cudaGetLastError();
}

// ---------------------------------------------------------------------------
// Strided batched GEMM with k == 0: C_i = beta * C_i (C not read when beta is
// 0), over the m x n entries of each [m, ldc] matrix.

__global__ void __launch_bounds__(kThreads)
    ScaleMatricesKernel(int64_t m, int64_t n, float beta, float* c, int64_t ldc, int64_t stride_c, int64_t batch) {
  const int64_t total = batch * m * n;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < total; e += stride) {
    const int64_t bi = e / (m * n);
    const int64_t r = (e - bi * m * n) / n;
    const int64_t col = e - bi * m * n - r * n;
    float* p = c + bi * stride_c + r * ldc + col;
    *p = beta == 0.f ? 0.f : beta * *p;
  }
}

// ---------------------------------------------------------------------------
// Softmax, one block per row. v = scale * x is rounded before the max is
// subtracted (__fmul_rn: no fused multiply-add), as in the reference.

template <int W>
__global__ void __launch_bounds__(kThreads) SoftmaxFwdKernel(const float* x, int64_t rows, int64_t cols, float scale,
                                                             int64_t causal_seq, float* y) {
  __shared__ float red[kWarps];
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const float* xr = x + row * cols;
    float* yr = y + row * cols;
    const int64_t visible = causal_seq > 0 ? MinI64(cols, row % causal_seq + 1) : cols;
    float m = -INFINITY;
    ForEachInRow<W>(cols, [&](int64_t c) {
      float v[W];
      LoadRo<W>(xr + c, v);
#pragma unroll
      for (int j = 0; j < W; ++j) {
        if (c + j < visible) m = fmaxf(m, __fmul_rn(scale, v[j]));
      }
    });
    m = BlockMax(m, red);
    float s = 0.f;
    ForEachInRow<W>(cols, [&](int64_t c) {
      float v[W];
      LoadRo<W>(xr + c, v);
#pragma unroll
      for (int j = 0; j < W; ++j) {
        if (c + j < visible) s += expf(__fmul_rn(scale, v[j]) - m);
      }
    });
    s = BlockSum1(s, red);
    ForEachInRow<W>(cols, [&](int64_t c) {
      float v[W];
      LoadRo<W>(xr + c, v);
#pragma unroll
      for (int j = 0; j < W; ++j) v[j] = c + j < visible ? expf(__fmul_rn(scale, v[j]) - m) / s : 0.f;
      Store<W>(yr + c, v);
    });
  }
}

// dx = scale * (y * (dy - sum_j dy_j y_j)).
template <int W>
__global__ void __launch_bounds__(kThreads)
    SoftmaxBwdKernel(const float* y, const float* dy, int64_t rows, int64_t cols, float scale, float* dx) {
  __shared__ float red[kWarps];
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const float* yr = y + row * cols;
    const float* dyr = dy + row * cols;
    float* dxr = dx + row * cols;
    float dot = 0.f;
    ForEachInRow<W>(cols, [&](int64_t c) {
      float a[W], b[W];
      LoadRo<W>(yr + c, a);
      LoadRo<W>(dyr + c, b);
#pragma unroll
      for (int j = 0; j < W; ++j) dot += a[j] * b[j];
    });
    dot = BlockSum1(dot, red);
    ForEachInRow<W>(cols, [&](int64_t c) {
      float a[W], b[W];
      LoadRo<W>(yr + c, a);
      LoadRo<W>(dyr + c, b);
#pragma unroll
      for (int j = 0; j < W; ++j) a[j] = scale * (a[j] * (b[j] - dot));
      Store<W>(dxr + c, a);
    });
  }
}

// ---------------------------------------------------------------------------
// Embedding.

// y[t] = table[tokens[t]], one block per token row.
template <int W>
__global__ void __launch_bounds__(kThreads)
    EmbeddingFwdKernel(const int32_t* tokens, const float* table, int64_t n, int64_t d, float* y) {
  for (int64_t t = blockIdx.x; t < n; t += gridDim.x) {
    const float* src = table + static_cast<int64_t>(tokens[t]) * d;
    float* dst = y + t * d;
    ForEachInRow<W>(d, [&](int64_t c) {
      float v[W];
      LoadRo<W>(src + c, v);
      Store<W>(dst + c, v);
    });
  }
}

// dtable[tokens[t], c] += dy[t, c]: one thread per column c, looping over
// the tokens in order, so each element receives its terms in token order
// (the reference's order) with no atomics.
__global__ void __launch_bounds__(kThreads) EmbeddingBwdKernel(const int32_t* __restrict__ tokens,
                                                               const float* __restrict__ dy, int64_t n, int64_t d,
                                                               float* __restrict__ dtable) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < d; c += stride) {
    for (int64_t t = 0; t < n; ++t) {
      float* p = dtable + static_cast<int64_t>(__ldg(tokens + t)) * d + c;
      *p = __fadd_rn(*p, __ldg(dy + t * d + c));
    }
  }
}

// ---------------------------------------------------------------------------
// Split heads (+ RoPE). Work item (row, slot, i): row = b * s + pos of qkv,
// slot < heads + 2 kv_heads the head in qkv's columns, and i < head_dim
// (no rope) or i < head_dim / 2 (rope: the pair i, i + half).

struct SplitArgs {
  int64_t b, s, heads, kv_heads, head_dim;
  bool rope;
  float rope_theta;
};

// kBwd = false: qkv -> q, k, v (rotate); true: dq, dk, dv -> dqkv (rotate
// back). `heads_ptr[0..2]` are q, k, v (or their gradients).
template <bool kBwd>
__global__ void __launch_bounds__(kThreads)
    SplitHeadsKernel(SplitArgs a, const float* qkv_in, float* qkv_out, const float* h0_in, const float* h1_in,
                     const float* h2_in, float* h0_out, float* h1_out, float* h2_out) {
  const int64_t slots = a.heads + 2 * a.kv_heads;
  const int64_t width = slots * a.head_dim;
  const int64_t per_head = a.rope ? a.head_dim / 2 : a.head_dim;
  const int64_t half = a.head_dim / 2;
  const int64_t total = a.b * a.s * slots * per_head;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t item = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; item < total; item += stride) {
    const int64_t i = item % per_head;
    const int64_t rest = item / per_head;
    const int64_t slot = rest % slots;
    const int64_t row = rest / slots;
    const int64_t bb = row / a.s;
    const int64_t pos = row - bb * a.s;
    const int64_t q_off = row * width + slot * a.head_dim;
    int64_t h_off;
    int which;
    if (slot < a.heads) {
      which = 0;
      h_off = ((bb * a.heads + slot) * a.s + pos) * a.head_dim;
    } else if (slot < a.heads + a.kv_heads) {
      which = 1;
      h_off = ((bb * a.kv_heads + (slot - a.heads)) * a.s + pos) * a.head_dim;
    } else {
      which = 2;
      h_off = ((bb * a.kv_heads + (slot - a.heads - a.kv_heads)) * a.s + pos) * a.head_dim;
    }
    const float* src;
    float* dst;
    if constexpr (kBwd) {
      src = (which == 0 ? h0_in : which == 1 ? h1_in : h2_in) + h_off;
      dst = qkv_out + q_off;
    } else {
      src = qkv_in + q_off;
      dst = (which == 0 ? h0_out : which == 1 ? h1_out : h2_out) + h_off;
    }
    if (!a.rope) {
      dst[i] = src[i];
    } else if (which == 2) {
      dst[i] = src[i];
      dst[i + half] = src[i + half];
    } else {
      float c, s;
      RopeCosSin(pos, i, a.head_dim, a.rope_theta, &c, &s);
      const float x0 = src[i];
      const float x1 = src[i + half];
      if constexpr (kBwd) {
        dst[i] = __fadd_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
        dst[i + half] = __fsub_rn(__fmul_rn(x1, c), __fmul_rn(x0, s));
      } else {
        dst[i] = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
        dst[i + half] = __fadd_rn(__fmul_rn(x1, c), __fmul_rn(x0, s));
      }
    }
  }
}

// ---------------------------------------------------------------------------
// AdamW: the order of operations of ops.h, each one IEEE fp32 rounding
// (explicit __f*_rn intrinsics, so nvcc cannot fuse a multiply-add), hence
// the reference's bits.

struct AdamArgs {
  float beta1, beta2, one_minus_beta1, one_minus_beta2, bc1, bc2, lr, eps, weight_decay;
};

template <int W>
__global__ void __launch_bounds__(kThreads)
    AdamKernel(float* master, const float* grad, float* m, float* v, int64_t n, AdamArgs a) {
  ForEachFlat<W>(n, [&](int64_t i, auto width) {
    constexpr int kW = decltype(width)::value;
    float p[kW], g[kW], mi[kW], vi[kW];
    Load<kW>(master + i, p);
    LoadRo<kW>(grad + i, g);
    Load<kW>(m + i, mi);
    Load<kW>(v + i, vi);
#pragma unroll
    for (int j = 0; j < kW; ++j) {
      mi[j] = __fadd_rn(__fmul_rn(a.beta1, mi[j]), __fmul_rn(a.one_minus_beta1, g[j]));
      vi[j] = __fadd_rn(__fmul_rn(a.beta2, vi[j]), __fmul_rn(__fmul_rn(a.one_minus_beta2, g[j]), g[j]));
      const float mhat = __fdiv_rn(mi[j], a.bc1);
      const float vhat = __fdiv_rn(vi[j], a.bc2);
      const float u = __fadd_rn(__fdiv_rn(mhat, __fadd_rn(__fsqrt_rn(vhat), a.eps)), __fmul_rn(a.weight_decay, p[j]));
      p[j] = __fsub_rn(p[j], __fmul_rn(a.lr, u));
    }
    Store<kW>(master + i, p);
    Store<kW>(m + i, mi);
    Store<kW>(v + i, vi);
  });
}

// ---------------------------------------------------------------------------
// Squared norm in double, a fixed two-level reduction: kSquaredNormPartials
// blocks, thread g summing x[g], x[g + G], x[g + 2G], ... (G the fixed grid
// size) in that order, a fixed block tree, then one block summing the
// partials with the same tree. Nothing depends on the device or timing.

constexpr int64_t kNormGridThreads = kSquaredNormPartials * kThreads;

__device__ __forceinline__ double WarpSumD(double v) {
#pragma unroll
  for (int o = kWarpSize / 2; o > 0; o /= 2) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}

// `red` is __shared__ double[kWarps]. Block-uniform call; every thread
// gets the same total.
__device__ __forceinline__ double BlockSumD(double v, double* red) {
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  v = WarpSumD(v);
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  return WarpSumD(lane < kWarps ? red[lane] : 0.0);
}

__global__ void __launch_bounds__(kThreads) SquaredNormPartialKernel(const float* x, int64_t n, double* partials) {
  __shared__ double red[kWarps];
  constexpr int64_t kStride = kNormGridThreads;
  int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  double acc = 0.0;
  // Four loads in flight, added in the same order as the plain loop.
  for (; i + 3 * kStride < n; i += 4 * kStride) {
    const double a0 = __ldg(x + i), a1 = __ldg(x + i + kStride), a2 = __ldg(x + i + 2 * kStride),
                 a3 = __ldg(x + i + 3 * kStride);
    acc += a0 * a0;
    acc += a1 * a1;
    acc += a2 * a2;
    acc += a3 * a3;
  }
  for (; i < n; i += kStride) {
    const double a = __ldg(x + i);
    acc += a * a;
  }
  acc = BlockSumD(acc, red);
  if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}

__global__ void __launch_bounds__(kThreads) SquaredNormFinalKernel(const double* partials, double* out) {
  __shared__ double red[kWarps];
  double acc = 0.0;
  for (int64_t i = threadIdx.x; i < kSquaredNormPartials; i += kThreads) acc += partials[i];
  acc = BlockSumD(acc, red);
  if (threadIdx.x == 0) *out = acc;
}

}  // namespace

// ---------------------------------------------------------------------------
// Launchers.

cudaError_t LaunchLayerNormFwd(const LaunchContext& ctx, const float* x, const float* gamma, const float* beta,
                               int64_t rows, int64_t cols, float eps, float* y) {
  if (rows <= 0 || cols <= 0) return cudaSuccess;
  return cols % 4 == 0 && AllAligned16(x, gamma, beta, y) ? NormFwd<4, true>(ctx, x, gamma, beta, rows, cols, eps, y)
                                                          : NormFwd<1, true>(ctx, x, gamma, beta, rows, cols, eps, y);
}

cudaError_t LaunchLayerNormBwd(const LaunchContext& ctx, const float* x, const float* gamma, const float* dy,
                               int64_t rows, int64_t cols, float eps, float* dx, float* dgamma, float* dbeta) {
  if (rows <= 0 || cols <= 0) return cudaSuccess;
  return cols % 4 == 0 && AllAligned16(x, gamma, dy, dx, dgamma, dbeta)
             ? NormBwd<4, true>(ctx, x, gamma, dy, rows, cols, eps, dx, dgamma, dbeta)
             : NormBwd<1, true>(ctx, x, gamma, dy, rows, cols, eps, dx, dgamma, dbeta);
}

cudaError_t LaunchRmsNormFwd(const LaunchContext& ctx, const float* x, const float* gamma, int64_t rows, int64_t cols,
                             float eps, float* y) {
  if (rows <= 0 || cols <= 0) return cudaSuccess;
  return cols % 4 == 0 && AllAligned16(x, gamma, y) ? NormFwd<4, false>(ctx, x, gamma, nullptr, rows, cols, eps, y)
                                                    : NormFwd<1, false>(ctx, x, gamma, nullptr, rows, cols, eps, y);
}

cudaError_t LaunchRmsNormBwd(const LaunchContext& ctx, const float* x, const float* gamma, const float* dy,
                             int64_t rows, int64_t cols, float eps, float* dx, float* dgamma) {
  if (rows <= 0 || cols <= 0) return cudaSuccess;
  return cols % 4 == 0 && AllAligned16(x, gamma, dy, dx, dgamma)
             ? NormBwd<4, false>(ctx, x, gamma, dy, rows, cols, eps, dx, dgamma, nullptr)
             : NormBwd<1, false>(ctx, x, gamma, dy, rows, cols, eps, dx, dgamma, nullptr);
}

cudaError_t LaunchGeluFwd(const LaunchContext& ctx, const float* x, int64_t n, float* y) {
  return LaunchMap(ctx, x, nullptr, n, y, GeluOp{});
}

cudaError_t LaunchGeluBwd(const LaunchContext& ctx, const float* x, const float* dy, int64_t n, float* dx) {
  return LaunchMap(ctx, x, dy, n, dx, GeluGradOp{});
}

cudaError_t LaunchSwigluFwd(const LaunchContext& ctx, const float* x, int64_t rows, int64_t f, float* y) {
  if (rows <= 0 || f <= 0) return cudaSuccess;
  if (f % 4 == 0 && AllAligned16(x, y)) {
    SwigluFwdLaunch<4>(ctx, x, rows, f, y);
  } else {
    SwigluFwdLaunch<1>(ctx, x, rows, f, y);
  }
  return cudaGetLastError();
}

cudaError_t LaunchSwigluBwd(const LaunchContext& ctx, const float* x, const float* dy, int64_t rows, int64_t f,
                            float* dx) {
  if (rows <= 0 || f <= 0) return cudaSuccess;
  if (f % 4 == 0 && AllAligned16(x, dy, dx)) {
    SwigluBwdLaunch<4>(ctx, x, dy, rows, f, dx);
  } else {
    SwigluBwdLaunch<1>(ctx, x, dy, rows, f, dx);
  }
  return cudaGetLastError();
}

cudaError_t LaunchDropoutFwd(const LaunchContext& ctx, const float* x, int64_t n, float p, uint64_t seed,
                             uint64_t offset, float* y, uint8_t* mask) {
  if (n <= 0) return cudaSuccess;
  const float keep = 1.f - p;
  return LaunchByWidth(AllAligned16(x, y) && Aligned(mask, 4), [&](auto width) {
    constexpr int kW = decltype(width)::value;
    DropoutFwdKernel<kW>
        <<<FlatGrid(ctx, kW == 4 ? n / 4 + 1 : n), kThreads, 0, ctx.stream>>>(x, n, p, keep, seed, offset, y, mask);
  });
}

cudaError_t LaunchDropoutBwd(const LaunchContext& ctx, const float* dy, const uint8_t* mask, int64_t n, float p,
                             float* dx) {
  if (n <= 0) return cudaSuccess;
  const float keep = 1.f - p;
  return LaunchByWidth(AllAligned16(dy, dx) && Aligned(mask, 4), [&](auto width) {
    constexpr int kW = decltype(width)::value;
    DropoutBwdKernel<kW>
        <<<FlatGrid(ctx, kW == 4 ? n / 4 + 1 : n), kThreads, 0, ctx.stream>>>(dy, mask, n, keep, dx);
  });
}

cudaError_t LaunchAdd(const LaunchContext& ctx, const float* a, const float* b, int64_t n, float* y) {
  return LaunchMap(ctx, a, b, n, y, AddOp{});
}

cudaError_t LaunchRouterFwd(const LaunchContext& ctx, const float* logits, int64_t tokens, int64_t experts,
                            int64_t top_k, bool sigmoid, bool renormalize, float* probs, int32_t* topk_idx,
                            float* topk_weights) {
  if (tokens <= 0 || experts <= 0) return cudaSuccess;
  const unsigned grid = RowGrid(ctx, (tokens + kWarps - 1) / kWarps);
  RouterFwdKernel<<<grid, kThreads, 0, ctx.stream>>>(logits, tokens, experts, top_k, sigmoid, renormalize, probs,
                                                     topk_idx, topk_weights);
  return cudaGetLastError();
}

cudaError_t LaunchRouterBwd(const LaunchContext& ctx, const float* probs, const int32_t* topk_idx,
                            const float* topk_weights, const float* d_topk_weights, int64_t tokens, int64_t experts,
                            int64_t top_k, bool sigmoid, bool renormalize, float* dlogits) {
  if (tokens <= 0 || experts <= 0) return cudaSuccess;
  const unsigned grid = RowGrid(ctx, (tokens + kWarps - 1) / kWarps);
  RouterBwdKernel<<<grid, kThreads, 0, ctx.stream>>>(probs, topk_idx, topk_weights, d_topk_weights, tokens, experts,
                                                     top_k, sigmoid, renormalize, dlogits);
  return cudaGetLastError();
}

cudaError_t LaunchDispatchPlan(const LaunchContext& ctx, const int32_t* topk_idx, int64_t n_pairs, int64_t experts,
                               int64_t first_offset, int64_t offset_count, int32_t* slot_of, int64_t* staged_offsets) {
  if (offset_count <= 0) return cudaSuccess;
  DispatchPlanKernel<<<static_cast<unsigned>(offset_count), kPlanThreads, 0, ctx.stream>>>(
      topk_idx, n_pairs, experts, first_offset, slot_of, staged_offsets);
  return cudaGetLastError();
}

cudaError_t LaunchDispatchFwd(const LaunchContext& ctx, const float* x, const int32_t* slot_of, int64_t tokens,
                              int64_t top_k, int64_t d, float* x_sorted) {
  const int64_t n_rows = tokens * top_k;
  if (n_rows <= 0 || d <= 0) return cudaSuccess;
  return LaunchByWidth(d % 4 == 0 && AllAligned16(x, x_sorted), [&](auto width) {
    constexpr int kW = decltype(width)::value;
    DispatchFwdKernel<kW><<<RowGrid(ctx, n_rows), kThreads, 0, ctx.stream>>>(x, slot_of, n_rows, top_k, d, x_sorted);
  });
}

cudaError_t LaunchDispatchBwd(const LaunchContext& ctx, const float* dx_sorted, const int32_t* slot_of, int64_t tokens,
                              int64_t top_k, int64_t d, float* dx) {
  return GatherSum(ctx, dx_sorted, slot_of, nullptr, tokens, top_k, d, dx);
}

cudaError_t LaunchCombineFwd(const LaunchContext& ctx, const float* y_sorted, const int32_t* slot_of,
                             const float* topk_weights, int64_t tokens, int64_t top_k, int64_t d, float* out) {
  return GatherSum(ctx, y_sorted, slot_of, topk_weights, tokens, top_k, d, out);
}

cudaError_t LaunchCombineBwd(const LaunchContext& ctx, const float* dout, const int32_t* slot_of,
                             const float* topk_weights, const float* y_sorted, int64_t tokens, int64_t top_k, int64_t d,
                             float* dy_sorted, float* d_topk_weights) {
  const int64_t n_rows = tokens * top_k;
  if (n_rows <= 0) return cudaSuccess;
  return LaunchByWidth(d % 4 == 0 && AllAligned16(dout, y_sorted, dy_sorted), [&](auto width) {
    constexpr int kW = decltype(width)::value;
    CombineBwdKernel<kW><<<RowGrid(ctx, n_rows), kThreads, 0, ctx.stream>>>(dout, slot_of, topk_weights, y_sorted, n_rows,
                                                                            top_k, d, dy_sorted, d_topk_weights);
  });
}

cudaError_t LaunchRouterGradRewrite(const LaunchContext& ctx, const float* da, const float* act,
                                    const int32_t* slot_of, const float* topk_weights, int64_t tokens, int64_t top_k,
                                    int64_t f, float* d_topk_weights) {
  const int64_t n_rows = tokens * top_k;
  if (n_rows <= 0) return cudaSuccess;
  return LaunchByWidth(f % 4 == 0 && AllAligned16(da, act), [&](auto width) {
    constexpr int kW = decltype(width)::value;
    RowDotKernel<kW><<<RowGrid(ctx, n_rows), kThreads, 0, ctx.stream>>>(da, act, slot_of, topk_weights, n_rows, f,
                                                                        d_topk_weights);
  });
}

cudaError_t LaunchCrossEntropyFwd(const LaunchContext& ctx, const float* logits, const int32_t* targets, int64_t tokens,
                                  int64_t vocab, float* probs, float* loss) {
  if (tokens <= 0 || vocab <= 0) return cudaSuccess;
  return LaunchByWidth(vocab % 4 == 0 && AllAligned16(logits, probs), [&](auto width) {
    constexpr int kW = decltype(width)::value;
    CrossEntropyFwdKernel<kW>
        <<<RowGrid(ctx, tokens), kThreads, 0, ctx.stream>>>(logits, targets, tokens, vocab, probs, loss);
  });
}

cudaError_t LaunchCrossEntropyBwd(const LaunchContext& ctx, const float* probs, const int32_t* targets, int64_t tokens,
                                  int64_t vocab, float scale, float* dlogits) {
  if (tokens <= 0 || vocab <= 0) return cudaSuccess;
  return LaunchByWidth(vocab % 4 == 0 && AllAligned16(probs, dlogits), [&](auto width) {
    constexpr int kW = decltype(width)::value;
    CrossEntropyBwdKernel<kW>
        <<<RowGrid(ctx, tokens), kThreads, 0, ctx.stream>>>(probs, targets, tokens, vocab, scale, dlogits);
  });
}

cudaError_t LaunchAttnResFwd(const LaunchContext& ctx, const float* const* sources, int64_t n, const float* w,
                             const float* gamma, int64_t tokens, int64_t d, float eps, float* h, float* weights) {
  if (tokens <= 0 || d <= 0 || n <= 0) return cudaSuccess;
  if (n > workspace::kMaxAttnResSources) return cudaErrorInvalidValue;
  AttnResSources src{};
  bool aligned = d % 4 == 0 && AllAligned16(w, gamma, h);
  for (int64_t i = 0; i < n; ++i) {
    src.p[i] = sources[i];
    aligned = aligned && AllAligned16(sources[i]);
  }
  const int64_t smem_bytes = kAttnResStatArrays * n * static_cast<int64_t>(sizeof(float));
  cudaError_t err = cudaSuccess;
  const cudaError_t launched = LaunchByWidth(aligned, [&](auto width) {
    constexpr int kW = decltype(width)::value;
    if (!UseSharedMemory(ctx, &AttnResFwdKernel<kW>, smem_bytes, &err)) {
      if (err == cudaSuccess) err = cudaErrorInvalidValue;
      return;
    }
    AttnResFwdKernel<kW>
        <<<RowGrid(ctx, tokens), kThreads, smem_bytes, ctx.stream>>>(src, n, w, gamma, tokens, d, eps, h, weights);
  });
  return err != cudaSuccess ? err : launched;
}

cudaError_t LaunchAttnResBwd(const LaunchContext& ctx, const float* const* sources, int64_t n, const float* w,
                             const float* gamma, const float* dh, int64_t tokens, int64_t d, float eps,
                             float* const* dsources, float* dw, float* dgamma, float* workspace) {
  if (tokens <= 0 || d <= 0 || n <= 0) return cudaSuccess;
  if (n > workspace::kMaxAttnResSources) return cudaErrorInvalidValue;
  AttnResSources src{};
  AttnResGrads ds{};
  bool aligned = d % 4 == 0 && AllAligned16(w, gamma, dh, dw, dgamma, workspace);
  for (int64_t i = 0; i < n; ++i) {
    src.p[i] = sources[i];
    ds.p[i] = dsources[i];
    aligned = aligned && AllAligned16(sources[i], dsources[i]);
  }
  return aligned ? AttnResBwd<4>(ctx, src, n, w, gamma, dh, tokens, d, eps, ds, dw, dgamma, workspace)
                 : AttnResBwd<1>(ctx, src, n, w, gamma, dh, tokens, d, eps, ds, dw, dgamma, workspace);
}

cudaError_t LaunchScaleMatrices(const LaunchContext& ctx, int64_t m, int64_t n, float beta, float* c, int64_t ldc,
                                int64_t stride_c, int64_t batch) {
  if (m <= 0 || n <= 0 || batch <= 0 || beta == 1.f) return cudaSuccess;
  ScaleMatricesKernel<<<FlatGrid(ctx, batch * m * n), kThreads, 0, ctx.stream>>>(m, n, beta, c, ldc, stride_c, batch);
  return cudaGetLastError();
}

cudaError_t LaunchAccumulate(const LaunchContext& ctx, float* y, const float* x, int64_t n) {
  return LaunchMap(ctx, y, x, n, y, AddOp{});
}

cudaError_t LaunchAxpby(const LaunchContext& ctx, const float* x, const float* y, int64_t n, float a, float b,
                        float* out) {
  if (y == nullptr) return LaunchMap(ctx, x, nullptr, n, out, ScaleOp{a});
  return LaunchMap(ctx, x, y, n, out, AxpbyOp{a, b});
}

cudaError_t LaunchSoftmaxFwd(const LaunchContext& ctx, const float* x, int64_t rows, int64_t cols, float scale,
                             int64_t causal_seq, float* y) {
  if (rows <= 0 || cols <= 0) return cudaSuccess;
  return LaunchByWidth(cols % 4 == 0 && AllAligned16(x, y), [&](auto width) {
    constexpr int kW = decltype(width)::value;
    SoftmaxFwdKernel<kW><<<RowGrid(ctx, rows), kThreads, 0, ctx.stream>>>(x, rows, cols, scale, causal_seq, y);
  });
}

cudaError_t LaunchSoftmaxBwd(const LaunchContext& ctx, const float* y, const float* dy, int64_t rows, int64_t cols,
                             float scale, float* dx) {
  if (rows <= 0 || cols <= 0) return cudaSuccess;
  return LaunchByWidth(cols % 4 == 0 && AllAligned16(y, dy, dx), [&](auto width) {
    constexpr int kW = decltype(width)::value;
    SoftmaxBwdKernel<kW><<<RowGrid(ctx, rows), kThreads, 0, ctx.stream>>>(y, dy, rows, cols, scale, dx);
  });
}

cudaError_t LaunchSigmoidFwd(const LaunchContext& ctx, const float* x, int64_t n, float* y) {
  return LaunchMap(ctx, x, nullptr, n, y, SigmoidOp{});
}

cudaError_t LaunchSigmoidBwd(const LaunchContext& ctx, const float* y, const float* dy, int64_t n, float* dx) {
  return LaunchMap(ctx, y, dy, n, dx, SigmoidGradOp{});
}

cudaError_t LaunchTopKFwd(const LaunchContext& ctx, const float* probs, int64_t tokens, int64_t experts, int64_t top_k,
                          bool renormalize, int32_t* idx, float* weights) {
  if (tokens <= 0 || experts <= 0) return cudaSuccess;
  const unsigned grid = RowGrid(ctx, (tokens + kWarps - 1) / kWarps);
  TopKFwdKernel<<<grid, kThreads, 0, ctx.stream>>>(probs, tokens, experts, top_k, renormalize, idx, weights);
  return cudaGetLastError();
}

cudaError_t LaunchTopKBwd(const LaunchContext& ctx, const float* probs, const int32_t* idx, const float* weights,
                          const float* d_weights, int64_t tokens, int64_t experts, int64_t top_k, bool renormalize,
                          float* dprobs) {
  if (tokens <= 0 || experts <= 0) return cudaSuccess;
  const unsigned grid = RowGrid(ctx, (tokens + kWarps - 1) / kWarps);
  TopKBwdKernel<<<grid, kThreads, 0, ctx.stream>>>(probs, idx, weights, d_weights, tokens, experts, top_k,
                                                   renormalize, dprobs);
  return cudaGetLastError();
}

cudaError_t LaunchEmbeddingFwd(const LaunchContext& ctx, const int32_t* tokens, const float* table, int64_t n,
                               int64_t d, float* y) {
  if (n <= 0 || d <= 0) return cudaSuccess;
  return LaunchByWidth(d % 4 == 0 && AllAligned16(table, y), [&](auto width) {
    constexpr int kW = decltype(width)::value;
    EmbeddingFwdKernel<kW><<<RowGrid(ctx, n), kThreads, 0, ctx.stream>>>(tokens, table, n, d, y);
  });
}

cudaError_t LaunchEmbeddingBwd(const LaunchContext& ctx, const int32_t* tokens, const float* dy, int64_t n, int64_t d,
                               float* dtable) {
  if (n <= 0 || d <= 0) return cudaSuccess;
  EmbeddingBwdKernel<<<FlatGrid(ctx, d), kThreads, 0, ctx.stream>>>(tokens, dy, n, d, dtable);
  return cudaGetLastError();
}

namespace {

SplitArgs MakeSplitArgs(int64_t b, int64_t s, int64_t heads, int64_t kv_heads, int64_t head_dim, bool rope,
                        float rope_theta) {
  return SplitArgs{b, s, heads, kv_heads, head_dim, rope, rope_theta};
}

int64_t SplitItems(const SplitArgs& a) {
  return a.b * a.s * (a.heads + 2 * a.kv_heads) * (a.rope ? a.head_dim / 2 : a.head_dim);
}

}  // namespace

cudaError_t LaunchSplitHeadsFwd(const LaunchContext& ctx, const float* qkv, int64_t b, int64_t s, int64_t heads,
                                int64_t kv_heads, int64_t head_dim, bool rope, float rope_theta, float* q, float* k,
                                float* v) {
  const SplitArgs a = MakeSplitArgs(b, s, heads, kv_heads, head_dim, rope, rope_theta);
  const int64_t items = SplitItems(a);
  if (items <= 0) return cudaSuccess;
  if (rope && head_dim % 2 != 0) return cudaErrorInvalidValue;
  SplitHeadsKernel<false><<<FlatGrid(ctx, items), kThreads, 0, ctx.stream>>>(a, qkv, nullptr, nullptr, nullptr,
                                                                             nullptr, q, k, v);
  return cudaGetLastError();
}

cudaError_t LaunchSplitHeadsBwd(const LaunchContext& ctx, const float* dq, const float* dk, const float* dv, int64_t b,
                                int64_t s, int64_t heads, int64_t kv_heads, int64_t head_dim, bool rope,
                                float rope_theta, float* dqkv) {
  const SplitArgs a = MakeSplitArgs(b, s, heads, kv_heads, head_dim, rope, rope_theta);
  const int64_t items = SplitItems(a);
  if (items <= 0) return cudaSuccess;
  if (rope && head_dim % 2 != 0) return cudaErrorInvalidValue;
  SplitHeadsKernel<true><<<FlatGrid(ctx, items), kThreads, 0, ctx.stream>>>(a, nullptr, dqkv, dq, dk, dv, nullptr,
                                                                            nullptr, nullptr);
  return cudaGetLastError();
}

cudaError_t LaunchAdamStep(const LaunchContext& ctx, float* master, const float* grad, float* m, float* v, int64_t n,
                           float lr, float beta1, float beta2, float eps, float weight_decay, float bc1, float bc2) {
  if (n <= 0) return cudaSuccess;
  const AdamArgs a{beta1, beta2, 1.f - beta1, 1.f - beta2, bc1, bc2, lr, eps, weight_decay};
  return LaunchByWidth(AllAligned16(master, grad, m, v), [&](auto width) {
    constexpr int kW = decltype(width)::value;
    AdamKernel<kW><<<FlatGrid(ctx, kW == 4 ? n / 4 + 1 : n), kThreads, 0, ctx.stream>>>(master, grad, m, v, n, a);
  });
}

cudaError_t LaunchSquaredNorm(const LaunchContext& ctx, const float* x, int64_t n, double* partials, double* out) {
  SquaredNormPartialKernel<<<static_cast<unsigned>(kSquaredNormPartials), kThreads, 0, ctx.stream>>>(
      x, n > 0 ? n : 0, partials);
  if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  SquaredNormFinalKernel<<<1, kThreads, 0, ctx.stream>>>(partials, out);
  return cudaGetLastError();
}

}  // namespace memplan::kernels::cuda
