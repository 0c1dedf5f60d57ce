// The CUDA implementation of Ops (ops.h, ops_cuda.h): cuBLAS for the GEMMs,
// the kernels of ops.cu (ops_launch.h) and attention.cu (attention_cuda.h)
// for the rest. Every CUDA or cuBLAS error aborts (cuda_check.h): a failed
// launch leaves the stream in an unknown state.
//
// Resources a CudaOps holds (made once, in MakeCudaOps): a cuBLAS handle
// bound to the stream; a GEMM workspace (GemmWorkspaceBytes) and a scratch
// buffer (KernelScratchBytes: DispatchPlan's offsets staged on their way to
// host memory, SquaredNorm's per-block partial sums), both the caller's
// planned memory when given (ops_cuda.h), else allocated here. Op calls
// never allocate, and cuBLAS always has a workspace of ours: it never falls
// back to its own pool.
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "attention_cuda.h"
#include "cuda_check.h"
#include "memplan/common/workspace.h"
#include "memplan/kernels/ops.h"
#include "memplan/kernels/ops_cuda.h"
#include "ops_launch.h"

namespace memplan::kernels {
namespace {

cuda::MlaDims Dims(const MlaShape& sh) {
  return {sh.b, sh.s, sh.heads, sh.nope, sh.rope, sh.v, sh.rope_theta, sh.cp, sh.cp_rank};
}

// DispatchPlan copies the E+1 offsets to the host through a device buffer of
// this many entries, one window at a time.
constexpr int64_t kStagedOffsets = workspace::kStagedOffsets;

class CudaOps final : public Ops {
 public:
  CudaOps(cudaStream_t stream, CudaOpsMemory memory) {
    int device = 0;
    MEMPLAN_CUDA_CHECK(cudaGetDevice(&device));
    ctx_.stream = stream;
    MEMPLAN_CUDA_CHECK(cudaDeviceGetAttribute(&ctx_.sm_count, cudaDevAttrMultiProcessorCount, device));
    MEMPLAN_CUDA_CHECK(
        cudaDeviceGetAttribute(&ctx_.max_smem_per_block_bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    MEMPLAN_CUBLAS_CHECK(cublasCreate(&cublas_));
    MEMPLAN_CUBLAS_CHECK(cublasSetStream(cublas_, stream));
    // Plain IEEE fp32: no TF32 tensor-core downconversion (CUBLAS_DEFAULT_MATH
    // never picks TF32 for cublasSgemm unless NVIDIA_TF32_OVERRIDE says so).
    MEMPLAN_CUBLAS_CHECK(cublasSetMathMode(cublas_, CUBLAS_DEFAULT_MATH));
    if (memory.gemm_workspace == nullptr) {
      MEMPLAN_CUDA_CHECK(cudaMalloc(&memory.gemm_workspace, static_cast<size_t>(GemmWorkspaceBytes())));
      owned_.push_back(memory.gemm_workspace);
    }
    if (memory.scratch == nullptr) {
      MEMPLAN_CUDA_CHECK(cudaMalloc(&memory.scratch, static_cast<size_t>(KernelScratchBytes())));
      owned_.push_back(memory.scratch);
    }
    default_workspace_ = memory.gemm_workspace;
    staged_offsets_ = static_cast<int64_t*>(memory.scratch);
    norm_partials_ = reinterpret_cast<double*>(static_cast<std::byte*>(memory.scratch) + workspace::StagedOffsetsBytes());
    UseWorkspace(default_workspace_);
  }

  // Teardown errors are ignored: at process exit the context may already be
  // gone, and aborting there would only hide the program's real outcome.
  ~CudaOps() override {
    if (cublas_ != nullptr) cublasDestroy(cublas_);
    for (void* p : owned_) cudaFree(p);
  }

  CudaOps(const CudaOps&) = delete;
  CudaOps& operator=(const CudaOps&) = delete;

  void Gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a, const float* b,
            float beta, float* c, void* workspace) override {
    if (m <= 0 || n <= 0) return;
    if (k <= 0) {
      // C = beta * C, spelled out rather than left to cuBLAS's k == 0 path;
      // with beta == 0, C is not read (NaNs in it do not survive).
      if (beta == 0.f) {
        MEMPLAN_CUDA_CHECK(cudaMemsetAsync(c, 0, static_cast<size_t>(m * n) * sizeof(float), ctx_.stream));
      } else if (beta != 1.f) {
        MEMPLAN_CUBLAS_CHECK(cublasSscal_64(cublas_, m * n, &beta, c, 1));
      }
      return;
    }
    UseWorkspace(workspace);
    // Row-major C[m,n] = op(A) op(B) is column-major C^T[n,m] = op(B)^T op(A)^T,
    // and a row-major matrix read column-major is its transpose: so cuBLAS
    // gets B first, then A, with the same transpose flags.
    const cublasOperation_t op_a = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t op_b = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    const int64_t lda = trans_a ? m : k;  // row length of A as stored
    const int64_t ldb = trans_b ? k : n;
    MEMPLAN_CUBLAS_CHECK(cublasSgemm_64(cublas_, op_b, op_a, n, m, k, &alpha, b, ldb, a, lda, &beta, c, n));
  }

  // Same operand swap as Gemm, with the caller's row strides as cuBLAS's
  // column-major leading dimensions.
  void GemmStridedBatched(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                          int64_t lda, int64_t stride_a, const float* b, int64_t ldb, int64_t stride_b, float beta,
                          float* c, int64_t ldc, int64_t stride_c, int64_t batch, void* workspace) override {
    if (m <= 0 || n <= 0 || batch <= 0) return;
    if (k <= 0) {
      MEMPLAN_CUDA_CHECK(cuda::LaunchScaleMatrices(ctx_, m, n, beta, c, ldc, stride_c, batch));
      return;
    }
    UseWorkspace(workspace);
    const cublasOperation_t op_a = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t op_b = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    MEMPLAN_CUBLAS_CHECK(cublasSgemmStridedBatched_64(cublas_, op_b, op_a, n, m, k, &alpha, b, ldb, stride_b, a, lda,
                                                      stride_a, &beta, c, ldc, stride_c, batch));
  }

  void GroupedGemm(const int64_t* offsets, int64_t experts, int64_t k, int64_t n, const float* x, const float* w,
                   float* y, void* workspace) override {
    for (int64_t e = 0; e < experts; ++e) {
      const int64_t row0 = offsets[e];
      const int64_t rows = offsets[e + 1] - row0;
      if (rows <= 0) continue;
      Gemm(false, false, rows, n, k, 1.f, x + row0 * k, w + e * k * n, 0.f, y + row0 * n, workspace);
    }
  }

  void GroupedGemmBwd(const int64_t* offsets, int64_t experts, int64_t k, int64_t n, const float* x, const float* w,
                      const float* dy, float* dx, float* dw, void* workspace) override {
    for (int64_t e = 0; e < experts; ++e) {
      const int64_t row0 = offsets[e];
      const int64_t rows = offsets[e + 1] - row0;
      if (rows <= 0) continue;  // dw[e] += 0
      Gemm(false, true, rows, k, n, 1.f, dy + row0 * n, w + e * k * n, 0.f, dx + row0 * k, workspace);
      Gemm(true, false, k, n, rows, 1.f, x + row0 * k, dy + row0 * n, 1.f, dw + e * k * n, workspace);
    }
  }

  void LayerNormFwd(const float* x, const float* gamma, const float* beta, int64_t rows, int64_t cols, float eps,
                    float* y) override {
    MEMPLAN_CUDA_CHECK(cuda::LaunchLayerNormFwd(ctx_, x, gamma, beta, rows, cols, eps, y));
  }
  void LayerNormBwd(const float* x, const float* gamma, const float* dy, int64_t rows, int64_t cols, float eps,
                    float* dx, float* dgamma, float* dbeta) override {
    MEMPLAN_CUDA_CHECK(cuda::LaunchLayerNormBwd(ctx_, x, gamma, dy, rows, cols, eps, dx, dgamma, dbeta));
  }
  void RmsNormFwd(const float* x, const float* gamma, int64_t rows, int64_t cols, float eps, float* y) override {
    MEMPLAN_CUDA_CHECK(cuda::LaunchRmsNormFwd(ctx_, x, gamma, rows, cols, eps, y));
  }
  void RmsNormBwd(const float* x, const float* gamma, const float* dy, int64_t rows, int64_t cols, float eps, float* dx,
                  float* dgamma) override {
    MEMPLAN_CUDA_CHECK(cuda::LaunchRmsNormBwd(ctx_, x, gamma, dy, rows, cols, eps, dx, dgamma));
  }

  void GeluFwd(const float* x, int64_t n, float* y) override { MEMPLAN_CUDA_CHECK(cuda::LaunchGeluFwd(ctx_, x, n, y)); }
  void GeluBwd(const float* x, const float* dy, int64_t n, float* dx) override {
    MEMPLAN_CUDA_CHECK(cuda::LaunchGeluBwd(ctx_, x, dy, n, dx));
  }
  void SwigluFwd(const float* x, int64_t rows, int64_t f, float* y) override {
    MEMPLAN_CUDA_CHECK(cuda::LaunchSwigluFwd(ctx_, x, rows, f, y));
  }
  void SwigluBwd(const float* x, const float* dy, int64_t rows, int64_t f, float* dx) override {
    MEMPLAN_CUDA_CHECK(cuda::LaunchSwigluBwd(ctx_, x, dy, rows, f, dx));
  }

  void DropoutFwd(const float* x, int64_t n, float p, uint64_t seed, uint64_t offset, float* y, uint8_t* mask,
                  int64_t first) override {
    MEMPLAN_CUDA_CHECK(cuda::LaunchDropoutFwd(ctx_, x, n, p, seed, offset, y, mask, first));
  }
  void DropoutBwd(const float* dy, const uint8_t* mask, int64_t n, float p, float* dx) override {
    MEMPLAN_CUDA_CHECK(cuda::LaunchDropoutBwd(ctx_, dy, mask, n, p, dx));
  }

  void MlaSplitFwd(const float* q_lin, const float* kv, const float* k_pe, const MlaShape& sh, float* q, float* k,
                   float* v) override {
    MEMPLAN_CUDA_CHECK(cuda::LaunchMlaSplitFwd(ctx_, q_lin, kv, k_pe, Dims(sh), q, k, v));
  }
  void MlaSplitBwd(const float* dq, const float* dk, const float* dv, const MlaShape& sh, float* dq_lin, float* dkv,
                   float* dk_pe) override {
    MEMPLAN_CUDA_CHECK(cuda::LaunchMlaSplitBwd(ctx_, dq, dk, dv, Dims(sh), dq_lin, dkv, dk_pe));
  }
  void Axpby(const float* x, const float* y, int64_t n, float a, float b, float* out) override {
    MEMPLAN_CUDA_CHECK(cuda::LaunchAxpby(ctx_, x, y, n, a, b, out));
  }
  void Add(const float* a, const float* b, int64_t n, float* y) override {
    MEMPLAN_CUDA_CHECK(cuda::LaunchAdd(ctx_, a, b, n, y));
  }
  void Accumulate(float* y, const float* x, int64_t n) override {
    MEMPLAN_CUDA_CHECK(cuda::LaunchAccumulate(ctx_, y, x, n));
  }

  void SoftmaxFwd(const float* x, int64_t rows, int64_t cols, float scale, int64_t causal_seq, float* y, int64_t cp,
                  int64_t cp_rank) override {
    MEMPLAN_CUDA_CHECK(cuda::LaunchSoftmaxFwd(ctx_, x, rows, cols, scale, causal_seq, y, cp, cp_rank));
  }
  void SoftmaxBwd(const float* y, const float* dy, int64_t rows, int64_t cols, float scale, float* dx) override {
    MEMPLAN_CUDA_CHECK(cuda::LaunchSoftmaxBwd(ctx_, y, dy, rows, cols, scale, dx));
  }
  void SigmoidFwd(const float* x, int64_t n, float* y) override {
    MEMPLAN_CUDA_CHECK(cuda::LaunchSigmoidFwd(ctx_, x, n, y));
  }
  void SigmoidBwd(const float* y, const float* dy, int64_t n, float* dx) override {
    MEMPLAN_CUDA_CHECK(cuda::LaunchSigmoidBwd(ctx_, y, dy, n, dx));
  }
  void TopKFwd(const float* probs, int64_t tokens, int64_t experts, int64_t top_k, bool renormalize, int32_t* idx,
               float* weights) override {
    MEMPLAN_CUDA_CHECK(cuda::LaunchTopKFwd(ctx_, probs, tokens, experts, top_k, renormalize, idx, weights));
  }
  void TopKBwd(const float* probs, const int32_t* idx, const float* weights, const float* d_weights, int64_t tokens,
               int64_t experts, int64_t top_k, bool renormalize, float* dprobs) override {
    MEMPLAN_CUDA_CHECK(
        cuda::LaunchTopKBwd(ctx_, probs, idx, weights, d_weights, tokens, experts, top_k, renormalize, dprobs));
  }
  void EmbeddingFwd(const int32_t* tokens, const float* table, int64_t n, int64_t d, float* y) override {
    MEMPLAN_CUDA_CHECK(cuda::LaunchEmbeddingFwd(ctx_, tokens, table, n, d, y));
  }
  void EmbeddingBwd(const int32_t* tokens, const float* dy, int64_t n, int64_t d, float* dtable) override {
    MEMPLAN_CUDA_CHECK(cuda::LaunchEmbeddingBwd(ctx_, tokens, dy, n, d, dtable));
  }
  void SplitHeadsFwd(const float* qkv, const SplitShape& sh, float* q, float* k, float* v) override {
    MEMPLAN_CUDA_CHECK(cuda::LaunchSplitHeadsFwd(ctx_, qkv, sh.b, sh.s, sh.heads, sh.kv_heads, sh.head_dim, sh.rope,
                                                 sh.rope_theta, q, k, v, sh.cp, sh.cp_rank));
  }
  void SplitHeadsBwd(const float* dq, const float* dk, const float* dv, const SplitShape& sh, float* dqkv) override {
    MEMPLAN_CUDA_CHECK(cuda::LaunchSplitHeadsBwd(ctx_, dq, dk, dv, sh.b, sh.s, sh.heads, sh.kv_heads, sh.head_dim,
                                                 sh.rope, sh.rope_theta, dqkv, sh.cp, sh.cp_rank));
  }
  void AdamStep(float* master, const float* grad, float* m, float* v, int64_t n, const AdamConfig& c,
                int64_t step) override {
    MEMPLAN_CUDA_CHECK(cuda::LaunchAdamStep(ctx_, master, grad, m, v, n, c.lr, c.beta1, c.beta2, c.eps,
                                            c.weight_decay, AdamBiasCorrection(c.beta1, step),
                                            AdamBiasCorrection(c.beta2, step)));
  }
  void SquaredNorm(const float* x, int64_t n, double* out) override {
    MEMPLAN_CUDA_CHECK(cuda::LaunchSquaredNorm(ctx_, x, n, norm_partials_, out));
  }
  void Copy(void* dst, const void* src, int64_t bytes) override {
    if (bytes <= 0) return;
    MEMPLAN_CUDA_CHECK(cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes), cudaMemcpyDeviceToDevice, ctx_.stream));
  }
  void WidenBf16(const uint16_t* x, int64_t n, float* y) override {
    MEMPLAN_CUDA_CHECK(cuda::LaunchWidenBf16(ctx_, x, n, y));
  }
  void RoundToBf16(const float* x, int64_t n, uint16_t* y) override {
    MEMPLAN_CUDA_CHECK(cuda::LaunchRoundToBf16(ctx_, x, n, y));
  }
  void Zero(void* dst, int64_t bytes) override {
    if (bytes <= 0) return;
    MEMPLAN_CUDA_CHECK(cudaMemsetAsync(dst, 0, static_cast<size_t>(bytes), ctx_.stream));
  }

