#include "memplan/runtime/activation.h"
#include "activation_impl.h"

#include <algorithm>
#include <utility>

#include "memplan/common/check.h"
#include "memplan/common/status.h"

namespace memplan::runtime {

using planner::Interval;
using planner::IntervalPart;
using planner::ProgramBuffer;
using planner::Storage;

ActivationManager::ActivationManager(const planner::PlanningProblem& problem, const planner::Assignment& assignment,
                                     const std::vector<planner::Interval>& intervals, std::vector<RankMemory> ranks,
                                     Backend& backend, MemoryMode mode)
    : p_(problem), a_(assignment), ivs_(intervals), backend_(backend), mode_(mode) {
  log_.resize(ranks.size());
  MEMPLAN_CHECK(ranks.size() == p_.instances.size(), "one RankMemory per pipeline rank");
  std::vector<std::vector<size_t>> mine(ranks.size());
  for (size_t r = 0; r < ranks.size(); ++r) {
    auto rank = std::make_unique<Rank>();
    rank->index = static_cast<int32_t>(r);
    rank->mem = ranks[r];
    rank->instances.resize(p_.instances[r].size());
    ranks_.push_back(std::move(rank));
  }
  for (size_t k = 0; k < ivs_.size(); ++k) {
    const Interval& iv = ivs_[k];
    mine[static_cast<size_t>(iv.rank)].push_back(k);
    if (iv.rank == iv.owner_rank) {
      Inst(iv.owner_rank, iv.instance).parts |= static_cast<uint8_t>(1u << static_cast<int>(iv.part));
    }
  }
  for (auto& r : ranks_) {
    r->walker = std::make_unique<planner::ProgramWalker>(p_, r->index, ivs_, std::move(mine[static_cast<size_t>(r->index)]));
    if (mode_.last_access == nullptr || static_cast<size_t>(r->index) >= mode_.last_access->size()) continue;
    for (const auto& [key, last] : (*mode_.last_access)[static_cast<size_t>(r->index)]) r->frees_at[last].push_back(key);
  }
}

ActivationManager::~ActivationManager() = default;

ActivationManager::Instance& ActivationManager::Inst(int32_t rank, int32_t instance) {
  return ranks_[static_cast<size_t>(rank)]->instances[static_cast<size_t>(instance)];
}
const ActivationManager::Instance& ActivationManager::Inst(int32_t rank, int32_t instance) const {
  return ranks_[static_cast<size_t>(rank)]->instances[static_cast<size_t>(instance)];
}

void ActivationManager::BeginStep(int32_t rank) {
  Rank& r = *ranks_[static_cast<size_t>(rank)];
  MEMPLAN_CHECK(r.walker->Next(), "memory program ran past its last step");
  r.allocations = r.walker->allocations();
  for (const auto& b : r.allocations) Allocate(r, b);
}

void ActivationManager::EndStep(int32_t rank) {
  Rank& r = *ranks_[static_cast<size_t>(rank)];
  for (const auto& b : r.walker->Frees()) Free(r, b);
  if (mode_.eager) EagerEndStep(r);
}

int64_t ActivationManager::step(int32_t rank) const { return ranks_[static_cast<size_t>(rank)]->walker->step(); }

const std::vector<ProgramBuffer>& ActivationManager::allocations(int32_t rank) const {
  return ranks_[static_cast<size_t>(rank)]->allocations;
}

void ActivationManager::Allocate(Rank& r, const ProgramBuffer& b) {
  // Eager: the plan decides only where copies start: a prefetch's
  // destination (kept until its last use, as every eager buffer) and a
  // remote payload's landing buffer on its target (until it goes back).
  // Every other buffer is allocated at its first use (Access).
  auto allocate = [&] {
    auto made = r.mem.device->Allocate(b.bytes);
    if (!made.ok()) ThrowError(made.error().code, made.error().message);
    ++r.events["allocations"];
    return *made;
  };
  Expected<Buffer> buf = Buffer{};
  if (!mode_.eager) {
    buf = allocate();
  } else {
    if (b.interval < 0) return;
    const Interval& iv = ivs_[static_cast<size_t>(b.interval)];
    if (iv.part == IntervalPart::kFetched) {
      buf = Inst(iv.owner_rank, iv.instance).fetched = InstancePart(iv.owner_rank, iv.instance, IntervalPart::kFetched);
    } else if (iv.part == IntervalPart::kLanded) {
      buf = allocate();
      planner::BufferLabel label = planner::InstancePartLabel(p_, iv.owner_rank, iv.instance, iv.part);
      r.allocation_events.push_back({r.walker->step(), b.bytes, label.name, label.part});
    } else {
      return;
    }
  }
  if (b.cross >= 0) {
    r.cross_bufs[b.cross] = *buf;
    return;
  }
  if (b.interval < 0) {
    auto& v = r.block_bufs[b.block];
    const planner::Block& blk = p_.timelines[static_cast<size_t>(r.index)].blocks[static_cast<size_t>(b.block)];
    const planner::LayerBuffers& lb = p_.layer_buffers[static_cast<size_t>(blk.layer)];
    v.resize((blk.forward ? lb.forward : lb.backward).size());
    v[static_cast<size_t>(b.buffer)] = *buf;
    return;
  }
  r.interval_buf[b.interval] = *buf;
  const Interval& iv = ivs_[static_cast<size_t>(b.interval)];
  Instance& s = Inst(iv.owner_rank, iv.instance);
  switch (iv.part) {
    case IntervalPart::kFull: s.full = *buf; break;
    case IntervalPart::kCompact: s.compact = *buf; break;
    case IntervalPart::kMovedOut: s.moved = *buf; break;
    case IntervalPart::kRestored: s.restored = *buf; break;
    case IntervalPart::kExtra: s.extra = *buf; break;
    case IntervalPart::kLanded:
      s.landed = *buf;
      if (s.on_wire) {  // the payload left its source before this buffer existed
        backend_.FromHost(*r.mem.device, s.landed.ptr, s.wire.data(), b.bytes);
        s.on_wire = false;
        s.landed_valid = true;
        std::vector<std::byte>().swap(s.wire);
      }
      break;
    case IntervalPart::kFetched: {
      // The prefetch, one layer ahead of the layer's backward.
      s.fetched = *buf;
      s.fetch_issued = true;
      const planner::Instance& in = p_.instances[static_cast<size_t>(iv.owner_rank)][static_cast<size_t>(iv.instance)];
      Storage st = a_.storage[static_cast<size_t>(iv.owner_rank)][static_cast<size_t>(in.tensor)];
      std::string what = "prefetch " + p_.tensors[static_cast<size_t>(iv.owner_rank)][static_cast<size_t>(in.tensor)].name +
                         "@mb" + std::to_string(in.microbatch);
      // The copy-out that filled the payload runs on another queue (another
      // thread, another stream): the prefetch reads it only once it is done.
      // The plan times it to be; a loaded machine may not (a CI run read a
      // half-written payload under load, 2026-12-05). As device.h says,
      // copies on different queues are ordered by a Wait between them: the
      // compute stream waits for the copy-out, and the prefetch, issued
      // after it, is ordered after the compute stream (the host blocks).
      r.mem.device->Wait(s.out_event);
      if (!planner::IsRemote(st)) {
        s.in_event = r.mem.device->CopyAsync(s.fetched.ptr, s.host.ptr, b.bytes, Queue::kH2D);
        ++r.events["h2d_copies"];
        r.copies.push_back({Queue::kH2D, std::move(what), s.in_event});
      } else if (s.landed_valid && !s.landed.empty()) {
        s.in_event = r.mem.device->CopyAsync(s.fetched.ptr, s.landed.ptr, b.bytes, Queue::kLink);
        ++r.events["link_copies"];
        r.copies.push_back({Queue::kLink, std::move(what), s.in_event});
      } else {
        MEMPLAN_CHECK(s.on_wire, "remote payload lost");
        backend_.FromHost(*r.mem.device, s.fetched.ptr, s.wire.data(), b.bytes);
        s.on_wire = false;
        std::vector<std::byte>().swap(s.wire);
        ++r.events["link_copies"];
      }
      break;
    }
  }
}

void ActivationManager::Free(Rank& r, const ProgramBuffer& b) {
  if (mode_.eager && (b.interval < 0 || ivs_[static_cast<size_t>(b.interval)].part != IntervalPart::kLanded)) return;
  ++r.events["frees"];
  if (b.cross >= 0) {
    auto it = r.cross_bufs.find(b.cross);
    r.mem.device->Free(it->second);
    r.cross_bufs.erase(it);
    return;
  }
  if (b.interval < 0) {
    auto it = r.block_bufs.find(b.block);
    Buffer& buf = it->second[static_cast<size_t>(b.buffer)];
    r.mem.device->Free(buf);
    buf = Buffer{};
    if (std::all_of(it->second.begin(), it->second.end(), [](const Buffer& x) { return x.empty(); })) {
      r.block_bufs.erase(it);
    }
    return;
  }
  auto it = r.interval_buf.find(b.interval);
  Buffer buf = it->second;
  r.interval_buf.erase(it);
  const Interval& iv = ivs_[static_cast<size_t>(b.interval)];
  Instance& s = Inst(iv.owner_rank, iv.instance);
  switch (iv.part) {
    case IntervalPart::kFull: s.full = Buffer{}; break;
    case IntervalPart::kCompact: s.compact = Buffer{}; break;
    case IntervalPart::kMovedOut: s.moved = Buffer{}; break;
    case IntervalPart::kRestored: s.restored = Buffer{}; break;
    case IntervalPart::kExtra: s.extra = Buffer{}; break;
    case IntervalPart::kFetched: s.fetched = Buffer{}; break;
    case IntervalPart::kLanded:
      if (!s.fetch_issued && s.landed_valid) {
        // The owner has not fetched it yet: the payload goes back on the wire
        // once the owner's copy into this buffer is over.
        s.out_event.Wait();
        s.wire.resize(static_cast<size_t>(b.bytes));
        backend_.ToHost(*r.mem.device, s.wire.data(), s.landed.ptr, b.bytes);
        s.on_wire = true;
      }
      s.landed = Buffer{};
      s.landed_valid = false;
      if (mode_.eager) {  // after the owner's fetch out of it, if it ran
        s.in_event.Wait();
        planner::BufferLabel label = planner::InstancePartLabel(p_, iv.owner_rank, iv.instance, iv.part);
        const int64_t touched = Witnessed(r, buf, true, label.name, label.part, "at its free");
        r.allocation_events.push_back({r.walker->step(), -b.bytes, label.name, label.part, touched});
      }
      break;
  }
  r.mem.device->Free(buf);
}

Buffer ActivationManager::BlockBuffer(int32_t rank, int64_t block, planner::BlockBuffer::Role role, int32_t tensor,
                                      int32_t op) {
  const planner::Block& blk = p_.timelines[static_cast<size_t>(rank)].blocks[static_cast<size_t>(block)];
  const planner::LayerBuffers& lb = p_.layer_buffers[static_cast<size_t>(blk.layer)];
  const auto& list = blk.forward ? lb.forward : lb.backward;
  if (mode_.eager) {
    // The size of the tensor (or the op's workspace); when it lives is the
    // executed program's business.
    for (const planner::BlockBuffer& b : list) {
      if (b.role != role || b.tensor != tensor || (op >= 0 && b.op != op)) continue;
      return Access(*ranks_[static_cast<size_t>(rank)],
                    {1, static_cast<int32_t>(block), static_cast<int32_t>(role), tensor, op}, b.bytes);
    }
  }
  for (size_t k = 0; k < list.size(); ++k) {
    const planner::BlockBuffer& b = list[k];
    if (b.role != role || b.tensor != tensor || (op >= 0 && b.op != op)) continue;
    int64_t first = 0, last = 0;
    if (!planner::BlockBufferSteps(blk, lb, b, &first, &last)) continue;
    return BlockBufferAt(rank, block, static_cast<int32_t>(k));
  }
  // The plan has no such buffer: a planner that left out what an op needs.
  const planner::LayerGraph& g = p_.layers[static_cast<size_t>(blk.layer)];
  std::string op_name = "an op";
  if (op >= 0 && static_cast<size_t>(op) < g.ops.size()) {
    const planner::OpSpec& spec = g.ops[g.TopologicalOrder()[static_cast<size_t>(op)]];
    op_name = "op " + spec.name + " (" + spec.kind + ")";
  }
  static constexpr const char* kRoles[] = {"value", "gradient", "workspace", "rebuilt value", "gradient temporary"};
  const auto ri = static_cast<size_t>(role);
  const std::string role_name = ri < std::size(kRoles) ? kRoles[ri] : "buffer";
  const std::string what = tensor >= 0 && static_cast<size_t>(tensor) < g.tensors.size()
                               ? role_name + " of " + g.tensors[static_cast<size_t>(tensor)].name
                               : role_name;
  ThrowError(ErrorCode::kCheckFailed,
             op_name + " in layer " + std::to_string(blk.layer) + (blk.forward ? " forward" : " backward") +
                 ", microbatch " + std::to_string(blk.microbatch) + ", pipeline rank " + std::to_string(rank) +
                 ", needs a " + what + ", and the plan has none: the layer's " +
                 (blk.forward ? "forward" : "backward") + " buffers (planner::LayerBuffers) leave it out");
}

Buffer ActivationManager::BlockBufferAt(int32_t rank, int64_t block, int32_t index) const {
  const Rank& r = *ranks_[static_cast<size_t>(rank)];
  auto it = r.block_bufs.find(block);
  MEMPLAN_CHECK(it != r.block_bufs.end() && static_cast<size_t>(index) < it->second.size() &&
                    !it->second[static_cast<size_t>(index)].empty(),
                "block buffer used outside its steps");
  return it->second[static_cast<size_t>(index)];
}

Buffer ActivationManager::Cross(int32_t rank, int32_t index, bool* fresh) {
  Rank& r = *ranks_[static_cast<size_t>(rank)];
  if (mode_.eager) {
    const EagerKey key{2, index, 0, 0, 0};
    if (fresh) *fresh = !r.eager.contains(key);
    return Access(r, key, p_.cross[static_cast<size_t>(rank)][static_cast<size_t>(index)].bytes);
  }
  if (fresh) *fresh = false;
  auto it = r.cross_bufs.find(index);
  MEMPLAN_CHECK(it != r.cross_bufs.end(), "cross buffer used outside its steps");
  return it->second;
}

Buffer ActivationManager::Forward(int32_t rank, int32_t instance) {
  const Instance& s = Inst(rank, instance);
  if (mode_.eager) {
    const planner::Instance& in = p_.instances[static_cast<size_t>(rank)][static_cast<size_t>(instance)];
    const bool fp8 = planner::IsFp8(a_.storage[static_cast<size_t>(rank)][static_cast<size_t>(in.tensor)]);
    return InstancePart(rank, instance, s.Has(IntervalPart::kMovedOut) && !fp8 ? IntervalPart::kMovedOut : IntervalPart::kFull);
  }
  Buffer b = s.full.empty() ? s.moved : s.full;
  MEMPLAN_CHECK(!b.empty(), "instance read outside its forward interval");
  return b;
}

Buffer ActivationManager::Backward(int32_t rank, int32_t instance) {
  const Instance& s = Inst(rank, instance);
  // Restored (recomputed, dequantized), else the prefetched full payload
  // (an FP8 payload is never read directly), else the kept tensor.
  const planner::Instance& in = p_.instances[static_cast<size_t>(rank)][static_cast<size_t>(instance)];
  bool fp8 = planner::IsFp8(a_.storage[static_cast<size_t>(rank)][static_cast<size_t>(in.tensor)]);
  if (mode_.eager) {
    if (s.Has(IntervalPart::kRestored)) return InstancePart(rank, instance, IntervalPart::kRestored);
    if (s.Has(IntervalPart::kFetched) && !fp8) {
      MEMPLAN_CHECK(!s.fetched.empty(), "a prefetched instance read before its prefetch");
      return InstancePart(rank, instance, IntervalPart::kFetched);
    }
    return Forward(rank, instance);
  }
  Buffer b = s.full;
  if (!s.restored.empty()) {
    b = s.restored;
  } else if (!s.fetched.empty() && !fp8) {
    b = s.fetched;
  }
  MEMPLAN_CHECK(!b.empty(), "instance read outside its backward interval");
  return b;
}

Buffer ActivationManager::Scratch(int32_t rank, int32_t instance) {
  if (mode_.eager) return InstancePart(rank, instance, IntervalPart::kExtra);
  return Inst(rank, instance).extra;
}

void ActivationManager::Save(int32_t rank, int32_t i) {
  Rank& r = *ranks_[static_cast<size_t>(rank)];
  Instance& s = r.instances[static_cast<size_t>(i)];
  const planner::Instance& in = p_.instances[static_cast<size_t>(rank)][static_cast<size_t>(i)];
  const planner::SavedTensor& st = p_.tensors[static_cast<size_t>(rank)][static_cast<size_t>(in.tensor)];
  Storage storage = a_.storage[static_cast<size_t>(rank)][static_cast<size_t>(in.tensor)];
  const planner::TensorSpec& spec = p_.layers[static_cast<size_t>(st.layer)].tensors[static_cast<size_t>(st.graph_index)];
  if (mode_.eager) {  // the buffers Save reads and writes, at their first use
    if (planner::IsFp8(storage)) {
      s.full = InstancePart(rank, i, IntervalPart::kFull);
      (s.Has(IntervalPart::kCompact) ? s.compact : s.moved) =
          InstancePart(rank, i, s.Has(IntervalPart::kCompact) ? IntervalPart::kCompact : IntervalPart::kMovedOut);
    } else if (s.Has(IntervalPart::kMovedOut)) {
      s.moved = InstancePart(rank, i, IntervalPart::kMovedOut);
    }
  }
  if (planner::IsFp8(storage)) {
    // Values, then the fp32 scales (planner::Fp8Bytes: no padding); a bf16
    // tensor is quantized from its bf16 values.
    Buffer dst = s.Has(IntervalPart::kCompact) ? s.compact : s.moved;
    int64_t cols = spec.shape.empty() ? 1 : spec.shape.back();
    int64_t rows = cols == 0 ? 0 : (spec.bytes / planner::DTypeBytes(spec.dtype)) / cols;
    auto* values = reinterpret_cast<uint8_t*>(dst.ptr);
    auto* scales = reinterpret_cast<float*>(dst.ptr + rows * cols);
    if (spec.dtype == planner::DType::kBF16) {
      backend_.QuantizeBf16(*r.mem.device, s.full.as<uint16_t>(), rows, cols, values, scales);
    } else {
      backend_.Quantize(*r.mem.device, s.full.as<float>(), rows, cols, values, scales);
    }
    ++r.events["quantizes"];
  }
  if (!s.Has(IntervalPart::kMovedOut)) return;  // kept, or an offload too late to leave
  std::string what = "offload " + st.name + "@mb" + std::to_string(in.microbatch);
  int64_t bytes = s.moved.bytes;
  if (!planner::IsRemote(storage)) {
    auto h = r.mem.host->Allocate(bytes);
    if (!h.ok()) ThrowError(h.error().code, h.error().message);
    s.host = *h;
    s.out_event = r.mem.device->CopyAsync(s.host.ptr, s.moved.ptr, bytes, Queue::kD2H);
    if (mode_.eager) Fence(r, {0, rank, i, static_cast<int32_t>(IntervalPart::kMovedOut), 0}, s.out_event);
    ++r.events["d2h_copies"];
    r.copies.push_back({Queue::kD2H, std::move(what), s.out_event});
    return;
  }
  ++r.events["link_copies"];
  if (!s.landed.empty()) {
    s.out_event = r.mem.device->CopyAsync(s.landed.ptr, s.moved.ptr, bytes, Queue::kLink);
    if (mode_.eager) Fence(r, {0, rank, i, static_cast<int32_t>(IntervalPart::kMovedOut), 0}, s.out_event);
    s.landed_valid = true;
    r.copies.push_back({Queue::kLink, std::move(what), s.out_event});
  } else {
    s.wire.resize(static_cast<size_t>(bytes));
    backend_.ToHost(*r.mem.device, s.wire.data(), s.moved.ptr, bytes);
    s.on_wire = true;
  }
}

void ActivationManager::Restore(int32_t rank, int32_t i) {
  Rank& r = *ranks_[static_cast<size_t>(rank)];
  Instance& s = r.instances[static_cast<size_t>(i)];
  const planner::Instance& in = p_.instances[static_cast<size_t>(rank)][static_cast<size_t>(i)];
  const planner::SavedTensor& st = p_.tensors[static_cast<size_t>(rank)][static_cast<size_t>(in.tensor)];
  Storage storage = a_.storage[static_cast<size_t>(rank)][static_cast<size_t>(in.tensor)];
  if (s.Has(IntervalPart::kFetched)) {
    r.mem.device->Wait(s.in_event);
    if (!s.host.empty()) {
      r.mem.host->Free(s.host);  // waits for the h2d copy
      s.host = Buffer{};
    }
  }
  if (planner::IsFp8(storage) && s.Has(IntervalPart::kRestored)) {
    if (mode_.eager) {
      s.restored = InstancePart(rank, i, IntervalPart::kRestored);
      if (s.Has(IntervalPart::kFetched)) {
        s.fetched = InstancePart(rank, i, IntervalPart::kFetched);
      } else {
        s.compact = InstancePart(rank, i, IntervalPart::kCompact);
      }
    }
    Buffer src = s.Has(IntervalPart::kFetched) ? s.fetched : s.compact;
    const planner::TensorSpec& spec = p_.layers[static_cast<size_t>(st.layer)].tensors[static_cast<size_t>(st.graph_index)];
    int64_t cols = spec.shape.empty() ? 1 : spec.shape.back();
    int64_t rows = cols == 0 ? 0 : (spec.bytes / planner::DTypeBytes(spec.dtype)) / cols;
    auto* values = reinterpret_cast<const uint8_t*>(src.ptr);
    auto* scales = reinterpret_cast<const float*>(src.ptr + rows * cols);
    if (spec.dtype == planner::DType::kBF16) {
      backend_.DequantizeBf16(*r.mem.device, values, scales, rows, cols, s.restored.as<uint16_t>());
    } else {
      backend_.Dequantize(*r.mem.device, values, scales, rows, cols, s.restored.as<float>());
    }
    ++r.events["dequantizes"];
  }
}

std::vector<std::byte> ActivationManager::TakeWire(int32_t rank, int32_t instance) {
  Instance& s = Inst(rank, instance);
  MEMPLAN_CHECK(s.on_wire, "no remote payload on the wire");
  s.on_wire = false;
  return std::exchange(s.wire, {});
}

void ActivationManager::PutWire(int32_t rank, int32_t instance, std::vector<std::byte> bytes) {
  Instance& s = Inst(rank, instance);
  MEMPLAN_CHECK(!s.on_wire, "a remote payload is already on the wire");
  s.wire = std::move(bytes);
  s.on_wire = true;
}

Buffer ActivationManager::Landed(int32_t owner, int32_t instance) const {
  const Instance& s = Inst(owner, instance);
  MEMPLAN_CHECK(!s.landed.empty(), "remote buffer used outside its steps");
  return s.landed;
}

std::vector<CopyRecord> ActivationManager::TakeCopies(int32_t rank) {
  return std::exchange(ranks_[static_cast<size_t>(rank)]->copies, {});
}

const std::vector<AllocationEvent>& ActivationManager::allocation_events(int32_t rank) const {
  return ranks_[static_cast<size_t>(rank)]->allocation_events;
}

const std::map<std::string, int64_t>& ActivationManager::events(int32_t rank) const {
  return ranks_[static_cast<size_t>(rank)]->events;
}

}  // namespace memplan::runtime
