// CUDA attention launchers (kernels/cuda/attention.cu) vs the CPU reference
// (MakeRefOps): standard and flash, forward and backward, over GQA group
// sizes, sequence lengths that do and do not divide the tile sizes, unequal
// q/k and v head dims (MLA-like), with and without the causal mask, o and
// d_o head-major and token-major. Exits 77 (Meson: skipped) when no CUDA
// device is visible.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

// The launchers are private to the kernels component (not in its public
// include dir), so the header is reached relative to this file.
#include "../../kernels/cuda/attention_cuda.h"
#include "memplan/kernels/ops.h"

namespace mk = memplan::kernels;

namespace {

constexpr double kRelTol = 1e-4;

// Owns one device allocation (test-only; the kernels never allocate).
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t size_bytes) : size_bytes_(size_bytes) {
    if (size_bytes > 0 && cudaMalloc(&ptr_, size_bytes) != cudaSuccess) ptr_ = nullptr;
    // NaN everywhere, so an output element a kernel forgets to write fails.
    if (ptr_ != nullptr) cudaMemset(ptr_, 0xFF, size_bytes);
  }
  ~DeviceBuffer() { cudaFree(ptr_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  bool ok() const { return size_bytes_ == 0 || ptr_ != nullptr; }
  float* f() const { return static_cast<float*>(ptr_); }
  void* raw() const { return ptr_; }

 private:
  void* ptr_ = nullptr;
  size_t size_bytes_;
};

std::unique_ptr<DeviceBuffer> Upload(const std::vector<float>& host) {
  auto buf = std::make_unique<DeviceBuffer>(host.size() * sizeof(float));
  if (buf->ok() && !host.empty()) {
    cudaMemcpy(buf->raw(), host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice);
  }
  return buf;
}

std::unique_ptr<DeviceBuffer> Alloc(size_t count) {
  return std::make_unique<DeviceBuffer>(count * sizeof(float));
}

std::vector<float> Download(const DeviceBuffer& buf, size_t count) {
  std::vector<float> host(count);
  if (count > 0) cudaMemcpy(host.data(), buf.raw(), count * sizeof(float), cudaMemcpyDeviceToHost);
  return host;
}

// Uniform in [-1, -0.05] U [0.05, 1]: random, never zero.
std::vector<float> RandomNonZero(size_t count, std::mt19937& rng) {
  std::uniform_real_distribution<float> mag(0.05f, 1.f);
  std::bernoulli_distribution neg(0.5);
  std::vector<float> x(count);
  for (float& e : x) e = neg(rng) ? -mag(rng) : mag(rng);
  return x;
}

// max |got - want| / max |want|; +inf if either holds a NaN or the sizes differ.
double RelErr(const std::vector<float>& got, const std::vector<float>& want) {
  if (got.size() != want.size()) return INFINITY;
  double max_diff = 0.0;
  double max_ref = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(got[i]) || std::isnan(want[i])) return INFINITY;
    max_diff = std::max(max_diff, std::fabs(static_cast<double>(got[i]) - want[i]));
    max_ref = std::max(max_ref, std::fabs(static_cast<double>(want[i])));
  }
  return max_ref > 0.0 ? max_diff / max_ref : max_diff;
}

