// Private: CUDA attention launchers (kernels/cuda/attention.cu), called by
// the CUDA Ops (cuda_ops.cc). Semantics are those of Ops::AttentionFwd/Bwd
// and Ops::FlashAttentionFwd/Bwd in ops.h. All pointers are device memory;
// launches are asynchronous on `stream` (a cudaStream_t). Return the
// cudaError_t of the launch as an int (0 on success).
#pragma once

#include "memplan/kernels/ops.h"

namespace memplan::kernels::cuda {

int AttentionFwd(const AttentionShape& sh, const float* q, const float* k, const float* v, float* probs, float* o,
                 void* stream);
int AttentionBwd(const AttentionShape& sh, const float* q, const float* k, const float* v, const float* probs,
                 const float* d_o, float* dq, float* dk, float* dv, void* workspace, void* stream);
int FlashAttentionFwd(const AttentionShape& sh, const float* q, const float* k, const float* v, float* o, float* lse,
                      void* stream);
int FlashAttentionBwd(const AttentionShape& sh, const float* q, const float* k, const float* v, const float* o,
                      const float* lse, const float* d_o, float* dq, float* dk, float* dv, void* workspace,
                      void* stream);

}  // namespace memplan::kernels::cuda
