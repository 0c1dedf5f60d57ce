// CPU reference ops: the shared RNG and workspace formulas, RefMath (every op
// but attention, see attention_ref.cc) and the Ops wrapper that runs it in
// float.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "memplan/common/workspace.h"
#include "memplan/kernels/ops.h"
#include "kda_ref.h"
#include "ops_ref_impl.h"

namespace memplan::kernels {

uint64_t SplitMix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  uint64_t z = x;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

float Uniform01(uint64_t seed, uint64_t offset, uint64_t index) {
  // 24 bits: exactly representable, so the float is the same on every side.
  return static_cast<float>(SplitMix64(seed ^ SplitMix64(offset + index)) >> 40) * 0x1p-24f;
}

// The formulas live in common/workspace.h, shared with the planner.
int64_t AttentionBwdWorkspaceBytes(int64_t b, int64_t heads, int64_t s) {
  return workspace::AttentionBwdBytes(b, heads, s, s);
}

int64_t FlashAttentionBwdWorkspaceBytes(int64_t b, int64_t heads, int64_t s) {
  return workspace::FlashAttentionBwdBytes(b, heads, s);
}

int64_t GemmWorkspaceBytes() { return workspace::GemmBytes(); }
int64_t KernelScratchBytes() { return workspace::KernelScratchBytes(); }

float AdamBiasCorrection(float beta, int64_t step) {
  return static_cast<float>(1.0 - std::pow(static_cast<double>(beta), static_cast<double>(step)));
}

namespace ref {
namespace {

template <typename T>
T Sigmoid(T x) {
  return T(1) / (T(1) + std::exp(-x));
}

// p = softmax(l) over n entries, max-subtracted, summed in index order.
// Returns the row sum of exp(l - max) and stores the max in *mx.
template <typename T>
T SoftmaxRow(const T* l, int64_t n, T* p, T* mx) {
  *mx = l[0];
  for (int64_t i = 1; i < n; ++i) *mx = std::max(*mx, l[i]);
  T sum = 0;
  for (int64_t i = 0; i < n; ++i) {
    p[i] = std::exp(l[i] - *mx);
    sum += p[i];
  }
  for (int64_t i = 0; i < n; ++i) p[i] /= sum;
  return sum;
}

template <typename T>
T DotN(const T* a, const T* b, int64_t n) {
  T s = 0;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// Mean and 1/sqrt(var + eps) of one LayerNorm row (two passes).
template <typename T>
void MeanRstd(const T* x, int64_t cols, T eps, T* mean, T* rstd) {
  T sum = 0;
  for (int64_t c = 0; c < cols; ++c) sum += x[c];
  const T mu = sum / T(cols);
  T var = 0;
  for (int64_t c = 0; c < cols; ++c) {
    const T dc = x[c] - mu;
    var += dc * dc;
  }
  var /= T(cols);
  *mean = mu;
  *rstd = T(1) / std::sqrt(var + eps);
}

// 1/sqrt(mean(x^2) + eps) of one RMSNorm row.
template <typename T>
T RmsRstd(const T* x, int64_t cols, T eps) {
  T ss = 0;
  for (int64_t c = 0; c < cols; ++c) ss += x[c] * x[c];
  return T(1) / std::sqrt(ss / T(cols) + eps);
}

// AttnRes logit of one source row: w . ((v * r) * gamma); returns r too.
template <typename T>
T AttnResLogit(const T* v, const T* w, const T* gamma, int64_t d, T eps, T* r_out) {
  const T r = RmsRstd(v, d, eps);
  T z = 0;
  for (int64_t c = 0; c < d; ++c) z += w[c] * ((v[c] * r) * gamma[c]);
  *r_out = r;
  return z;
}

// Max and sum of exp(z_i - max) over token t's n sources. Shared by the
// forward and the backward so that both see the same a_i bit for bit.
template <typename T>
void AttnResStats(const T* const* sources, const T* w, const T* gamma, int64_t n, int64_t d, T eps, int64_t t,
                  T* max_out, T* sum_out) {
  T r;
  T mx = -std::numeric_limits<T>::infinity();
  for (int64_t i = 0; i < n; ++i) mx = std::max(mx, AttnResLogit(sources[i] + t * d, w, gamma, d, eps, &r));
  T sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += std::exp(AttnResLogit(sources[i] + t * d, w, gamma, d, eps, &r) - mx);
  *max_out = mx;
  *sum_out = sum;
}

}  // namespace

// --- GEMM ---------------------------------------------------------------

template <typename T>
void RefMath<T>::Gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, T alpha, const T* a, const T* b,
                      T beta, T* c) {
  GemmLd(trans_a, trans_b, m, n, k, alpha, a, trans_a ? m : k, b, trans_b ? k : n, beta, c, n);
}

namespace {

// SSE-sized vectors (the baseline x86-64 target): 4 floats or 2 doubles.
template <typename T>
using GemmVec [[gnu::vector_size(16)]] = T;
// op(B) is packed in panels of two vectors' columns: panel q holds
// op(B)[p, q * W + j] at [(q * k + p) * W + j], zero beyond n.
template <typename T>
inline constexpr int64_t kGemmPanel = 2 * 16 / sizeof(T);

// Four rows of C against one panel, eight accumulators in registers:
// row r's sums take op(A)[r,p] * op(B)[p,j] for p = 0..k-1 in order.
template <typename T>
inline void GemmPanelRows(const T* const* a_rows, int64_t a_step, const T* panel, int64_t k, GemmVec<T>* out) {
  constexpr int64_t kW = kGemmPanel<T>;
  constexpr int64_t kHalf = kW / 2;
  const T* a0 = a_rows[0];
  const T* a1 = a_rows[1];
  const T* a2 = a_rows[2];
  const T* a3 = a_rows[3];
  GemmVec<T> c0 = {}, c1 = {}, c2 = {}, c3 = {}, d0 = {}, d1 = {}, d2 = {}, d3 = {};
  for (int64_t p = 0; p < k; ++p) {
    GemmVec<T> lo, hi;
    std::memcpy(&lo, panel + p * kW, sizeof lo);
    std::memcpy(&hi, panel + p * kW + kHalf, sizeof hi);
    const int64_t at = p * a_step;
    const T v0 = a0[at], v1 = a1[at], v2 = a2[at], v3 = a3[at];
    c0 += v0 * lo;
    d0 += v0 * hi;
    c1 += v1 * lo;
    d1 += v1 * hi;
    c2 += v2 * lo;
    d2 += v2 * hi;
    c3 += v3 * lo;
    d3 += v3 * hi;
  }
  out[0] = c0;
  out[1] = d0;
  out[2] = c1;
  out[3] = d1;
  out[4] = c2;
  out[5] = d2;
  out[6] = c3;
  out[7] = d3;
}

}  // namespace

template <typename T>
void RefMath<T>::GemmLd(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, T alpha, const T* a,
                        int64_t lda, const T* b, int64_t ldb, T beta, T* c, int64_t ldc) {
  // Every C[i,j] sums op(A)[i,p] * op(B)[p,j] for p = 0..k-1 in order into an
  // accumulator that starts at 0, then C = alpha * acc (+ beta * C), as the
  // header states. The order of the C elements computed does not change a
  // bit: each is its own sum. op(B) is packed in panels and four rows of C
  // accumulate in registers (built with -ffp-contract=off: no fused
  // multiply-add, the roundings of the scalar loop).
  constexpr int64_t kW = kGemmPanel<T>;
  const int64_t panels = (n + kW - 1) / kW;
  std::vector<T> packed(static_cast<size_t>(panels * k * kW), T(0));
  for (int64_t q = 0; q < panels; ++q) {
    const int64_t nj = std::min(kW, n - q * kW);
    T* dst = packed.data() + q * k * kW;
    for (int64_t p = 0; p < k; ++p) {
      for (int64_t j = 0; j < nj; ++j) {
        const int64_t col = q * kW + j;
        dst[p * kW + j] = trans_b ? b[col * ldb + p] : b[p * ldb + col];
      }
    }
  }
  const int64_t a_step = trans_a ? lda : 1;
  for (int64_t q = 0; q < panels; ++q) {
    const int64_t j0 = q * kW;
    const int64_t nj = std::min(kW, n - j0);
    const T* panel = packed.data() + q * k * kW;
    for (int64_t i0 = 0; i0 < m; i0 += 4) {
      const int64_t rows = std::min<int64_t>(4, m - i0);
      GemmVec<T> acc[8] = {};
      if (k > 0) {  // with k == 0, A may be null
        // Rows past m repeat the last row; their sums are not stored.
        const T* a_rows[4];
        for (int64_t r = 0; r < 4; ++r) {
          const int64_t row = i0 + std::min(r, rows - 1);
          a_rows[r] = trans_a ? a + row : a + row * lda;
        }
        GemmPanelRows<T>(a_rows, a_step, panel, k, acc);
      }
      for (int64_t r = 0; r < rows; ++r) {
        T* crow = c + (i0 + r) * ldc + j0;
        for (int64_t j = 0; j < nj; ++j) {
          const T sum = acc[2 * r + j / (kW / 2)][j % (kW / 2)];
          crow[j] = beta == T(0) ? alpha * sum : alpha * sum + beta * crow[j];
        }
      }
    }
  }
}

template <typename T>
void RefMath<T>::GemmStridedBatched(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, T alpha, const T* a,
                                    int64_t lda, int64_t stride_a, const T* b, int64_t ldb, int64_t stride_b, T beta,
                                    T* c, int64_t ldc, int64_t stride_c, int64_t batch) {
  for (int64_t i = 0; i < batch; ++i) {
    GemmLd(trans_a, trans_b, m, n, k, alpha, a + i * stride_a, lda, b + i * stride_b, ldb, beta, c + i * stride_c,
           ldc);
  }
}

template <typename T>
void RefMath<T>::GroupedGemm(const int64_t* offsets, int64_t experts, int64_t k, int64_t n, const T* x, const T* w,
                             T* y) {
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t rows = offsets[e + 1] - offsets[e];
    if (rows <= 0) continue;
    Gemm(false, false, rows, n, k, T(1), x + offsets[e] * k, w + e * k * n, T(0), y + offsets[e] * n);
  }
}

template <typename T>
void RefMath<T>::GroupedGemmBwd(const int64_t* offsets, int64_t experts, int64_t k, int64_t n, const T* x,
                                const T* w, const T* dy, T* dx, T* dw) {
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t rows = offsets[e + 1] - offsets[e];
    if (rows <= 0) continue;
    const T* xe = x + offsets[e] * k;
    const T* dye = dy + offsets[e] * n;
    Gemm(false, true, rows, k, n, T(1), dye, w + e * k * n, T(0), dx + offsets[e] * k);
    Gemm(true, false, k, n, rows, T(1), xe, dye, T(1), dw + e * k * n);
  }
}

