// CUDA attention launchers (attention_cuda.h): standard attention, which
// saves the s x s probabilities, and a FlashAttention-2-style pair that saves
// only o and the log-sum-exp. fp32 throughout. o and d_o are read and
// written through an OLayout (head-major [b, heads, s, dv] or, with
// AttentionShape::o_token_major, [b, s, heads, dv]); everything else is
// head-major.
//
// Standard attention is a chain of batched tiled GEMMs (one kernel,
// parameterized by operand layout and head mapping) plus row kernels for the
// softmax and its backward. The flash kernels keep one query tile (forward,
// dq) or one key tile (dk/dv) resident in shared memory and stream the other
// side through it.
//
// Determinism: every output element is reduced by one thread in a fixed
// order, and the heads that share a kv head (GQA) are summed inside the
// kernel that owns the kv-head tile, so there are no atomics and the results
// are reproducible run to run.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "attention_cuda.h"

namespace memplan::kernels::cuda {
namespace {

constexpr int kWarpSize = 32;
constexpr int kMaxHeadDim = 256;

// std::min is host-only without --expt-relaxed-constexpr.
__device__ __forceinline__ int64_t MinI64(int64_t a, int64_t b) { return a < b ? a : b; }

// ---------------------------------------------------------------------------
// Batched tiled GEMM for standard attention.
//
// C[z][m, n] = alpha * sum_{g < groups} sum_k opA_g(m, k) * opB_g(k, n), for
// z = (batch, output head). The operand head for output head `ho` and group
// member g is (ho * head_mul + g) / head_div, which expresses both "query
// head h reads kv head h / group" (mul 1, div group) and "kv head j sums
// query heads j * group + g" (mul group, div 1).
// ---------------------------------------------------------------------------

struct Operand {
  const float* ptr;
  int64_t batch_stride;  // elements between batches
  int64_t head_stride;   // elements between heads
  int64_t ld;            // row stride of the stored [rows, cols] matrix
  int head_mul;
  int head_div;
  bool trans;  // A: stored [k, m]; B: stored [n, k]
};

struct OutOperand {
  float* ptr;
  int64_t batch_stride;
  int64_t head_stride;
  int64_t ld;
};

// Which part of the k range can be non-zero, from the causal structure.
enum class KRange : int {
  kAll,         // every k
  kUpToRow,     // opA(m, k) == 0 for k > m (P or dS times something)
  kFromRow,     // opA(m, k) == 0 for k < m (P^T or dS^T times something)
};

struct GemmParams {
  Operand a, b;
  OutOperand c;
  int64_t m, n, k;
  int out_heads;
  int groups;
  float alpha;
  KRange k_range;
  bool causal_out_mask;  // C(m, n) = mask_value for n > m
  float mask_value;
};

constexpr int kGemmTileM = 64;
constexpr int kGemmTileN = 64;
constexpr int kGemmTileK = 16;
constexpr int kGemmThreads = 256;
constexpr int kGemmPerThread = 4;  // 4 x 4 outputs per thread

__device__ __forceinline__ const float* OperandBase(const Operand& op, int64_t batch, int out_head, int g) {
  const int64_t head = (static_cast<int64_t>(out_head) * op.head_mul + g) / op.head_div;
  return op.ptr + batch * op.batch_stride + head * op.head_stride;
}

__global__ void __launch_bounds__(kGemmThreads) AttentionGemmKernel(GemmParams p) {
  __shared__ float a_tile[kGemmTileK][kGemmTileM + 1];
  __shared__ float b_tile[kGemmTileK][kGemmTileN + 1];

  const int t = static_cast<int>(threadIdx.x);
  const int tx = t % 16;
  const int ty = t / 16;
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * kGemmTileM;
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kGemmTileN;
  const int64_t z = blockIdx.z;
  const int64_t batch = z / p.out_heads;
  const int out_head = static_cast<int>(z % p.out_heads);
  float* c = p.c.ptr + batch * p.c.batch_stride + out_head * p.c.head_stride;

  // A tile entirely above the diagonal: every entry is masked.
  if (p.causal_out_mask && n0 > m0 + kGemmTileM - 1) {
    for (int idx = t; idx < kGemmTileM * kGemmTileN; idx += kGemmThreads) {
      const int64_t m = m0 + idx / kGemmTileN;
      const int64_t n = n0 + idx % kGemmTileN;
      if (m < p.m && n < p.n) c[m * p.c.ld + n] = p.mask_value;
    }
    return;
  }

  int64_t k_begin = 0;
  int64_t k_end = p.k;
  if (p.k_range == KRange::kUpToRow) k_end = MinI64(p.k, m0 + kGemmTileM);
  if (p.k_range == KRange::kFromRow) k_begin = m0;

  float acc[kGemmPerThread][kGemmPerThread] = {};
  for (int g = 0; g < p.groups; ++g) {
    const float* a = OperandBase(p.a, batch, out_head, g);
    const float* b = OperandBase(p.b, batch, out_head, g);
    for (int64_t k0 = k_begin; k0 < k_end; k0 += kGemmTileK) {
      for (int idx = t; idx < kGemmTileM * kGemmTileK; idx += kGemmThreads) {
        // Consecutive threads walk the contiguous dimension of the stored matrix.
        const int mm = p.a.trans ? idx % kGemmTileM : idx / kGemmTileK;
        const int kk = p.a.trans ? idx / kGemmTileM : idx % kGemmTileK;
        const int64_t m = m0 + mm;
        const int64_t k = k0 + kk;
        float v = 0.f;
        if (m < p.m && k < k_end) v = p.a.trans ? a[k * p.a.ld + m] : a[m * p.a.ld + k];
        a_tile[kk][mm] = v;
      }
      for (int idx = t; idx < kGemmTileN * kGemmTileK; idx += kGemmThreads) {
        const int nn = p.b.trans ? idx / kGemmTileK : idx % kGemmTileN;
        const int kk = p.b.trans ? idx % kGemmTileK : idx / kGemmTileN;
        const int64_t n = n0 + nn;
        const int64_t k = k0 + kk;
        float v = 0.f;
        if (n < p.n && k < k_end) v = p.b.trans ? b[n * p.b.ld + k] : b[k * p.b.ld + n];
        b_tile[kk][nn] = v;
      }
      __syncthreads();
#pragma unroll
      for (int kk = 0; kk < kGemmTileK; ++kk) {
        float av[kGemmPerThread];
        float bv[kGemmPerThread];
#pragma unroll
        for (int r = 0; r < kGemmPerThread; ++r) av[r] = a_tile[kk][ty + 16 * r];
#pragma unroll
        for (int q = 0; q < kGemmPerThread; ++q) bv[q] = b_tile[kk][tx + 16 * q];
#pragma unroll
        for (int r = 0; r < kGemmPerThread; ++r) {
#pragma unroll
          for (int q = 0; q < kGemmPerThread; ++q) acc[r][q] = fmaf(av[r], bv[q], acc[r][q]);
        }
      }
      __syncthreads();
    }
  }

#pragma unroll
  for (int r = 0; r < kGemmPerThread; ++r) {
    const int64_t m = m0 + ty + 16 * r;
    if (m >= p.m) continue;
#pragma unroll
    for (int q = 0; q < kGemmPerThread; ++q) {
      const int64_t n = n0 + tx + 16 * q;
      if (n >= p.n) continue;
      const bool masked = p.causal_out_mask && n > m;
      c[m * p.c.ld + n] = masked ? p.mask_value : p.alpha * acc[r][q];
    }
  }
}

int LaunchGemm(const GemmParams& p, int64_t batch, cudaStream_t stream) {
  const int64_t z = batch * p.out_heads;
  if (p.m <= 0 || p.n <= 0 || z <= 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>((p.n + kGemmTileN - 1) / kGemmTileN),
                  static_cast<unsigned>((p.m + kGemmTileM - 1) / kGemmTileM), static_cast<unsigned>(z));
  if (grid.y > 65535u || grid.z > 65535u) return cudaErrorInvalidConfiguration;
  AttentionGemmKernel<<<grid, kGemmThreads, 0, stream>>>(p);
  return static_cast<int>(cudaGetLastError());
}

// ---------------------------------------------------------------------------
// Row kernels (one warp per row of an s x s matrix).
// ---------------------------------------------------------------------------

constexpr int kRowThreads = 256;
constexpr int kRowsPerCta = kRowThreads / kWarpSize;

__device__ __forceinline__ float WarpMax(float v) {
#pragma unroll
  for (int off = kWarpSize / 2; off > 0; off /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}
__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int off = kWarpSize / 2; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// In place: masked scaled scores -> probabilities. Under causal, entries
// j > i are written as exact zeros.
__global__ void __launch_bounds__(kRowThreads) SoftmaxRowsKernel(float* __restrict__ x, int64_t rows, int64_t s,
                                                                 bool causal) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerCta + threadIdx.x / kWarpSize;
  if (row >= rows) return;  // warp-uniform
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int64_t i = row % s;
  const int64_t limit = causal ? i + 1 : s;
  float* r = x + row * s;
  float mx = -INFINITY;
  for (int64_t j = lane; j < limit; j += kWarpSize) mx = fmaxf(mx, r[j]);
  mx = WarpMax(mx);
  float sum = 0.f;
  for (int64_t j = lane; j < limit; j += kWarpSize) sum += expf(r[j] - mx);
  sum = WarpSum(sum);
  for (int64_t j = lane; j < s; j += kWarpSize) r[j] = j < limit ? expf(r[j] - mx) / sum : 0.f;
}

// In place on dP: dS = P * (dP - rowsum(dP * P)).
__global__ void __launch_bounds__(kRowThreads) SoftmaxBwdRowsKernel(const float* __restrict__ probs,
                                                                    float* __restrict__ dp, int64_t rows, int64_t s,
                                                                    bool causal) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerCta + threadIdx.x / kWarpSize;
  if (row >= rows) return;
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int64_t i = row % s;
  const int64_t limit = causal ? i + 1 : s;
  const float* pr = probs + row * s;
  float* d = dp + row * s;
  float dot = 0.f;
  for (int64_t j = lane; j < limit; j += kWarpSize) dot += d[j] * pr[j];
  dot = WarpSum(dot);
  for (int64_t j = lane; j < s; j += kWarpSize) d[j] = j < limit ? pr[j] * (d[j] - dot) : 0.f;
}

// Where o and d_o keep element (batch, head, position, c):
// batch * batch_stride + head * head_stride + position * row_stride + c.
// Head-major [b, heads, s, dv] or, with o_token_major, [b, s, heads, dv].
struct OLayout {
  int64_t batch_stride, head_stride, row_stride;
};

OLayout MakeOLayout(const AttentionShape& sh) {
  if (sh.o_token_major) return OLayout{sh.s * sh.heads * sh.dv, sh.dv, sh.heads * sh.dv};
  return OLayout{sh.heads * sh.s * sh.dv, sh.s * sh.dv, sh.dv};
}

// D[row] = sum_e dO[row, e] * O[row, e] (flash backward preprocessing), for
// row = (batch * heads + head) * s + position; o and d_o laid out as `l`.
__global__ void __launch_bounds__(kRowThreads) RowDotKernel(const float* __restrict__ a,
                                                            const float* __restrict__ b, int64_t rows, int64_t cols,
                                                            int64_t heads, int64_t s, OLayout l,
                                                            float* __restrict__ out) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerCta + threadIdx.x / kWarpSize;
  if (row >= rows) return;
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int64_t bh = row / s;
  const int64_t at = (bh / heads) * l.batch_stride + (bh % heads) * l.head_stride + (row % s) * l.row_stride;
  float dot = 0.f;
  for (int64_t e = lane; e < cols; e += kWarpSize) dot += a[at + e] * b[at + e];
  dot = WarpSum(dot);
  if (lane == 0) out[row] = dot;
}

