// Storage backends of the activation manager (private).
//
// A backend stores the payload of one instance between Save and Load. The
// placement backends (keep, offload_host, offload_remote) hold a payload
// somewhere; recompute holds nothing; fp8 is a codec that wraps a placement
// backend and hands it the FP8 encoding instead of the full tensor, which is
// how policies compose ([fp8, offload_host] = Fp8(OffloadHost)).
//
// Per-instance state lives in a Slot, shared by the layers of one chain
// (each layer uses its own fields). Backends themselves are stateless apart
// from their configuration, so one chain serves every instance of a binding.
// Allocation failures throw ErrorException; every field that owns memory is
// set before anything else can throw, so Discard() always frees all of it.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "memplan/kernels/fp8.h"
#include "memplan/runtime/device.h"
#include "memplan/runtime/host_device.h"
#include "memplan/runtime/storage.h"

namespace memplan::runtime::internal {

// What the backends share with the manager: the device, the host arena and
// the free discipline (immediate, or deferred to the end of the step).
struct Context {
  Device& device;
  HostArena* host = nullptr;
  kernels::ScaleMode scale_mode = kernels::ScaleMode::kAmax;
  bool defer_frees = false;
  std::vector<Buffer> pending_frees;

  // Throws ErrorException (kRuntime) when the device is exhausted.
  Buffer Allocate(int64_t bytes, const std::string& what);
  // Frees a device buffer now or at EndStep().
  void Free(Buffer& buffer);
};

struct Slot {
  std::string name;
  int32_t microbatch = 0;
  std::vector<int64_t> shape;  // elements; {bytes} for raw data
  int64_t bytes = 0;           // full tensor
  bool is_float = true;
  std::function<void(std::byte*)> recompute;

  Buffer loaded;  // the manager: full tensor handed out by Load
  Buffer staged;  // fp8: full tensor while quantizing, FP8 while dequantizing
  Buffer device;  // placement: payload on the device (kept, copy-out source, prefetched)
  Buffer away;    // offload: payload in the host arena or on the remote device
  Event out, in;  // offload: copy-out and prefetch
  bool copied_out = false;  // offload: copy-out finished, device source freed
  bool prefetched = false;  // offload: prefetch issued
  bool resident = false;    // offload: loaded before its copy-out finished: stays

  std::string Label() const { return name + "@mb" + std::to_string(microbatch); }
};

class Backend {
 public:
  virtual ~Backend() = default;
  // Takes ownership of `payload`, a device buffer written at this step.
  virtual void Store(Context& ctx, Slot& slot, Buffer payload) = 0;
  // Copy-out finished: free the device source (offload only).
  virtual void FinishStore(Context&, Slot&) {}
  virtual bool CopyOutPending(const Slot&) const { return false; }
  // Start bringing the payload back (offload only).
  virtual void Prefetch(Context&, Slot&) {}
  // The payload on the device; ownership moves to the caller.
  virtual Buffer Restore(Context& ctx, Slot& slot) = 0;
  // Frees whatever this layer still holds for the instance.
  virtual void Discard(Context& ctx, Slot& slot) = 0;
};

// The chain for a (validated) spec.
std::unique_ptr<Backend> MakeBackend(const StorageSpec& spec);

}  // namespace memplan::runtime::internal
