// The MoE kernels (ops.h): the router's softmax/sigmoid and top-k, one warp
// per token (selection and gradient code shared), and the dispatch/combine
// gathers and scatters with their deterministic backwards.
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>

#include "device_util.cuh"

namespace memplan::kernels::cuda {
namespace {

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

}  // namespace

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

}  // namespace memplan::kernels::cuda
