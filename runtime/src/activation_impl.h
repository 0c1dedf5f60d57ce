// Private to runtime/: the activation manager's state (activation.cc,
// activation_eager.cc).
#pragma once

#include "memplan/runtime/activation.h"

namespace memplan::runtime {

using planner::Interval;
using planner::IntervalPart;
using planner::ProgramBuffer;
using planner::Storage;

// Where an instance's bytes are at each moment.
struct ActivationManager::Instance {
  Buffer full, compact, moved, fetched, restored, extra;  // on the owner rank
  Buffer landed;                                          // on the remote target
  Buffer host;                                            // in the owner's host arena
  Event out_event, in_event;
  std::vector<std::byte> wire;  // a remote payload between the ranks' buffers
  bool on_wire = false;
  bool landed_valid = false;
  bool fetch_issued = false;
  uint8_t parts = 0;  // bit per IntervalPart the owner holds
  bool Has(IntervalPart p) const { return (parts >> static_cast<int>(p)) & 1; }
};

struct ActivationManager::EagerBuffer {
  Buffer buf;
  std::vector<Event> fences;  // copies reading or writing it
};

struct ActivationManager::Rank {
  int32_t index = 0;
  RankMemory mem;
  std::vector<Instance> instances;
  std::unique_ptr<planner::ProgramWalker> walker;
  std::vector<ProgramBuffer> allocations;  // of the current step
  std::unordered_map<int64_t, Buffer> interval_buf;              // interval -> buffer
  std::unordered_map<int64_t, std::vector<Buffer>> block_bufs;  // block -> per list entry
  std::unordered_map<int32_t, Buffer> cross_bufs;                // cross buffer index -> buffer
  std::map<std::string, int64_t> events;
  std::vector<CopyRecord> copies;
  // Eager (activation_eager.cc): live buffers by identity, the measured
  // pass's frees by step, frees waiting for copies, what happened.
  std::map<EagerKey, EagerBuffer> eager;
  std::map<int64_t, std::vector<EagerKey>> frees_at;
  std::vector<EagerKey> deferred;
  std::vector<AllocationEvent> allocation_events;
  std::vector<EagerKey> op_keys;  // eager buffers handed out since the last AfterOp
};

}  // namespace memplan::runtime
