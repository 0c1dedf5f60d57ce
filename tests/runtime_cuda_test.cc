// Runtime: the CUDA device (stream-ordered pool, compute and copy streams,
// native events) and the pinned host arena. Needs a GPU: exits 77 (skip)
// without one.
#define DOCTEST_CONFIG_IMPLEMENT
#include <cuda_runtime_api.h>
#include <doctest/doctest.h>

#include <cstring>
#include <memory>
#include <new>
#include <random>
#include <string>
#include <vector>

#include "kernels/gpu_test_main.h"
#include "memplan/common/best_fit_heap.h"
#include "memplan/runtime/cuda_device.h"

using namespace memplan;
using namespace memplan::runtime;

namespace {

constexpr int64_t kMiB = int64_t{1} << 20;

std::unique_ptr<CudaDevice> MustCreate(int64_t capacity_bytes, std::string name = "gpu") {
  CudaDevice::Options o;
  o.capacity_bytes = capacity_bytes;
  o.name = std::move(name);
  auto d = CudaDevice::Create(std::move(o));
  REQUIRE_MESSAGE(d.ok(), (d.ok() ? "" : d.error().message));
  return std::move(*d);
}

std::unique_ptr<HostArena> MustPin(int64_t capacity_bytes) {
  auto a = MakePinnedArena(capacity_bytes, "pinned");
  REQUIRE_MESSAGE(a.ok(), (a.ok() ? "" : a.error().message));
  return std::move(*a);
}

Buffer MustAllocate(Device& d, int64_t bytes) {
  auto b = d.Allocate(bytes);
  REQUIRE_MESSAGE(b.ok(), (b.ok() ? "" : b.error().message));
  return *b;
}

Buffer MustAllocate(HostArena& a, int64_t bytes) {
  auto b = a.Allocate(bytes);
  REQUIRE_MESSAGE(b.ok(), (b.ok() ? "" : b.error().message));
  return *b;
}

// Arbitrary bytes (every float bit pattern, NaN payloads included).
void FillRandom(std::byte* p, int64_t bytes, uint32_t seed) {
  std::mt19937 rng(seed);
  for (int64_t i = 0; i < bytes; ++i) p[i] = static_cast<std::byte>(rng() & 0xFF);
}

bool AllBytes(const std::byte* p, int64_t bytes, unsigned char value) {
  for (int64_t i = 0; i < bytes; ++i) {
    if (p[i] != static_cast<std::byte>(value)) return false;
  }
  return true;
}

// The "producing kernel": a memset on the device's compute stream.
void FillOnCompute(CudaDevice& d, const Buffer& b, unsigned char value) {
  REQUIRE(cudaMemsetAsync(b.ptr, value, static_cast<size_t>(b.bytes), static_cast<cudaStream_t>(d.compute_stream())) ==
          cudaSuccess);
}

}  // namespace

TEST_CASE("cuda device: creation, availability and bad options") {
  CHECK(CudaRuntimeAvailable());

  CudaDevice::Options bad_device;
  bad_device.device = 1 << 20;
  auto d = CudaDevice::Create(bad_device);
  REQUIRE_FALSE(d.ok());
  CHECK(d.error().code == ErrorCode::kBadInput);
  CHECK(d.error().message.find("does not exist") != std::string::npos);

  CudaDevice::Options bad_capacity;
  bad_capacity.capacity_bytes = 0;
  CHECK(CudaDevice::Create(bad_capacity).error().code == ErrorCode::kBadInput);
  CHECK(MakePinnedArena(0, "pinned").error().code == ErrorCode::kBadInput);

  auto dev = MustCreate(64 * kMiB, "rank0");
  CHECK(dev->name() == "rank0");
  CHECK(dev->device() == 0);
  CHECK(dev->capacity_bytes() == 64 * kMiB);
  CHECK(dev->compute_stream() != nullptr);
  CHECK(dev->pool() != nullptr);
  // Four distinct streams: compute and one per queue.
  std::vector<void*> streams = {dev->compute_stream(), dev->queue_stream(Queue::kD2H), dev->queue_stream(Queue::kH2D),
                                dev->queue_stream(Queue::kLink)};
  for (size_t i = 0; i < streams.size(); ++i) {
    for (size_t j = i + 1; j < streams.size(); ++j) CHECK(streams[i] != streams[j]);
  }
  unsigned int flags = 0;
  REQUIRE(cudaStreamGetFlags(static_cast<cudaStream_t>(dev->compute_stream()), &flags) == cudaSuccess);
  CHECK(flags == cudaStreamNonBlocking);
}