// --- Norms ----------------------------------------------------------------

template <typename T>
void RefMath<T>::LayerNormFwd(const T* x, const T* gamma, const T* beta, int64_t rows, int64_t cols, T eps, T* y) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * cols;
    T* yr = y + r * cols;
    T mean, rstd;
    MeanRstd(xr, cols, eps, &mean, &rstd);
    for (int64_t c = 0; c < cols; ++c) yr[c] = (xr[c] - mean) * rstd * gamma[c] + beta[c];
  }
}

template <typename T>
void RefMath<T>::LayerNormBwd(const T* x, const T* gamma, const T* dy, int64_t rows, int64_t cols, T eps, T* dx,
                              T* dgamma, T* dbeta) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * cols;
    const T* dyr = dy + r * cols;
    T* dxr = dx + r * cols;
    T mean, rstd;
    MeanRstd(xr, cols, eps, &mean, &rstd);
    T sum_g = 0, sum_gx = 0;
    for (int64_t c = 0; c < cols; ++c) {
      const T xhat = (xr[c] - mean) * rstd;
      const T g = dyr[c] * gamma[c];
      sum_g += g;
      sum_gx += g * xhat;
    }
    const T mean_g = sum_g / T(cols);
    const T mean_gx = sum_gx / T(cols);
    for (int64_t c = 0; c < cols; ++c) {
      const T xhat = (xr[c] - mean) * rstd;
      const T g = dyr[c] * gamma[c];
      dxr[c] = rstd * (g - mean_g - xhat * mean_gx);
      dgamma[c] += dyr[c] * xhat;
      dbeta[c] += dyr[c];
    }
  }
}

template <typename T>
void RefMath<T>::RmsNormFwd(const T* x, const T* gamma, int64_t rows, int64_t cols, T eps, T* y) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * cols;
    T* yr = y + r * cols;
    const T rstd = RmsRstd(xr, cols, eps);
    for (int64_t c = 0; c < cols; ++c) yr[c] = xr[c] * rstd * gamma[c];
  }
}

template <typename T>
void RefMath<T>::RmsNormBwd(const T* x, const T* gamma, const T* dy, int64_t rows, int64_t cols, T eps, T* dx,
                            T* dgamma) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * cols;
    const T* dyr = dy + r * cols;
    T* dxr = dx + r * cols;
    const T rstd = RmsRstd(xr, cols, eps);
    T sum_gx = 0;
    for (int64_t c = 0; c < cols; ++c) sum_gx += dyr[c] * gamma[c] * (xr[c] * rstd);
    const T mean_gx = sum_gx / T(cols);
    for (int64_t c = 0; c < cols; ++c) {
      const T xhat = xr[c] * rstd;
      dxr[c] = rstd * (dyr[c] * gamma[c] - xhat * mean_gx);
      dgamma[c] += dyr[c] * xhat;
    }
  }
}

// --- Activations, dropout, add ---------------------------------------------

