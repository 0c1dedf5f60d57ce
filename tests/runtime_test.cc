// Runtime: the host device (best-fit arena, copy engines). The activation
// manager and the executor are exercised end to end in executor_test.cc.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "memplan/common/best_fit_heap.h"
#include "memplan/kernels/fp8.h"
#include "memplan/runtime/host_device.h"

using namespace memplan;
using namespace memplan::runtime;

namespace {

HostDevice::Options DeviceOptions(int64_t capacity_bytes, std::string name = "dev", int64_t jitter_us = 0) {
  HostDevice::Options o;
  o.capacity_bytes = capacity_bytes;
  o.name = std::move(name);
  o.copy_jitter_us = jitter_us;
  return o;
}

HostArena::Options HostOptions(int64_t capacity_bytes) {
  HostArena::Options o;
  o.capacity_bytes = capacity_bytes;
  o.name = "pinned";
  return o;
}

// Arbitrary bit patterns (NaN payloads, denormals, -0 included): a bit-exact
// round trip must preserve all of them.
std::vector<float> RandomBits(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) {
    uint32_t bits = rng();
    std::memcpy(&x, &bits, sizeof(x));
  }
  return v;
}


bool BitEqual(const float* a, const std::vector<float>& b) {
  return std::memcmp(a, b.data(), b.size() * sizeof(float)) == 0;
}



// Checks the FP8 bound: relative error <= 2^-4 for every element whose
// scaled magnitude is in E4M3's normal range (>= 2^-6 * scale).

}  // namespace

// ------------------------------------------------------------- host device

TEST_CASE("host arena: best-fit placement, requested vs aligned peaks") {
  HostDevice d(DeviceOptions(1 << 20));
  auto a = *d.Allocate(100);
  auto b = *d.Allocate(300);  // 512 aligned
  auto c = *d.Allocate(100);
  CHECK(a.offset == 0);
  CHECK(b.offset == 256);
  CHECK(c.offset == 768);
  CHECK(d.allocated_bytes() == 500);
  CHECK(d.peak() == 1024);
  CHECK(d.high_water() == 1024);
  d.Free(b);
  auto e = *d.Allocate(40);  // best fit: the 512-byte hole, lowest offset
  CHECK(e.offset == 256);
  auto f = *d.Allocate(200);
  CHECK(f.offset == 512);
  CHECK(d.allocated_bytes() == 440);
  CHECK(d.allocated_peak() == 500);  // requested bytes, not aligned
  CHECK(d.arena().aligned_allocated_bytes() == 1024);
  CHECK(d.peak() == 1024);
  CHECK(e.ptr == a.ptr + 256);
  for (auto buf : {a, c, e, f}) d.Free(buf);
  CHECK(d.allocated_bytes() == 0);
  CHECK(d.arena().live_buffers() == 0);
  CHECK(d.peak() == 1024);  // a high-water mark stays
  CHECK(d.Allocate(0)->empty());
}

TEST_CASE("host arena places exactly as the planner's BestFitHeap") {
  HostDevice d(DeviceOptions(64 << 20));
  BestFitHeap heap;
  std::mt19937 rng(7);
  std::vector<std::pair<Buffer, int64_t>> live;
  for (int i = 0; i < 3000; ++i) {
    if (live.empty() || rng() % 3 != 0) {
      int64_t bytes = 1 + static_cast<int64_t>(rng() % 20000);
      Buffer b = *d.Allocate(bytes);
      int64_t off = heap.Allocate(bytes);
      REQUIRE(b.offset == off);
      live.emplace_back(b, off);
    } else {
      size_t k = rng() % live.size();
      d.Free(live[k].first);
      heap.Free(live[k].second);
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(k));
    }
  }
  CHECK(d.peak() == heap.high_water());
  CHECK(d.arena().aligned_allocated_bytes() == heap.allocated_bytes());
  for (auto& [b, off] : live) d.Free(b);
}

