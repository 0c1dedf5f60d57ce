// Runtime: the host device (best-fit arena, copy engines) and the unified
// activation manager (storage backends, footprints, round trips).
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
#include "memplan/runtime/activation.h"
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

// Finite, normally distributed activations whose magnitude changes every 64
// elements over several decades (so FP8 blocks need their own scales).
std::vector<float> RandomActivations(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::uniform_int_distribution<int> decade(-6, 4);
  std::vector<float> v(static_cast<size_t>(n));
  float magnitude = 1.f;
  for (size_t i = 0; i < v.size(); ++i) {
    if (i % 64 == 0) magnitude = std::pow(10.f, static_cast<float>(decade(rng)));
    v[i] = normal(rng) * magnitude;
  }
  return v;
}

bool BitEqual(const float* a, const std::vector<float>& b) {
  return std::memcmp(a, b.data(), b.size() * sizeof(float)) == 0;
}

StorageSpec Spec(std::vector<Policy> p, Device* remote = nullptr) {
  StorageSpec s;
  s.policies = std::move(p);
  s.remote = remote;
  return s;
}

std::unique_ptr<ActivationManager> MustCreate(Device& d, HostArena* host, ActivationManager::Bindings b,
                                              ActivationManager::Options o = {}) {
  auto m = ActivationManager::Create(d, host, std::move(b), std::move(o));
  REQUIRE_MESSAGE(m.ok(), (m.ok() ? "" : m.error().message));
  return std::move(*m);
}

// Checks the FP8 bound: relative error <= 2^-4 for every element whose
// scaled magnitude is in E4M3's normal range (>= 2^-6 * scale).
void CheckFp8Close(const float* got, const std::vector<float>& want, int64_t cols) {
  int64_t rows = static_cast<int64_t>(want.size()) / cols;
  int64_t checked = 0;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b0 = 0; b0 < cols; b0 += 128) {
      int64_t b1 = std::min(cols, b0 + 128);
      float amax = 0;
      for (int64_t c = b0; c < b1; ++c) amax = std::max(amax, std::fabs(want[static_cast<size_t>(r * cols + c)]));
      float scale = amax / 448.f;
      for (int64_t c = b0; c < b1; ++c) {
        size_t i = static_cast<size_t>(r * cols + c);
        if (std::fabs(want[i]) < scale * 0x1p-6f) continue;  // subnormal in E4M3
        double rel = std::fabs(static_cast<double>(got[i]) - want[i]) / std::fabs(static_cast<double>(want[i]));
        REQUIRE(rel <= 0x1p-4 * (1 + 1e-6));
        ++checked;
      }
    }
  }
  CHECK(checked > static_cast<int64_t>(want.size()) / 2);
}

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

TEST_CASE("storage specs: legal compositions only") {
  HostDevice d(DeviceOptions(1 << 20)), other(DeviceOptions(1 << 20, "other"));
  HostArena host(HostOptions(1 << 20));
  using P = Policy;
  for (auto p : {std::vector<P>{P::kKeep}, {P::kRecompute}, {P::kFp8}, {P::kOffloadHost}, {P::kFp8, P::kOffloadHost},
                 {P::kOffloadRemote}, {P::kFp8, P::kOffloadRemote}}) {
    CHECK_FALSE(ValidateStorageSpec(Spec(p, &other)).has_value());
  }
  for (auto p : {std::vector<P>{}, {P::kOffloadHost, P::kFp8}, {P::kRecompute, P::kFp8}, {P::kKeep, P::kFp8},
                 {P::kFp8, P::kFp8}, {P::kOffloadHost, P::kOffloadRemote}, {P::kFp8, P::kOffloadHost, P::kKeep}}) {
    auto e = ValidateStorageSpec(Spec(p, &other));
    REQUIRE(e.has_value());
    CHECK(e->code == ErrorCode::kBadInput);
    CHECK(e->message.find("illegal storage") != std::string::npos);
  }
  CHECK(ValidateStorageSpec(Spec({P::kOffloadRemote})).has_value());  // no target
  CHECK(DescribeStorageSpec(Spec({P::kFp8, P::kOffloadHost})) == "fp8+offload_host");
  CHECK(*ParsePolicy("offload_remote") == P::kOffloadRemote);
  CHECK_FALSE(ParsePolicy("zip").ok());

  CHECK_FALSE(ActivationManager::Create(d, nullptr, {{"x", Spec({P::kOffloadHost})}}).ok());
  CHECK_FALSE(ActivationManager::Create(d, &host, {{"x", Spec({P::kOffloadRemote}, &d)}}).ok());
  auto bad = ActivationManager::Create(d, &host, {{"layer0.attn.qkv_in", Spec({P::kOffloadHost, P::kFp8})}});
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.error().message.find("layer0.attn.qkv_in") != std::string::npos);
}