unsigned RowGrid(int64_t rows) { return static_cast<unsigned>((rows + kRowsPerCta - 1) / kRowsPerCta); }

// ---------------------------------------------------------------------------
// Flash attention.
//
// Shared-memory tiles are row-major with a row stride of width + 1, so the
// threads of a warp that read the same column of different rows hit
// different banks. Accumulators live in registers: each thread owns one row
// and every kLanesPerRow-th column of it, kMaxD / kLanesPerRow registers,
// with kMaxD the head-dim bound the kernel was instantiated for.
// ---------------------------------------------------------------------------

struct FlashParams {
  const float* q;
  const float* k;
  const float* v;
  const float* o;
  const float* d_o;
  const float* lse_in;
  const float* delta;  // D = rowsum(dO * O)
  float* o_out;
  float* lse_out;
  float* dq;
  float* dk;
  float* dv;
  int64_t s;
  OLayout o_layout;  // of o, o_out and d_o
  int dqk, dv_dim;
  int heads, kv_heads;
  float scale;
  bool causal;
};

constexpr int kFlashThreads = 256;
constexpr int kFwdTileQ = 64;
constexpr int kFwdTileKv = 32;
constexpr int kFwdLanesPerRow = kFlashThreads / kFwdTileQ;         // 4
constexpr int kFwdKeysPerLane = kFwdTileKv / kFwdLanesPerRow;      // 8
constexpr int kBwdTile = 32;                                       // query and key tiles
constexpr int kBwdLanesPerRow = kFlashThreads / kBwdTile;          // 8
constexpr int kBwdPairsPerLane = kBwdTile / kBwdLanesPerRow;       // 4
static_assert(kWarpSize % kFwdLanesPerRow == 0 && kWarpSize % kBwdLanesPerRow == 0,
              "the lanes of one row must sit in one warp");

