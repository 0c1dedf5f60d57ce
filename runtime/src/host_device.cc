#include "memplan/runtime/host_device.h"

#include <cstdlib>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <new>

#include <sys/mman.h>
#include <string>

#include "memplan/common/check.h"
#include "memplan/kernels/ops.h"

namespace memplan::runtime {

namespace {

// Page alignment for the arena base, so that every buffer offset aligned to
// the heap's alignment is equally aligned in memory.
constexpr std::align_val_t kArenaBaseAlign{4096};

// Arenas alive in this process, so that a copy can fence whichever arena
// holds its source and destination. A handful at most: a linear scan.
std::mutex& RegistryMutex() {
  static std::mutex mu;
  return mu;
}
std::vector<HostArena*>& Registry() {
  static std::vector<HostArena*> arenas;
  return arenas;
}

std::string Describe(int64_t bytes) { return std::to_string(bytes) + " B"; }

}  // namespace

// ---------------------------------------------------------------- HostArena

HostArena::HostArena(Options options) : options_(std::move(options)), heap_(options_.alignment) {
  MEMPLAN_CHECK(options_.capacity_bytes > 0, "arena capacity must be positive");
  MEMPLAN_CHECK(options_.alignment > 0 && static_cast<size_t>(options_.alignment) <=
                                              static_cast<size_t>(kArenaBaseAlign),
                "arena alignment must be in (0, 4096]");
  MEMPLAN_CHECK(static_cast<bool>(options_.allocate) == static_cast<bool>(options_.release),
                "arena allocate and release hooks come in pairs");
  if (options_.allocate) {
    base_ = options_.allocate(options_.capacity_bytes);
    MEMPLAN_CHECK(base_ != nullptr, "arena allocate hook returned no memory");
    MEMPLAN_CHECK(reinterpret_cast<uintptr_t>(base_) % static_cast<uintptr_t>(kArenaBaseAlign) == 0,
                  "arena allocate hook returned memory not aligned to 4096 B");
  } else {
    // Anonymous pages, not the C heap: they are zero-filled on first touch
    // only, so an arena costs what the step touches rather than its
    // capacity, also where a malloc debugging mode (MALLOC_PERTURB_, which
    // Meson's test runner sets) would fill every heap allocation.
    void* p = ::mmap(nullptr, static_cast<size_t>(options_.capacity_bytes), PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    base_ = static_cast<std::byte*>(p);
  }
  std::lock_guard<std::mutex> lock(RegistryMutex());
  Registry().push_back(this);
}

HostArena::~HostArena() {
  {
    std::lock_guard<std::mutex> lock(RegistryMutex());
    auto& r = Registry();
    r.erase(std::find(r.begin(), r.end(), this));
  }
  // Copies still fenced on live buffers must not write into freed memory.
  for (auto& [offset, block] : live_) {
    for (const Event& e : block.fences) e.Wait();
  }
  if (options_.release) {
    options_.release(base_);
  } else {
    ::munmap(base_, static_cast<size_t>(options_.capacity_bytes));
  }
}

Expected<Buffer> HostArena::Allocate(int64_t bytes) {
  MEMPLAN_CHECK(bytes >= 0, "negative allocation");
  if (bytes == 0) return Buffer{};
  std::lock_guard<std::mutex> lock(mu_);
  int64_t aligned = heap_.AlignedSize(bytes);
  if (aligned > options_.capacity_bytes) {
    return Error{ErrorCode::kRuntime, options_.name + " arena exhausted: " + Describe(bytes) +
                                          " requested, capacity is " + Describe(options_.capacity_bytes)};
  }
  int64_t offset = heap_.Allocate(bytes);
  if (offset + aligned > options_.capacity_bytes) {
    // Only growth from the top can pass the capacity, and no free block
    // touches the top, so freeing the block restores the heap exactly (its
    // own high-water mark is not used: high_water_ counts successes only).
    heap_.Free(offset);
    return Error{ErrorCode::kRuntime,
                 options_.name + " arena exhausted: " + Describe(bytes) + " requested with " +
                     Describe(allocated_bytes_) + " in use (" + Describe(heap_.allocated_bytes()) +
                     " aligned), capacity is " + Describe(options_.capacity_bytes)};
  }
  live_.emplace(offset, Block{bytes, {}});
  high_water_ = std::max(high_water_, offset + aligned);
  allocated_bytes_ += bytes;
  allocated_peak_ = std::max(allocated_peak_, allocated_bytes_);
  return Buffer{base_ + offset, offset, bytes};
}

void HostArena::Free(Buffer buffer) {
  if (buffer.empty()) return;
  MEMPLAN_CHECK(buffer.ptr == base_ + buffer.offset, "buffer freed on the wrong arena");
  std::vector<Event> fences;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = live_.find(buffer.offset);
    MEMPLAN_CHECK(it != live_.end(), "free of a buffer that is not live");
    fences.swap(it->second.fences);
  }
  // Without the lock: the copy engines never take it, but other callers may.
  for (const Event& e : fences) e.Wait();
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.find(buffer.offset);
  MEMPLAN_CHECK(it != live_.end(), "buffer freed twice concurrently");
  allocated_bytes_ -= it->second.bytes;
  live_.erase(it);
  heap_.Free(buffer.offset);
}

void HostArena::Fence(const void* ptr, int64_t bytes, const Event& event) {
  int64_t offset = static_cast<const std::byte*>(ptr) - base_;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.upper_bound(offset);
  MEMPLAN_CHECK(it != live_.begin(), "copy touches arena memory that is not allocated");
  --it;
  MEMPLAN_CHECK(offset + bytes <= it->first + it->second.bytes, "copy runs past the end of its buffer");
  auto& fences = it->second.fences;
  std::erase_if(fences, [](const Event& e) { return e.done(); });
  fences.push_back(event);
}

bool HostArena::Contains(const void* ptr) const {
  auto p = static_cast<const std::byte*>(ptr);
  // Compare as integers: pointers into different objects are unordered.
  auto x = reinterpret_cast<uintptr_t>(p);
  auto lo = reinterpret_cast<uintptr_t>(base_);
  return x >= lo && x < lo + static_cast<uintptr_t>(options_.capacity_bytes);
}

HostArena* HostArena::Owner(const void* ptr) {
  std::lock_guard<std::mutex> lock(RegistryMutex());
  for (HostArena* a : Registry()) {
    if (a->Contains(ptr)) return a;
  }
  return nullptr;
}

int64_t HostArena::high_water() const {
  std::lock_guard<std::mutex> lock(mu_);
  return high_water_;
}
int64_t HostArena::allocated_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return allocated_bytes_;
}
int64_t HostArena::allocated_peak() const {
  std::lock_guard<std::mutex> lock(mu_);
  return allocated_peak_;
}
void HostArena::ResetAllocatedPeak() {
  std::lock_guard<std::mutex> lock(mu_);
  allocated_peak_ = allocated_bytes_;
}
int64_t HostArena::aligned_allocated_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return heap_.allocated_bytes();
}
int64_t HostArena::live_buffers() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(live_.size());
}

