// The CUDA backend (cuda_device.h). Compiled only when Meson found CUDA
// (runtime/meson.build), into the CUDA plugin and runtime_cuda_dep.
//
// Errors while creating a device are Error values; a CUDA call that fails
// afterwards (a stream, event or copy call) aborts with the call and CUDA's
// error string, as the kernels do: the stream is in an unknown state and
// nothing a caller could do would recover it. Teardown ignores errors: at
// process exit the CUDA runtime may already be gone.
#include "memplan/runtime/cuda_device.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <optional>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "memplan/common/best_fit_heap.h"
#include "memplan/common/check.h"

#define MEMPLAN_CUDART_CHECK(expr)                                                                          \
  do {                                                                                                      \
    const cudaError_t memplan_cudart_err_ = (expr);                                                         \
    if (memplan_cudart_err_ != cudaSuccess) [[unlikely]]                                                    \
      ::memplan::internal::CheckFailed(__FILE__, __LINE__, #expr, cudaGetErrorString(memplan_cudart_err_)); \
  } while (0)

namespace memplan::runtime {

namespace {

std::string Describe(int64_t bytes) { return std::to_string(bytes) + " B"; }

// Makes `device` current for the scope and restores the caller's device:
// events must be created on their stream's device, and a thread driving two
// GPUs should not find its current device changed under it.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    MEMPLAN_CUDART_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) MEMPLAN_CUDART_CHECK(cudaSetDevice(device));
    device_ = device;
  }
  ~DeviceScope() {
    if (previous_ != device_) cudaSetDevice(previous_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = 0;
  int device_ = 0;
};

// Event's view of a cudaEvent_t (device.h, internal::NativeEventOps).
bool QueryCudaEvent(void* native) {
  const cudaError_t err = cudaEventQuery(static_cast<cudaEvent_t>(native));
  if (err == cudaErrorNotReady) return false;
  MEMPLAN_CUDART_CHECK(err);
  return true;
}
void SynchronizeCudaEvent(void* native) {
  MEMPLAN_CUDART_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(native)));
}
void DestroyCudaEvent(void* native) { cudaEventDestroy(static_cast<cudaEvent_t>(native)); }
constexpr internal::NativeEventOps kCudaEventOps{&QueryCudaEvent, &SynchronizeCudaEvent, &DestroyCudaEvent};

// A completion event (no timing: cheaper to record and to wait on), created
// on the current device and recorded on `stream`.
cudaEvent_t RecordNewEvent(cudaStream_t stream) {
  cudaEvent_t e = nullptr;
  MEMPLAN_CUDART_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  MEMPLAN_CUDART_CHECK(cudaEventRecord(e, stream));
  return e;
}

// Makes `waiter` wait for all work issued so far on `producer` (on device
// `producer_device`). A fresh event each time rather than one per device:
// two ranks driven from two threads may order against the same stream.
void OrderAfter(cudaStream_t waiter, cudaStream_t producer, int producer_device) {
  DeviceScope scope(producer_device);
  cudaEvent_t e = RecordNewEvent(producer);
  MEMPLAN_CUDART_CHECK(cudaStreamWaitEvent(waiter, e, 0));
  // Destroying a recorded event is legal: the wait already captured it.
  MEMPLAN_CUDART_CHECK(cudaEventDestroy(e));
}

int64_t PoolAttribute(cudaMemPool_t pool, cudaMemPoolAttr attr) {
  uint64_t value = 0;  // the attribute is a cuuint64_t
  MEMPLAN_CUDART_CHECK(cudaMemPoolGetAttribute(pool, attr, &value));
  return static_cast<int64_t>(value);
}

}  // namespace

// ------------------------------------------------------------------ state

namespace internal {

// What a CudaDevice owns, and what other devices' copies need of it: its
// streams (to order against) and its live buffers (to fence).
struct CudaDeviceState {
  struct Block {
    int64_t bytes = 0;
    std::vector<Event> fences;  // copies reading or writing the buffer
  };

  CudaDevice::Options options;
  cudaMemPool_t pool = nullptr;
  // Arena mode: one block and the planner's heap over it.
  std::byte* arena_base = nullptr;
  std::optional<BestFitHeap> heap;
  int64_t arena_high_water = 0;
  cudaStream_t compute = nullptr;
  cudaStream_t queues[kQueueCount] = {};

