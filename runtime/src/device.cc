#include "memplan/runtime/device.h"

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

bool Event::done() const {
  if (!state_) return true;
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->done;
}

void Event::Wait() const {
  if (!state_) return;
  std::unique_lock<std::mutex> lock(state_->mu);
  state_->cv.wait(lock, [&] { return state_->done; });
}

void Event::Complete() const {
  if (!state_) return;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->done = true;
  }
  state_->cv.notify_all();
}

}  // namespace memplan::runtime