bool BitEqual(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

std::string Describe(const mk::AttentionShape& sh) {
  char buf[160];
  std::snprintf(buf, sizeof(buf), "b=%lld heads=%lld kv_heads=%lld s=%lld dqk=%lld dv=%lld causal=%d",
                static_cast<long long>(sh.b), static_cast<long long>(sh.heads), static_cast<long long>(sh.kv_heads),
                static_cast<long long>(sh.s), static_cast<long long>(sh.dqk), static_cast<long long>(sh.dv),
                sh.causal ? 1 : 0);
  return buf;
}

// Inputs and CPU reference results for one shape.
struct Reference {
  std::vector<float> q, k, v, d_o;
  std::vector<float> probs, o, dq, dk, dv;              // standard
  std::vector<float> flash_o, lse, flash_dq, flash_dk, flash_dv;  // flash
};

Reference RunReference(const mk::AttentionShape& sh, uint32_t seed) {
  const auto n = [](int64_t x) { return static_cast<size_t>(x); };
  const size_t q_count = n(sh.b * sh.heads * sh.s * sh.dqk);
  const size_t k_count = n(sh.b * sh.kv_heads * sh.s * sh.dqk);
  const size_t v_count = n(sh.b * sh.kv_heads * sh.s * sh.dv);
  const size_t o_count = n(sh.b * sh.heads * sh.s * sh.dv);
  std::mt19937 rng(seed);
  Reference r;
  r.q = RandomNonZero(q_count, rng);
  r.k = RandomNonZero(k_count, rng);
  r.v = RandomNonZero(v_count, rng);
  r.d_o = RandomNonZero(o_count, rng);
  r.probs.resize(n(sh.b * sh.heads * sh.s * sh.s));
  r.o.resize(o_count);
  r.dq.resize(q_count);
  r.dk.resize(k_count);
  r.dv.resize(v_count);
  r.flash_o.resize(o_count);
  r.lse.resize(n(sh.b * sh.heads * sh.s));
  r.flash_dq.resize(q_count);
  r.flash_dk.resize(k_count);
  r.flash_dv.resize(v_count);

  auto ops = mk::MakeRefOps();
  std::vector<unsigned char> ws(n(std::max(mk::AttentionBwdWorkspaceBytes(sh.b, sh.heads, sh.s),
                                           mk::FlashAttentionBwdWorkspaceBytes(sh.b, sh.heads, sh.s))));
  ops->AttentionFwd(sh, r.q.data(), r.k.data(), r.v.data(), r.probs.data(), r.o.data());
  ops->AttentionBwd(sh, r.q.data(), r.k.data(), r.v.data(), r.probs.data(), r.d_o.data(), r.dq.data(), r.dk.data(),
                    r.dv.data(), ws.data());
  ops->FlashAttentionFwd(sh, r.q.data(), r.k.data(), r.v.data(), r.flash_o.data(), r.lse.data());
  ops->FlashAttentionBwd(sh, r.q.data(), r.k.data(), r.v.data(), r.flash_o.data(), r.lse.data(), r.d_o.data(),
                         r.flash_dq.data(), r.flash_dk.data(), r.flash_dv.data(), ws.data());
  return r;
}

struct DeviceInputs {
  std::unique_ptr<DeviceBuffer> q, k, v, d_o;
};

// Runs the standard launchers and checks probs, o, dq, dk, dv.
void CheckStandard(const mk::AttentionShape& sh, const Reference& ref, const DeviceInputs& in,
                   std::vector<float>* o_out) {
  auto probs = Alloc(ref.probs.size());
  auto o = Alloc(ref.o.size());
  auto dq = Alloc(ref.dq.size());
  auto dk = Alloc(ref.dk.size());
  auto dv = Alloc(ref.dv.size());
  DeviceBuffer ws(static_cast<size_t>(mk::AttentionBwdWorkspaceBytes(sh.b, sh.heads, sh.s)));
  REQUIRE((probs->ok() && o->ok() && dq->ok() && dk->ok() && dv->ok() && ws.ok()));

  CHECK(mk::cuda::AttentionFwd(sh, in.q->f(), in.k->f(), in.v->f(), probs->f(), o->f(), nullptr) == 0);
  CHECK(mk::cuda::AttentionBwd(sh, in.q->f(), in.k->f(), in.v->f(), probs->f(), in.d_o->f(), dq->f(), dk->f(),
                               dv->f(), ws.raw(), nullptr) == 0);
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);

  CHECK(RelErr(Download(*probs, ref.probs.size()), ref.probs) < kRelTol);
  *o_out = Download(*o, ref.o.size());
  CHECK(RelErr(*o_out, ref.o) < kRelTol);
  const auto dq_got = Download(*dq, ref.dq.size());
  const auto dk_got = Download(*dk, ref.dk.size());
  const auto dv_got = Download(*dv, ref.dv.size());
  CHECK(RelErr(dq_got, ref.dq) < kRelTol);
  CHECK(RelErr(dk_got, ref.dk) < kRelTol);
  CHECK(RelErr(dv_got, ref.dv) < kRelTol);

  // Overwrite (not accumulate) and determinism: a second backward into the
  // same buffers gives the same bits.
  CHECK(mk::cuda::AttentionBwd(sh, in.q->f(), in.k->f(), in.v->f(), probs->f(), in.d_o->f(), dq->f(), dk->f(),
                               dv->f(), ws.raw(), nullptr) == 0);
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  CHECK(BitEqual(Download(*dq, ref.dq.size()), dq_got));
  CHECK(BitEqual(Download(*dk, ref.dk.size()), dk_got));
  CHECK(BitEqual(Download(*dv, ref.dv.size()), dv_got));
}