// Copies rows [row0, row0 + tile_rows) of an [s, width] matrix with row
// stride src_ld (width when omitted) into a padded shared tile, zero-filling
// rows past s.
__device__ __forceinline__ void LoadTile(float* __restrict__ dst, const float* __restrict__ src, int64_t row0,
                                         int tile_rows, int width, int64_t s, int64_t src_ld = 0) {
  if (src_ld == 0) src_ld = width;
  const int ld = width + 1;
  for (int idx = static_cast<int>(threadIdx.x); idx < tile_rows * width; idx += kFlashThreads) {
    const int r = idx / width;
    const int c = idx % width;
    const int64_t row = row0 + r;
    dst[r * ld + c] = row < s ? src[row * src_ld + c] : 0.f;
  }
}

__device__ __forceinline__ float RowDot(const float* __restrict__ a, const float* __restrict__ b, int n) {
  float acc = 0.f;
  for (int d = 0; d < n; ++d) acc = fmaf(a[d], b[d], acc);
  return acc;
}

int64_t FwdSmemFloats(int dqk, int dv) {
  return int64_t{kFwdTileQ} * (dqk + 1) + int64_t{kFwdTileKv} * (dqk + 1) + int64_t{kFwdTileKv} * (dv + 1) +
         int64_t{kFwdTileQ} * (kFwdTileKv + 1);
}

