// Private: launchers for the CUDA kernels of the Ops interface
// (kernels/cuda/ops.cu), called by CudaOps (cuda_ops.cc). Semantics, shapes
// and the overwrite/accumulate rules are those of the same-named methods in
// ops.h; attention lives in attention_cuda.h and GEMMs go through cuBLAS.
//
// All pointers are device memory; every launcher only enqueues work on
// ctx.stream and returns the launch status (cudaGetLastError()). Nothing is
// allocated and nothing synchronizes. Outputs must not alias inputs.
//
// Determinism: no launcher uses floating-point atomics except the
// DispatchBwd / CombineFwd fallback for d < top_k (documented there).
// Cross-row reductions into weight gradients (LayerNorm/RMSNorm dgamma, dbeta;
// AttnRes dw, dgamma) are summed in a fixed order, two-pass: per-block
// partials parked in the not-yet-written input-gradient output, then a
// fixed-order column sum, then the input gradient itself. Results are
// reproducible run to run on one device and grid; they are not bit-identical
// to the CPU references (different summation order).
#pragma once

#include <cuda_runtime_api.h>

#include "memplan/common/workspace.h"
#include "memplan/kernels/ops.h"

#include <cstdint>

namespace memplan::kernels::cuda {

// What a launcher needs to size its grid.
struct LaunchContext {
  cudaStream_t stream = nullptr;
  int sm_count = 1;                          // cudaDevAttrMultiProcessorCount
  int max_smem_per_block_bytes = 48 * 1024;  // cudaDevAttrMaxSharedMemoryPerBlockOptin
};

cudaError_t LaunchLayerNormFwd(const LaunchContext& ctx, const float* x, const float* gamma, const float* beta,
                               int64_t rows, int64_t cols, float eps, float* y);
// dx doubles as scratch for the dgamma/dbeta partials before it is written.
cudaError_t LaunchLayerNormBwd(const LaunchContext& ctx, const float* x, const float* gamma, const float* dy,
                               int64_t rows, int64_t cols, float eps, float* dx, float* dgamma, float* dbeta);
cudaError_t LaunchRmsNormFwd(const LaunchContext& ctx, const float* x, const float* gamma, int64_t rows, int64_t cols,
                             float eps, float* y);
cudaError_t LaunchRmsNormBwd(const LaunchContext& ctx, const float* x, const float* gamma, const float* dy,
                             int64_t rows, int64_t cols, float eps, float* dx, float* dgamma);

cudaError_t LaunchGeluFwd(const LaunchContext& ctx, const float* x, int64_t n, float* y);
cudaError_t LaunchGeluBwd(const LaunchContext& ctx, const float* x, const float* dy, int64_t n, float* dx);
cudaError_t LaunchSwigluFwd(const LaunchContext& ctx, const float* x, int64_t rows, int64_t f, float* y);
cudaError_t LaunchSwigluBwd(const LaunchContext& ctx, const float* x, const float* dy, int64_t rows, int64_t f,
                            float* dx);
cudaError_t LaunchDropoutFwd(const LaunchContext& ctx, const float* x, int64_t n, float p, uint64_t seed,
                             uint64_t offset, float* y, uint8_t* mask, int64_t first);
cudaError_t LaunchDropoutBwd(const LaunchContext& ctx, const float* dy, const uint8_t* mask, int64_t n, float p,
                             float* dx);
cudaError_t LaunchAdd(const LaunchContext& ctx, const float* a, const float* b, int64_t n, float* y);
// out = a * x + b * y (y may be null: out = a * x); out may alias x.
cudaError_t LaunchAxpby(const LaunchContext& ctx, const float* x, const float* y, int64_t n, float a, float b,
                        float* out);
cudaError_t LaunchAccumulate(const LaunchContext& ctx, float* y, const float* x, int64_t n);

// GemmStridedBatched with k == 0 (cuBLAS is not asked): C_i = beta * C_i on
// the m x n entries of each [m, ldc] matrix; beta == 0 writes zeros without
// reading C; beta == 1 launches nothing.
cudaError_t LaunchScaleMatrices(const LaunchContext& ctx, int64_t m, int64_t n, float beta, float* c, int64_t ldc,
                                int64_t stride_c, int64_t batch);

// Softmax: one block per row; scale * x is rounded before the max is
// subtracted, as in the reference.
cudaError_t LaunchSoftmaxFwd(const LaunchContext& ctx, const float* x, int64_t rows, int64_t cols, float scale,
                             int64_t causal_seq, float* y, int64_t cp = 1, int64_t cp_rank = 0);
cudaError_t LaunchSoftmaxBwd(const LaunchContext& ctx, const float* y, const float* dy, int64_t rows, int64_t cols,
                             float scale, float* dx);
cudaError_t LaunchSigmoidFwd(const LaunchContext& ctx, const float* x, int64_t n, float* y);
cudaError_t LaunchSigmoidBwd(const LaunchContext& ctx, const float* y, const float* dy, int64_t n, float* dx);

// One warp per token; the selection code is RouterFwd's (WarpTopK) and the
// gradient RouterBwd's (TopKGrad).
cudaError_t LaunchTopKFwd(const LaunchContext& ctx, const float* probs, int64_t tokens, int64_t experts, int64_t top_k,
                          bool renormalize, int32_t* idx, float* weights);
cudaError_t LaunchTopKBwd(const LaunchContext& ctx, const float* probs, const int32_t* idx, const float* weights,
                          const float* d_weights, int64_t tokens, int64_t experts, int64_t top_k, bool renormalize,
                          float* dprobs);

// EmbeddingBwd runs one thread per column looping over the tokens in order:
// no atomics, the reference's order, so the reference's bits.
cudaError_t LaunchEmbeddingFwd(const LaunchContext& ctx, const int32_t* tokens, const float* table, int64_t n,
                               int64_t d, float* y);
cudaError_t LaunchEmbeddingBwd(const LaunchContext& ctx, const int32_t* tokens, const float* dy, int64_t n, int64_t d,
                               float* dtable);

// SplitShape's fields spelled out (this header does not include ops.h).
// cudaErrorInvalidValue for rope with an odd head_dim.
cudaError_t LaunchSplitHeadsFwd(const LaunchContext& ctx, const float* qkv, int64_t b, int64_t s, int64_t heads,
                                int64_t kv_heads, int64_t head_dim, bool rope, float rope_theta, float* q, float* k,
                                float* v, int64_t cp = 1, int64_t cp_rank = 0);
cudaError_t LaunchSplitHeadsBwd(const LaunchContext& ctx, const float* dq, const float* dk, const float* dv, int64_t b,
                                int64_t s, int64_t heads, int64_t kv_heads, int64_t head_dim, bool rope,
                                float rope_theta, float* dqkv, int64_t cp = 1, int64_t cp_rank = 0);

// AdamW with the bias corrections bc1, bc2 computed by the caller
// (AdamBiasCorrection); bit-identical to the reference.
cudaError_t LaunchAdamStep(const LaunchContext& ctx, float* master, const float* grad, float* m, float* v, int64_t n,
                           float lr, float beta1, float beta2, float eps, float weight_decay, float bc1, float bc2);

// MLA heads (ops.h MlaSplitFwd/Bwd, MlaShape's fields spelled out;
// kernels/cuda/mla.cu).
struct MlaDims {
  int64_t b, s, heads, nope, rope, v;
  float rope_theta;
  int64_t cp, cp_rank;  // ops.h's CpPosition
};
cudaError_t LaunchMlaSplitFwd(const LaunchContext& ctx, const float* q_lin, const float* kv, const float* k_pe,
                              const MlaDims& sh, float* q, float* k, float* v);
cudaError_t LaunchMlaSplitBwd(const LaunchContext& ctx, const float* dq, const float* dk, const float* dv,
                              const MlaDims& sh, float* dq_lin, float* dkv, float* dk_pe);

// Squared norm in double: kSquaredNormPartials blocks write their partial
// sums to `partials` (device, kSquaredNormPartials doubles, owned by the
// caller), then one block sums them into *out (device). Fixed grid, fixed
// per-thread ranges and trees: bit-identical run to run for a given n.
inline constexpr int64_t kSquaredNormPartials = workspace::kNormPartials;
cudaError_t LaunchSquaredNorm(const LaunchContext& ctx, const float* x, int64_t n, double* partials, double* out);

cudaError_t LaunchRouterFwd(const LaunchContext& ctx, const float* logits, int64_t tokens, int64_t experts,
                            int64_t top_k, bool sigmoid, bool renormalize, float* probs, int32_t* topk_idx,
                            float* topk_weights);
cudaError_t LaunchRouterBwd(const LaunchContext& ctx, const float* probs, const int32_t* topk_idx,
                            const float* topk_weights, const float* d_topk_weights, int64_t tokens, int64_t experts,
                            int64_t top_k, bool sigmoid, bool renormalize, float* dlogits);

// The device half of DispatchPlan for the pairs of topk_idx[n_pairs]:
// offsets[e] = #{pairs with 0 <= expert < e} for e in
// [first_offset, first_offset + offset_count) (a window of the E+1 offsets,
// written to staged_offsets[0, offset_count)), and the stable counting sort
// of the pairs of the window's experts (e < experts) into slot_of. Pairs
// whose expert is outside [0, experts) are dropped. One 1024-thread block per
// expert, each reading topk_idx twice: O(E * n_pairs) L2 traffic, fine for
// MoE sizes (E <= a few hundred).
cudaError_t LaunchDispatchPlan(const LaunchContext& ctx, const int32_t* topk_idx, int64_t n_pairs, int64_t experts,
                               int64_t first_offset, int64_t offset_count, int32_t* slot_of, int64_t* staged_offsets);
cudaError_t LaunchDispatchFwd(const LaunchContext& ctx, const float* x, const int32_t* slot_of, int64_t tokens,
                              int64_t top_k, int64_t d, float* x_sorted);
// dx doubles as scratch for the inverse permutation (needs d >= top_k;
// otherwise float atomics, nondeterministic for top_k >= 3).
cudaError_t LaunchDispatchBwd(const LaunchContext& ctx, const float* dx_sorted, const int32_t* slot_of, int64_t tokens,
                              int64_t top_k, int64_t d, float* dx);
// out doubles as scratch for the inverse permutation, as in DispatchBwd.
cudaError_t LaunchCombineFwd(const LaunchContext& ctx, const float* y_sorted, const int32_t* slot_of,
                             const float* topk_weights, int64_t tokens, int64_t top_k, int64_t d, float* out);
cudaError_t LaunchCombineBwd(const LaunchContext& ctx, const float* dout, const int32_t* slot_of,
                             const float* topk_weights, const float* y_sorted, int64_t tokens, int64_t top_k, int64_t d,
                             float* dy_sorted, float* d_topk_weights);
cudaError_t LaunchRouterGradRewrite(const LaunchContext& ctx, const float* da, const float* act,
                                    const int32_t* slot_of, const float* topk_weights, int64_t tokens, int64_t top_k,
                                    int64_t f, float* d_topk_weights);

cudaError_t LaunchCrossEntropyFwd(const LaunchContext& ctx, const float* logits, const int32_t* targets, int64_t tokens,
                                  int64_t vocab, float* probs, float* loss);
cudaError_t LaunchCrossEntropyBwd(const LaunchContext& ctx, const float* probs, const int32_t* targets, int64_t tokens,
                                  int64_t vocab, float scale, float* dlogits);
cudaError_t LaunchCrossEntropyPartialStats(const LaunchContext& ctx, const float* logits, const int32_t* targets,
                                           int64_t tokens, int64_t vocab, float* stats);
cudaError_t LaunchCrossEntropyPartialProbs(const LaunchContext& ctx, const float* logits, const float* stats,
                                           int64_t tokens, int64_t vocab, float* probs);

// weights [T, n] may be nullptr. Sources and their gradients are n separate
// [T, d] tensors (n <= workspace::kMaxAttnResSources); dsources, dw and dgamma
// are added into; `workspace` holds workspace::AttnResBwdBytes(T, d).
cudaError_t LaunchAttnResFwd(const LaunchContext& ctx, const float* const* sources, int64_t n, const float* w,
                             const float* gamma, int64_t tokens, int64_t d, float eps, float* h, float* weights);
cudaError_t LaunchAttnResBwd(const LaunchContext& ctx, const float* const* sources, int64_t n, const float* w,
                             const float* gamma, const float* dh, int64_t tokens, int64_t d, float eps,
                             float* const* dsources, float* dw, float* dgamma, float* workspace);

// bf16 storage (convert.cu): exact widening; rounding to nearest even.
cudaError_t LaunchWidenBf16(const LaunchContext& ctx, const uint16_t* x, int64_t n, float* y);
cudaError_t LaunchRoundToBf16(const LaunchContext& ctx, const float* x, int64_t n, uint16_t* y);

// KDA (kda.cu). The backward's workspace holds workspace::KdaBwdBytes.
cudaError_t LaunchKdaFwd(const LaunchContext& ctx, const float* q, const float* k, const float* v, const float* g,
                         const float* beta, const float* a_log, const float* dt_bias, const KdaShape& shape,
                         float* o, float* states);
cudaError_t LaunchKdaBwd(const LaunchContext& ctx, const float* q, const float* k, const float* v, const float* g,
                         const float* beta, const float* a_log, const float* dt_bias, const float* states,
                         const float* d_o, const KdaShape& shape, float* dq, float* dk, float* dv, float* dg,
                         float* dbeta, float* da_log, float* d_dt_bias, float* workspace);
cudaError_t LaunchShortConvFwd(const LaunchContext& ctx, const float* x, const float* w, int64_t batch, int64_t seq,
                               int64_t channels, int64_t taps, float* y);
cudaError_t LaunchShortConvBwd(const LaunchContext& ctx, const float* x, const float* w, const float* dy,
                               int64_t batch, int64_t seq, int64_t channels, int64_t taps, float* dx, float* dw);
cudaError_t LaunchSigmoidGateFwd(const LaunchContext& ctx, const float* x, const float* g, int64_t n, float* y);
cudaError_t LaunchSigmoidGateBwd(const LaunchContext& ctx, const float* x, const float* g, const float* dy, int64_t n,
                                 float* dx, float* dg);

}  // namespace memplan::kernels::cuda