namespace {
template <typename T>
constexpr T kSqrt2OverPi = T(0.79788456080286535587989211986876);
template <typename T>
constexpr T kGeluCubic = T(0.044715);
}  // namespace

template <typename T>
void RefMath<T>::GeluFwd(const T* x, int64_t n, T* y) {
  for (int64_t i = 0; i < n; ++i) {
    const T xi = x[i];
    y[i] = T(0.5) * xi * (T(1) + std::tanh(kSqrt2OverPi<T> * (xi + kGeluCubic<T> * xi * xi * xi)));
  }
}

template <typename T>
void RefMath<T>::GeluBwd(const T* x, const T* dy, int64_t n, T* dx) {
  for (int64_t i = 0; i < n; ++i) {
    const T xi = x[i];
    const T t = std::tanh(kSqrt2OverPi<T> * (xi + kGeluCubic<T> * xi * xi * xi));
    const T du = kSqrt2OverPi<T> * (T(1) + T(3) * kGeluCubic<T> * xi * xi);
    dx[i] = dy[i] * (T(0.5) * (T(1) + t) + T(0.5) * xi * (T(1) - t * t) * du);
  }
}

template <typename T>
void RefMath<T>::SwigluFwd(const T* x, int64_t rows, int64_t f, T* y) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* gate = x + r * 2 * f;
    const T* up = gate + f;
    for (int64_t j = 0; j < f; ++j) y[r * f + j] = gate[j] * Sigmoid(gate[j]) * up[j];
  }
}

template <typename T>
void RefMath<T>::SwigluBwd(const T* x, const T* dy, int64_t rows, int64_t f, T* dx) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* gate = x + r * 2 * f;
    const T* up = gate + f;
    T* dgate = dx + r * 2 * f;
    T* dup = dgate + f;
    for (int64_t j = 0; j < f; ++j) {
      const T g = gate[j];
      const T s = Sigmoid(g);
      const T d = dy[r * f + j];
      dgate[j] = d * up[j] * (s * (T(1) + g * (T(1) - s)));
      dup[j] = d * (g * s);
    }
  }
}

template <typename T>
void RefMath<T>::DropoutFwd(const T* x, int64_t n, T p, uint64_t seed, uint64_t offset, T* y, uint8_t* mask,
                            int64_t first) {
  const T keep = T(1) - p;
  for (int64_t i = 0; i < n; ++i) {
    const bool kept = T(Uniform01(seed, offset, static_cast<uint64_t>(first + i))) >= p;
    mask[i] = kept ? 1 : 0;
    y[i] = kept ? x[i] / keep : T(0);
  }
}

template <typename T>
void RefMath<T>::DropoutBwd(const T* dy, const uint8_t* mask, int64_t n, T p, T* dx) {
  const T keep = T(1) - p;
  for (int64_t i = 0; i < n; ++i) dx[i] = mask[i] ? dy[i] / keep : T(0);
}

template <typename T>
void RefMath<T>::Add(const T* a, const T* b, int64_t n, T* y) {
  for (int64_t i = 0; i < n; ++i) y[i] = a[i] + b[i];
}

template <typename T>
void RefMath<T>::Accumulate(T* y, const T* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += x[i];
}

template <typename T>
void RefMath<T>::Axpby(const T* x, const T* y, int64_t n, T a, T b, T* out) {
  if (y == nullptr) {
    for (int64_t i = 0; i < n; ++i) out[i] = a * x[i];
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    const T ax = a * x[i];
    const T by = b * y[i];
    out[i] = ax + by;
  }
}

// --- Softmax, sigmoid ---------------------------------------------------------

template <typename T>
void RefMath<T>::SoftmaxFwd(const T* x, int64_t rows, int64_t cols, T scale, int64_t causal_seq, T* y, int64_t cp,
                            int64_t cp_rank) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * cols;
    T* yr = y + r * cols;
    const int64_t visible =
        causal_seq > 0 ? std::min(cols, CpPosition(r % causal_seq, causal_seq, cp, cp_rank) + 1) : cols;
    for (int64_t j = 0; j < visible; ++j) yr[j] = scale * xr[j];
    T mx;
    if (visible > 0) SoftmaxRow(yr, visible, yr, &mx);
    std::fill(yr + visible, yr + cols, T(0));
  }
}

template <typename T>
void RefMath<T>::SoftmaxBwd(const T* y, const T* dy, int64_t rows, int64_t cols, T scale, T* dx) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* yr = y + r * cols;
    const T* dyr = dy + r * cols;
    T* dxr = dx + r * cols;
    const T dot = DotN(dyr, yr, cols);
    for (int64_t j = 0; j < cols; ++j) dxr[j] = scale * (yr[j] * (dyr[j] - dot));
  }
}

template <typename T>
void RefMath<T>::SigmoidFwd(const T* x, int64_t n, T* y) {
  for (int64_t i = 0; i < n; ++i) y[i] = Sigmoid(x[i]);
}

template <typename T>
void RefMath<T>::SigmoidBwd(const T* y, const T* dy, int64_t n, T* dx) {
  for (int64_t i = 0; i < n; ++i) dx[i] = dy[i] * (y[i] * (T(1) - y[i]));
}

// --- Router, dispatch, combine ------------------------------------------

template <typename T>
void RefMath<T>::TopKFwd(const T* probs, int64_t tokens, int64_t experts, int64_t top_k, bool renormalize,
                         int32_t* idx_out, T* weights) {
  for (int64_t t = 0; t < tokens; ++t) {
    const T* p = probs + t * experts;
    // Pass i picks the best expert that comes after pass i-1's pick in the
    // total order (p descending, index ascending): no "taken" flags needed.
    int32_t* idx = idx_out + t * top_k;
    T* wt = weights + t * top_k;
    int64_t prev = -1;
    for (int64_t i = 0; i < top_k; ++i) {
      int64_t best = -1;
      for (int64_t e = 0; e < experts; ++e) {
        const bool after_prev = prev < 0 || p[e] < p[prev] || (p[e] == p[prev] && e > prev);
        if (after_prev && (best < 0 || p[e] > p[best])) best = e;
      }
      idx[i] = static_cast<int32_t>(best);
      wt[i] = p[best];
      prev = best;
    }
    if (renormalize) {
      T sum = 0;
      for (int64_t i = 0; i < top_k; ++i) sum += wt[i];
      for (int64_t i = 0; i < top_k; ++i) wt[i] /= sum;
    }
  }
}

