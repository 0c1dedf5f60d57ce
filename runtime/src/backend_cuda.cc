// The CUDA backend: one CudaDevice (stream-ordered pool,
// compute and copy streams) per emulated rank, pinned host arenas, the CUDA
// kernels and cuBLAS on each device's compute stream.
#include <cuda_runtime_api.h>

#include "memplan/runtime/backend.h"
#include "memplan/common/check.h"
#include "memplan/kernels/fp8_cuda.h"
#include "memplan/kernels/ops_cuda.h"
#include "memplan/runtime/cuda_device.h"

namespace memplan::runtime {
namespace {

cudaStream_t StreamOf(Device& d) {
  auto* cuda = dynamic_cast<CudaDevice*>(&d);
  MEMPLAN_CHECK(cuda != nullptr, "the cuda backend runs on CudaDevices");
  return static_cast<cudaStream_t>(cuda->compute_stream());
}

void Check(cudaError_t e, const char* what) {
  MEMPLAN_CHECK(e == cudaSuccess, (std::string(what) + ": " + cudaGetErrorString(e)).c_str());
}

class CudaBackend final : public Backend {
 public:
  // The process's GPU becomes its current device (NCCL and cudaMemGetInfo
  // read the current one).
  explicit CudaBackend(bool arena) : arena_(arena), device_(LocalCudaDevice()) { cudaSetDevice(device_); }

  std::string device_name() const override {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, device_) != cudaSuccess) return "cuda";
    return std::string(prop.name);
  }

  Expected<std::unique_ptr<Device>> MakeDevice(const std::string& name, int64_t capacity_bytes,
                                               int64_t alignment) override {
    CudaDevice::Options o;
    o.name = name;
    o.capacity_bytes = capacity_bytes;
    o.arena = arena_;
    o.alignment = alignment;
    o.device = device_;
    auto d = CudaDevice::Create(o);
    if (!d.ok()) return d.error();
    return std::unique_ptr<Device>(std::move(*d));
  }

  Expected<std::unique_ptr<HostArena>> MakeHostArena(const std::string& name, int64_t capacity_bytes) override {
    return MakePinnedArena(capacity_bytes, name);
  }

  std::unique_ptr<kernels::Ops> MakeOps(Device& d, const OpsMemory& memory) override {
    MEMPLAN_CHECK(memory.gemm_workspace.bytes >= kernels::GemmWorkspaceBytes() &&
                      memory.scratch.bytes >= kernels::KernelScratchBytes(),
                  "the kernels' planned workspace and scratch are missing");
    return kernels::MakeCudaOps(StreamOf(d), {memory.gemm_workspace.ptr, memory.scratch.ptr});
  }

  void Quantize(Device& d, const float* x, int64_t rows, int64_t cols, uint8_t* values, float* scales) override {
    kernels::Fp8BlockLayout l;
    l.rows = rows;
    l.cols = cols;
    int rc = kernels::QuantizeFp8BlockwiseCuda(x, l, kernels::ScaleMode::kAmax, values, scales, StreamOf(d));
    MEMPLAN_CHECK(rc == 0, "FP8 quantization failed");
  }

  void Dequantize(Device& d, const uint8_t* values, const float* scales, int64_t rows, int64_t cols,
                  float* y) override {
    kernels::Fp8BlockLayout l;
    l.rows = rows;
    l.cols = cols;
    int rc = kernels::DequantizeFp8BlockwiseCuda(values, scales, l, y, StreamOf(d));
    MEMPLAN_CHECK(rc == 0, "FP8 dequantization failed");
  }

  void ToHost(Device& d, void* dst, const void* src, int64_t bytes) override {
    cudaStream_t s = StreamOf(d);
    Check(cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes), cudaMemcpyDefault, s), "cudaMemcpyAsync");
    Check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
  }

  void FromHost(Device& d, void* dst, const void* src, int64_t bytes) override {
    cudaStream_t s = StreamOf(d);
    Check(cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes), cudaMemcpyDefault, s), "cudaMemcpyAsync");
    // The source may be a temporary of the caller's.
    Check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
  }

  void Finish(Device& d) override { Check(cudaStreamSynchronize(StreamOf(d)), "cudaStreamSynchronize"); }

  std::vector<std::pair<std::string, void*>> Streams(Device& d) override {
    auto& cuda = dynamic_cast<CudaDevice&>(d);
    std::vector<std::pair<std::string, void*>> out{{"compute", cuda.compute_stream()}};
    for (int q = 0; q < kQueueCount; ++q) {
      out.emplace_back(std::string(QueueName(static_cast<Queue>(q))), cuda.queue_stream(static_cast<Queue>(q)));
    }
    return out;
  }

  int64_t DeviceBytesInUse() override {
    cudaFree(nullptr);  // creates the context if nothing has yet
    size_t free_bytes = 0, total_bytes = 0;
    if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) {
      cudaGetLastError();
      return 0;
    }
    return static_cast<int64_t>(total_bytes - free_bytes);
  }

 private:
  bool arena_;  // one block per device placed by the planner's heap, or a pool
  int device_;  // one GPU per local rank under mpirun (LocalCudaDevice)
};

}  // namespace

std::unique_ptr<Backend> MakeCudaBackend(bool arena) {
  if (!CudaRuntimeAvailable()) return nullptr;
  return std::make_unique<CudaBackend>(arena);
}

}  // namespace memplan::runtime
