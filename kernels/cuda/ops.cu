// CUDA kernels of the Ops interface (ops.h), except the norms (norm.cu),
// the MoE router, top-k, dispatch and combine (moe.cu), Block AttnRes
// (attn_res.cu), MLA's head split (mla.cu), KDA (kda.cu), bf16 conversions
// (convert.cu),
// attention (attention.cu) and the GEMMs (cuBLAS, cuda_ops.cc); the helpers
// they share are in device_util.cuh.
//
// Shapes of the kernels:
//   - Elementwise ops (GELU, SwiGLU, dropout, add, cross-entropy backward)
//     are memory bound: grid-stride loops over 16-byte float4 vectors when
//     every pointer is aligned (and, for row-structured ops, the row length is
//     a multiple of 4), scalar coalesced accesses otherwise.
//   - Row ops (cross-entropy forward, gathers, softmax) run one 256-thread
//     block per row (grid-stride over rows); row reductions are warp
//     shuffles, then one shuffle across the block's warps. The tree has a
//     fixed shape, so results do not change from run to run.
//   - Deterministic by construction where the contract asks for bits:
//     EmbeddingBwd (one thread per column, tokens in order, no atomics),
//     AdamStep (explicit __f*_rn intrinsics, the reference's roundings) and
//     SquaredNorm (a fixed grid of double partial sums, fixed trees).
//   - No kernel allocates.
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <type_traits>

#include "device_util.cuh"
#include "memplan/common/workspace.h"
#include "ops_launch.h"
#include "rope_cuda.h"

