#include "storage_backends.h"

#include <cstring>
#include <utility>

#include "memplan/common/check.h"

namespace memplan::runtime::internal {

Buffer Context::Allocate(int64_t bytes, const std::string& what) {
  Expected<Buffer> b = device.Allocate(bytes);
  if (!b) ThrowError(b.error().code, what + ": " + b.error().message);
  return *b;
}

void Context::Free(Buffer& buffer) {
  if (buffer.empty()) return;
  if (defer_frees) {
    pending_frees.push_back(buffer);
  } else {
    device.Free(buffer);
  }
  buffer = Buffer{};
}

namespace {

// The payload stays on the device.
class KeepBackend final : public Backend {
 public:
  void Store(Context&, Slot& slot, Buffer payload) override { slot.device = payload; }
  Buffer Restore(Context&, Slot& slot) override { return std::exchange(slot.device, Buffer{}); }
  void Discard(Context& ctx, Slot& slot) override { ctx.Free(slot.device); }
};

// Nothing is stored; Restore re-runs the producing function.
class RecomputeBackend final : public Backend {
 public:
  void Store(Context& ctx, Slot&, Buffer payload) override { ctx.Free(payload); }
  Buffer Restore(Context& ctx, Slot& slot) override {
    MEMPLAN_CHECK(slot.recompute != nullptr, "recompute without a producer function");
    slot.staged = ctx.Allocate(slot.bytes, "recomputing " + slot.Label());
    slot.recompute(slot.staged.ptr);
    return std::exchange(slot.staged, Buffer{});
  }
  void Discard(Context& ctx, Slot& slot) override { ctx.Free(slot.staged); }
};

// The payload moves to the host arena (d2h, back by h2d) or to a remote
// device (link queue both ways). The device source stays until
// FinishStore; the off-device copy is freed once the prefetch has landed.
class OffloadBackend final : public Backend {
 public:
  explicit OffloadBackend(Device* remote) : remote_(remote) {}

  void Store(Context& ctx, Slot& slot, Buffer payload) override {
    slot.device = payload;
    slot.away = AllocateAway(ctx, slot, payload.bytes);
    slot.out = ctx.device.CopyAsync(slot.away.ptr, slot.device.ptr, payload.bytes, remote_ ? Queue::kLink : Queue::kD2H);
  }

  bool CopyOutPending(const Slot& slot) const override {
    return !slot.copied_out && !slot.resident && !slot.device.empty() && !slot.away.empty();
  }

  void FinishStore(Context& ctx, Slot& slot) override {
    if (!CopyOutPending(slot)) return;
    ctx.device.Wait(slot.out);
    ctx.Free(slot.device);
    slot.copied_out = true;
  }

  void Prefetch(Context& ctx, Slot& slot) override {
    if (slot.prefetched || slot.resident || slot.away.empty()) return;
    if (!slot.copied_out) {
      // The copy-out is not over: the planner keeps such an instance
      // resident, and so do we (its source becomes the loaded payload).
      slot.resident = true;
      return;
    }
    slot.device = ctx.Allocate(slot.away.bytes, "prefetching " + slot.Label());
    slot.in = ctx.device.CopyAsync(slot.device.ptr, slot.away.ptr, slot.away.bytes, remote_ ? Queue::kLink : Queue::kH2D);
    slot.prefetched = true;
  }

  Buffer Restore(Context& ctx, Slot& slot) override {
    Prefetch(ctx, slot);
    if (slot.prefetched) ctx.device.Wait(slot.in);
    FreeAway(ctx, slot);  // waits for the copy-out of a resident instance
    return std::exchange(slot.device, Buffer{});
  }

  void Discard(Context& ctx, Slot& slot) override {
    ctx.Free(slot.device);  // a deferred free still waits for its copy when it happens
    FreeAway(ctx, slot);
  }

 private:
  Buffer AllocateAway(Context& ctx, const Slot& slot, int64_t bytes) {
    Expected<Buffer> b = remote_ ? remote_->Allocate(bytes) : ctx.host->Allocate(bytes);
    if (!b) ThrowError(b.error().code, "offloading " + slot.Label() + ": " + b.error().message);
    return *b;
  }
  void FreeAway(Context& ctx, Slot& slot) {
    if (slot.away.empty()) return;
    if (remote_) {
      remote_->Free(slot.away);
    } else {
      ctx.host->Free(slot.away);
    }
    slot.away = Buffer{};
  }