// One CTA per (query tile, head, batch). Online softmax over key tiles.
template <int kMaxD>
__global__ void __launch_bounds__(kFlashThreads) FlashFwdKernel(FlashParams p) {
  constexpr int kCols = kMaxD / kFwdLanesPerRow;
  extern __shared__ float smem[];
  const int dqk = p.dqk;
  const int dv = p.dv_dim;
  float* q_s = smem;
  float* k_s = q_s + kFwdTileQ * (dqk + 1);
  float* v_s = k_s + kFwdTileKv * (dqk + 1);
  float* p_s = v_s + kFwdTileKv * (dv + 1);

  const int t = static_cast<int>(threadIdx.x);
  const int r = t / kFwdLanesPerRow;
  const int sub = t % kFwdLanesPerRow;
  const int64_t q0 = static_cast<int64_t>(blockIdx.x) * kFwdTileQ;
  const int h = static_cast<int>(blockIdx.y);
  const int64_t b = blockIdx.z;
  const int kvh = h / (p.heads / p.kv_heads);
  const int64_t s = p.s;
  const int64_t bh = b * p.heads + h;
  const int64_t bkv = b * p.kv_heads + kvh;
  const float* q = p.q + bh * s * dqk;
  const float* k = p.k + bkv * s * dqk;
  const float* v = p.v + bkv * s * dv;
  const int64_t i = q0 + r;

  LoadTile(q_s, q, q0, kFwdTileQ, dqk, s);

  float m_run = -INFINITY;
  float l_run = 0.f;
  float acc[kCols];
#pragma unroll
  for (int c = 0; c < kCols; ++c) acc[c] = 0.f;

  // Under causal, key tiles past the tile's last query are fully masked.
  const int64_t kv_end = p.causal ? MinI64(s, q0 + kFwdTileQ) : s;
  for (int64_t j0 = 0; j0 < kv_end; j0 += kFwdTileKv) {
    __syncthreads();  // previous tile's k_s / v_s reads are done
    LoadTile(k_s, k, j0, kFwdTileKv, dqk, s);
    LoadTile(v_s, v, j0, kFwdTileKv, dv, s);
    __syncthreads();

    float sc[kFwdKeysPerLane];
    float tile_max = -INFINITY;
#pragma unroll
    for (int jj = 0; jj < kFwdKeysPerLane; ++jj) {
      const int jl = sub + kFwdLanesPerRow * jj;
      const int64_t j = j0 + jl;
      const bool masked = j >= s || (p.causal && j > i);
      sc[jj] = masked ? -INFINITY : p.scale * RowDot(q_s + r * (dqk + 1), k_s + jl * (dqk + 1), dqk);
      tile_max = fmaxf(tile_max, sc[jj]);
    }
#pragma unroll
    for (int off = 1; off < kFwdLanesPerRow; off *= 2) {
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, off));
    }
    const float m_new = fmaxf(m_run, tile_max);
    // A row with nothing unmasked yet keeps m = -inf; exponentiate against 0
    // then so that exp(-inf - -inf) never produces a NaN.
    const float m_base = m_new == -INFINITY ? 0.f : m_new;
    const float alpha = expf(m_run - m_base);
    float tile_sum = 0.f;
#pragma unroll
    for (int jj = 0; jj < kFwdKeysPerLane; ++jj) {
      const float e = expf(sc[jj] - m_base);
      tile_sum += e;
      p_s[r * (kFwdTileKv + 1) + sub + kFwdLanesPerRow * jj] = e;
    }
#pragma unroll
    for (int off = 1; off < kFwdLanesPerRow; off *= 2) {
      tile_sum += __shfl_xor_sync(0xffffffffu, tile_sum, off);
    }
    l_run = l_run * alpha + tile_sum;
    m_run = m_new;
    __syncwarp();  // the row's p_s entries come from the other lanes of this warp

#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      const int col = sub + kFwdLanesPerRow * c;
      if (col < dv) {
        float a = acc[c] * alpha;
        for (int jl = 0; jl < kFwdTileKv; ++jl) {
          a = fmaf(p_s[r * (kFwdTileKv + 1) + jl], v_s[jl * (dv + 1) + col], a);
        }
        acc[c] = a;
      }
    }
  }

  if (i < s) {
    float* o = p.o_out + b * p.o_layout.batch_stride + h * p.o_layout.head_stride + i * p.o_layout.row_stride;
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      const int col = sub + kFwdLanesPerRow * c;
      if (col < dv) o[col] = acc[c] / l_run;
    }
    if (sub == 0) p.lse_out[bh * s + i] = m_run + logf(l_run);
  }
}

int64_t BwdSmemFloats(int dqk, int dv) {
  return 2 * int64_t{kBwdTile} * (dqk + 1) + 2 * int64_t{kBwdTile} * (dv + 1) +
         2 * int64_t{kBwdTile} * (kBwdTile + 1) + 2 * int64_t{kBwdTile};
}

// P and dS for query i of head `bh` against key j, from the recomputed score.
__device__ __forceinline__ void RecomputePds(const FlashParams& p, const float* q_row, const float* k_row,
                                             const float* do_row, const float* v_row, int64_t i, int64_t j, float lse,
                                             float delta, float* prob, float* ds) {
  const bool valid = i < p.s && j < p.s && !(p.causal && j > i);
  if (!valid) {
    *prob = 0.f;
    *ds = 0.f;
    return;
  }
  const float pr = expf(p.scale * RowDot(q_row, k_row, p.dqk) - lse);
  const float dp = RowDot(do_row, v_row, p.dv_dim);
  *prob = pr;
  *ds = pr * (dp - delta);
}