  mutable std::mutex mu;            // guards what follows
  std::map<uintptr_t, Block> live;  // address -> block
  std::vector<uintptr_t> allocated_addresses;  // pool mode: every address, for AddRegions
  int64_t allocated_bytes = 0;
  int64_t allocated_peak = 0;
  bool witness = false;  // EnableWitness: red zones either side of each pool buffer

  // Releases whatever Create got as far as making.
  ~CudaDeviceState() {
    if (compute != nullptr) cudaStreamDestroy(compute);
    for (cudaStream_t s : queues) {
      if (s != nullptr) cudaStreamDestroy(s);
    }
    if (pool != nullptr) cudaMemPoolDestroy(pool);
    if (arena_base != nullptr) cudaFree(arena_base);
  }

  // Registers `event` on the live block holding [ptr, ptr + bytes), which
  // must lie inside it.
  void Fence(const void* ptr, int64_t bytes, const Event& event) {
    auto x = reinterpret_cast<uintptr_t>(ptr);
    std::lock_guard<std::mutex> lock(mu);
    auto it = live.upper_bound(x);
    MEMPLAN_CHECK(it != live.begin(), "copy touches device memory that is not allocated");
    --it;
    MEMPLAN_CHECK(x + static_cast<uintptr_t>(bytes) <= it->first + static_cast<uintptr_t>(it->second.bytes),
                  "copy runs past the end of its buffer");
    auto& fences = it->second.fences;
    std::erase_if(fences, [](const Event& e) { return e.done(); });
    fences.push_back(event);
  }

  bool Holds(const void* ptr) const {
    auto x = reinterpret_cast<uintptr_t>(ptr);
    std::lock_guard<std::mutex> lock(mu);
    auto it = live.upper_bound(x);
    if (it == live.begin()) return false;
    --it;
    return x < it->first + static_cast<uintptr_t>(it->second.bytes);
  }
};

}  // namespace internal

namespace {

// CudaDevices alive in this process, so that a copy can fence and order
// against whichever device owns its source and destination (a handful: a
// linear scan, as for host arenas).
std::mutex& RegistryMutex() {
  static std::mutex mu;
  return mu;
}
std::vector<internal::CudaDeviceState*>& Registry() {
  static std::vector<internal::CudaDeviceState*> devices;
  return devices;
}

internal::CudaDeviceState* OwnerOf(const void* ptr) {
  std::lock_guard<std::mutex> lock(RegistryMutex());
  for (internal::CudaDeviceState* d : Registry()) {
    if (d->Holds(ptr)) return d;
  }
  return nullptr;
}

// The stream-ordered pool of pool mode, on the current device. `failed`
// turns a CUDA error into the caller's Error.
template <class Failed>
Expected<bool> CreatePool(internal::CudaDeviceState& state, Failed& failed) {
  internal::CudaDeviceState* impl = &state;
  cudaMemPoolProps props{};
  props.allocType = cudaMemAllocationTypePinned;
  props.handleTypes = cudaMemHandleTypeNone;
  props.location.type = cudaMemLocationTypeDevice;
  props.location.id = impl->options.device;
  if (cudaError_t err = cudaMemPoolCreate(&impl->pool, &props); err != cudaSuccess) {
    impl->pool = nullptr;
    return failed("cudaMemPoolCreate", err);
  }
  // Freed memory stays reserved (never trimmed on synchronization): the
  // reserved high-water mark is then the rank's footprint.
  uint64_t keep = UINT64_MAX;
  if (cudaError_t err = cudaMemPoolSetAttribute(impl->pool, cudaMemPoolAttrReleaseThreshold, &keep);
      err != cudaSuccess) {
    return failed("cudaMemPoolSetAttribute(ReleaseThreshold)", err);
  }
  // Reuse follows stream order only (all frees are on the compute stream),
  // not whichever free happens to have completed: deterministic placement.
  int off = 0;
  if (cudaError_t err = cudaMemPoolSetAttribute(impl->pool, cudaMemPoolReuseAllowOpportunistic, &off);
      err != cudaSuccess) {
    return failed("cudaMemPoolSetAttribute(ReuseAllowOpportunistic)", err);
  }
  return true;
}

}  // namespace

// ------------------------------------------------------------- CudaDevice

bool CudaRuntimeAvailable() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // no driver or no device: not an error to keep
    return false;
  }
  return count > 0;
}

