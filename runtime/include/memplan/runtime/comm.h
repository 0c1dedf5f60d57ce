// Processes of one run: the communicator that ties the ranks of a plan's
// grid together when `memplan run` is launched by mpirun (docs/runtime.md,
// "One process per rank").
//
// The executor needs little from it: point-to-point messages between
// pipeline stages (activations, their gradients, Block AttnRes caches and
// their gradients), and a few collectives on small host data (the agreement
// before any work, the gradient norm's partial sums, the tied embedding's
// gradients, the per-rank measurements gathered on rank 0). Messages are
// host bytes: the host backend's memory is host memory, and the cuda
// backend stages through the host as its single-process mailbox does.
//
// Semantics every implementation keeps:
//   - Send never blocks: the bytes are the communicator's until delivered.
//   - Recv blocks until the message from `from` with `tag` arrived; after
//     timeout() seconds without it, it throws ErrorException (kRuntime)
//     naming the peer, so that a lost rank fails the others instead of
//     hanging them. Messages between two ranks with one tag arrive in the
//     order they were sent.
//   - Collectives are called by every rank in the same order.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "memplan/common/status.h"

namespace memplan::runtime {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string_view transport() const = 0;  // "mpi"
  // Seconds Recv waits for one message.
  virtual double timeout() const = 0;
  // The largest tag Send and Recv accept.
  virtual int max_tag() const = 0;

  virtual void Send(int to, int tag, std::vector<std::byte> bytes) = 0;
  virtual std::vector<std::byte> Recv(int from, int tag) = 0;
  // Every rank's `mine`, in rank order.
  virtual std::vector<std::string> AllGather(const std::string& mine) = 0;
  virtual void Barrier() = 0;
  // The ranks with the same `color`, ordered by `key` (MPI_Comm_split); a
  // collective of this communicator.
  virtual std::unique_ptr<Communicator> Split(int color, int key) = 0;
  // Data parallelism. `in` holds size() blocks of `block` floats; rank r
  // receives the element-wise sum of every rank's block r.
  virtual void ReduceScatterSum(const float* in, float* out, int64_t block) = 0;
  // The element-wise sum of every rank's `data`, in place.
  virtual void AllReduceSum(float* data, int64_t n) = 0;
  // Every rank's `block` bytes at `in`, in rank order, into `out`.
  virtual void AllGatherBlocks(const void* in, void* out, int64_t block) = 0;
  // Ends every rank's process with `code` (a rank that failed alone).
  [[noreturn]] virtual void Abort(int code) = 0;
};

// Device memory between the processes of one run, for the cuda backend
// (NCCL): the data-parallel gradient reduction and the gathering of ZeRO-1's
// weights run on the device buffers themselves instead of staging through
// the host. Calls are enqueued on `stream` (a cudaStream_t: the ops'
// stream, so they follow the kernels that wrote the data) and every rank of
// the communicator makes the same calls in the same order.
class DeviceCommunicator {
 public:
  virtual ~DeviceCommunicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string_view transport() const = 0;  // "nccl"
  // The element-wise sum over the ranks, in place.
  virtual void AllReduceSum(float* data, int64_t n, void* stream) = 0;
  // ZeRO-1's ranges (k = ceil(n / size()): rank r's is [r k, min(n, (r+1) k))):
  // each rank's range of the sum lands in place in its own copy (the rest
  // of its copy is left as it was); each rank's range of `width`-byte
  // elements copied into every other rank's copy.
  virtual void ReduceRanges(float* data, int64_t n, void* stream) = 0;
  virtual void GatherRanges(void* data, int64_t n, int64_t width, void* stream) = 0;
  // Waits for what was enqueued on `stream`; a failed collective throws
  // ErrorException (kRuntime).
  virtual void Synchronize(void* stream) = 0;
};

// NCCL over the ranks of `bootstrap` (runtime/src/nccl_comm.cc, built into
// the CUDA plugin with NCCL: the runtime reaches it through
// CudaPlugin::make_nccl).
Expected<std::unique_ptr<DeviceCommunicator>> MakeNcclCommunicator(Communicator& bootstrap);

// Whether this process was started by an MPI launcher (mpirun, srun with
// PMIx): OpenMPI's, PMIx's or PMI's rank variables are set.
// This process's rank in its mpirun launch (from the launcher's
// environment, before MPI starts), or -1 outside one.
int LaunchRank();
bool LaunchedByMpi();

// MPI_Init and the world communicator; MPI_Finalize when it is destroyed.
// kRuntime when memplan was built without MPI. `timeout_s`: Recv's limit
// (MEMPLAN_COMM_TIMEOUT_S overrides it).
Expected<std::unique_ptr<Communicator>> MakeMpiCommunicator(double timeout_s = 120);

// Every rank's local outcome, agreed: the first failing rank's error (its
// message prefixed with "rank N: " unless every rank failed alike), else
// ok. A collective: every rank calls it, so every rank takes the same
// way out and none waits for a rank that already gave up.
Expected<std::monostate> Agree(Communicator& comm, const Expected<std::monostate>& local);

}  // namespace memplan::runtime
