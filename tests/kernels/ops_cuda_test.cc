// The CUDA Ops (MakeCudaOps) vs the CPU reference ops (MakeRefOps), op by op:
// random non-zero inputs, the same inputs through both backends, fp32
// results within a relative bound, dropout masks, top-k indices and dispatch
// plans exactly equal. Shapes cover the vector (float4) and scalar paths,
// misaligned pointers, tails, and every scratch/shared-memory branch of the
// kernels. Exits 77 (Meson: skipped) when no CUDA device is visible.
#define DOCTEST_CONFIG_IMPLEMENT
#include "memplan/kernels/ops_cuda.h"

#include <cuda_runtime_api.h>
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "memplan/kernels/ops.h"
#include "memplan/common/workspace.h"

namespace mk = memplan::kernels;

namespace {

// Relative bounds: elementwise ops differ from the reference by a few ulps
// of libm vs CUDA math; reductions and GEMMs also by summation order.
constexpr double kElementwiseTol = 1e-5;
constexpr double kReductionTol = 1e-4;

// One stream and both backends for the whole run.
struct Env {
  cudaStream_t stream = nullptr;
  std::unique_ptr<mk::Ops> cuda;
  std::unique_ptr<mk::Ops> ref = mk::MakeRefOps();

  Env() {
    cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    cuda = mk::MakeCudaOps(stream);
  }
  ~Env() {
    cuda.reset();  // before its stream goes
    cudaStreamDestroy(stream);
  }
  void Sync() const { REQUIRE(cudaStreamSynchronize(stream) == cudaSuccess); }
};

Env& GetEnv() {
  static Env env;
  return env;
}

// A device copy of a host vector (test-only; the ops never allocate). With
// `misalign`, the data starts 4 bytes into the allocation, so float4 paths
// must fall back to scalar code.
template <typename T>
class DeviceArray {
 public:
  // Both constructors end with a device synchronization: cudaMemcpy from
  // pageable memory may return before its DMA lands and cudaMemset is
  // asynchronous, both on the legacy stream, which the ops' non-blocking
  // stream does not wait for.
  explicit DeviceArray(const std::vector<T>& host, bool misalign = false) : DeviceArray(host.size(), misalign) {
    if (!host.empty()) {
      REQUIRE(cudaMemcpy(data_, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice) == cudaSuccess);
      REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
    }
  }
  // Filled with 0xFF bytes (NaN for floats), so unwritten outputs show.
  explicit DeviceArray(size_t count, bool misalign = false) : count_(count) {
    const size_t pad = misalign ? 4 : 0;
    REQUIRE(cudaMalloc(&base_, count * sizeof(T) + pad + 16) == cudaSuccess);
    REQUIRE(cudaMemset(base_, 0xFF, count * sizeof(T) + pad + 16) == cudaSuccess);
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
    data_ = reinterpret_cast<T*>(static_cast<char*>(base_) + pad);
  }
  ~DeviceArray() { cudaFree(base_); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;

  T* get() const { return data_; }
  std::vector<T> ToHost() const {
    GetEnv().Sync();
    std::vector<T> host(count_);
    if (count_ > 0) {
      REQUIRE(cudaMemcpy(host.data(), data_, count_ * sizeof(T), cudaMemcpyDeviceToHost) == cudaSuccess);
    }
    return host;
  }

 private:
  void* base_ = nullptr;
  T* data_ = nullptr;
  size_t count_ = 0;
};

using DevF = DeviceArray<float>;
using DevI = DeviceArray<int32_t>;

// Uniform in +-[lo, hi]: never zero.
std::vector<float> Random(size_t count, uint32_t seed, float lo = 0.05f, float hi = 1.f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> mag(lo, hi);
  std::bernoulli_distribution neg(0.5);
  std::vector<float> v(count);
  for (float& x : v) x = neg(rng) ? -mag(rng) : mag(rng);
  return v;
}

std::vector<float> Normal(size_t count, uint32_t seed, float sigma) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.f, sigma);
  std::vector<float> v(count);
  for (float& x : v) x = dist(rng);
  return v;
}

// got[i] must be within tol * max(|want[i]|, rms(want)) of want[i]: the RMS
// floor judges entries that cancel to near zero against the array's scale.
void ExpectNear(const std::vector<float>& got, const std::vector<float>& want, double tol, const std::string& what) {
  REQUIRE(got.size() == want.size());
  double sq = 0;
  for (float w : want) sq += static_cast<double>(w) * w;
  const double rms = want.empty() ? 0 : std::sqrt(sq / static_cast<double>(want.size()));
  size_t bad = 0, first = 0;
  double worst = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double err = std::fabs(static_cast<double>(got[i]) - want[i]);
    // A reference this small is the rounding residue of a cancellation
    // (e.g. the input gradient of a one-column norm, exactly 0 in real
    // arithmetic): a contracted multiply-add leaves a different residue.
    const double bound = tol * std::max(std::fabs(static_cast<double>(want[i])), rms) + (rms < 1e-4 ? 1e-5 : 0);
    if (!(err <= bound)) {  // NaN fails too
      if (bad++ == 0) first = i;
      worst = std::max(worst, bound > 0 ? err / bound : err);
    }
  }
  std::ostringstream msg;
  if (bad > 0) {
    msg << what << ": " << bad << " of " << want.size() << " off; first [" << first << "] got " << got[first]
        << " want " << want[first] << "; worst " << worst << " x the bound";
  }
  CHECK_MESSAGE(bad == 0, msg.str());
}

template <typename T>
void ExpectEqual(const std::vector<T>& got, const std::vector<T>& want, const std::string& what) {
  REQUIRE(got.size() == want.size());
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0) {
      if (bad++ == 0) first = i;
    }
  }
  std::ostringstream msg;
  if (bad > 0) {
    msg << what << ": " << bad << " of " << want.size() << " differ; first [" << first << "] got " << +got[first]
        << " want " << +want[first];
  }
  CHECK_MESSAGE(bad == 0, msg.str());
}

std::string Shape(int64_t a, int64_t b) { return "[" + std::to_string(a) + "x" + std::to_string(b) + "]"; }

// Distinct experts per token, in random order (a valid top-k result).
std::vector<int32_t> RandomTopk(int64_t tokens, int64_t top_k, int64_t experts, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> perm(static_cast<size_t>(experts));
  std::vector<int32_t> idx;
  for (int64_t t = 0; t < tokens; ++t) {
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    idx.insert(idx.end(), perm.begin(), perm.begin() + top_k);
  }
  return idx;
}

}  // namespace

// Sizes and random q, k, v, dO of one attention shape (seeds seed..seed+3).
struct AttentionInputs {
  size_t nq, nk, nv, no, np, nl;
  std::vector<float> q, k, v, d_o;
  AttentionInputs(const mk::AttentionShape& sh, uint32_t seed)
      : nq(static_cast<size_t>(sh.b * sh.heads * sh.s * sh.dqk)),
        nk(static_cast<size_t>(sh.b * sh.kv_heads * sh.s * sh.dqk)),
        nv(static_cast<size_t>(sh.b * sh.kv_heads * sh.s * sh.dv)),
        no(static_cast<size_t>(sh.b * sh.heads * sh.s * sh.dv)),
        np(static_cast<size_t>(sh.b * sh.heads * sh.s * sh.s)),
        nl(static_cast<size_t>(sh.b * sh.heads * sh.s)),
        q(Random(nq, seed)),
        k(Random(nk, seed + 1)),
        v(Random(nv, seed + 2)),
        d_o(Random(no, seed + 3)) {}
};

TEST_CASE("device and backends") {
  CHECK(mk::CudaDeviceAvailable());
  REQUIRE(GetEnv().cuda != nullptr);
}

TEST_CASE("Gemm: every transpose, beta 0 and 1, with and without workspace") {
  Env& env = GetEnv();
  DeviceArray<char> workspace(static_cast<size_t>(mk::GemmWorkspaceBytes()));
  struct Dims {
    int64_t m, n, k;
  };
  uint32_t seed = 1;
  for (const Dims dims : {Dims{37, 53, 29}, Dims{256, 192, 320}, Dims{1, 7, 1}, Dims{64, 8, 0}}) {
    for (int trans = 0; trans < 4; ++trans) {
      for (const float beta : {0.f, 0.5f}) {
        for (const bool use_ws : {false, true}) {
          const bool ta = trans & 1, tb = trans & 2;
          const auto a = Random(static_cast<size_t>(dims.m * dims.k), ++seed);
          const auto b = Random(static_cast<size_t>(dims.k * dims.n), ++seed);
          // With beta == 0, C must not be read: start it at NaN.
          auto c = beta == 0.f ? std::vector<float>(static_cast<size_t>(dims.m * dims.n),
                                                    std::numeric_limits<float>::quiet_NaN())
                               : Random(static_cast<size_t>(dims.m * dims.n), ++seed);
          DevF da(a), db(b), dc(c);
          env.cuda->Gemm(ta, tb, dims.m, dims.n, dims.k, 0.75f, da.get(), db.get(), beta, dc.get(),
                         use_ws ? workspace.get() : nullptr);
          env.ref->Gemm(ta, tb, dims.m, dims.n, dims.k, 0.75f, a.data(), b.data(), beta, c.data(), nullptr);
          ExpectNear(dc.ToHost(), c, kReductionTol,
                     "gemm m" + std::to_string(dims.m) + " n" + std::to_string(dims.n) + " k" + std::to_string(dims.k) +
                         " ta" + std::to_string(ta) + " tb" + std::to_string(tb) + " beta" + std::to_string(beta) +
                         " ws" + std::to_string(use_ws));
        }
      }
    }
  }
}