TEST_CASE("cuda device: allocate/free round trip and accounting") {
  auto dev = MustCreate(256 * kMiB);
  CHECK(dev->Allocate(0)->empty());
  dev->Free(Buffer{});  // no-op

  Buffer a = MustAllocate(*dev, 3 * kMiB + 5);
  Buffer b = MustAllocate(*dev, 17 * kMiB);
  Buffer c = MustAllocate(*dev, 1);
  CHECK(a.ptr != b.ptr);
  CHECK(b.ptr != c.ptr);
  CHECK(dev->live_buffers() == 3);
  CHECK(dev->allocated_bytes() == 20 * kMiB + 6);
  dev->Free(b);
  CHECK(dev->allocated_bytes() == 3 * kMiB + 6);
  Buffer d = MustAllocate(*dev, 5 * kMiB);
  CHECK(dev->allocated_peak() == 20 * kMiB + 6);
  dev->Free(a);
  dev->Free(c);
  dev->Free(d);
  dev->Synchronize();
  CHECK(dev->live_buffers() == 0);
  CHECK(dev->allocated_bytes() == 0);
  CHECK(dev->allocated_peak() == 20 * kMiB + 6);

  // The pool's marks cover what the class counted; freed memory stays
  // reserved (release threshold UINT64_MAX).
  MESSAGE("reserved high ", dev->high_water(), ", used high ", dev->used_high_water(), ", allocated peak ",
          dev->allocated_peak());
  INFO("reserved high ", dev->high_water(), ", used high ", dev->used_high_water(), ", allocated peak ",
       dev->allocated_peak());
  CHECK(dev->used_high_water() >= dev->allocated_peak());
  CHECK(dev->high_water() >= dev->used_high_water());
  CHECK(dev->reserved_bytes() == dev->high_water());
}

TEST_CASE("cuda device: d2h then h2d through a pinned arena is bit-exact") {
  constexpr int64_t kBytes = 16 * kMiB + 12;
  auto dev = MustCreate(64 * kMiB);
  auto pinned = MustPin(64 * kMiB);
  Buffer in = MustAllocate(*pinned, kBytes);
  Buffer out = MustAllocate(*pinned, kBytes);
  FillRandom(in.ptr, kBytes, 42);
  std::memset(out.ptr, 0, static_cast<size_t>(kBytes));

  Buffer x = MustAllocate(*dev, kBytes);
  Event up = dev->CopyAsync(x.ptr, in.ptr, kBytes, Queue::kH2D);
  REQUIRE(up.native() != nullptr);
  dev->Wait(up);  // the compute stream, hence the next copy, sees x
  Event down = dev->CopyAsync(out.ptr, x.ptr, kBytes, Queue::kD2H);
  down.Wait();
  CHECK(down.done());
  CHECK(std::memcmp(in.ptr, out.ptr, static_cast<size_t>(kBytes)) == 0);

  // And back up into a second buffer, then down again.
  Buffer y = MustAllocate(*dev, kBytes);
  std::vector<std::byte> expected(out.ptr, out.ptr + kBytes);
  Event up2 = dev->CopyAsync(y.ptr, out.ptr, kBytes, Queue::kH2D);
  dev->Wait(up2);
  std::memset(in.ptr, 0, static_cast<size_t>(kBytes));
  dev->CopyAsync(in.ptr, y.ptr, kBytes, Queue::kD2H).Wait();
  CHECK(std::memcmp(in.ptr, expected.data(), expected.size()) == 0);

  // A zero-byte copy is complete at once; default events are no-ops.
  CHECK(dev->CopyAsync(out.ptr, x.ptr, 0, Queue::kD2H).done());
  dev->Wait(Event{});

  dev->Free(x);
  dev->Free(y);
  pinned->Free(in);  // the pinned side of a copy is fenced too
  pinned->Free(out);
  dev->Synchronize();
}