TEST_CASE("FP8 footprint is the planner's: 1.03125 B/element when 128 divides cols") {
  CHECK(Fp8Bytes({8, 256}) == 2112);
  CHECK(static_cast<double>(Fp8Bytes({4, 16, 1024})) == 1.03125 * 4 * 16 * 1024);
  CHECK(Fp8Bytes({3, 200}) == 600 + 3 * 2 * 4);  // a short tail block
  CHECK(Fp8Bytes({1000}) == 1000 + 8 * 4);
  CHECK(NumElements({}) == 1);
}

TEST_CASE("round trips are bit-exact for keep, offload_host, offload_remote and recompute") {
  HostDevice d(DeviceOptions(4 << 20)), remote(DeviceOptions(4 << 20, "rank1"));
  HostArena host(HostOptions(4 << 20));
  using P = Policy;
  auto m = MustCreate(d, &host,
                      {{"keep", Spec({P::kKeep})},
                       {"host", Spec({P::kOffloadHost})},
                       {"remote", Spec({P::kOffloadRemote}, &remote)},
                       {"recompute", Spec({P::kRecompute})}});
  const std::vector<int64_t> shape = {16, 96};
  for (const char* name : {"keep", "host", "remote", "recompute"}) {
    CAPTURE(name);
    for (int32_t mb = 0; mb < 2; ++mb) {
      std::vector<float> data = RandomBits(16 * 96, static_cast<uint32_t>(mb * 10 + name[0]));
      auto regenerate = [&data](float* out) { std::memcpy(out, data.data(), data.size() * sizeof(float)); };
      REQUIRE(m->Save(name, mb, data.data(), shape, regenerate).ok());
      std::vector<float> clobber = RandomBits(16 * 96, 99);
      data.swap(clobber);  // the producer's output buffer is reused...
      data.swap(clobber);  // ...and rewritten identically for the recompute
      REQUIRE(m->FinishCopyOut(name, mb).ok());
      REQUIRE(m->Prefetch(name, mb).ok());
      auto got = m->Load(name, mb);
      REQUIRE(got.ok());
      CHECK(BitEqual(*got, data));
      CHECK(*m->Load(name, mb) == *got);  // a second Load is the same tensor
      REQUIRE(m->Release(name, mb).ok());
    }
  }
  CHECK(d.allocated_bytes() == 0);
  CHECK(host.allocated_bytes() == 0);
  CHECK(remote.allocated_bytes() == 0);
  CHECK(m->live_instances() == 0);
  CHECK(d.copies(Queue::kD2H) == 2);
  CHECK(d.copies(Queue::kH2D) == 2);
  CHECK(d.copies(Queue::kLink) == 4);
}

