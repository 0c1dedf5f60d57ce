// A model of PyTorch's CUDA caching allocator: caching_allocator.h states
// the rules, docs/targets.md cites PyTorch's lines for each.
#include "memplan/common/caching_allocator.h"

#include <algorithm>

#include "memplan/common/check.h"

namespace memplan {

CachingAllocatorModel::CachingAllocatorModel(CachingAllocatorConfig config) : config_(config) {}

int64_t CachingAllocatorModel::RoundSize(int64_t bytes) {
  if (bytes < kMinBlockSize) return kMinBlockSize;
  return kMinBlockSize * ((bytes + kMinBlockSize - 1) / kMinBlockSize);
}

int64_t CachingAllocatorModel::SegmentSize(int64_t size) {
  if (size <= kSmallSize) return kSmallBuffer;
  if (size < kMinLargeAlloc) return kLargeBuffer;
  return kRoundLarge * ((size + kRoundLarge - 1) / kRoundLarge);
}

int64_t CachingAllocatorModel::segments() const {
  int64_t n = 0;
  for (const Segment& s : segments_) n += s.alive && s.size > 0;
  return n;
}

std::tuple<int64_t, int64_t, int32_t> CachingAllocatorModel::Key(int32_t b) const {
  const Block& x = blocks_[static_cast<size_t>(b)];
  return {x.size, segments_[static_cast<size_t>(x.segment)].address + x.offset, b};
}

int32_t CachingAllocatorModel::FindFree(bool small, int64_t size) {
  FreeSet& pool = PoolOf(small);
  auto it = pool.lower_bound({size, std::numeric_limits<int64_t>::min(), -1});
  if (it == pool.end()) return -1;
  const int64_t found = std::get<0>(*it);
  // An oversize block (>= max_split_size) serves no smaller request, and a
  // large request only when little of it is wasted.
  const int64_t max_split = config_.max_split_size_bytes;
  if (size < max_split && found >= max_split) return -1;
  if (size >= max_split && found >= size + kLargeBuffer) return -1;
  const int32_t b = std::get<2>(*it);
  pool.erase(it);
  return b;
}

bool CachingAllocatorModel::ShouldSplit(const Block& b, bool small, int64_t size) const {
  const int64_t rest = b.size - size;
  // Expandable segments split large blocks as small ones (their pages are
  // mapped on demand, so a remainder costs nothing).
  if (small || config_.expandable_segments) return rest >= kMinBlockSize;
  return size < config_.max_split_size_bytes && rest > kSmallSize;
}

int32_t CachingAllocatorModel::NewBlock(const Block& b) {
  if (!spare_blocks_.empty()) {
    const int32_t id = spare_blocks_.back();
    spare_blocks_.pop_back();
    blocks_[static_cast<size_t>(id)] = b;
    return id;
  }
  blocks_.push_back(b);
  return static_cast<int32_t>(blocks_.size() - 1);
}

int32_t CachingAllocatorModel::NewSegment(bool small, int64_t size) {
  if (reserved_ + size > config_.capacity_bytes) ReleaseFreeSegments();
  Segment s;
  s.address = next_address_;
  s.size = size;
  s.small = small;
  next_address_ += size;
  const int32_t id = static_cast<int32_t>(segments_.size());
  Block b;
  b.segment = id;
  b.size = size;
  const int32_t bi = NewBlock(b);
  s.first = s.last = bi;
  segments_.push_back(s);
  reserved_ += size;
  return bi;
}

int32_t CachingAllocatorModel::GrowExpandable(bool small, int64_t size) {
  const int64_t page = small ? kSmallBuffer : kLargeBuffer;
  int32_t& seg = expandable_[small ? 1 : 0];
  if (seg < 0) {
    Segment s;
    s.address = next_address_;
    s.small = small;
    // One virtual range per pool, as large as the device: later segments
    // never sit inside it.
    next_address_ += int64_t{1} << 50;
    seg = static_cast<int32_t>(segments_.size());
    segments_.push_back(s);
  }
  Segment& s = segments_[static_cast<size_t>(seg)];
  int32_t tail = s.last;
  const bool tail_free = tail >= 0 && blocks_[static_cast<size_t>(tail)].free;
  const int64_t have = tail_free ? blocks_[static_cast<size_t>(tail)].size : 0;
  const int64_t mapped = page * ((size - have + page - 1) / page);
  if (reserved_ + mapped > config_.capacity_bytes) ReleaseFreeSegments();
  if (tail_free) {
    PoolOf(small).erase(Key(tail));
    blocks_[static_cast<size_t>(tail)].size += mapped;
  } else {
    Block b;
    b.segment = seg;
    b.offset = s.size;
    b.size = mapped;
    b.prev = tail;
    const int32_t bi = NewBlock(b);
    Segment& s2 = segments_[static_cast<size_t>(seg)];  // blocks_ may have moved, segments_ not
    if (tail >= 0) blocks_[static_cast<size_t>(tail)].next = bi;
    if (s2.first < 0) s2.first = bi;
    s2.last = bi;
    tail = bi;
  }
  segments_[static_cast<size_t>(seg)].size += mapped;
  reserved_ += mapped;
  return tail;
}

void CachingAllocatorModel::ReleaseFreeSegments() {
  for (size_t i = 0; i < segments_.size(); ++i) {
    Segment& s = segments_[i];
    if (!s.alive || s.first < 0) continue;
    const bool expandable = static_cast<int32_t>(i) == expandable_[0] || static_cast<int32_t>(i) == expandable_[1];
    Block& tail = blocks_[static_cast<size_t>(s.last)];
    if (!tail.free) continue;
    if (expandable) {
      // Unmap the whole pages of the free tail.
      const int64_t page = s.small ? kSmallBuffer : kLargeBuffer;
      const int64_t drop = (tail.size / page) * page;
      if (drop == 0) continue;
      PoolOf(s.small).erase(Key(s.last));
      tail.size -= drop;
      s.size -= drop;
      reserved_ -= drop;
      if (tail.size > 0) {
        PoolOf(s.small).insert(Key(s.last));
      } else {
        const int32_t gone = s.last;
        s.last = tail.prev;
        if (s.last >= 0) blocks_[static_cast<size_t>(s.last)].next = -1;
        if (s.first == gone) s.first = -1;
        spare_blocks_.push_back(gone);
      }
      ++released_;
      continue;
    }
    if (s.first != s.last) continue;  // something in it is allocated
    PoolOf(s.small).erase(Key(s.first));
    spare_blocks_.push_back(s.first);
    s.alive = false;
    reserved_ -= s.size;
    ++released_;
  }
}

void CachingAllocatorModel::Account() {
  peak_allocated_ = std::max(peak_allocated_, allocated_);
  peak_reserved_ = std::max(peak_reserved_, reserved_);
}

int64_t CachingAllocatorModel::Allocate(int64_t bytes) {
  MEMPLAN_CHECK(bytes > 0, "allocation of no bytes");
  const int64_t size = RoundSize(bytes);
  const bool small = size <= kSmallSize;
  int32_t b = FindFree(small, size);
  if (b < 0) b = config_.expandable_segments ? GrowExpandable(small, size) : NewSegment(small, SegmentSize(size));
  if (ShouldSplit(blocks_[static_cast<size_t>(b)], small, size)) {
    Block rest;
    {
      const Block& x = blocks_[static_cast<size_t>(b)];
      rest.segment = x.segment;
      rest.offset = x.offset + size;
      rest.size = x.size - size;
      rest.prev = b;
      rest.next = x.next;
    }
    const int32_t ri = NewBlock(rest);
    Block& x = blocks_[static_cast<size_t>(b)];
    if (x.next >= 0) blocks_[static_cast<size_t>(x.next)].prev = ri;
    Segment& s = segments_[static_cast<size_t>(x.segment)];
    if (s.last == b) s.last = ri;
    x.next = ri;
    x.size = size;
    PoolOf(small).insert(Key(ri));
  }
  Block& x = blocks_[static_cast<size_t>(b)];
  x.free = false;
  allocated_ += x.size;
  Account();
  return b;
}

void CachingAllocatorModel::Free(int64_t handle) {
  MEMPLAN_CHECK(handle >= 0 && handle < static_cast<int64_t>(blocks_.size()), "unknown block");
  int32_t b = static_cast<int32_t>(handle);
  MEMPLAN_CHECK(!blocks_[static_cast<size_t>(b)].free, "block freed twice");
  Block& x = blocks_[static_cast<size_t>(b)];
  const bool small = segments_[static_cast<size_t>(x.segment)].small;
  allocated_ -= x.size;
  x.free = true;
  FreeSet& pool = PoolOf(small);
  // Merge with a free neighbour: the block absorbs it (PyTorch's
  // try_merge_blocks).
  auto absorb = [&](int32_t into, int32_t gone) {
    Block& a = blocks_[static_cast<size_t>(into)];
    Block& g = blocks_[static_cast<size_t>(gone)];
    pool.erase(Key(into));
    pool.erase(Key(gone));
    a.size += g.size;
    a.next = g.next;
    if (g.next >= 0) blocks_[static_cast<size_t>(g.next)].prev = into;
    Segment& s = segments_[static_cast<size_t>(a.segment)];
    if (s.last == gone) s.last = into;
    spare_blocks_.push_back(gone);
  };
  if (x.next >= 0 && blocks_[static_cast<size_t>(x.next)].free) absorb(b, x.next);
  if (const int32_t p = blocks_[static_cast<size_t>(b)].prev; p >= 0 && blocks_[static_cast<size_t>(p)].free) {
    absorb(p, b);
    b = p;
  }
  pool.insert(Key(b));
}

}  // namespace memplan