TEST_CASE("cuda device: a free right after a copy waits for it (stream order)") {
  // Large enough that a copy takes milliseconds while the memset that reuses
  // the memory takes far less: without the fence, the reuse would overtake it.
  constexpr int64_t kBytes = 256 * kMiB;
  auto dev = MustCreate(kBytes);
  auto pinned = MustPin(2 * kBytes);
  Buffer out = MustAllocate(*pinned, kBytes);
  Buffer in = MustAllocate(*pinned, kBytes);
  std::memset(out.ptr, 0, static_cast<size_t>(kBytes));
  std::memset(in.ptr, 0x3C, static_cast<size_t>(kBytes));

  SUBCASE("a copy reading the freed buffer") {
    Buffer a = MustAllocate(*dev, kBytes);
    FillOnCompute(*dev, a, 0x5A);
    Event down = dev->CopyAsync(out.ptr, a.ptr, kBytes, Queue::kD2H);
    dev->Free(a);
    Buffer b = MustAllocate(*dev, kBytes);  // capacity allows only one: reuse
    if (b.ptr != a.ptr) MESSAGE("the pool did not reuse the freed block");
    FillOnCompute(*dev, b, 0xA5);
    down.Wait();
    dev->Synchronize();
    CHECK(AllBytes(out.ptr, kBytes, 0x5A));
    dev->Free(b);
  }
  SUBCASE("a copy writing the freed buffer") {
    Buffer a = MustAllocate(*dev, kBytes);
    dev->CopyAsync(a.ptr, in.ptr, kBytes, Queue::kH2D);
    dev->Free(a);
    Buffer b = MustAllocate(*dev, kBytes);
    FillOnCompute(*dev, b, 0xA5);
    Event e = dev->CopyAsync(out.ptr, b.ptr, kBytes, Queue::kD2H);
    e.Wait();
    CHECK(AllBytes(out.ptr, kBytes, 0xA5));
    dev->Free(b);
  }
  dev->Synchronize();
  CHECK(dev->allocated_peak() == kBytes);
  pinned->Free(out);
  pinned->Free(in);
}

TEST_CASE("cuda device: link copy between two devices (emulated ranks)") {
  constexpr int64_t kBytes = 32 * kMiB + 256;
  auto rank0 = MustCreate(64 * kMiB, "rank0");
  auto rank1 = MustCreate(64 * kMiB, "rank1");
  CHECK(rank0->pool() != rank1->pool());
  auto pinned = MustPin(2 * kBytes);
  Buffer in = MustAllocate(*pinned, kBytes);
  Buffer out = MustAllocate(*pinned, kBytes);
  FillRandom(in.ptr, kBytes, 7);
  std::memset(out.ptr, 0, static_cast<size_t>(kBytes));

  Buffer src = MustAllocate(*rank0, kBytes);
  rank0->Wait(rank0->CopyAsync(src.ptr, in.ptr, kBytes, Queue::kH2D));
  // The destination is allocated in rank1's stream order just before the
  // copy, and the source is freed right after it: both are ordered by events.
  Buffer dst = MustAllocate(*rank1, kBytes);
  Event link = rank0->CopyAsync(dst.ptr, src.ptr, kBytes, Queue::kLink);
  rank0->Free(src);
  Buffer scratch = MustAllocate(*rank0, kBytes);  // may reuse src's memory
  FillOnCompute(*rank0, scratch, 0xEE);
  rank1->Wait(link);
  rank1->CopyAsync(out.ptr, dst.ptr, kBytes, Queue::kD2H).Wait();
  CHECK(std::memcmp(in.ptr, out.ptr, static_cast<size_t>(kBytes)) == 0);

  // Each rank counts its own bytes.
  CHECK(rank0->allocated_peak() == kBytes);
  CHECK(rank1->allocated_peak() == kBytes);
  CHECK(rank1->allocated_bytes() == kBytes);
  rank1->Free(dst);
  rank0->Free(scratch);
  rank0->Synchronize();
  rank1->Synchronize();
  CHECK(rank0->allocated_bytes() == 0);
  CHECK(rank1->allocated_bytes() == 0);
  pinned->Free(in);
  pinned->Free(out);
}

