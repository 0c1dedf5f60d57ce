// libmemplan_cuda.so's entry point (cuda_plugin.h): the CUDA backend,
// CUPTI and NCCL, handed to the executable that opened it.
#include "memplan/runtime/backend.h"
#include "memplan/runtime/cuda_plugin.h"
#include "memplan/traces/cupti_source.h"

namespace {

memplan::Expected<std::unique_ptr<memplan::traces::GpuProfiler>> StartProfiler(
    const memplan::traces::CuptiOptions& options) {
  auto source = memplan::traces::CuptiSource::Start(options);
  if (!source) return source.error();
  return std::unique_ptr<memplan::traces::GpuProfiler>(std::move(*source));
}

#ifdef MEMPLAN_HAVE_NCCL
constexpr auto kMakeNccl = &memplan::runtime::MakeNcclCommunicator;
#else
memplan::Expected<std::unique_ptr<memplan::runtime::DeviceCommunicator>> NoNccl(memplan::runtime::Communicator&) {
  return memplan::Error{memplan::ErrorCode::kRuntime,
                        "the CUDA plugin was built without NCCL (libnccl and nccl.h in the CUDA toolkit)"};
}
constexpr auto kMakeNccl = &NoNccl;
#endif

const memplan::runtime::CudaPlugin kPlugin{
    memplan::runtime::kCudaPluginAbi,
    MEMPLAN_VERSION,
    &memplan::runtime::MakeCudaBackend,
    &StartProfiler,
    kMakeNccl,
};

}  // namespace

extern "C" __attribute__((visibility("default"))) const memplan::runtime::CudaPlugin* memplan_cuda_plugin() {
  return &kPlugin;
}
