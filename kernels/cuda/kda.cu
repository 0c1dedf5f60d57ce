// KDA (Kimi Delta Attention, ops.h KdaFwd/KdaBwd) and its sigmoid output
// gate. One thread block per (sequence, head) runs the recurrence token by
// token, its state S [dk, dv] (and, backward, dS) in shared memory: a thread
// owns state columns j for the per-column work and rows i for the per-row
// sums, so every sum runs in a fixed order (no atomics). The forward writes
// S at each chunk start; the backward re-makes a chunk's states from there
// into the planned workspace (workspace::KdaBwdBytes) and runs its tokens
// backwards. This is the recurrent form with chunk-level state checkpoints,
// not FLA's chunk-parallel (WY) kernels: the same saved bytes, less
// parallelism within a head.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "memplan/kernels/ops.h"
#include "ops_launch.h"

namespace memplan::kernels::cuda {
namespace {

constexpr int kKdaThreads = 128;

__device__ __forceinline__ float SigmoidF(float x) { return 1.f / (1.f + expf(-x)); }
__device__ __forceinline__ float SoftplusF(float x) { return x > 20.f ? x : log1pf(expf(x)); }

// Block-wide sum of one value per thread (fixed tree); every thread gets it.
__device__ float BlockSum(float v, float* red) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float s = 0.f;
  for (int w = 0; w < static_cast<int>(blockDim.x) / 32; ++w) s += red[w];
  return s;
}

// Per-token vectors in shared memory.
struct KdaVec {
  float *q, *k, *alpha, *log_alpha, *u, *ka, *du, *dka;
  float beta, qn, kn;
};

// Loads token row `r` of head h: normalized q (scaled) and k, the decays,
// beta. Ends with a barrier.
__device__ void LoadToken(const float* q, const float* k, const float* g, const float* dt_bias, const float* beta,
                          float a_log, int64_t r, int64_t h, const KdaShape& sh, KdaVec& t, float* red, float* scal) {
  const float* qr = q + (r * sh.heads + h) * sh.dk;
  const float* kr = k + (r * sh.heads + h) * sh.dk;
  const float* gr = g + (r * sh.heads + h) * sh.dk;
  float sq = 0.f, sk = 0.f;
  for (int64_t i = threadIdx.x; i < sh.dk; i += blockDim.x) {
    sq += qr[i] * qr[i];
    sk += kr[i] * kr[i];
  }
  sq = BlockSum(sq, red);
  sk = BlockSum(sk, red);
  const float qn = sqrtf(sq + static_cast<float>(kKdaNormEps)), kn = sqrtf(sk + static_cast<float>(kKdaNormEps));
  const float scale = 1.f / sqrtf(static_cast<float>(sh.dk)), c = expf(a_log);
  for (int64_t i = threadIdx.x; i < sh.dk; i += blockDim.x) {
    t.q[i] = qr[i] / qn * scale;
    t.k[i] = kr[i] / kn;
    t.log_alpha[i] = -c * SoftplusF(gr[i] + (dt_bias != nullptr ? dt_bias[h * sh.dk + i] : 0.f));
    t.alpha[i] = expf(t.log_alpha[i]);
  }
  if (threadIdx.x == 0) scal[0] = SigmoidF(beta[r * sh.heads + h]);
  __syncthreads();
  t.beta = scal[0];
  t.qn = qn;
  t.kn = kn;
}

// Shared layout: S [dk * dv], (backward: dS [dk * dv]), then 8 vectors of
// max(dk, dv) floats, then 2 scalars.
int64_t SharedBytes(const KdaShape& sh, bool backward) {
  const int64_t w = std::max(sh.dk, sh.dv);
  return ((backward ? 2 : 1) * sh.dk * sh.dv + 8 * w + 2) * static_cast<int64_t>(sizeof(float));
}

__device__ KdaVec Vectors(float* base, const KdaShape& sh) {
  const int64_t w = sh.dk > sh.dv ? sh.dk : sh.dv;
  KdaVec t;
  t.q = base;
  t.k = base + w;
  t.alpha = base + 2 * w;
  t.log_alpha = base + 3 * w;
  t.u = base + 4 * w;
  t.ka = base + 5 * w;
  t.du = base + 6 * w;
  t.dka = base + 7 * w;
  return t;
}

// One forward step on S in shared memory (columns per thread); o may be null.
__device__ void Step(float* S, const KdaVec& t, const float* vr, const KdaShape& sh, float* o) {
  for (int64_t j = threadIdx.x; j < sh.dv; j += blockDim.x) {
    float ka = 0.f;
    for (int64_t i = 0; i < sh.dk; ++i) {
      S[i * sh.dv + j] *= t.alpha[i];
      ka += t.k[i] * S[i * sh.dv + j];
    }
    const float u = t.beta * (vr[j] - ka);
    float acc = 0.f;
    for (int64_t i = 0; i < sh.dk; ++i) {
      S[i * sh.dv + j] += t.k[i] * u;
      acc += t.q[i] * S[i * sh.dv + j];
    }
    if (o != nullptr) o[j] = acc;
  }
  __syncthreads();
}

__global__ void __launch_bounds__(kKdaThreads)
    KdaFwdKernel(const float* q, const float* k, const float* v, const float* g, const float* beta,
                 const float* a_log, const float* dt_bias, KdaShape sh, float* o, float* states) {
  extern __shared__ float4 kda_fwd_smem[];
  __shared__ float red[kKdaThreads / 32];
  float* S = reinterpret_cast<float*>(kda_fwd_smem);
  KdaVec t = Vectors(S + sh.dk * sh.dv, sh);
  float* scal = S + sh.dk * sh.dv + 8 * (sh.dk > sh.dv ? sh.dk : sh.dv);
  const int64_t b = blockIdx.x / sh.heads, h = blockIdx.x % sh.heads;
  const int64_t chunks = (sh.seq + sh.chunk - 1) / sh.chunk;
  for (int64_t e = threadIdx.x; e < sh.dk * sh.dv; e += blockDim.x) S[e] = 0.f;
  __syncthreads();
  for (int64_t s = 0; s < sh.seq; ++s) {
    const int64_t r = b * sh.seq + s;
    if (s % sh.chunk == 0) {
      float* dst = states + ((b * sh.heads + h) * chunks + s / sh.chunk) * sh.dk * sh.dv;
      for (int64_t e = threadIdx.x; e < sh.dk * sh.dv; e += blockDim.x) dst[e] = S[e];
    }
    LoadToken(q, k, g, dt_bias, beta, a_log[h], r, h, sh, t, red, scal);
    Step(S, t, v + (r * sh.heads + h) * sh.dv, sh, o + (r * sh.heads + h) * sh.dv);
  }
}

__global__ void __launch_bounds__(kKdaThreads)
    KdaBwdKernel(const float* q, const float* k, const float* v, const float* g, const float* beta,
                 const float* a_log, const float* dt_bias, const float* states, const float* d_o, KdaShape sh,
                 float* dq, float* dk,
                 float* dv, float* dg, float* dbeta, float* work, float* da_part) {
  extern __shared__ float4 kda_bwd_smem[];
  __shared__ float red[kKdaThreads / 32];
  const int64_t n = sh.dk * sh.dv;
  float* S = reinterpret_cast<float*>(kda_bwd_smem);
  float* dS = S + n;
  KdaVec t = Vectors(dS + n, sh);
  float* scal = dS + n + 8 * (sh.dk > sh.dv ? sh.dk : sh.dv);
  const int64_t b = blockIdx.x / sh.heads, h = blockIdx.x % sh.heads;
  const int64_t chunks = (sh.seq + sh.chunk - 1) / sh.chunk;
  float* W = work + static_cast<int64_t>(blockIdx.x) * sh.chunk * n;
  const float c = expf(a_log[h]), scale = 1.f / sqrtf(static_cast<float>(sh.dk));
  for (int64_t e = threadIdx.x; e < n; e += blockDim.x) dS[e] = 0.f;
  float da = 0.f;  // thread 0's running da_log of this (sequence, head)
  for (int64_t ch = chunks - 1; ch >= 0; --ch) {
    const int64_t s0 = ch * sh.chunk, s1 = s0 + sh.chunk < sh.seq ? s0 + sh.chunk : sh.seq;
    const float* start = states + ((b * sh.heads + h) * chunks + ch) * n;
    for (int64_t e = threadIdx.x; e < n; e += blockDim.x) S[e] = start[e];
    __syncthreads();
    for (int64_t s = s0; s < s1; ++s) {
      const int64_t r = b * sh.seq + s;
      for (int64_t e = threadIdx.x; e < n; e += blockDim.x) W[(s - s0) * n + e] = S[e];
      LoadToken(q, k, g, dt_bias, beta, a_log[h], r, h, sh, t, red, scal);
      Step(S, t, v + (r * sh.heads + h) * sh.dv, sh, nullptr);
    }
    for (int64_t s = s1 - 1; s >= s0; --s) {
      const int64_t r = b * sh.seq + s;
      const float* Sp = W + (s - s0) * n;
      const float* vr = v + (r * sh.heads + h) * sh.dv;
      const float* dor = d_o + (r * sh.heads + h) * sh.dv;
      LoadToken(q, k, g, dt_bias, beta, a_log[h], r, h, sh, t, red, scal);
      // Columns: ka = A^T k, u, then dS += q do^T, du = dS^T k.
      float dbeta_part = 0.f;
      for (int64_t j = threadIdx.x; j < sh.dv; j += blockDim.x) {
        float acc = 0.f;
        for (int64_t i = 0; i < sh.dk; ++i) acc += t.k[i] * (t.alpha[i] * Sp[i * sh.dv + j]);
        t.ka[j] = acc;
        t.u[j] = t.beta * (vr[j] - acc);
        float d = 0.f;
        for (int64_t i = 0; i < sh.dk; ++i) {
          dS[i * sh.dv + j] += t.q[i] * dor[j];
          d += dS[i * sh.dv + j] * t.k[i];
        }
        t.du[j] = d;
        t.dka[j] = -t.beta * d;
        dv[(r * sh.heads + h) * sh.dv + j] = t.beta * d;
        dbeta_part += d * (vr[j] - acc);
      }
      const float dbeta_s = BlockSum(dbeta_part, red);  // (ends with the columns' shared writes visible)
      __syncthreads();
      // Rows: dq^ = S_t do, dk^ = dS u + A dka, dalpha = (dS + k dka^T) . Sp.
      float zq = 0.f, zk = 0.f;
      for (int64_t i = threadIdx.x; i < sh.dk; i += blockDim.x) {
        float aq = 0.f, ak = 0.f, aa = 0.f;
        for (int64_t j = 0; j < sh.dv; ++j) {
          const float sp = Sp[i * sh.dv + j], a = t.alpha[i] * sp, ds = dS[i * sh.dv + j];
          aq += (a + t.k[i] * t.u[j]) * dor[j];
          ak += ds * t.u[j] + t.dka[j] * a;
          aa += (ds + t.k[i] * t.dka[j]) * sp;
        }
        const float qz = q[(r * sh.heads + h) * sh.dk + i] / t.qn;
        zq += qz * (aq * scale);
        zk += t.k[i] * ak;
        // Park dq^, dk^, dalpha in the outputs; finished after the sums.
        dq[(r * sh.heads + h) * sh.dk + i] = aq * scale;
        dk[(r * sh.heads + h) * sh.dk + i] = ak;
        dg[(r * sh.heads + h) * sh.dk + i] = aa;
      }
      zq = BlockSum(zq, red);
      zk = BlockSum(zk, red);
      __syncthreads();
      // dS_{t-1} = Diag(alpha) (dS + k dka^T), columns per thread.
      for (int64_t j = threadIdx.x; j < sh.dv; j += blockDim.x) {
        for (int64_t i = 0; i < sh.dk; ++i) dS[i * sh.dv + j] = t.alpha[i] * (dS[i * sh.dv + j] + t.k[i] * t.dka[j]);
      }
      float da_part = 0.f;
      for (int64_t i = threadIdx.x; i < sh.dk; i += blockDim.x) {
        const int64_t at = (r * sh.heads + h) * sh.dk + i;
        const float qz = q[at] / t.qn;
        dq[at] = (dq[at] - qz * zq) / t.qn;
        dk[at] = (dk[at] - t.k[i] * zk) / t.kn;
        const float dl = dg[at] * t.alpha[i];
        dg[at] = dl * (-c) * SigmoidF(g[at] + (dt_bias != nullptr ? dt_bias[h * sh.dk + i] : 0.f));
        da_part += dl * t.log_alpha[i];
      }
      da += BlockSum(da_part, red);
      if (threadIdx.x == 0) dbeta[r * sh.heads + h] = dbeta_s * t.beta * (1.f - t.beta);
      __syncthreads();
    }
  }
  if (threadIdx.x == 0) da_part[blockIdx.x] = da;
}

// out[c] += sum over rows (in order) of x[r, c]: da_log from the per-
// sequence partials [batch, heads], d_dt_bias from dg [rows, heads * dk].
__global__ void ColumnSumKernel(const float* x, int64_t rows, int64_t cols, float* out) {
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < cols;
       c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float s = 0.f;
    for (int64_t r = 0; r < rows; ++r) s += x[r * cols + c];
    out[c] += s;
  }
}