// --------------------------------------------------------------- CopyEngine

namespace internal {

// One copy queue: a worker thread running memcpy jobs first in first out.
class CopyEngine {
 public:
  explicit CopyEngine(int64_t jitter_us, uint64_t seed) : jitter_us_(jitter_us), seed_(seed) {
    thread_ = std::thread([this] { Run(); });
  }
  ~CopyEngine() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
      held_ = false;
    }
    cv_.notify_all();
    thread_.join();
  }

  void Submit(void* dst, const void* src, int64_t bytes, Event done) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      jobs_.push_back(Job{dst, src, bytes, std::move(done)});
    }
    cv_.notify_all();
  }

  // Blocks until every submitted job has completed.
  void Drain() {
    std::unique_lock<std::mutex> lock(mu_);
    idle_cv_.wait(lock, [&] { return jobs_.empty() && !busy_; });
  }

  void Hold(bool held) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      held_ = held;
    }
    cv_.notify_all();
  }

  std::thread::id thread_id() const { return thread_.get_id(); }
  int64_t copied_bytes() const {
    std::lock_guard<std::mutex> lock(mu_);
    return copied_bytes_;
  }
  int64_t copies() const {
    std::lock_guard<std::mutex> lock(mu_);
    return copies_;
  }

 private:
  struct Job {
    void* dst;
    const void* src;
    int64_t bytes;
    Event done;
  };

  void Run() {
    uint64_t n = 0;
    for (;;) {
      Job job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || (!held_ && !jobs_.empty()); });
        if (jobs_.empty()) return;  // stopping, and drained
        job = std::move(jobs_.front());
        jobs_.pop_front();
        busy_ = true;
      }
      if (jitter_us_ > 0) {
        uint64_t r = kernels::SplitMix64(seed_ ^ kernels::SplitMix64(n++));
        std::this_thread::sleep_for(std::chrono::microseconds(static_cast<int64_t>(r % static_cast<uint64_t>(jitter_us_ + 1))));
      }
      std::memcpy(job.dst, job.src, static_cast<size_t>(job.bytes));
      {
        std::lock_guard<std::mutex> lock(mu_);
        copied_bytes_ += job.bytes;
        ++copies_;
      }
      // Completing after the counters: whoever waits on the event sees them.
      job.done.Complete();
      {
        std::lock_guard<std::mutex> lock(mu_);
        busy_ = false;
      }
      idle_cv_.notify_all();
    }
  }

  const int64_t jitter_us_;
  const uint64_t seed_;
  mutable std::mutex mu_;
  std::condition_variable cv_, idle_cv_;
  std::deque<Job> jobs_;
  bool stop_ = false;
  bool held_ = false;
  bool busy_ = false;
  int64_t copied_bytes_ = 0;
  int64_t copies_ = 0;
  std::thread thread_;  // last: starts after every other member exists
};

}  // namespace internal