// Runs the flash launchers and checks o, lse, dq, dk, dv; o also against the
// standard forward's o.
void CheckFlash(const mk::AttentionShape& sh, const Reference& ref, const DeviceInputs& in,
                const std::vector<float>& standard_o) {
  auto o = Alloc(ref.flash_o.size());
  auto lse = Alloc(ref.lse.size());
  auto dq = Alloc(ref.flash_dq.size());
  auto dk = Alloc(ref.flash_dk.size());
  auto dv = Alloc(ref.flash_dv.size());
  DeviceBuffer ws(static_cast<size_t>(mk::FlashAttentionBwdWorkspaceBytes(sh.b, sh.heads, sh.s)));
  REQUIRE((o->ok() && lse->ok() && dq->ok() && dk->ok() && dv->ok() && ws.ok()));

  CHECK(mk::cuda::FlashAttentionFwd(sh, in.q->f(), in.k->f(), in.v->f(), o->f(), lse->f(), nullptr) == 0);
  CHECK(mk::cuda::FlashAttentionBwd(sh, in.q->f(), in.k->f(), in.v->f(), o->f(), lse->f(), in.d_o->f(), dq->f(),
                                    dk->f(), dv->f(), ws.raw(), nullptr) == 0);
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);

  const auto o_got = Download(*o, ref.flash_o.size());
  CHECK(RelErr(o_got, ref.flash_o) < kRelTol);
  CHECK(RelErr(o_got, standard_o) < kRelTol);
  CHECK(RelErr(o_got, ref.o) < kRelTol);
  CHECK(RelErr(Download(*lse, ref.lse.size()), ref.lse) < kRelTol);
  const auto dq_got = Download(*dq, ref.flash_dq.size());
  const auto dk_got = Download(*dk, ref.flash_dk.size());
  const auto dv_got = Download(*dv, ref.flash_dv.size());
  CHECK(RelErr(dq_got, ref.flash_dq) < kRelTol);
  CHECK(RelErr(dk_got, ref.flash_dk) < kRelTol);
  CHECK(RelErr(dv_got, ref.flash_dv) < kRelTol);
  // Flash and standard compute the same gradients.
  CHECK(RelErr(dq_got, ref.dq) < kRelTol);
  CHECK(RelErr(dk_got, ref.dk) < kRelTol);
  CHECK(RelErr(dv_got, ref.dv) < kRelTol);

  CHECK(mk::cuda::FlashAttentionBwd(sh, in.q->f(), in.k->f(), in.v->f(), o->f(), lse->f(), in.d_o->f(), dq->f(),
                                    dk->f(), dv->f(), ws.raw(), nullptr) == 0);
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  CHECK(BitEqual(Download(*dq, ref.flash_dq.size()), dq_got));
  CHECK(BitEqual(Download(*dk, ref.flash_dk.size()), dk_got));
  CHECK(BitEqual(Download(*dv, ref.flash_dv.size()), dv_got));
}

