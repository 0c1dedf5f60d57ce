// The communicator (runtime/comm.h): MPI when memplan was built with it
// (MEMPLAN_HAVE_MPI), and the agreement every rank reaches before work.
#include "memplan/runtime/comm.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstdio>
#include <mutex>
#include <condition_variable>
#include <deque>
#include <string>
#include <thread>

#include "memplan/common/check.h"
#include "memplan/common/cleanup.h"

#ifdef MEMPLAN_HAVE_MPI
#define OMPI_SKIP_MPICXX 1  // the C API only
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>
#endif

namespace memplan::runtime {

int LaunchRank() {
  for (const char* v : {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"}) {
    if (const char* r = std::getenv(v)) {
      char* end = nullptr;
      const long rank = std::strtol(r, &end, 10);
      if (end != r && *end == '\0' && rank >= 0) return static_cast<int>(rank);
    }
  }
  return -1;
}

bool LaunchedByMpi() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_SIZE"}) {
    if (std::getenv(v) != nullptr) return true;
  }
  return false;
}

Expected<std::monostate> Agree(Communicator& comm, const Expected<std::monostate>& local) {
  // "<code> <message>", or "0" for ok.
  std::string mine = local.ok() ? "0" : std::to_string(static_cast<int>(local.error().code)) + " " + local.error().message;
  std::vector<std::string> all = comm.AllGather(mine);
  // Said as it is where every rank failed alike (the same bad plan).
  const bool alike = std::all_of(all.begin(), all.end(), [&](const std::string& s) { return s == all.front(); });
  for (size_t r = 0; r < all.size(); ++r) {
    if (all[r] == "0") continue;
    size_t space = all[r].find(' ');
    Error e{static_cast<ErrorCode>(std::atoi(all[r].substr(0, space).c_str())),
            space == std::string::npos ? std::string() : all[r].substr(space + 1)};
    if (!alike) e.message = "rank " + std::to_string(r) + ": " + e.message;
    return e;
  }
  return std::monostate{};
}

#ifdef MEMPLAN_HAVE_MPI
namespace {

// MPI_COMM_WORLD. Sends are MPI_Isend with their bytes kept until MPI says
// they are delivered; receives poll (MPI_Iprobe) so that a missing peer is
// an error after the timeout, and so that an oversubscribed machine (more
// ranks than cores) is not spun on by every waiting rank.
class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(double timeout_s, MPI_Comm comm) : timeout_s_(timeout_s), comm_(comm) {
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    int flag = 0;
    int* ub = nullptr;
    MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &ub, &flag);
    max_tag_ = flag && ub ? *ub : 32767;
  }
  ~MpiCommunicator() override {
    for (auto& p : pending_) MPI_Wait(&p.request, MPI_STATUS_IGNORE);
    pending_.clear();
    if (finalize_) {
      MPI_Finalize();
    } else {
      MPI_Comm_free(&comm_);
    }
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string_view transport() const override { return "mpi"; }
  double timeout() const override { return timeout_s_; }
  int max_tag() const override { return max_tag_; }

  void Send(int to, int tag, std::vector<std::byte> bytes) override {
    MEMPLAN_CHECK(to >= 0 && to < size_ && to != rank_, "send to an invalid rank");
    MEMPLAN_CHECK(tag >= 0 && tag <= max_tag_, "message tag out of range");
    MEMPLAN_CHECK(bytes.size() <= static_cast<size_t>(INT32_MAX), "message over 2 GiB");
    pending_.push_back({MPI_REQUEST_NULL, std::move(bytes)});
    Pending& p = pending_.back();
    MPI_Isend(p.bytes.data(), static_cast<int>(p.bytes.size()), MPI_BYTE, to, tag, comm_, &p.request);
    Retire();
  }

  std::vector<std::byte> Recv(int from, int tag) override {
    MEMPLAN_CHECK(from >= 0 && from < size_ && from != rank_, "receive from an invalid rank");
    const auto start = std::chrono::steady_clock::now();
    auto nap = std::chrono::microseconds(1);
    MPI_Status status;
    for (;;) {
      int arrived = 0;
      MPI_Iprobe(from, tag, comm_, &arrived, &status);
      if (arrived) break;
      Retire();
      const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (waited > timeout_s_) {
        ThrowError(ErrorCode::kRuntime, "rank " + std::to_string(rank_) + " waited " +
                                            std::to_string(static_cast<int>(waited)) + " s for rank " +
                                            std::to_string(from) + " (message " + std::to_string(tag) +
                                            "): rank " + std::to_string(from) +
                                            " is lost or stuck (MEMPLAN_COMM_TIMEOUT_S sets the limit)");
      }
      std::this_thread::sleep_for(nap);
      nap = std::min(nap * 2, std::chrono::microseconds(1000));
    }
    int count = 0;
    MPI_Get_count(&status, MPI_BYTE, &count);
    std::vector<std::byte> bytes(static_cast<size_t>(count));
    MPI_Recv(bytes.data(), count, MPI_BYTE, from, tag, comm_, MPI_STATUS_IGNORE);
    return bytes;
  }

  std::vector<std::string> AllGather(const std::string& mine) override {
    int n = static_cast<int>(mine.size());
    std::vector<int> sizes(static_cast<size_t>(size_)), offsets(static_cast<size_t>(size_));
    MPI_Allgather(&n, 1, MPI_INT, sizes.data(), 1, MPI_INT, comm_);
    int64_t total = 0;
    for (int r = 0; r < size_; ++r) {
      offsets[static_cast<size_t>(r)] = static_cast<int>(total);
      total += sizes[static_cast<size_t>(r)];
    }
    MEMPLAN_CHECK(total <= INT32_MAX, "gathered data over 2 GiB");
    std::string all(static_cast<size_t>(total), '\0');
    MPI_Allgatherv(mine.data(), n, MPI_CHAR, all.data(), sizes.data(), offsets.data(), MPI_CHAR, comm_);
    std::vector<std::string> out;
    for (int r = 0; r < size_; ++r) {
      out.push_back(all.substr(static_cast<size_t>(offsets[static_cast<size_t>(r)]),
                               static_cast<size_t>(sizes[static_cast<size_t>(r)])));
    }
    return out;
  }

  void Barrier() override { MPI_Barrier(comm_); }

  std::unique_ptr<Communicator> Split(int color, int key) override {
    MPI_Comm sub;
    MPI_Comm_split(comm_, color, key, &sub);
    auto out = std::unique_ptr<MpiCommunicator>(new MpiCommunicator(timeout_s_, sub));
    out->finalize_ = false;
    return out;
  }

  void ReduceScatterSum(const float* in, float* out, int64_t block) override {
    MEMPLAN_CHECK(block >= 0 && block <= INT32_MAX, "reduce-scatter block over 2^31 elements");
    MPI_Reduce_scatter_block(in, out, static_cast<int>(block), MPI_FLOAT, MPI_SUM, comm_);
  }

  void AllReduceSum(float* data, int64_t n) override {
    MEMPLAN_CHECK(n >= 0 && n <= INT32_MAX, "all-reduce over 2^31 elements");
    MPI_Allreduce(MPI_IN_PLACE, data, static_cast<int>(n), MPI_FLOAT, MPI_SUM, comm_);
  }

  void AllGatherBlocks(const void* in, void* out, int64_t block) override {
    MEMPLAN_CHECK(block >= 0 && block <= INT32_MAX, "all-gather block over 2 GiB");
    MPI_Allgather(in, static_cast<int>(block), MPI_BYTE, out, static_cast<int>(block), MPI_BYTE, comm_);
  }

  [[noreturn]] void Abort(int code) override {
    // MPI_Abort runs no destructor: remove this process's staged outputs
    // first (the others get SIGTERM from mpirun, whose handler does it).
    RemoveCleanupPaths();
    MPI_Abort(MPI_COMM_WORLD, code);
    std::_Exit(code);
  }

 private:
  struct Pending {
    MPI_Request request;
    std::vector<std::byte> bytes;
  };
  // Drops the sends MPI has delivered (in order: the oldest first).
  void Retire() {
    while (!pending_.empty()) {
      int done = 0;
      MPI_Test(&pending_.front().request, &done, MPI_STATUS_IGNORE);
      if (!done) break;
      pending_.pop_front();
    }
  }

  double timeout_s_;
  MPI_Comm comm_;
  bool finalize_ = true;  // the world's: MPI_Finalize; a split: MPI_Comm_free
  int rank_ = 0, size_ = 1, max_tag_ = 32767;
  std::deque<Pending> pending_;
};

}  // namespace

