#include "memplan/runtime/device.h"

#include <string>

#include "memplan/common/check.h"
#include "memplan/runtime/cuda_device.h"

namespace memplan::runtime {

std::string_view QueueName(Queue q) {
  switch (q) {
    case Queue::kD2H: return "d2h";
    case Queue::kH2D: return "h2d";
    case Queue::kLink: return "link";
  }
  return "unknown";
}

Event Event::Pending() {
  Event e;
  e.state_ = std::make_shared<internal::EventState>();
  return e;
}

Event Event::Native(void* native, const internal::NativeEventOps* ops) {
  MEMPLAN_CHECK(native != nullptr && ops != nullptr, "a native event needs its object and its operations");
  Event e;
  e.state_ = std::make_shared<internal::EventState>();
  e.state_->native = native;
  e.state_->ops = ops;
  return e;
}

bool Event::done() const {
  if (!state_) return true;
  if (state_->native != nullptr) return state_->ops->query(state_->native);
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->done;
}

void Event::Wait() const {
  if (!state_) return;
  if (state_->native != nullptr) {
    state_->ops->synchronize(state_->native);
    return;
  }
  std::unique_lock<std::mutex> lock(state_->mu);
  state_->cv.wait(lock, [&] { return state_->done; });
}

void Event::Complete() const {
  if (!state_) return;
  MEMPLAN_CHECK(state_->native == nullptr, "a native event is completed by its backend, not by Complete()");
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->done = true;
  }
  state_->cv.notify_all();
}

}  // namespace memplan::runtime

#ifndef MEMPLAN_HAVE_CUDA_RUNTIME
// Built without CUDA (runtime/meson.build compiles cuda_device.cc only with
// it): the CUDA backend's entry points exist and report that it is missing,
// so callers need no build-time switch of their own.
namespace memplan::runtime {

namespace {
Error NoCuda(std::string_view what) {
  return Error{ErrorCode::kRuntime,
               std::string(what) + ": memplan was built without CUDA (configure with -Dcuda=enabled)"};
}

[[noreturn]] void NoCudaDevice() {
  ::memplan::internal::CheckFailed(__FILE__, __LINE__, "CudaDevice",
                                   "no CudaDevice exists without CUDA: Create() always fails");
}
}  // namespace

namespace internal {
struct CudaDeviceState {};
}  // namespace internal

bool CudaRuntimeAvailable() { return false; }

Expected<std::unique_ptr<CudaDevice>> CudaDevice::Create(Options options) { return NoCuda(options.name); }

// Never called (no object is ever made), but a unique_ptr<CudaDevice> and the
// vtable still name them.
CudaDevice::CudaDevice(std::unique_ptr<internal::CudaDeviceState> state) : impl_(std::move(state)) {}
CudaDevice::~CudaDevice() = default;
std::string_view CudaDevice::name() const { NoCudaDevice(); }
Expected<Buffer> CudaDevice::Allocate(int64_t) { NoCudaDevice(); }
void CudaDevice::Free(Buffer) { NoCudaDevice(); }
int64_t CudaDevice::capacity_bytes() const { NoCudaDevice(); }
int64_t CudaDevice::high_water() const { NoCudaDevice(); }
int64_t CudaDevice::allocated_bytes() const { NoCudaDevice(); }
int64_t CudaDevice::allocated_peak() const { NoCudaDevice(); }
Event CudaDevice::CopyAsync(void*, const void*, int64_t, Queue) { NoCudaDevice(); }
void CudaDevice::Wait(const Event&) { NoCudaDevice(); }
void CudaDevice::Synchronize() { NoCudaDevice(); }
int64_t CudaDevice::used_high_water() const { NoCudaDevice(); }
int64_t CudaDevice::reserved_bytes() const { NoCudaDevice(); }
int64_t CudaDevice::live_buffers() const { NoCudaDevice(); }
int CudaDevice::device() const { NoCudaDevice(); }
void* CudaDevice::compute_stream() const { NoCudaDevice(); }
void* CudaDevice::queue_stream(Queue) const { NoCudaDevice(); }
void* CudaDevice::pool() const { NoCudaDevice(); }
void CudaDevice::AddRegions(traces::OwnerRegions&) const { NoCudaDevice(); }
std::pair<void*, int64_t> CudaDevice::arena_block() const { NoCudaDevice(); }

Expected<std::unique_ptr<HostArena>> MakePinnedArena(int64_t /*capacity_bytes*/, std::string name) {
  return NoCuda(name);
}

}  // namespace memplan::runtime
#endif  // MEMPLAN_HAVE_CUDA_RUNTIME
