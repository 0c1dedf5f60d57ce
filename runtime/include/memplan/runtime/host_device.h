// The host backend: device memory and pinned host memory emulated in host
// arenas, copy engines as worker threads.
//
// HostArena is one contiguous block of host memory of a fixed capacity whose
// buffers are placed by memplan::BestFitHeap, the allocator the planner
// simulates to predict `peak`: for the same sequence of allocations and
// frees the arena reaches exactly the predicted high-water mark. It serves
// both as a rank's device memory (inside HostDevice) and as the pinned-host
// stand-in that receives host offloads.
//
// HostDevice is a Device over one HostArena with three copy engines (d2h,
// h2d, link), each a worker thread running memcpy in FIFO order. Copies are
// asynchronous with respect to the calling thread; allocation and frees
// happen only on the calling thread, in program order, so the byte
// accounting is deterministic whatever the worker threads' timing.
//
// Limits: capacity is reserved up front (the operating system backs pages
// lazily, except for pinned arenas); pointers are plain host pointers, so
// kernels are the CPU references.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "memplan/common/best_fit_heap.h"
#include "memplan/runtime/device.h"

namespace memplan::runtime {

namespace internal {
class CopyEngine;
}  // namespace internal

class HostArena {
 public:
  struct Options {
    int64_t capacity_bytes = int64_t{1} << 30;  // fixed arena size
    int64_t alignment = 256;                    // BestFitHeap rounding, the planner's
    std::string name = "host";                  // used in error messages
    // Where the block comes from: `allocate(capacity_bytes)` returns
    // capacity_bytes of memory aligned to 4096 B (non-null: it cannot fail
    // here, so a factory that can fail allocates first and hands the block
    // over), and `release(block)` gives it back when the arena is destroyed.
    // Both set or neither; unset, the block is anonymous mmap(2) pages.
    // MakePinnedArena (cuda_device.h) uses them for page-locked memory.
    std::function<std::byte*(int64_t)> allocate;
    std::function<void(std::byte*)> release;
  };

  explicit HostArena(Options options);
  ~HostArena();
  HostArena(const HostArena&) = delete;
  HostArena& operator=(const HostArena&) = delete;

  // Best-fit placement (lowest offset among equal sizes). An error (kRuntime)
  // when the arena would grow past its capacity; the arena is unchanged then.
  // O(log n).
  Expected<Buffer> Allocate(int64_t bytes);
  // Waits for every copy fenced on the buffer, then frees it.
  void Free(Buffer buffer);
  // Registers an in-flight copy touching [ptr, ptr + bytes), which must lie
  // inside one live buffer: its Free waits for `event`.
  void Fence(const void* ptr, int64_t bytes, const Event& event);
  bool Contains(const void* ptr) const;
  // The live arena (host or device) whose memory holds `ptr`, or nullptr.
  static HostArena* Owner(const void* ptr);

  const std::string& name() const { return options_.name; }
  int64_t capacity_bytes() const { return options_.capacity_bytes; }
  int64_t alignment() const { return options_.alignment; }
  // Highest offset + aligned size any buffer reached.
  int64_t high_water() const;
  // Live requested bytes and their maximum over time.
  int64_t allocated_bytes() const;
  int64_t allocated_peak() const;
  void ResetAllocatedPeak();
  // Live bytes after alignment (what the heap holds).
  int64_t aligned_allocated_bytes() const;
  int64_t live_buffers() const;

 private:
  struct Block {
    int64_t bytes = 0;
    std::vector<Event> fences;
  };

  Options options_;
  std::byte* base_ = nullptr;
  mutable std::mutex mu_;
  BestFitHeap heap_;
  std::map<int64_t, Block> live_;  // offset -> block
  int64_t high_water_ = 0;
  int64_t allocated_bytes_ = 0;
  int64_t allocated_peak_ = 0;
};

class HostDevice final : public Device {
 public:
  struct Options {
    int64_t capacity_bytes = int64_t{1} << 30;
    int64_t alignment = 256;
    std::string name = "host";
    // Testing aid: each copy first sleeps a pseudo-random 0..N microseconds
    // (a fixed sequence per queue), to shake the copy engines' timing.
    int64_t copy_jitter_us = 0;
    // Eager execution (docs/runtime.md, "Eager execution"): every buffer is
    // its own allocation from the system allocator (malloc of exactly its
    // bytes, so AddressSanitizer checks each tensor's bounds), not a place
    // in the arena; capacity and alignment are then unused. The caller
    // waits for a buffer's copies before freeing it.
    bool system_allocator = false;
  };

  explicit HostDevice(Options options);
  // Drains the copy queues, then releases the arena.
  ~HostDevice() override;

  std::string_view name() const override { return arena_.name(); }
  Expected<Buffer> Allocate(int64_t bytes) override;
  void Free(Buffer buffer) override;
  int64_t capacity_bytes() const override { return arena_.capacity_bytes(); }
  int64_t high_water() const override { return system_ ? heap_peak_ : arena_.high_water(); }
  int64_t allocated_bytes() const override { return system_ ? heap_bytes_ : arena_.allocated_bytes(); }
  int64_t allocated_peak() const override { return system_ ? heap_peak_ : arena_.allocated_peak(); }
  void ResetAllocatedPeak() override {
    if (system_) {
      heap_peak_ = heap_bytes_;
    } else {
      arena_.ResetAllocatedPeak();
    }
  }

  // Fences the source and destination on whichever host arenas hold them
  // (this device's, a HostArena, another HostDevice's), then enqueues.
  Event CopyAsync(void* dst, const void* src, int64_t bytes, Queue queue) override;
  void Wait(const Event& event) override { event.Wait(); }
  void Synchronize() override;
  // The system allocator only (eager execution): the arena's buffers are
  // the planner's placement, not the kernels' statement.
  bool EnableWitness() override;
  std::optional<BufferWitness> Witness(const Buffer& buffer, bool scan) const override;

  HostArena& arena() { return arena_; }
  const HostArena& arena() const { return arena_; }
  // The worker thread running `queue`.
  std::thread::id queue_thread(Queue queue) const;
  // Bytes and copies completed on `queue` so far.
  int64_t copied_bytes(Queue queue) const;
  int64_t copies(Queue queue) const;
  // Testing aid: while held, `queue` starts no new copy (enqueued ones wait).
  void HoldQueue(Queue queue, bool held);

 private:
  HostArena arena_;
  // system_allocator: the live buffers (pointer -> bytes) and their bytes.
  bool system_ = false;
  std::map<const std::byte*, int64_t> heap_;
  int64_t heap_bytes_ = 0, heap_peak_ = 0;
  bool witness_ = false;  // EnableWitness: red zones either side of each buffer
  // Declared after the arena: destroyed (drained, joined) before it.
  std::unique_ptr<internal::CopyEngine> engines_[kQueueCount];
};

}  // namespace memplan::runtime
