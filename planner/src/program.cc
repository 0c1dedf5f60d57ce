#include "memplan/planner/program.h"

#include <algorithm>
#include <functional>

namespace memplan::planner {

ProgramWalker::ProgramWalker(const PlanningProblem& p, int32_t rank, const std::vector<Interval>& intervals,
                             std::vector<size_t> mine)
    : p_(p),
      tl_(p.timelines[static_cast<size_t>(rank)]),
      ivs_(intervals),
      cross_(p.cross[static_cast<size_t>(rank)]),
      mine_(std::move(mine)) {
  std::stable_sort(mine_.begin(), mine_.end(), [&](size_t x, size_t y) { return ivs_[x].first < ivs_[y].first; });
}

bool ProgramWalker::Next() {
  using Entry = std::pair<std::pair<int64_t, int64_t>, ProgramBuffer>;
  auto later = [](const Entry& a, const Entry& b) { return a.first > b.first; };
  if (step_ + 1 >= tl_.steps) return false;
  ++step_;
  allocs_.clear();
  frees_.clear();
  auto go_live = [&](const ProgramBuffer& b) { allocs_.push_back(b); };
  for (; next_interval_ < mine_.size() && ivs_[mine_[next_interval_]].first == step_; ++next_interval_) {
    const Interval& iv = ivs_[mine_[next_interval_]];
    ProgramBuffer b;
    b.first = iv.first;
    b.last = iv.last;
    b.bytes = iv.bytes;
    b.interval = static_cast<int64_t>(mine_[next_interval_]);
    go_live(b);
  }
  for (; next_cross_ < cross_.size() && cross_[next_cross_].first == step_; ++next_cross_) {
    ProgramBuffer b;
    b.first = cross_[next_cross_].first;
    b.last = cross_[next_cross_].last;
    b.bytes = cross_[next_cross_].bytes;
    b.cross = static_cast<int32_t>(next_cross_);
    go_live(b);
  }
  for (; next_block_ < tl_.blocks.size() && tl_.blocks[next_block_].first == step_; ++next_block_) {
    const Block& blk = tl_.blocks[next_block_];
    const LayerBuffers& lb = p_.layer_buffers[static_cast<size_t>(blk.layer)];
    const auto& list = blk.forward ? lb.forward : lb.backward;
    for (size_t k = 0; k < list.size(); ++k) {
      ProgramBuffer b;
      if (!BlockBufferSteps(blk, lb, list[k], &b.first, &b.last)) continue;
      b.bytes = list[k].bytes;
      b.block = static_cast<int32_t>(next_block_);
      b.buffer = static_cast<int32_t>(k);
      pending_.push_back({{b.first, seq_++}, b});
      std::push_heap(pending_.begin(), pending_.end(), later);
    }
  }
  while (!pending_.empty() && pending_.front().first.first == step_) {
    std::pop_heap(pending_.begin(), pending_.end(), later);
    go_live(pending_.back().second);
    pending_.pop_back();
  }
  return true;
}

const std::vector<ProgramBuffer>& ProgramWalker::Frees() {
  auto later = [](const Live& a, const Live& b) { return a > b; };
  frees_.clear();
  for (const ProgramBuffer& b : allocs_) {
    if (b.last == step_) {  // lives for this step only: no need to queue it
      frees_.push_back(b);
      continue;
    }
    int32_t slot;
    if (free_slots_.empty()) {
      slot = static_cast<int32_t>(slab_.size());
      slab_.push_back(b);
    } else {
      slot = free_slots_.back();
      free_slots_.pop_back();
      slab_[static_cast<size_t>(slot)] = b;
    }
    live_.push_back({b.last, seq_++, slot});
    std::push_heap(live_.begin(), live_.end(), later);
  }
  allocs_.clear();
  while (!live_.empty() && live_.front().last == step_) {
    std::pop_heap(live_.begin(), live_.end(), later);
    int32_t slot = live_.back().slot;
    frees_.push_back(slab_[static_cast<size_t>(slot)]);
    free_slots_.push_back(slot);
    live_.pop_back();
  }
  return frees_;
}

}  // namespace memplan::planner
