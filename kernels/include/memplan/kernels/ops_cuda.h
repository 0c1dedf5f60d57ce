// The CUDA implementation of the Ops interface (ops.h). No CUDA header is
// needed to include this one: the stream is passed as an opaque pointer.
#pragma once

#include <memory>

#include "memplan/kernels/ops.h"

namespace memplan::kernels {

// Device memory a CudaOps uses for the whole of its life, when the caller
// plans it (the runtime carves both from a rank's static buffers,
// docs/accounting.md): `gemm_workspace` of GemmWorkspaceBytes() goes to
// cuBLAS with cublasSetWorkspace, so cuBLAS allocates none of its own;
// `scratch` of KernelScratchBytes() holds the routing offsets' staging and
// the norm's partial sums. A nullptr member is allocated by the CudaOps
// itself (tests, benchmarks) and freed with it.
struct CudaOpsMemory {
  void* gemm_workspace = nullptr;
  void* scratch = nullptr;
};

// Ops running asynchronously on `stream` (a cudaStream_t; nullptr is the
// legacy default stream). GEMMs go through cuBLAS with the workspace a call
// passes, else `memory.gemm_workspace`. Returns nullptr when memplan was
// built without CUDA or no device is visible.
std::unique_ptr<Ops> MakeCudaOps(void* stream, CudaOpsMemory memory = {});

// True when built with CUDA and at least one device is visible.
bool CudaDeviceAvailable();

}  // namespace memplan::kernels