TEST_CASE("fp8 round trip is within the E4M3 bound and not bit-identical; fp8+offload composes") {
  HostDevice d(DeviceOptions(4 << 20)), remote(DeviceOptions(4 << 20, "rank1"));
  HostArena host(HostOptions(4 << 20));
  using P = Policy;
  auto m = MustCreate(d, &host,
                      {{"fp8", Spec({P::kFp8})},
                       {"fp8_host", Spec({P::kFp8, P::kOffloadHost})},
                       {"fp8_remote", Spec({P::kFp8, P::kOffloadRemote}, &remote)}});
  // cols % 128 == 0 (PackFp8's layout) and a short tail with unaligned scales.
  for (std::vector<int64_t> shape : {std::vector<int64_t>{8, 256}, std::vector<int64_t>{3, 200}}) {
    int64_t n = NumElements(shape), cols = shape.back();
    std::vector<float> data = RandomActivations(n, static_cast<uint32_t>(n));
    std::vector<float> reference;
    for (const char* name : {"fp8", "fp8_host", "fp8_remote"}) {
      CAPTURE(name);
      CAPTURE(n);
      REQUIRE(m->Save(name, 0, data.data(), shape).ok());
      REQUIRE(m->FinishCopyOut(name, 0).ok());
      auto got = m->Load(name, 0);
      REQUIRE(got.ok());
      CheckFp8Close(*got, data, cols);
      CHECK_FALSE(BitEqual(*got, data));
      // Offloading moves the FP8 bytes untouched: the same result as fp8 alone.
      if (reference.empty()) {
        reference.assign(*got, *got + n);
      } else {
        CHECK(BitEqual(*got, reference));
      }
      REQUIRE(m->Release(name, 0).ok());
    }
  }
  // The quantization is the kernels' reference, packed as PackFp8 packs.
  std::vector<float> x = RandomActivations(4 * 256, 5);
  kernels::Fp8BlockLayout layout{4, 256};
  std::vector<uint8_t> values(static_cast<size_t>(layout.ValueBytes()));
  std::vector<float> scales(static_cast<size_t>(layout.rows * layout.BlocksPerRow()));
  kernels::QuantizeFp8BlockwiseRef(x.data(), layout, kernels::ScaleMode::kAmax, values.data(), scales.data());
  std::vector<float> want(x.size());
  kernels::DequantizeFp8BlockwiseRef(values.data(), scales.data(), layout, want.data());
  REQUIRE(m->Save("fp8", 1, x.data(), {4, 256}).ok());
  CHECK(BitEqual(*m->Load("fp8", 1), want));
  REQUIRE(m->Release("fp8", 1).ok());
  CHECK(layout.PackedBytes() == Fp8Bytes({4, 256}));
  // Byte for byte, the offloaded payload is PackFp8's buffer. An empty host
  // arena places its first buffer at its base, which a probe reveals.
  HostArena probe_host(HostOptions(1 << 20));
  Buffer probe = *probe_host.Allocate(1);
  const std::byte* base = probe.ptr;
  probe_host.Free(probe);
  auto m2 = MustCreate(d, &probe_host, {{"t", Spec({P::kFp8, P::kOffloadHost})}});
  REQUIRE(m2->Save("t", 0, x.data(), {4, 256}).ok());
  REQUIRE(m2->FinishCopyOut("t", 0).ok());
  CHECK(probe_host.allocated_bytes() == layout.PackedBytes());
  std::vector<std::byte> packed(static_cast<size_t>(layout.PackedBytes()));
  kernels::PackFp8(values.data(), scales.data(), layout, packed.data());
  CHECK(std::memcmp(base, packed.data(), packed.size()) == 0);
  REQUIRE(m2->Release("t", 0).ok());
  CHECK(d.allocated_bytes() == 0);
  CHECK(host.allocated_bytes() == 0);
  CHECK(remote.allocated_bytes() == 0);
}

TEST_CASE("device bytes between save and load are the planner's footprints") {
  using P = Policy;
  const std::vector<int64_t> shape = {8, 256};
  const int64_t full = 8 * 256 * 4, fp8 = 2112;
  struct Case {
    std::vector<P> policies;
    int64_t at_save;     // device bytes right after Save (copy-out in flight)
    int64_t between;     // after FinishCopyOut: what the planner keeps between F and B
    int64_t save_peak;   // allocated_peak reached by Save
    int64_t moved;       // bytes held off the device between F and B
    int64_t prefetched;  // after Prefetch
  };
  std::vector<Case> cases = {
      {{P::kKeep}, full, full, full, 0, full},
      {{P::kRecompute}, 0, 0, full, 0, 0},
      {{P::kFp8}, fp8, fp8, full + fp8, 0, fp8},
      {{P::kOffloadHost}, full, 0, full, full, full},
      {{P::kFp8, P::kOffloadHost}, fp8, 0, full + fp8, fp8, fp8},
      {{P::kOffloadRemote}, full, 0, full, full, full},
      {{P::kFp8, P::kOffloadRemote}, fp8, 0, full + fp8, fp8, fp8},
  };
  for (const Case& c : cases) {
    HostDevice d(DeviceOptions(1 << 20)), remote(DeviceOptions(1 << 20, "rank1"));
    HostArena host(HostOptions(1 << 20));
    StorageSpec spec = Spec(c.policies, &remote);
    CAPTURE(DescribeStorageSpec(spec));
    auto m = MustCreate(d, &host, {{"t", spec}});
    std::vector<float> data = RandomActivations(8 * 256, 3);
    REQUIRE(m->Save("t", 0, data.data(), shape, [&](float* out) { std::memcpy(out, data.data(), full); }).ok());
    CHECK(d.allocated_bytes() == c.at_save);
    CHECK(m->DeviceBytes("t", 0) == c.at_save);
    CHECK(d.allocated_peak() == c.save_peak);
    REQUIRE(m->FinishCopyOut("t", 0).ok());
    CHECK(d.allocated_bytes() == c.between);
    CHECK(host.allocated_bytes() + remote.allocated_bytes() == c.moved);
    REQUIRE(m->Prefetch("t", 0).ok());
    CHECK(d.allocated_bytes() == c.prefetched);
    REQUIRE(m->Load("t", 0).ok());
    CHECK(d.allocated_bytes() == full);
    CHECK(host.allocated_bytes() + remote.allocated_bytes() == 0);  // freed once landed
    REQUIRE(m->Release("t", 0).ok());
    CHECK(d.allocated_bytes() == 0);
    CHECK(m->DeviceBytes("t", 0) == 0);
    CHECK(d.arena().live_buffers() == 0);
  }
}

