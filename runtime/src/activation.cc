#include "memplan/runtime/activation.h"

#include <cstring>
#include <utility>

#include "memplan/common/check.h"
#include "memplan/common/units.h"
#include "storage_backends.h"

namespace memplan::runtime {

using internal::Backend;
using internal::Slot;

struct ActivationManager::Impl {
  Impl(Device& device, HostArena* host, Bindings b, Options o)
      : bindings(std::move(b)), options(std::move(o)), ctx{device, host, options.fp8_scale_mode, options.defer_frees, {}} {}

  Bindings bindings;
  Options options;
  internal::Context ctx;
  // One chain per binding (and one for the default), built at Create.
  std::map<std::string, std::unique_ptr<Backend>> chains;
  std::unique_ptr<Backend> default_chain;
  // Instances by (name, microbatch): ordered, so sweeps are deterministic.
  std::map<std::pair<std::string, int32_t>, Slot> slots;

  const StorageSpec& Spec(const std::string& name) const {
    auto it = bindings.find(name);
    return it == bindings.end() ? options.default_spec : it->second;
  }
  Backend& Chain(const std::string& name) {
    auto it = chains.find(name);
    return it == chains.end() ? *default_chain : *it->second;
  }
  Slot& Find(const std::string& name, int32_t mb) {
    auto it = slots.find({name, mb});
    if (it == slots.end()) {
      ThrowError(ErrorCode::kRuntime, name + "@mb" + std::to_string(mb) + " was not saved (or was released)");
    }
    return it->second;
  }
  void Drop(const std::string& name, int32_t mb) {
    auto it = slots.find({name, mb});
    if (it == slots.end()) return;
    Slot& slot = it->second;
    ctx.Free(slot.loaded);
    ctx.Free(slot.staged);
    Chain(name).Discard(ctx, slot);
    slots.erase(it);
  }

  // Stores a full tensor already on the device (owned by the manager from
  // the first line on).
  void Store(const std::string& name, int32_t mb, Buffer full, std::vector<int64_t> shape, int64_t bytes,
             bool is_float, std::function<void(std::byte*)> recompute) {
    // The entry points have checked that the instance is new.
    Slot& slot = slots[{name, mb}];
    slot.name = name;
    slot.microbatch = mb;
    slot.staged = full;  // owned by the slot until a backend takes it
    slot.shape = std::move(shape);
    slot.bytes = bytes;
    slot.is_float = is_float;
    slot.recompute = std::move(recompute);
    const StorageSpec& spec = Spec(name);
    if (spec.fp8() && !is_float) {
      ThrowError(ErrorCode::kBadInput, slot.Label() + " is bound to " + DescribeStorageSpec(spec) +
                                           " but holds raw bytes: FP8 applies to floating-point tensors only");
    }
    if (spec.recompute() && !slot.recompute) {
      ThrowError(ErrorCode::kBadInput, slot.Label() + " is bound to recompute but was saved without a producer function");
    }
    Chain(name).Store(ctx, slot, std::exchange(slot.staged, Buffer{}));
  }

  // Runs `fn`; on an error, forgets the instance (freeing all it holds)
  // when `drop_on_error`.
  template <class Fn>
  auto Guard(const std::string& name, int32_t mb, bool drop_on_error, Fn&& fn) -> Expected<decltype(fn())> {
    try {
      return fn();
    } catch (const ErrorException& e) {
      if (drop_on_error) Drop(name, mb);
      return e.error();
    }
  }

