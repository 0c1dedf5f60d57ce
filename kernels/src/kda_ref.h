// Private: the reference math of KDA (Kimi Delta Attention) and of the
// sigmoid output gate, as templates on the scalar type T (float behind
// MakeRefOps, double in the tests' central differences). Semantics are those
// of Ops::KdaFwd/KdaBwd and Ops::SigmoidGateFwd/Bwd in ops.h; sums run in
// increasing index order in T, so results are reproducible bit for bit.
// Unlike ops_ref_impl.h, a head's working state (S and dS, dk x dv, which the
// CUDA kernels keep in shared memory) lives in local vectors; the backward's
// per-token states of a chunk go to the caller's planned workspace.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "memplan/kernels/ops.h"

namespace memplan::kernels::ref {

template <typename T>
T KdaSoftplus(T x) {
  return x > T(20) ? x : std::log1p(std::exp(x));
}
template <typename T>
T KdaSigmoid(T x) {
  return T(1) / (T(1) + std::exp(-x));
}

// One token of one head, the values the recurrence uses: q and k
// L2-normalized (q also scaled by 1/sqrt(dk)), the per-channel decay
// alpha = exp(-exp(a_log) softplus(g + dt_bias)) and beta = sigmoid(beta_raw).
template <typename T>
struct KdaToken {
  std::vector<T> q, k, alpha, log_alpha;
  T qn = 0, kn = 0, beta = 0;