// Short convolution (ops.h ShortConvFwd/Bwd): one thread per element; the
// weight gradient one thread per (tap, channel), rows in order.
__device__ float ShortConvPre(const float* x, const float* w, int64_t seq, int64_t channels, int64_t taps,
                              int64_t row, int64_t c) {
  const int64_t s = row % seq;
  float acc = 0.f;
  for (int64_t j = 0; j < taps; ++j) {
    const int64_t t = s - taps + 1 + j;
    if (t >= 0) acc += w[j * channels + c] * x[(row - s + t) * channels + c];
  }
  return acc;
}

__global__ void ShortConvFwdKernel(const float* x, const float* w, int64_t rows, int64_t seq, int64_t channels,
                                   int64_t taps, float* y) {
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < rows * channels;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float pre = ShortConvPre(x, w, seq, channels, taps, e / channels, e % channels);
    y[e] = pre * SigmoidF(pre);
  }
}

// dpre = dy * silu'(pre) of element (row, c), pre re-made from x: the
// backward keeps nothing between its kernels (no workspace).
__device__ float ShortConvDpre(const float* x, const float* w, const float* dy, int64_t seq, int64_t channels,
                               int64_t taps, int64_t row, int64_t c) {
  const float pre = ShortConvPre(x, w, seq, channels, taps, row, c);
  const float sg = SigmoidF(pre);
  return dy[row * channels + c] * (sg * (1.f + pre * (1.f - sg)));
}