TEST_CASE("GroupedGemm and GroupedGemmBwd, with an empty expert") {
  Env& env = GetEnv();
  const std::vector<int64_t> offsets = {0, 7, 7, 30, 31, 50};  // expert 1 has no rows
  const int64_t experts = 5, k = 24, n = 40, tokens = offsets.back();
  const auto x = Random(static_cast<size_t>(tokens * k), 11);
  const auto w = Random(static_cast<size_t>(experts * k * n), 12);
  const auto dy = Random(static_cast<size_t>(tokens * n), 13);
  auto dw = Random(static_cast<size_t>(experts * k * n), 14);  // accumulated into
  std::vector<float> y(static_cast<size_t>(tokens * n)), dx(static_cast<size_t>(tokens * k));
  DevF d_x(x), d_w(w), d_dy(dy), d_dw(dw), d_y(y.size()), d_dx(dx.size());
  DeviceArray<char> workspace(static_cast<size_t>(mk::GemmWorkspaceBytes()));

  env.cuda->GroupedGemm(offsets.data(), experts, k, n, d_x.get(), d_w.get(), d_y.get(), workspace.get());
  env.ref->GroupedGemm(offsets.data(), experts, k, n, x.data(), w.data(), y.data(), nullptr);
  ExpectNear(d_y.ToHost(), y, kReductionTol, "grouped gemm y");

  env.cuda->GroupedGemmBwd(offsets.data(), experts, k, n, d_x.get(), d_w.get(), d_dy.get(), d_dx.get(), d_dw.get(),
                           nullptr);
  env.ref->GroupedGemmBwd(offsets.data(), experts, k, n, x.data(), w.data(), dy.data(), dx.data(), dw.data(), nullptr);
  ExpectNear(d_dx.ToHost(), dx, kReductionTol, "grouped gemm dx");
  ExpectNear(d_dw.ToHost(), dw, kReductionTol, "grouped gemm dw");
}

TEST_CASE("LayerNorm and RMSNorm forward and backward") {
  Env& env = GetEnv();
  struct Case {
    int64_t rows, cols;
    bool misalign;
  };
  // Register-cached and plain forwards, one-row (direct) and partial-row
  // backwards, shared-memory partials with and without opt-in, and the
  // global-memory partials (LayerNorm 4 x 40000 needs 320 KB).
  const Case cases[] = {{1, 7, false},     {2, 1, false},      {3, 5, false},     {64, 1024, false},
                        {37, 130, false},  {300, 4096, false}, {16, 8192, false}, {8, 12288, false},
                        {4, 40000, false}, {64, 1024, true},   {1, 4096, false},  {1000, 768, false}};
  uint32_t seed = 100;
  for (const Case& cs : cases) {
    const std::string shape = Shape(cs.rows, cs.cols) + (cs.misalign ? " misaligned" : "");
    const size_t n = static_cast<size_t>(cs.rows * cs.cols);
    const size_t cols = static_cast<size_t>(cs.cols);
    // An offset mean, so the two-pass variance matters.
    auto x = Random(n, ++seed);
    for (float& v : x) v += 0.5f;
    const auto gamma = Random(cols, ++seed, 0.5f, 1.5f);
    const auto beta = Random(cols, ++seed);
    const auto dy = Random(n, ++seed);
    const auto dgamma0 = Random(cols, ++seed);
    const auto dbeta0 = Random(cols, ++seed);
    DevF d_x(x, cs.misalign), d_gamma(gamma, cs.misalign), d_beta(beta, cs.misalign), d_dy(dy, cs.misalign);
    DevF d_y(n, cs.misalign), d_dx(n, cs.misalign);
    const float eps = 1e-5f;

    for (const bool ln : {true, false}) {
      const std::string what = std::string(ln ? "layernorm " : "rmsnorm ") + shape;
      std::vector<float> y(n), dx(n), dgamma = dgamma0, dbeta = dbeta0;
      DevF d_dgamma(dgamma0, cs.misalign), d_dbeta(dbeta0, cs.misalign);
      if (ln) {
        env.cuda->LayerNormFwd(d_x.get(), d_gamma.get(), d_beta.get(), cs.rows, cs.cols, eps, d_y.get());
        env.ref->LayerNormFwd(x.data(), gamma.data(), beta.data(), cs.rows, cs.cols, eps, y.data());
        env.cuda->LayerNormBwd(d_x.get(), d_gamma.get(), d_dy.get(), cs.rows, cs.cols, eps, d_dx.get(), d_dgamma.get(),
                               d_dbeta.get());
        env.ref->LayerNormBwd(x.data(), gamma.data(), dy.data(), cs.rows, cs.cols, eps, dx.data(), dgamma.data(),
                              dbeta.data());
      } else {
        env.cuda->RmsNormFwd(d_x.get(), d_gamma.get(), cs.rows, cs.cols, eps, d_y.get());
        env.ref->RmsNormFwd(x.data(), gamma.data(), cs.rows, cs.cols, eps, y.data());
        env.cuda->RmsNormBwd(d_x.get(), d_gamma.get(), d_dy.get(), cs.rows, cs.cols, eps, d_dx.get(), d_dgamma.get());
        env.ref->RmsNormBwd(x.data(), gamma.data(), dy.data(), cs.rows, cs.cols, eps, dx.data(), dgamma.data());
      }
      ExpectNear(d_y.ToHost(), y, kElementwiseTol, what + " y");
      ExpectNear(d_dx.ToHost(), dx, kReductionTol, what + " dx");
      const auto got_dgamma = d_dgamma.ToHost();
      ExpectNear(got_dgamma, dgamma, kReductionTol, what + " dgamma");
      if (ln) ExpectNear(d_dbeta.ToHost(), dbeta, kReductionTol, what + " dbeta");

      // The weight-gradient sums are in a fixed order: a second run from the
      // same start gives the same bits.
      DevF d_dgamma2(dgamma0, cs.misalign), d_dbeta2(dbeta0, cs.misalign);
      if (ln) {
        env.cuda->LayerNormBwd(d_x.get(), d_gamma.get(), d_dy.get(), cs.rows, cs.cols, eps, d_dx.get(), d_dgamma2.get(),
                               d_dbeta2.get());
      } else {
        env.cuda->RmsNormBwd(d_x.get(), d_gamma.get(), d_dy.get(), cs.rows, cs.cols, eps, d_dx.get(), d_dgamma2.get());
      }
      ExpectEqual(d_dgamma2.ToHost(), got_dgamma, what + " dgamma rerun");
    }
  }
}

TEST_CASE("GELU, SwiGLU, dropout and add") {
  Env& env = GetEnv();
  for (const bool misalign : {false, true}) {
    for (const int64_t n : {int64_t{1}, int64_t{3}, int64_t{1000003}}) {
      const std::string what = "n=" + std::to_string(n) + (misalign ? " misaligned" : "");
      const size_t un = static_cast<size_t>(n);
      const auto x = Random(un, 200, 0.01f, 3.f);
      const auto b = Random(un, 201);
      const auto dy = Random(un, 202);
      DevF d_x(x, misalign), d_b(b, misalign), d_dy(dy, misalign), d_y(un, misalign);
      std::vector<float> y(un);

      env.cuda->GeluFwd(d_x.get(), n, d_y.get());
      env.ref->GeluFwd(x.data(), n, y.data());
      ExpectNear(d_y.ToHost(), y, kElementwiseTol, "gelu fwd " + what);
      env.cuda->GeluBwd(d_x.get(), d_dy.get(), n, d_y.get());
      env.ref->GeluBwd(x.data(), dy.data(), n, y.data());
      ExpectNear(d_y.ToHost(), y, kElementwiseTol, "gelu bwd " + what);

      env.cuda->Add(d_x.get(), d_b.get(), n, d_y.get());
      env.ref->Add(x.data(), b.data(), n, y.data());
      ExpectEqual(d_y.ToHost(), y, "add " + what);

      for (const float p : {0.f, 0.1f, 0.5f, 1.f}) {
        const std::string dwhat = "dropout p=" + std::to_string(p) + " " + what;
        const uint64_t seed = 0x1234'5678'9ABC'DEF0ull, offset = 98765;
        DeviceArray<uint8_t> d_mask(un, misalign);
        std::vector<uint8_t> mask(un);
        env.cuda->DropoutFwd(d_x.get(), n, p, seed, offset, d_y.get(), d_mask.get());
        env.ref->DropoutFwd(x.data(), n, p, seed, offset, y.data(), mask.data());
        ExpectEqual(d_mask.ToHost(), mask, dwhat + " mask");
        ExpectEqual(d_y.ToHost(), y, dwhat + " y");
        env.cuda->DropoutBwd(d_dy.get(), d_mask.get(), n, p, d_y.get());
        env.ref->DropoutBwd(dy.data(), mask.data(), n, p, y.data());
        ExpectEqual(d_y.ToHost(), y, dwhat + " bwd");
        // A slice of a larger tensor (tensor and context parallelism): its
        // element indices start at `first`.
        env.cuda->DropoutFwd(d_x.get(), n, p, seed, offset, d_y.get(), d_mask.get(), 12345);
        env.ref->DropoutFwd(x.data(), n, p, seed, offset, y.data(), mask.data(), 12345);
        ExpectEqual(d_mask.ToHost(), mask, dwhat + " mask from 12345");
      }
    }

    for (const int64_t f : {int64_t{100}, int64_t{37}, int64_t{1}}) {
      const int64_t rows = 33;
      const std::string what = Shape(rows, f) + (misalign ? " misaligned" : "");
      const auto x = Random(static_cast<size_t>(rows * 2 * f), 210, 0.01f, 4.f);
      const auto dy = Random(static_cast<size_t>(rows * f), 211);
      DevF d_x(x, misalign), d_dy(dy, misalign), d_y(dy.size(), misalign), d_dx(x.size(), misalign);
      std::vector<float> y(dy.size()), dx(x.size());
      env.cuda->SwigluFwd(d_x.get(), rows, f, d_y.get());
      env.ref->SwigluFwd(x.data(), rows, f, y.data());
      ExpectNear(d_y.ToHost(), y, kElementwiseTol, "swiglu fwd " + what);
      env.cuda->SwigluBwd(d_x.get(), d_dy.get(), rows, f, d_dx.get());
      env.ref->SwigluBwd(x.data(), dy.data(), rows, f, dx.data());
      ExpectNear(d_dx.ToHost(), dx, kElementwiseTol, "swiglu bwd " + what);
    }
  }
}

