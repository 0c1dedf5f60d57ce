// A backend: what the executor and the activation manager need to run on
// one kind of device. It makes the devices (memory pools with copy
// engines), the host arenas that receive host offloads, and the kernels
// that run in order with a device's allocations; it converts to and from
// FP8 and copies synchronously between device and plain host memory (the
// pipeline mailbox, the loss, dumps).
//
//   host   HostDevice arenas placed by the planner's best-fit heap, copy
//          engines as worker threads, CPU reference kernels.
//   cuda   CudaDevice (stream-ordered pool, compute and copy streams),
//          pinned host arenas, CUDA kernels and cuBLAS on the compute stream.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "memplan/common/status.h"
#include "memplan/kernels/ops.h"
#include "memplan/runtime/device.h"
#include "memplan/runtime/host_device.h"

namespace memplan::runtime {

// Device memory the kernels of one rank hold for the whole run:
// GemmWorkspaceBytes() and KernelScratchBytes() (kernels/ops.h).
struct OpsMemory {
  Buffer gemm_workspace;
  Buffer scratch;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string device_name() const = 0;
  // One rank's device memory (`capacity_bytes` is a bound, not a reservation).
  // Arenas round every buffer up to `alignment` bytes: the planner's 256 for
  // activations (its placement), 4 (fp32 words, packed) for static memory,
  // which is allocated once in order and never freed, so that its arena holds
  // exactly the plan's static bytes.
  virtual Expected<std::unique_ptr<Device>> MakeDevice(const std::string& name, int64_t capacity_bytes,
                                                       int64_t alignment) = 0;
  // Eager execution's device (docs/runtime.md, "Eager execution"): a
  // general-purpose allocator, one allocation per buffer: the system
  // allocator on the host, the stream-ordered pool on CUDA (the backend made
  // without arenas).
  virtual Expected<std::unique_ptr<Device>> MakeEagerDevice(const std::string& name, int64_t capacity_bytes) {
    return MakeDevice(name, capacity_bytes, 256);
  }
  // Host memory that receives host offloads (pinned on CUDA).
  virtual Expected<std::unique_ptr<HostArena>> MakeHostArena(const std::string& name, int64_t capacity_bytes) = 0;
  // Kernels running in order with `device`'s allocations and frees, using
  // `memory` (planned static buffers, docs/accounting.md) for the cuBLAS
  // workspace and their scratch; the reference kernels need neither.
  virtual std::unique_ptr<kernels::Ops> MakeOps(Device& device, const OpsMemory& memory) = 0;
  // FP8 E4M3 1x128 blockwise, on `device`'s compute stream.
  virtual void Quantize(Device& device, const float* x, int64_t rows, int64_t cols, uint8_t* values,
                        float* scales) = 0;
  virtual void Dequantize(Device& device, const uint8_t* values, const float* scales, int64_t rows, int64_t cols,
                          float* y) = 0;
  // The same for a bf16 tensor (bit patterns): quantized from bf16 (each
  // value widened exactly first), dequantized into bf16 (rounded to nearest
  // even). Only backends that execute bf16 implement them.
  virtual void QuantizeBf16(Device& device, const uint16_t* x, int64_t rows, int64_t cols, uint8_t* values,
                            float* scales);
  virtual void DequantizeBf16(Device& device, const uint8_t* values, const float* scales, int64_t rows, int64_t cols,
                              uint16_t* y);
  // Synchronous copies between `device` memory and plain host memory, in
  // order with the device's compute stream.
  virtual void ToHost(Device& device, void* dst, const void* src, int64_t bytes) = 0;
  virtual void FromHost(Device& device, void* dst, const void* src, int64_t bytes) = 0;
  // Waits until everything issued on `device` is done.
  virtual void Finish(Device& device) = 0;
  // Bytes in use on the backend's device right now (cudaMemGetInfo's total
  // minus free, which counts the context and the driver's page granules);
  // 0 on the host backend.
  virtual int64_t DeviceBytesInUse() { return 0; }
  // The native streams `device` runs on, named ("compute", "d2h", "h2d",
  // "link"; cudaStream_t on cuda), for the GPU timeline; none on the host.
  virtual std::vector<std::pair<std::string, void*>> Streams(Device&) { return {}; }
};

// `copy_jitter_us` (tests): each copy first sleeps a pseudo-random 0..N us.
std::unique_ptr<Backend> MakeHostBackend(int64_t copy_jitter_us = 0);
// In the CUDA plugin (cuda_plugin.h; memplan reaches it through
// LoadCudaPlugin): nullptr when no device is visible.
// `arena`: each device is one block placed by the planner's heap (exact
// bytes); otherwise a stream-ordered pool (cuda_device.h).
std::unique_ptr<Backend> MakeCudaBackend(bool arena = true);

}  // namespace memplan::runtime
