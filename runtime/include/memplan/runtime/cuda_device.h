// The CUDA backend: a Device over one stream-ordered memory pool of a GPU,
// with a compute stream and three copy streams, and the pinned host arena
// that receives host offloads.
//
// CudaDevice is one (emulated) pipeline rank. Several may share a GPU: each
// has its own pool, so each rank's footprint is measured on its own
// (docs/design.md, "Backends").
//
//   pool     created with cudaMemPoolCreate on `device`, release threshold
//            UINT64_MAX (freed memory stays reserved, so the reserved
//            high-water mark is the rank's footprint) and opportunistic reuse
//            off (reuse follows stream order only). Every Allocate is a
//            cudaMallocFromPoolAsync and every Free a cudaFreeAsync, both on
//            the compute stream: the host-side order of the calls is the
//            stream order.
//   streams  compute (kernels: pass compute_stream() to kernels::MakeCudaOps)
//            and d2h, h2d, link, one per Queue; all created non-blocking.
//   events   CopyAsync orders its copy stream after the compute stream (and
//            after the compute stream of any other CudaDevice that owns the
//            source or destination), issues the copy, and returns a native
//            Event recorded after it. Wait(event) makes the compute stream
//            wait for it without blocking the calling thread; Event::Wait()
//            blocks the thread. Each buffer keeps the events of the copies
//            that touch it, and Free first makes the compute stream wait for
//            them: a free waits for its copy, in stream order.
//
// Two allocators (Options::arena):
//   pool     (arena = false) as above: the framework-like stream-ordered
//            pool; its reserved mark comes in the driver's granules.
//   arena    (arena = true) one cudaMalloc of exactly capacity_bytes made at
//            Create, buffers placed in it by BestFitHeap (the planner's own
//            allocator, same alignment): driven by the plan's program, the
//            placement is the planner's, so high_water is the plan's peak
//            byte for byte, as on the host backend. A free is immediate in
//            host order; the memory is reused only by work issued later on
//            the compute stream, or by copies ordered after it (CopyAsync
//            waits for the compute stream), so stream order protects it.
//
// Accounting (device.h's names):
//   allocated_bytes / allocated_peak   live requested bytes and their maximum,
//                                      counted by the class in call order;
//   high_water (= peak)                the pool's cudaMemPoolAttrReservedMemHigh;
//                                      arena: the heap's offset + size maximum;
//   used_high_water                    the pool's cudaMemPoolAttrUsedMemHigh
//                                      (high_water - used_high_water is the
//                                      fragmentation the driver added); arena:
//                                      high_water.
// capacity_bytes bounds allocated_bytes (the class refuses an allocation that
// would pass it), not the pool's reservation, which the driver rounds up.
//
// No CUDA header is included here: streams, the pool and events are opaque
// pointers (cudaStream_t, cudaMemPool_t and cudaEvent_t are pointer types).
// Built only with CUDA, into the CUDA plugin (cuda_plugin.h) and the GPU
// tests (runtime_cuda_dep); memplan itself never links it.
//
// Limits: a CudaDevice is driven from one thread (device.h). Copies between
// two GPUs use cudaMemcpyPeerAsync and are checked on one GPU only (two
// CudaDevices on the same GPU, the emulated pipeline ranks).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "memplan/common/status.h"
#include "memplan/runtime/device.h"
#include "memplan/runtime/host_device.h"

namespace memplan::runtime {

namespace internal {
struct CudaDeviceState;
}  // namespace internal

// True when memplan was built with the CUDA runtime and at least one CUDA
// device is visible. Always false without CUDA support compiled in.
bool CudaRuntimeAvailable();

// This process's GPU: under an MPI launcher its rank on the node
// (OMPI_COMM_WORLD_LOCAL_RANK, MPI_LOCALRANKID or SLURM_LOCALID) modulo the
// visible devices, one GPU per local rank; otherwise device 0.
int LocalCudaDevice();

class CudaDevice final : public Device {
 public:
  struct Options {
    int device = 0;                             // CUDA device ordinal
    std::string name = "cuda";                  // used in error messages
    int64_t capacity_bytes = int64_t{1} << 30;  // bound on live requested bytes (arena: its size)
    bool arena = false;                         // one block placed by BestFitHeap
    int64_t alignment = 256;                    // arena: BestFitHeap rounding, the planner's
  };