// dk, dv: one CTA per (key tile, kv head, batch), looping over the heads that
// share the kv head and over their query tiles.
template <int kMaxD>
__global__ void __launch_bounds__(kFlashThreads) FlashBwdKvKernel(FlashParams p) {
  constexpr int kCols = kMaxD / kBwdLanesPerRow;
  extern __shared__ float smem[];
  const int dqk = p.dqk;
  const int dv = p.dv_dim;
  const int ldq = dqk + 1;
  const int ldv = dv + 1;
  constexpr int ldp = kBwdTile + 1;
  float* k_s = smem;
  float* v_s = k_s + kBwdTile * ldq;
  float* q_s = v_s + kBwdTile * ldv;
  float* do_s = q_s + kBwdTile * ldq;
  float* p_s = do_s + kBwdTile * ldv;
  float* ds_s = p_s + kBwdTile * ldp;
  float* lse_s = ds_s + kBwdTile * ldp;
  float* delta_s = lse_s + kBwdTile;

  const int t = static_cast<int>(threadIdx.x);
  const int jr = t / kBwdLanesPerRow;  // key row owned in the accumulation
  const int sub = t % kBwdLanesPerRow;
  const int64_t j0 = static_cast<int64_t>(blockIdx.x) * kBwdTile;
  const int kvh = static_cast<int>(blockIdx.y);
  const int64_t b = blockIdx.z;
  const int group = p.heads / p.kv_heads;
  const int64_t s = p.s;
  const int64_t bkv = b * p.kv_heads + kvh;

  LoadTile(k_s, p.k + bkv * s * dqk, j0, kBwdTile, dqk, s);
  LoadTile(v_s, p.v + bkv * s * dv, j0, kBwdTile, dv, s);

  float dk_acc[kCols];
  float dv_acc[kCols];
#pragma unroll
  for (int c = 0; c < kCols; ++c) {
    dk_acc[c] = 0.f;
    dv_acc[c] = 0.f;
  }

  // Under causal, queries before the key tile see none of its keys.
  const int64_t i_begin = p.causal ? (j0 / kBwdTile) * kBwdTile : 0;
  for (int g = 0; g < group; ++g) {
    const int64_t bh = b * p.heads + static_cast<int64_t>(kvh) * group + g;
    const float* q = p.q + bh * s * dqk;
    const float* d_o =
        p.d_o + b * p.o_layout.batch_stride + (static_cast<int64_t>(kvh) * group + g) * p.o_layout.head_stride;
    for (int64_t i0 = i_begin; i0 < s; i0 += kBwdTile) {
      __syncthreads();  // previous tile's reads are done
      LoadTile(q_s, q, i0, kBwdTile, dqk, s);
      LoadTile(do_s, d_o, i0, kBwdTile, dv, s, p.o_layout.row_stride);
      if (t < kBwdTile) {
        const int64_t i = i0 + t;
        lse_s[t] = i < s ? p.lse_in[bh * s + i] : 0.f;
        delta_s[t] = i < s ? p.delta[bh * s + i] : 0.f;
      }
      __syncthreads();

#pragma unroll
      for (int ii = 0; ii < kBwdPairsPerLane; ++ii) {
        const int il = sub + kBwdLanesPerRow * ii;
        float pr, ds;
        RecomputePds(p, q_s + il * ldq, k_s + jr * ldq, do_s + il * ldv, v_s + jr * ldv, i0 + il, j0 + jr,
                     lse_s[il], delta_s[il], &pr, &ds);
        p_s[il * ldp + jr] = pr;
        ds_s[il * ldp + jr] = ds;
      }
      __syncthreads();

#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        const int col = sub + kBwdLanesPerRow * c;
        if (col < dv) {
          float a = dv_acc[c];
          for (int il = 0; il < kBwdTile; ++il) a = fmaf(p_s[il * ldp + jr], do_s[il * ldv + col], a);
          dv_acc[c] = a;
        }
        if (col < dqk) {
          float a = dk_acc[c];
          for (int il = 0; il < kBwdTile; ++il) a = fmaf(ds_s[il * ldp + jr], q_s[il * ldq + col], a);
          dk_acc[c] = a;
        }
      }
    }
  }

  const int64_t j = j0 + jr;
  if (j < s) {
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      const int col = sub + kBwdLanesPerRow * c;
      if (col < dv) p.dv[(bkv * s + j) * dv + col] = dv_acc[c];
      if (col < dqk) p.dk[(bkv * s + j) * dqk + col] = p.scale * dk_acc[c];
    }
  }
}