int LocalCudaDevice() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count <= 0) {
    cudaGetLastError();
    return 0;
  }
  for (const char* v : {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"}) {
    if (const char* s = std::getenv(v)) return std::max(0, std::atoi(s)) % count;
  }
  return 0;
}

Expected<std::unique_ptr<CudaDevice>> CudaDevice::Create(Options options) {
  const std::string name = options.name;
  if (options.capacity_bytes <= 0) {
    return Error{ErrorCode::kBadInput,
                 name + ": device capacity must be positive, got " + Describe(options.capacity_bytes)};
  }
  auto failed = [&](const char* call, cudaError_t err) {
    cudaGetLastError();
    return Error{ErrorCode::kRuntime, name + ": " + call + " failed: " + cudaGetErrorString(err)};
  };
  int count = 0;
  if (cudaError_t err = cudaGetDeviceCount(&count); err != cudaSuccess) return failed("cudaGetDeviceCount", err);
  if (options.device < 0 || options.device >= count) {
    return Error{ErrorCode::kBadInput, name + ": CUDA device " + std::to_string(options.device) + " does not exist (" +
                                           std::to_string(count) + " visible)"};
  }

  int previous = 0;
  if (cudaError_t err = cudaGetDevice(&previous); err != cudaSuccess) return failed("cudaGetDevice", err);
  if (cudaError_t err = cudaSetDevice(options.device); err != cudaSuccess) return failed("cudaSetDevice", err);
  auto impl = std::make_unique<internal::CudaDeviceState>();
  impl->options = std::move(options);
  auto result = [&]() -> Expected<std::unique_ptr<CudaDevice>> {
    if (impl->options.arena) {
      void* base = nullptr;
      if (cudaError_t err = cudaMalloc(&base, static_cast<size_t>(impl->options.capacity_bytes)); err != cudaSuccess) {
        return failed("cudaMalloc(arena)", err);
      }
      impl->arena_base = static_cast<std::byte*>(base);
      impl->heap.emplace(impl->options.alignment);
    } else if (auto made = CreatePool(*impl, failed); !made.ok()) {
      return made.error();
    }
    if (cudaError_t err = cudaStreamCreateWithFlags(&impl->compute, cudaStreamNonBlocking); err != cudaSuccess) {
      impl->compute = nullptr;
      return failed("cudaStreamCreateWithFlags", err);
    }
    for (cudaStream_t& s : impl->queues) {
      if (cudaError_t err = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking); err != cudaSuccess) {
        s = nullptr;
        return failed("cudaStreamCreateWithFlags", err);
      }
    }
    return std::unique_ptr<CudaDevice>(new CudaDevice(std::move(impl)));
  }();
  cudaSetDevice(previous);
  return result;
}


CudaDevice::CudaDevice(std::unique_ptr<internal::CudaDeviceState> state) : impl_(std::move(state)) {
  std::lock_guard<std::mutex> lock(RegistryMutex());
  Registry().push_back(impl_.get());
}

CudaDevice::~CudaDevice() {
  {
    std::lock_guard<std::mutex> lock(RegistryMutex());
    auto& r = Registry();
    r.erase(std::find(r.begin(), r.end(), impl_.get()));
  }
  int previous = 0;
  if (cudaGetDevice(&previous) != cudaSuccess) return;  // the runtime is gone: nothing left to release
  cudaSetDevice(impl_->options.device);
  for (auto& [address, block] : impl_->live) {
    for (const Event& e : block.fences) {
      if (void* n = e.native()) {
        cudaStreamWaitEvent(impl_->compute, static_cast<cudaEvent_t>(n), 0);
      } else {
        e.Wait();
      }
    }
    if (!impl_->heap) cudaFreeAsync(reinterpret_cast<void*>(address - (impl_->witness ? kWitnessRedZone : 0)), impl_->compute);
  }
  impl_->live.clear();
  cudaStreamSynchronize(impl_->compute);
  for (cudaStream_t s : impl_->queues) cudaStreamSynchronize(s);
  cudaGetLastError();
  impl_.reset();  // streams and pool, with the device still current
  cudaSetDevice(previous);
}

std::string_view CudaDevice::name() const { return impl_->options.name; }