TEST_CASE("Router forward and backward") {
  Env& env = GetEnv();
  struct Case {
    int64_t tokens, experts, top_k;
  };
  uint32_t seed = 300;
  for (const Case cs : {Case{77, 64, 6}, Case{40, 256, 8}, Case{9, 5, 5}, Case{3, 1, 1}}) {
    const size_t n = static_cast<size_t>(cs.tokens * cs.experts);
    const size_t nk = static_cast<size_t>(cs.tokens * cs.top_k);
    auto logits = Normal(n, ++seed, 2.f);
    // Exact ties: token 0 all equal, token 1 in equal pairs (expect the lower
    // index first on both backends).
    std::fill(logits.begin(), logits.begin() + cs.experts, 0.25f);
    if (cs.tokens > 1) {
      for (int64_t e = 1; e < cs.experts; e += 2) logits[cs.experts + e] = logits[cs.experts + e - 1];
    }
    const auto d_topk = Random(nk, ++seed);
    DevF d_logits(logits), d_dtopk(d_topk);
    for (const bool sigmoid : {false, true}) {
      for (const bool renormalize : {false, true}) {
        const std::string what = "router E=" + std::to_string(cs.experts) + " k=" + std::to_string(cs.top_k) +
                                 (sigmoid ? " sigmoid" : " softmax") + (renormalize ? " renorm" : "");
        DevF d_probs(n), d_weights(nk), d_dlogits(n);
        DevI d_idx(nk);
        std::vector<float> probs(n), weights(nk), dlogits(n);
        std::vector<int32_t> idx(nk);
        env.cuda->RouterFwd(d_logits.get(), cs.tokens, cs.experts, cs.top_k, sigmoid, renormalize, d_probs.get(),
                            d_idx.get(), d_weights.get());
        env.ref->RouterFwd(logits.data(), cs.tokens, cs.experts, cs.top_k, sigmoid, renormalize, probs.data(),
                           idx.data(), weights.data());
        ExpectNear(d_probs.ToHost(), probs, kElementwiseTol, what + " probs");
        ExpectEqual(d_idx.ToHost(), idx, what + " topk_idx");
        ExpectNear(d_weights.ToHost(), weights, kElementwiseTol, what + " weights");

        // Backward from the reference's forward, so only the backward differs.
        DevF r_probs(probs), r_weights(weights);
        DevI r_idx(idx);
        env.cuda->RouterBwd(r_probs.get(), r_idx.get(), r_weights.get(), d_dtopk.get(), cs.tokens, cs.experts, cs.top_k,
                            sigmoid, renormalize, d_dlogits.get());
        env.ref->RouterBwd(probs.data(), idx.data(), weights.data(), d_topk.data(), cs.tokens, cs.experts, cs.top_k,
                           sigmoid, renormalize, dlogits.data());
        ExpectNear(d_dlogits.ToHost(), dlogits, kReductionTol, what + " dlogits");
      }
    }
  }
}

TEST_CASE("DispatchPlan: stable order and host offsets, beyond one staging window") {
  Env& env = GetEnv();
  struct Case {
    int64_t tokens, top_k, experts;
  };
  uint32_t seed = 400;
  for (const Case cs : {Case{123, 4, 16}, Case{1000, 8, 64}, Case{50, 2, 1500}, Case{0, 2, 3}, Case{7, 1, 1}}) {
    const std::string what = "dispatch plan T=" + std::to_string(cs.tokens) + " k=" + std::to_string(cs.top_k) +
                             " E=" + std::to_string(cs.experts);
    const auto topk = RandomTopk(cs.tokens, cs.top_k, cs.experts, ++seed);
    DevI d_topk(topk), d_slot(topk.size());
    std::vector<int32_t> slot(topk.size());
    std::vector<int64_t> offsets(static_cast<size_t>(cs.experts + 1), -1), d_offsets(offsets);
    env.cuda->DispatchPlan(d_topk.get(), cs.tokens, cs.top_k, cs.experts, d_slot.get(), d_offsets.data());
    env.ref->DispatchPlan(topk.data(), cs.tokens, cs.top_k, cs.experts, slot.data(), offsets.data());
    ExpectEqual(d_offsets, offsets, what + " offsets");
    ExpectEqual(d_slot.ToHost(), slot, what + " slot_of");
  }
}

TEST_CASE("Dispatch, combine and the router-gradient rewrite") {
  Env& env = GetEnv();
  struct Case {
    int64_t tokens, top_k, experts, d;
    bool misalign;
  };
  // d = 3 < top_k = 4 takes the atomic fallback of DispatchBwd/CombineFwd.
  uint32_t seed = 500;
  for (const Case cs : {Case{123, 4, 16, 64, false}, Case{57, 2, 8, 130, false}, Case{57, 2, 8, 128, true},
                        Case{31, 4, 6, 3, false}, Case{5, 1, 2, 8, false}}) {
    const std::string what = "T=" + std::to_string(cs.tokens) + " k=" + std::to_string(cs.top_k) +
                             " d=" + std::to_string(cs.d) + (cs.misalign ? " misaligned" : "");
    const size_t nk = static_cast<size_t>(cs.tokens * cs.top_k);
    const size_t td = static_cast<size_t>(cs.tokens * cs.d);
    const size_t kd = nk * static_cast<size_t>(cs.d);
    const auto topk = RandomTopk(cs.tokens, cs.top_k, cs.experts, ++seed);
    std::vector<int32_t> slot(nk);
    std::vector<int64_t> offsets(static_cast<size_t>(cs.experts + 1));
    env.ref->DispatchPlan(topk.data(), cs.tokens, cs.top_k, cs.experts, slot.data(), offsets.data());
    const auto x = Random(td, ++seed);
    const auto rows = Random(kd, ++seed);
    const auto weights = Random(nk, ++seed, 0.05f, 1.f);
    const auto dout = Random(td, ++seed);
    const auto act = Random(kd, ++seed);
    DevI d_slot(slot);
    DevF d_x(x, cs.misalign), d_rows(rows, cs.misalign), d_weights(weights), d_dout(dout, cs.misalign),
        d_act(act, cs.misalign);

    DevF d_sorted(kd, cs.misalign), d_out(td, cs.misalign);
    std::vector<float> sorted(kd), out(td);
    env.cuda->DispatchFwd(d_x.get(), d_slot.get(), cs.tokens, cs.top_k, cs.d, d_sorted.get());
    env.ref->DispatchFwd(x.data(), slot.data(), cs.tokens, cs.top_k, cs.d, sorted.data());
    ExpectEqual(d_sorted.ToHost(), sorted, "dispatch fwd " + what);

    env.cuda->DispatchBwd(d_rows.get(), d_slot.get(), cs.tokens, cs.top_k, cs.d, d_out.get());
    env.ref->DispatchBwd(rows.data(), slot.data(), cs.tokens, cs.top_k, cs.d, out.data());
    ExpectNear(d_out.ToHost(), out, kElementwiseTol, "dispatch bwd " + what);

    env.cuda->CombineFwd(d_rows.get(), d_slot.get(), d_weights.get(), cs.tokens, cs.top_k, cs.d, d_out.get());
    env.ref->CombineFwd(rows.data(), slot.data(), weights.data(), cs.tokens, cs.top_k, cs.d, out.data());
    ExpectNear(d_out.ToHost(), out, kElementwiseTol, "combine fwd " + what);

    for (const bool with_y : {true, false}) {
      // Without y_sorted, d_topk_weights must be left alone.
      const auto sentinel = Random(nk, ++seed);
      std::vector<float> dtopk = sentinel;
      DevF d_dtopk(sentinel);
      env.cuda->CombineBwd(d_dout.get(), d_slot.get(), d_weights.get(), with_y ? d_rows.get() : nullptr, cs.tokens,
                           cs.top_k, cs.d, d_sorted.get(), d_dtopk.get());
      env.ref->CombineBwd(dout.data(), slot.data(), weights.data(), with_y ? rows.data() : nullptr, cs.tokens, cs.top_k,
                          cs.d, sorted.data(), dtopk.data());
      const std::string cwhat = "combine bwd " + what + (with_y ? " with y" : " without y");
      ExpectEqual(d_sorted.ToHost(), sorted, cwhat + " dy_sorted");
      ExpectNear(d_dtopk.ToHost(), dtopk, kReductionTol, cwhat + " d_topk_weights");
    }

    DevF d_dtopk(nk);
    std::vector<float> dtopk(nk);
    env.cuda->RouterGradRewrite(d_rows.get(), d_act.get(), d_slot.get(), nullptr, cs.tokens, cs.top_k, cs.d,
                                d_dtopk.get());
    env.ref->RouterGradRewrite(rows.data(), act.data(), slot.data(), nullptr, cs.tokens, cs.top_k, cs.d, dtopk.data());
    ExpectNear(d_dtopk.ToHost(), dtopk, kReductionTol, "router grad rewrite " + what);
    env.cuda->RouterGradRewrite(d_rows.get(), d_act.get(), d_slot.get(), d_weights.get(), cs.tokens, cs.top_k, cs.d,
                                d_dtopk.get());
    env.ref->RouterGradRewrite(rows.data(), act.data(), slot.data(), weights.data(), cs.tokens, cs.top_k, cs.d,
                               dtopk.data());
    ExpectNear(d_dtopk.ToHost(), dtopk, kReductionTol, "weighted router grad rewrite " + what);
  }
}

