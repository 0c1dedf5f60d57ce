// The CUDA implementation of the Ops interface (ops.h). No CUDA header is
// needed to include this one: the stream is passed as an opaque pointer.
#pragma once

#include <memory>

#include "memplan/kernels/ops.h"

namespace memplan::kernels {

// Ops running asynchronously on `stream` (a cudaStream_t; nullptr is the
// legacy default stream). GEMMs go through cuBLAS with the caller's
// workspace (GemmWorkspaceBytes). Returns nullptr when memplan was built
// without CUDA.
std::unique_ptr<Ops> MakeCudaOps(void* stream);

// True when built with CUDA and at least one device is visible.
bool CudaDeviceAvailable();

}  // namespace memplan::kernels
