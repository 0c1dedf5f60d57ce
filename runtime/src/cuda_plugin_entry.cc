// libmemplan_cuda.so's entry point (cuda_plugin.h): the CUDA backend and
// CUPTI, handed to the executable that opened it.
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

const memplan::runtime::CudaPlugin kPlugin{
    memplan::runtime::kCudaPluginAbi,
    MEMPLAN_VERSION,
    &memplan::runtime::MakeCudaBackend,
    &StartProfiler,
};

}  // namespace

extern "C" __attribute__((visibility("default"))) const memplan::runtime::CudaPlugin* memplan_cuda_plugin() {
  return &kPlugin;
}