TEST_CASE("CrossEntropy forward and backward") {
  Env& env = GetEnv();
  uint32_t seed = 600;
  for (const int64_t vocab : {int64_t{4096}, int64_t{50257}, int64_t{3}}) {
    const int64_t tokens = 19;
    const std::string what = "cross entropy " + Shape(tokens, vocab);
    const size_t n = static_cast<size_t>(tokens * vocab);
    const auto logits = Normal(n, ++seed, 3.f);
    std::vector<int32_t> targets(static_cast<size_t>(tokens));
    std::mt19937 rng(++seed);
    for (auto& t : targets) t = static_cast<int32_t>(rng() % static_cast<uint32_t>(vocab));
    targets[0] = 0;
    targets[1] = static_cast<int32_t>(vocab - 1);
    DevF d_logits(logits), d_probs(n), d_loss(targets.size()), d_dlogits(n);
    DevI d_targets(targets);
    std::vector<float> probs(n), loss(targets.size()), dlogits(n);
    env.cuda->CrossEntropyFwd(d_logits.get(), d_targets.get(), tokens, vocab, d_probs.get(), d_loss.get());
    env.ref->CrossEntropyFwd(logits.data(), targets.data(), tokens, vocab, probs.data(), loss.data());
    // Softmax denominators sum the whole row: a reduction (50257 terms).
    ExpectNear(d_probs.ToHost(), probs, kReductionTol, what + " probs");
    ExpectNear(d_loss.ToHost(), loss, kReductionTol, what + " loss");
    // Backward from the reference's probs: the same arithmetic, bit for bit.
    DevF r_probs(probs);
    const float scale = 1.f / static_cast<float>(tokens);
    env.cuda->CrossEntropyBwd(r_probs.get(), d_targets.get(), tokens, vocab, scale, d_dlogits.get());
    env.ref->CrossEntropyBwd(probs.data(), targets.data(), tokens, vocab, scale, dlogits.data());
    ExpectEqual(d_dlogits.ToHost(), dlogits, what + " dlogits");
  }
}

TEST_CASE("Vocabulary-parallel cross-entropy and embedding: negative ids are another rank's") {
  Env& env = GetEnv();
  uint32_t seed = 650;
  for (const int64_t vocab : {int64_t{2048}, int64_t{25}}) {
    const int64_t tokens = 17;
    const std::string what = "vocab-parallel " + Shape(tokens, vocab);
    const size_t n = static_cast<size_t>(tokens * vocab);
    const auto logits = Normal(n, ++seed, 3.f);
    std::vector<int32_t> targets(static_cast<size_t>(tokens));
    std::mt19937 rng(++seed);
    for (auto& t : targets) t = rng() % 3 == 0 ? -1 : static_cast<int32_t>(rng() % static_cast<uint32_t>(vocab));
    DevF d_logits(logits), d_stats(static_cast<size_t>(3 * tokens)), d_probs(n), d_dlogits(n);
    DevI d_targets(targets);
    std::vector<float> stats(static_cast<size_t>(3 * tokens)), probs(n), dlogits(n);
    env.cuda->CrossEntropyPartialStats(d_logits.get(), d_targets.get(), tokens, vocab, d_stats.get());
    env.ref->CrossEntropyPartialStats(logits.data(), targets.data(), tokens, vocab, stats.data());
    ExpectNear(d_stats.ToHost(), stats, kReductionTol, what + " stats");
    DevF r_stats(stats);
    env.cuda->CrossEntropyPartialProbs(d_logits.get(), r_stats.get(), tokens, vocab, d_probs.get());
    env.ref->CrossEntropyPartialProbs(logits.data(), stats.data(), tokens, vocab, probs.data());
    ExpectNear(d_probs.ToHost(), probs, kElementwiseTol, what + " probs");
    DevF r_probs(probs);
    env.cuda->CrossEntropyBwd(r_probs.get(), d_targets.get(), tokens, vocab, 0.5f, d_dlogits.get());
    env.ref->CrossEntropyBwd(probs.data(), targets.data(), tokens, vocab, 0.5f, dlogits.data());
    ExpectEqual(d_dlogits.ToHost(), dlogits, what + " dlogits");
    // The embedding with the same ids: zero rows, skipped in backward.
    const int64_t d = 24;
    const auto table = Random(static_cast<size_t>(vocab * d), ++seed);
    const auto dy = Random(static_cast<size_t>(tokens * d), ++seed);
    auto dtable = Random(table.size(), ++seed);
    DevF d_table(table), d_dy(dy), d_y(dy.size()), d_dtable(dtable);
    std::vector<float> y(dy.size());
    env.cuda->EmbeddingFwd(d_targets.get(), d_table.get(), tokens, d, d_y.get());
    env.ref->EmbeddingFwd(targets.data(), table.data(), tokens, d, y.data());
    ExpectEqual(d_y.ToHost(), y, what + " embedding fwd");
    env.cuda->EmbeddingBwd(d_targets.get(), d_dy.get(), tokens, d, d_dtable.get());
    env.ref->EmbeddingBwd(targets.data(), dy.data(), tokens, d, dtable.data());
    ExpectEqual(d_dtable.ToHost(), dtable, what + " embedding bwd");
  }
}

TEST_CASE("AttnRes forward and backward") {
  Env& env = GetEnv();
  struct Case {
    int64_t n, tokens, d;
    bool misalign;
  };
  // d = 60000 does not fit its partial sums in shared memory (global path).
  uint32_t seed = 700;
  for (const Case cs : {Case{3, 50, 256, false}, Case{4, 33, 130, false}, Case{1, 1, 64, false},
                        Case{5, 700, 128, false}, Case{2, 4, 60000, false}, Case{3, 20, 256, true}}) {
    const std::string what =
        "attn_res n=" + std::to_string(cs.n) + " " + Shape(cs.tokens, cs.d) + (cs.misalign ? " misaligned" : "");
    const size_t nsrc = static_cast<size_t>(cs.n * cs.tokens * cs.d);
    const size_t td = static_cast<size_t>(cs.tokens * cs.d);
    const size_t d = static_cast<size_t>(cs.d);
    const auto sources = Random(nsrc, ++seed, 0.05f, 2.f);
    // Logits of order 1-10: the softmax over sources is far from uniform but
    // not one-hot, so the weights and their gradients are all exercised.
    auto w = Random(d, ++seed, 0.5f, 3.f);
    for (float& x : w) x *= 4.f / std::sqrt(static_cast<float>(cs.d));
    const auto gamma = Random(d, ++seed, 0.5f, 1.5f);
    const auto dh = Random(td, ++seed);
    auto dw = Random(d, ++seed);
    auto dgamma = Random(d, ++seed);
    const float eps = 1e-6f;
    // dsources starts non-zero: the backward adds into it.
    const auto ds0 = Random(nsrc, ++seed);
    DevF d_sources(sources, cs.misalign), d_w(w, cs.misalign), d_gamma(gamma, cs.misalign), d_dh(dh, cs.misalign);
    DevF d_h(td, cs.misalign), d_weights(static_cast<size_t>(cs.n * cs.tokens)), d_ds(ds0, cs.misalign);
    DevF d_dw(dw, cs.misalign), d_dgamma(dgamma, cs.misalign);
    DevF d_ws(static_cast<size_t>(memplan::workspace::AttnResBwdBytes(cs.tokens, cs.d) / 4), cs.misalign);
    std::vector<float> h(td), weights(static_cast<size_t>(cs.n * cs.tokens)), ds = ds0;
    // Block i at its own address (every other block reversed in memory order).
    std::vector<const float*> d_src, h_src;
    std::vector<float*> d_dsrc, h_dsrc;
    for (int64_t i = 0; i < cs.n; ++i) {
      const int64_t at = (cs.n - 1 - i) * static_cast<int64_t>(td);
      d_src.push_back(d_sources.get() + at);
      h_src.push_back(sources.data() + at);
      d_dsrc.push_back(d_ds.get() + at);
      h_dsrc.push_back(ds.data() + at);
    }

    env.cuda->AttnResFwd(d_src.data(), cs.n, d_w.get(), d_gamma.get(), cs.tokens, cs.d, eps, d_h.get(),
                         d_weights.get());
    env.ref->AttnResFwd(h_src.data(), cs.n, w.data(), gamma.data(), cs.tokens, cs.d, eps, h.data(), weights.data());
    ExpectNear(d_h.ToHost(), h, kReductionTol, what + " h");
    ExpectNear(d_weights.ToHost(), weights, kReductionTol, what + " weights");

    env.cuda->AttnResBwd(d_src.data(), cs.n, d_w.get(), d_gamma.get(), d_dh.get(), cs.tokens, cs.d, eps,
                         d_dsrc.data(), d_dw.get(), d_dgamma.get(), d_ws.get());
    env.ref->AttnResBwd(h_src.data(), cs.n, w.data(), gamma.data(), dh.data(), cs.tokens, cs.d, eps, h_dsrc.data(),
                        dw.data(), dgamma.data(), nullptr);
    ExpectNear(d_ds.ToHost(), ds, kReductionTol, what + " dsources");
    ExpectNear(d_dw.ToHost(), dw, kReductionTol, what + " dw");
    ExpectNear(d_dgamma.ToHost(), dgamma, kReductionTol, what + " dgamma");
  }
}