namespace {

// Arena mode: the planner's heap places the buffer (the caller holds d.mu).
Expected<Buffer> AllocateInArena(internal::CudaDeviceState& d, int64_t bytes) {
  const int64_t aligned = d.heap->AlignedSize(bytes);
  const int64_t offset = d.heap->Allocate(bytes);
  if (offset + aligned > d.options.capacity_bytes) {
    // Only growth from the top passes the capacity; freeing restores it.
    d.heap->Free(offset);
    return Error{ErrorCode::kRuntime, d.options.name + " arena exhausted: " + Describe(bytes) + " requested with " +
                                          Describe(d.allocated_bytes) + " in use, capacity is " +
                                          Describe(d.options.capacity_bytes)};
  }
  std::byte* ptr = d.arena_base + offset;
  d.live.emplace(reinterpret_cast<uintptr_t>(ptr), internal::CudaDeviceState::Block{bytes, {}});
  d.arena_high_water = std::max(d.arena_high_water, offset + aligned);
  d.allocated_bytes += bytes;
  d.allocated_peak = std::max(d.allocated_peak, d.allocated_bytes);
  return Buffer{ptr, offset, bytes};
}

}  // namespace

Expected<Buffer> CudaDevice::Allocate(int64_t bytes) {
  MEMPLAN_CHECK(bytes >= 0, "negative allocation");
  if (bytes == 0) return Buffer{};
  internal::CudaDeviceState& d = *impl_;
  std::lock_guard<std::mutex> lock(d.mu);
  if (bytes > d.options.capacity_bytes - d.allocated_bytes) {
    return Error{ErrorCode::kRuntime, d.options.name + " device exhausted: " + Describe(bytes) + " requested with " +
                                          Describe(d.allocated_bytes) + " in use, capacity is " +
                                          Describe(d.options.capacity_bytes)};
  }
  if (d.heap) return AllocateInArena(d, bytes);
  DeviceScope scope(d.options.device);
  void* ptr = nullptr;
  const int64_t zone = d.witness ? kWitnessRedZone : 0;
  if (cudaError_t err = cudaMallocFromPoolAsync(&ptr, static_cast<size_t>(bytes + 2 * zone), d.pool, d.compute);
      err != cudaSuccess) {
    cudaGetLastError();  // an allocation failure is not sticky: clear it
    return Error{ErrorCode::kRuntime,
                 d.options.name +
                     (err == cudaErrorMemoryAllocation ? " device exhausted" : " device allocation failed") +
                     ": the pool could not provide " + Describe(bytes) + " with " + Describe(d.allocated_bytes) +
                     " in use (" + cudaGetErrorString(err) + ")"};
  }
  if (d.witness) {
    MEMPLAN_CUDART_CHECK(cudaMemsetAsync(ptr, kWitnessCanary, static_cast<size_t>(bytes + 2 * zone), d.compute));
    ptr = static_cast<std::byte*>(ptr) + zone;
  }
  d.allocated_addresses.push_back(reinterpret_cast<uintptr_t>(ptr));  // the driver's address (CUPTI's)
  if (d.witness) {
    MEMPLAN_CUDART_CHECK(cudaMemsetAsync(ptr, kWitnessCanary, static_cast<size_t>(bytes + 2 * zone), d.compute));
    ptr = static_cast<std::byte*>(ptr) + zone;
  }
  d.live.emplace(reinterpret_cast<uintptr_t>(ptr), internal::CudaDeviceState::Block{bytes, {}});
  d.allocated_bytes += bytes;
  d.allocated_peak = std::max(d.allocated_peak, d.allocated_bytes);
  return Buffer{static_cast<std::byte*>(ptr), 0, bytes};
}

void CudaDevice::Free(Buffer buffer) {
  if (buffer.empty()) return;
  internal::CudaDeviceState& d = *impl_;
  const auto address = reinterpret_cast<uintptr_t>(buffer.ptr);
  std::vector<Event> fences;
  {
    std::lock_guard<std::mutex> lock(d.mu);
    auto it = d.live.find(address);
    MEMPLAN_CHECK(it != d.live.end(), "free of a buffer that is not live on this device");
    fences.swap(it->second.fences);
  }
  DeviceScope scope(d.options.device);
  // Without the lock: a host event may block, and other callers may fence.
  for (const Event& e : fences) Wait(e);
  // Pool: freed in stream order. Arena: back to the heap now; later users
  // of the range are ordered after this point on the compute stream.
  if (!d.heap) MEMPLAN_CUDART_CHECK(cudaFreeAsync(buffer.ptr - (d.witness ? kWitnessRedZone : 0), d.compute));
  std::lock_guard<std::mutex> lock(d.mu);
  auto it = d.live.find(address);
  MEMPLAN_CHECK(it != d.live.end(), "buffer freed twice concurrently");
  d.allocated_bytes -= it->second.bytes;
  d.live.erase(it);
  if (d.heap) d.heap->Free(static_cast<int64_t>(buffer.ptr - d.arena_base));
}