TEST_CASE("arena exhaustion is an error, and leaves the arena unchanged") {
  HostDevice d(DeviceOptions(4096));
  auto a = d.Allocate(3000);
  REQUIRE(a.ok());
  auto too_much = d.Allocate(2000);
  REQUIRE_FALSE(too_much.ok());
  CHECK(too_much.error().code == ErrorCode::kRuntime);
  CHECK(too_much.error().message.find("exhausted") != std::string::npos);
  CHECK(d.allocated_bytes() == 3000);
  CHECK(d.peak() == 3072);
  CHECK_FALSE(d.Allocate(5000).ok());
  auto fits = d.Allocate(1000);  // the remaining 1024 bytes still serve
  REQUIRE(fits.ok());
  CHECK(fits->offset == 3072);
  CHECK(d.peak() == 4096);
  d.Free(*a);
  d.Free(*fits);

  HostArena host(HostOptions(1024));
  CHECK_FALSE(host.Allocate(1025).ok());
  CHECK(host.allocated_bytes() == 0);
  CHECK(host.high_water() == 0);
}

TEST_CASE("copies run on one worker thread per queue, in FIFO order") {
  HostDevice d(DeviceOptions(1 << 20));
  HostArena host(HostOptions(1 << 20));
  std::thread::id main_id = std::this_thread::get_id();
  CHECK(d.queue_thread(Queue::kD2H) != main_id);
  CHECK(d.queue_thread(Queue::kH2D) != main_id);
  CHECK(d.queue_thread(Queue::kLink) != main_id);
  CHECK(d.queue_thread(Queue::kD2H) != d.queue_thread(Queue::kH2D));

  std::vector<float> data = RandomBits(1024, 1);
  Buffer a = *d.Allocate(4096), b = *d.Allocate(4096);
  Buffer h = *host.Allocate(4096);
  std::memcpy(a.ptr, data.data(), 4096);
  // a -> h -> b on the same queue: FIFO makes the second copy see the first.
  d.HoldQueue(Queue::kLink, true);
  Event e1 = d.CopyAsync(h.ptr, a.ptr, 4096, Queue::kLink);
  Event e2 = d.CopyAsync(b.ptr, h.ptr, 4096, Queue::kLink);
  CHECK_FALSE(e1.done());
  CHECK_FALSE(e2.done());
  d.HoldQueue(Queue::kLink, false);
  d.Wait(e2);
  CHECK(e1.done());
  CHECK(BitEqual(b.as<float>(), data));
  CHECK(d.copies(Queue::kLink) == 2);
  CHECK(d.copied_bytes(Queue::kLink) == 8192);
  CHECK(d.CopyAsync(b.ptr, a.ptr, 0, Queue::kD2H).done());
  d.Synchronize();
  d.Free(a);
  d.Free(b);
  host.Free(h);
}

TEST_CASE("a free waits for its in-flight copy") {
  HostDevice d(DeviceOptions(1 << 20));
  HostArena host(HostOptions(1 << 20));
  std::vector<float> data = RandomBits(2048, 2);
  Buffer src = *d.Allocate(8192);
  Buffer dst = *host.Allocate(8192);
  std::memcpy(src.ptr, data.data(), 8192);
  d.HoldQueue(Queue::kD2H, true);
  Event e = d.CopyAsync(dst.ptr, src.ptr, 8192, Queue::kD2H);
  std::atomic<bool> freed{false};
  std::thread t([&] {
    d.Free(src);
    freed = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  CHECK_FALSE(freed.load());  // the copy cannot start while the queue is held
  CHECK(d.allocated_bytes() == 8192);
  d.HoldQueue(Queue::kD2H, false);
  t.join();
  CHECK(freed.load());
  CHECK(e.done());
  CHECK(d.allocated_bytes() == 0);
  CHECK(BitEqual(dst.as<float>(), data));
  host.Free(dst);
}

// ------------------------------------------------------ activation manager