__global__ void ShortConvDxKernel(const float* x, const float* w, const float* dy, int64_t rows, int64_t seq,
                                  int64_t channels, int64_t taps, float* dx) {
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < rows * channels;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = e / channels, c = e % channels, t = row % seq;
    float acc = 0.f;
    for (int64_t j = 0; j < taps; ++j) {
      const int64_t s = t + taps - 1 - j;
      if (s < seq) acc += w[j * channels + c] * ShortConvDpre(x, w, dy, seq, channels, taps, row - t + s, c);
    }
    dx[e] = acc;
  }
}

__global__ void ShortConvDwKernel(const float* x, const float* w, const float* dy, int64_t rows, int64_t seq,
                                  int64_t channels, int64_t taps, float* dw) {
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < taps * channels;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t j = e / channels, c = e % channels;
    float acc = 0.f;
    for (int64_t row = 0; row < rows; ++row) {
      const int64_t t = row % seq - taps + 1 + j;
      if (t >= 0) acc += ShortConvDpre(x, w, dy, seq, channels, taps, row, c) * x[(row - row % seq + t) * channels + c];
    }
    dw[e] += acc;
  }
}

__global__ void SigmoidGateFwdKernel(const float* x, const float* g, int64_t n, float* y) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    y[i] = x[i] * SigmoidF(g[i]);
  }
}

