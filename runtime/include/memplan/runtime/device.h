// Devices: the memory and copy engines the runtime executes a plan on.
//
// Glossary
//   buffer   one block of a device's memory, returned by Allocate() and given
//            back by Free(). Its `bytes` are the requested size; the arena
//            rounds it up to its alignment (256 B by default, like the
//            planner's placement heap).
//   queue    a copy engine: d2h (device -> host), h2d (host -> device) and
//            link (between pipeline ranks, for remote offload). Each queue
//            runs its copies one at a time, first in first out, overlapped
//            with the caller (docs/design.md, "Backends").
//   event    completion flag of one asynchronous copy: a host flag on the
//            host backend, a native event (cudaEvent_t) on the CUDA backend.
//
// Accounting (the names MEASURED.json uses):
//   allocated_bytes   live requested bytes (not aligned);
//   allocated_peak    the maximum of allocated_bytes: compare with the plan's
//                     `lower_bound`;
//   peak/high_water   the arena's high-water mark (offset + aligned size):
//                     compare with the plan's `peak`. On the CUDA backend
//                     the pool's reserved high-water mark instead (the
//                     driver places buffers, not BestFitHeap).
//
// A device is driven from one thread (the compute stream): Allocate, Free,
// CopyAsync and Wait are called in program order, so byte counts do not depend
// on how fast the copy engines run. A copy is ordered after everything issued
// on the compute stream before it; copies on different queues are unordered
// with respect to each other unless the caller Waits on one before issuing
// the next.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <mutex>
#include <string_view>

#include "memplan/common/status.h"
#include "memplan/traces/footprint.h"

namespace memplan::runtime {

// One block of device memory. Empty (ptr == nullptr) for zero bytes.
struct Buffer {
  std::byte* ptr = nullptr;  // host-visible on the host backend
  int64_t offset = -1;       // offset in the owning arena, -1 when empty
                             // (0 on the CUDA backend: its pool has no offsets)
  int64_t bytes = 0;         // requested bytes

  bool empty() const { return ptr == nullptr; }
  template <class T>
  T* as() const {
    return reinterpret_cast<T*>(ptr);
  }
};

enum class Queue : uint8_t { kD2H, kH2D, kLink };
inline constexpr int kQueueCount = 3;
std::string_view QueueName(Queue q);  // "d2h", "h2d", "link"

namespace internal {
// How Event reaches a backend's native completion object without this header
// naming its type: query (is it complete?), synchronize (block the calling
// thread until it is) and destroy (release it, once no Event refers to it).
struct NativeEventOps {
  bool (*query)(void* native);
  void (*synchronize)(void* native);
  void (*destroy)(void* native);
};

struct EventState {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  // A backend's completion object (a cudaEvent_t), or nullptr for a host
  // event; owned: released through `ops` with the state.
  void* native = nullptr;
  const NativeEventOps* ops = nullptr;

  EventState() = default;
  EventState(const EventState&) = delete;
  EventState& operator=(const EventState&) = delete;
  ~EventState() {
    if (native != nullptr) ops->destroy(native);
  }
};
}  // namespace internal

// Completion of one asynchronous copy. Copyable (shared state); a
// default-constructed Event is already complete. Thread-safe.
//
// A host event is completed by Complete(); a native event is completed by
// its backend (on the CUDA backend: when its stream reaches it), and done()
// and Wait() ask the backend.
class Event {
 public:
  Event() = default;
  // A pending host event, completed by Complete() (called by a copy engine).
  static Event Pending();
  // An event over a backend's completion object `native` (non-null), which
  // the event owns from now on and releases through ops->destroy.
  static Event Native(void* native, const internal::NativeEventOps* ops);
  bool done() const;
  // Blocks the calling thread until complete.
  void Wait() const;
  // Completes a host event; must not be called on a native one.
  void Complete() const;
  // The native completion object, or nullptr (host or default event).
  void* native() const { return state_ ? state_->native : nullptr; }

