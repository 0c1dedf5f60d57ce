// Eager execution (docs/runtime.md, "Eager execution"): the activation
// manager's buffers by identity (EagerKey), each allocated from the
// device's own allocator at its first use and freed at the end of the step
// of its last use, once the copies that read or write it are done. The
// last use comes from a record pass of the same step (nothing freed, every
// access logged), never from the planner's intervals: the plan supplies
// decisions (storage, the schedule's order, where copies start) only.
#include "memplan/common/check.h"
#include "memplan/common/status.h"
#include "memplan/runtime/activation.h"
#include "activation_impl.h"

#include <algorithm>
#include <optional>
#include <utility>

namespace memplan::runtime {

using planner::IntervalPart;

Buffer ActivationManager::InstancePart(int32_t rank, int32_t instance, IntervalPart part) {
  const planner::Instance& in = p_.instances[static_cast<size_t>(rank)][static_cast<size_t>(instance)];
  const planner::SavedTensor& st = p_.tensors[static_cast<size_t>(rank)][static_cast<size_t>(in.tensor)];
  const bool fp8 = planner::IsFp8(a_.storage[static_cast<size_t>(rank)][static_cast<size_t>(in.tensor)]);
  int64_t bytes = st.bytes;
  switch (part) {
    case IntervalPart::kFull:
    case IntervalPart::kRestored: break;
    case IntervalPart::kCompact: bytes = st.fp8_bytes; break;
    case IntervalPart::kMovedOut:
    case IntervalPart::kFetched:
    case IntervalPart::kLanded: bytes = fp8 ? st.fp8_bytes : st.bytes; break;
    case IntervalPart::kExtra: bytes = st.recompute_extra_bytes; break;
  }
  return Access(*ranks_[static_cast<size_t>(rank)], {0, rank, instance, static_cast<int32_t>(part), 0}, bytes);
}

std::pair<std::string, std::string> ActivationManager::EagerName(const Rank& r, const EagerKey& k) const {
  planner::BufferLabel l;
  if (k.kind == 0) {
    l = planner::InstancePartLabel(p_, k.a, k.b, static_cast<IntervalPart>(k.c));
  } else if (k.kind == 1) {
    l = planner::BlockBufferLabel(p_, r.index, k.a, static_cast<planner::BlockBuffer::Role>(k.b), k.c, k.d);
  } else {
    l = planner::CrossBufferLabel(p_, r.index, k.a);
  }
  return {std::move(l.name), std::move(l.part)};
}

Buffer ActivationManager::Access(Rank& r, const EagerKey& key, int64_t bytes) {
  const int64_t step = r.walker->step();
  auto& logged = log_[static_cast<size_t>(r.index)];
  if (mode_.last_access == nullptr) {
    logged[key] = step;  // the record pass: this is the last use so far
  }
  r.op_keys.push_back(key);
  auto it = r.eager.find(key);
  if (it != r.eager.end()) return it->second.buf;
  if (mode_.last_access != nullptr) {
    const auto& last = (*mode_.last_access)[static_cast<size_t>(r.index)];
    auto l = last.find(key);
    MEMPLAN_CHECK(l != last.end() && l->second >= step,
                  ("eager execution: " + EagerName(r, key).first + " used after the record pass's last use").c_str());
  }
  Expected<Buffer> buf = r.mem.device->Allocate(bytes);
  if (!buf.ok()) ThrowError(buf.error().code, buf.error().message);
  ++r.events["allocations"];
  if (bytes > 0) {  // an empty buffer takes no memory (the plan has none either)
    auto [name, part] = EagerName(r, key);
    r.allocation_events.push_back({step, bytes, std::move(name), std::move(part)});
  }
  r.eager[key].buf = *buf;
  return *buf;
}

void ActivationManager::Fence(Rank& r, const EagerKey& key, const Event& e) {
  auto it = r.eager.find(key);
  if (it != r.eager.end()) it->second.fences.push_back(e);
}

void ActivationManager::EagerFree(Rank& r, const EagerKey& key) {
  auto it = r.eager.find(key);
  if (it == r.eager.end()) return;
  for (const Event& e : it->second.fences) e.Wait();
  if (it->second.buf.bytes > 0) {
    auto [name, part] = EagerName(r, key);
    const int64_t touched = Witnessed(r, it->second.buf, true, name, part, "at its free");
    r.allocation_events.push_back({r.walker->step(), -it->second.buf.bytes, std::move(name), std::move(part), touched});
  }
  r.mem.device->Free(it->second.buf);
  ++r.events["frees"];
  r.eager.erase(it);
}

void ActivationManager::EagerEndStep(Rank& r) {
  auto done = [&](const EagerKey& key) {
    auto it = r.eager.find(key);
    if (it == r.eager.end()) return true;
    for (const Event& e : it->second.fences) {
      if (!e.done()) return false;
    }
    return true;
  };
  // A copy's completion is measured, not predicted: a buffer a copy still
  // reads waits for it, and is freed at the end of the first step after.
  std::vector<EagerKey> waiting;
  for (const EagerKey& key : r.deferred) {
    if (done(key)) {
      EagerFree(r, key);
    } else {
      waiting.push_back(key);
    }
  }
  r.deferred = std::move(waiting);
  auto it = r.frees_at.find(r.walker->step());
  if (it == r.frees_at.end()) return;
  for (const EagerKey& key : it->second) {
    if (done(key)) {
      EagerFree(r, key);
    } else {
      r.deferred.push_back(key);
    }
  }
}

void ActivationManager::FinishEager() {
  if (!mode_.eager) return;
  for (auto& r : ranks_) {
    while (!r->eager.empty()) EagerFree(*r, r->eager.begin()->first);
    r->deferred.clear();
  }
}

}  // namespace memplan::runtime

namespace memplan::runtime {

int64_t ActivationManager::Witnessed(Rank& r, const Buffer& buf, bool scan, const std::string& name,
                                     const std::string& part, const std::string& when) {
  std::optional<BufferWitness> w = r.mem.device->Witness(buf, scan);
  if (!w) return -1;
  if (w->overrun_bytes > 0 || w->underrun_bytes > 0) {
    ThrowError(ErrorCode::kCheckFailed,
               "eager witness: " + when + ", " + name + " (" + part + ", " + std::to_string(buf.bytes) +
                   " bytes planned) was written " +
                   (w->overrun_bytes > 0 ? std::to_string(w->overrun_bytes) + " bytes past its end"
                                         : std::to_string(w->underrun_bytes) + " bytes before its start") +
                   ": the plan gives it fewer bytes than the kernel writes");
  }
  return w->touched_bytes;
}

void ActivationManager::AfterOp(int32_t rank, const std::string& what) {
  Rank& r = *ranks_[static_cast<size_t>(rank)];
  std::vector<EagerKey> keys = std::exchange(r.op_keys, {});
  std::sort(keys.begin(), keys.end());
  keys.erase(std::unique(keys.begin(), keys.end()), keys.end());
  for (const EagerKey& key : keys) {
    auto it = r.eager.find(key);
    if (it == r.eager.end() || it->second.buf.bytes == 0) continue;
    auto [name, part] = EagerName(r, key);
    Witnessed(r, it->second.buf, false, name, part, what);
  }
}

}  // namespace memplan::runtime