// KDA: the recurrence per (sequence, head) in shared memory against the
// reference, forward (o, the chunk states) and backward (every input
// gradient, da_log added into), and the sigmoid output gate.
TEST_CASE("KDA and the sigmoid gate against the reference") {
  Env& env = GetEnv();
  uint32_t seed = 900;
  for (const mk::KdaShape sh : {mk::KdaShape{2, 40, 3, 16, 16, 16}, mk::KdaShape{1, 70, 2, 128, 64, 32}}) {
    const std::string what = "kda dk=" + std::to_string(sh.dk) + " dv=" + std::to_string(sh.dv);
    const size_t rows = static_cast<size_t>(sh.batch * sh.seq), nk = rows * static_cast<size_t>(sh.heads * sh.dk);
    const size_t nv = rows * static_cast<size_t>(sh.heads * sh.dv), nb = rows * static_cast<size_t>(sh.heads);
    const size_t ns = static_cast<size_t>(sh.batch * sh.heads * sh.Chunks() * sh.dk * sh.dv);
    const auto q = Random(nk, ++seed, -1.f, 1.f), k = Random(nk, ++seed, -1.f, 1.f), v = Random(nv, ++seed, -1.f, 1.f);
    const auto g = Random(nk, ++seed, -2.f, 2.f), beta = Random(nb, ++seed, -2.f, 2.f);
    const auto a_log = Random(static_cast<size_t>(sh.heads), ++seed, -1.f, 0.5f), d_o = Random(nv, ++seed, -1.f, 1.f);
    auto da = Random(static_cast<size_t>(sh.heads), ++seed);
    const auto dt_bias = Random(static_cast<size_t>(sh.heads * sh.dk), ++seed, -3.f, 0.f);
    auto ddt = Random(static_cast<size_t>(sh.heads * sh.dk), ++seed);
    DevF d_q(q), d_k(k), d_v(v), d_g(g), d_beta(beta), d_a(a_log), d_do(d_o), d_da(da), d_dt(dt_bias), d_ddt(ddt);
    DevF d_o_out(nv), d_states(ns), d_dq(nk), d_dk(nk), d_dv(nv), d_dg(nk), d_db(nb);
    DevF d_ws(static_cast<size_t>(memplan::workspace::KdaBwdBytes(sh.batch, sh.heads, sh.chunk, sh.dk, sh.dv) / 4));
    std::vector<float> o(nv), states(ns), dq(nk), dk(nk), dv(nv), dg(nk), db(nb);
    env.cuda->KdaFwd(d_q.get(), d_k.get(), d_v.get(), d_g.get(), d_beta.get(), d_a.get(), d_dt.get(), sh,
                     d_o_out.get(), d_states.get());
    env.ref->KdaFwd(q.data(), k.data(), v.data(), g.data(), beta.data(), a_log.data(), dt_bias.data(), sh, o.data(),
                    states.data());
    ExpectNear(d_o_out.ToHost(), o, kReductionTol, what + " o");
    ExpectNear(d_states.ToHost(), states, kReductionTol, what + " states");
    env.cuda->KdaBwd(d_q.get(), d_k.get(), d_v.get(), d_g.get(), d_beta.get(), d_a.get(), d_dt.get(), d_states.get(),
                     d_do.get(), sh, d_dq.get(), d_dk.get(), d_dv.get(), d_dg.get(), d_db.get(), d_da.get(),
                     d_ddt.get(), d_ws.get());
    env.ref->KdaBwd(q.data(), k.data(), v.data(), g.data(), beta.data(), a_log.data(), dt_bias.data(), states.data(),
                    d_o.data(), sh, dq.data(), dk.data(), dv.data(), dg.data(), db.data(), da.data(), ddt.data(),
                    nullptr);
    ExpectNear(d_dq.ToHost(), dq, kReductionTol, what + " dq");
    ExpectNear(d_dk.ToHost(), dk, kReductionTol, what + " dk");
    ExpectNear(d_dv.ToHost(), dv, kReductionTol, what + " dv");
    ExpectNear(d_dg.ToHost(), dg, kReductionTol, what + " dg");
    ExpectNear(d_db.ToHost(), db, kReductionTol, what + " dbeta");
    ExpectNear(d_da.ToHost(), da, kReductionTol, what + " da_log");
    ExpectNear(d_ddt.ToHost(), ddt, kReductionTol, what + " d_dt_bias");
  }
  // The short convolution (q, k, v's), taps 4 and 1, sequences shorter than the taps included.
  for (const auto& [batch, seq, channels, taps] :
       std::vector<std::array<int64_t, 4>>{{2, 37, 48, 4}, {3, 2, 16, 4}, {1, 9, 8, 1}}) {
    const std::string what = "short conv taps=" + std::to_string(taps) + " seq=" + std::to_string(seq);
    const size_t n = static_cast<size_t>(batch * seq * channels), nw = static_cast<size_t>(taps * channels);
    const auto x = Random(n, ++seed, -2.f, 2.f), w = Random(nw, ++seed, -1.f, 1.f), dy = Random(n, ++seed, -1.f, 1.f);
    auto dw = Random(nw, ++seed);
    DevF d_x(x), d_w(w), d_dy(dy), d_dw(dw), d_y(n), d_dx(n);
    std::vector<float> y(n), dx(n);
    env.cuda->ShortConvFwd(d_x.get(), d_w.get(), batch, seq, channels, taps, d_y.get());
    env.ref->ShortConvFwd(x.data(), w.data(), batch, seq, channels, taps, y.data());
    ExpectNear(d_y.ToHost(), y, kReductionTol, what + " y");
    env.cuda->ShortConvBwd(d_x.get(), d_w.get(), d_dy.get(), batch, seq, channels, taps, d_dx.get(), d_dw.get());
    env.ref->ShortConvBwd(x.data(), w.data(), dy.data(), batch, seq, channels, taps, dx.data(), dw.data());
    ExpectNear(d_dx.ToHost(), dx, kReductionTol, what + " dx");
    ExpectNear(d_dw.ToHost(), dw, kReductionTol, what + " dw");
  }
  const size_t n = 5000;
  const auto x = Random(n, 950, -1.f, 1.f), gate = Random(n, 951, -3.f, 3.f), dy = Random(n, 952, -1.f, 1.f);
  DevF d_x(x), d_gate(gate), d_dy(dy), d_y(n), d_dx(n), d_dgate(n);
  std::vector<float> y(n), dx(n), dgate(n);
  env.cuda->SigmoidGateFwd(d_x.get(), d_gate.get(), static_cast<int64_t>(n), d_y.get());
  env.ref->SigmoidGateFwd(x.data(), gate.data(), static_cast<int64_t>(n), y.data());
  ExpectNear(d_y.ToHost(), y, kReductionTol, "sigmoid gate y");
  env.cuda->SigmoidGateBwd(d_x.get(), d_gate.get(), d_dy.get(), static_cast<int64_t>(n), d_dx.get(), d_dgate.get());
  env.ref->SigmoidGateBwd(x.data(), gate.data(), dy.data(), static_cast<int64_t>(n), dx.data(), dgate.data());
  ExpectNear(d_dx.ToHost(), dx, kReductionTol, "sigmoid gate dx");
  ExpectNear(d_dgate.ToHost(), dgate, kReductionTol, "sigmoid gate dg");
}

// bf16 storage: the device's rounding (__float2bfloat16_rn) equals the
// reference's bit for bit, edge values included, and widening is exact.
TEST_CASE("bf16 conversions against the reference") {
  Env& env = GetEnv();
  std::vector<float> x = Random(100000, 960, -1e4f, 1e4f);
  for (uint32_t u : {0x3F808000u, 0x3F818000u, 0x7F7FFFFFu, 0xFF7FFFFFu, 0x7F800000u, 0x7FC00000u, 0x00000001u,
                     0x80000000u}) {
    float f;
    std::memcpy(&f, &u, 4);
    x.push_back(f);
  }
  DeviceArray<float> d_x(x), d_back(x.size());
  DeviceArray<uint16_t> d_b(x.size());
  env.cuda->RoundToBf16(d_x.get(), static_cast<int64_t>(x.size()), d_b.get());
  env.cuda->WidenBf16(d_b.get(), static_cast<int64_t>(x.size()), d_back.get());
  std::vector<uint16_t> want(x.size());
  env.ref->RoundToBf16(x.data(), static_cast<int64_t>(x.size()), want.data());
  const std::vector<uint16_t> got = d_b.ToHost();
  const std::vector<float> back = d_back.ToHost();
  int64_t mismatches = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    mismatches += got[i] != want[i];
    uint32_t u;
    std::memcpy(&u, &back[i], 4);
    mismatches += u != (static_cast<uint32_t>(want[i]) << 16);
  }
  CHECK(mismatches == 0);
}

// The attention kernels have their own test (attention_cuda_test.cc); this
// checks that CudaOps forwards to them on its stream.
TEST_CASE("Attention through CudaOps") {
  Env& env = GetEnv();
  mk::AttentionShape sh;
  sh.b = 2;
  sh.heads = 4;
  sh.kv_heads = 2;
  sh.s = 33;
  sh.dqk = 16;
  sh.dv = 8;
  sh.scale = 0.25f;
  sh.causal = true;
  const AttentionInputs in(sh, 801);
  const size_t nq = in.nq, nk = in.nk, nv = in.nv, no = in.no, np = in.np, nl = in.nl;
  const auto &q = in.q, &k = in.k, &v = in.v, &d_o = in.d_o;
  DevF dq_(q), dk_(k), dv_(v), ddo(d_o);

  {
    DevF d_probs(np), d_out(no), d_dq(nq), d_dk(nk), d_dv(nv);
    DeviceArray<char> ws(static_cast<size_t>(mk::AttentionBwdWorkspaceBytes(sh.b, sh.heads, sh.s)));
    std::vector<float> probs(np), out(no), gq(nq), gk(nk), gv(nv),
        ref_ws(static_cast<size_t>(mk::AttentionBwdWorkspaceBytes(sh.b, sh.heads, sh.s)) / sizeof(float));
    env.cuda->AttentionFwd(sh, dq_.get(), dk_.get(), dv_.get(), d_probs.get(), d_out.get());
    env.ref->AttentionFwd(sh, q.data(), k.data(), v.data(), probs.data(), out.data());
    ExpectNear(d_probs.ToHost(), probs, kReductionTol, "attention probs");
    ExpectNear(d_out.ToHost(), out, kReductionTol, "attention o");
    DevF r_probs(probs);
    env.cuda->AttentionBwd(sh, dq_.get(), dk_.get(), dv_.get(), r_probs.get(), ddo.get(), d_dq.get(), d_dk.get(),
                           d_dv.get(), ws.get());
    env.ref->AttentionBwd(sh, q.data(), k.data(), v.data(), probs.data(), d_o.data(), gq.data(), gk.data(), gv.data(),
                          ref_ws.data());
    ExpectNear(d_dq.ToHost(), gq, kReductionTol, "attention dq");
    ExpectNear(d_dk.ToHost(), gk, kReductionTol, "attention dk");
    ExpectNear(d_dv.ToHost(), gv, kReductionTol, "attention dv");
  }
  {
    DevF d_out(no), d_lse(nl), d_dq(nq), d_dk(nk), d_dv(nv);
    DeviceArray<char> ws(static_cast<size_t>(mk::FlashAttentionBwdWorkspaceBytes(sh.b, sh.heads, sh.s)));
    std::vector<float> out(no), lse(nl), gq(nq), gk(nk), gv(nv),
        ref_ws(static_cast<size_t>(mk::FlashAttentionBwdWorkspaceBytes(sh.b, sh.heads, sh.s)) / sizeof(float));
    env.cuda->FlashAttentionFwd(sh, dq_.get(), dk_.get(), dv_.get(), d_out.get(), d_lse.get());
    env.ref->FlashAttentionFwd(sh, q.data(), k.data(), v.data(), out.data(), lse.data());
    ExpectNear(d_out.ToHost(), out, kReductionTol, "flash attention o");
    ExpectNear(d_lse.ToHost(), lse, kReductionTol, "flash attention lse");
    DevF r_out(out), r_lse(lse);
    env.cuda->FlashAttentionBwd(sh, dq_.get(), dk_.get(), dv_.get(), r_out.get(), r_lse.get(), ddo.get(), d_dq.get(),
                                d_dk.get(), d_dv.get(), ws.get());
    env.ref->FlashAttentionBwd(sh, q.data(), k.data(), v.data(), out.data(), lse.data(), d_o.data(), gq.data(),
                               gk.data(), gv.data(), ref_ws.data());
    ExpectNear(d_dq.ToHost(), gq, kReductionTol, "flash attention dq");
    ExpectNear(d_dk.ToHost(), gk, kReductionTol, "flash attention dk");
    ExpectNear(d_dv.ToHost(), gv, kReductionTol, "flash attention dv");
  }
}

