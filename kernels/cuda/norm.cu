// LayerNorm and RMSNorm (ops.h): one block per row, the statistics in two
// passes over the row; the backward is deterministic in three passes (per
// block partials of dgamma/dbeta parked in dx, a fixed-order column sum, then
// dx itself).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "device_util.cuh"

namespace memplan::kernels::cuda {
namespace {

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

}  // namespace

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

}  // namespace memplan::kernels::cuda