bool CudaDevice::EnableWitness() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (impl_->heap) return false;
  MEMPLAN_CHECK(impl_->live.empty(), "the witness starts before the first allocation");
  impl_->witness = true;
  return true;
}

std::optional<BufferWitness> CudaDevice::Witness(const Buffer& buffer, bool scan) const {
  const internal::CudaDeviceState& d = *impl_;
  if (!d.witness || buffer.empty()) return std::nullopt;
  int64_t bytes = 0;
  {
    std::lock_guard<std::mutex> lock(d.mu);
    auto it = d.live.find(reinterpret_cast<uintptr_t>(buffer.ptr));
    MEMPLAN_CHECK(it != d.live.end(), "witness of a buffer that is not live on this device");
    bytes = it->second.bytes;
  }
  DeviceScope scope(d.options.device);
  MEMPLAN_CUDART_CHECK(cudaStreamSynchronize(d.compute));
  const int64_t z = kWitnessRedZone;
  // The whole buffer when scanning, else the two red zones around an
  // untouched (canary) payload stand-in.
  std::vector<std::byte> host(static_cast<size_t>(scan ? bytes + 2 * z : 2 * z + 1), std::byte{kWitnessCanary});
  if (scan) {
    MEMPLAN_CUDART_CHECK(cudaMemcpy(host.data(), buffer.ptr - z, host.size(), cudaMemcpyDeviceToHost));
    return ReadWitness(host.data(), bytes, true);
  }
  MEMPLAN_CUDART_CHECK(cudaMemcpy(host.data(), buffer.ptr - z, static_cast<size_t>(z), cudaMemcpyDeviceToHost));
  MEMPLAN_CUDART_CHECK(cudaMemcpy(host.data() + z + 1, buffer.ptr + bytes, static_cast<size_t>(z), cudaMemcpyDeviceToHost));
  return ReadWitness(host.data(), 1, false);
}

int64_t CudaDevice::capacity_bytes() const { return impl_->options.capacity_bytes; }
int64_t CudaDevice::high_water() const {
  if (impl_->heap) {
    std::lock_guard<std::mutex> lock(impl_->mu);
    return impl_->arena_high_water;
  }
  return PoolAttribute(impl_->pool, cudaMemPoolAttrReservedMemHigh);
}
int64_t CudaDevice::used_high_water() const {
  return impl_->heap ? high_water() : PoolAttribute(impl_->pool, cudaMemPoolAttrUsedMemHigh);
}
int64_t CudaDevice::reserved_bytes() const {
  return impl_->heap ? impl_->options.capacity_bytes : PoolAttribute(impl_->pool, cudaMemPoolAttrReservedMemCurrent);
}
void CudaDevice::AddRegions(traces::OwnerRegions& regions) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (impl_->heap) {
    auto begin = reinterpret_cast<uint64_t>(impl_->arena_base);
    regions.ranges.emplace_back(begin, begin + static_cast<uint64_t>(impl_->options.capacity_bytes));
    return;
  }
  for (uintptr_t a : impl_->allocated_addresses) regions.addresses.push_back(static_cast<uint64_t>(a));
}

std::pair<void*, int64_t> CudaDevice::arena_block() const {
  if (!impl_->heap) return {nullptr, 0};
  return {impl_->arena_base, impl_->options.capacity_bytes};
}
int64_t CudaDevice::allocated_bytes() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->allocated_bytes;
}
int64_t CudaDevice::allocated_peak() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->allocated_peak;
}
void CudaDevice::ResetAllocatedPeak() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->allocated_peak = impl_->allocated_bytes;
}
int64_t CudaDevice::live_buffers() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return static_cast<int64_t>(impl_->live.size());
}
int CudaDevice::device() const { return impl_->options.device; }
void* CudaDevice::compute_stream() const { return impl_->compute; }
void* CudaDevice::queue_stream(Queue queue) const { return impl_->queues[static_cast<int>(queue)]; }
void* CudaDevice::pool() const { return impl_->pool; }