  Device* remote_;  // nullptr: the host arena
};

// FP8 E4M3 1x128 blockwise. The payload is one buffer of Fp8Bytes(shape):
// the values, then the fp32 scales right after them. When the values fill a
// multiple of 16 bytes this is exactly kernels::PackFp8's layout; otherwise
// PackFp8 would pad, and the planner's footprint has no padding, so the
// scales follow unpadded (and unaligned scales go through a copy).
class Fp8Backend final : public Backend {
 public:
  explicit Fp8Backend(std::unique_ptr<Backend> inner) : inner_(std::move(inner)) {}

  void Store(Context& ctx, Slot& slot, Buffer payload) override {
    slot.staged = payload;
    Buffer fp8 = ctx.Allocate(Fp8Bytes(slot.shape), "quantizing " + slot.Label());
    kernels::Fp8BlockLayout layout = Layout(slot);
    std::byte* scale_ptr = fp8.ptr + layout.ValueBytes();
    auto values = reinterpret_cast<uint8_t*>(fp8.ptr);
    const float* x = slot.staged.as<const float>();
    if (Aligned(scale_ptr)) {
      kernels::QuantizeFp8BlockwiseRef(x, layout, ctx.scale_mode, values, reinterpret_cast<float*>(scale_ptr));
    } else {
      std::vector<float> scales(static_cast<size_t>(layout.rows * layout.BlocksPerRow()));
      kernels::QuantizeFp8BlockwiseRef(x, layout, ctx.scale_mode, values, scales.data());
      std::memcpy(scale_ptr, scales.data(), static_cast<size_t>(layout.ScaleBytes()));
    }
    ctx.Free(slot.staged);  // the full tensor lives only at its producing step
    inner_->Store(ctx, slot, fp8);
  }

  void FinishStore(Context& ctx, Slot& slot) override { inner_->FinishStore(ctx, slot); }
  bool CopyOutPending(const Slot& slot) const override { return inner_->CopyOutPending(slot); }
  void Prefetch(Context& ctx, Slot& slot) override { inner_->Prefetch(ctx, slot); }

  Buffer Restore(Context& ctx, Slot& slot) override {
    // A retry after a failed allocation finds the FP8 payload staged.
    if (slot.staged.empty()) slot.staged = inner_->Restore(ctx, slot);
    Buffer full = ctx.Allocate(slot.bytes, "dequantizing " + slot.Label());
    kernels::Fp8BlockLayout layout = Layout(slot);
    const std::byte* scale_ptr = slot.staged.ptr + layout.ValueBytes();
    auto values = reinterpret_cast<const uint8_t*>(slot.staged.ptr);
    if (Aligned(scale_ptr)) {
      kernels::DequantizeFp8BlockwiseRef(values, reinterpret_cast<const float*>(scale_ptr), layout, full.as<float>());
    } else {
      std::vector<float> scales(static_cast<size_t>(layout.rows * layout.BlocksPerRow()));
      std::memcpy(scales.data(), scale_ptr, static_cast<size_t>(layout.ScaleBytes()));
      kernels::DequantizeFp8BlockwiseRef(values, scales.data(), layout, full.as<float>());
    }
    ctx.Free(slot.staged);
    return full;
  }

  void Discard(Context& ctx, Slot& slot) override {
    ctx.Free(slot.staged);
    inner_->Discard(ctx, slot);
  }

 private:
  static kernels::Fp8BlockLayout Layout(const Slot& slot) {
    kernels::Fp8BlockLayout l;
    l.cols = slot.shape.empty() ? 1 : slot.shape.back();
    l.rows = l.cols == 0 ? 0 : NumElements(slot.shape) / l.cols;
    return l;
  }
  static bool Aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % alignof(float) == 0; }

  std::unique_ptr<Backend> inner_;
};

}  // namespace

std::unique_ptr<Backend> MakeBackend(const StorageSpec& spec) {
  std::unique_ptr<Backend> placement;
  if (spec.recompute()) return std::make_unique<RecomputeBackend>();
  if (spec.offload_host()) {
    placement = std::make_unique<OffloadBackend>(nullptr);
  } else if (spec.offload_remote()) {
    placement = std::make_unique<OffloadBackend>(spec.remote);
  } else {
    placement = std::make_unique<KeepBackend>();
  }
  if (spec.fp8()) return std::make_unique<Fp8Backend>(std::move(placement));
  return placement;
}

}  // namespace memplan::runtime::internal