  void AttentionFwd(const AttentionShape& sh, const float* q, const float* k, const float* v, float* probs,
                    float* o) override {
    MEMPLAN_CUDA_CHECK(static_cast<cudaError_t>(cuda::AttentionFwd(sh, q, k, v, probs, o, ctx_.stream)));
  }
  void AttentionBwd(const AttentionShape& sh, const float* q, const float* k, const float* v, const float* probs,
                    const float* d_o, float* dq, float* dk, float* dv, void* workspace) override {
    MEMPLAN_CUDA_CHECK(
        static_cast<cudaError_t>(cuda::AttentionBwd(sh, q, k, v, probs, d_o, dq, dk, dv, workspace, ctx_.stream)));
  }
  void FlashAttentionFwd(const AttentionShape& sh, const float* q, const float* k, const float* v, float* o,
                         float* lse) override {
    MEMPLAN_CUDA_CHECK(static_cast<cudaError_t>(cuda::FlashAttentionFwd(sh, q, k, v, o, lse, ctx_.stream)));
  }
  void FlashAttentionBwd(const AttentionShape& sh, const float* q, const float* k, const float* v, const float* o,
                         const float* lse, const float* d_o, float* dq, float* dk, float* dv,
                         void* workspace) override {
    MEMPLAN_CUDA_CHECK(static_cast<cudaError_t>(
        cuda::FlashAttentionBwd(sh, q, k, v, o, lse, d_o, dq, dk, dv, workspace, ctx_.stream)));
  }

