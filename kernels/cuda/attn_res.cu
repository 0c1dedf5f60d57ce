// Block AttnRes (ops.h AttnResFwd/Bwd): one block per token over the n
// blocks, read in place through their addresses; the backward's dw/dgamma in
// a fixed order through the planned workspace.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "device_util.cuh"
#include "memplan/common/workspace.h"

namespace memplan::kernels::cuda {
namespace {

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

}  // namespace

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

}  // namespace memplan::kernels::cuda
