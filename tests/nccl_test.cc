// The NCCL device communicator (runtime/comm.h, runtime/src/nccl_comm.cc):
// a communicator of one rank on this process's GPU, bootstrapped the way
// mpirun's ranks bootstrap theirs (rank 0's unique id through the MPI
// communicator; here a one-rank stand-in). More ranks need more GPUs and
// mpirun: scripts/gpu-run-check runs them where the machine has them.
// Needs a GPU: exits 77 (skip) without one.
#define DOCTEST_CONFIG_IMPLEMENT
#include <cuda_runtime_api.h>
#include <doctest/doctest.h>

#include <cstring>
#include <numeric>
#include <vector>

#include "kernels/gpu_test_main.h"
#include "memplan/runtime/comm.h"

using namespace memplan;
using namespace memplan::runtime;

namespace {

// One rank, no transport: what a bootstrap needs of a Communicator.
class OneRank final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string_view transport() const override { return "self"; }
  double timeout() const override { return 1; }
  int max_tag() const override { return 0; }
  void Send(int, int, std::vector<std::byte>) override { FAIL("a one-rank bootstrap sends nothing"); }
  std::vector<std::byte> Recv(int, int) override { FAIL("a one-rank bootstrap receives nothing"); return {}; }
  std::vector<std::string> AllGather(const std::string& mine) override {
    ++gathers;
    return {mine};
  }
  void Barrier() override {}
  std::unique_ptr<Communicator> Split(int, int) override { return std::make_unique<OneRank>(); }
  void ReduceScatterSum(const float* in, float* out, int64_t block) override { std::memcpy(out, in, block * 4); }
  void AllReduceSum(float*, int64_t) override {}
  void AllGatherBlocks(const void* in, void* out, int64_t block) override { std::memcpy(out, in, block); }
  [[noreturn]] void Abort(int code) override { std::_Exit(code); }
  int gathers = 0;
};

std::vector<float> Iota(int64_t n) {
  std::vector<float> v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), 1.f);
  return v;
}

}  // namespace

TEST_CASE("nccl: a one-rank communicator reduces and gathers in place on the device") {
  OneRank bootstrap;
  auto made = MakeNcclCommunicator(bootstrap);
  REQUIRE_MESSAGE(made.ok(), (made.ok() ? "" : made.error().message));
  DeviceCommunicator& nccl = **made;
  CHECK(bootstrap.gathers == 1);  // the unique id went through the bootstrap
  CHECK(nccl.rank() == 0);
  CHECK(nccl.size() == 1);
  CHECK(nccl.transport() == "nccl");

  cudaStream_t stream = nullptr;
  REQUIRE(cudaStreamCreate(&stream) == cudaSuccess);
  const int64_t n = 1000003;  // odd: ranges of ceil(n / size)
  float* d = nullptr;
  REQUIRE(cudaMalloc(reinterpret_cast<void**>(&d), n * 4) == cudaSuccess);
  std::vector<float> want = Iota(n), got(static_cast<size_t>(n));
  int checked = 0;
  auto run = [&](auto&& op) {
    REQUIRE(cudaMemcpy(d, want.data(), n * 4, cudaMemcpyHostToDevice) == cudaSuccess);
    op();
    nccl.Synchronize(stream);
    REQUIRE(cudaMemcpy(got.data(), d, n * 4, cudaMemcpyDeviceToHost) == cudaSuccess);
    CHECK(got == want);  // one rank: the sum of one copy is the copy
    ++checked;
  };
  run([&] { nccl.AllReduceSum(d, n, stream); });
  run([&] { nccl.ReduceRanges(d, n, stream); });
  run([&] { nccl.GatherRanges(d, n, 4, stream); });
  run([&] { nccl.GatherRanges(d, 2 * n, 2, stream); });  // bf16 weights: 2-byte elements
  CHECK(checked == 4);
  cudaFree(d);
  cudaStreamDestroy(stream);
}
