// Private: the math of the CPU reference ops (MakeRefOps), written once as
// templates on the scalar type T. The Ops methods run RefMath<float> and
// AttentionMath<float>; the tests run the same code in double to check every
// backward against central finite differences. Both class templates are
// explicitly instantiated for float and double only (RefMath in ops_ref.cc,
// AttentionMath in attention_ref.cc).
//
// Shapes, layouts and semantics are those of the Ops method of the same name
// in ops.h (with T in place of float). What this header adds is the order of
// evaluation, which is fixed:
//   - every sum is a plain loop that starts from 0 and adds the terms in
//     increasing index order, in T (no wider accumulator, no pairwise or
//     parallel reduction), so a result is reproducible bit for bit;
//   - accumulating outputs (weight gradients, dk/dv across GQA heads, the
//     rows a token was dispatched to) receive their terms in the loop order
//     documented on each function.
// Workspaces are typed T* here; the Ops wrappers cast the caller's void*.
// Nothing allocates; every scratch value lives on the stack.
#pragma once

#include <cstdint>

#include "memplan/kernels/ops.h"

namespace memplan::kernels::ref {

// Square output tile of the blocked GEMM (rows and columns of C).
inline constexpr int64_t kGemmTile = 64;
// Keys per block of the flash forward's online softmax.
inline constexpr int64_t kFlashKeyBlock = 64;

template <typename T>
struct RefMath {
  // Blocked over kGemmTile x kGemmTile tiles of C; inside a tile every
  // C[i,j] accumulates op(A)[i,p] * op(B)[p,j] for p = 0..k-1 in order, then
  // C = alpha * acc + beta * C (beta == 0: C is not read, NaNs in it vanish).
  static void Gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, T alpha, const T* a, const T* b,
                   T beta, T* c);
  // Gemm with explicit row strides (lda, ldb, ldc elements between stored
  // rows); same tiles and order. Gemm is GemmLd with the tight strides.
  static void GemmLd(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda,
                     const T* b, int64_t ldb, T beta, T* c, int64_t ldc);
  // One GemmLd per batch entry, in batch order.
  static void GemmStridedBatched(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, T alpha, const T* a,
                                 int64_t lda, int64_t stride_a, const T* b, int64_t ldb, int64_t stride_b, T beta,
                                 T* c, int64_t ldc, int64_t stride_c, int64_t batch);
  // One Gemm per expert (expert order); experts with no rows are skipped
  // (their dw is left as is).
  static void GroupedGemm(const int64_t* offsets, int64_t experts, int64_t k, int64_t n, const T* x, const T* w,
                          T* y);
  static void GroupedGemmBwd(const int64_t* offsets, int64_t experts, int64_t k, int64_t n, const T* x, const T* w,
                             const T* dy, T* dx, T* dw);

  // Two-pass mean and biased variance per row. dgamma/dbeta receive one term
  // per row, rows in order.
  static void LayerNormFwd(const T* x, const T* gamma, const T* beta, int64_t rows, int64_t cols, T eps, T* y);
  static void LayerNormBwd(const T* x, const T* gamma, const T* dy, int64_t rows, int64_t cols, T eps, T* dx,
                           T* dgamma, T* dbeta);
  static void RmsNormFwd(const T* x, const T* gamma, int64_t rows, int64_t cols, T eps, T* y);
  static void RmsNormBwd(const T* x, const T* gamma, const T* dy, int64_t rows, int64_t cols, T eps, T* dx,
                         T* dgamma);

  static void GeluFwd(const T* x, int64_t n, T* y);
  static void GeluBwd(const T* x, const T* dy, int64_t n, T* dx);
  static void SwigluFwd(const T* x, int64_t rows, int64_t f, T* y);
  static void SwigluBwd(const T* x, const T* dy, int64_t rows, int64_t f, T* dx);