template <typename T>
void RefMath<T>::TopKBwd(const T* probs, const int32_t* idx_in, const T* weights, const T* d_weights, int64_t tokens,
                         int64_t experts, int64_t top_k, bool renormalize, T* dprobs) {
  for (int64_t t = 0; t < tokens; ++t) {
    const T* p = probs + t * experts;
    const int32_t* idx = idx_in + t * top_k;
    const T* wt = weights + t * top_k;
    const T* dwt = d_weights + t * top_k;
    T* dp = dprobs + t * experts;
    std::fill(dp, dp + experts, T(0));
    if (renormalize) {
      // w_i = p_i / S: dL/dp_i = (dw_i - sum_j dw_j w_j) / S.
      T sum_p = 0, dot = 0;
      for (int64_t i = 0; i < top_k; ++i) {
        sum_p += p[idx[i]];
        dot += dwt[i] * wt[i];
      }
      for (int64_t i = 0; i < top_k; ++i) dp[idx[i]] = (dwt[i] - dot) / sum_p;
    } else {
      for (int64_t i = 0; i < top_k; ++i) dp[idx[i]] = dwt[i];
    }
  }
}

template <typename T>
void RefMath<T>::RouterFwd(const T* logits, int64_t tokens, int64_t experts, int64_t top_k, bool sigmoid,
                           bool renormalize, T* probs, int32_t* topk_idx, T* topk_weights) {
  if (sigmoid) {
    SigmoidFwd(logits, tokens * experts, probs);
  } else {
    SoftmaxFwd(logits, tokens, experts, T(1), 0, probs);
  }
  TopKFwd(probs, tokens, experts, top_k, renormalize, topk_idx, topk_weights);
}

template <typename T>
void RefMath<T>::RouterBwd(const T* probs, const int32_t* topk_idx, const T* topk_weights, const T* d_topk_weights,
                           int64_t tokens, int64_t experts, int64_t top_k, bool sigmoid, bool renormalize,
                           T* dlogits) {
  // dlogits first holds dL/dprobs, then is mapped through the softmax /
  // sigmoid in place.
  TopKBwd(probs, topk_idx, topk_weights, d_topk_weights, tokens, experts, top_k, renormalize, dlogits);
  if (sigmoid) {
    SigmoidBwd(probs, dlogits, tokens * experts, dlogits);
  } else {
    SoftmaxBwd(probs, dlogits, tokens, experts, T(1), dlogits);
  }
}

template <typename T>
void RefMath<T>::DispatchFwd(const T* x, const int32_t* slot_of, int64_t tokens, int64_t top_k, int64_t d,
                             T* x_sorted) {
  for (int64_t j = 0; j < tokens * top_k; ++j) {
    const T* src = x + (slot_of[j] / top_k) * d;
    std::copy(src, src + d, x_sorted + j * d);
  }
}

template <typename T>
void RefMath<T>::DispatchBwd(const T* dx_sorted, const int32_t* slot_of, int64_t tokens, int64_t top_k, int64_t d,
                             T* dx) {
  std::fill(dx, dx + tokens * d, T(0));
  for (int64_t j = 0; j < tokens * top_k; ++j) {
    T* dst = dx + (slot_of[j] / top_k) * d;
    for (int64_t c = 0; c < d; ++c) dst[c] += dx_sorted[j * d + c];
  }
}

template <typename T>
void RefMath<T>::CombineFwd(const T* y_sorted, const int32_t* slot_of, const T* topk_weights, int64_t tokens,
                            int64_t top_k, int64_t d, T* out) {
  std::fill(out, out + tokens * d, T(0));
  for (int64_t j = 0; j < tokens * top_k; ++j) {
    const int64_t slot = slot_of[j];
    const T wt = topk_weights[slot];
    T* dst = out + (slot / top_k) * d;
    for (int64_t c = 0; c < d; ++c) dst[c] += wt * y_sorted[j * d + c];
  }
}

template <typename T>
void RefMath<T>::CombineBwd(const T* dout, const int32_t* slot_of, const T* topk_weights, const T* y_sorted,
                            int64_t tokens, int64_t top_k, int64_t d, T* dy_sorted, T* d_topk_weights) {
  for (int64_t j = 0; j < tokens * top_k; ++j) {
    const int64_t slot = slot_of[j];
    const T wt = topk_weights[slot];
    const T* g = dout + (slot / top_k) * d;
    for (int64_t c = 0; c < d; ++c) dy_sorted[j * d + c] = wt * g[c];
    if (y_sorted != nullptr) d_topk_weights[slot] = DotN(g, y_sorted + j * d, d);
  }
}

template <typename T>
void RefMath<T>::RouterGradRewrite(const T* da, const T* act, const int32_t* slot_of, const T* topk_weights,
                                   int64_t tokens, int64_t top_k, int64_t f, T* d_topk_weights) {
  for (int64_t j = 0; j < tokens * top_k; ++j) {
    T dot = DotN(da + j * f, act + j * f, f);
    if (topk_weights != nullptr) {
      T w = topk_weights[slot_of[j]];
      dot = w == T(0) ? T(0) : dot / w;
    }
    d_topk_weights[slot_of[j]] = dot;
  }
}

// --- Embedding, split heads ----------------------------------------------------

template <typename T>
void RefMath<T>::EmbeddingFwd(const int32_t* tokens, const T* table, int64_t n, int64_t d, T* y) {
  for (int64_t t = 0; t < n; ++t) {
    if (tokens[t] < 0) {
      std::fill(y + t * d, y + (t + 1) * d, T(0));
      continue;
    }
    const T* src = table + static_cast<int64_t>(tokens[t]) * d;
    std::copy(src, src + d, y + t * d);
  }
}

template <typename T>
void RefMath<T>::EmbeddingBwd(const int32_t* tokens, const T* dy, int64_t n, int64_t d, T* dtable) {
  for (int64_t t = 0; t < n; ++t) {
    if (tokens[t] < 0) continue;
    T* dst = dtable + static_cast<int64_t>(tokens[t]) * d;
    for (int64_t c = 0; c < d; ++c) dst[c] += dy[t * d + c];
  }
}

namespace {

// One head row of head_dim values from `x` to `y`: a copy, or the RoPE
// rotation at position pos (inverse: the transposed rotation).
template <typename T>
void RopeRow(const T* x, T* y, int64_t pos, const SplitShape& sh, bool rotate, bool inverse) {
  if (!rotate) {
    std::copy(x, x + sh.head_dim, y);
    return;
  }
  const int64_t half = sh.head_dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    const double angle = static_cast<double>(CpPosition(pos, sh.s, sh.cp, sh.cp_rank)) * std::pow(static_cast<double>(sh.rope_theta),
                                                             -static_cast<double>(2 * i) /
                                                                 static_cast<double>(sh.head_dim));
    const T c = static_cast<T>(std::cos(angle));
    const T s = static_cast<T>(std::sin(angle));
    const T a = x[i];
    const T b = x[i + half];
    if (inverse) {
      y[i] = a * c + b * s;
      y[i + half] = b * c - a * s;
    } else {
      y[i] = a * c - b * s;
      y[i + half] = b * c + a * s;
    }
  }
}