  void RouterFwd(const float* logits, int64_t tokens, int64_t experts, int64_t top_k, bool sigmoid, bool renormalize,
                 float* probs, int32_t* topk_idx, float* topk_weights) override {
    MEMPLAN_CUDA_CHECK(cuda::LaunchRouterFwd(ctx_, logits, tokens, experts, top_k, sigmoid, renormalize, probs,
                                             topk_idx, topk_weights));
  }
  void RouterBwd(const float* probs, const int32_t* topk_idx, const float* topk_weights, const float* d_topk_weights,
                 int64_t tokens, int64_t experts, int64_t top_k, bool sigmoid, bool renormalize,
                 float* dlogits) override {
    MEMPLAN_CUDA_CHECK(cuda::LaunchRouterBwd(ctx_, probs, topk_idx, topk_weights, d_topk_weights, tokens, experts,
                                             top_k, sigmoid, renormalize, dlogits));
  }

  // The only synchronizing op: offsets are host memory, so this waits for
  // the stream (all work queued before it included) before returning.
  void DispatchPlan(const int32_t* topk_idx, int64_t tokens, int64_t top_k, int64_t experts, int32_t* slot_of,
                    int64_t* offsets) override {
    const int64_t n_pairs = tokens * top_k;
    // Windows of the E+1 offsets share one staging buffer: stream order puts
    // each copy-out before the next window's kernel overwrites it.
    for (int64_t first = 0; first <= experts; first += kStagedOffsets) {
      const int64_t count = std::min(kStagedOffsets, experts + 1 - first);
      MEMPLAN_CUDA_CHECK(
          cuda::LaunchDispatchPlan(ctx_, topk_idx, n_pairs, experts, first, count, slot_of, staged_offsets_));
      MEMPLAN_CUDA_CHECK(cudaMemcpyAsync(offsets + first, staged_offsets_, count * sizeof(int64_t),
                                         cudaMemcpyDeviceToHost, ctx_.stream));
    }
    MEMPLAN_CUDA_CHECK(cudaStreamSynchronize(ctx_.stream));
  }
  void DispatchFwd(const float* x, const int32_t* slot_of, int64_t tokens, int64_t top_k, int64_t d,
                   float* x_sorted) override {
    MEMPLAN_CUDA_CHECK(cuda::LaunchDispatchFwd(ctx_, x, slot_of, tokens, top_k, d, x_sorted));
  }
  void DispatchBwd(const float* dx_sorted, const int32_t* slot_of, int64_t tokens, int64_t top_k, int64_t d,
                   float* dx) override {
    MEMPLAN_CUDA_CHECK(cuda::LaunchDispatchBwd(ctx_, dx_sorted, slot_of, tokens, top_k, d, dx));
  }
  void CombineFwd(const float* y_sorted, const int32_t* slot_of, const float* topk_weights, int64_t tokens,
                  int64_t top_k, int64_t d, float* out) override {
    MEMPLAN_CUDA_CHECK(cuda::LaunchCombineFwd(ctx_, y_sorted, slot_of, topk_weights, tokens, top_k, d, out));
  }
  void CombineBwd(const float* dout, const int32_t* slot_of, const float* topk_weights, const float* y_sorted,
                  int64_t tokens, int64_t top_k, int64_t d, float* dy_sorted, float* d_topk_weights) override {
    MEMPLAN_CUDA_CHECK(cuda::LaunchCombineBwd(ctx_, dout, slot_of, topk_weights, y_sorted, tokens, top_k, d, dy_sorted,
                                              d_topk_weights));
  }
  void RouterGradRewrite(const float* da, const float* act, const int32_t* slot_of, const float* topk_weights,
                         int64_t tokens, int64_t top_k, int64_t f, float* d_topk_weights) override {
    MEMPLAN_CUDA_CHECK(
        cuda::LaunchRouterGradRewrite(ctx_, da, act, slot_of, topk_weights, tokens, top_k, f, d_topk_weights));
  }