void CheckShape(const mk::AttentionShape& sh, uint32_t seed) {
  INFO(Describe(sh));
  const Reference ref = RunReference(sh, seed);
  DeviceInputs in{Upload(ref.q), Upload(ref.k), Upload(ref.v), Upload(ref.d_o)};
  REQUIRE((in.q->ok() && in.k->ok() && in.v->ok() && in.d_o->ok()));
  std::vector<float> standard_o;
  CheckStandard(sh, ref, in, &standard_o);
  CheckFlash(sh, ref, in, standard_o);
}

TEST_CASE("attention launchers match the CPU reference") {
  uint32_t seed = 1;
  for (const int64_t kv_heads : {4, 2, 1}) {
    for (const int64_t s : {1, 63, 130}) {
      for (const int64_t dqk : {64, 192}) {
        for (const int64_t dv : {64, 128}) {
          for (const bool causal : {true, false}) {
            mk::AttentionShape sh;
            sh.b = 2;
            sh.heads = 4;
            sh.kv_heads = kv_heads;
            sh.s = s;
            sh.dqk = dqk;
            sh.dv = dv;
            sh.scale = 1.f / std::sqrt(static_cast<float>(dqk));
            sh.causal = causal;
            CheckShape(sh, seed++);
          }
        }
      }
    }
  }
}

TEST_CASE("odd head dims, the largest head dim, and a longer sequence") {
  const struct {
    int64_t kv_heads, s, dqk, dv;
  } cases[] = {{2, 97, 33, 17}, {1, 70, 256, 256}, {4, 300, 128, 128}};
  uint32_t seed = 1000;
  for (const auto& c : cases) {
    for (const bool causal : {true, false}) {
      mk::AttentionShape sh;
      sh.b = 2;
      sh.heads = 4;
      sh.kv_heads = c.kv_heads;
      sh.s = c.s;
      sh.dqk = c.dqk;
      sh.dv = c.dv;
      sh.scale = 1.f / std::sqrt(static_cast<float>(c.dqk));
      sh.causal = causal;
      CheckShape(sh, seed++);
    }
  }
}

TEST_CASE("token-major o and d_o ([b, s, heads, dv]) match the reference in the same layout") {
  // The reference (RunReference passes the shape on) lays o and d_o out the
  // same way, so every check of CheckShape applies unchanged.
  const struct {
    int64_t kv_heads, s, dqk, dv;
  } cases[] = {{4, 63, 64, 64}, {1, 130, 64, 128}, {2, 97, 33, 17}, {2, 1, 192, 64}};
  uint32_t seed = 2000;
  for (const auto& c : cases) {
    for (const bool causal : {true, false}) {
      mk::AttentionShape sh;
      sh.b = 2;
      sh.heads = 4;
      sh.kv_heads = c.kv_heads;
      sh.s = c.s;
      sh.dqk = c.dqk;
      sh.dv = c.dv;
      sh.scale = 1.f / std::sqrt(static_cast<float>(c.dqk));
      sh.causal = causal;
      sh.o_token_major = true;
      INFO("o_token_major");
      CheckShape(sh, seed++);
    }
  }
}

TEST_CASE("invalid shapes are rejected without launching") {
  mk::AttentionShape sh;
  sh.heads = 3;
  sh.kv_heads = 2;  // heads not a multiple of kv_heads
  sh.s = 4;
  sh.dqk = 8;
  sh.dv = 8;
  CHECK(mk::cuda::AttentionFwd(sh, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr) != 0);
  CHECK(mk::cuda::FlashAttentionFwd(sh, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr) != 0);
  sh.heads = 2;
  sh.dqk = 512;  // past the 256 head-dim bound
  CHECK(mk::cuda::FlashAttentionFwd(sh, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr) != 0);
  CHECK(mk::cuda::FlashAttentionBwd(sh, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                                    nullptr, nullptr, nullptr) != 0);
}

}  // namespace

#include "gpu_test_main.h"
