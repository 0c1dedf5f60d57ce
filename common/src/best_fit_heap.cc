#include "memplan/common/best_fit_heap.h"

#include <algorithm>

#include "memplan/common/check.h"

namespace memplan {

BestFitHeap::BestFitHeap(int64_t alignment) : alignment_(alignment) {
  MEMPLAN_CHECK(alignment > 0, "alignment must be positive");
}

int64_t BestFitHeap::AlignedSize(int64_t bytes) const {
  return (bytes + alignment_ - 1) / alignment_ * alignment_;
}

void BestFitHeap::InsertFree(int64_t offset, int64_t size) {
  free_by_offset_.emplace(offset, size);
  free_by_size_.emplace(size, offset);
}

void BestFitHeap::EraseFree(std::pmr::map<int64_t, int64_t>::iterator it) {
  free_by_size_.erase({it->second, it->first});
  free_by_offset_.erase(it);
}

int64_t BestFitHeap::Allocate(int64_t bytes) {
  MEMPLAN_CHECK(bytes > 0, "allocation of zero bytes");
  int64_t size = AlignedSize(bytes);
  int64_t offset = 0;
  auto fit = free_by_size_.lower_bound({size, INT64_MIN});
  if (fit != free_by_size_.end()) {
    auto [block_size, block_offset] = *fit;
    EraseFree(free_by_offset_.find(block_offset));
    if (block_size > size) InsertFree(block_offset + size, block_size - size);
    offset = block_offset;
  } else {
    // Grow from the top, absorbing a free block that ends there.
    offset = top_;
    if (!free_by_offset_.empty()) {
      auto last = std::prev(free_by_offset_.end());
      if (last->first + last->second == top_) {
        offset = last->first;
        EraseFree(last);
      }
    }
    top_ = offset + size;
    high_water_ = std::max(high_water_, top_);
  }
  allocated_.emplace(offset, size);
  allocated_bytes_ += size;
  return offset;
}

void BestFitHeap::AllocateAndFree(int64_t bytes) {
  MEMPLAN_CHECK(bytes > 0, "allocation of zero bytes");
  int64_t size = AlignedSize(bytes);
  if (free_by_size_.lower_bound({size, INT64_MIN}) != free_by_size_.end()) return;  // fits below the top
  int64_t offset = top_;
  if (!free_by_offset_.empty()) {
    auto last = std::prev(free_by_offset_.end());
    if (last->first + last->second == top_) offset = last->first;
  }
  high_water_ = std::max(high_water_, offset + size);
}

void BestFitHeap::Free(int64_t offset) {
  auto it = allocated_.find(offset);
  MEMPLAN_CHECK(it != allocated_.end(), "free of an unallocated offset");
  int64_t size = it->second;
  allocated_.erase(it);
  allocated_bytes_ -= size;
  // Coalesce with the free neighbours.
  auto next = free_by_offset_.lower_bound(offset);
  if (next != free_by_offset_.end() && offset + size == next->first) {
    size += next->second;
    auto after = std::next(next);
    EraseFree(next);
    next = after;
  }
  if (next != free_by_offset_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == offset) {
      offset = prev->first;
      size += prev->second;
      EraseFree(prev);
    }
  }
  if (offset + size == top_) {
    top_ = offset;  // the arena shrinks back; high_water_ remembers
    return;
  }
  InsertFree(offset, size);
}

}  // namespace memplan
