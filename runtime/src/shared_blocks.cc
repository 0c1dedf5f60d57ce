// Block AttnRes with a single copy (docs/design.md, "Shared blocks"): a block
// representation is one saved tensor of the layer that completes it; later
// layers read it in place on its rank, other ranks through the pp cache (a
// copy per rank and microbatch, made when its first reader there runs). The
// gradients of a block are summed in one buffer on its owner (kSharedGrad),
// other ranks' first in their cache gradient, which is sent when its last
// reader there has run and lands in the owner's inbox at the block's layer's
// first backward step. Every buffer here is a planner::CrossBuffer of the
// plan, allocated by the memory program; this file moves the bytes.
#include "executor_impl.h"

namespace memplan::runtime::exec {

using Role = planner::CrossBuffer::Role;

void Executor::SetupShared() {
  cross_ends_.assign(p_.cross.size(), {});
  for (size_t r = 0; r < p_.cross.size(); ++r) {
    cross_ends_[r].resize(static_cast<size_t>(p_.timelines[r].steps));
    for (size_t i = 0; i < p_.cross[r].size(); ++i) {
      const planner::CrossBuffer& c = p_.cross[r][i];
      cross_index_[{static_cast<int32_t>(r), c.owner_rank, c.instance, c.role}] = static_cast<int32_t>(i);
      cross_ends_[r][static_cast<size_t>(c.last)].push_back(static_cast<int32_t>(i));
      if (c.role == Role::kCache) cache_readers_[{c.owner_rank, c.instance}].push_back(static_cast<int32_t>(r));
      if (c.role == Role::kCacheGrad) grad_senders_[{c.owner_rank, c.instance}].push_back(static_cast<int32_t>(r));
    }
  }
}

namespace {

// The owner layer and graph index of shared tensor `t` of `layer`.
std::pair<int64_t, int32_t> Owner(const LayerBuffers& lb, int64_t layer, int32_t t) {
  const int32_t j = lb.share_layer[static_cast<size_t>(t)];
  return j >= 0 ? std::pair<int64_t, int32_t>{j, lb.share_index[static_cast<size_t>(t)]} : std::pair{layer, t};
}

}  // namespace

Buffer Executor::SharedValue(Rank& r, size_t bi, int32_t t) {
  const Block& blk = p_.timelines[static_cast<size_t>(r.index)].blocks[bi];
  auto [layer, tensor] = Owner(LB(blk.layer), blk.layer, t);
  const int32_t owner = static_cast<int32_t>(p_.layout.rank_of_layer[static_cast<size_t>(layer)]);
  const int32_t inst = InstIndex(layer, tensor, blk.microbatch);
  if (owner == r.index) return blk.forward ? acts_->Forward(owner, inst) : acts_->Backward(owner, inst);
  return CrossBuf(r, cross_index_.at({r.index, owner, inst, Role::kCache}));
}

Buffer Executor::SharedGrad(Rank& r, size_t bi, int32_t t) {
  const Block& blk = p_.timelines[static_cast<size_t>(r.index)].blocks[bi];
  auto [layer, tensor] = Owner(LB(blk.layer), blk.layer, t);
  const int32_t owner = static_cast<int32_t>(p_.layout.rank_of_layer[static_cast<size_t>(layer)]);
  const int32_t inst = InstIndex(layer, tensor, blk.microbatch);
  const Role role = owner == r.index ? Role::kSharedGrad : Role::kCacheGrad;
  return CrossBuf(r, cross_index_.at({r.index, owner, inst, role}));
}

Buffer Executor::CrossBuf(Rank& r, int32_t index) {
  bool fresh = false;
  Buffer buf = acts_->Cross(r.index, index, &fresh);
  if (fresh) InitCross(r, index, buf);  // eager: at its first use
  return buf;
}

void Executor::InitCross(Rank& r, int32_t index, Buffer buf) {
  const planner::CrossBuffer& c = p_.cross[static_cast<size_t>(r.index)][static_cast<size_t>(index)];
  if (c.role == Role::kSharedGrad || c.role == Role::kCacheGrad) {
    r.ops->Zero(buf.ptr, buf.bytes);
  } else if (c.role == Role::kCache) {
    // Only the new block travels, once per rank and microbatch.
    std::vector<std::byte> wire = Take(c.owner_rank, r.index, Msg::kBlockCache, c.instance);
    MEMPLAN_CHECK(static_cast<int64_t>(wire.size()) == c.bytes, "a cached block has the wrong size");
    backend_->FromHost(*r.dev, buf.ptr, wire.data(), c.bytes);
    ++r.events["block_cache_copies"];
  }
}

void Executor::BeginCross(Rank& r) {
  if (acts_->eager()) return;  // eager: each at its first use (CrossBuf)
  for (const auto& b : acts_->allocations(r.index)) {
    if (b.cross >= 0) InitCross(r, b.cross, acts_->Cross(r.index, b.cross));
  }
}

void Executor::SendBlockCaches(Rank& r, int32_t inst) {
  auto readers = cache_readers_.find({r.index, inst});
  if (readers == cache_readers_.end()) return;
  Buffer src = acts_->Forward(r.index, inst);
  for (int32_t q : readers->second) {
    std::vector<std::byte> wire(static_cast<size_t>(src.bytes));
    backend_->ToHost(*r.dev, wire.data(), src.ptr, src.bytes);
    Post(r.index, q, Msg::kBlockCache, inst, std::move(wire));
  }
}

void Executor::EndCross(Rank& r) {
  const int64_t step = acts_->step(r.index);
  for (int32_t i : cross_ends_[static_cast<size_t>(r.index)][static_cast<size_t>(step)]) {
    const planner::CrossBuffer& c = p_.cross[static_cast<size_t>(r.index)][static_cast<size_t>(i)];
    if (c.role != Role::kCacheGrad) continue;
    std::vector<std::byte> wire(static_cast<size_t>(c.bytes));
    backend_->ToHost(*r.dev, wire.data(), CrossBuf(r, i).ptr, c.bytes);
    Post(r.index, c.owner_rank, Msg::kBlockGrad, c.instance, std::move(wire));
    ++r.events["block_grad_sends"];
  }
}

void Executor::ReceiveSharedGrads(Rank& r, size_t bi) {
  const Block& blk = p_.timelines[static_cast<size_t>(r.index)].blocks[bi];
  const LayerGraph& g = G(blk.layer);
  const LayerBuffers& lb = LB(blk.layer);
  for (size_t t = 0; t < g.tensors.size(); ++t) {
    if (!lb.shared_out[t]) continue;
    const int32_t inst = InstIndex(blk.layer, static_cast<int32_t>(t), blk.microbatch);
    auto inbox = cross_index_.find({r.index, r.index, inst, Role::kGradInbox});
    if (inbox == cross_index_.end()) continue;  // read on this rank only
    auto senders = grad_senders_.find({r.index, inst});
    MEMPLAN_CHECK(senders != grad_senders_.end(), "a shared block's gradient has no sender");
    Buffer in = CrossBuf(r, inbox->second);
    Buffer sum = SharedGrad(r, bi, static_cast<int32_t>(t));
    const bool bf16 = g.tensors[t].dtype == planner::DType::kBF16;
    // In the senders' rank order, whatever order they ran in.
    for (int32_t q : senders->second) {
      std::vector<std::byte> w = Take(q, r.index, Msg::kBlockGrad, inst);
      MEMPLAN_CHECK(static_cast<int64_t>(w.size()) == in.bytes, "a shared block's gradient has the wrong size");
      backend_->FromHost(*r.dev, in.ptr, w.data(), in.bytes);
      if (!bf16) {
        r.ops->Accumulate(sum.as<float>(), in.as<float>(), in.bytes / 4);
        continue;
      }
      // bf16 (host backend): added in fp32, rounded once, as an op would.
      const int64_t n = in.bytes / 2;
      std::vector<float> a(static_cast<size_t>(n)), b(static_cast<size_t>(n));
      r.ops->WidenBf16(sum.as<uint16_t>(), n, a.data());
      r.ops->WidenBf16(in.as<uint16_t>(), n, b.data());
      r.ops->Accumulate(a.data(), b.data(), n);
      r.ops->RoundToBf16(a.data(), n, sum.as<uint16_t>());
    }
  }
}

}  // namespace memplan::runtime::exec
