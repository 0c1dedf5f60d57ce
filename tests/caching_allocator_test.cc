// The PyTorch caching-allocator model (common/caching_allocator.h), one rule
// per test case on a sequence worked by hand (docs/targets.md lists the
// same sequences with the rule each shows).
#include <doctest/doctest.h>

#include <random>
#include <vector>

#include "memplan/common/caching_allocator.h"

namespace memplan {
namespace {

constexpr int64_t KiB = 1024, MiB = 1024 * 1024;

TEST_CASE("caching allocator: requests round up to 512 bytes") {
  CHECK(CachingAllocatorModel::RoundSize(1) == 512);
  CHECK(CachingAllocatorModel::RoundSize(512) == 512);
  CHECK(CachingAllocatorModel::RoundSize(513) == 1024);
  CachingAllocatorModel a;
  a.Allocate(1000);  // 1024 B allocated, a 2 MiB small segment reserved
  CHECK(a.allocated_bytes() == 1024);
  CHECK(a.reserved_bytes() == 2 * MiB);
}

TEST_CASE("caching allocator: small requests share a 2 MiB segment, large ones never use it") {
  CachingAllocatorModel a;
  // Three 700 KiB requests: two fit the first 2 MiB segment (1400 KiB, 648
  // KiB left), the third needs a second one.
  for (int i = 0; i < 3; ++i) a.Allocate(700 * KiB);
  CHECK(a.allocated_bytes() == 2100 * KiB);
  CHECK(a.reserved_bytes() == 4 * MiB);
  CHECK(a.segments() == 2);
  // 1 MiB + 512 B is large-pool: a 20 MiB segment, although 2.2 MiB of
  // small segments are free.
  a.Allocate(MiB + 512);
  CHECK(a.reserved_bytes() == 24 * MiB);
}

TEST_CASE("caching allocator: a large miss under 10 MiB takes 20 MiB, and the rest is split and reused") {
  CachingAllocatorModel a;
  a.Allocate(5 * MiB);  // 20 MiB segment, split: 5 used, 15 free
  CHECK(a.reserved_bytes() == 20 * MiB);
  a.Allocate(8 * MiB);  // best fit: the 15 MiB block, split (7 MiB left > 1 MiB)
  CHECK(a.reserved_bytes() == 20 * MiB);
  CHECK(a.allocated_bytes() == 13 * MiB);
  // 6.5 MiB fits the 7 MiB rest, whose 0.5 MiB remainder is not split off
  // (a large block splits only when more than 1 MiB remains): 7 MiB allocated.
  a.Allocate(6 * MiB + 512 * KiB);
  CHECK(a.allocated_bytes() == 20 * MiB);
  CHECK(a.reserved_bytes() == 20 * MiB);
}

TEST_CASE("caching allocator: 10 MiB and more is its own segment rounded to 2 MiB") {
  CachingAllocatorModel a;
  a.Allocate(30 * MiB + 1);  // rounds to 30 MiB + 512 B; segment 32 MiB
  CHECK(a.reserved_bytes() == 32 * MiB);
  // The 2 MiB - 512 B rest is over 1 MiB, so it was split off and serves
  // a 1.5 MiB request without a new segment.
  a.Allocate(MiB + 512 * KiB);
  CHECK(a.reserved_bytes() == 32 * MiB);
  CHECK(CachingAllocatorModel::SegmentSize(10 * MiB) == 10 * MiB);
  CHECK(CachingAllocatorModel::SegmentSize(10 * MiB - 512) == 20 * MiB);
}

TEST_CASE("caching allocator: a freed block merges with its free neighbours and stays reserved") {
  CachingAllocatorModel a;
  const int64_t x = a.Allocate(4 * MiB), y = a.Allocate(4 * MiB);  // one 20 MiB segment: 4 | 4 | 12 free
  a.Allocate(4 * MiB);                                              // 4 | 4 | 4 | 8 free
  a.Free(x);
  a.Free(y);  // merges with x: an 8 MiB free block at the start
  CHECK(a.allocated_bytes() == 4 * MiB);
  CHECK(a.reserved_bytes() == 20 * MiB);
  // 8 MiB: best fit among two free 8 MiB blocks takes the lower address.
  a.Allocate(8 * MiB);
  a.Allocate(8 * MiB);  // the other one: still one segment
  CHECK(a.reserved_bytes() == 20 * MiB);
  // Fragmentation: nothing of 9 MiB is free, so a new 20 MiB segment.
  a.Allocate(9 * MiB);
  CHECK(a.reserved_bytes() == 40 * MiB);
  CHECK(a.allocated_bytes() == 29 * MiB);
}

TEST_CASE("caching allocator: max_split_size keeps oversize blocks whole") {
  CachingAllocatorConfig c;
  c.max_split_size_bytes = 64 * MiB;
  CachingAllocatorModel a(c);
  const int64_t big = a.Allocate(100 * MiB);  // 100 MiB segment, not split (at least max_split)
  a.Free(big);
  // A 10 MiB request may not take the oversize 100 MiB block: new segment.
  a.Allocate(10 * MiB);
  CHECK(a.reserved_bytes() == 110 * MiB);
  // A 90 MiB request may (100 < 90 + 20): whole, unsplit.
  a.Allocate(90 * MiB);
  CHECK(a.reserved_bytes() == 110 * MiB);
  CHECK(a.allocated_bytes() == 110 * MiB);
  // Without the setting the 10 MiB request splits the cached block.
  CachingAllocatorModel b;
  b.Free(b.Allocate(100 * MiB));
  b.Allocate(10 * MiB);
  CHECK(b.reserved_bytes() == 100 * MiB);
}

TEST_CASE("caching allocator: the OOM retry frees wholly cached segments") {
  CachingAllocatorConfig c;
  c.capacity_bytes = 64 * MiB;
  CachingAllocatorModel a(c);
  a.Free(a.Allocate(40 * MiB));  // a cached 40 MiB segment
  a.Allocate(30 * MiB);          // served from it (split: 10 MiB left)
  CHECK(a.reserved_bytes() == 40 * MiB);
  CachingAllocatorModel b(c);
  const int64_t h = b.Allocate(40 * MiB);
  b.Free(h);
  b.Allocate(50 * MiB);  // 40 cached + 50 > 64: the cached segment is released first
  CHECK(b.released_segments() == 1);
  CHECK(b.reserved_bytes() == 50 * MiB);
  CHECK(b.peak_reserved_bytes() == 50 * MiB);
}

TEST_CASE("caching allocator: expandable segments map 20 MiB pages into one segment") {
  CachingAllocatorConfig c;
  c.expandable_segments = true;
  CachingAllocatorModel a(c);
  const int64_t x = a.Allocate(30 * MiB);  // maps 2 pages: 40 MiB, 10 MiB free at the end
  CHECK(a.reserved_bytes() == 40 * MiB);
  a.Allocate(25 * MiB);  // the free 10 MiB tail grows by one page to 30 MiB
  CHECK(a.reserved_bytes() == 60 * MiB);
  CHECK(a.segments() == 1);
  a.Free(x);
  // The freed 30 MiB at the start serves 30 MiB: nothing new is mapped.
  a.Allocate(30 * MiB);
  CHECK(a.reserved_bytes() == 60 * MiB);
  // Without expandable segments: a 30 MiB segment and a 26 MiB one (25 MiB
  // rounded to 2 MiB; the 1 MiB rest is not split off), then the freed
  // 30 MiB segment serves 30 MiB again.
  CachingAllocatorModel b;
  const int64_t y = b.Allocate(30 * MiB);
  b.Allocate(25 * MiB);
  CHECK(b.allocated_bytes() == 56 * MiB);
  b.Free(y);
  b.Allocate(30 * MiB);
  CHECK(b.reserved_bytes() == 56 * MiB);
  // A small rest splits off under expandable segments (512 B suffices):
  // 5 MiB then 18 MiB take 20 + 20 MiB of pages, 38 MiB in ordinary segments.
  CachingAllocatorModel e(c), f;
  e.Allocate(5 * MiB);
  e.Allocate(18 * MiB);
  f.Allocate(5 * MiB);
  f.Allocate(18 * MiB);
  CHECK(e.reserved_bytes() == 40 * MiB);
  CHECK(e.allocated_bytes() == 23 * MiB);
  CHECK(f.reserved_bytes() == 38 * MiB);
}

TEST_CASE("caching allocator: allocated returns to zero and reserved never drops without the OOM retry") {
  std::mt19937_64 rng(7);
  CachingAllocatorModel a;
  std::vector<int64_t> live;
  int64_t checks = 0, last_reserved = 0;
  for (int i = 0; i < 5000; ++i) {
    if (live.empty() || rng() % 3 != 0) {
      live.push_back(a.Allocate(static_cast<int64_t>(1 + rng() % (30 * MiB))));
    } else {
      const size_t k = rng() % live.size();
      a.Free(live[k]);
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(k));
    }
    CHECK(a.reserved_bytes() >= last_reserved);
    CHECK(a.reserved_bytes() >= a.allocated_bytes());
    last_reserved = a.reserved_bytes();
    ++checks;
  }
  for (int64_t h : live) a.Free(h);
  CHECK(a.allocated_bytes() == 0);
  CHECK(checks == 5000);
}

}  // namespace
}  // namespace memplan
