// Private: MEMPLAN_CUDA_CHECK / MEMPLAN_CUBLAS_CHECK, the kernels' way of
// stopping on a CUDA runtime or cuBLAS error. kernels/ must not depend on
// common/, so this mirrors MEMPLAN_CHECK (common/check.h): report file:line,
// the failing expression and the library's error string on stderr, then
// abort. A failed launch or API call leaves the stream in an unknown state,
// so there is nothing a caller could recover.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>

namespace memplan::kernels::cuda::detail {

[[noreturn]] inline void CudaCheckFailed(const char* file, int line, const char* expr, const char* library,
                                         const char* what) {
  std::fprintf(stderr, "%s:%d: %s error in %s: %s\n", file, line, library, expr, what);
  std::fflush(stderr);
  std::abort();
}

}  // namespace memplan::kernels::cuda::detail

#define MEMPLAN_CUDA_CHECK(expr)                                                                \
  do {                                                                                          \
    const cudaError_t memplan_cuda_err_ = (expr);                                               \
    if (memplan_cuda_err_ != cudaSuccess) [[unlikely]]                                          \
      ::memplan::kernels::cuda::detail::CudaCheckFailed(__FILE__, __LINE__, #expr, "CUDA",      \
                                                        cudaGetErrorString(memplan_cuda_err_)); \
  } while (0)

#define MEMPLAN_CUBLAS_CHECK(expr)                                                                   \
  do {                                                                                               \
    const cublasStatus_t memplan_cublas_err_ = (expr);                                               \
    if (memplan_cublas_err_ != CUBLAS_STATUS_SUCCESS) [[unlikely]]                                   \
      ::memplan::kernels::cuda::detail::CudaCheckFailed(__FILE__, __LINE__, #expr, "cuBLAS",         \
                                                        cublasGetStatusString(memplan_cublas_err_)); \
  } while (0)
