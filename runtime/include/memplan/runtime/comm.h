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

// Whether this process was started by an MPI launcher (mpirun, srun with
// PMIx): OpenMPI's, PMIx's or PMI's rank variables are set.
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
