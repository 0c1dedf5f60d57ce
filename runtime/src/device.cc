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

namespace memplan::runtime {

BufferWitness ReadWitness(const std::byte* raw, int64_t bytes, bool scan) {
  const auto canary = static_cast<std::byte>(kWitnessCanary);
  BufferWitness w;
  const std::byte* payload = raw + kWitnessRedZone;
  // A red zone byte counts as overwritten from the first one that differs,
  // nearest the payload: the extent of the overrun.
  for (int64_t i = 0; i < kWitnessRedZone; ++i) {
    if (payload[bytes + i] != canary) w.overrun_bytes = i + 1;
    if (payload[-1 - i] != canary) w.underrun_bytes = i + 1;
  }
  if (scan) {
    int64_t end = bytes;
    while (end > 0 && payload[end - 1] == canary) --end;
    w.touched_bytes = end;
  }
  return w;
}

}  // namespace memplan::runtime