__global__ void SigmoidGateBwdKernel(const float* x, const float* g, const float* dy, int64_t n, float* dx, float* dg) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float s = SigmoidF(g[i]);
    dx[i] = dy[i] * s;
    dg[i] = dy[i] * x[i] * (s * (1.f - s));
  }
}

unsigned FlatBlocks(const LaunchContext& ctx, int64_t n) {
  const int64_t blocks = (n + 255) / 256;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(blocks, int64_t{ctx.sm_count} * 32)));
}

cudaError_t Smem(const LaunchContext& ctx, const void* kernel, int64_t bytes) {
  if (bytes > ctx.max_smem_per_block_bytes) return cudaErrorInvalidValue;
  if (bytes <= 48 * 1024) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
}

}  // namespace

cudaError_t LaunchKdaFwd(const LaunchContext& ctx, const float* q, const float* k, const float* v, const float* g,
                         const float* beta, const float* a_log, const float* dt_bias, const KdaShape& sh, float* o,
                         float* states) {
  if (sh.batch <= 0 || sh.seq <= 0 || sh.heads <= 0 || sh.chunk <= 0) return cudaSuccess;
  const int64_t bytes = SharedBytes(sh, false);
  if (cudaError_t e = Smem(ctx, reinterpret_cast<const void*>(&KdaFwdKernel), bytes); e != cudaSuccess) return e;
  KdaFwdKernel<<<static_cast<unsigned>(sh.batch * sh.heads), kKdaThreads, bytes, ctx.stream>>>(q, k, v, g, beta,
                                                                                                a_log, dt_bias, sh, o,
                                                                                                states);
  return cudaGetLastError();
}

