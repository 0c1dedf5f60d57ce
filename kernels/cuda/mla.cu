// MLA heads (ops.h, MlaShape; MlaDims here): q_lin, kv, k_pe -> q, k, v and back. One
// thread per output element of a head row, grid-stride; RoPE's cos and sin
// as SplitHeads' (double, rounded to float once) and each rotation product
// and sum rounded separately, so the results are the reference's bits. The
// backward's k_pe gradient is a gather (one thread per (token, j) summing the
// heads in order): deterministic, no atomics.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "device_util.cuh"
#include "ops_launch.h"
#include "rope_cuda.h"

namespace memplan::kernels::cuda {
namespace {

struct MlaArgs {
  int64_t b, s, heads, nope, rope, v;
  float theta;
  int64_t cp, cp_rank;  // ops.h's CpPosition
};

// Element j of the rope part [0, rope) of `x` rotated (forward) or rotated
// back (inverse), as ops_ref's RopeRow.
__device__ __forceinline__ float Rotate(const float* x, int64_t j, int64_t pos, const MlaArgs& a, bool inverse) {
  const int64_t half = a.rope / 2;
  const int64_t i = j < half ? j : j - half;
  float c, s;
  RopeCosSin(CpPositionDevice(pos, a.s, a.cp, a.cp_rank), i, a.rope, a.theta, &c, &s);
  const float x0 = x[i], x1 = x[i + half];
  if (j < half) return inverse ? __fadd_rn(__fmul_rn(x0, c), __fmul_rn(x1, s)) : __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
  return inverse ? __fsub_rn(__fmul_rn(x1, c), __fmul_rn(x0, s)) : __fadd_rn(__fmul_rn(x1, c), __fmul_rn(x0, s));
}

// Work item (row, head, j) of both kernels, j < nope + rope (q and k) + v:
// the token row and its position, the head row of q/k/v [b, heads, s, ·],
// and where the head starts in q_lin's and kv's token rows.
struct MlaItem {
  int64_t j, row, pos, head_row, q_lin_at, kv_at;
};

__device__ __forceinline__ MlaItem Decode(int64_t item, const MlaArgs& a) {
  const int64_t qk = a.nope + a.rope, per = qk + a.v;
  const int64_t h = (item / per) % a.heads;
  const int64_t row = item / per / a.heads;
  const int64_t bb = row / a.s, pos = row - bb * a.s;
  return {item % per, row, pos, (bb * a.heads + h) * a.s + pos, row * a.heads * qk + h * qk,
          row * a.heads * (a.nope + a.v) + h * (a.nope + a.v)};
}

// Item (row, head, j): writes q[j] and k[j] for j < qk, and v[j - qk] beyond.
__global__ void __launch_bounds__(kThreads)
    MlaSplitFwdKernel(MlaArgs a, const float* q_lin, const float* kv, const float* k_pe, float* q, float* k, float* v) {
  const int64_t qk = a.nope + a.rope;
  const int64_t total = a.b * a.s * a.heads * (qk + a.v);
  for (int64_t item = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; item < total;
       item += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const MlaItem it = Decode(item, a);
    const int64_t j = it.j, row = it.row, pos = it.pos, out = it.head_row;
    const float* qs = q_lin + it.q_lin_at;
    const float* kvs = kv + it.kv_at;
    if (j < a.nope) {
      q[out * qk + j] = qs[j];
      k[out * qk + j] = kvs[j];
    } else if (j < qk) {
      q[out * qk + j] = Rotate(qs + a.nope, j - a.nope, pos, a, false);
      k[out * qk + j] = Rotate(k_pe + row * a.rope, j - a.nope, pos, a, false);
    } else {
      v[out * a.v + (j - qk)] = kvs[a.nope + (j - qk)];
    }
  }
}

// Item (row, head, j) as the forward, into dq_lin and dkv.
__global__ void __launch_bounds__(kThreads)
    MlaSplitBwdKernel(MlaArgs a, const float* dq, const float* dk, const float* dv, float* dq_lin, float* dkv) {
  const int64_t qk = a.nope + a.rope;
  const int64_t total = a.b * a.s * a.heads * (qk + a.v);
  for (int64_t item = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; item < total;
       item += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const MlaItem it = Decode(item, a);
    const int64_t j = it.j, pos = it.pos, in = it.head_row;
    float* qd = dq_lin + it.q_lin_at;
    float* kvd = dkv + it.kv_at;
    if (j < a.nope) {
      qd[j] = dq[in * qk + j];
      kvd[j] = dk[in * qk + j];
    } else if (j < qk) {
      qd[j] = Rotate(dq + in * qk + a.nope, j - a.nope, pos, a, true);
    } else {
      kvd[a.nope + (j - qk)] = dv[in * a.v + (j - qk)];
    }
  }
}

// Item (row, j), j < rope: dk_pe[row, j] = sum over heads, in order.
__global__ void __launch_bounds__(kThreads)
    MlaKpeBwdKernel(MlaArgs a, const float* dk, float* dk_pe) {
  const int64_t qk = a.nope + a.rope;
  const int64_t total = a.b * a.s * a.rope;
  for (int64_t item = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; item < total;
       item += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t j = item % a.rope;
    const int64_t row = item / a.rope;
    const int64_t bb = row / a.s, pos = row - bb * a.s;
    float acc = 0.f;
    for (int64_t h = 0; h < a.heads; ++h) {
      const int64_t in = (bb * a.heads + h) * a.s + pos;
      acc = __fadd_rn(acc, Rotate(dk + in * qk + a.nope, j, pos, a, true));
    }
    dk_pe[row * a.rope + j] = acc;
  }
}

MlaArgs Args(const MlaDims& sh) {
  return {sh.b, sh.s, sh.heads, sh.nope, sh.rope, sh.v, sh.rope_theta, sh.cp, sh.cp_rank};
}

bool Valid(const MlaDims& sh) { return sh.heads >= 1 && sh.v >= 1 && sh.nope >= 0 && sh.rope >= 0 && sh.rope % 2 == 0; }

}  // namespace

cudaError_t LaunchMlaSplitFwd(const LaunchContext& ctx, const float* q_lin, const float* kv, const float* k_pe,
                              const MlaDims& sh, float* q, float* k, float* v) {
  if (!Valid(sh)) return cudaErrorInvalidValue;
  const int64_t items = sh.b * sh.s * sh.heads * (sh.nope + sh.rope + sh.v);
  if (items <= 0) return cudaSuccess;
  MlaSplitFwdKernel<<<FlatGrid(ctx, items), kThreads, 0, ctx.stream>>>(Args(sh), q_lin, kv, k_pe, q, k, v);
  return cudaGetLastError();
}

cudaError_t LaunchMlaSplitBwd(const LaunchContext& ctx, const float* dq, const float* dk, const float* dv,
                              const MlaDims& sh, float* dq_lin, float* dkv, float* dk_pe) {
  if (!Valid(sh)) return cudaErrorInvalidValue;
  const int64_t items = sh.b * sh.s * sh.heads * (sh.nope + sh.rope + sh.v);
  if (items <= 0) return cudaSuccess;
  MlaSplitBwdKernel<<<FlatGrid(ctx, items), kThreads, 0, ctx.stream>>>(Args(sh), dq, dk, dv, dq_lin, dkv);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess || sh.rope == 0) return e;
  MlaKpeBwdKernel<<<FlatGrid(ctx, sh.b * sh.s * sh.rope), kThreads, 0, ctx.stream>>>(Args(sh), dk, dk_pe);
  return cudaGetLastError();
}

}  // namespace memplan::kernels::cuda