  // Kept elements are x / (1 - p) (one division); dropped ones are +0, so
  // p == 1 gives zeros rather than 0/0.
  static void DropoutFwd(const T* x, int64_t n, T p, uint64_t seed, uint64_t offset, T* y, uint8_t* mask,
                         int64_t first = 0);
  static void DropoutBwd(const T* dy, const uint8_t* mask, int64_t n, T p, T* dx);
  static void Add(const T* a, const T* b, int64_t n, T* y);
  static void Accumulate(T* y, const T* x, int64_t n);
  static void Axpby(const T* x, const T* y, int64_t n, T a, T b, T* out);

  // SoftmaxFwd scales the visible entries into y, then runs the shared
  // SoftmaxRow on them in place (the router's and cross-entropy's softmax).
  // SoftmaxBwd's dot is summed in column order. Both may run in place
  // (y == x, dx == dy), which RouterFwd/RouterBwd use.
  static void SoftmaxFwd(const T* x, int64_t rows, int64_t cols, T scale, int64_t causal_seq, T* y, int64_t cp = 1,
                         int64_t cp_rank = 0);
  static void SoftmaxBwd(const T* y, const T* dy, int64_t rows, int64_t cols, T scale, T* dx);
  static void SigmoidFwd(const T* x, int64_t n, T* y);
  static void SigmoidBwd(const T* y, const T* dy, int64_t n, T* dx);

  // Top-k is k passes of a selection in the order (probability descending,
  // expert index ascending), so idx[t] lists the experts best first; the
  // renormalization sums the k weights best first. TopKBwd's sum_j dw_j w_j
  // and S are summed best first too.
  static void TopKFwd(const T* probs, int64_t tokens, int64_t experts, int64_t top_k, bool renormalize,
                      int32_t* idx, T* weights);
  static void TopKBwd(const T* probs, const int32_t* idx, const T* weights, const T* d_weights, int64_t tokens,
                      int64_t experts, int64_t top_k, bool renormalize, T* dprobs);

  // dtable receives dy row by row in token order.
  static void EmbeddingFwd(const int32_t* tokens, const T* table, int64_t n, int64_t d, T* y);
  static void EmbeddingBwd(const int32_t* tokens, const T* dy, int64_t n, int64_t d, T* dtable);

  // cos/sin as stated on SplitShape (double, rounded to T once).
  static void SplitHeadsFwd(const T* qkv, const SplitShape& sh, T* q, T* k, T* v);
  static void MlaSplitFwd(const T* q_lin, const T* kv, const T* k_pe, const MlaShape& sh, T* q, T* k, T* v);
  static void MlaSplitBwd(const T* dq, const T* dk, const T* dv, const MlaShape& sh, T* dq_lin, T* dkv, T* dk_pe);
  static void SplitHeadsBwd(const T* dq, const T* dk, const T* dv, const SplitShape& sh, T* dqkv);

  // The order of ops.h's AdamStep, in T (the library is built with
  // -ffp-contract=off, so nothing is fused).
  static void AdamStep(T* master, const T* grad, T* m, T* v, int64_t n, const AdamConfig& c, int64_t step);
  // sum of double(x_i)^2, i ascending, in double.
  static double SquaredNorm(const T* x, int64_t n);

  // SoftmaxFwd (scale 1, no mask) or SigmoidFwd, then TopKFwd; backward
  // TopKBwd, then SoftmaxBwd (scale 1) or SigmoidBwd in place. Preconditions:
  // 1 <= top_k <= experts, finite logits.
  static void RouterFwd(const T* logits, int64_t tokens, int64_t experts, int64_t top_k, bool sigmoid,
                        bool renormalize, T* probs, int32_t* topk_idx, T* topk_weights);
  static void RouterBwd(const T* probs, const int32_t* topk_idx, const T* topk_weights, const T* d_topk_weights,
                        int64_t tokens, int64_t experts, int64_t top_k, bool sigmoid, bool renormalize, T* dlogits);

