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
                             uint64_t offset, float* y, uint8_t* mask);
cudaError_t LaunchDropoutBwd(const LaunchContext& ctx, const float* dy, const uint8_t* mask, int64_t n, float p,
                             float* dx);
cudaError_t LaunchAdd(const LaunchContext& ctx, const float* a, const float* b, int64_t n, float* y);

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
cudaError_t LaunchRouterGradRewrite(const LaunchContext& ctx, const float* da_unweighted, const float* act,
                                    const int32_t* slot_of, int64_t tokens, int64_t top_k, int64_t f,
                                    float* d_topk_weights);

cudaError_t LaunchCrossEntropyFwd(const LaunchContext& ctx, const float* logits, const int32_t* targets, int64_t tokens,
                                  int64_t vocab, float* probs, float* loss);
cudaError_t LaunchCrossEntropyBwd(const LaunchContext& ctx, const float* probs, const int32_t* targets, int64_t tokens,
                                  int64_t vocab, float scale, float* dlogits);

// weights [T, n] may be nullptr. dsources doubles as scratch for the dw/dgamma
// partials before it is written.
cudaError_t LaunchAttnResFwd(const LaunchContext& ctx, const float* sources, const float* w, const float* gamma,
                             int64_t n, int64_t tokens, int64_t d, float eps, float* h, float* weights);
cudaError_t LaunchAttnResBwd(const LaunchContext& ctx, const float* sources, const float* w, const float* gamma,
                             const float* dh, int64_t n, int64_t tokens, int64_t d, float eps, float* dsources,
                             float* dw, float* dgamma);

}  // namespace memplan::kernels::cuda