TEST_CASE("cuda device: exhausted capacity is an error that leaves the device unchanged") {
  auto dev = MustCreate(kMiB);
  CHECK_FALSE(dev->Allocate(kMiB + 1).ok());
  Buffer a = MustAllocate(*dev, 768 * 1024);

  const int64_t bytes = dev->allocated_bytes(), peak = dev->allocated_peak(), live = dev->live_buffers();
  const int64_t high = dev->high_water(), used_high = dev->used_high_water(), reserved = dev->reserved_bytes();
  auto refused = dev->Allocate(512 * 1024);
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.error().code == ErrorCode::kRuntime);
  CHECK(refused.error().message.find("exhausted") != std::string::npos);
  CHECK(refused.error().message.find("gpu") != std::string::npos);
  CHECK(dev->allocated_bytes() == bytes);
  CHECK(dev->allocated_peak() == peak);
  CHECK(dev->live_buffers() == live);
  CHECK(dev->high_water() == high);
  CHECK(dev->used_high_water() == used_high);
  CHECK(dev->reserved_bytes() == reserved);

  // Exactly full is fine; one byte more is not.
  Buffer b = MustAllocate(*dev, 256 * 1024);
  CHECK(dev->allocated_bytes() == kMiB);
  CHECK_FALSE(dev->Allocate(1).ok());
  dev->Free(a);
  Buffer c = MustAllocate(*dev, 1);  // freed bytes count again
  dev->Free(b);
  dev->Free(c);
  dev->Synchronize();
}

TEST_CASE("cuda device: live buffers at destruction are freed after their copies") {
  constexpr int64_t kBytes = 64 * kMiB;
  auto pinned = MustPin(kBytes);
  Buffer out = MustAllocate(*pinned, kBytes);
  Event down;
  {
    auto dev = MustCreate(kBytes);
    Buffer a = MustAllocate(*dev, kBytes);
    FillOnCompute(*dev, a, 0x77);
    down = dev->CopyAsync(out.ptr, a.ptr, kBytes, Queue::kD2H);
  }  // a is still live: the destructor frees it after the copy
  down.Wait();
  CHECK(AllBytes(out.ptr, kBytes, 0x77));
  pinned->Free(out);
}

TEST_CASE("host arena: allocate and release hooks") {
  int allocations = 0, releases = 0;
  std::byte* block = nullptr;
  {
    HostArena::Options o;
    o.capacity_bytes = 1 << 16;
    o.allocate = [&](int64_t bytes) {
      ++allocations;
      block = static_cast<std::byte*>(::operator new (static_cast<size_t>(bytes), std::align_val_t{4096}));
      return block;
    };
    o.release = [&](std::byte* p) {
      ++releases;
      CHECK(p == block);
      ::operator delete (p, std::align_val_t{4096});
    };
    HostArena arena(std::move(o));
    CHECK(allocations == 1);
    Buffer b = MustAllocate(arena, 100);
    CHECK(b.ptr == block);
    CHECK(HostArena::Owner(b.ptr) == &arena);
    arena.Free(b);
  }
  CHECK(releases == 1);
}

TEST_CASE("cuda arena: one block, the planner's placement, exact high water") {
  // A fixed program of allocations and frees: the arena must place each
  // buffer where the planner's BestFitHeap does, and reach its high water.
  CudaDevice::Options o;
  o.capacity_bytes = 8 * kMiB;
  o.name = "arena";
  o.arena = true;
  auto made = CudaDevice::Create(o);
  REQUIRE_MESSAGE(made.ok(), (made.ok() ? "" : made.error().message));
  CudaDevice& dev = **made;
  auto [base, block_bytes] = dev.arena_block();
  REQUIRE(base != nullptr);
  CHECK(block_bytes == 8 * kMiB);
  CHECK(dev.pool() == nullptr);
  BestFitHeap heap(256);
  const int64_t sizes[] = {3 * kMiB, 1000, kMiB + 1, 2 * kMiB, 77};
  std::vector<Buffer> live;
  for (int64_t s : sizes) {
    Buffer b = MustAllocate(dev, s);
    CHECK(b.offset == heap.Allocate(s));
    CHECK(static_cast<std::byte*>(b.ptr) == static_cast<std::byte*>(base) + b.offset);
    FillOnCompute(dev, b, 0x5A);
    live.push_back(b);
  }
  dev.Free(live[1]);
  heap.Free(live[1].offset);
  dev.Free(live[3]);
  heap.Free(live[3].offset);
  Buffer again = MustAllocate(dev, 1500 * 1024);
  CHECK(again.offset == heap.Allocate(1500 * 1024));
  CHECK(dev.high_water() == heap.high_water());
  // Past the block: an error, the device unchanged.
  CHECK_FALSE(dev.Allocate(8 * kMiB).ok());
  CHECK(dev.high_water() == heap.high_water());
  dev.Free(again);
  for (int i : {0, 2, 4}) dev.Free(live[static_cast<size_t>(i)]);
  dev.Synchronize();
  CHECK(dev.allocated_bytes() == 0);
}