TEST_CASE("an offload whose copy-out is not finished stays resident") {
  HostDevice d(DeviceOptions(1 << 20));
  HostArena host(HostOptions(1 << 20));
  auto m = MustCreate(d, &host, {{"t", Spec({Policy::kOffloadHost})}});
  std::vector<float> data = RandomBits(512, 4);
  REQUIRE(m->Save("t", 0, data.data(), {512}).ok());
  REQUIRE(m->Prefetch("t", 0).ok());  // no FinishCopyOut: no h2d, the source stays
  CHECK(d.allocated_bytes() == 2048);
  REQUIRE(m->FinishCopyOut("t", 0).ok());  // too late: a no-op
  CHECK(d.allocated_bytes() == 2048);
  CHECK(BitEqual(*m->Load("t", 0), data));
  CHECK(host.allocated_bytes() == 0);
  CHECK(d.copies(Queue::kH2D) == 0);
  REQUIRE(m->Release("t", 0).ok());
  CHECK(d.allocated_bytes() == 0);
}

TEST_CASE("deferred frees reproduce the planner's step-by-step placement") {
  // Steps: 0 F(a: fp8), 1 F(b: keep), 2 B(b), 3 B(a). Planner intervals:
  // a full [0,0], a fp8 [0,3], b [1,2], a full [3,3]; at each step the
  // intervals that start are placed, then those that end are freed.
  const std::vector<int64_t> sa = {16, 512}, sb = {20, 512};
  const int64_t a_full = 16 * 512 * 4, a_fp8 = Fp8Bytes(sa), b_full = 20 * 512 * 4;
  BestFitHeap heap;
  int64_t f0 = heap.Allocate(a_full), q = heap.Allocate(a_fp8);
  heap.Free(f0);
  int64_t b = heap.Allocate(b_full);
  heap.Free(b);
  int64_t f3 = heap.Allocate(a_full);
  heap.Free(q);
  heap.Free(f3);

  HostDevice d(DeviceOptions(1 << 20));
  ActivationManager::Options o;
  o.defer_frees = true;
  auto m = MustCreate(d, nullptr, {{"a", Spec({Policy::kFp8})}}, o);
  std::vector<float> xa = RandomActivations(16 * 512, 1), xb = RandomActivations(20 * 512, 2);
  REQUIRE(m->Save("a", 0, xa.data(), sa).ok());
  CHECK(d.allocated_bytes() == a_full + a_fp8);  // the full size lives through its step
  m->EndStep();
  CHECK(d.allocated_bytes() == a_fp8);
  REQUIRE(m->Save("b", 0, xb.data(), sb).ok());
  m->EndStep();
  CHECK(BitEqual(*m->Load("b", 0), xb));
  REQUIRE(m->Release("b", 0).ok());
  CHECK(d.allocated_bytes() == a_fp8 + b_full);
  m->EndStep();
  REQUIRE(m->Load("a", 0).ok());
  REQUIRE(m->Release("a", 0).ok());
  CHECK(d.allocated_bytes() == a_full + a_fp8);
  m->EndStep();
  CHECK(d.allocated_bytes() == 0);
  CHECK(d.peak() == heap.high_water());
  CHECK(d.allocated_peak() == a_fp8 + b_full);
}

