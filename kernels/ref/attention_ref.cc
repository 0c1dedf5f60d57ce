// CPU reference attention: standard (probs saved) and flash-style (o and lse
// saved, scores recomputed), causal or not, with GQA. See AttentionMath in
// ops_ref_impl.h for the evaluation order.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "memplan/kernels/ops.h"
#include "ops_ref_impl.h"

namespace memplan::kernels::ref {
namespace {

// Flat offsets of one row in the attention tensors.
class AttnIndex {
 public:
  explicit AttnIndex(const AttentionShape& sh) : sh_(sh), group_(sh.heads / sh.kv_heads) {}

  // Query-side row (q, dq, probs; lse and D with width 1) of (bb, h, i).
  int64_t QRow(int64_t bb, int64_t h, int64_t i) const { return (bb * sh_.heads + h) * sh_.s + i; }
  // Row of o and d_o: QRow, or (bb, i, h) when o_token_major.
  int64_t ORow(int64_t bb, int64_t h, int64_t i) const {
    return sh_.o_token_major ? (bb * sh_.s + i) * sh_.heads + h : QRow(bb, h, i);
  }
  // Key/value row (k, v, dk, dv) of (bb, query head h, j) under GQA.
  int64_t KvRow(int64_t bb, int64_t h, int64_t j) const { return (bb * sh_.kv_heads + h / group_) * sh_.s + j; }
  // Keys visible to query i.
  int64_t KeyEnd(int64_t i) const { return sh_.causal ? i + 1 : sh_.s; }