// Calls f(src_offset, dst tensor 0/1/2, dst_offset, rotate) for every head
// row of every token: src in qkv, dst in q / k / v.
template <typename F>
void ForEachHeadRow(const SplitShape& sh, F&& f) {
  const int64_t width = (sh.heads + 2 * sh.kv_heads) * sh.head_dim;
  for (int64_t bb = 0; bb < sh.b; ++bb) {
    for (int64_t pos = 0; pos < sh.s; ++pos) {
      const int64_t row = (bb * sh.s + pos) * width;
      for (int64_t h = 0; h < sh.heads; ++h) {
        f(row + h * sh.head_dim, 0, ((bb * sh.heads + h) * sh.s + pos) * sh.head_dim, pos, sh.rope);
      }
      for (int64_t g = 0; g < sh.kv_heads; ++g) {
        const int64_t kv = ((bb * sh.kv_heads + g) * sh.s + pos) * sh.head_dim;
        f(row + (sh.heads + g) * sh.head_dim, 1, kv, pos, sh.rope);
        f(row + (sh.heads + sh.kv_heads + g) * sh.head_dim, 2, kv, pos, false);
      }
    }
  }
}

}  // namespace

template <typename T>
void RefMath<T>::SplitHeadsFwd(const T* qkv, const SplitShape& sh, T* q, T* k, T* v) {
  T* const out[3] = {q, k, v};
  ForEachHeadRow(sh, [&](int64_t src, int which, int64_t dst, int64_t pos, bool rotate) {
    RopeRow(qkv + src, out[which] + dst, pos, sh, rotate, false);
  });
}

template <typename T>
void RefMath<T>::SplitHeadsBwd(const T* dq, const T* dk, const T* dv, const SplitShape& sh, T* dqkv) {
  const T* const in[3] = {dq, dk, dv};
  ForEachHeadRow(sh, [&](int64_t src, int which, int64_t dst, int64_t pos, bool rotate) {
    RopeRow(in[which] + dst, dqkv + src, pos, sh, rotate, true);
  });
}

template <typename T>
void RefMath<T>::MlaSplitFwd(const T* q_lin, const T* kv, const T* k_pe, const MlaShape& sh, T* q, T* k, T* v) {
  const int64_t qk = sh.nope + sh.rope, qw = sh.heads * qk, kvw = sh.heads * (sh.nope + sh.v);
  const SplitShape rope{sh.b, sh.s, 1, 1, sh.rope, true, sh.rope_theta, sh.cp, sh.cp_rank};
  for (int64_t bb = 0; bb < sh.b; ++bb) {
    for (int64_t pos = 0; pos < sh.s; ++pos) {
      const int64_t row = bb * sh.s + pos;
      for (int64_t h = 0; h < sh.heads; ++h) {
        const int64_t out = ((bb * sh.heads + h) * sh.s + pos);
        const T* qs = q_lin + row * qw + h * qk;
        const T* kvs = kv + row * kvw + h * (sh.nope + sh.v);
        std::copy(qs, qs + sh.nope, q + out * qk);
        if (sh.rope > 0) RopeRow(qs + sh.nope, q + out * qk + sh.nope, pos, rope, true, false);
        std::copy(kvs, kvs + sh.nope, k + out * qk);
        if (sh.rope > 0) RopeRow(k_pe + row * sh.rope, k + out * qk + sh.nope, pos, rope, true, false);
        std::copy(kvs + sh.nope, kvs + sh.nope + sh.v, v + out * sh.v);
      }
    }
  }
}

template <typename T>
void RefMath<T>::MlaSplitBwd(const T* dq, const T* dk, const T* dv, const MlaShape& sh, T* dq_lin, T* dkv,
                             T* dk_pe) {
  const int64_t qk = sh.nope + sh.rope, qw = sh.heads * qk, kvw = sh.heads * (sh.nope + sh.v);
  const SplitShape rope{sh.b, sh.s, 1, 1, sh.rope, true, sh.rope_theta, sh.cp, sh.cp_rank};
  std::vector<T> back(static_cast<size_t>(sh.rope));
  for (int64_t bb = 0; bb < sh.b; ++bb) {
    for (int64_t pos = 0; pos < sh.s; ++pos) {
      const int64_t row = bb * sh.s + pos;
      T* pe = dk_pe + row * sh.rope;
      std::fill(pe, pe + sh.rope, T(0));
      for (int64_t h = 0; h < sh.heads; ++h) {
        const int64_t in = ((bb * sh.heads + h) * sh.s + pos);
        T* qd = dq_lin + row * qw + h * qk;
        T* kvd = dkv + row * kvw + h * (sh.nope + sh.v);
        std::copy(dq + in * qk, dq + in * qk + sh.nope, qd);
        if (sh.rope > 0) RopeRow(dq + in * qk + sh.nope, qd + sh.nope, pos, rope, true, true);
        std::copy(dk + in * qk, dk + in * qk + sh.nope, kvd);
        std::copy(dv + in * sh.v, dv + in * sh.v + sh.v, kvd + sh.nope);
        if (sh.rope > 0) {
          RopeRow(dk + in * qk + sh.nope, back.data(), pos, rope, true, true);
          for (int64_t j = 0; j < sh.rope; ++j) pe[j] += back[static_cast<size_t>(j)];
        }
      }
    }
  }
}

// --- Optimizer -------------------------------------------------------------------

template <typename T>
void RefMath<T>::AdamStep(T* master, const T* grad, T* m, T* v, int64_t n, const AdamConfig& c, int64_t step) {
  const T beta1 = T(c.beta1), beta2 = T(c.beta2);
  const T one_minus_beta1 = T(1) - beta1, one_minus_beta2 = T(1) - beta2;
  const T bc1 = T(AdamBiasCorrection(c.beta1, step)), bc2 = T(AdamBiasCorrection(c.beta2, step));
  const T lr = T(c.lr), eps = T(c.eps), wd = T(c.weight_decay);
  for (int64_t i = 0; i < n; ++i) {
    const T g = grad[i];
    const T mi = beta1 * m[i] + one_minus_beta1 * g;
    const T vi = beta2 * v[i] + (one_minus_beta2 * g) * g;
    m[i] = mi;
    v[i] = vi;
    const T mhat = mi / bc1;
    const T vhat = vi / bc2;
    const T u = mhat / (std::sqrt(vhat) + eps) + wd * master[i];
    master[i] = master[i] - lr * u;
  }
}

template <typename T>
double RefMath<T>::SquaredNorm(const T* x, int64_t n) {
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double xi = static_cast<double>(x[i]);
    sum += xi * xi;
  }
  return sum;
}

void DispatchPlan(const int32_t* topk_idx, int64_t tokens, int64_t top_k, int64_t experts, int32_t* slot_of,
                  int64_t* offsets) {
  const int64_t pairs = tokens * top_k;
  std::fill(offsets, offsets + experts + 1, int64_t{0});
  for (int64_t s = 0; s < pairs; ++s) ++offsets[topk_idx[s] + 1];
  for (int64_t e = 0; e < experts; ++e) offsets[e + 1] += offsets[e];
  // offsets[e] doubles as expert e's write cursor; afterwards it holds the
  // start of expert e+1, so shift everything back by one.
  for (int64_t s = 0; s < pairs; ++s) slot_of[offsets[topk_idx[s]]++] = static_cast<int32_t>(s);
  for (int64_t e = experts; e > 0; --e) offsets[e] = offsets[e - 1];
  offsets[0] = 0;
}