namespace memplan::kernels::cuda {
namespace {


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
                                                             uint64_t seed, uint64_t offset, float* y, uint8_t* mask,
                                                             int64_t first) {
  ForEachFlat<W>(n, [&](int64_t i, auto width) {
    constexpr int kW = decltype(width)::value;
    float v[kW];
    uint8_t m[kW];
    LoadRo<kW>(x + i, v);
#pragma unroll
    for (int j = 0; j < kW; ++j) {
      m[j] = Uniform01Device(seed, offset, static_cast<uint64_t>(first + i + j)) >= p ? 1 : 0;
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

// Vocabulary-parallel cross-entropy (ops.h): per row this rank's max, its
// sum of exp(l - max) and the target's logit; then probs from the combined
// (M, S). One block per token row.
__global__ void __launch_bounds__(kThreads)
    CrossEntropyPartialStatsKernel(const float* logits, const int32_t* targets, int64_t tokens, int64_t vocab,
                                   float* stats) {
  __shared__ float red[kWarps];
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    const float* lg = logits + t * vocab;
    float m = -INFINITY;
    for (int64_t c = threadIdx.x; c < vocab; c += blockDim.x) m = fmaxf(m, lg[c]);
    m = BlockMax(m, red);
    float s = 0.f;
    for (int64_t c = threadIdx.x; c < vocab; c += blockDim.x) s += expf(lg[c] - m);
    s = BlockSum1(s, red);
    if (threadIdx.x == 0) {
      const int64_t target = targets[t];
      stats[3 * t] = m;
      stats[3 * t + 1] = s;
      stats[3 * t + 2] = target >= 0 && target < vocab ? lg[target] : 0.f;
    }
  }
}

__global__ void __launch_bounds__(kThreads)
    CrossEntropyPartialProbsKernel(const float* logits, const float* stats, int64_t tokens, int64_t vocab,
                                   float* probs) {
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    const float m = stats[2 * t], s = stats[2 * t + 1];
    for (int64_t c = threadIdx.x; c < vocab; c += blockDim.x) probs[t * vocab + c] = expf(logits[t * vocab + c] - m) / s;
  }
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
                                                             int64_t causal_seq, float* y, int64_t cp,
                                                             int64_t cp_rank) {
  __shared__ float red[kWarps];
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const float* xr = x + row * cols;
    float* yr = y + row * cols;
    const int64_t visible =
        causal_seq > 0 ? MinI64(cols, CpPositionDevice(row % causal_seq, causal_seq, cp, cp_rank) + 1) : cols;
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
    const int64_t token = tokens[t];  // negative: a row another rank holds
    const float* src = table + token * d;
    float* dst = y + t * d;
    ForEachInRow<W>(d, [&](int64_t c) {
      float v[W];
      if (token >= 0) {
        LoadRo<W>(src + c, v);
      } else {
#pragma unroll
        for (int j = 0; j < W; ++j) v[j] = 0.f;
      }
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
      const int64_t token = __ldg(tokens + t);
      if (token < 0) continue;
      float* p = dtable + token * d + c;
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
  int64_t cp, cp_rank;  // ops.h's CpPosition
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
      RopeCosSin(CpPositionDevice(pos, a.s, a.cp, a.cp_rank), i, a.head_dim, a.rope_theta, &c, &s);
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
                             uint64_t offset, float* y, uint8_t* mask, int64_t first) {
  if (n <= 0) return cudaSuccess;
  const float keep = 1.f - p;
  return LaunchByWidth(AllAligned16(x, y) && Aligned(mask, 4), [&](auto width) {
    constexpr int kW = decltype(width)::value;
    DropoutFwdKernel<kW><<<FlatGrid(ctx, kW == 4 ? n / 4 + 1 : n), kThreads, 0, ctx.stream>>>(x, n, p, keep, seed,
                                                                                              offset, y, mask, first);
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

cudaError_t LaunchCrossEntropyPartialStats(const LaunchContext& ctx, const float* logits, const int32_t* targets,
                                           int64_t tokens, int64_t vocab, float* stats) {
  if (tokens <= 0 || vocab <= 0) return cudaSuccess;
  CrossEntropyPartialStatsKernel<<<RowGrid(ctx, tokens), kThreads, 0, ctx.stream>>>(logits, targets, tokens, vocab,
                                                                                     stats);
  return cudaGetLastError();
}

cudaError_t LaunchCrossEntropyPartialProbs(const LaunchContext& ctx, const float* logits, const float* stats,
                                           int64_t tokens, int64_t vocab, float* probs) {
  if (tokens <= 0 || vocab <= 0) return cudaSuccess;
  CrossEntropyPartialProbsKernel<<<RowGrid(ctx, tokens), kThreads, 0, ctx.stream>>>(logits, stats, tokens, vocab,
                                                                                     probs);
  return cudaGetLastError();
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
                             int64_t causal_seq, float* y, int64_t cp, int64_t cp_rank) {
  if (rows <= 0 || cols <= 0) return cudaSuccess;
  return LaunchByWidth(cols % 4 == 0 && AllAligned16(x, y), [&](auto width) {
    constexpr int kW = decltype(width)::value;
    SoftmaxFwdKernel<kW><<<RowGrid(ctx, rows), kThreads, 0, ctx.stream>>>(x, rows, cols, scale, causal_seq, y, cp,
                                                                           cp_rank);
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
                        float rope_theta, int64_t cp, int64_t cp_rank) {
  return SplitArgs{b, s, heads, kv_heads, head_dim, rope, rope_theta, cp, cp_rank};
}

int64_t SplitItems(const SplitArgs& a) {
  return a.b * a.s * (a.heads + 2 * a.kv_heads) * (a.rope ? a.head_dim / 2 : a.head_dim);
}

}  // namespace

cudaError_t LaunchSplitHeadsFwd(const LaunchContext& ctx, const float* qkv, int64_t b, int64_t s, int64_t heads,
                                int64_t kv_heads, int64_t head_dim, bool rope, float rope_theta, float* q, float* k,
                                float* v, int64_t cp, int64_t cp_rank) {
  const SplitArgs a = MakeSplitArgs(b, s, heads, kv_heads, head_dim, rope, rope_theta, cp, cp_rank);
  const int64_t items = SplitItems(a);
  if (items <= 0) return cudaSuccess;
  if (rope && head_dim % 2 != 0) return cudaErrorInvalidValue;
  SplitHeadsKernel<false><<<FlatGrid(ctx, items), kThreads, 0, ctx.stream>>>(a, qkv, nullptr, nullptr, nullptr,
                                                                             nullptr, q, k, v);
  return cudaGetLastError();
}

cudaError_t LaunchSplitHeadsBwd(const LaunchContext& ctx, const float* dq, const float* dk, const float* dv, int64_t b,
                                int64_t s, int64_t heads, int64_t kv_heads, int64_t head_dim, bool rope,
                                float rope_theta, float* dqkv, int64_t cp, int64_t cp_rank) {
  const SplitArgs a = MakeSplitArgs(b, s, heads, kv_heads, head_dim, rope, rope_theta, cp, cp_rank);
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