  void CrossEntropyFwd(const float* logits, const int32_t* targets, int64_t tokens, int64_t vocab, float* probs,
                       float* loss) override {
    MEMPLAN_CUDA_CHECK(cuda::LaunchCrossEntropyFwd(ctx_, logits, targets, tokens, vocab, probs, loss));
  }
  void CrossEntropyBwd(const float* probs, const int32_t* targets, int64_t tokens, int64_t vocab, float scale,
                       float* dlogits) override {
    MEMPLAN_CUDA_CHECK(cuda::LaunchCrossEntropyBwd(ctx_, probs, targets, tokens, vocab, scale, dlogits));
  }
  void CrossEntropyPartialStats(const float* logits, const int32_t* targets, int64_t tokens, int64_t vocab,
                                float* stats) override {
    MEMPLAN_CUDA_CHECK(cuda::LaunchCrossEntropyPartialStats(ctx_, logits, targets, tokens, vocab, stats));
  }
  void CrossEntropyPartialProbs(const float* logits, const float* stats, int64_t tokens, int64_t vocab,
                                float* probs) override {
    MEMPLAN_CUDA_CHECK(cuda::LaunchCrossEntropyPartialProbs(ctx_, logits, stats, tokens, vocab, probs));
  }

  void KdaFwd(const float* q, const float* k, const float* v, const float* g, const float* beta, const float* a_log,
              const float* dt_bias, const KdaShape& shape, float* o, float* states) override {
    MEMPLAN_CUDA_CHECK(cuda::LaunchKdaFwd(ctx_, q, k, v, g, beta, a_log, dt_bias, shape, o, states));
  }
  void KdaBwd(const float* q, const float* k, const float* v, const float* g, const float* beta, const float* a_log,
              const float* dt_bias, const float* states, const float* d_o, const KdaShape& shape, float* dq,
              float* dk, float* dv, float* dg, float* dbeta, float* da_log, float* d_dt_bias,
              float* workspace) override {
    MEMPLAN_CUDA_CHECK(cuda::LaunchKdaBwd(ctx_, q, k, v, g, beta, a_log, dt_bias, states, d_o, shape, dq, dk, dv, dg,
                                          dbeta, da_log, d_dt_bias, workspace));
  }
  void ShortConvFwd(const float* x, const float* w, int64_t batch, int64_t seq, int64_t channels, int64_t taps,
                    float* y) override {
    MEMPLAN_CUDA_CHECK(cuda::LaunchShortConvFwd(ctx_, x, w, batch, seq, channels, taps, y));
  }
  void ShortConvBwd(const float* x, const float* w, const float* dy, int64_t batch, int64_t seq, int64_t channels,
                    int64_t taps, float* dx, float* dw) override {
    MEMPLAN_CUDA_CHECK(cuda::LaunchShortConvBwd(ctx_, x, w, dy, batch, seq, channels, taps, dx, dw));
  }
  void SigmoidGateFwd(const float* x, const float* g, int64_t n, float* y) override {
    MEMPLAN_CUDA_CHECK(cuda::LaunchSigmoidGateFwd(ctx_, x, g, n, y));
  }
  void SigmoidGateBwd(const float* x, const float* g, const float* dy, int64_t n, float* dx, float* dg) override {
    MEMPLAN_CUDA_CHECK(cuda::LaunchSigmoidGateBwd(ctx_, x, g, dy, n, dx, dg));
  }