Event CudaDevice::CopyAsync(void* dst, const void* src, int64_t bytes, Queue queue) {
  MEMPLAN_CHECK(bytes >= 0, "negative copy size");
  if (bytes == 0) return Event{};
  MEMPLAN_CHECK(dst != nullptr && src != nullptr, "copy with a null pointer");
  auto dx = reinterpret_cast<uintptr_t>(dst);
  auto sx = reinterpret_cast<uintptr_t>(src);
  auto n = static_cast<uintptr_t>(bytes);
  MEMPLAN_CHECK(dx + n <= sx || sx + n <= dx, "copy source and destination overlap");
  internal::CudaDeviceState& d = *impl_;
  DeviceScope scope(d.options.device);
  cudaStream_t stream = d.queues[static_cast<int>(queue)];

  // The copy sees the producing kernels and the allocation of its buffers,
  // on this device's compute stream and on that of another rank owning the
  // source or destination (a remote buffer is allocated in its stream order).
  internal::CudaDeviceState* dst_owner = OwnerOf(dst);
  internal::CudaDeviceState* src_owner = OwnerOf(src);
  OrderAfter(stream, d.compute, d.options.device);
  if (dst_owner != nullptr && dst_owner != &d) OrderAfter(stream, dst_owner->compute, dst_owner->options.device);
  if (src_owner != nullptr && src_owner != &d && src_owner != dst_owner) {
    OrderAfter(stream, src_owner->compute, src_owner->options.device);
  }

  if (dst_owner != nullptr && src_owner != nullptr && dst_owner->options.device != src_owner->options.device) {
    MEMPLAN_CUDART_CHECK(cudaMemcpyPeerAsync(dst, dst_owner->options.device, src, src_owner->options.device,
                                             static_cast<size_t>(bytes), stream));
  } else {
    MEMPLAN_CUDART_CHECK(cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes), cudaMemcpyDefault, stream));
  }
  Event done = Event::Native(RecordNewEvent(stream), &kCudaEventOps);

  if (dst_owner != nullptr) {
    dst_owner->Fence(dst, bytes, done);
  } else if (HostArena* a = HostArena::Owner(dst)) {
    a->Fence(dst, bytes, done);
  }
  if (src_owner != nullptr) {
    src_owner->Fence(src, bytes, done);
  } else if (HostArena* a = HostArena::Owner(src)) {
    a->Fence(src, bytes, done);
  }
  return done;
}

void CudaDevice::Wait(const Event& event) {
  if (void* n = event.native()) {
    DeviceScope scope(impl_->options.device);
    MEMPLAN_CUDART_CHECK(cudaStreamWaitEvent(impl_->compute, static_cast<cudaEvent_t>(n), 0));
  } else {
    event.Wait();
  }
}

void CudaDevice::Synchronize() {
  DeviceScope scope(impl_->options.device);
  MEMPLAN_CUDART_CHECK(cudaStreamSynchronize(impl_->compute));
  for (cudaStream_t s : impl_->queues) MEMPLAN_CUDART_CHECK(cudaStreamSynchronize(s));
}

// ------------------------------------------------------------ pinned arena

Expected<std::unique_ptr<HostArena>> MakePinnedArena(int64_t capacity_bytes, std::string name) {
  if (capacity_bytes <= 0) {
    return Error{ErrorCode::kBadInput,
                 name + ": pinned arena capacity must be positive, got " + Describe(capacity_bytes)};
  }
  // Allocated here, where failure can be an Error; the arena's hook only
  // hands the block over.
  void* block = nullptr;
  if (cudaError_t err = cudaHostAlloc(&block, static_cast<size_t>(capacity_bytes), cudaHostAllocPortable);
      err != cudaSuccess) {
    cudaGetLastError();
    return Error{ErrorCode::kRuntime,
                 name + ": cudaHostAlloc of " + Describe(capacity_bytes) + " failed: " + cudaGetErrorString(err)};
  }
  HostArena::Options o;
  o.capacity_bytes = capacity_bytes;
  o.name = std::move(name);
  o.allocate = [block](int64_t) { return static_cast<std::byte*>(block); };
  o.release = [](std::byte* p) { cudaFreeHost(p); };
  return std::make_unique<HostArena>(std::move(o));
}

}  // namespace memplan::runtime