// dq: one CTA per (query tile, head, batch), looping over key tiles.
template <int kMaxD>
__global__ void __launch_bounds__(kFlashThreads) FlashBwdQKernel(FlashParams p) {
  constexpr int kCols = kMaxD / kBwdLanesPerRow;
  extern __shared__ float smem[];
  const int dqk = p.dqk;
  const int dv = p.dv_dim;
  const int ldq = dqk + 1;
  const int ldv = dv + 1;
  constexpr int ldp = kBwdTile + 1;
  float* q_s = smem;
  float* do_s = q_s + kBwdTile * ldq;
  float* k_s = do_s + kBwdTile * ldv;
  float* v_s = k_s + kBwdTile * ldq;
  float* ds_s = v_s + kBwdTile * ldv;
  float* lse_s = ds_s + 2 * kBwdTile * ldp;  // same layout size as the kv kernel
  float* delta_s = lse_s + kBwdTile;

  const int t = static_cast<int>(threadIdx.x);
  const int ir = t / kBwdLanesPerRow;  // query row owned
  const int sub = t % kBwdLanesPerRow;
  const int64_t i0 = static_cast<int64_t>(blockIdx.x) * kBwdTile;
  const int h = static_cast<int>(blockIdx.y);
  const int64_t b = blockIdx.z;
  const int kvh = h / (p.heads / p.kv_heads);
  const int64_t s = p.s;
  const int64_t bh = b * p.heads + h;
  const int64_t bkv = b * p.kv_heads + kvh;
  const float* k = p.k + bkv * s * dqk;
  const float* v = p.v + bkv * s * dv;

  LoadTile(q_s, p.q + bh * s * dqk, i0, kBwdTile, dqk, s);
  LoadTile(do_s, p.d_o + b * p.o_layout.batch_stride + h * p.o_layout.head_stride, i0, kBwdTile, dv, s,
           p.o_layout.row_stride);
  if (t < kBwdTile) {
    const int64_t i = i0 + t;
    lse_s[t] = i < s ? p.lse_in[bh * s + i] : 0.f;
    delta_s[t] = i < s ? p.delta[bh * s + i] : 0.f;
  }

  float dq_acc[kCols];
#pragma unroll
  for (int c = 0; c < kCols; ++c) dq_acc[c] = 0.f;

  const int64_t i = i0 + ir;
  const int64_t kv_end = p.causal ? MinI64(s, i0 + kBwdTile) : s;
  for (int64_t j0 = 0; j0 < kv_end; j0 += kBwdTile) {
    __syncthreads();  // previous tile's reads are done (and q_s, lse_s loaded)
    LoadTile(k_s, k, j0, kBwdTile, dqk, s);
    LoadTile(v_s, v, j0, kBwdTile, dv, s);
    __syncthreads();

#pragma unroll
    for (int jj = 0; jj < kBwdPairsPerLane; ++jj) {
      const int jl = sub + kBwdLanesPerRow * jj;
      float pr, ds;
      RecomputePds(p, q_s + ir * ldq, k_s + jl * ldq, do_s + ir * ldv, v_s + jl * ldv, i, j0 + jl, lse_s[ir],
                   delta_s[ir], &pr, &ds);
      ds_s[ir * ldp + jl] = ds;
    }
    __syncwarp();  // the row's ds_s entries come from the other lanes of this warp

#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      const int col = sub + kBwdLanesPerRow * c;
      if (col < dqk) {
        float a = dq_acc[c];
        for (int jl = 0; jl < kBwdTile; ++jl) a = fmaf(ds_s[ir * ldp + jl], k_s[jl * ldq + col], a);
        dq_acc[c] = a;
      }
    }
  }

  if (i < s) {
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      const int col = sub + kBwdLanesPerRow * c;
      if (col < dqk) p.dq[(bh * s + i) * dqk + col] = p.scale * dq_acc[c];
    }
  }
}

template <typename Kernel>
int LaunchFlash(Kernel kernel, dim3 grid, int64_t smem_floats, const FlashParams& p, cudaStream_t stream) {
  const size_t smem_bytes = static_cast<size_t>(smem_floats) * sizeof(float);
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem_bytes));
  if (err != cudaSuccess) return static_cast<int>(err);
  kernel<<<grid, kFlashThreads, smem_bytes, stream>>>(p);
  return static_cast<int>(cudaGetLastError());
}

// The smallest instantiated head-dim bound that fits both head dims.
int MaxDimBucket(int dqk, int dv) {
  const int d = std::max(dqk, dv);
  if (d <= 64) return 64;
  if (d <= 128) return 128;
  return 256;
}

bool ValidShape(const AttentionShape& sh) {
  return sh.b >= 0 && sh.s >= 0 && sh.heads > 0 && sh.kv_heads > 0 && sh.heads % sh.kv_heads == 0 &&
         sh.dqk > 0 && sh.dv > 0 && sh.dqk <= kMaxHeadDim && sh.dv <= kMaxHeadDim && sh.b <= 65535 &&
         sh.heads <= 65535;
}

bool Empty(const AttentionShape& sh) { return sh.b == 0 || sh.s == 0; }

FlashParams MakeFlashParams(const AttentionShape& sh) {
  FlashParams p{};
  p.s = sh.s;
  p.dqk = static_cast<int>(sh.dqk);
  p.dv_dim = static_cast<int>(sh.dv);
  p.heads = static_cast<int>(sh.heads);
  p.kv_heads = static_cast<int>(sh.kv_heads);
  p.scale = sh.scale;
  p.causal = sh.causal;
  p.o_layout = MakeOLayout(sh);
  return p;
}

// Operand views of the attention tensors for the GEMM kernel. `per_head`
// operands are indexed by the output head directly; `kv` ones by
// head / group (query-head outputs) or by kv head * group + g (kv-head
// outputs summing over the group).
Operand QHeadOperand(const float* ptr, int64_t heads, int64_t rows, int64_t cols, bool trans, int mul) {
  return Operand{ptr, heads * rows * cols, rows * cols, cols, mul, 1, trans};
}
Operand KvOfQHeadOperand(const float* ptr, int64_t kv_heads, int64_t rows, int64_t cols, bool trans, int group) {
  return Operand{ptr, kv_heads * rows * cols, rows * cols, cols, 1, group, trans};
}
OutOperand Out(float* ptr, int64_t heads, int64_t rows, int64_t cols) {
  return OutOperand{ptr, heads * rows * cols, rows * cols, cols};
}
// o / d_o in either layout; `mul` as in QHeadOperand (kv-head outputs sum
// the group's query heads).
Operand OOperand(const float* ptr, const OLayout& l, int mul) {
  return Operand{ptr, l.batch_stride, l.head_stride, l.row_stride, mul, 1, false};
}
OutOperand OOut(float* ptr, const OLayout& l) { return OutOperand{ptr, l.batch_stride, l.head_stride, l.row_stride}; }

}  // namespace