  void AttnResFwd(const float* const* sources, int64_t n, const float* w, const float* gamma, int64_t tokens,
                  int64_t d, float eps, float* h, float* weights) override {
    MEMPLAN_CUDA_CHECK(cuda::LaunchAttnResFwd(ctx_, sources, n, w, gamma, tokens, d, eps, h, weights));
  }
  void AttnResBwd(const float* const* sources, int64_t n, const float* w, const float* gamma, const float* dh,
                  int64_t tokens, int64_t d, float eps, float* const* dsources, float* dw, float* dgamma,
                  float* workspace) override {
    MEMPLAN_CUDA_CHECK(
        cuda::LaunchAttnResBwd(ctx_, sources, n, w, gamma, dh, tokens, d, eps, dsources, dw, dgamma, workspace));
  }

 private:
  // Points cuBLAS at the call's workspace, or at ours (never at cuBLAS's
  // own pool, and never at a workspace the caller may since have freed).
  void UseWorkspace(void* workspace) {
    if (workspace == nullptr) workspace = default_workspace_;
    if (workspace == workspace_) return;
    MEMPLAN_CUBLAS_CHECK(cublasSetWorkspace(cublas_, workspace, static_cast<size_t>(GemmWorkspaceBytes())));
    workspace_ = workspace;
  }

  cuda::LaunchContext ctx_;
  cublasHandle_t cublas_ = nullptr;
  void* workspace_ = nullptr;          // what cuBLAS was last given
  void* default_workspace_ = nullptr;  // planned, or in owned_
  int64_t* staged_offsets_ = nullptr;  // device, kStagedOffsets entries (scratch)
  double* norm_partials_ = nullptr;    // device, cuda::kSquaredNormPartials entries (scratch)
  std::vector<void*> owned_;           // what this CudaOps allocated itself
};

}  // namespace

// Returns nullptr (rather than aborting) when no device is visible, so a
// host program can fall back to the reference ops.
std::unique_ptr<Ops> MakeCudaOps(void* stream, CudaOpsMemory memory) {
  if (!CudaDeviceAvailable()) return nullptr;
  return std::make_unique<CudaOps>(static_cast<cudaStream_t>(stream), memory);
}

bool CudaDeviceAvailable() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the error so it does not surface in a later check
    return false;
  }
  return count > 0;
}

}  // namespace memplan::kernels
