// The training ops of memplan's templates, behind one interface that both
// runtime backends call: `MakeRefOps()` (CPU references, kernels/ref) and
// `MakeCudaOps()` (kernels/cuda, declared in ops_cuda.h).
//
// Conventions
//   - Every tensor is a row-major fp32 array (masks are uint8, indices
//     int32). Shapes are given in elements; "T" is tokens (rows), "d" a
//     feature width.
//   - Ops never allocate. Callers pass outputs and, where an op needs one, a
//     workspace of at least the bytes the matching *WorkspaceBytes() formula
//     returns (the planner sizes op workspaces with the same formulas).
//   - Backward ops *overwrite* their input-gradient outputs and *accumulate*
//     (+=) into weight gradients, as autograd engines do.
//   - Pointers are host memory for the reference ops and device memory for
//     the CUDA ops; CUDA ops are asynchronous on the stream they were made
//     with.
//   - The CPU references reduce in a fixed order, so their results are
//     reproducible bit for bit.
//
// The exact math (epsilons, GELU form, attention scaling and masking, RNG) is
// stated on each function; docs/kernels.md repeats it for other frameworks.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>

namespace memplan::kernels {

// Counter-based, stateless RNG shared by both backends: the uniform in
// [0, 1) for element `index` of a draw keyed by (seed, offset) is
//   u = (SplitMix64(seed ^ SplitMix64(offset + index)) >> 40) * 2^-24.
// Dropout keeps an element when u >= p. Replaying (seed, offset)
// regenerates the same mask, so recompute reproduces it exactly.
uint64_t SplitMix64(uint64_t x);
float Uniform01(uint64_t seed, uint64_t offset, uint64_t index);

// Workspace formulas (bytes), shared with the planner.
int64_t AttentionBwdWorkspaceBytes(int64_t b, int64_t heads, int64_t s);       // standard
int64_t FlashAttentionBwdWorkspaceBytes(int64_t b, int64_t heads, int64_t s);  // D = rowsum(dO * O)
int64_t GemmWorkspaceBytes();                                                  // cuBLAS workspace
int64_t KernelScratchBytes();  // offsets staging + norm partials + one result granule

// Attention shapes: q [b, heads, s, dqk], k [b, kv_heads, s, dqk],
// v [b, kv_heads, s, dv], o [b, heads, s, dv]; head h reads kv head
// h / (heads / kv_heads) (GQA). Scores are scale * q.k, with the causal mask
// (key j > query i gets -inf) when `causal`. With `o_token_major`, o and d_o
// (standard and flash, forward and backward) are [b, s, heads, dv] instead
// (row = token: [b*s, heads*dv], ready for the output projection); q, k, v,
// probs and lse [b, heads, s] keep their layouts.
struct AttentionShape {
  int64_t b = 1, heads = 1, kv_heads = 1, s = 1, dqk = 1, dv = 1;
  float scale = 1.f;
  bool causal = true;
  bool o_token_major = false;
};

// The fused QKV projection's output and the heads attention reads.
// qkv is [b*s, (heads + 2*kv_heads) * head_dim], row = batch * s + position,
// columns [q heads | k heads | v heads], each head head_dim wide.
// q is [b, heads, s, head_dim]; k and v are [b, kv_heads, s, head_dim].
// With `rope`, q and k are rotated (rotate-half / GPT-NeoX form): for
// i < half = head_dim / 2, at position pos,
//   angle = pos * rope_theta^(-2i / head_dim)
//   (x_i, x_{i+half}) -> (x_i cos - x_{i+half} sin, x_{i+half} cos + x_i sin).
// cos and sin are evaluated in double and rounded to float once:
//   angle = double(pos) * std::pow(double(rope_theta), -double(2 i) / double(head_dim)).
// Then, in float without fused multiply-adds: out_i = x_i*c - x_{i+half}*s,
// out_{i+half} = x_{i+half}*c + x_i*s (each product rounded, then the sum).
// Preconditions: heads, kv_heads, head_dim >= 1 (b or s 0: nothing to do);
// head_dim even when rope.
struct SplitShape {
  int64_t b = 1, s = 1, heads = 1, kv_heads = 1, head_dim = 1;
  bool rope = false;
  float rope_theta = 10000.f;
  // Context parallelism: the rows are this rank's two load-balanced chunks
  // of each sequence, rotated at their positions in the whole sequence
  // (CpPosition).
  int64_t cp = 1, cp_rank = 0;
};

// Context parallelism's load-balanced split (Megatron's): a sequence of 2 cp
// chunks of s / 2, rank r holding chunks r and 2 cp - 1 - r back to back in
// its s local positions. The position in the whole sequence of local
// position `pos`.
constexpr int64_t CpPosition(int64_t pos, int64_t s, int64_t cp, int64_t cp_rank) {
  if (cp <= 1) return pos;
  const int64_t c = s / 2;
  return pos < c ? cp_rank * c + pos : (2 * cp - 1 - cp_rank) * c + (pos - c);
}

// MLA heads (DeepSeek-V2/V3 multi-head latent attention), T = b*s tokens,
// row = batch * s + position:
//   q_lin [T, heads*(nope+rope)], kv [T, heads*(nope+v)], k_pe [T, rope] ->
//   q [b, heads, s, nope+rope] = [q_nope | RoPE(q_rope)],
//   k [b, heads, s, nope+rope] = [k_nope | RoPE(k_pe)] (k_pe shared by every head),
//   v [b, heads, s, v].
// RoPE is SplitShape's on the rope part (its head_dim = rope in the angle).
// Preconditions: heads, v >= 1; rope even.
struct MlaShape {
  int64_t b = 1, s = 1, heads = 1, nope = 0, rope = 0, v = 1;
  float rope_theta = 10000.f;
  int64_t cp = 1, cp_rank = 0;  // as SplitShape's
};

// AdamW hyperparameters (AdamStep).
struct AdamConfig {
  float lr = 1e-3f, beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, weight_decay = 0.f;
};

// The bias corrections of AdamStep, computed on the host by both backends:
// 1 - beta^step evaluated in double, rounded to float once.
float AdamBiasCorrection(float beta, int64_t step);

// One fp32 to bf16, round to nearest even (every NaN to the canonical
// 0x7FFF, as CUDA's __float2bfloat16_rn), and back (exact).
inline uint16_t FloatToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FFF;
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float Bf16ToFloat(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// KDA shapes: `batch` sequences of `seq` tokens (row r = b * seq + s),
// `heads` heads of key width dk and value width dv, the state materialized
// every `chunk` tokens.
struct KdaShape {
  int64_t batch = 0, seq = 0, heads = 0, dk = 0, dv = 0, chunk = 0;
  int64_t Chunks() const { return chunk > 0 ? (seq + chunk - 1) / chunk : 0; }
};
// eps inside KDA's L2 norms of q and k: ||x|| = sqrt(sum x^2 + eps).
inline constexpr double kKdaNormEps = 1e-6;

class Ops {
 public:
  virtual ~Ops() = default;

  // C[m,n] = alpha * op(A) * op(B) + beta * C; op(X) = X or X^T (row-major).
  // A is [m,k] (or [k,m] when trans_a), B is [k,n] (or [n,k] when trans_b).
  virtual void Gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                    const float* b, float beta, float* c, void* workspace) = 0;

  // For i in [0, batch): C_i = alpha * op(A_i) * op(B_i) + beta * C_i, the
  // Gemm above on sub-matrices: A_i starts at a + i * stride_a and has row
  // stride lda (elements between consecutive stored rows; lda >= k, or >= m
  // when trans_a), likewise B_i (ldb >= n, or >= k when trans_b) and C_i
  // (ldc >= n). Strides may be 0 for A and B (one operand for every entry);
  // the C_i must not overlap. beta == 0: C is not read; k == 0: C = beta * C.
  // Elements of C between rows (columns n..ldc-1) are left as they are.
  virtual void GemmStridedBatched(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                                  const float* a, int64_t lda, int64_t stride_a, const float* b, int64_t ldb,
                                  int64_t stride_b, float beta, float* c, int64_t ldc, int64_t stride_c,
                                  int64_t batch, void* workspace) = 0;

  // Experts: rows [offsets[e], offsets[e+1]) of x [T, k] (tokens sorted by
  // expert) times w[e] ([E, k, n]) into y [T, n]. offsets has E+1 entries
  // (host memory for both backends).
  virtual void GroupedGemm(const int64_t* offsets, int64_t experts, int64_t k, int64_t n, const float* x,
                           const float* w, float* y, void* workspace) = 0;
  // dx = dy * w[e]^T (overwrite); dw[e] += x^T * dy (accumulate).
  virtual void GroupedGemmBwd(const int64_t* offsets, int64_t experts, int64_t k, int64_t n, const float* x,
                              const float* w, const float* dy, float* dx, float* dw, void* workspace) = 0;

  // LayerNorm over the last dim: y = (x - mean) / sqrt(var + eps) * gamma + beta
  // (biased variance). Backward recomputes mean and rstd from x.
  virtual void LayerNormFwd(const float* x, const float* gamma, const float* beta, int64_t rows, int64_t cols,
                            float eps, float* y) = 0;
  virtual void LayerNormBwd(const float* x, const float* gamma, const float* dy, int64_t rows, int64_t cols,
                            float eps, float* dx, float* dgamma, float* dbeta) = 0;
  // RMSNorm: y = x / sqrt(mean(x^2) + eps) * gamma.
  virtual void RmsNormFwd(const float* x, const float* gamma, int64_t rows, int64_t cols, float eps, float* y) = 0;
  virtual void RmsNormBwd(const float* x, const float* gamma, const float* dy, int64_t rows, int64_t cols, float eps,
                          float* dx, float* dgamma) = 0;

  // GELU, tanh form: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
  virtual void GeluFwd(const float* x, int64_t n, float* y) = 0;
  virtual void GeluBwd(const float* x, const float* dy, int64_t n, float* dx) = 0;
  // SwiGLU on x [rows, 2f] = [gate | up]: y [rows, f] = silu(gate) * up.
  virtual void SwigluFwd(const float* x, int64_t rows, int64_t f, float* y) = 0;
  virtual void SwigluBwd(const float* x, const float* dy, int64_t rows, int64_t f, float* dx) = 0;

  // Dropout with probability p: mask[i] = (Uniform01(seed, offset, first +
  // i) >= p), y = x * mask / (1 - p). Backward: dx = dy * mask / (1 - p).
  // `first`: the index of x[0] in the whole tensor, when x is a slice of it
  // (tensor parallelism: a rank's part draws the whole tensor's masks).
  virtual void DropoutFwd(const float* x, int64_t n, float p, uint64_t seed, uint64_t offset, float* y,
                          uint8_t* mask, int64_t first = 0) = 0;
  virtual void DropoutBwd(const float* dy, const uint8_t* mask, int64_t n, float p, float* dx) = 0;

  // y = a + b (residual add; its backward is the identity on both inputs).
  virtual void Add(const float* a, const float* b, int64_t n, float* y) = 0;
  // y += x (gradient accumulation; y and x may not overlap unless equal).
  virtual void Accumulate(float* y, const float* x, int64_t n) = 0;
  // out = a * x + b * y, each product and the sum rounded to fp32 (no fused
  // multiply-add: bit-identical on both backends); y may be null (out = a * x).
  // out may equal x; it must not otherwise overlap x or y. (Muon's updates.)
  virtual void Axpby(const float* x, const float* y, int64_t n, float a, float b, float* out) = 0;

  // Row softmax of x [rows, cols]: y = softmax(scale * x) per row, as
  // v_j = scale * x_j (rounded), m = max_j v_j, e_j = exp(v_j - m),
  // y_j = e_j / sum_j e_j. When causal_seq > 0, row r is query position
  // i = r % causal_seq and columns j > i are masked: left out of the max and
  // the sum, and y_j = 0 exactly (scores [b, heads, s, s] use causal_seq = s).
  // Context parallelism: the rows are rank cp_rank's chunks (CpPosition) and
  // i their position in the whole sequence (cols = the whole sequence).
  virtual void SoftmaxFwd(const float* x, int64_t rows, int64_t cols, float scale, int64_t causal_seq, float* y,
                          int64_t cp = 1, int64_t cp_rank = 0) = 0;
  // dx = scale * (y * (dy - dot)), dot = sum_j dy_j * y_j per row
  // (overwrite). Masked entries have y = 0, so their dx is 0.
  virtual void SoftmaxBwd(const float* y, const float* dy, int64_t rows, int64_t cols, float scale, float* dx) = 0;
  // y = 1 / (1 + exp(-x)); backward dx = dy * (y * (1 - y)) from the output.
  virtual void SigmoidFwd(const float* x, int64_t n, float* y) = 0;
  virtual void SigmoidBwd(const float* y, const float* dy, int64_t n, float* dx) = 0;

  // The router's selection on probs [T, E] (RouterFwd without the softmax /
  // sigmoid): idx [T, k] = the k experts with the largest probability, best
  // first, ties to the lower expert index; weights [T, k] = the selected
  // probabilities, divided by their sum (summed best first) when
  // `renormalize`. Preconditions: 1 <= top_k <= experts, no NaN.
  virtual void TopKFwd(const float* probs, int64_t tokens, int64_t experts, int64_t top_k, bool renormalize,
                       int32_t* idx, float* weights) = 0;
  // dprobs [T, E] (overwrite): 0 off the selection; on expert idx[t,i]
  // d_weights[t,i], or with renormalization (w_i = p_i / S, S = sum_sel p)
  // (d_weights_i - sum_j d_weights_j w_j) / S.
  virtual void TopKBwd(const float* probs, const int32_t* idx, const float* weights, const float* d_weights,
                       int64_t tokens, int64_t experts, int64_t top_k, bool renormalize, float* dprobs) = 0;

  // Token embedding: y[t] = table[tokens[t]] (n tokens, rows of d); a
  // negative token is a row another rank holds (vocabulary-parallel
  // embedding): y[t] = 0.
  virtual void EmbeddingFwd(const int32_t* tokens, const float* table, int64_t n, int64_t d, float* y) = 0;
  // dtable[tokens[t]] += dy[t] (accumulate; negative tokens skipped).
  // Deterministic: every element of dtable receives its tokens' terms one by
  // one in increasing t, so both backends give the same bits.
  // Preconditions: tokens index table's rows or are negative.
  virtual void EmbeddingBwd(const int32_t* tokens, const float* dy, int64_t n, int64_t d, float* dtable) = 0;

  // qkv -> q, k, v (with RoPE on q and k when sh.rope); see SplitShape.
  virtual void SplitHeadsFwd(const float* qkv, const SplitShape& sh, float* q, float* k, float* v) = 0;
  // The adjoint: dqkv (overwrite) from dq, dk, dv; with rope, dq and dk are
  // rotated back: dx_i = dy_i*c + dy_{i+half}*s, dx_{i+half} =
  // dy_{i+half}*c - dy_i*s (same float evaluation rules as the forward).
  // MLA heads (MlaShape). Backward overwrites dq_lin and dkv, and dk_pe with
  // the sum over heads, in head order, of each head's rotated-back gradient.
  virtual void MlaSplitFwd(const float* q_lin, const float* kv, const float* k_pe, const MlaShape& sh, float* q,
                           float* k, float* v) = 0;
  virtual void MlaSplitBwd(const float* dq, const float* dk, const float* dv, const MlaShape& sh, float* dq_lin,
                           float* dkv, float* dk_pe) = 0;
  virtual void SplitHeadsBwd(const float* dq, const float* dk, const float* dv, const SplitShape& sh,
                             float* dqkv) = 0;

  // One AdamW step (step >= 1) on n fp32 parameters, in place on master, m
  // and v. With bc1 = AdamBiasCorrection(beta1, step), bc2 likewise, every
  // element is, in this order, each operation one IEEE fp32 rounding (no
  // fused multiply-add), so both backends give the same bits:
  //   m      = beta1 * m + (1 - beta1) * g             (1 - beta1 rounded first)
  //   v      = beta2 * v + ((1 - beta2) * g) * g
  //   mhat   = m / bc1
  //   vhat   = v / bc2
  //   u      = mhat / (sqrt(vhat) + eps) + weight_decay * master
  //   master = master - lr * u
  virtual void AdamStep(float* master, const float* grad, float* m, float* v, int64_t n, const AdamConfig& c,
                        int64_t step) = 0;
  // *out = sum_i double(x_i)^2. out is host memory for the reference
  // (summed sequentially in double) and device memory for CUDA (a fixed
  // two-level reduction in double: bit-identical run to run, equal to the
  // reference up to summation order).
  virtual void SquaredNorm(const float* x, int64_t n, double* out) = 0;
  // Copy bytes from src to dst (no overlap; device to device for CUDA);
  // Zero sets bytes to 0.
  virtual void Copy(void* dst, const void* src, int64_t bytes) = 0;
  virtual void Zero(void* dst, int64_t bytes) = 0;
  // bf16 storage (bit patterns, the upper half of an fp32): widening is
  // exact; rounding is to nearest even, as CUDA's __float2bfloat16_rn
  // (FloatToBf16). y may not overlap x.
  virtual void WidenBf16(const uint16_t* x, int64_t n, float* y) = 0;
  virtual void RoundToBf16(const float* x, int64_t n, uint16_t* y) = 0;

  // Standard attention: saves probs [b, heads, s, s] (softmax of the masked,
  // scaled scores) and writes o. Backward uses probs; `workspace` holds the
  // score gradients (AttentionBwdWorkspaceBytes).
  virtual void AttentionFwd(const AttentionShape& sh, const float* q, const float* k, const float* v, float* probs,
                            float* o) = 0;
  virtual void AttentionBwd(const AttentionShape& sh, const float* q, const float* k, const float* v,
                            const float* probs, const float* d_o, float* dq, float* dk, float* dv,
                            void* workspace) = 0;
  // Flash-style attention: no s x s tensor is saved; o and the log-sum-exp
  // lse [b, heads, s] (natural log of the row sum of exp(scores)) are.
  // Backward recomputes the scores tile by tile; `workspace` holds
  // D = rowsum(dO * O) (FlashAttentionBwdWorkspaceBytes). dk, dv are
  // overwritten (summed over the heads that share a kv head).
  virtual void FlashAttentionFwd(const AttentionShape& sh, const float* q, const float* k, const float* v, float* o,
                                 float* lse) = 0;
  virtual void FlashAttentionBwd(const AttentionShape& sh, const float* q, const float* k, const float* v,
                                 const float* o, const float* lse, const float* d_o, float* dq, float* dk, float* dv,
                                 void* workspace) = 0;

  // Router over logits [T, E]: softmax (row-wise) or sigmoid, then top-k by
  // probability (ties: lower expert index first), weights = the selected
  // probabilities, renormalized to sum to 1 when `renormalize`. Equal to
  // SoftmaxFwd (scale 1, no mask) or SigmoidFwd, then TopKFwd; RouterBwd to
  // TopKBwd, then SoftmaxBwd (scale 1) or SigmoidBwd.
  virtual void RouterFwd(const float* logits, int64_t tokens, int64_t experts, int64_t top_k, bool sigmoid,
                         bool renormalize, float* probs, int32_t* topk_idx, float* topk_weights) = 0;
  // From the gradient of the top-k weights to the logits (through the
  // renormalization and the softmax/sigmoid). dlogits is overwritten.
  virtual void RouterBwd(const float* probs, const int32_t* topk_idx, const float* topk_weights,
                         const float* d_topk_weights, int64_t tokens, int64_t experts, int64_t top_k, bool sigmoid,
                         bool renormalize, float* dlogits) = 0;

  // Dispatch: stable sort of the T*k (token, slot) pairs by expert.
  // slot_of[j] = the flat index t*k + i placed at sorted row j; offsets
  // [E+1] (host memory) delimit each expert's rows. Then
  // x_sorted[j] = x[slot_of[j] / k].
  virtual void DispatchPlan(const int32_t* topk_idx, int64_t tokens, int64_t top_k, int64_t experts,
                            int32_t* slot_of, int64_t* offsets) = 0;
  virtual void DispatchFwd(const float* x, const int32_t* slot_of, int64_t tokens, int64_t top_k, int64_t d,
                           float* x_sorted) = 0;
  // dx[t] = sum over the token's k sorted rows of dx_sorted (overwrite).
  virtual void DispatchBwd(const float* dx_sorted, const int32_t* slot_of, int64_t tokens, int64_t top_k, int64_t d,
                           float* dx) = 0;
  // Combine: out[t] = sum_i topk_weights[t, i] * y_sorted[row of (t, i)].
  virtual void CombineFwd(const float* y_sorted, const int32_t* slot_of, const float* topk_weights, int64_t tokens,
                          int64_t top_k, int64_t d, float* out) = 0;
  // dy_sorted[row of (t,i)] = w[t,i] * dout[t]; when y_sorted is given,
  // d_topk_weights[t,i] = <dout[t], y_sorted[row]> (the native router
  // gradient, which needs the expert output saved).
  virtual void CombineBwd(const float* dout, const int32_t* slot_of, const float* topk_weights, const float* y_sorted,
                          int64_t tokens, int64_t top_k, int64_t d, float* dy_sorted, float* d_topk_weights) = 0;
  // SonicMoE rewrite: d_topk_weights[t,i] = <dA_unweighted[row], act[row]>,
  // where dA_unweighted[row] = dout[t] * W2_e^T (the fc2 backward before the
  // router weight) and act = A, the expert activation. No expert output needed.
  // With `topk_weights` (else nullptr), `da` is instead the weighted
  // gradient w[t,i] * dA_unweighted[row] (the fc2 backward of the weighted
  // rows, which the weight gradients need anyway) and each dot product is
  // divided by its weight (0 where the weight is 0).
  virtual void RouterGradRewrite(const float* da, const float* act, const int32_t* slot_of,
                                 const float* topk_weights, int64_t tokens, int64_t top_k, int64_t f,
                                 float* d_topk_weights) = 0;

  // Cross-entropy over logits [T, V] with int32 targets: probs = softmax
  // (saved), loss[t] = -log probs[t, target]. Backward: dlogits = (probs -
  // onehot) * scale (scale = 1/T for a mean loss).
  virtual void CrossEntropyFwd(const float* logits, const int32_t* targets, int64_t tokens, int64_t vocab,
                               float* probs, float* loss) = 0;
  // A negative target is a column another rank holds (no one-hot here).
  virtual void CrossEntropyBwd(const float* probs, const int32_t* targets, int64_t tokens, int64_t vocab, float scale,
                               float* dlogits) = 0;
  // Vocabulary-parallel cross-entropy (Megatron's): this rank holds `vocab`
  // columns of the logits, and a row's target is one of its columns or
  // negative. Stats [tokens, 3] per row: this rank's max m, sum over its
  // columns of exp(l - m), and the target's logit (0 when
  // negative). With every rank's stats combined into M = max m_r and S =
  // sum_r s_r exp(m_r - M), written as [tokens, 2] = (M, S): probs =
  // exp(l - M) / S.
  virtual void CrossEntropyPartialStats(const float* logits, const int32_t* targets, int64_t tokens, int64_t vocab,
                                        float* stats) = 0;
  virtual void CrossEntropyPartialProbs(const float* logits, const float* stats, int64_t tokens, int64_t vocab,
                                        float* probs) = 0;

  // Block AttnRes: for each token, weights over n sources, source i a
  // separate [T, d] tensor at sources[i] (the blocks are read in place, so
  // they need not be contiguous; n <= workspace::kMaxAttnResSources):
  // a_i = softmax_i(w . RMSNorm(v_i; gamma, eps)), h = sum_i a_i v_i.
  // Saves nothing; the backward recomputes the weights and adds (+=) into
  // dsources[i], dw and dgamma. `workspace` holds
  // workspace::AttnResBwdBytes(T, d) for the dw/dgamma partials.
  virtual void AttnResFwd(const float* const* sources, int64_t n, const float* w, const float* gamma, int64_t tokens,
                          int64_t d, float eps, float* h, float* weights) = 0;
  virtual void AttnResBwd(const float* const* sources, int64_t n, const float* w, const float* gamma, const float* dh,
                          int64_t tokens, int64_t d, float eps, float* const* dsources, float* dw, float* dgamma,
                          float* workspace) = 0;
  // KDA (Kimi Delta Attention), the gated delta rule of each head with a
  // state S [dk, dv] starting at 0 per sequence, token by token:
  //   q^ = q / ||q|| / sqrt(dk), k^ = k / ||k||, alpha = exp(-exp(a_log[h]) softplus(g + dt_bias)),
  //   beta = sigmoid(beta_raw), S = (I - beta k^ k^T) Diag(alpha) S + beta k^ v^T, o = S^T q^.
  // q, k, g [rows, heads * dk], v, o [rows, heads * dv], beta_raw [rows, heads],
  // a_log [heads], dt_bias [heads * dk] (nullptr: zero); states [batch, heads,
  // chunks, dk, dv] receives S at the start of every chunk (saved for the
  // backward, which re-makes each chunk's states from it). Backward: dq, dk,
  // dv, dg, dbeta (overwrite), da_log and d_dt_bias (the column sums of dg;
  // added into, ignored without dt_bias); `workspace` holds
  // workspace::KdaBwdBytes(shape).
  virtual void KdaFwd(const float* q, const float* k, const float* v, const float* g, const float* beta,
                      const float* a_log, const float* dt_bias, const KdaShape& shape, float* o, float* states) = 0;
  virtual void KdaBwd(const float* q, const float* k, const float* v, const float* g, const float* beta,
                      const float* a_log, const float* dt_bias, const float* states, const float* d_o,
                      const KdaShape& shape, float* dq, float* dk, float* dv, float* dg, float* dbeta, float* da_log,
                      float* d_dt_bias, float* workspace) = 0;
  // KDA's short convolution on q, k and v: causal and depthwise over the
  // sequence, then SiLU. x, y [batch * seq, channels], w [taps, channels]:
  //   pre[b,s,c] = sum_j w[j,c] x[b, s - taps + 1 + j, c] (zero before the
  //   sequence's start), y = pre * sigmoid(pre).
  // Backward re-makes pre from x: dx (overwrite), dw (added into).
  virtual void ShortConvFwd(const float* x, const float* w, int64_t batch, int64_t seq, int64_t channels,
                            int64_t taps, float* y) = 0;
  virtual void ShortConvBwd(const float* x, const float* w, const float* dy, int64_t batch, int64_t seq,
                            int64_t channels, int64_t taps, float* dx, float* dw) = 0;
  // KDA's output gate: y = x * sigmoid(g) (y may be x); backward
  // dx = dy * sigmoid(g), dg = dy * x * s (1 - s) (overwrite).
  virtual void SigmoidGateFwd(const float* x, const float* g, int64_t n, float* y) = 0;
  virtual void SigmoidGateBwd(const float* x, const float* g, const float* dy, int64_t n, float* dx, float* dg) = 0;
};

// The CPU reference implementation.
std::unique_ptr<Ops> MakeRefOps();

}  // namespace memplan::kernels