int AttentionFwd(const AttentionShape& sh, const float* q, const float* k, const float* v, float* probs, float* o,
                 void* stream) {
  if (!ValidShape(sh)) return static_cast<int>(cudaErrorInvalidValue);
  if (Empty(sh)) return static_cast<int>(cudaSuccess);
  const auto st = static_cast<cudaStream_t>(stream);
  const int group = static_cast<int>(sh.heads / sh.kv_heads);
  const int heads = static_cast<int>(sh.heads);
  const int64_t s = sh.s;

  // probs <- scale * q k^T, -inf above the diagonal under causal.
  GemmParams scores{};
  scores.a = QHeadOperand(q, heads, s, sh.dqk, false, 1);
  scores.b = KvOfQHeadOperand(k, sh.kv_heads, s, sh.dqk, true, group);
  scores.c = Out(probs, heads, s, s);
  scores.m = s;
  scores.n = s;
  scores.k = sh.dqk;
  scores.out_heads = heads;
  scores.groups = 1;
  scores.alpha = sh.scale;
  scores.k_range = KRange::kAll;
  scores.causal_out_mask = sh.causal;
  scores.mask_value = -INFINITY;
  if (int err = LaunchGemm(scores, sh.b, st); err != 0) return err;

  const int64_t rows = sh.b * sh.heads * s;
  SoftmaxRowsKernel<<<RowGrid(rows), kRowThreads, 0, st>>>(probs, rows, s, sh.causal);
  if (int err = static_cast<int>(cudaGetLastError()); err != 0) return err;

  // o <- probs v.
  GemmParams pv{};
  pv.a = QHeadOperand(probs, heads, s, s, false, 1);
  pv.b = KvOfQHeadOperand(v, sh.kv_heads, s, sh.dv, false, group);
  pv.c = OOut(o, MakeOLayout(sh));
  pv.m = s;
  pv.n = sh.dv;
  pv.k = s;
  pv.out_heads = heads;
  pv.groups = 1;
  pv.alpha = 1.f;
  pv.k_range = sh.causal ? KRange::kUpToRow : KRange::kAll;
  return LaunchGemm(pv, sh.b, st);
}

int AttentionBwd(const AttentionShape& sh, const float* q, const float* k, const float* v, const float* probs,
                 const float* d_o, float* dq, float* dk, float* dv, void* workspace, void* stream) {
  if (!ValidShape(sh)) return static_cast<int>(cudaErrorInvalidValue);
  if (Empty(sh)) return static_cast<int>(cudaSuccess);
  const auto st = static_cast<cudaStream_t>(stream);
  const int group = static_cast<int>(sh.heads / sh.kv_heads);
  const int heads = static_cast<int>(sh.heads);
  const int kv_heads = static_cast<int>(sh.kv_heads);
  const int64_t s = sh.s;
  auto* ds = static_cast<float*>(workspace);

  // dv[j] = sum over the group of P^T dO (rows i >= j only under causal).
  GemmParams dv_gemm{};
  dv_gemm.a = QHeadOperand(probs, heads, s, s, true, group);
  dv_gemm.b = OOperand(d_o, MakeOLayout(sh), group);
  dv_gemm.c = Out(dv, kv_heads, s, sh.dv);
  dv_gemm.m = s;
  dv_gemm.n = sh.dv;
  dv_gemm.k = s;
  dv_gemm.out_heads = kv_heads;
  dv_gemm.groups = group;
  dv_gemm.alpha = 1.f;
  dv_gemm.k_range = sh.causal ? KRange::kFromRow : KRange::kAll;
  if (int err = LaunchGemm(dv_gemm, sh.b, st); err != 0) return err;

  // workspace <- dP = dO v^T (zero above the diagonal under causal) ...
  GemmParams dp{};
  dp.a = OOperand(d_o, MakeOLayout(sh), 1);
  dp.b = KvOfQHeadOperand(v, sh.kv_heads, s, sh.dv, true, group);
  dp.c = Out(ds, heads, s, s);
  dp.m = s;
  dp.n = s;
  dp.k = sh.dv;
  dp.out_heads = heads;
  dp.groups = 1;
  dp.alpha = 1.f;
  dp.k_range = KRange::kAll;
  dp.causal_out_mask = sh.causal;
  dp.mask_value = 0.f;
  if (int err = LaunchGemm(dp, sh.b, st); err != 0) return err;

  // ... then, in place, dS = P * (dP - rowsum(dP * P)).
  const int64_t rows = sh.b * sh.heads * s;
  SoftmaxBwdRowsKernel<<<RowGrid(rows), kRowThreads, 0, st>>>(probs, ds, rows, s, sh.causal);
  if (int err = static_cast<int>(cudaGetLastError()); err != 0) return err;

  // dq = scale * dS k.
  GemmParams dq_gemm{};
  dq_gemm.a = QHeadOperand(ds, heads, s, s, false, 1);
  dq_gemm.b = KvOfQHeadOperand(k, sh.kv_heads, s, sh.dqk, false, group);
  dq_gemm.c = Out(dq, heads, s, sh.dqk);
  dq_gemm.m = s;
  dq_gemm.n = sh.dqk;
  dq_gemm.k = s;
  dq_gemm.out_heads = heads;
  dq_gemm.groups = 1;
  dq_gemm.alpha = sh.scale;
  dq_gemm.k_range = sh.causal ? KRange::kUpToRow : KRange::kAll;
  if (int err = LaunchGemm(dq_gemm, sh.b, st); err != 0) return err;

  // dk = scale * sum over the group of dS^T q.
  GemmParams dk_gemm{};
  dk_gemm.a = QHeadOperand(ds, heads, s, s, true, group);
  dk_gemm.b = QHeadOperand(q, heads, s, sh.dqk, false, group);
  dk_gemm.c = Out(dk, kv_heads, s, sh.dqk);
  dk_gemm.m = s;
  dk_gemm.n = sh.dqk;
  dk_gemm.k = s;
  dk_gemm.out_heads = kv_heads;
  dk_gemm.groups = group;
  dk_gemm.alpha = sh.scale;
  dk_gemm.k_range = sh.causal ? KRange::kFromRow : KRange::kAll;
  return LaunchGemm(dk_gemm, sh.b, st);
}

