// BestFitHeap: the deterministic online best-fit allocator that both the
// planner (to predict `peak`, fragmentation included) and the host runtime's
// device arena use, so that measured equals predicted byte for byte.
//
// Allocate() takes the smallest free block that fits (lowest offset among
// equal sizes); when none fits it grows the arena from its top, reusing a
// free block that touches the top. Free() coalesces with its neighbours.
// Sizes are rounded up to `alignment`. Every operation is O(log n).
#pragma once

#include <cstdint>
#include <map>
#include <memory_resource>
#include <set>
#include <unordered_map>
#include <utility>

namespace memplan {

class BestFitHeap {
 public:
  // Without `track_allocations` the heap does not remember its blocks:
  // callers free with Free(offset, bytes) (the planner's placement, which
  // knows every buffer's size), saving a hash-table insert and erase per block.
  explicit BestFitHeap(int64_t alignment = 256, bool track_allocations = true);

  // Returns the offset of a new block of at least `bytes` (> 0).
  int64_t Allocate(int64_t bytes);
  // Frees the block at `offset` (must be allocated).
  void Free(int64_t offset);
  // Frees the block at `offset` that Allocate(bytes) returned.
  void Free(int64_t offset, int64_t bytes);
  // The effect of Allocate(bytes) immediately followed by Free() of that
  // block: the heap ends in the same state, only the high-water mark can
  // move. O(log n) and no mutation of the free lists.
  void AllocateAndFree(int64_t bytes);

  int64_t AlignedSize(int64_t bytes) const;
  // Highest offset + size ever reached: the arena size a run needs.
  int64_t high_water() const { return high_water_; }
  // Bytes currently allocated (aligned sizes).
  int64_t allocated_bytes() const { return allocated_bytes_; }

 private:
  void InsertFree(int64_t offset, int64_t size);
  void EraseFree(std::pmr::map<int64_t, int64_t>::iterator it);

  // Coalesces the free block [offset, offset + size) into the free lists.
  void Release(int64_t offset, int64_t size);

  int64_t alignment_;
  bool track_;
  int64_t top_ = 0;
  int64_t high_water_ = 0;
  int64_t allocated_bytes_ = 0;
  // Node containers draw from one pool: a planning run places hundreds of
  // thousands of buffers.
  std::pmr::unsynchronized_pool_resource pool_;
  std::pmr::map<int64_t, int64_t> free_by_offset_{&pool_};          // offset -> size
  std::pmr::set<std::pair<int64_t, int64_t>> free_by_size_{&pool_};  // (size, offset)
  std::pmr::unordered_map<int64_t, int64_t> allocated_{&pool_};     // offset -> size
};

}  // namespace memplan