 private:
  const AttentionShape& sh_;
  int64_t group_;  // query heads per kv head
};

template <typename T>
T Dot(const T* a, const T* b, int64_t n) {
  T s = 0;
  for (int64_t c = 0; c < n; ++c) s += a[c] * b[c];
  return s;
}

}  // namespace

template <typename T>
void AttentionMath<T>::AttentionFwd(const AttentionShape& sh, const T* q, const T* k, const T* v, T* probs, T* o) {
  const AttnIndex ix(sh);
  const T scale = T(sh.scale);
  for (int64_t bb = 0; bb < sh.b; ++bb) {
    for (int64_t h = 0; h < sh.heads; ++h) {
      for (int64_t i = 0; i < sh.s; ++i) {
        const int64_t qr = ix.QRow(bb, h, i);
        const T* qi = q + qr * sh.dqk;
        T* p = probs + qr * sh.s;
        const int64_t jend = ix.KeyEnd(i);
        T mx = -std::numeric_limits<T>::infinity();
        for (int64_t j = 0; j < jend; ++j) {
          p[j] = scale * Dot(qi, k + ix.KvRow(bb, h, j) * sh.dqk, sh.dqk);
          mx = std::max(mx, p[j]);
        }
        T sum = 0;
        for (int64_t j = 0; j < jend; ++j) {
          p[j] = std::exp(p[j] - mx);
          sum += p[j];
        }
        for (int64_t j = 0; j < jend; ++j) p[j] /= sum;
        std::fill(p + jend, p + sh.s, T(0));
        T* oi = o + ix.ORow(bb, h, i) * sh.dv;
        std::fill(oi, oi + sh.dv, T(0));
        for (int64_t j = 0; j < jend; ++j) {
          const T* vj = v + ix.KvRow(bb, h, j) * sh.dv;
          for (int64_t c = 0; c < sh.dv; ++c) oi[c] += p[j] * vj[c];
        }
      }
    }
  }
}

template <typename T>
void AttentionMath<T>::AttentionBwd(const AttentionShape& sh, const T* q, const T* k, const T* v, const T* probs,
                                    const T* d_o, T* dq, T* dk, T* dv, T* workspace) {
  const AttnIndex ix(sh);
  const T scale = T(sh.scale);
  std::fill(dk, dk + sh.b * sh.kv_heads * sh.s * sh.dqk, T(0));
  std::fill(dv, dv + sh.b * sh.kv_heads * sh.s * sh.dv, T(0));
  for (int64_t bb = 0; bb < sh.b; ++bb) {
    for (int64_t h = 0; h < sh.heads; ++h) {
      // ds row i: first dP = dO_i . v_j, then scale * P * (dP - rowsum(dP*P)).
      for (int64_t i = 0; i < sh.s; ++i) {
        const int64_t qr = ix.QRow(bb, h, i);
        const T* p = probs + qr * sh.s;
        const T* doi = d_o + ix.ORow(bb, h, i) * sh.dv;
        T* ds = workspace + qr * sh.s;
        const int64_t jend = ix.KeyEnd(i);
        T rowsum = 0;
        for (int64_t j = 0; j < jend; ++j) {
          ds[j] = Dot(doi, v + ix.KvRow(bb, h, j) * sh.dv, sh.dv);
          rowsum += ds[j] * p[j];
        }
        for (int64_t j = 0; j < jend; ++j) ds[j] = scale * (p[j] * (ds[j] - rowsum));
        std::fill(ds + jend, ds + sh.s, T(0));

        T* dqi = dq + qr * sh.dqk;
        const T* qi = q + qr * sh.dqk;
        std::fill(dqi, dqi + sh.dqk, T(0));
        for (int64_t j = 0; j < jend; ++j) {
          const int64_t kr = ix.KvRow(bb, h, j);
          const T* kj = k + kr * sh.dqk;
          T* dkj = dk + kr * sh.dqk;
          T* dvj = dv + kr * sh.dv;
          for (int64_t c = 0; c < sh.dqk; ++c) dqi[c] += ds[j] * kj[c];
          for (int64_t c = 0; c < sh.dqk; ++c) dkj[c] += ds[j] * qi[c];
          for (int64_t c = 0; c < sh.dv; ++c) dvj[c] += p[j] * doi[c];
        }
      }
    }
  }
}

template <typename T>
void AttentionMath<T>::FlashAttentionFwd(const AttentionShape& sh, const T* q, const T* k, const T* v, T* o,
                                         T* lse) {
  const AttnIndex ix(sh);
  const T scale = T(sh.scale);
  for (int64_t bb = 0; bb < sh.b; ++bb) {
    for (int64_t h = 0; h < sh.heads; ++h) {
      for (int64_t i = 0; i < sh.s; ++i) {
        const int64_t qr = ix.QRow(bb, h, i);
        const T* qi = q + qr * sh.dqk;
        T* oi = o + ix.ORow(bb, h, i) * sh.dv;  // the unnormalized accumulator until the end
        std::fill(oi, oi + sh.dv, T(0));
        T m = -std::numeric_limits<T>::infinity();
        T l = 0;
        const int64_t jend = ix.KeyEnd(i);
        for (int64_t j0 = 0; j0 < jend; j0 += kFlashKeyBlock) {
          const int64_t nb = std::min(kFlashKeyBlock, jend - j0);
          T sc[kFlashKeyBlock];
          T block_max = -std::numeric_limits<T>::infinity();
          for (int64_t jj = 0; jj < nb; ++jj) {
            sc[jj] = scale * Dot(qi, k + ix.KvRow(bb, h, j0 + jj) * sh.dqk, sh.dqk);
            block_max = std::max(block_max, sc[jj]);
          }
          // exp(-inf) = 0 wipes the empty state on the first block.
          const T m_new = std::max(m, block_max);
          const T corr = std::exp(m - m_new);
          l *= corr;
          for (int64_t c = 0; c < sh.dv; ++c) oi[c] *= corr;
          for (int64_t jj = 0; jj < nb; ++jj) {
            const T pj = std::exp(sc[jj] - m_new);
            const T* vj = v + ix.KvRow(bb, h, j0 + jj) * sh.dv;
            l += pj;
            for (int64_t c = 0; c < sh.dv; ++c) oi[c] += pj * vj[c];
          }
          m = m_new;
        }
        for (int64_t c = 0; c < sh.dv; ++c) oi[c] /= l;
        lse[qr] = m + std::log(l);
      }
    }
  }
}

template <typename T>
void AttentionMath<T>::FlashAttentionBwd(const AttentionShape& sh, const T* q, const T* k, const T* v, const T* o,
                                         const T* lse, const T* d_o, T* dq, T* dk, T* dv, T* workspace) {
  const AttnIndex ix(sh);
  const T scale = T(sh.scale);
  T* dsum = workspace;  // D = rowsum(dO * O), one per query row
  for (int64_t bb = 0; bb < sh.b; ++bb) {
    for (int64_t h = 0; h < sh.heads; ++h) {
      for (int64_t i = 0; i < sh.s; ++i) {
        const int64_t orow = ix.ORow(bb, h, i);
        dsum[ix.QRow(bb, h, i)] = Dot(d_o + orow * sh.dv, o + orow * sh.dv, sh.dv);
      }
    }
  }
  std::fill(dk, dk + sh.b * sh.kv_heads * sh.s * sh.dqk, T(0));
  std::fill(dv, dv + sh.b * sh.kv_heads * sh.s * sh.dv, T(0));
  for (int64_t bb = 0; bb < sh.b; ++bb) {
    for (int64_t h = 0; h < sh.heads; ++h) {
      for (int64_t i = 0; i < sh.s; ++i) {
        const int64_t qr = ix.QRow(bb, h, i);
        const T* qi = q + qr * sh.dqk;
        const T* doi = d_o + ix.ORow(bb, h, i) * sh.dv;
        T* dqi = dq + qr * sh.dqk;
        std::fill(dqi, dqi + sh.dqk, T(0));
        const int64_t jend = ix.KeyEnd(i);
        for (int64_t j = 0; j < jend; ++j) {
          const int64_t kr = ix.KvRow(bb, h, j);
          const T* kj = k + kr * sh.dqk;
          const T* vj = v + kr * sh.dv;
          const T p = std::exp(scale * Dot(qi, kj, sh.dqk) - lse[qr]);
          const T ds = scale * (p * (Dot(doi, vj, sh.dv) - dsum[qr]));
          T* dkj = dk + kr * sh.dqk;
          T* dvj = dv + kr * sh.dv;
          for (int64_t c = 0; c < sh.dqk; ++c) dqi[c] += ds * kj[c];
          for (int64_t c = 0; c < sh.dqk; ++c) dkj[c] += ds * qi[c];
          for (int64_t c = 0; c < sh.dv; ++c) dvj[c] += p * doi[c];
        }
      }
    }
  }
}

template struct AttentionMath<float>;
template struct AttentionMath<double>;

}  // namespace memplan::kernels::ref
