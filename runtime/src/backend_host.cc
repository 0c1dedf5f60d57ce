// The host backend: HostDevice arenas placed by the
// planner's best-fit heap, copy engines as worker threads, CPU reference
// kernels.
#include <cstring>
#include <vector>

#include "memplan/runtime/backend.h"
#include "memplan/kernels/fp8.h"
#include "memplan/kernels/ops.h"
#include "memplan/common/status.h"

namespace memplan::runtime {
namespace {

class HostBackend final : public Backend {
 public:
  explicit HostBackend(int64_t jitter_us) : jitter_us_(jitter_us) {}

  std::string device_name() const override { return "CPU reference kernels"; }

  Expected<std::unique_ptr<Device>> MakeDevice(const std::string& name, int64_t capacity_bytes,
                                               int64_t alignment) override {
    HostDevice::Options o;
    o.capacity_bytes = capacity_bytes;
    o.alignment = alignment;
    o.name = name;
    o.copy_jitter_us = jitter_us_;
    return std::unique_ptr<Device>(std::make_unique<HostDevice>(o));
  }

  Expected<std::unique_ptr<Device>> MakeEagerDevice(const std::string& name, int64_t) override {
    HostDevice::Options o;
    o.name = name;
    o.copy_jitter_us = jitter_us_;
    o.system_allocator = true;
    return std::unique_ptr<Device>(std::make_unique<HostDevice>(o));
  }

  Expected<std::unique_ptr<HostArena>> MakeHostArena(const std::string& name, int64_t capacity_bytes) override {
    HostArena::Options o;
    o.capacity_bytes = capacity_bytes;
    o.name = name;
    return std::make_unique<HostArena>(o);
  }

  std::unique_ptr<kernels::Ops> MakeOps(Device&, const OpsMemory&) override { return kernels::MakeRefOps(); }

  void Quantize(Device&, const float* x, int64_t rows, int64_t cols, uint8_t* values, float* scales) override {
    kernels::Fp8BlockLayout l;
    l.rows = rows;
    l.cols = cols;
    kernels::QuantizeFp8BlockwiseRef(x, l, kernels::ScaleMode::kAmax, values, scales);
  }

  void Dequantize(Device&, const uint8_t* values, const float* scales, int64_t rows, int64_t cols, float* y) override {
    kernels::Fp8BlockLayout l;
    l.rows = rows;
    l.cols = cols;
    kernels::DequantizeFp8BlockwiseRef(values, scales, l, y);
  }

  void QuantizeBf16(Device&, const uint16_t* x, int64_t rows, int64_t cols, uint8_t* values, float* scales) override {
    kernels::Fp8BlockLayout l;
    l.rows = rows;
    l.cols = cols;
    kernels::QuantizeFp8BlockwiseRef(x, l, kernels::ScaleMode::kAmax, values, scales);
  }
  void DequantizeBf16(Device&, const uint8_t* values, const float* scales, int64_t rows, int64_t cols,
                      uint16_t* y) override {
    kernels::Fp8BlockLayout l;
    l.rows = rows;
    l.cols = cols;
    std::vector<float> f32(static_cast<size_t>(rows * cols));
    kernels::DequantizeFp8BlockwiseRef(values, scales, l, f32.data());
    for (size_t i = 0; i < f32.size(); ++i) y[i] = kernels::FloatToBf16(f32[i]);
  }

  void ToHost(Device&, void* dst, const void* src, int64_t bytes) override {
    std::memcpy(dst, src, static_cast<size_t>(bytes));
  }
  void FromHost(Device&, void* dst, const void* src, int64_t bytes) override {
    std::memcpy(dst, src, static_cast<size_t>(bytes));
  }
  void Finish(Device& d) override { d.Synchronize(); }

 private:
  int64_t jitter_us_;
};

}  // namespace

std::unique_ptr<Backend> MakeHostBackend(int64_t copy_jitter_us) {
  return std::make_unique<HostBackend>(copy_jitter_us);
}

// Backends that do not execute bf16 (the executor refuses bf16 plans there
// before anything runs).
void Backend::QuantizeBf16(Device&, const uint16_t*, int64_t, int64_t, uint8_t*, float*) {
  ThrowError(ErrorCode::kRuntime, "bf16 tensors in FP8: not supported by the " + device_name() + " backend");
}
void Backend::DequantizeBf16(Device&, const uint8_t*, const float*, int64_t, int64_t, uint16_t*) {
  ThrowError(ErrorCode::kRuntime, "bf16 tensors in FP8: not supported by the " + device_name() + " backend");
}

}  // namespace memplan::runtime