// --- Executor ops -------------------------------------------------------------

TEST_CASE("GemmStridedBatched: transposes, padded rows, batch strides, broadcast, beta, k == 0") {
  Env& env = GetEnv();
  DeviceArray<char> workspace(static_cast<size_t>(mk::GemmWorkspaceBytes()));
  struct Dims {
    int64_t m, n, k, batch;
  };
  uint32_t seed = 900;
  for (const Dims dims : {Dims{37, 53, 29, 3}, Dims{128, 64, 96, 8}, Dims{1, 7, 1, 2}, Dims{16, 8, 0, 3}}) {
    for (int trans = 0; trans < 4; ++trans) {
      for (const float beta : {0.f, 0.5f}) {
        for (const bool broadcast_b : {false, true}) {
          const bool ta = trans & 1, tb = trans & 2;
          const int64_t rows_a = ta ? dims.k : dims.m, cols_a = ta ? dims.m : dims.k;
          const int64_t rows_b = tb ? dims.n : dims.k, cols_b = tb ? dims.k : dims.n;
          const int64_t lda = cols_a + 3, ldb = cols_b + 1, ldc = dims.n + 2;
          const int64_t stride_a = rows_a * lda + 5, stride_b = broadcast_b ? 0 : rows_b * ldb + 3;
          const int64_t stride_c = dims.m * ldc + 1;
          const auto a = Random(static_cast<size_t>(dims.batch * stride_a + 1), ++seed);
          const auto b = Random(static_cast<size_t>(rows_b * ldb + dims.batch * stride_b + 1), ++seed);
          auto c = Random(static_cast<size_t>(dims.batch * stride_c), ++seed);
          if (beta == 0.f) {  // C must not be read: NaN in every m x n entry
            for (int64_t i = 0; i < dims.batch; ++i) {
              for (int64_t r = 0; r < dims.m; ++r) {
                std::fill_n(c.begin() + i * stride_c + r * ldc, dims.n, std::numeric_limits<float>::quiet_NaN());
              }
            }
          }
          const bool use_ws = broadcast_b;
          DevF da(a), db(b), dc(c);
          env.cuda->GemmStridedBatched(ta, tb, dims.m, dims.n, dims.k, 0.75f, da.get(), lda, stride_a, db.get(), ldb,
                                       stride_b, beta, dc.get(), ldc, stride_c, dims.batch,
                                       use_ws ? workspace.get() : nullptr);
          env.ref->GemmStridedBatched(ta, tb, dims.m, dims.n, dims.k, 0.75f, a.data(), lda, stride_a, b.data(), ldb,
                                      stride_b, beta, c.data(), ldc, stride_c, dims.batch, nullptr);
          ExpectNear(dc.ToHost(), c, kReductionTol,
                     "strided batched gemm m" + std::to_string(dims.m) + " n" + std::to_string(dims.n) + " k" +
                         std::to_string(dims.k) + " ta" + std::to_string(ta) + " tb" + std::to_string(tb) + " beta" +
                         std::to_string(beta) + (broadcast_b ? " broadcast" : ""));
        }
      }
    }
  }
}

TEST_CASE("Softmax and sigmoid forward and backward") {
  Env& env = GetEnv();
  struct Case {
    int64_t rows, cols, causal_seq;
    bool misalign;
    int64_t cp = 1, cp_rank = 0;  // context parallelism: the rows are rank cp_rank's chunks
  };
  uint32_t seed = 1000;
  for (const Case cs : {Case{64, 1024, 0, false}, Case{130, 130, 130, false}, Case{37, 7, 0, false},
                        Case{6, 50257, 0, false}, Case{33, 64, 11, false}, Case{40, 256, 20, true},
                        Case{3, 1, 1, false}, Case{64, 64, 16, false, 2, 1}, Case{48, 96, 24, false, 2, 0}}) {
    const std::string what = "softmax " + Shape(cs.rows, cs.cols) + " causal_seq=" + std::to_string(cs.causal_seq) +
                              (cs.misalign ? " misaligned" : "") +
                              (cs.cp > 1 ? " cp rank " + std::to_string(cs.cp_rank) : "");
    const size_t n = static_cast<size_t>(cs.rows * cs.cols);
    const auto x = Normal(n, ++seed, 3.f);
    const auto dy = Random(n, ++seed);
    const float scale = 0.125f;
    DevF d_x(x, cs.misalign), d_dy(dy, cs.misalign), d_y(n, cs.misalign), d_dx(n, cs.misalign);
    std::vector<float> y(n), dx(n);
    env.cuda->SoftmaxFwd(d_x.get(), cs.rows, cs.cols, scale, cs.causal_seq, d_y.get(), cs.cp, cs.cp_rank);
    env.ref->SoftmaxFwd(x.data(), cs.rows, cs.cols, scale, cs.causal_seq, y.data(), cs.cp, cs.cp_rank);
    const auto got = d_y.ToHost();
    ExpectNear(got, y, kElementwiseTol, what + " y");
    size_t masked_nonzero = 0;
    for (int64_t r = 0; r < cs.rows; ++r) {
      for (int64_t j = 0; j < cs.cols; ++j) {
        if (cs.causal_seq > 0 && j > mk::CpPosition(r % cs.causal_seq, cs.causal_seq, cs.cp, cs.cp_rank) &&
            got[r * cs.cols + j] != 0.f) {
          ++masked_nonzero;
        }
      }
    }
    CHECK_MESSAGE(masked_nonzero == 0, what << ": masked entries not exactly 0");
    // Backward from the reference's y.
    DevF r_y(y, cs.misalign);
    env.cuda->SoftmaxBwd(r_y.get(), d_dy.get(), cs.rows, cs.cols, scale, d_dx.get());
    env.ref->SoftmaxBwd(y.data(), dy.data(), cs.rows, cs.cols, scale, dx.data());
    ExpectNear(d_dx.ToHost(), dx, kReductionTol, what + " dx");
  }

  for (const bool misalign : {false, true}) {
    for (const int64_t n : {int64_t{1}, int64_t{3}, int64_t{1000003}}) {
      const std::string what = "sigmoid n=" + std::to_string(n) + (misalign ? " misaligned" : "");
      const size_t un = static_cast<size_t>(n);
      const auto x = Normal(un, 1100, 4.f);
      const auto dy = Random(un, 1101);
      DevF d_x(x, misalign), d_dy(dy, misalign), d_y(un, misalign), d_dx(un, misalign);
      std::vector<float> y(un), dx(un);
      env.cuda->SigmoidFwd(d_x.get(), n, d_y.get());
      env.ref->SigmoidFwd(x.data(), n, y.data());
      ExpectNear(d_y.ToHost(), y, kElementwiseTol, what + " fwd");
      // Backward from the reference's y: the same three roundings.
      DevF r_y(y, misalign);
      env.cuda->SigmoidBwd(r_y.get(), d_dy.get(), n, d_dx.get());
      env.ref->SigmoidBwd(y.data(), dy.data(), n, dx.data());
      ExpectEqual(d_dx.ToHost(), dx, what + " bwd");
    }
  }
}