// --- Cross entropy ----------------------------------------------------------

template <typename T>
void RefMath<T>::CrossEntropyFwd(const T* logits, const int32_t* targets, int64_t tokens, int64_t vocab, T* probs,
                                 T* loss) {
  for (int64_t t = 0; t < tokens; ++t) {
    const T* l = logits + t * vocab;
    T* p = probs + t * vocab;
    T mx;
    const T sum = SoftmaxRow(l, vocab, p, &mx);
    loss[t] = std::log(sum) - (l[targets[t]] - mx);
  }
}

template <typename T>
void RefMath<T>::CrossEntropyBwd(const T* probs, const int32_t* targets, int64_t tokens, int64_t vocab, T scale,
                                 T* dlogits) {
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t v = 0; v < vocab; ++v) {
      const T onehot = v == targets[t] ? T(1) : T(0);
      dlogits[t * vocab + v] = (probs[t * vocab + v] - onehot) * scale;
    }
  }
}

template <typename T>
void RefMath<T>::CrossEntropyPartialStats(const T* logits, const int32_t* targets, int64_t tokens, int64_t vocab,
                                          T* stats) {
  for (int64_t t = 0; t < tokens; ++t) {
    const T* l = logits + t * vocab;
    T mx = l[0];
    for (int64_t v = 1; v < vocab; ++v) mx = std::max(mx, l[v]);
    T sum = 0;
    for (int64_t v = 0; v < vocab; ++v) sum += std::exp(l[v] - mx);
    stats[3 * t] = mx;
    stats[3 * t + 1] = sum;
    stats[3 * t + 2] = targets[t] >= 0 ? l[targets[t]] : T(0);
  }
}

template <typename T>
void RefMath<T>::CrossEntropyPartialProbs(const T* logits, const T* stats, int64_t tokens, int64_t vocab, T* probs) {
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t v = 0; v < vocab; ++v) {
      probs[t * vocab + v] = std::exp(logits[t * vocab + v] - stats[2 * t]) / stats[2 * t + 1];
    }
  }
}

// --- Block AttnRes ------------------------------------------------------------

template <typename T>
void RefMath<T>::AttnResFwd(const T* const* sources, int64_t n, const T* w, const T* gamma, int64_t tokens, int64_t d,
                            T eps, T* h, T* weights) {
  for (int64_t t = 0; t < tokens; ++t) {
    T mx, sum, r;
    AttnResStats(sources, w, gamma, n, d, eps, t, &mx, &sum);
    T* ht = h + t * d;
    std::fill(ht, ht + d, T(0));
    for (int64_t i = 0; i < n; ++i) {
      const T* v = sources[i] + t * d;
      const T a = std::exp(AttnResLogit(v, w, gamma, d, eps, &r) - mx) / sum;
      weights[t * n + i] = a;
      for (int64_t c = 0; c < d; ++c) ht[c] += a * v[c];
    }
  }
}

template <typename T>
void RefMath<T>::AttnResBwd(const T* const* sources, int64_t n, const T* w, const T* gamma, const T* dh,
                            int64_t tokens, int64_t d, T eps, T* const* dsources, T* dw, T* dgamma, T* partial) {
  // With `partial` (the planned workspace, workspace::AttnResBwdBytes), as
  // the CUDA kernel: U = sum over tokens of dz xhat, one row per group of
  // consecutive tokens, then summed over the groups in order; dw += gamma U,
  // dgamma += w U.
  const int64_t groups = std::min<int64_t>(tokens, workspace::kAttnResBwdGroups);
  const int64_t per_group = groups == 0 ? 1 : (tokens + groups - 1) / groups;
  if (partial != nullptr) std::fill(partial, partial + groups * d, T(0));
  for (int64_t t = 0; t < tokens; ++t) {
    T mx, sum, r;
    AttnResStats(sources, w, gamma, n, d, eps, t, &mx, &sum);
    const T* dht = dh + t * d;
    // da_i = <dh, v_i>; the softmax backward needs sum_j a_j da_j first.
    T dot_ada = 0;
    for (int64_t i = 0; i < n; ++i) {
      const T* v = sources[i] + t * d;
      const T a = std::exp(AttnResLogit(v, w, gamma, d, eps, &r) - mx) / sum;
      dot_ada += a * DotN(dht, v, d);
    }
    for (int64_t i = 0; i < n; ++i) {
      const T* v = sources[i] + t * d;
      T* dv = dsources[i] + t * d;
      const T a = std::exp(AttnResLogit(v, w, gamma, d, eps, &r) - mx) / sum;
      const T dz = a * (DotN(dht, v, d) - dot_ada);
      // z = sum_c w_c gamma_c xhat_c with xhat = v * r; g = dz/dxhat.
      T sum_gx = 0;
      for (int64_t c = 0; c < d; ++c) sum_gx += (dz * w[c] * gamma[c]) * (v[c] * r);
      const T mean_gx = sum_gx / T(d);
      for (int64_t c = 0; c < d; ++c) {
        const T xhat = v[c] * r;
        const T g = dz * w[c] * gamma[c];
        dv[c] += a * dht[c] + r * (g - xhat * mean_gx);
        if (partial != nullptr) {
          partial[(t / per_group) * d + c] += dz * xhat;
        } else {
          dw[c] += dz * gamma[c] * xhat;
          dgamma[c] += dz * w[c] * xhat;
        }
      }
    }
  }
  if (partial == nullptr) return;
  for (int64_t c = 0; c < d; ++c) {
    T u = 0;
    for (int64_t k = 0; k < groups; ++k) u += partial[k * d + c];
    dw[c] += gamma[c] * u;
    dgamma[c] += w[c] * u;
  }
}

template struct RefMath<float>;
template struct RefMath<double>;

}  // namespace ref

namespace {

// Float instantiation of the reference math behind the Ops interface. The
// workspaces the interface asks for are used as the CUDA kernels use them
// (attention, AttnRes and KDA backward), so that the eager witness sees the
// same bytes written on either backend; GEMM workspaces (cuBLAS's) are not.
class RefOps final : public Ops {
  using M = ref::RefMath<float>;
  using A = ref::AttentionMath<float>;