  // dtb: the decay's per-channel bias dt_bias of this head (nullptr: none).
  void Load(const T* qr, const T* kr, const T* gr, const T* dtb, T braw, T a_log, int64_t dk) {
    q.assign(qr, qr + dk);
    k.assign(kr, kr + dk);
    alpha.resize(static_cast<size_t>(dk));
    log_alpha.resize(static_cast<size_t>(dk));
    T sq = 0, sk = 0;
    for (int64_t i = 0; i < dk; ++i) sq += qr[i] * qr[i];
    for (int64_t i = 0; i < dk; ++i) sk += kr[i] * kr[i];
    qn = std::sqrt(sq + T(kKdaNormEps));
    kn = std::sqrt(sk + T(kKdaNormEps));
    const T scale = T(1) / std::sqrt(static_cast<T>(dk));
    const T c = std::exp(a_log);
    for (int64_t i = 0; i < dk; ++i) {
      q[static_cast<size_t>(i)] = qr[i] / qn * scale;
      k[static_cast<size_t>(i)] = kr[i] / kn;
      log_alpha[static_cast<size_t>(i)] = -c * KdaSoftplus(gr[i] + (dtb ? dtb[i] : T(0)));
      alpha[static_cast<size_t>(i)] = std::exp(log_alpha[static_cast<size_t>(i)]);
    }
    beta = KdaSigmoid(braw);
  }
};

// S [dk, dv] row-major. One step: S = (I - beta k k^T) Diag(alpha) S + beta k v^T,
// o = S^T q.
template <typename T>
void KdaStep(const KdaToken<T>& tk, const T* v, int64_t dk, int64_t dv, T* S, T* o) {
  for (int64_t j = 0; j < dv; ++j) {
    T ka = 0;
    for (int64_t i = 0; i < dk; ++i) {
      S[i * dv + j] *= tk.alpha[static_cast<size_t>(i)];
      ka += tk.k[static_cast<size_t>(i)] * S[i * dv + j];
    }
    const T u = tk.beta * (v[j] - ka);
    T acc = 0;
    for (int64_t i = 0; i < dk; ++i) {
      S[i * dv + j] += tk.k[static_cast<size_t>(i)] * u;
      acc += tk.q[static_cast<size_t>(i)] * S[i * dv + j];
    }
    o[j] = acc;
  }
}

// Row of token s of sequence b, head h: q/k/g at (b*seq + s) * heads*dk + h*dk.
struct KdaIndex {
  const KdaShape& sh;
  int64_t QK(int64_t b, int64_t s, int64_t h) const { return ((b * sh.seq + s) * sh.heads + h) * sh.dk; }
  int64_t V(int64_t b, int64_t s, int64_t h) const { return ((b * sh.seq + s) * sh.heads + h) * sh.dv; }
  int64_t Beta(int64_t b, int64_t s, int64_t h) const { return (b * sh.seq + s) * sh.heads + h; }
  int64_t State(int64_t b, int64_t h, int64_t c) const { return ((b * sh.heads + h) * sh.Chunks() + c) * sh.dk * sh.dv; }
  template <typename T>
  const T* DtBias(const T* dt_bias, int64_t h) const { return dt_bias ? dt_bias + h * sh.dk : nullptr; }
};

template <typename T>
void KdaFwd(const T* q, const T* k, const T* v, const T* g, const T* beta, const T* a_log, const T* dt_bias,
            const KdaShape& sh, T* o, T* states) {
  const KdaIndex ix{sh};
  std::vector<T> S(static_cast<size_t>(sh.dk * sh.dv));
  KdaToken<T> tk;
  for (int64_t b = 0; b < sh.batch; ++b) {
    for (int64_t h = 0; h < sh.heads; ++h) {
      std::fill(S.begin(), S.end(), T(0));
      for (int64_t s = 0; s < sh.seq; ++s) {
        if (s % sh.chunk == 0) std::copy(S.begin(), S.end(), states + ix.State(b, h, s / sh.chunk));
        tk.Load(q + ix.QK(b, s, h), k + ix.QK(b, s, h), g + ix.QK(b, s, h), ix.DtBias(dt_bias, h),
                beta[ix.Beta(b, s, h)], a_log[h], sh.dk);
        KdaStep(tk, v + ix.V(b, s, h), sh.dk, sh.dv, S.data(), o + ix.V(b, s, h));
      }
    }
  }
}

// Backward, chunk by chunk from the last: the chunk's states are re-made
// from its saved start (into `work`: chunk x dk x dv, the state before each
// token), then its tokens run backwards carrying dS = dL/dS. Input
// gradients are written; da_log is added into, head by head, batch by batch,
// and d_dt_bias (when dt_bias is given) receives the column sums of dg in
// row order.
template <typename T>
void KdaBwd(const T* q, const T* k, const T* v, const T* g, const T* beta, const T* a_log, const T* dt_bias,
            const T* states, const T* d_o, const KdaShape& sh, T* dq, T* dk, T* dv, T* dg, T* dbeta, T* da_log,
            T* d_dt_bias, T* work) {
  const KdaIndex ix{sh};
  const int64_t DK = sh.dk, DV = sh.dv, n = DK * DV;
  // The workspace as the CUDA kernel lays it out (workspace::KdaBwdBytes):
  // each sequence and head's per-token states of one chunk, then one
  // da_log partial per sequence and head, summed over the sequences in
  // order at the end.
  std::vector<T> local;
  if (work == nullptr) {
    local.resize(static_cast<size_t>(sh.batch * sh.heads * (sh.chunk * n + 1)));
    work = local.data();
  }
  T* const states_base = work;
  T* const da_partial = work + sh.batch * sh.heads * sh.chunk * n;
  std::vector<T> S(static_cast<size_t>(n)), dS(static_cast<size_t>(n)), u(static_cast<size_t>(DV)),
      ka(static_cast<size_t>(DV)), du(static_cast<size_t>(DV)), dka(static_cast<size_t>(DV)),
      dqh(static_cast<size_t>(DK)), dkh(static_cast<size_t>(DK)), dal(static_cast<size_t>(DK)), scratch(static_cast<size_t>(DV));
  KdaToken<T> tk;
  const T scale = T(1) / std::sqrt(static_cast<T>(DK));
  for (int64_t b = 0; b < sh.batch; ++b) {
    for (int64_t h = 0; h < sh.heads; ++h) {
      work = states_base + (b * sh.heads + h) * sh.chunk * n;
      std::fill(dS.begin(), dS.end(), T(0));
      const T c = std::exp(a_log[h]);
      T da = 0;
      for (int64_t ch = sh.Chunks() - 1; ch >= 0; --ch) {
        const int64_t s0 = ch * sh.chunk, s1 = std::min(sh.seq, s0 + sh.chunk);
        std::copy(states + ix.State(b, h, ch), states + ix.State(b, h, ch) + n, S.begin());
        for (int64_t s = s0; s < s1; ++s) {
          std::copy(S.begin(), S.end(), work + (s - s0) * n);
          tk.Load(q + ix.QK(b, s, h), k + ix.QK(b, s, h), g + ix.QK(b, s, h), ix.DtBias(dt_bias, h),
                  beta[ix.Beta(b, s, h)], a_log[h], DK);
          KdaStep(tk, v + ix.V(b, s, h), DK, DV, S.data(), scratch.data());
        }
        for (int64_t s = s1 - 1; s >= s0; --s) {
          const T* Sp = work + (s - s0) * n;  // the state before token s
          const T* vr = v + ix.V(b, s, h);
          const T* dor = d_o + ix.V(b, s, h);
          tk.Load(q + ix.QK(b, s, h), k + ix.QK(b, s, h), g + ix.QK(b, s, h), ix.DtBias(dt_bias, h),
                  beta[ix.Beta(b, s, h)], a_log[h], DK);
          const auto& qh = tk.q;
          const auto& kh = tk.k;
          const auto& al = tk.alpha;
          // Forward quantities of this token: A = Diag(alpha) Sp, ka = A^T k, u = beta (v - ka).
          for (int64_t j = 0; j < DV; ++j) {
            T acc = 0;
            for (int64_t i = 0; i < DK; ++i) acc += kh[static_cast<size_t>(i)] * (al[static_cast<size_t>(i)] * Sp[i * DV + j]);
            ka[static_cast<size_t>(j)] = acc;
            u[static_cast<size_t>(j)] = tk.beta * (vr[j] - acc);
          }
          // o = S_t^T q: dS += q do^T, dq = S_t do.
          for (int64_t i = 0; i < DK; ++i) {
            T acc = 0;
            for (int64_t j = 0; j < DV; ++j) {
              const T st = al[static_cast<size_t>(i)] * Sp[i * DV + j] + kh[static_cast<size_t>(i)] * u[static_cast<size_t>(j)];
              acc += st * dor[j];
              dS[static_cast<size_t>(i * DV + j)] += qh[static_cast<size_t>(i)] * dor[j];
            }
            dqh[static_cast<size_t>(i)] = acc;
          }
          // S_t = A + k u^T: du = dS^T k; dk = dS u.
          T dbeta_s = 0;
          for (int64_t j = 0; j < DV; ++j) {
            T acc = 0;
            for (int64_t i = 0; i < DK; ++i) acc += dS[static_cast<size_t>(i * DV + j)] * kh[static_cast<size_t>(i)];
            du[static_cast<size_t>(j)] = acc;
            dbeta_s += acc * (vr[j] - ka[static_cast<size_t>(j)]);
            dv[ix.V(b, s, h) + j] = tk.beta * acc;
            dka[static_cast<size_t>(j)] = -tk.beta * acc;
          }
          for (int64_t i = 0; i < DK; ++i) {
            T acc = 0, acc_al = 0;
            for (int64_t j = 0; j < DV; ++j) {
              const T ds = dS[static_cast<size_t>(i * DV + j)];
              const T a = al[static_cast<size_t>(i)] * Sp[i * DV + j];
              acc += ds * u[static_cast<size_t>(j)] + dka[static_cast<size_t>(j)] * a;
              // dA = dS + k dka^T; dalpha_i = sum_j dA_ij Sp_ij.
              acc_al += (ds + kh[static_cast<size_t>(i)] * dka[static_cast<size_t>(j)]) * Sp[i * DV + j];
            }
            dkh[static_cast<size_t>(i)] = acc;
            dal[static_cast<size_t>(i)] = acc_al;
          }
          // dS_{t-1} = Diag(alpha) dA.
          for (int64_t i = 0; i < DK; ++i) {
            for (int64_t j = 0; j < DV; ++j) {
              T& ds = dS[static_cast<size_t>(i * DV + j)];
              ds = al[static_cast<size_t>(i)] * (ds + kh[static_cast<size_t>(i)] * dka[static_cast<size_t>(j)]);
            }
          }
          // Through the normalizations and the gates.
          const T* qr = q + ix.QK(b, s, h);
          const T* gr = g + ix.QK(b, s, h);
          T zq = 0, zk = 0;  // z . dz
          for (int64_t i = 0; i < DK; ++i) {
            zq += (qr[i] / tk.qn) * (dqh[static_cast<size_t>(i)] * scale);
            zk += kh[static_cast<size_t>(i)] * dkh[static_cast<size_t>(i)];
          }
          for (int64_t i = 0; i < DK; ++i) {
            dq[ix.QK(b, s, h) + i] = (dqh[static_cast<size_t>(i)] * scale - (qr[i] / tk.qn) * zq) / tk.qn;
            dk[ix.QK(b, s, h) + i] = (dkh[static_cast<size_t>(i)] - kh[static_cast<size_t>(i)] * zk) / tk.kn;
            const T dl = dal[static_cast<size_t>(i)] * al[static_cast<size_t>(i)];  // d log alpha
            dg[ix.QK(b, s, h) + i] = dl * (-c) * KdaSigmoid(gr[i] + (dt_bias ? dt_bias[h * DK + i] : T(0)));
            da += dl * tk.log_alpha[static_cast<size_t>(i)];
          }
          dbeta[ix.Beta(b, s, h)] = dbeta_s * tk.beta * (T(1) - tk.beta);
        }
      }
      da_partial[b * sh.heads + h] = da;
    }
  }
  for (int64_t b = 0; b < sh.batch; ++b) {
    for (int64_t h = 0; h < sh.heads; ++h) da_log[h] += da_partial[b * sh.heads + h];
  }
  if (dt_bias != nullptr && d_dt_bias != nullptr) {
    const int64_t width = sh.heads * DK;
    for (int64_t r = 0; r < sh.batch * sh.seq; ++r) {
      for (int64_t c = 0; c < width; ++c) d_dt_bias[c] += dg[r * width + c];
    }
  }
}

// y = x * sigmoid(g); backward dx = dy * sigmoid(g), dg = dy * x * s (1 - s).
template <typename T>
void SigmoidGateFwd(const T* x, const T* g, int64_t n, T* y) {
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * KdaSigmoid(g[i]);
}
template <typename T>
void SigmoidGateBwd(const T* x, const T* g, const T* dy, int64_t n, T* dx, T* dg) {
  for (int64_t i = 0; i < n; ++i) {
    const T s = KdaSigmoid(g[i]);
    dx[i] = dy[i] * s;
    dg[i] = dy[i] * x[i] * (s * (T(1) - s));
  }
}

// KDA's short convolution: causal, depthwise over the sequence, then SiLU.
// x, y [batch * seq, channels]; w [taps, channels]:
//   pre[b,s,c] = sum_j w[j,c] x[b, s - taps + 1 + j, c] (zero before s = 0),
//   y = pre * sigmoid(pre).
template <typename T>
T ShortConvPre(const T* x, const T* w, int64_t seq, int64_t channels, int64_t taps, int64_t b, int64_t s,
               int64_t c) {
  T acc = 0;
  for (int64_t j = 0; j < taps; ++j) {
    const int64_t t = s - taps + 1 + j;
    if (t >= 0) acc += w[j * channels + c] * x[(b * seq + t) * channels + c];
  }
  return acc;
}
template <typename T>
void ShortConvFwd(const T* x, const T* w, int64_t batch, int64_t seq, int64_t channels, int64_t taps, T* y) {
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t s = 0; s < seq; ++s) {
      for (int64_t c = 0; c < channels; ++c) {
        const T pre = ShortConvPre(x, w, seq, channels, taps, b, s, c);
        y[(b * seq + s) * channels + c] = pre * KdaSigmoid(pre);
      }
    }
  }
}
// Backward, keeping nothing between its passes (the CUDA kernels' order):
// dpre = dy * silu'(pre), pre re-made from x wherever it is read;
// dw[j,c] += sum over rows in order of dpre[b,s,c] x[b, s - taps + 1 + j, c],
// then dx[b,t,c] = sum_j w[j,c] dpre[b, t + taps - 1 - j, c] (written).
template <typename T>
T ShortConvDpre(const T* x, const T* w, const T* dy, int64_t seq, int64_t channels, int64_t taps, int64_t b,
                int64_t s, int64_t c) {
  const T pre = ShortConvPre(x, w, seq, channels, taps, b, s, c);
  const T sg = KdaSigmoid(pre);
  return dy[(b * seq + s) * channels + c] * (sg * (T(1) + pre * (T(1) - sg)));
}
template <typename T>
void ShortConvBwd(const T* x, const T* w, const T* dy, int64_t batch, int64_t seq, int64_t channels, int64_t taps,
                  T* dx, T* dw) {
  for (int64_t j = 0; j < taps; ++j) {
    for (int64_t c = 0; c < channels; ++c) {
      T acc = 0;
      for (int64_t b = 0; b < batch; ++b) {
        for (int64_t s = 0; s < seq; ++s) {
          const int64_t t = s - taps + 1 + j;
          if (t >= 0) acc += ShortConvDpre(x, w, dy, seq, channels, taps, b, s, c) * x[(b * seq + t) * channels + c];
        }
      }
      dw[j * channels + c] += acc;
    }
  }
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t t = 0; t < seq; ++t) {
      for (int64_t c = 0; c < channels; ++c) {
        T acc = 0;
        for (int64_t j = 0; j < taps; ++j) {
          const int64_t s = t + taps - 1 - j;
          if (s < seq) acc += w[j * channels + c] * ShortConvDpre(x, w, dy, seq, channels, taps, b, s, c);
        }
        dx[(b * seq + t) * channels + c] = acc;
      }
    }
  }
}

}  // namespace memplan::kernels::ref