int FlashAttentionFwd(const AttentionShape& sh, const float* q, const float* k, const float* v, float* o, float* lse,
                      void* stream) {
  if (!ValidShape(sh)) return static_cast<int>(cudaErrorInvalidValue);
  if (Empty(sh)) return static_cast<int>(cudaSuccess);
  const auto st = static_cast<cudaStream_t>(stream);
  FlashParams p = MakeFlashParams(sh);
  p.q = q;
  p.k = k;
  p.v = v;
  p.o_out = o;
  p.lse_out = lse;
  const dim3 grid(static_cast<unsigned>((sh.s + kFwdTileQ - 1) / kFwdTileQ), static_cast<unsigned>(sh.heads),
                  static_cast<unsigned>(sh.b));
  const int64_t smem = FwdSmemFloats(p.dqk, p.dv_dim);
  switch (MaxDimBucket(p.dqk, p.dv_dim)) {
    case 64:
      return LaunchFlash(FlashFwdKernel<64>, grid, smem, p, st);
    case 128:
      return LaunchFlash(FlashFwdKernel<128>, grid, smem, p, st);
    default:
      return LaunchFlash(FlashFwdKernel<256>, grid, smem, p, st);
  }
}

int FlashAttentionBwd(const AttentionShape& sh, const float* q, const float* k, const float* v, const float* o,
                      const float* lse, const float* d_o, float* dq, float* dk, float* dv, void* workspace,
                      void* stream) {
  if (!ValidShape(sh)) return static_cast<int>(cudaErrorInvalidValue);
  if (Empty(sh)) return static_cast<int>(cudaSuccess);
  const auto st = static_cast<cudaStream_t>(stream);
  auto* delta = static_cast<float*>(workspace);

  const int64_t rows = sh.b * sh.heads * sh.s;
  RowDotKernel<<<RowGrid(rows), kRowThreads, 0, st>>>(d_o, o, rows, sh.dv, sh.heads, sh.s, MakeOLayout(sh), delta);
  if (int err = static_cast<int>(cudaGetLastError()); err != 0) return err;

  FlashParams p = MakeFlashParams(sh);
  p.q = q;
  p.k = k;
  p.v = v;
  p.o = o;
  p.d_o = d_o;
  p.lse_in = lse;
  p.delta = delta;
  p.dq = dq;
  p.dk = dk;
  p.dv = dv;
  const unsigned tiles = static_cast<unsigned>((sh.s + kBwdTile - 1) / kBwdTile);
  const dim3 kv_grid(tiles, static_cast<unsigned>(sh.kv_heads), static_cast<unsigned>(sh.b));
  const dim3 q_grid(tiles, static_cast<unsigned>(sh.heads), static_cast<unsigned>(sh.b));
  const int64_t smem = BwdSmemFloats(p.dqk, p.dv_dim);
  int err = 0;
  switch (MaxDimBucket(p.dqk, p.dv_dim)) {
    case 64:
      err = LaunchFlash(FlashBwdKvKernel<64>, kv_grid, smem, p, st);
      return err != 0 ? err : LaunchFlash(FlashBwdQKernel<64>, q_grid, smem, p, st);
    case 128:
      err = LaunchFlash(FlashBwdKvKernel<128>, kv_grid, smem, p, st);
      return err != 0 ? err : LaunchFlash(FlashBwdQKernel<128>, q_grid, smem, p, st);
    default:
      err = LaunchFlash(FlashBwdKvKernel<256>, kv_grid, smem, p, st);
      return err != 0 ? err : LaunchFlash(FlashBwdQKernel<256>, q_grid, smem, p, st);
  }
}

}  // namespace memplan::kernels::cuda