 public:
  void Gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a, const float* b,
            float beta, float* c, void* /*workspace*/) override {
    M::Gemm(trans_a, trans_b, m, n, k, alpha, a, b, beta, c);
  }
  void GemmStridedBatched(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                          int64_t lda, int64_t stride_a, const float* b, int64_t ldb, int64_t stride_b, float beta,
                          float* c, int64_t ldc, int64_t stride_c, int64_t batch, void* /*workspace*/) override {
    M::GemmStridedBatched(trans_a, trans_b, m, n, k, alpha, a, lda, stride_a, b, ldb, stride_b, beta, c, ldc, stride_c,
                          batch);
  }
  void GroupedGemm(const int64_t* offsets, int64_t experts, int64_t k, int64_t n, const float* x, const float* w,
                   float* y, void* /*workspace*/) override {
    M::GroupedGemm(offsets, experts, k, n, x, w, y);
  }
  void GroupedGemmBwd(const int64_t* offsets, int64_t experts, int64_t k, int64_t n, const float* x, const float* w,
                      const float* dy, float* dx, float* dw, void* /*workspace*/) override {
    M::GroupedGemmBwd(offsets, experts, k, n, x, w, dy, dx, dw);
  }
  void LayerNormFwd(const float* x, const float* gamma, const float* beta, int64_t rows, int64_t cols, float eps,
                    float* y) override {
    M::LayerNormFwd(x, gamma, beta, rows, cols, eps, y);
  }
  void LayerNormBwd(const float* x, const float* gamma, const float* dy, int64_t rows, int64_t cols, float eps,
                    float* dx, float* dgamma, float* dbeta) override {
    M::LayerNormBwd(x, gamma, dy, rows, cols, eps, dx, dgamma, dbeta);
  }
  void RmsNormFwd(const float* x, const float* gamma, int64_t rows, int64_t cols, float eps, float* y) override {
    M::RmsNormFwd(x, gamma, rows, cols, eps, y);
  }
  void RmsNormBwd(const float* x, const float* gamma, const float* dy, int64_t rows, int64_t cols, float eps,
                  float* dx, float* dgamma) override {
    M::RmsNormBwd(x, gamma, dy, rows, cols, eps, dx, dgamma);
  }
  void GeluFwd(const float* x, int64_t n, float* y) override { M::GeluFwd(x, n, y); }
  void GeluBwd(const float* x, const float* dy, int64_t n, float* dx) override { M::GeluBwd(x, dy, n, dx); }
  void SwigluFwd(const float* x, int64_t rows, int64_t f, float* y) override { M::SwigluFwd(x, rows, f, y); }
  void SwigluBwd(const float* x, const float* dy, int64_t rows, int64_t f, float* dx) override {
    M::SwigluBwd(x, dy, rows, f, dx);
  }
  void DropoutFwd(const float* x, int64_t n, float p, uint64_t seed, uint64_t offset, float* y, uint8_t* mask,
                  int64_t first) override {
    M::DropoutFwd(x, n, p, seed, offset, y, mask, first);
  }
  void DropoutBwd(const float* dy, const uint8_t* mask, int64_t n, float p, float* dx) override {
    M::DropoutBwd(dy, mask, n, p, dx);
  }
  void Add(const float* a, const float* b, int64_t n, float* y) override { M::Add(a, b, n, y); }
  void Accumulate(float* y, const float* x, int64_t n) override { M::Accumulate(y, x, n); }
  void Axpby(const float* x, const float* y, int64_t n, float a, float b, float* out) override {
    M::Axpby(x, y, n, a, b, out);
  }

  void SoftmaxFwd(const float* x, int64_t rows, int64_t cols, float scale, int64_t causal_seq, float* y, int64_t cp,
                  int64_t cp_rank) override {
    M::SoftmaxFwd(x, rows, cols, scale, causal_seq, y, cp, cp_rank);
  }
  void SoftmaxBwd(const float* y, const float* dy, int64_t rows, int64_t cols, float scale, float* dx) override {
    M::SoftmaxBwd(y, dy, rows, cols, scale, dx);
  }
  void SigmoidFwd(const float* x, int64_t n, float* y) override { M::SigmoidFwd(x, n, y); }
  void SigmoidBwd(const float* y, const float* dy, int64_t n, float* dx) override { M::SigmoidBwd(y, dy, n, dx); }
  void TopKFwd(const float* probs, int64_t tokens, int64_t experts, int64_t top_k, bool renormalize, int32_t* idx,
               float* weights) override {
    M::TopKFwd(probs, tokens, experts, top_k, renormalize, idx, weights);
  }
  void TopKBwd(const float* probs, const int32_t* idx, const float* weights, const float* d_weights, int64_t tokens,
               int64_t experts, int64_t top_k, bool renormalize, float* dprobs) override {
    M::TopKBwd(probs, idx, weights, d_weights, tokens, experts, top_k, renormalize, dprobs);
  }
  void EmbeddingFwd(const int32_t* tokens, const float* table, int64_t n, int64_t d, float* y) override {
    M::EmbeddingFwd(tokens, table, n, d, y);
  }
  void EmbeddingBwd(const int32_t* tokens, const float* dy, int64_t n, int64_t d, float* dtable) override {
    M::EmbeddingBwd(tokens, dy, n, d, dtable);
  }
  void SplitHeadsFwd(const float* qkv, const SplitShape& sh, float* q, float* k, float* v) override {
    M::SplitHeadsFwd(qkv, sh, q, k, v);
  }
  void SplitHeadsBwd(const float* dq, const float* dk, const float* dv, const SplitShape& sh, float* dqkv) override {
    M::SplitHeadsBwd(dq, dk, dv, sh, dqkv);
  }
  void MlaSplitFwd(const float* q_lin, const float* kv, const float* k_pe, const MlaShape& sh, float* q, float* k,
                   float* v) override {
    M::MlaSplitFwd(q_lin, kv, k_pe, sh, q, k, v);
  }
  void MlaSplitBwd(const float* dq, const float* dk, const float* dv, const MlaShape& sh, float* dq_lin, float* dkv,
                   float* dk_pe) override {
    M::MlaSplitBwd(dq, dk, dv, sh, dq_lin, dkv, dk_pe);
  }
  void AdamStep(float* master, const float* grad, float* m, float* v, int64_t n, const AdamConfig& c,
                int64_t step) override {
    M::AdamStep(master, grad, m, v, n, c, step);
  }
  void SquaredNorm(const float* x, int64_t n, double* out) override { *out = M::SquaredNorm(x, n); }
  void Copy(void* dst, const void* src, int64_t bytes) override {
    if (bytes > 0) std::memcpy(dst, src, static_cast<size_t>(bytes));
  }
  void WidenBf16(const uint16_t* x, int64_t n, float* y) override {
    for (int64_t i = 0; i < n; ++i) y[i] = Bf16ToFloat(x[i]);
  }
  void RoundToBf16(const float* x, int64_t n, uint16_t* y) override {
    for (int64_t i = 0; i < n; ++i) y[i] = FloatToBf16(x[i]);
  }
  void Zero(void* dst, int64_t bytes) override {
    if (bytes > 0) std::memset(dst, 0, static_cast<size_t>(bytes));
  }