TEST_CASE("manager errors leave nothing behind") {
  HostDevice d(DeviceOptions(16384)), remote(DeviceOptions(4096, "rank1"));
  HostArena host(HostOptions(4096));
  using P = Policy;
  auto m = MustCreate(d, &host,
                      {{"fp8", Spec({P::kFp8})},
                       {"host", Spec({P::kOffloadHost})},
                       {"remote", Spec({P::kOffloadRemote}, &remote)},
                       {"rc", Spec({P::kRecompute})}});
  std::vector<float> small(256, 1.f), big(3000, 1.f);
  REQUIRE(m->Save("keep", 0, small.data(), {256}).ok());
  auto dup = m->Save("keep", 0, small.data(), {256});
  REQUIRE_FALSE(dup.ok());
  CHECK(dup.error().message.find("already saved") != std::string::npos);
  CHECK(m->DeviceBytes("keep", 0) == 1024);  // the first one is intact
  CHECK_FALSE(m->Load("nothing", 0).ok());
  CHECK_FALSE(m->Release("nothing", 3).ok());
  auto rc = m->Save("rc", 0, small.data(), {256});
  REQUIRE_FALSE(rc.ok());
  CHECK(rc.error().message.find("producer function") != std::string::npos);
  uint8_t mask[64] = {};
  CHECK_FALSE(m->SaveRaw("fp8", 0, mask, 64).ok());
  // Offload bigger than the host arena / the remote device: refused, undone.
  auto host_full = m->Save("host", 0, big.data(), {3000});
  REQUIRE_FALSE(host_full.ok());
  CHECK(host_full.error().message.find("exhausted") != std::string::npos);
  CHECK_FALSE(m->Save("remote", 0, big.data(), {3000}).ok());
  // Device exhausted in the middle of fp8 (full fits, full + fp8 does not).
  std::vector<float> huge(3500, 1.f);
  auto dev_full = m->Save("fp8", 1, huge.data(), {3500});
  REQUIRE_FALSE(dev_full.ok());
  CHECK(dev_full.error().message.find("fp8@mb1") != std::string::npos);
  CHECK(d.allocated_bytes() == 1024);
  CHECK(host.allocated_bytes() == 0);
  CHECK(remote.allocated_bytes() == 0);
  CHECK(m->live_instances() == 1);
  // Raw bytes round trip.
  for (int i = 0; i < 64; ++i) mask[i] = static_cast<uint8_t>(i * 7);
  REQUIRE(m->SaveRaw("host", 5, mask, 64).ok());
  REQUIRE(m->FinishCopyOut("host", 5).ok());
  CHECK_FALSE(m->Load("host", 5).ok());  // raw: LoadRaw only
  CHECK(std::memcmp(*m->LoadRaw("host", 5), mask, 64) == 0);
  REQUIRE(m->Release("host", 5).ok());
  REQUIRE(m->Release("keep", 0).ok());
  CHECK(d.allocated_bytes() == 0);
}

TEST_CASE("recompute may reach back to other saved instances") {
  HostDevice d(DeviceOptions(1 << 20));
  auto m = MustCreate(d, nullptr, {{"act", Spec({Policy::kRecompute})}});
  std::vector<float> x = RandomActivations(1024, 8), y(1024);
  for (size_t i = 0; i < x.size(); ++i) y[i] = x[i] * 2.f;  // act = 2 * x
  REQUIRE(m->Save("x", 0, x.data(), {1024}).ok());
  ActivationManager* mp = m.get();
  REQUIRE(m->Save("act", 0, y.data(), {1024},
                  [mp](float* out) {
                    const float* in = *mp->Load("x", 0);
                    for (int i = 0; i < 1024; ++i) out[i] = in[i] * 2.f;
                  })
              .ok());
  CHECK(d.allocated_bytes() == 4096);
  CHECK(BitEqual(*m->Load("act", 0), y));
  REQUIRE(m->Release("act", 0).ok());
  REQUIRE(m->Release("x", 0).ok());
  CHECK(d.allocated_bytes() == 0);
}

