// CachingAllocatorModel: a model of PyTorch's CUDA caching allocator
// (c10/cuda/CUDACachingAllocator.cpp), one device and one stream, for
// predicting the *reserved* bytes of a framework job from its predicted
// allocation sequence (docs/targets.md, "Reserved, not only allocated").
//
// The rules, each cited in docs/targets.md with its line in PyTorch:
//   rounding     requests round up to 512 B (kMinBlockSize);
//   pools        rounded sizes up to 1 MiB (kSmallSize) come from the small
//                pool, larger ones from the large pool;
//   segments     a small-pool miss allocates a 2 MiB segment (kSmallBuffer);
//                a large-pool miss under 10 MiB (kMinLargeAlloc) a 20 MiB
//                segment (kLargeBuffer); larger requests a segment of their
//                size rounded up to 2 MiB (kRoundLarge);
//   best fit     the smallest cached free block of the pool that holds the
//                request (ties by address); with max_split_size, a block of
//                at least that size serves no smaller request, and serves a
//                request of at least that size only when it is under the
//                request plus 20 MiB;
//   splitting    a block is split when the rest is at least 512 B (small
//                pool, or any pool with expandable segments) or over 1 MiB
//                (large pool, requests under max_split_size only);
//   freeing      a freed block merges with free neighbours of its segment
//                and stays cached: segments go back to the driver only when
//                a new segment would pass `capacity_bytes` (the OOM retry
//                frees every wholly free segment, then tries again);
//   expandable   with expandable_segments, each pool is one segment that
//                maps pages (2 MiB small, 20 MiB large) at its end as needed.
// Reserved is the sum of segment sizes (mapped pages); allocated the sum of
// blocks in use, at their rounded sizes (PyTorch's allocated_bytes).
//
// Addresses are not modelled beyond their order: segments take increasing
// addresses in creation order, as a fresh process's cudaMalloc tends to
// give, which decides best fit's ties. Streams, events, graphs' private
// pools and the roundup_power2_divisions option are not modelled.
#pragma once

#include <cstdint>
#include <limits>
#include <set>
#include <tuple>
#include <vector>

namespace memplan {

struct CachingAllocatorConfig {
  // PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:N (bytes here); unlimited by
  // default, as in PyTorch.
  int64_t max_split_size_bytes = std::numeric_limits<int64_t>::max();
  // PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True.
  bool expandable_segments = false;
  // What the device can reserve: a segment that would pass it first frees
  // every cached segment with nothing allocated (PyTorch's OOM retry). Past
  // it after that, the segment is still counted (the job would OOM there).
  int64_t capacity_bytes = std::numeric_limits<int64_t>::max();
};

class CachingAllocatorModel {
 public:
  static constexpr int64_t kMinBlockSize = 512;
  static constexpr int64_t kSmallSize = int64_t{1} << 20;
  static constexpr int64_t kSmallBuffer = int64_t{2} << 20;
  static constexpr int64_t kLargeBuffer = int64_t{20} << 20;
  static constexpr int64_t kMinLargeAlloc = int64_t{10} << 20;
  static constexpr int64_t kRoundLarge = int64_t{2} << 20;

  explicit CachingAllocatorModel(CachingAllocatorConfig config = {});

  // The block size a request of `bytes` (> 0) takes: rounded up to 512 B.
  static int64_t RoundSize(int64_t bytes);
  // The segment a miss of rounded size `size` allocates (non-expandable).
  static int64_t SegmentSize(int64_t size);

  // Allocates `bytes` (> 0); returns a handle for Free. O(log n) in the
  // number of cached blocks, O(n) in a segment's blocks for expandable
  // growth.
  int64_t Allocate(int64_t bytes);
  void Free(int64_t handle);

  int64_t allocated_bytes() const { return allocated_; }
  int64_t reserved_bytes() const { return reserved_; }
  int64_t peak_allocated_bytes() const { return peak_allocated_; }
  int64_t peak_reserved_bytes() const { return peak_reserved_; }
  int64_t segments() const;  // live segments
  // Segments freed back to the driver by the OOM retry.
  int64_t released_segments() const { return released_; }

 private:
  struct Block {
    int32_t segment = -1;
    int64_t offset = 0;  // inside its segment
    int64_t size = 0;
    bool free = true;
    int32_t prev = -1, next = -1;  // neighbours in the segment, by offset
  };
  struct Segment {
    int64_t address = 0;  // creation order, for ties
    int64_t size = 0;
    bool small = false;
    bool alive = true;
    int32_t first = -1, last = -1;  // blocks at its lowest and highest offset
  };
  // A pool's free blocks ordered as PyTorch's BlockComparatorSize: size,
  // then address.
  using FreeSet = std::set<std::tuple<int64_t, int64_t, int32_t>>;  // (size, address, block)

  FreeSet& PoolOf(bool small) { return small ? small_free_ : large_free_; }
  std::tuple<int64_t, int64_t, int32_t> Key(int32_t b) const;
  int32_t NewBlock(const Block& b);  // a spare slot, or a new one
  int32_t FindFree(bool small, int64_t size);
  int32_t NewSegment(bool small, int64_t size);
  int32_t GrowExpandable(bool small, int64_t size);
  bool ShouldSplit(const Block& b, bool small, int64_t size) const;
  void ReleaseFreeSegments();
  void Account();

  CachingAllocatorConfig config_;
  std::vector<Block> blocks_;
  std::vector<int32_t> spare_blocks_;
  std::vector<Segment> segments_;
  FreeSet small_free_, large_free_;
  int32_t expandable_[2] = {-1, -1};  // large, small
  int64_t next_address_ = 0;
  int64_t allocated_ = 0, reserved_ = 0, peak_allocated_ = 0, peak_reserved_ = 0;
  int64_t released_ = 0;
};

}  // namespace memplan
