// A CUDA program with known device allocations, for `memplan profile`
// (tests/profile_test.sh): cudaMalloc 1 MiB; from a stream-ordered pool
// 3 MiB and 5 MiB, the first freed before the end; 2 MiB of managed
// memory (not device memory: not in the device footprint); everything
// freed. Device-memory peak: 1 + 3 + 5 = 9 MiB. Exits 77 without a GPU.
#include <cuda_runtime_api.h>

#include <cstdio>

#define CHECK_CUDA(call)                                                                         \
  do {                                                                                           \
    cudaError_t e = (call);                                                                      \
    if (e != cudaSuccess) {                                                                      \
      std::fprintf(stderr, "profile_target: %s: %s\n", #call, cudaGetErrorString(e));            \
      return 1;                                                                                  \
    }                                                                                            \
  } while (0)

int main() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::fprintf(stderr, "profile_target: no CUDA device\n");
    return 77;
  }
  constexpr size_t kMiB = size_t{1} << 20;
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreate(&stream));
  void *a = nullptr, *b = nullptr, *c = nullptr, *m = nullptr;
  CHECK_CUDA(cudaMalloc(&a, 1 * kMiB));
  CHECK_CUDA(cudaMallocAsync(&b, 3 * kMiB, stream));
  CHECK_CUDA(cudaMallocAsync(&c, 5 * kMiB, stream));
  CHECK_CUDA(cudaMallocManaged(&m, 2 * kMiB));
  CHECK_CUDA(cudaMemsetAsync(c, 0, 5 * kMiB, stream));
  CHECK_CUDA(cudaFreeAsync(b, stream));
  CHECK_CUDA(cudaStreamSynchronize(stream));
  CHECK_CUDA(cudaFreeAsync(c, stream));
  CHECK_CUDA(cudaStreamSynchronize(stream));
  CHECK_CUDA(cudaFree(m));
  CHECK_CUDA(cudaFree(a));
  CHECK_CUDA(cudaStreamDestroy(stream));
  std::printf("profile_target: done\n");
  return 0;
}