Expected<std::unique_ptr<Communicator>> MakeMpiCommunicator(double timeout_s) {
  if (const char* env = std::getenv("MEMPLAN_COMM_TIMEOUT_S")) {
    char* end = nullptr;
    double v = std::strtod(env, &end);
    if (end == env || *end != '\0' || !(v > 0)) {
      return Error{ErrorCode::kBadInput, "MEMPLAN_COMM_TIMEOUT_S: expected a positive number of seconds, got \"" +
                                             std::string(env) + "\""};
    }
    timeout_s = v;
  }
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    // MPI's start-up waits for every process of the launch; one that exits
    // first (a usage error, another program) would hold this one there for
    // ever. A watchdog bounds it: MEMPLAN_COMM_TIMEOUT_S, or 120 s.
    const double bound = std::getenv("MEMPLAN_COMM_TIMEOUT_S") != nullptr ? timeout_s : std::min(timeout_s, 120.0);
    std::mutex m;
    std::condition_variable cv;
    bool started = false;
    std::thread watchdog([&] {
      std::unique_lock<std::mutex> lock(m);
      if (cv.wait_for(lock, std::chrono::duration<double>(bound), [&] { return started; })) return;
      std::fprintf(stderr,
                   "memplan: rank %d: MPI start-up did not finish within %.0f s: another process of this launch "
                   "exited before starting MPI (see its message) or is not memplan (MEMPLAN_COMM_TIMEOUT_S sets "
                   "the bound)\n",
                   LaunchRank(), bound);
      std::fflush(stderr);
      std::_Exit(static_cast<int>(ErrorCode::kRuntime));
    });
    int provided = 0;
    // Only the main thread calls MPI (copy engines never do).
    const int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided);
    {
      std::lock_guard<std::mutex> lock(m);
      started = true;
    }
    cv.notify_all();
    watchdog.join();
    if (rc != MPI_SUCCESS) return Error{ErrorCode::kRuntime, "MPI_Init_thread failed"};
  }
  return std::unique_ptr<Communicator>(new MpiCommunicator(timeout_s, MPI_COMM_WORLD));
}

#else

Expected<std::unique_ptr<Communicator>> MakeMpiCommunicator(double) {
  return Error{ErrorCode::kRuntime,
               "launched by mpirun, but this memplan was built without MPI (install libopenmpi-dev and reconfigure)"};
}

#endif

}  // namespace memplan::runtime