TEST_CASE("TopK forward and backward; Router equals Softmax/Sigmoid + TopK on the device") {
  Env& env = GetEnv();
  struct Case {
    int64_t tokens, experts, top_k;
  };
  uint32_t seed = 1200;
  for (const Case cs : {Case{77, 64, 6}, Case{40, 256, 8}, Case{9, 5, 5}, Case{3, 1, 1}}) {
    const size_t n = static_cast<size_t>(cs.tokens * cs.experts);
    const size_t nk = static_cast<size_t>(cs.tokens * cs.top_k);
    auto logits = Normal(n, ++seed, 2.f);
    std::fill(logits.begin(), logits.begin() + cs.experts, 0.25f);  // token 0: all tied
    const auto d_w = Random(nk, ++seed);
    DevF d_logits(logits), d_dw(d_w);
    for (const bool sigmoid : {false, true}) {
      for (const bool renormalize : {false, true}) {
        const std::string what = "topk E=" + std::to_string(cs.experts) + " k=" + std::to_string(cs.top_k) +
                                 (sigmoid ? " sigmoid" : " softmax") + (renormalize ? " renorm" : "");
        // Reference probabilities, then top-k on both backends from them.
        std::vector<float> probs(n), weights(nk), dprobs(n);
        std::vector<int32_t> idx(nk);
        if (sigmoid) {
          env.ref->SigmoidFwd(logits.data(), static_cast<int64_t>(n), probs.data());
        } else {
          env.ref->SoftmaxFwd(logits.data(), cs.tokens, cs.experts, 1.f, 0, probs.data());
        }
        env.ref->TopKFwd(probs.data(), cs.tokens, cs.experts, cs.top_k, renormalize, idx.data(), weights.data());
        DevF r_probs(probs), d_weights(nk), d_dprobs(n);
        DevI d_idx(nk);
        env.cuda->TopKFwd(r_probs.get(), cs.tokens, cs.experts, cs.top_k, renormalize, d_idx.get(), d_weights.get());
        ExpectEqual(d_idx.ToHost(), idx, what + " idx");
        ExpectEqual(d_weights.ToHost(), weights, what + " weights");  // same sums in the same order
        DevI r_idx(idx);
        DevF r_weights(weights);
        env.cuda->TopKBwd(r_probs.get(), r_idx.get(), r_weights.get(), d_dw.get(), cs.tokens, cs.experts, cs.top_k,
                          renormalize, d_dprobs.get());
        env.ref->TopKBwd(probs.data(), idx.data(), weights.data(), d_w.data(), cs.tokens, cs.experts, cs.top_k,
                         renormalize, dprobs.data());
        ExpectNear(d_dprobs.ToHost(), dprobs, kReductionTol, what + " dprobs");

        // Device composition vs the device router.
        DevF c_probs(n), c_weights(nk), c_dp(n), c_dl(n), r2_probs(n), r2_weights(nk), r2_dl(n);
        DevI c_idx(nk), r2_idx(nk);
        if (sigmoid) {
          env.cuda->SigmoidFwd(d_logits.get(), static_cast<int64_t>(n), c_probs.get());
        } else {
          env.cuda->SoftmaxFwd(d_logits.get(), cs.tokens, cs.experts, 1.f, 0, c_probs.get());
        }
        env.cuda->TopKFwd(c_probs.get(), cs.tokens, cs.experts, cs.top_k, renormalize, c_idx.get(), c_weights.get());
        env.cuda->TopKBwd(c_probs.get(), c_idx.get(), c_weights.get(), d_dw.get(), cs.tokens, cs.experts, cs.top_k,
                          renormalize, c_dp.get());
        if (sigmoid) {
          env.cuda->SigmoidBwd(c_probs.get(), c_dp.get(), static_cast<int64_t>(n), c_dl.get());
        } else {
          env.cuda->SoftmaxBwd(c_probs.get(), c_dp.get(), cs.tokens, cs.experts, 1.f, c_dl.get());
        }
        env.cuda->RouterFwd(d_logits.get(), cs.tokens, cs.experts, cs.top_k, sigmoid, renormalize, r2_probs.get(),
                            r2_idx.get(), r2_weights.get());
        env.cuda->RouterBwd(r2_probs.get(), r2_idx.get(), r2_weights.get(), d_dw.get(), cs.tokens, cs.experts,
                            cs.top_k, sigmoid, renormalize, r2_dl.get());
        ExpectNear(c_probs.ToHost(), r2_probs.ToHost(), kElementwiseTol, what + " composed probs");
        ExpectEqual(c_idx.ToHost(), r2_idx.ToHost(), what + " composed idx");
        ExpectNear(c_weights.ToHost(), r2_weights.ToHost(), kElementwiseTol, what + " composed weights");
        ExpectNear(c_dl.ToHost(), r2_dl.ToHost(), kReductionTol, what + " composed dlogits");
      }
    }
  }
}

TEST_CASE("Embedding forward and backward: the reference's bits, run to run") {
  Env& env = GetEnv();
  struct Case {
    int64_t vocab, n, d;
    bool misalign;
  };
  uint32_t seed = 1300;
  for (const Case cs : {Case{50, 1000, 64, false}, Case{7, 300, 130, false}, Case{1000, 17, 1, false},
                        Case{50, 257, 128, true}}) {
    const std::string what = "embedding V=" + std::to_string(cs.vocab) + " n=" + std::to_string(cs.n) +
                             " d=" + std::to_string(cs.d) + (cs.misalign ? " misaligned" : "");
    std::mt19937 rng(++seed);
    std::vector<int32_t> tokens(static_cast<size_t>(cs.n));
    for (auto& t : tokens) t = static_cast<int32_t>(rng() % static_cast<uint32_t>(cs.vocab));
    const auto table = Random(static_cast<size_t>(cs.vocab * cs.d), ++seed);
    const auto dy = Random(static_cast<size_t>(cs.n * cs.d), ++seed);
    auto dtable = Random(table.size(), ++seed);
    DevI d_tokens(tokens);
    DevF d_table(table, cs.misalign), d_dy(dy, cs.misalign), d_y(dy.size(), cs.misalign);
    DevF d_dtable(dtable, cs.misalign), d_dtable2(dtable, cs.misalign);
    std::vector<float> y(dy.size());
    env.cuda->EmbeddingFwd(d_tokens.get(), d_table.get(), cs.n, cs.d, d_y.get());
    env.ref->EmbeddingFwd(tokens.data(), table.data(), cs.n, cs.d, y.data());
    ExpectEqual(d_y.ToHost(), y, what + " fwd");
    env.cuda->EmbeddingBwd(d_tokens.get(), d_dy.get(), cs.n, cs.d, d_dtable.get());
    env.cuda->EmbeddingBwd(d_tokens.get(), d_dy.get(), cs.n, cs.d, d_dtable2.get());
    env.ref->EmbeddingBwd(tokens.data(), dy.data(), cs.n, cs.d, dtable.data());
    const auto got = d_dtable.ToHost();
    ExpectEqual(got, dtable, what + " bwd");
    ExpectEqual(d_dtable2.ToHost(), got, what + " bwd rerun");
  }
}

TEST_CASE("SplitHeads forward and backward, with and without RoPE") {
  Env& env = GetEnv();
  uint32_t seed = 1400;
  const mk::SplitShape shapes[] = {
      {.b = 2, .s = 33, .heads = 8, .kv_heads = 2, .head_dim = 64, .rope = true, .rope_theta = 10000.f},
      {.b = 1, .s = 4096, .heads = 4, .kv_heads = 4, .head_dim = 128, .rope = true, .rope_theta = 500000.f},
      {.b = 3, .s = 7, .heads = 2, .kv_heads = 1, .head_dim = 17, .rope = false},
      {.b = 2, .s = 5, .heads = 4, .kv_heads = 2, .head_dim = 6, .rope = false},
      // Context parallelism: rank 1 of 2 (its chunks at positions 16.. and 32.. of 64).
      {.b = 2, .s = 32, .heads = 4, .kv_heads = 2, .head_dim = 16, .rope = true, .rope_theta = 10000.f, .cp = 2,
       .cp_rank = 1},
  };
  for (const mk::SplitShape& sh : shapes) {
    const std::string what = "split heads s=" + std::to_string(sh.s) + " hd=" + std::to_string(sh.head_dim) +
                             (sh.rope ? " rope" : "");
    const size_t nqkv = static_cast<size_t>(sh.b * sh.s * (sh.heads + 2 * sh.kv_heads) * sh.head_dim);
    const size_t nq = static_cast<size_t>(sh.b * sh.heads * sh.s * sh.head_dim);
    const size_t nkv = static_cast<size_t>(sh.b * sh.kv_heads * sh.s * sh.head_dim);
    const auto qkv = Random(nqkv, ++seed);
    const auto gq = Random(nq, ++seed), gk = Random(nkv, ++seed), gv = Random(nkv, ++seed);
    DevF d_qkv(qkv), d_q(nq), d_k(nkv), d_v(nkv), d_gq(gq), d_gk(gk), d_gv(gv), d_dqkv(nqkv);
    std::vector<float> q(nq), k(nkv), v(nkv), dqkv(nqkv);
    env.cuda->SplitHeadsFwd(d_qkv.get(), sh, d_q.get(), d_k.get(), d_v.get());
    env.ref->SplitHeadsFwd(qkv.data(), sh, q.data(), k.data(), v.data());
    env.cuda->SplitHeadsBwd(d_gq.get(), d_gk.get(), d_gv.get(), sh, d_dqkv.get());
    env.ref->SplitHeadsBwd(gq.data(), gk.data(), gv.data(), sh, dqkv.data());
    ExpectEqual(d_v.ToHost(), v, what + " v");
    if (sh.rope) {  // cos/sin from the device's double math: equal but for rare last-bit cases
      ExpectNear(d_q.ToHost(), q, kElementwiseTol, what + " q");
      ExpectNear(d_k.ToHost(), k, kElementwiseTol, what + " k");
      ExpectNear(d_dqkv.ToHost(), dqkv, kElementwiseTol, what + " dqkv");
    } else {
      ExpectEqual(d_q.ToHost(), q, what + " q");
      ExpectEqual(d_k.ToHost(), k, what + " k");
      ExpectEqual(d_dqkv.ToHost(), dqkv, what + " dqkv");
    }
  }
}

TEST_CASE("MlaSplit forward and backward against the reference") {
  Env& env = GetEnv();
  uint32_t seed = 1450;
  const mk::MlaShape shapes[] = {
      {.b = 2, .s = 33, .heads = 4, .nope = 16, .rope = 8, .v = 16, .rope_theta = 10000.f},
      {.b = 1, .s = 257, .heads = 16, .nope = 128, .rope = 64, .v = 128, .rope_theta = 10000.f},
      {.b = 1, .s = 5, .heads = 3, .nope = 7, .rope = 0, .v = 5, .rope_theta = 10000.f},
      {.b = 2, .s = 32, .heads = 4, .nope = 16, .rope = 8, .v = 16, .rope_theta = 10000.f, .cp = 4, .cp_rank = 2},
  };
  for (const mk::MlaShape& sh : shapes) {
    const std::string what = "mla s=" + std::to_string(sh.s) + " heads=" + std::to_string(sh.heads);
    const int64_t t = sh.b * sh.s, qk = sh.nope + sh.rope;
    const size_t nql = static_cast<size_t>(t * sh.heads * qk), nkv = static_cast<size_t>(t * sh.heads * (sh.nope + sh.v));
    const size_t npe = static_cast<size_t>(t * sh.rope), nq = nql, nv = static_cast<size_t>(t * sh.heads * sh.v);
    const auto ql = Random(nql, ++seed), kv = Random(nkv, ++seed), pe = Random(std::max<size_t>(npe, 1), ++seed);
    const auto gq = Random(nq, ++seed), gk = Random(nq, ++seed), gv = Random(nv, ++seed);
    DevF d_ql(ql), d_kv(kv), d_pe(pe), d_q(nq), d_k(nq), d_v(nv), d_gq(gq), d_gk(gk), d_gv(gv);
    DevF d_dql(nql), d_dkv(nkv), d_dpe(std::max<size_t>(npe, 1));
    std::vector<float> q(nq), k(nq), v(nv), dql(nql), dkv(nkv), dpe(std::max<size_t>(npe, 1));
    env.cuda->MlaSplitFwd(d_ql.get(), d_kv.get(), d_pe.get(), sh, d_q.get(), d_k.get(), d_v.get());
    env.ref->MlaSplitFwd(ql.data(), kv.data(), pe.data(), sh, q.data(), k.data(), v.data());
    env.cuda->MlaSplitBwd(d_gq.get(), d_gk.get(), d_gv.get(), sh, d_dql.get(), d_dkv.get(), d_dpe.get());
    env.ref->MlaSplitBwd(gq.data(), gk.data(), gv.data(), sh, dql.data(), dkv.data(), dpe.data());
    ExpectEqual(d_v.ToHost(), v, what + " v");
    ExpectEqual(d_dkv.ToHost(), dkv, what + " dkv");  // copies only
    // cos/sin from the device's double math: equal but for rare last-bit cases.
    ExpectNear(d_q.ToHost(), q, kElementwiseTol, what + " q");
    ExpectNear(d_k.ToHost(), k, kElementwiseTol, what + " k");
    ExpectNear(d_dql.ToHost(), dql, kElementwiseTol, what + " dq_lin");
    if (npe > 0) ExpectNear(d_dpe.ToHost(), dpe, kElementwiseTol, what + " dk_pe");
  }
}