namespace {

// A 1F1B-like run over several layers and microbatches with every storage,
// prefetching one layer ahead. Returns the device/host/remote bytes after
// every call, and checks every Load.
struct StressResult {
  std::vector<int64_t> trace;
  int64_t peak = 0, allocated_peak = 0, remote_peak = 0, host_peak = 0;
};

StressResult RunStress(int64_t jitter_us) {
  HostDevice d(DeviceOptions(64 << 20, "rank0", jitter_us)), remote(DeviceOptions(64 << 20, "rank1", jitter_us));
  HostArena host(HostOptions(64 << 20));
  using P = Policy;
  const int layers = 8, tensors = 4, mbs = 6;
  const std::vector<std::vector<P>> kinds = {
      {P::kOffloadHost}, {P::kFp8, P::kOffloadHost}, {P::kOffloadRemote}, {P::kFp8, P::kOffloadRemote},
      {P::kFp8},         {P::kKeep},                 {P::kRecompute},     {P::kOffloadHost}};
  ActivationManager::Bindings bindings;
  auto name = [](int l, int t) { return "layer" + std::to_string(l) + ".t" + std::to_string(t); };
  for (int l = 0; l < layers; ++l) {
    for (int t = 0; t < tensors; ++t) {
      bindings[name(l, t)] = Spec(kinds[static_cast<size_t>((l * tensors + t) % kinds.size())], &remote);
    }
  }
  ActivationManager::Options o;
  o.defer_frees = true;
  auto m = MustCreate(d, &host, bindings, o);
  StressResult r;
  auto note = [&] {
    r.trace.push_back(d.allocated_bytes());
    r.trace.push_back(host.allocated_bytes());
    r.trace.push_back(remote.allocated_bytes());
  };
  auto shape_of = [](int l, int t) { return std::vector<int64_t>{4 + t, 128 * (1 + (l % 3))}; };
  auto data_of = [&](int l, int t, int mb) {
    auto s = shape_of(l, t);
    return RandomActivations(s[0] * s[1], static_cast<uint32_t>((l * 31 + t) * 131 + mb));
  };
  auto forward = [&](int mb) {
    for (int l = 0; l < layers; ++l) {
      for (int t = 0; t < tensors; ++t) {
        auto x = data_of(l, t, mb);
        REQUIRE(m->Save(name(l, t), mb, x.data(), shape_of(l, t), [=](float* out) {
                   auto y = data_of(l, t, mb);
                   std::memcpy(out, y.data(), y.size() * sizeof(float));
                 }).ok());
        note();
      }
      m->EndStep();
      // The copy-outs issued two layers ago are done by now.
      if (l >= 2) {
        for (int t = 0; t < tensors; ++t) REQUIRE(m->FinishCopyOut(name(l - 2, t), mb).ok());
      }
      note();
    }
    for (int l = std::max(0, layers - 2); l < layers; ++l) {
      for (int t = 0; t < tensors; ++t) REQUIRE(m->FinishCopyOut(name(l, t), mb).ok());
    }
    m->EndStep();
    note();
  };
  auto backward = [&](int mb) {
    for (int t = 0; t < tensors; ++t) REQUIRE(m->Prefetch(name(layers - 1, t), mb).ok());
    for (int l = layers - 1; l >= 0; --l) {
      if (l > 0) {
        for (int t = 0; t < tensors; ++t) REQUIRE(m->Prefetch(name(l - 1, t), mb).ok());
      }
      note();
      for (int t = 0; t < tensors; ++t) {
        auto got = m->Load(name(l, t), mb);
        REQUIRE(got.ok());
        auto want = data_of(l, t, mb);
        if (m->SpecOf(name(l, t)).fp8()) {
          CheckFp8Close(*got, want, shape_of(l, t)[1]);
        } else {
          REQUIRE(BitEqual(*got, want));
        }
        note();
      }
      for (int t = 0; t < tensors; ++t) REQUIRE(m->Release(name(l, t), mb).ok());
      m->EndStep();
      note();
    }
  };
  // 1F1B with 3 in flight: warm-up, steady state, cool-down.
  const int in_flight = 3;
  for (int mb = 0; mb < in_flight; ++mb) forward(mb);
  for (int mb = in_flight; mb < mbs; ++mb) {
    backward(mb - in_flight);
    forward(mb);
  }
  for (int mb = mbs - in_flight; mb < mbs; ++mb) backward(mb);
  CHECK(m->live_instances() == 0);
  CHECK(d.allocated_bytes() == 0);
  CHECK(host.allocated_bytes() == 0);
  CHECK(remote.allocated_bytes() == 0);
  r.peak = d.peak();
  r.allocated_peak = d.allocated_peak();
  r.remote_peak = remote.peak();
  r.host_peak = host.high_water();
  return r;
}

}  // namespace

TEST_CASE("interleaved offloads and prefetches are deterministic in bytes") {
  StressResult calm = RunStress(0);
  StressResult shaken = RunStress(40);  // copy engines delayed at random
  CHECK(calm.trace == shaken.trace);
  CHECK(calm.peak == shaken.peak);
  CHECK(calm.allocated_peak == shaken.allocated_peak);
  CHECK(calm.remote_peak == shaken.remote_peak);
  CHECK(calm.host_peak == shaken.host_peak);
  CHECK(calm.peak >= calm.allocated_peak);
  CHECK(calm.remote_peak > 0);
  CHECK(calm.host_peak > 0);
}
