// The CUDA side of the runtime, loaded when a command needs it
// (docs/runtime.md, "The CUDA plugin").
//
// memplan links no CUDA library: mapping and relocating cudart, cuBLAS,
// cuBLASLt and CUPTI costs a quarter of a second and tens of thousands of
// page faults, which every planning command would pay. `run --backend cuda`
// opens libmemplan_cuda.so instead: the CUDA device (cuda_device.h), the
// CUDA backend with its kernels and cuBLAS, and CUPTI. The plugin is built
// beside memplan from the same sources and resolves the rest of the runtime
// from the executable (linked with --export-dynamic).
#pragma once

#include <memory>

#include "memplan/common/status.h"
#include "memplan/runtime/backend.h"
#include "memplan/runtime/comm.h"
#include "memplan/traces/gpu_profiler.h"

namespace memplan::runtime {

inline constexpr int kCudaPluginAbi = 2;

struct CudaPlugin {
  int abi = 0;                   // kCudaPluginAbi of the plugin's build
  const char* version = nullptr;  // the project version it was built as
  // MakeCudaBackend (backend.h): nullptr when no device is visible.
  std::unique_ptr<Backend> (*make_backend)(bool arena) = nullptr;
  // CUPTI (traces/cupti_source.h); an error when it cannot start.
  Expected<std::unique_ptr<traces::GpuProfiler>> (*start_profiler)(const traces::CuptiOptions&) = nullptr;
  // NCCL over the ranks of `bootstrap` (a collective of it: rank 0's unique
  // id travels by bootstrap's AllGather), on this process's GPU; an error
  // when the plugin was built without NCCL or NCCL cannot start.
  Expected<std::unique_ptr<DeviceCommunicator>> (*make_nccl)(Communicator& bootstrap) = nullptr;
};

// The plugin's entry point: extern "C" const CudaPlugin* memplan_cuda_plugin().
inline constexpr const char* kCudaPluginSymbol = "memplan_cuda_plugin";
inline constexpr const char* kCudaPluginFile = "libmemplan_cuda.so";

// Opens the plugin once per process and checks that it matches this build.
// Looks at $MEMPLAN_CUDA_PLUGIN (a path), then beside the running
// executable, then the dynamic linker's search path. Errors (kRuntime) say
// where it looked and why it failed (not built, a missing CUDA library).
Expected<const CudaPlugin*> LoadCudaPlugin();

}  // namespace memplan::runtime