 private:
  std::shared_ptr<internal::EventState> state_;
};

// The eager witness's reading of one live buffer (Device::Witness): what
// the kernels did to it, seen through a canary pattern written at its
// allocation and red zones either side (docs/runtime.md, "What each
// measurement sees").
struct BufferWitness {
  // One past the highest byte that no longer holds the canary (0: nothing
  // written). A value that happens to equal the canary byte at the very end
  // reads as untouched: at most a few bytes, 1 in 256 per byte.
  int64_t touched_bytes = 0;
  int64_t overrun_bytes = 0;   // red-zone bytes written after the buffer's end
  int64_t underrun_bytes = 0;  // ... before its start
};

// The canary byte and the red zone of the eager witness.
inline constexpr unsigned char kWitnessCanary = 0xA5;
inline constexpr int64_t kWitnessRedZone = 256;

// The memory and copy engines of one (emulated) pipeline rank.
class Device {
 public:
  virtual ~Device() = default;
  virtual std::string_view name() const = 0;

  // A new buffer of `bytes` (>= 0; 0 gives an empty buffer). An error
  // (kRuntime, "... exhausted ...") when the memory cannot hold it; the
  // device is unchanged then.
  virtual Expected<Buffer> Allocate(int64_t bytes) = 0;
  // Gives a buffer back; first waits for every in-flight copy that reads or
  // writes it ("a free waits for its copy"). Freeing an empty buffer is a
  // no-op; freeing anything else that is not live aborts (MEMPLAN_CHECK).
  virtual void Free(Buffer buffer) = 0;

  virtual int64_t capacity_bytes() const = 0;
  virtual int64_t high_water() const = 0;
  // The most bytes live buffers occupied at once after the allocator's own
  // rounding (a pool's used mark); high_water() - used_high_water() is
  // what the allocator's placement added. Arenas: high_water().
  virtual int64_t used_high_water() const { return high_water(); }
  // Adds where this device's memory lies to `regions`, so that a
  // profiler's allocation records can be attributed to it: a block's
  // address range (arenas), or every address it allocated (pools). Host
  // devices: nothing (a profiler sees no device memory of theirs).
  virtual void AddRegions(traces::OwnerRegions& regions) const { (void)regions; }
  // MEASURED.json's `peak`: the same as high_water().
  int64_t peak() const { return high_water(); }
  virtual int64_t allocated_bytes() const = 0;
  virtual int64_t allocated_peak() const = 0;
  // allocated_peak() starts again from the bytes live now (memplan run
  // --steps: each step's own peak). A system-allocator device's high_water
  // is that peak, and starts again with it.
  virtual void ResetAllocatedPeak() = 0;

  // Enqueues a copy of `bytes` (>= 0) from src to dst on `queue` and returns
  // its completion event. The ranges must not overlap; when they lie in host
  // arenas they must be inside live buffers, which then wait for the copy
  // before they are freed. A zero-byte copy returns a complete event.
  virtual Event CopyAsync(void* dst, const void* src, int64_t bytes, Queue queue) = 0;
  // Orders the compute stream after `event`: whatever is issued on the
  // device afterwards sees the copy's result. The host backend blocks the
  // calling thread until it is complete; the CUDA backend makes its compute
  // stream wait (the calling thread does not block).
  virtual void Wait(const Event& event) = 0;
  // Blocks the calling thread until every queue (and, on the CUDA backend,
  // the compute stream) is empty.
  virtual void Synchronize() = 0;

  // The eager witness: from now on every allocation is filled with
  // kWitnessCanary and carries kWitnessRedZone guard bytes either side,
  // outside its bytes (allocated_bytes and the peaks count what was asked
  // for; a pool's own marks see the red zones). A device without it
  // returns false.
  virtual bool EnableWitness() { return false; }
  // The witness's reading of a live buffer allocated under it (nullopt
  // otherwise). `scan`: also find its touched bytes (reads the whole
  // buffer); else only the red zones. Waits for the compute stream.
  virtual std::optional<BufferWitness> Witness(const Buffer& buffer, bool scan) const {
    (void)buffer;
    (void)scan;
    return std::nullopt;
  }
};

// The witness's reading of `raw` (red zone, payload of `bytes`, red zone),
// host memory: shared by the devices.
BufferWitness ReadWitness(const std::byte* raw, int64_t bytes, bool scan);

}  // namespace memplan::runtime
