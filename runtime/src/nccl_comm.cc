// The device communicator over NCCL (comm.h), in the CUDA plugin
// (cuda_plugin.h): rank 0's unique id reaches every rank through the MPI
// communicator the ranks already share, then ncclCommInitRank on each
// process's GPU (docs/runtime.md, "NCCL").
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <nccl.h>  // types only: the functions are looked up (LoadNccl)

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>

#include "memplan/common/check.h"
#include "memplan/runtime/comm.h"
#include "memplan/runtime/cuda_device.h"

namespace memplan::runtime {
namespace {

// NCCL is opened when a run first needs it, not linked: the plugin then
// loads on machines whose CUDA has no NCCL (a 200 MB library), and only a
// data-parallel cuda run asks for it.
struct Nccl {
  decltype(&::ncclGetUniqueId) GetUniqueId = nullptr;
  decltype(&::ncclCommInitRank) CommInitRank = nullptr;
  decltype(&::ncclCommDestroy) CommDestroy = nullptr;
  decltype(&::ncclCommGetAsyncError) CommGetAsyncError = nullptr;
  decltype(&::ncclGetErrorString) GetErrorString = nullptr;
  decltype(&::ncclAllReduce) AllReduce = nullptr;
  decltype(&::ncclReduce) Reduce = nullptr;
  decltype(&::ncclBroadcast) Broadcast = nullptr;
  decltype(&::ncclGroupStart) GroupStart = nullptr;
  decltype(&::ncclGroupEnd) GroupEnd = nullptr;
};

Expected<const Nccl*> LoadNccl() {
  static Nccl nccl;
  static std::string error = [] {
    void* lib = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) lib = dlopen("libnccl.so", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) return std::string("NCCL: cannot open libnccl.so.2 (") + dlerror() + ")";
    std::string missing;
    auto bind = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
      if (fn == nullptr) missing += std::string(missing.empty() ? "" : ", ") + name;
    };
    bind(nccl.GetUniqueId, "ncclGetUniqueId");
    bind(nccl.CommInitRank, "ncclCommInitRank");
    bind(nccl.CommDestroy, "ncclCommDestroy");
    bind(nccl.CommGetAsyncError, "ncclCommGetAsyncError");
    bind(nccl.GetErrorString, "ncclGetErrorString");
    bind(nccl.AllReduce, "ncclAllReduce");
    bind(nccl.Reduce, "ncclReduce");
    bind(nccl.Broadcast, "ncclBroadcast");
    bind(nccl.GroupStart, "ncclGroupStart");
    bind(nccl.GroupEnd, "ncclGroupEnd");
    return missing.empty() ? std::string() : "NCCL: libnccl lacks " + missing;
  }();
  if (!error.empty()) return Error{ErrorCode::kRuntime, error};
  return &nccl;
}

const Nccl& N() { return **LoadNccl(); }  // after MakeNcclCommunicator loaded it

void Check(ncclResult_t r, const char* what) {
  if (r != ncclSuccess) ThrowError(ErrorCode::kRuntime, std::string(what) + ": " + N().GetErrorString(r));
}

cudaStream_t S(void* stream) { return static_cast<cudaStream_t>(stream); }

class NcclCommunicator final : public DeviceCommunicator {
 public:
  NcclCommunicator(ncclComm_t comm, int rank, int size) : comm_(comm), rank_(rank), size_(size) {}
  ~NcclCommunicator() override { N().CommDestroy(comm_); }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string_view transport() const override { return "nccl"; }

  void AllReduceSum(float* data, int64_t n, void* stream) override {
    Check(N().AllReduce(data, data, static_cast<size_t>(n), ncclFloat32, ncclSum, comm_, S(stream)), "ncclAllReduce");
  }