// --------------------------------------------------------------- HostDevice

namespace {
HostArena::Options ArenaOptions(const HostDevice::Options& options) {
  HostArena::Options o;
  o.capacity_bytes = options.capacity_bytes;
  o.alignment = options.alignment;
  o.name = options.name;
  return o;
}
}  // namespace

HostDevice::HostDevice(Options options)
    : arena_(ArenaOptions(options.system_allocator ? Options{4096, 256, options.name, 0, true} : options)),
      system_(options.system_allocator) {
  for (int q = 0; q < kQueueCount; ++q) {
    engines_[q] = std::make_unique<internal::CopyEngine>(options.copy_jitter_us, static_cast<uint64_t>(q) + 1);
  }
}

HostDevice::~HostDevice() {
  for (auto& e : engines_) e.reset();  // drains: a running copy never outlives the arena
  for (auto& [ptr, bytes] : heap_) std::free(const_cast<std::byte*>(ptr) - (witness_ ? kWitnessRedZone : 0));
}

Expected<Buffer> HostDevice::Allocate(int64_t bytes) {
  if (!system_) return arena_.Allocate(bytes);
  MEMPLAN_CHECK(bytes >= 0, "negative allocation size");
  if (bytes == 0) return Buffer{};
  const int64_t zone = witness_ ? kWitnessRedZone : 0;
  auto* raw = static_cast<std::byte*>(std::malloc(static_cast<size_t>(bytes + 2 * zone)));
  if (raw == nullptr) {
    return Error{ErrorCode::kRuntime, arena_.name() + ": the system allocator is exhausted (" +
                                          std::to_string(bytes) + " bytes asked)"};
  }
  if (witness_) std::memset(raw, kWitnessCanary, static_cast<size_t>(bytes + 2 * zone));
  std::byte* p = raw + zone;
  heap_[p] = bytes;
  heap_bytes_ += bytes;
  heap_peak_ = std::max(heap_peak_, heap_bytes_);
  return Buffer{p, 0, bytes};
}

void HostDevice::Free(Buffer buffer) {
  if (!system_) return arena_.Free(buffer);
  if (buffer.empty()) return;
  auto it = heap_.find(buffer.ptr);
  MEMPLAN_CHECK(it != heap_.end(), "freeing a buffer that is not live");
  heap_bytes_ -= it->second;
  heap_.erase(it);
  std::free(buffer.ptr - (witness_ ? kWitnessRedZone : 0));
}

bool HostDevice::EnableWitness() {
  if (!system_) return false;
  MEMPLAN_CHECK(heap_.empty(), "the witness starts before the first allocation");
  witness_ = true;
  return true;
}

std::optional<BufferWitness> HostDevice::Witness(const Buffer& buffer, bool scan) const {
  if (!witness_ || buffer.empty()) return std::nullopt;
  auto it = heap_.find(buffer.ptr);
  MEMPLAN_CHECK(it != heap_.end(), "witness of a buffer that is not live");
  return ReadWitness(buffer.ptr - kWitnessRedZone, it->second, scan);
}

Event HostDevice::CopyAsync(void* dst, const void* src, int64_t bytes, Queue queue) {
  MEMPLAN_CHECK(bytes >= 0, "negative copy size");
  if (bytes == 0) return Event{};
  MEMPLAN_CHECK(dst != nullptr && src != nullptr, "copy with a null pointer");
  auto d = reinterpret_cast<uintptr_t>(dst);
  auto s = reinterpret_cast<uintptr_t>(src);
  auto n = static_cast<uintptr_t>(bytes);
  MEMPLAN_CHECK(d + n <= s || s + n <= d, "copy source and destination overlap");
  Event done = Event::Pending();
  if (HostArena* a = HostArena::Owner(dst)) a->Fence(dst, bytes, done);
  if (HostArena* a = HostArena::Owner(src)) a->Fence(src, bytes, done);
  engines_[static_cast<int>(queue)]->Submit(dst, src, bytes, done);
  return done;
}

void HostDevice::Synchronize() {
  for (auto& e : engines_) e->Drain();
}

std::thread::id HostDevice::queue_thread(Queue queue) const {
  return engines_[static_cast<int>(queue)]->thread_id();
}
int64_t HostDevice::copied_bytes(Queue queue) const { return engines_[static_cast<int>(queue)]->copied_bytes(); }
int64_t HostDevice::copies(Queue queue) const { return engines_[static_cast<int>(queue)]->copies(); }
void HostDevice::HoldQueue(Queue queue, bool held) { engines_[static_cast<int>(queue)]->Hold(held); }

}  // namespace memplan::runtime
