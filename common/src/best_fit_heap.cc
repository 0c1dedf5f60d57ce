#include "memplan/common/best_fit_heap.h"

#include <algorithm>

#include "memplan/common/check.h"

namespace memplan {

BestFitHeap::BestFitHeap(int64_t alignment, bool track_allocations)
    : alignment_(alignment), track_(track_allocations) {
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
    auto by_offset = free_by_offset_.find(block_offset);
    if (block_size > size) {
      // The remainder keeps its place between the same neighbours: reuse
      // both tree nodes instead of freeing and allocating them.
      auto size_node = free_by_size_.extract(fit);
      size_node.value() = {block_size - size, block_offset + size};
      free_by_size_.insert(std::move(size_node));
      auto offset_node = free_by_offset_.extract(by_offset++);
      offset_node.key() = block_offset + size;
      offset_node.mapped() = block_size - size;
      free_by_offset_.insert(by_offset, std::move(offset_node));
    } else {
      free_by_size_.erase(fit);
      free_by_offset_.erase(by_offset);
    }
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
  if (track_) allocated_.emplace(offset, size);
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
  MEMPLAN_CHECK(track_, "Free(offset) needs a heap that tracks its allocations");
  auto it = allocated_.find(offset);
  MEMPLAN_CHECK(it != allocated_.end(), "free of an unallocated offset");
  int64_t size = it->second;
  allocated_.erase(it);
  Release(offset, size);
}

void BestFitHeap::Free(int64_t offset, int64_t bytes) {
  int64_t size = AlignedSize(bytes);
  if (track_) {
    auto it = allocated_.find(offset);
    MEMPLAN_CHECK(it != allocated_.end() && it->second == size, "free of an unallocated offset or size");
    allocated_.erase(it);
  }
  Release(offset, size);
}

void BestFitHeap::Release(int64_t offset, int64_t size) {
  allocated_bytes_ -= size;
  // Coalesce with the free neighbours, reusing their tree nodes.
  auto next = free_by_offset_.lower_bound(offset);
  bool merge_next = next != free_by_offset_.end() && offset + size == next->first;
  auto prev = next == free_by_offset_.begin() ? free_by_offset_.end() : std::prev(next);
  bool merge_prev = prev != free_by_offset_.end() && prev->first + prev->second == offset;
  int64_t merged_offset = merge_prev ? prev->first : offset;
  int64_t merged_size = size + (merge_prev ? prev->second : 0) + (merge_next ? next->second : 0);
  if (merged_offset + merged_size == top_) {
    if (merge_prev) EraseFree(prev);
    if (merge_next) EraseFree(next);
    top_ = merged_offset;  // the arena shrinks back; high_water_ remembers
    return;
  }
  auto rekey_size = [&](int64_t old_size, int64_t old_offset) {
    auto node = free_by_size_.extract({old_size, old_offset});
    node.value() = {merged_size, merged_offset};
    free_by_size_.insert(std::move(node));
  };
  if (merge_prev) {
    rekey_size(prev->second, prev->first);
    prev->second = merged_size;  // same offset key: no re-insert
    if (merge_next) EraseFree(next);
  } else if (merge_next) {
    rekey_size(next->second, next->first);
    auto hint = std::next(next);
    auto node = free_by_offset_.extract(next);
    node.key() = merged_offset;
    node.mapped() = merged_size;
    free_by_offset_.insert(hint, std::move(node));
  } else {
    InsertFree(merged_offset, merged_size);
  }
}

}  // namespace memplan