  void AttentionFwd(const AttentionShape& sh, const float* q, const float* k, const float* v, float* probs,
                    float* o) override {
    A::AttentionFwd(sh, q, k, v, probs, o);
  }
  void AttentionBwd(const AttentionShape& sh, const float* q, const float* k, const float* v, const float* probs,
                    const float* d_o, float* dq, float* dk, float* dv, void* workspace) override {
    A::AttentionBwd(sh, q, k, v, probs, d_o, dq, dk, dv, static_cast<float*>(workspace));
  }
  void FlashAttentionFwd(const AttentionShape& sh, const float* q, const float* k, const float* v, float* o,
                         float* lse) override {
    A::FlashAttentionFwd(sh, q, k, v, o, lse);
  }
  void FlashAttentionBwd(const AttentionShape& sh, const float* q, const float* k, const float* v, const float* o,
                         const float* lse, const float* d_o, float* dq, float* dk, float* dv,
                         void* workspace) override {
    A::FlashAttentionBwd(sh, q, k, v, o, lse, d_o, dq, dk, dv, static_cast<float*>(workspace));
  }

  void RouterFwd(const float* logits, int64_t tokens, int64_t experts, int64_t top_k, bool sigmoid, bool renormalize,
                 float* probs, int32_t* topk_idx, float* topk_weights) override {
    M::RouterFwd(logits, tokens, experts, top_k, sigmoid, renormalize, probs, topk_idx, topk_weights);
  }
  void RouterBwd(const float* probs, const int32_t* topk_idx, const float* topk_weights,
                 const float* d_topk_weights, int64_t tokens, int64_t experts, int64_t top_k, bool sigmoid,
                 bool renormalize, float* dlogits) override {
    M::RouterBwd(probs, topk_idx, topk_weights, d_topk_weights, tokens, experts, top_k, sigmoid, renormalize,
                 dlogits);
  }
  void DispatchPlan(const int32_t* topk_idx, int64_t tokens, int64_t top_k, int64_t experts, int32_t* slot_of,
                    int64_t* offsets) override {
    ref::DispatchPlan(topk_idx, tokens, top_k, experts, slot_of, offsets);
  }
  void DispatchFwd(const float* x, const int32_t* slot_of, int64_t tokens, int64_t top_k, int64_t d,
                   float* x_sorted) override {
    M::DispatchFwd(x, slot_of, tokens, top_k, d, x_sorted);
  }
  void DispatchBwd(const float* dx_sorted, const int32_t* slot_of, int64_t tokens, int64_t top_k, int64_t d,
                   float* dx) override {
    M::DispatchBwd(dx_sorted, slot_of, tokens, top_k, d, dx);
  }
  void CombineFwd(const float* y_sorted, const int32_t* slot_of, const float* topk_weights, int64_t tokens,
                  int64_t top_k, int64_t d, float* out) override {
    M::CombineFwd(y_sorted, slot_of, topk_weights, tokens, top_k, d, out);
  }
  void CombineBwd(const float* dout, const int32_t* slot_of, const float* topk_weights, const float* y_sorted,
                  int64_t tokens, int64_t top_k, int64_t d, float* dy_sorted, float* d_topk_weights) override {
    M::CombineBwd(dout, slot_of, topk_weights, y_sorted, tokens, top_k, d, dy_sorted, d_topk_weights);
  }
  void RouterGradRewrite(const float* da, const float* act, const int32_t* slot_of, const float* topk_weights,
                         int64_t tokens, int64_t top_k, int64_t f, float* d_topk_weights) override {
    M::RouterGradRewrite(da, act, slot_of, topk_weights, tokens, top_k, f, d_topk_weights);
  }

  void CrossEntropyFwd(const float* logits, const int32_t* targets, int64_t tokens, int64_t vocab, float* probs,
                       float* loss) override {
    M::CrossEntropyFwd(logits, targets, tokens, vocab, probs, loss);
  }
  void CrossEntropyBwd(const float* probs, const int32_t* targets, int64_t tokens, int64_t vocab, float scale,
                       float* dlogits) override {
    M::CrossEntropyBwd(probs, targets, tokens, vocab, scale, dlogits);
  }
  void CrossEntropyPartialStats(const float* logits, const int32_t* targets, int64_t tokens, int64_t vocab,
                                float* stats) override {
    M::CrossEntropyPartialStats(logits, targets, tokens, vocab, stats);
  }
  void CrossEntropyPartialProbs(const float* logits, const float* stats, int64_t tokens, int64_t vocab,
                                float* probs) override {
    M::CrossEntropyPartialProbs(logits, stats, tokens, vocab, probs);
  }

  void AttnResFwd(const float* const* sources, int64_t n, const float* w, const float* gamma, int64_t tokens,
                  int64_t d, float eps, float* h, float* weights) override {
    M::AttnResFwd(sources, n, w, gamma, tokens, d, eps, h, weights);
  }
  void AttnResBwd(const float* const* sources, int64_t n, const float* w, const float* gamma, const float* dh,
                  int64_t tokens, int64_t d, float eps, float* const* dsources, float* dw, float* dgamma,
                  float* workspace) override {
    M::AttnResBwd(sources, n, w, gamma, dh, tokens, d, eps, dsources, dw, dgamma, workspace);
  }

  void KdaFwd(const float* q, const float* k, const float* v, const float* g, const float* beta, const float* a_log,
              const float* dt_bias, const KdaShape& shape, float* o, float* states) override {
    ref::KdaFwd(q, k, v, g, beta, a_log, dt_bias, shape, o, states);
  }
  void KdaBwd(const float* q, const float* k, const float* v, const float* g, const float* beta, const float* a_log,
              const float* dt_bias, const float* states, const float* d_o, const KdaShape& shape, float* dq,
              float* dk, float* dv, float* dg, float* dbeta, float* da_log, float* d_dt_bias,
              float* workspace) override {
    ref::KdaBwd(q, k, v, g, beta, a_log, dt_bias, states, d_o, shape, dq, dk, dv, dg, dbeta, da_log, d_dt_bias,
                workspace);
  }
  void ShortConvFwd(const float* x, const float* w, int64_t batch, int64_t seq, int64_t channels, int64_t taps,
                    float* y) override {
    ref::ShortConvFwd(x, w, batch, seq, channels, taps, y);
  }
  void ShortConvBwd(const float* x, const float* w, const float* dy, int64_t batch, int64_t seq, int64_t channels,
                    int64_t taps, float* dx, float* dw) override {
    ref::ShortConvBwd(x, w, dy, batch, seq, channels, taps, dx, dw);
  }
  void SigmoidGateFwd(const float* x, const float* g, int64_t n, float* y) override { ref::SigmoidGateFwd(x, g, n, y); }
  void SigmoidGateBwd(const float* x, const float* g, const float* dy, int64_t n, float* dx, float* dg) override {
    ref::SigmoidGateBwd(x, g, dy, n, dx, dg);
  }
};

}  // namespace

std::unique_ptr<Ops> MakeRefOps() { return std::make_unique<RefOps>(); }

}  // namespace memplan::kernels