  Buffer LoadBuffer(const std::string& name, int32_t mb) {
    Slot& slot = Find(name, mb);
    if (slot.loaded.empty() && slot.bytes > 0) slot.loaded = Chain(name).Restore(ctx, slot);
    return slot.loaded;
  }
};

Expected<std::unique_ptr<ActivationManager>> ActivationManager::Create(Device& device, HostArena* host,
                                                                       Bindings bindings, Options options) {
  auto impl = std::make_unique<Impl>(device, host, std::move(bindings), std::move(options));
  auto check = [&](const std::string& what, const StorageSpec& spec) -> std::optional<Error> {
    if (auto e = ValidateStorageSpec(spec)) return Error{e->code, what + ": " + e->message};
    if (spec.offload_remote() && spec.remote == &device) {
      return Error{ErrorCode::kBadInput, what + ": offload_remote targets the manager's own device"};
    }
    if (spec.offload_host() && host == nullptr) {
      return Error{ErrorCode::kBadInput, what + ": offload_host needs a host arena"};
    }
    return std::nullopt;
  };
  if (auto e = check("default storage", impl->options.default_spec)) return *e;
  impl->default_chain = internal::MakeBackend(impl->options.default_spec);
  for (const auto& [name, spec] : impl->bindings) {
    if (auto e = check("binding of " + name, spec)) return *e;
    impl->chains.emplace(name, internal::MakeBackend(spec));
  }
  return std::unique_ptr<ActivationManager>(new ActivationManager(std::move(impl)));
}

ActivationManager::ActivationManager(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

ActivationManager::~ActivationManager() {
  while (!impl_->slots.empty()) {
    auto key = impl_->slots.begin()->first;
    impl_->Drop(key.first, key.second);
  }
  impl_->ctx.defer_frees = false;
  EndStep();
}

namespace {
Status CheckShape(const std::string& name, const std::vector<int64_t>& shape) {
  for (int64_t d : shape) {
    if (d < 0) return Error{ErrorCode::kBadInput, name + ": negative dimension in its shape"};
  }
  return OkStatus();
}
}  // namespace

Status ActivationManager::Save(const std::string& name, int32_t microbatch, const float* data,
                               const std::vector<int64_t>& shape, RecomputeFn recompute) {
  if (auto s = CheckShape(name, shape); !s) return s;
  Impl& m = *impl_;
  // A name already saved must not be dropped by the guard below.
  if (m.slots.count({name, microbatch})) {
    return Error{ErrorCode::kRuntime, name + "@mb" + std::to_string(microbatch) + " is already saved"};
  }
  return m.Guard(name, microbatch, true, [&] {
    int64_t bytes = CheckedMul(NumElements(shape), int64_t{sizeof(float)}, "tensor bytes");
    if (data == nullptr && bytes > 0) ThrowError(ErrorCode::kBadInput, name + ": saved from a null pointer");
    Buffer full = m.ctx.Allocate(bytes, "saving " + name + "@mb" + std::to_string(microbatch));
    if (bytes > 0) std::memcpy(full.ptr, data, static_cast<size_t>(bytes));
    std::function<void(std::byte*)> raw;
    if (recompute) raw = [fn = std::move(recompute)](std::byte* out) { fn(reinterpret_cast<float*>(out)); };
    m.Store(name, microbatch, full, shape, bytes, true, std::move(raw));
    return std::monostate{};
  });
}

Status ActivationManager::SaveBuffer(const std::string& name, int32_t microbatch, Buffer full,
                                     const std::vector<int64_t>& shape, RecomputeFn recompute) {
  Impl& m = *impl_;
  if (auto s = CheckShape(name, shape); !s) {
    m.ctx.Free(full);
    return s;
  }
  if (m.slots.count({name, microbatch})) {
    m.ctx.Free(full);
    return Error{ErrorCode::kRuntime, name + "@mb" + std::to_string(microbatch) + " is already saved"};
  }
  return m.Guard(name, microbatch, true, [&] {
    int64_t bytes = 0;
    try {
      bytes = CheckedMul(NumElements(shape), int64_t{sizeof(float)}, "tensor bytes");
    } catch (const ErrorException&) {
      m.ctx.Free(full);
      throw;
    }
    if (bytes != full.bytes) {
      m.ctx.Free(full);
      ThrowError(ErrorCode::kBadInput, name + ": buffer of " + std::to_string(full.bytes) + " B saved with a shape of " +
                                           std::to_string(bytes) + " B");
    }
    std::function<void(std::byte*)> raw;
    if (recompute) raw = [fn = std::move(recompute)](std::byte* out) { fn(reinterpret_cast<float*>(out)); };
    m.Store(name, microbatch, full, shape, bytes, true, std::move(raw));
    return std::monostate{};
  });
}

Status ActivationManager::SaveRaw(const std::string& name, int32_t microbatch, const void* data, int64_t bytes,
                                  RawRecomputeFn recompute) {
  if (bytes < 0) return Error{ErrorCode::kBadInput, name + ": negative byte count"};
  if (data == nullptr && bytes > 0) return Error{ErrorCode::kBadInput, name + ": saved from a null pointer"};
  Impl& m = *impl_;
  if (m.slots.count({name, microbatch})) {
    return Error{ErrorCode::kRuntime, name + "@mb" + std::to_string(microbatch) + " is already saved"};
  }
  return m.Guard(name, microbatch, true, [&] {
    Buffer full = m.ctx.Allocate(bytes, "saving " + name + "@mb" + std::to_string(microbatch));
    if (bytes > 0) std::memcpy(full.ptr, data, static_cast<size_t>(bytes));
    m.Store(name, microbatch, full, {bytes}, bytes, false, std::move(recompute));
    return std::monostate{};
  });
}

Status ActivationManager::FinishCopyOut(const std::string& name, int32_t microbatch) {
  Impl& m = *impl_;
  return m.Guard(name, microbatch, false, [&] {
    Slot& slot = m.Find(name, microbatch);
    m.Chain(name).FinishStore(m.ctx, slot);
    return std::monostate{};
  });
}

void ActivationManager::FinishCopyOuts() {
  Impl& m = *impl_;
  for (auto& [key, slot] : m.slots) m.Chain(key.first).FinishStore(m.ctx, slot);
}

Status ActivationManager::Prefetch(const std::string& name, int32_t microbatch) {
  Impl& m = *impl_;
  return m.Guard(name, microbatch, false, [&] {
    Slot& slot = m.Find(name, microbatch);
    if (slot.loaded.empty()) m.Chain(name).Prefetch(m.ctx, slot);
    return std::monostate{};
  });
}

Expected<const float*> ActivationManager::Load(const std::string& name, int32_t microbatch) {
  Impl& m = *impl_;
  return m.Guard(name, microbatch, false, [&]() -> const float* {
    const Slot& slot = m.Find(name, microbatch);
    if (!slot.is_float) ThrowError(ErrorCode::kBadInput, slot.Label() + " holds raw bytes: use LoadRaw");
    return m.LoadBuffer(name, microbatch).as<const float>();
  });
}

Expected<const std::byte*> ActivationManager::LoadRaw(const std::string& name, int32_t microbatch) {
  Impl& m = *impl_;
  return m.Guard(name, microbatch, false,
                 [&]() -> const std::byte* { return m.LoadBuffer(name, microbatch).as<const std::byte>(); });
}

Status ActivationManager::Release(const std::string& name, int32_t microbatch) {
  Impl& m = *impl_;
  return m.Guard(name, microbatch, false, [&] {
    m.Find(name, microbatch);
    m.Drop(name, microbatch);
    return std::monostate{};
  });
}

void ActivationManager::EndStep() {
  auto& pending = impl_->ctx.pending_frees;
  for (Buffer& b : pending) impl_->ctx.device.Free(b);
  pending.clear();
}

const StorageSpec& ActivationManager::SpecOf(const std::string& name) const { return impl_->Spec(name); }

int64_t ActivationManager::DeviceBytes(const std::string& name, int32_t microbatch) const {
  auto it = impl_->slots.find({name, microbatch});
  if (it == impl_->slots.end()) return 0;
  const Slot& s = it->second;
  return s.loaded.bytes + s.staged.bytes + s.device.bytes;
}

int64_t ActivationManager::live_instances() const { return static_cast<int64_t>(impl_->slots.size()); }

Device& ActivationManager::device() { return impl_->ctx.device; }

}  // namespace memplan::runtime