  // One ncclReduce per range, rooted at its owner, in place; grouped so
  // that NCCL runs them as one operation.
  void ReduceRanges(float* data, int64_t n, void* stream) override {
    const int64_t k = (n + size_ - 1) / size_;
    Check(N().GroupStart(), "ncclGroupStart");
    for (int r = 0; r < size_; ++r) {
      const int64_t lo = std::min(n, k * r), count = std::min(n, lo + k) - lo;
      if (count == 0) continue;
      Check(N().Reduce(data + lo, data + lo, static_cast<size_t>(count), ncclFloat32, ncclSum, r, comm_, S(stream)),
            "ncclReduce");
    }
    Check(N().GroupEnd(), "ncclGroupEnd");
  }

  // One ncclBroadcast per range from its owner, in place.
  void GatherRanges(void* data, int64_t n, int64_t width, void* stream) override {
    const int64_t k = (n + size_ - 1) / size_;
    auto* bytes = static_cast<std::byte*>(data);
    Check(N().GroupStart(), "ncclGroupStart");
    for (int r = 0; r < size_; ++r) {
      const int64_t lo = std::min(n, k * r), count = std::min(n, lo + k) - lo;
      if (count == 0) continue;
      Check(N().Broadcast(bytes + lo * width, bytes + lo * width, static_cast<size_t>(count * width), ncclUint8, r,
                          comm_, S(stream)),
            "ncclBroadcast");
    }
    Check(N().GroupEnd(), "ncclGroupEnd");
  }

  void Synchronize(void* stream) override {
    if (cudaError_t e = cudaStreamSynchronize(S(stream)); e != cudaSuccess) {
      ThrowError(ErrorCode::kRuntime, std::string("NCCL: cudaStreamSynchronize: ") + cudaGetErrorString(e));
    }
    ncclResult_t async = ncclSuccess;
    Check(N().CommGetAsyncError(comm_, &async), "ncclCommGetAsyncError");
    Check(async, "NCCL");
  }

 private:
  ncclComm_t comm_;
  int rank_, size_;
};

}  // namespace

Expected<std::unique_ptr<DeviceCommunicator>> MakeNcclCommunicator(Communicator& bootstrap) {
  // Every rank reaches the exchange below, so that none waits for one that
  // gave up; a rank without NCCL sends no id.
  auto loaded = LoadNccl();
  ncclUniqueId id;
  std::memset(&id, 0, sizeof id);
  if (bootstrap.rank() == 0 && loaded.ok() && N().GetUniqueId(&id) != ncclSuccess) std::memset(&id, 0, sizeof id);
  // Rank 0's id to every rank (MPI_Allgather: a broadcast among few ranks).
  std::string mine(reinterpret_cast<const char*>(&id), sizeof id);
  std::vector<std::string> all = bootstrap.AllGather(mine);
  if (all.empty() || all[0].size() != sizeof id) return Error{ErrorCode::kRuntime, "NCCL: no unique id from rank 0"};
  if (!loaded.ok()) return loaded.error();
  std::memcpy(&id, all[0].data(), sizeof id);
  const ncclUniqueId zero{};
  if (std::memcmp(&id, &zero, sizeof id) == 0) return Error{ErrorCode::kRuntime, "NCCL: rank 0 could not make a unique id"};
  // Connections made at init, not at the first collective: NCCL's buffers
  // are then allocated before the step, with the context's bytes, instead
  // of in the middle of the measured step. A user's setting wins.
  setenv("NCCL_RUNTIME_CONNECT", "0", 0);
  if (cudaError_t e = cudaSetDevice(LocalCudaDevice()); e != cudaSuccess) {
    return Error{ErrorCode::kRuntime, std::string("NCCL: cudaSetDevice: ") + cudaGetErrorString(e)};
  }
  ncclComm_t comm = nullptr;
  if (ncclResult_t r = N().CommInitRank(&comm, bootstrap.size(), id, bootstrap.rank()); r != ncclSuccess) {
    return Error{ErrorCode::kRuntime, std::string("ncclCommInitRank: ") + N().GetErrorString(r)};
  }
  return std::unique_ptr<DeviceCommunicator>(new NcclCommunicator(comm, bootstrap.rank(), bootstrap.size()));
}

}  // namespace memplan::runtime