  // A device with its pool, streams and events created on `options.device`.
  // Errors: kBadInput for a non-positive capacity or a device ordinal that
  // does not exist; kRuntime when CUDA is missing or a CUDA call fails (the
  // message names the call and CUDA's error string).
  static Expected<std::unique_ptr<CudaDevice>> Create(Options options);
  // Frees the live buffers in stream order (after their copies), waits for
  // every stream, then destroys the streams and the pool.
  ~CudaDevice() override;
  CudaDevice(const CudaDevice&) = delete;
  CudaDevice& operator=(const CudaDevice&) = delete;

  std::string_view name() const override;
  // cudaMallocFromPoolAsync on the compute stream. Errors (kRuntime,
  // "... exhausted ..."): the live requested bytes would pass capacity_bytes,
  // or the pool cannot grow; the device is unchanged then.
  Expected<Buffer> Allocate(int64_t bytes) override;
  // Makes the compute stream wait for the buffer's in-flight copies, then
  // cudaFreeAsync on the compute stream. The calling thread blocks only on
  // host events (copies issued by a HostDevice).
  void Free(Buffer buffer) override;
  int64_t capacity_bytes() const override;
  int64_t high_water() const override;
  int64_t allocated_bytes() const override;
  int64_t allocated_peak() const override;
  void ResetAllocatedPeak() override;

  // cudaMemcpyAsync (cudaMemcpyDefault) on `queue`'s stream, ordered after the
  // compute stream; cudaMemcpyPeerAsync when the source and destination are
  // buffers of CudaDevices on different GPUs. Fences the source and
  // destination on whichever CudaDevice or HostArena holds them. Host memory
  // outside a pinned arena works but is staged by the driver and may make
  // the call synchronous.
  Event CopyAsync(void* dst, const void* src, int64_t bytes, Queue queue) override;
  // Native events: the compute stream waits (cudaStreamWaitEvent); the
  // calling thread does not block. Host events: blocks until complete.
  void Wait(const Event& event) override;
  // Blocks until the compute stream and the three copy streams are idle.
  void Synchronize() override;
  // Pool mode only (eager execution): red zones and the canary are set with
  // cudaMemsetAsync on the compute stream; Witness synchronizes it and
  // copies the buffer (or its red zones) back.
  bool EnableWitness() override;
  std::optional<BufferWitness> Witness(const Buffer& buffer, bool scan) const override;

  // The pool's cudaMemPoolAttrUsedMemHigh: the most bytes its live buffers
  // occupied at once, after the driver's rounding.
  int64_t used_high_water() const override;
  // Arena: the block's range. Pool: every address allocated so far.
  void AddRegions(traces::OwnerRegions& regions) const override;
  // The pool's cudaMemPoolAttrReservedMemCurrent.
  int64_t reserved_bytes() const;
  int64_t live_buffers() const;
  int device() const;
  // cudaStream_t of the compute stream (for kernels::MakeCudaOps).
  void* compute_stream() const;
  // cudaStream_t of `queue`'s copy stream.
  void* queue_stream(Queue queue) const;
  // cudaMemPool_t of the device's pool (nullptr in arena mode).
  void* pool() const;
  // Arena mode: the block's base address and size (CUPTI attributes device
  // allocations to ranks by address); {nullptr, 0} in pool mode.
  std::pair<void*, int64_t> arena_block() const;

 private:
  explicit CudaDevice(std::unique_ptr<internal::CudaDeviceState> state);
  std::unique_ptr<internal::CudaDeviceState> impl_;
};

// A HostArena of `capacity_bytes` (> 0) in page-locked host memory
// (cudaHostAlloc, portable to every device; cudaFreeHost when the arena is
// destroyed), so that d2h and h2d copies run asynchronously on the copy
// engines. Pinning is slow: make one arena up front. Errors: kBadInput for a
// non-positive capacity; kRuntime when CUDA is missing or cudaHostAlloc fails.
Expected<std::unique_ptr<HostArena>> MakePinnedArena(int64_t capacity_bytes, std::string name = "pinned");

}  // namespace memplan::runtime