  // The sums over a token's k rows (DispatchBwd, CombineFwd) run in sorted
  // row order, i.e. by expert index, not by slot i: the reference has no
  // inverse of slot_of and builds none.
  static void DispatchFwd(const T* x, const int32_t* slot_of, int64_t tokens, int64_t top_k, int64_t d, T* x_sorted);
  static void DispatchBwd(const T* dx_sorted, const int32_t* slot_of, int64_t tokens, int64_t top_k, int64_t d,
                          T* dx);
  static void CombineFwd(const T* y_sorted, const int32_t* slot_of, const T* topk_weights, int64_t tokens,
                         int64_t top_k, int64_t d, T* out);
  // d_topk_weights is written only when y_sorted is non-null.
  static void CombineBwd(const T* dout, const int32_t* slot_of, const T* topk_weights, const T* y_sorted,
                         int64_t tokens, int64_t top_k, int64_t d, T* dy_sorted, T* d_topk_weights);
  static void RouterGradRewrite(const T* da, const T* act, const int32_t* slot_of, const T* topk_weights,
                                int64_t tokens, int64_t top_k, int64_t f, T* d_topk_weights);

  // loss[t] = log(sum_v exp(l_v - max)) - (l_target - max), which equals
  // -log probs[t, target] without underflowing to log(0).
  static void CrossEntropyFwd(const T* logits, const int32_t* targets, int64_t tokens, int64_t vocab, T* probs,
                              T* loss);
  static void CrossEntropyBwd(const T* probs, const int32_t* targets, int64_t tokens, int64_t vocab, T scale,
                              T* dlogits);
  static void CrossEntropyPartialStats(const T* logits, const int32_t* targets, int64_t tokens, int64_t vocab,
                                       T* stats);
  static void CrossEntropyPartialProbs(const T* logits, const T* stats, int64_t tokens, int64_t vocab, T* probs);

  // Source i is [tokens, d] at sources[i]; weights is [tokens, n] (row t:
  // token t's softmax over the n sources). Both directions recompute each
  // source's logit instead of storing n per-token scalars; dsources[i],
  // dw and dgamma receive terms (+=) token by token, source by source.
  static void AttnResFwd(const T* const* sources, int64_t n, const T* w, const T* gamma, int64_t tokens, int64_t d,
                         T eps, T* h, T* weights);
  static void AttnResBwd(const T* const* sources, int64_t n, const T* w, const T* gamma, const T* dh, int64_t tokens,
                         int64_t d, T eps, T* const* dsources, T* dw, T* dgamma,
                         T* partial = nullptr);
};

// Scores are scale * (q . k) with the dot product summed over dqk in order.
// sh.o_token_major only moves the rows of o and d_o; the arithmetic is the
// same, so the two layouts give the same bits up to that transpose.
// Backward ops overwrite dq, dk, dv; dk/dv sum their terms head by head
// (ascending h within the GQA group), then query by query.
// Preconditions: heads % kv_heads == 0, s >= 1.
template <typename T>
struct AttentionMath {
  static void AttentionFwd(const AttentionShape& sh, const T* q, const T* k, const T* v, T* probs, T* o);
  // workspace: b*heads*s*s values; holds scale * P * (dP - rowsum(dP * P)),
  // the gradient of the unscaled dot products.
  static void AttentionBwd(const AttentionShape& sh, const T* q, const T* k, const T* v, const T* probs,
                           const T* d_o, T* dq, T* dk, T* dv, T* workspace);
  // Online softmax over blocks of kFlashKeyBlock keys (fully masked blocks
  // are skipped); o = acc / l, lse = m + log(l).
  static void FlashAttentionFwd(const AttentionShape& sh, const T* q, const T* k, const T* v, T* o, T* lse);
  // workspace: b*heads*s values; holds D = rowsum(dO * O). P is recomputed as
  // exp(scale * q.k - lse).
  static void FlashAttentionBwd(const AttentionShape& sh, const T* q, const T* k, const T* v, const T* o,
                                const T* lse, const T* d_o, T* dq, T* dk, T* dv, T* workspace);
};

// Counting sort of the flat (token, slot) indices by expert; stable, so each
// expert's rows are in increasing t*k+i. Preconditions: every index in
// [0, experts).
void DispatchPlan(const int32_t* topk_idx, int64_t tokens, int64_t top_k, int64_t experts, int32_t* slot_of,
                  int64_t* offsets);

extern template struct RefMath<float>;
extern template struct RefMath<double>;
extern template struct AttentionMath<float>;
extern template struct AttentionMath<double>;

}  // namespace memplan::kernels::ref