TEST_CASE("AdamStep: bit-identical to the reference over several steps") {
  Env& env = GetEnv();
  for (const bool misalign : {false, true}) {
    for (const int64_t n : {int64_t{3}, int64_t{1000003}}) {
      const std::string what = "adam n=" + std::to_string(n) + (misalign ? " misaligned" : "");
      const size_t un = static_cast<size_t>(n);
      auto p = Random(un, 1500), m = Random(un, 1501, 0.f, 0.1f), v = Random(un, 1502, 0.f, 0.01f);
      for (float& x : v) x = std::fabs(x);
      DevF d_p(p, misalign), d_m(m, misalign), d_v(v, misalign);
      const mk::AdamConfig cfg{.lr = 3e-4f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f};
      for (int64_t step = 1; step <= 3; ++step) {
        const auto g = Normal(un, 1510 + static_cast<uint32_t>(step), 1e-2f);
        DevF d_g(g, misalign);
        env.cuda->AdamStep(d_p.get(), d_g.get(), d_m.get(), d_v.get(), n, cfg, step);
        env.ref->AdamStep(p.data(), g.data(), m.data(), v.data(), n, cfg, step);
        GetEnv().Sync();  // d_g goes out of scope
      }
      ExpectEqual(d_p.ToHost(), p, what + " master");
      ExpectEqual(d_m.ToHost(), m, what + " m");
      ExpectEqual(d_v.ToHost(), v, what + " v");
    }
  }
}

TEST_CASE("SquaredNorm: bit-identical run to run, 1e-12 of the reference") {
  Env& env = GetEnv();
  DeviceArray<double> out(2);
  for (const int64_t n : {int64_t{0}, int64_t{1}, int64_t{1000}, int64_t{262145}, int64_t{4000037}}) {
    const std::string what = "squared norm n=" + std::to_string(n);
    const auto x = Normal(static_cast<size_t>(n), 1600, 3.f);
    DevF d_x(x);
    env.cuda->SquaredNorm(d_x.get(), n, out.get());
    env.cuda->SquaredNorm(d_x.get(), n, out.get() + 1);
    double want = -1;
    env.ref->SquaredNorm(x.data(), n, &want);
    const auto got = out.ToHost();
    CHECK_MESSAGE(std::memcmp(&got[0], &got[1], sizeof(double)) == 0, what << ": runs differ");
    if (n == 0) {
      CHECK(got[0] == 0.0);
    } else {
      CHECK_MESSAGE(std::fabs(got[0] - want) <= 1e-12 * want, what << ": got " << got[0] << " want " << want);
    }
  }
}

TEST_CASE("Copy, Zero and Accumulate") {
  Env& env = GetEnv();
  for (const bool misalign : {false, true}) {
    const size_t n = 100003;
    const auto x = Random(n, 1700), y0 = Random(n, 1701);
    DevF d_x(x, misalign), d_y(y0, misalign), d_c(n, misalign), d_z(n, misalign);
    env.cuda->Copy(d_c.get(), d_x.get(), static_cast<int64_t>(n * sizeof(float)));
    ExpectEqual(d_c.ToHost(), x, "copy");
    env.cuda->Zero(d_z.get(), static_cast<int64_t>(n * sizeof(float)));
    ExpectEqual(d_z.ToHost(), std::vector<float>(n, 0.f), "zero");
    std::vector<float> y = y0;
    env.cuda->Accumulate(d_y.get(), d_x.get(), static_cast<int64_t>(n));
    env.ref->Accumulate(y.data(), x.data(), static_cast<int64_t>(n));
    ExpectEqual(d_y.ToHost(), y, std::string("accumulate") + (misalign ? " misaligned" : ""));
    // Axpby: bit-identical to the reference, out of place, in place on x, y null.
    std::vector<float> want(n);
    DevF d_o(n, misalign), d_x2(x, misalign);
    env.cuda->Axpby(d_x.get(), d_y.get(), static_cast<int64_t>(n), 0.95f, -1.7f, d_o.get());
    env.ref->Axpby(x.data(), y.data(), static_cast<int64_t>(n), 0.95f, -1.7f, want.data());
    ExpectEqual(d_o.ToHost(), want, "axpby");
    env.cuda->Axpby(d_x2.get(), d_y.get(), static_cast<int64_t>(n), 0.95f, -1.7f, d_x2.get());
    ExpectEqual(d_x2.ToHost(), want, "axpby in place");
    env.cuda->Axpby(d_x.get(), nullptr, static_cast<int64_t>(n), 0.5f, 0.f, d_o.get());
    env.ref->Axpby(x.data(), nullptr, static_cast<int64_t>(n), 0.5f, 0.f, want.data());
    ExpectEqual(d_o.ToHost(), want, "scale");
  }
}

TEST_CASE("Attention through CudaOps with o_token_major") {
  Env& env = GetEnv();
  for (const bool causal : {true, false}) {
    mk::AttentionShape sh;
    sh.b = 2;
    sh.heads = 4;
    sh.kv_heads = 2;
    sh.s = 45;
    sh.dqk = 16;
    sh.dv = 8;
    sh.scale = 0.25f;
    sh.causal = causal;
    sh.o_token_major = true;
    const std::string what = std::string("token-major attention") + (causal ? " causal" : "");
    const AttentionInputs in(sh, 1801);
    const size_t nq = in.nq, nk = in.nk, nv = in.nv, no = in.no, np = in.np, nl = in.nl;
    const auto &q = in.q, &k = in.k, &v = in.v, &d_o = in.d_o;
    DevF dq_(q), dk_(k), dv_(v), ddo(d_o);
    {
      DevF d_probs(np), d_out(no), d_dq(nq), d_dk(nk), d_dv(nv);
      DeviceArray<char> ws(static_cast<size_t>(mk::AttentionBwdWorkspaceBytes(sh.b, sh.heads, sh.s)));
      std::vector<float> probs(np), out(no), gq(nq), gk(nk), gv(nv), ref_ws(np);
      env.cuda->AttentionFwd(sh, dq_.get(), dk_.get(), dv_.get(), d_probs.get(), d_out.get());
      env.ref->AttentionFwd(sh, q.data(), k.data(), v.data(), probs.data(), out.data());
      ExpectNear(d_out.ToHost(), out, kReductionTol, what + " o");
      DevF r_probs(probs);
      env.cuda->AttentionBwd(sh, dq_.get(), dk_.get(), dv_.get(), r_probs.get(), ddo.get(), d_dq.get(), d_dk.get(),
                             d_dv.get(), ws.get());
      env.ref->AttentionBwd(sh, q.data(), k.data(), v.data(), probs.data(), d_o.data(), gq.data(), gk.data(),
                            gv.data(), ref_ws.data());
      ExpectNear(d_dq.ToHost(), gq, kReductionTol, what + " dq");
      ExpectNear(d_dk.ToHost(), gk, kReductionTol, what + " dk");
      ExpectNear(d_dv.ToHost(), gv, kReductionTol, what + " dv");
    }
    {
      DevF d_out(no), d_lse(nl), d_dq(nq), d_dk(nk), d_dv(nv);
      DeviceArray<char> ws(static_cast<size_t>(mk::FlashAttentionBwdWorkspaceBytes(sh.b, sh.heads, sh.s)));
      std::vector<float> out(no), lse(nl), gq(nq), gk(nk), gv(nv), ref_ws(nl);
      env.cuda->FlashAttentionFwd(sh, dq_.get(), dk_.get(), dv_.get(), d_out.get(), d_lse.get());
      env.ref->FlashAttentionFwd(sh, q.data(), k.data(), v.data(), out.data(), lse.data());
      ExpectNear(d_out.ToHost(), out, kReductionTol, what + " flash o");
      ExpectNear(d_lse.ToHost(), lse, kReductionTol, what + " flash lse");
      DevF r_out(out), r_lse(lse);
      env.cuda->FlashAttentionBwd(sh, dq_.get(), dk_.get(), dv_.get(), r_out.get(), r_lse.get(), ddo.get(),
                                  d_dq.get(), d_dk.get(), d_dv.get(), ws.get());
      env.ref->FlashAttentionBwd(sh, q.data(), k.data(), v.data(), out.data(), lse.data(), d_o.data(), gq.data(),
                                 gk.data(), gv.data(), ref_ws.data());
      ExpectNear(d_dq.ToHost(), gq, kReductionTol, what + " flash dq");
      ExpectNear(d_dk.ToHost(), gk, kReductionTol, what + " flash dk");
      ExpectNear(d_dv.ToHost(), gv, kReductionTol, what + " flash dv");
    }
  }
}

#include "gpu_test_main.h"