cudaError_t LaunchKdaBwd(const LaunchContext& ctx, const float* q, const float* k, const float* v, const float* g,
                         const float* beta, const float* a_log, const float* dt_bias, const float* states,
                         const float* d_o, const KdaShape& sh, float* dq, float* dk, float* dv, float* dg,
                         float* dbeta, float* da_log, float* d_dt_bias, float* workspace) {
  if (sh.batch <= 0 || sh.seq <= 0 || sh.heads <= 0 || sh.chunk <= 0) return cudaSuccess;
  const int64_t bytes = SharedBytes(sh, true);
  if (cudaError_t e = Smem(ctx, reinterpret_cast<const void*>(&KdaBwdKernel), bytes); e != cudaSuccess) return e;
  float* part = workspace + sh.batch * sh.heads * sh.chunk * sh.dk * sh.dv;
  KdaBwdKernel<<<static_cast<unsigned>(sh.batch * sh.heads), kKdaThreads, bytes, ctx.stream>>>(
      q, k, v, g, beta, a_log, dt_bias, states, d_o, sh, dq, dk, dv, dg, dbeta, workspace, part);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  ColumnSumKernel<<<FlatBlocks(ctx, sh.heads), 256, 0, ctx.stream>>>(part, sh.batch, sh.heads, da_log);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  if (dt_bias != nullptr && d_dt_bias != nullptr) {
    const int64_t width = sh.heads * sh.dk;
    ColumnSumKernel<<<FlatBlocks(ctx, width), 256, 0, ctx.stream>>>(dg, sh.batch * sh.seq, width, d_dt_bias);
  }
  return cudaGetLastError();
}

cudaError_t LaunchShortConvFwd(const LaunchContext& ctx, const float* x, const float* w, int64_t batch, int64_t seq,
                               int64_t channels, int64_t taps, float* y) {
  const int64_t n = batch * seq * channels;
  if (n <= 0) return cudaSuccess;
  ShortConvFwdKernel<<<FlatBlocks(ctx, n), 256, 0, ctx.stream>>>(x, w, batch * seq, seq, channels, taps, y);
  return cudaGetLastError();
}

cudaError_t LaunchShortConvBwd(const LaunchContext& ctx, const float* x, const float* w, const float* dy,
                               int64_t batch, int64_t seq, int64_t channels, int64_t taps, float* dx, float* dw) {
  const int64_t n = batch * seq * channels;
  if (n <= 0) return cudaSuccess;
  ShortConvDwKernel<<<FlatBlocks(ctx, taps * channels), 256, 0, ctx.stream>>>(x, w, dy, batch * seq, seq, channels,
                                                                              taps, dw);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  ShortConvDxKernel<<<FlatBlocks(ctx, n), 256, 0, ctx.stream>>>(x, w, dy, batch * seq, seq, channels, taps, dx);
  return cudaGetLastError();
}

cudaError_t LaunchSigmoidGateFwd(const LaunchContext& ctx, const float* x, const float* g, int64_t n, float* y) {
  if (n <= 0) return cudaSuccess;
  SigmoidGateFwdKernel<<<FlatBlocks(ctx, n), 256, 0, ctx.stream>>>(x, g, n, y);
  return cudaGetLastError();
}

cudaError_t LaunchSigmoidGateBwd(const LaunchContext& ctx, const float* x, const float* g, const float* dy, int64_t n,
                                 float* dx, float* dg) {
  if (n <= 0) return cudaSuccess;
  SigmoidGateBwdKernel<<<FlatBlocks(ctx, n), 256, 0, ctx.stream>>>(x, g, dy, n, dx, dg);
  return cudaGetLastError();
}

}  // namespace memplan::kernels::cuda
