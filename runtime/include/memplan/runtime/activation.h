// The unified activation manager (mission-notes.md): every tensor saved for
// backward goes through Save / Prefetch / Load / Release, and a binding
// table, not the model code, decides how it is stored in between.
//
// Glossary (docs/planner.md, "Liveness")
//   instance   one saved tensor (by name) of one microbatch.
//   payload    what a storage keeps of an instance: the full tensor, or its
//              FP8 encoding (E4M3 values then the fp32 block scales).
//   copy-out   the asynchronous copy of an offloaded payload off the device
//              (d2h queue into the HostArena, or link queue into the remote
//              device); FinishCopyOut() ends it and frees the device source.
//   prefetch   the asynchronous copy back (h2d or link), issued one layer
//              ahead by the executor; Load() waits for it.
//
// Device bytes follow the planner's intervals, call by call:
//
//   storage             Save                 between            Load .. Release
//   keep                full                 full               full
//   recompute           full, then 0         0                  full (re-run)
//   fp8                 full + fp8, then fp8 fp8                full + fp8, then full
//   offload_*           full until FinishCopyOut, 0;  Prefetch: full
//   fp8 + offload_*     full + fp8, then fp8 until FinishCopyOut, 0;
//                       Prefetch: fp8; Load: fp8 + full, then full
//
// "then" is immediate, or at the next EndStep() with Options::defer_frees
// (the planner frees every interval at the end of its last step, after the
// step's transient is placed). An offloaded instance whose copy-out was not
// finished when it is prefetched or loaded stays resident, as the planner
// accounts it: its device source becomes the loaded tensor. Off the
// device, the host arena or the remote device holds the moved bytes from
// Save until Load (the planner counts a remote target's bytes from the
// copy-out's end to the prefetch's arrival).
//
// Threading: a manager is driven by one thread (the compute stream). Copy
// engines run concurrently; every allocation and free happens on the
// calling thread in program order, so device bytes are deterministic.
// Kernels are the CPU references: the host backend is assumed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <variant>
#include <vector>

#include "memplan/common/status.h"
#include "memplan/kernels/fp8.h"
#include "memplan/runtime/device.h"
#include "memplan/runtime/host_device.h"
#include "memplan/runtime/storage.h"

namespace memplan::runtime {

// Success or an Error.
using Status = Expected<std::monostate>;
inline Status OkStatus() { return std::monostate{}; }

class ActivationManager {
 public:
  // Tensor name -> storage. Names not in the table take Options::default_spec.
  using Bindings = std::map<std::string, StorageSpec>;
  // Re-runs the producing function of one instance into `out` (the full
  // tensor, on the device). It may Load() other saved instances.
  using RecomputeFn = std::function<void(float* out)>;
  using RawRecomputeFn = std::function<void(std::byte* out)>;

  struct Options {
    StorageSpec default_spec;  // keep
    kernels::ScaleMode fp8_scale_mode = kernels::ScaleMode::kAmax;  // design.md: amax / 448
    // Frees that end an interval wait for EndStep() (the executor's mode).
    bool defer_frees = false;
  };

  // An error (kBadInput) when a binding is illegal, offload_remote targets
  // `device` itself, or offload_host is bound without a host arena.
  // `device`, `host` and every remote target must outlive the manager.
  static Expected<std::unique_ptr<ActivationManager>> Create(Device& device, HostArena* host, Bindings bindings,
                                                             Options options);
  static Expected<std::unique_ptr<ActivationManager>> Create(Device& device, HostArena* host, Bindings bindings) {
    return Create(device, host, std::move(bindings), Options{});
  }
  // Releases every instance still held (waiting for its copies), then
  // performs the deferred frees.
  ~ActivationManager();
  ActivationManager(const ActivationManager&) = delete;
  ActivationManager& operator=(const ActivationManager&) = delete;

  // Saves a row-major fp32 tensor of `shape` (the last dimension is the FP8
  // block dimension) produced at this step: copies it into a device buffer,
  // then stores it by its binding. `recompute` is required when the binding
  // recomputes. Errors: the instance exists, the device or host arena is
  // exhausted, recompute without a function. On error nothing stays held.
  Status Save(const std::string& name, int32_t microbatch, const float* data, const std::vector<int64_t>& shape,
              RecomputeFn recompute = {});
  // As Save, adopting `full` (a buffer of this device holding the tensor,
  // 4 * NumElements(shape) bytes): no copy. The manager owns it from now
  // on, also on error.
  Status SaveBuffer(const std::string& name, int32_t microbatch, Buffer full, const std::vector<int64_t>& shape,
                    RecomputeFn recompute = {});
  // Raw bytes (masks, indices): any storage but fp8.
  Status SaveRaw(const std::string& name, int32_t microbatch, const void* data, int64_t bytes,
                 RawRecomputeFn recompute = {});

  // The copy-out of an offloaded instance is over: waits for it and frees
  // the device source (the planner's `done` step). A no-op for other
  // storages and when already finished.
  Status FinishCopyOut(const std::string& name, int32_t microbatch);
  // FinishCopyOut for every instance with a copy-out in flight.
  void FinishCopyOuts();

  // Starts bringing an offloaded payload back to the device (allocates it
  // there). A no-op for other storages, when already prefetched, and when
  // the copy-out was not finished (the instance stays resident).
  Status Prefetch(const std::string& name, int32_t microbatch);

  // The full tensor on the device, valid until Release: waits for the
  // prefetch (issuing it first if needed), dequantizes, or recomputes. A
  // second Load returns the same pointer.
  Expected<const float*> Load(const std::string& name, int32_t microbatch);
  Expected<const std::byte*> LoadRaw(const std::string& name, int32_t microbatch);

  // Frees everything the instance holds (loaded or not) and forgets it.
  Status Release(const std::string& name, int32_t microbatch);

  // Performs the frees deferred to the end of the current step
  // (Options::defer_frees); a no-op otherwise.
  void EndStep();

  // The storage `name` is bound to.
  const StorageSpec& SpecOf(const std::string& name) const;
  // Bytes of this device the instance holds now (0 when unknown); frees
  // deferred to EndStep() are not counted.
  int64_t DeviceBytes(const std::string& name, int32_t microbatch) const;
  // Instances saved and not released.
  int64_t live_instances() const;
  Device& device();

 private:
  struct Impl;
  explicit ActivationManager(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace memplan::runtime
