// CPU reference ops (MakeRefOps and the RefMath / AttentionMath templates
// behind it). Always runs.
//   - Forwards against independent, naive formulas.
//   - Every backward against central finite differences of the same
//     templated code run in double, with a random projection loss
//     L = sum(R * y); the float Ops are then checked against the double
//     gradients, which also proves the Ops wrappers pass their arguments on
//     in the right order.
//   - Dropout RNG properties and bit reproducibility of every op.
// Shapes are deliberately not multiples of the 64-wide GEMM tile and flash key
// block.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "memplan/kernels/ops.h"
#include "ops_ref_impl.h"
#include "ref_test_util.h"

namespace mk = memplan::kernels;
namespace mr = memplan::kernels::ref;

namespace {

using namespace memplan::test::kernels;
using MD = mr::RefMath<double>;
using AD = mr::AttentionMath<double>;

template <typename... V>
std::vector<uint8_t> Bytes(const V&... vs) {
  std::vector<uint8_t> out;
  auto append = [&out](const auto& v) {
    const auto* p = reinterpret_cast<const uint8_t*>(v.data());
    out.insert(out.end(), p, p + v.size() * sizeof(v[0]));
  };
  (append(vs), ...);
  return out;
}

// C = alpha * op(A) op(B) + beta * C0, three plain loops in double.
VecD NaiveGemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, double alpha, const VecD& a, const VecD& b,
               double beta, const VecD& c0) {
  VecD c(static_cast<size_t>(m * n));
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double s = 0;
      for (int64_t p = 0; p < k; ++p) {
        s += (ta ? a[p * m + i] : a[i * k + p]) * (tb ? b[j * k + p] : b[p * n + j]);
      }
      c[i * n + j] = alpha * s + (beta == 0 ? 0 : beta * c0[i * n + j]);
    }
  }
  return c;
}

std::string Name(bool ta, bool tb) { return std::string(ta ? "T" : "N") + (tb ? "T" : "N"); }

}  // namespace

// --- RNG and workspace formulas ---------------------------------------------

TEST_CASE("SplitMix64 is the standard generator; Uniform01 follows ops.h") {
  // The first two outputs of the reference splitmix64 seeded with 0.
  CHECK(mk::SplitMix64(0) == 0xE220A8397B1DCDAFull);
  CHECK(mk::SplitMix64(0x9E3779B97F4A7C15ull) == 0x6E789E6AA1B965F4ull);
  for (uint64_t i = 0; i < 1000; ++i) {
    const float u = mk::Uniform01(42, 7, i);
    CHECK(u >= 0.f);
    CHECK(u < 1.f);
    const uint64_t bits = mk::SplitMix64(42 ^ mk::SplitMix64(7 + i)) >> 40;
    CHECK(u == static_cast<float>(static_cast<double>(bits) / 16777216.0));
  }
}

TEST_CASE("Workspace formulas") {
  CHECK(mk::GemmWorkspaceBytes() == 32 * 1024 * 1024);
  CHECK(mk::AttentionBwdWorkspaceBytes(2, 3, 5) == 2 * 3 * 5 * 5 * 4);
  CHECK(mk::FlashAttentionBwdWorkspaceBytes(2, 3, 5) == 2 * 3 * 5 * 4);
}

// --- GEMM -------------------------------------------------------------------

TEST_CASE("Gemm matches a naive triple loop for every transpose") {
  auto ops = mk::MakeRefOps();
  const int64_t m = 70, n = 67, k = 131;
  const VecF a = Rand(m * k, 1), b = Rand(k * n, 2), c0 = Rand(m * n, 3);
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      CAPTURE(Name(ta, tb));
      VecF c = c0;
      ops->Gemm(ta, tb, m, n, k, 1.5f, a.data(), b.data(), 0.5f, c.data(), nullptr);
      ExpectClose(c, NaiveGemm(ta, tb, m, n, k, 1.5, ToD(a), ToD(b), 0.5, ToD(c0)), kF32Tol, "gemm");

      // beta == 0: C is not read, so NaNs in it do not propagate.
      VecF nan_c(c0.size(), std::numeric_limits<float>::quiet_NaN());
      ops->Gemm(ta, tb, m, n, k, 2.f, a.data(), b.data(), 0.f, nan_c.data(), nullptr);
      ExpectClose(nan_c, NaiveGemm(ta, tb, m, n, k, 2.0, ToD(a), ToD(b), 0.0, {}), kF32Tol, "gemm beta=0");
    }
  }
  // k == 0: C = beta * C.
  VecF c = c0;
  ops->Gemm(false, false, m, n, 0, 1.f, nullptr, nullptr, 2.f, c.data(), nullptr);
  for (size_t i = 0; i < c.size(); ++i) CHECK(c[i] == 2.f * c0[i]);
}

TEST_CASE("Gemm is bit for bit the in-order float sum its header states") {
  // RefMath::Gemm's law (ops_ref_impl.h): acc = 0; acc += op(A)[i,p] *
  // op(B)[p,j] for p = 0..k-1; C = alpha * acc (+ beta * C). The packed,
  // register-blocked loop must give exactly these bits (the executors'
  // one-process against many-process checks compare losses bit for bit).
  // Shapes straddle the 4-row and 8-column blocks; strides are padded.
  auto ops = mk::MakeRefOps();
  int checked = 0;
  for (const auto& [m, n, k] : {std::tuple<int64_t, int64_t, int64_t>{1, 1, 1}, {5, 9, 3}, {7, 13, 70}, {4, 8, 16},
                                {66, 3, 131}, {3, 66, 2}}) {
    for (bool ta : {false, true}) {
      for (bool tb : {false, true}) {
        for (float beta : {0.f, 0.5f}) {
          CAPTURE(m);
          CAPTURE(n);
          CAPTURE(k);
          CAPTURE(Name(ta, tb));
          CAPTURE(beta);
          const int64_t lda = (ta ? m : k) + 3, ldb = (tb ? k : n) + 1, ldc = n + 2;
          const VecF a = Rand((ta ? k : m) * lda, 21), b = Rand((tb ? n : k) * ldb, 22), c0 = Rand(m * ldc, 23);
          VecF got = c0, want = c0;
          mr::RefMath<float>::GemmLd(ta, tb, m, n, k, -1.25f, a.data(), lda, b.data(), ldb, beta, got.data(), ldc);
          for (int64_t i = 0; i < m; ++i) {
            for (int64_t j = 0; j < n; ++j) {
              volatile float acc = 0.f;  // volatile: one rounding per step, as stated
              for (int64_t p = 0; p < k; ++p) {
                const float x = ta ? a[p * lda + i] : a[i * lda + p];
                const float y = tb ? b[j * ldb + p] : b[p * ldb + j];
                const volatile float prod = x * y;
                acc = acc + prod;
              }
              float& out = want[i * ldc + j];
              const volatile float scaled = -1.25f * acc;
              out = beta == 0.f ? scaled : scaled + static_cast<float>(beta * out);
            }
          }
          CHECK(Bytes(got) == Bytes(want));
          ++checked;
        }
      }
    }
  }
  CHECK(checked == 6 * 8);
}

TEST_CASE("Gemm backward (all transposes) matches finite differences") {
  // The backward of C = alpha op(A) op(B) + beta C is itself two GEMMs; this
  // checks the transpose bookkeeping a caller uses to build them.
  const int64_t m = 67, n = 4, k = 5;
  const double alpha = 1.25, beta = -0.75;
  VecD a = ToD(Rand(m * k, 11)), b = ToD(Rand(k * n, 12)), c0 = ToD(Rand(m * n, 13));
  const VecD r = ToD(Rand(m * n, 14));
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      CAPTURE(Name(ta, tb));
      auto loss = [&] {
        VecD c = c0;
        MD::Gemm(ta, tb, m, n, k, alpha, a.data(), b.data(), beta, c.data());
        return Dot(r, c);
      };
      VecD da(a.size()), db(b.size()), dc(c0.size());
      if (!ta) {  // dA [m,k] = alpha dC op(B)^T
        MD::Gemm(false, !tb, m, k, n, alpha, r.data(), b.data(), 0.0, da.data());
      } else {  // dA [k,m] = alpha op(B) dC^T
        MD::Gemm(tb, true, k, m, n, alpha, b.data(), r.data(), 0.0, da.data());
      }
      if (!tb) {  // dB [k,n] = alpha op(A)^T dC
        MD::Gemm(!ta, false, k, n, m, alpha, a.data(), r.data(), 0.0, db.data());
      } else {  // dB [n,k] = alpha dC^T op(A)
        MD::Gemm(true, ta, n, k, m, alpha, r.data(), a.data(), 0.0, db.data());
      }
      for (size_t i = 0; i < dc.size(); ++i) dc[i] = beta * r[i];
      ExpectClose(da, NumGrad(a, loss), kFdTol, "gemm dA");
      ExpectClose(db, NumGrad(b, loss), kFdTol, "gemm dB");
      ExpectClose(dc, NumGrad(c0, loss), kFdTol, "gemm dC");
    }
  }
}

TEST_CASE("GemmStridedBatched: row strides, batch strides, broadcast operands, beta and k == 0") {
  auto ops = mk::MakeRefOps();
  const int64_t m = 67, n = 5, k = 70, batch = 3;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      for (float beta : {0.f, 0.5f}) {
        CAPTURE(Name(ta, tb));
        CAPTURE(beta);
        // Stored shapes and padded row strides; B is broadcast (stride 0) when tb.
        const int64_t rows_a = ta ? k : m, cols_a = ta ? m : k, lda = cols_a + 3, stride_a = rows_a * lda + 7;
        const int64_t rows_b = tb ? n : k, cols_b = tb ? k : n, ldb = cols_b + 2;
        const int64_t stride_b = tb ? 0 : rows_b * ldb + 1;
        const int64_t ldc = n + 4, stride_c = m * ldc + 5;
        const VecF a = Rand(batch * stride_a, 15), b = Rand(rows_b * ldb + 2 * stride_b, 16);
        VecF c0 = Rand(batch * stride_c, 17);
        VecF c = c0;
        if (beta == 0.f) {
          for (int64_t i = 0; i < batch; ++i) {
            for (int64_t r = 0; r < m; ++r) std::fill_n(c.begin() + i * stride_c + r * ldc, n, nan);
          }
        }
        ops->GemmStridedBatched(ta, tb, m, n, k, 1.5f, a.data(), lda, stride_a, b.data(), ldb, stride_b, beta,
                                c.data(), ldc, stride_c, batch, nullptr);
        for (int64_t i = 0; i < batch; ++i) {
          // Tight copies of the batch entry through the plain Gemm: the same bits.
          VecF at(static_cast<size_t>(rows_a * cols_a)), bt(static_cast<size_t>(rows_b * cols_b));
          VecF ct(static_cast<size_t>(m * n));
          for (int64_t r = 0; r < rows_a; ++r) {
            std::copy_n(a.begin() + i * stride_a + r * lda, cols_a, at.begin() + r * cols_a);
          }
          for (int64_t r = 0; r < rows_b; ++r) {
            std::copy_n(b.begin() + i * stride_b + r * ldb, cols_b, bt.begin() + r * cols_b);
          }
          for (int64_t r = 0; r < m; ++r) std::copy_n(c0.begin() + i * stride_c + r * ldc, n, ct.begin() + r * n);
          const VecD want = NaiveGemm(ta, tb, m, n, k, 1.5, ToD(at), ToD(bt), beta, ToD(ct));
          ops->Gemm(ta, tb, m, n, k, 1.5f, at.data(), bt.data(), beta, ct.data(), nullptr);
          VecF got(ct.size());
          for (int64_t r = 0; r < m; ++r) std::copy_n(c.begin() + i * stride_c + r * ldc, n, got.begin() + r * n);
          CHECK(Bytes(got) == Bytes(ct));
          ExpectClose(got, want, kF32Tol, "strided batched gemm");
        }
        // Nothing outside the m x n entries of each C_i is touched.
        for (int64_t e = 0; e < batch * stride_c; ++e) {
          const int64_t i = e / stride_c, r = (e % stride_c) / ldc, col = (e % stride_c) % ldc;
          if (i >= batch || r >= m || col >= n) CHECK(c[e] == c0[e]);
        }
      }
    }
  }
  // k == 0: C = beta * C; beta == 0 writes zeros over NaN.
  const int64_t ldc = 9, stride_c = 4 * ldc + 1;
  const VecF c0 = Rand(2 * stride_c, 18);
  VecF c = c0, z(c0.size(), nan);
  ops->GemmStridedBatched(false, false, 4, 7, 0, 1.f, nullptr, 1, 0, nullptr, 7, 0, 2.f, c.data(), ldc, stride_c, 2,
                          nullptr);
  ops->GemmStridedBatched(false, false, 4, 7, 0, 1.f, nullptr, 1, 0, nullptr, 7, 0, 0.f, z.data(), ldc, stride_c, 2,
                          nullptr);
  for (int64_t e = 0; e < 2 * stride_c; ++e) {
    const bool inside = (e % stride_c) / ldc < 4 && (e % stride_c) % ldc < 7;
    CHECK(c[e] == (inside ? 2.f * c0[e] : c0[e]));
    if (inside) CHECK(z[e] == 0.f);
  }
}

TEST_CASE("GroupedGemm forward and backward") {
  auto ops = mk::MakeRefOps();
  // Expert 1 is empty; expert 2 spans more than one 64-row tile.
  const int64_t experts = 4, k = 3, n = 5;
  const int64_t offsets[] = {0, 5, 5, 72, 75};
  const int64_t rows = offsets[experts];
  const VecF xf = Rand(rows * k, 21), wf = Rand(experts * k * n, 22), rf = Rand(rows * n, 23);
  const VecF dw0f = Rand(experts * k * n, 24);

  VecF y(static_cast<size_t>(rows * n));
  ops->GroupedGemm(offsets, experts, k, n, xf.data(), wf.data(), y.data(), nullptr);
  VecD want(y.size());
  for (int64_t e = 0; e < experts; ++e) {
    for (int64_t t = offsets[e]; t < offsets[e + 1]; ++t) {
      for (int64_t j = 0; j < n; ++j) {
        double s = 0;
        for (int64_t p = 0; p < k; ++p) s += double(xf[t * k + p]) * wf[(e * k + p) * n + j];
        want[t * n + j] = s;
      }
    }
  }
  ExpectClose(y, want, kF32Tol, "grouped gemm");

  VecD x = ToD(xf), w = ToD(wf);
  const VecD r = ToD(rf);
  auto loss = [&] {
    VecD yd(static_cast<size_t>(rows * n));
    MD::GroupedGemm(offsets, experts, k, n, x.data(), w.data(), yd.data());
    return Dot(r, yd);
  };
  VecD dx(x.size()), dw = ToD(dw0f);
  MD::GroupedGemmBwd(offsets, experts, k, n, x.data(), w.data(), r.data(), dx.data(), dw.data());
  for (size_t i = 0; i < dw.size(); ++i) dw[i] -= dw0f[i];  // dw accumulates
  ExpectClose(dx, NumGrad(x, loss), kFdTol, "grouped gemm dx");
  ExpectClose(dw, NumGrad(w, loss), kFdTol, "grouped gemm dw");

  VecF dxf(x.size(), std::numeric_limits<float>::quiet_NaN()), dwf = dw0f;
  ops->GroupedGemmBwd(offsets, experts, k, n, xf.data(), wf.data(), rf.data(), dxf.data(), dwf.data(), nullptr);
  for (size_t i = 0; i < dwf.size(); ++i) dwf[i] -= dw0f[i];
  ExpectClose(dxf, dx, kF32Tol, "grouped gemm dx (float)");
  ExpectClose(dwf, dw, kF32Tol, "grouped gemm dw (float)");
}

// --- Norms ------------------------------------------------------------------

TEST_CASE("LayerNorm forward normalizes; backward matches finite differences") {
  auto ops = mk::MakeRefOps();
  const int64_t rows = 4, cols = 67;
  const float eps = 1e-5f;
  const VecF xf = Rand(rows * cols, 31, -2.f, 3.f), gf = Rand(cols, 32, 0.5f, 1.5f), bf = Rand(cols, 33);
  const VecF rf = Rand(rows * cols, 34), dg0 = Rand(cols, 35), db0 = Rand(cols, 36);

  VecF y(xf.size());
  const VecF ones(static_cast<size_t>(cols), 1.f), zeros(static_cast<size_t>(cols), 0.f);
  ops->LayerNormFwd(xf.data(), ones.data(), zeros.data(), rows, cols, eps, y.data());
  for (int64_t r = 0; r < rows; ++r) {
    double mean = 0, sq = 0;
    for (int64_t c = 0; c < cols; ++c) mean += y[r * cols + c];
    for (int64_t c = 0; c < cols; ++c) sq += double(y[r * cols + c]) * y[r * cols + c];
    CHECK(std::fabs(mean / cols) < 1e-6);
    CHECK(std::fabs(sq / cols - 1) < 1e-4);
  }

  VecD x = ToD(xf), g = ToD(gf), b = ToD(bf);
  const VecD r = ToD(rf);
  auto loss = [&] {
    VecD yd(x.size());
    MD::LayerNormFwd(x.data(), g.data(), b.data(), rows, cols, eps, yd.data());
    return Dot(r, yd);
  };
  VecD dx(x.size()), dg = ToD(dg0), db = ToD(db0);
  MD::LayerNormBwd(x.data(), g.data(), r.data(), rows, cols, eps, dx.data(), dg.data(), db.data());
  for (size_t i = 0; i < dg.size(); ++i) {
    dg[i] -= dg0[i];
    db[i] -= db0[i];
  }
  ExpectClose(dx, NumGrad(x, loss), kFdTol, "layernorm dx");
  ExpectClose(dg, NumGrad(g, loss), kFdTol, "layernorm dgamma");
  ExpectClose(db, NumGrad(b, loss), kFdTol, "layernorm dbeta");

  VecF dxf(x.size()), dgf = dg0, dbf = db0;
  ops->LayerNormBwd(xf.data(), gf.data(), rf.data(), rows, cols, eps, dxf.data(), dgf.data(), dbf.data());
  for (size_t i = 0; i < dgf.size(); ++i) {
    dgf[i] -= dg0[i];
    dbf[i] -= db0[i];
  }
  ExpectClose(dxf, dx, kF32Tol, "layernorm dx (float)");
  ExpectClose(dgf, dg, kF32Tol, "layernorm dgamma (float)");
  ExpectClose(dbf, db, kF32Tol, "layernorm dbeta (float)");
}

TEST_CASE("RMSNorm forward normalizes; backward matches finite differences") {
  auto ops = mk::MakeRefOps();
  const int64_t rows = 5, cols = 67;
  const float eps = 1e-6f;
  const VecF xf = Rand(rows * cols, 41, -2.f, 3.f), gf = Rand(cols, 42, 0.5f, 1.5f);
  const VecF rf = Rand(rows * cols, 43), dg0 = Rand(cols, 44);

  VecF y(xf.size());
  const VecF ones(static_cast<size_t>(cols), 1.f);
  ops->RmsNormFwd(xf.data(), ones.data(), rows, cols, eps, y.data());
  for (int64_t r = 0; r < rows; ++r) {
    double sq = 0;
    for (int64_t c = 0; c < cols; ++c) sq += double(y[r * cols + c]) * y[r * cols + c];
    CHECK(std::fabs(sq / cols - 1) < 1e-4);
  }

  VecD x = ToD(xf), g = ToD(gf);
  const VecD r = ToD(rf);
  auto loss = [&] {
    VecD yd(x.size());
    MD::RmsNormFwd(x.data(), g.data(), rows, cols, eps, yd.data());
    return Dot(r, yd);
  };
  VecD dx(x.size()), dg = ToD(dg0);
  MD::RmsNormBwd(x.data(), g.data(), r.data(), rows, cols, eps, dx.data(), dg.data());
  for (size_t i = 0; i < dg.size(); ++i) dg[i] -= dg0[i];
  ExpectClose(dx, NumGrad(x, loss), kFdTol, "rmsnorm dx");
  ExpectClose(dg, NumGrad(g, loss), kFdTol, "rmsnorm dgamma");

  VecF dxf(x.size()), dgf = dg0;
  ops->RmsNormBwd(xf.data(), gf.data(), rf.data(), rows, cols, eps, dxf.data(), dgf.data());
  for (size_t i = 0; i < dgf.size(); ++i) dgf[i] -= dg0[i];
  ExpectClose(dxf, dx, kF32Tol, "rmsnorm dx (float)");
  ExpectClose(dgf, dg, kF32Tol, "rmsnorm dgamma (float)");
}

// --- Activations, dropout, add ------------------------------------------------

TEST_CASE("GELU (tanh form) forward and backward") {
  auto ops = mk::MakeRefOps();
  const float pts[] = {0.f, 1.f, -1.f, 3.f};
  float y[4];
  ops->GeluFwd(pts, 4, y);
  CHECK(y[0] == 0.f);
  CHECK(y[1] == doctest::Approx(0.8411919906).epsilon(1e-6));
  CHECK(y[2] == doctest::Approx(-0.1588080094).epsilon(1e-6));
  CHECK(y[3] == doctest::Approx(2.9963626079).epsilon(1e-6));

  const int64_t n = 101;
  const VecF xf = Rand(n, 51, -4.f, 4.f), rf = Rand(n, 52);
  VecD x = ToD(xf);
  const VecD r = ToD(rf);
  auto loss = [&] {
    VecD yd(x.size());
    MD::GeluFwd(x.data(), n, yd.data());
    return Dot(r, yd);
  };
  VecD dx(x.size());
  MD::GeluBwd(x.data(), r.data(), n, dx.data());
  ExpectClose(dx, NumGrad(x, loss), kFdTol, "gelu dx");
  VecF dxf(x.size());
  ops->GeluBwd(xf.data(), rf.data(), n, dxf.data());
  ExpectClose(dxf, dx, kF32Tol, "gelu dx (float)");
}

TEST_CASE("SwiGLU forward and backward") {
  auto ops = mk::MakeRefOps();
  const int64_t rows = 3, f = 67;
  const VecF xf = Rand(rows * 2 * f, 61, -3.f, 3.f), rf = Rand(rows * f, 62);
  VecF y(rf.size());
  ops->SwigluFwd(xf.data(), rows, f, y.data());
  VecD want(y.size());
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < f; ++j) {
      const double g = xf[r * 2 * f + j], u = xf[r * 2 * f + f + j];
      want[r * f + j] = g / (1 + std::exp(-g)) * u;
    }
  }
  ExpectClose(y, want, kF32Tol, "swiglu");

  VecD x = ToD(xf);
  const VecD r = ToD(rf);
  auto loss = [&] {
    VecD yd(r.size());
    MD::SwigluFwd(x.data(), rows, f, yd.data());
    return Dot(r, yd);
  };
  VecD dx(x.size());
  MD::SwigluBwd(x.data(), r.data(), rows, f, dx.data());
  ExpectClose(dx, NumGrad(x, loss), kFdTol, "swiglu dx");
  VecF dxf(x.size());
  ops->SwigluBwd(xf.data(), rf.data(), rows, f, dxf.data());
  ExpectClose(dxf, dx, kF32Tol, "swiglu dx (float)");
}

TEST_CASE("Dropout: keep rule, scaling, backward with the saved mask") {
  auto ops = mk::MakeRefOps();
  const int64_t n = 257;
  const float p = 0.25f;
  const uint64_t seed = 1234, offset = 99;
  const VecF xf = Rand(n, 71), rf = Rand(n, 72);
  VecF y(xf.size());
  std::vector<uint8_t> mask(xf.size());
  ops->DropoutFwd(xf.data(), n, p, seed, offset, y.data(), mask.data());
  int64_t kept = 0;
  for (int64_t i = 0; i < n; ++i) {
    const bool keep = mk::Uniform01(seed, offset, static_cast<uint64_t>(i)) >= p;
    CHECK(mask[i] == (keep ? 1 : 0));
    CHECK(y[i] == (keep ? xf[i] / (1.f - p) : 0.f));
    kept += keep;
  }
  CHECK(kept > 0);
  CHECK(kept < n);

  // The mask is fixed by (seed, offset), so the op is linear in x.
  VecD x = ToD(xf);
  const VecD r = ToD(rf);
  std::vector<uint8_t> mask_d(xf.size());
  auto loss = [&] {
    VecD yd(x.size());
    MD::DropoutFwd(x.data(), n, p, seed, offset, yd.data(), mask_d.data());
    return Dot(r, yd);
  };
  VecD dx(x.size());
  MD::DropoutBwd(r.data(), mask.data(), n, p, dx.data());
  ExpectClose(dx, NumGrad(x, loss), kFdTol, "dropout dx");
  VecF dxf(x.size());
  ops->DropoutBwd(rf.data(), mask.data(), n, p, dxf.data());
  ExpectClose(dxf, dx, kF32Tol, "dropout dx (float)");
}

TEST_CASE("Dropout masks are determined by (seed, offset) and keep 1-p of the elements") {
  auto ops = mk::MakeRefOps();
  const int64_t n = 100000;
  const float p = 0.3f;
  const VecF x(static_cast<size_t>(n), 1.f);
  VecF y(x.size());
  std::vector<uint8_t> m1(x.size()), m2(x.size()), m3(x.size()), m4(x.size());
  ops->DropoutFwd(x.data(), n, p, 7, 1000, y.data(), m1.data());
  ops->DropoutFwd(x.data(), n, p, 7, 1000, y.data(), m2.data());
  CHECK(m1 == m2);
  ops->DropoutFwd(x.data(), n, p, 8, 1000, y.data(), m3.data());
  CHECK(m1 != m3);
  // Counter-based: offset o + 5 is the same stream shifted by 5 elements.
  ops->DropoutFwd(x.data(), n, p, 7, 1005, y.data(), m4.data());
  CHECK(std::equal(m4.begin(), m4.end() - 5, m1.begin() + 5));

  int64_t kept = 0;
  for (uint8_t m : m1) kept += m;
  const double mean = n * (1.0 - p), sigma = std::sqrt(n * p * (1.0 - p));
  CHECK_MESSAGE(std::fabs(kept - mean) <= 3 * sigma, "kept " << kept << " of " << n);

  // p = 1 drops everything without dividing by zero.
  ops->DropoutFwd(x.data(), 1000, 1.f, 7, 0, y.data(), m1.data());
  for (int64_t i = 0; i < 1000; ++i) CHECK(y[i] == 0.f);
}

TEST_CASE("Add") {
  auto ops = mk::MakeRefOps();
  const VecF a = Rand(37, 81), b = Rand(37, 82);
  VecF y(a.size());
  ops->Add(a.data(), b.data(), 37, y.data());
  for (size_t i = 0; i < y.size(); ++i) CHECK(y[i] == a[i] + b[i]);
}

// --- Attention ----------------------------------------------------------------

namespace {

size_t QSize(const mk::AttentionShape& sh) { return static_cast<size_t>(sh.b * sh.heads * sh.s * sh.dqk); }
size_t KSize(const mk::AttentionShape& sh) { return static_cast<size_t>(sh.b * sh.kv_heads * sh.s * sh.dqk); }
size_t VSize(const mk::AttentionShape& sh) { return static_cast<size_t>(sh.b * sh.kv_heads * sh.s * sh.dv); }
size_t OSize(const mk::AttentionShape& sh) { return static_cast<size_t>(sh.b * sh.heads * sh.s * sh.dv); }
size_t PSize(const mk::AttentionShape& sh) { return static_cast<size_t>(sh.b * sh.heads * sh.s * sh.s); }
size_t LSize(const mk::AttentionShape& sh) { return static_cast<size_t>(sh.b * sh.heads * sh.s); }

// Softmax(scale q k^T, masked) v written from the definition in ops.h, with
// the GQA map spelled out; also returns the log-sum-exp of each row.
void NaiveAttention(const mk::AttentionShape& sh, const VecD& q, const VecD& k, const VecD& v, VecD* o, VecD* lse) {
  o->assign(OSize(sh), 0);
  lse->assign(LSize(sh), 0);
  for (int64_t bb = 0; bb < sh.b; ++bb) {
    for (int64_t h = 0; h < sh.heads; ++h) {
      const int64_t kvh = h / (sh.heads / sh.kv_heads);
      for (int64_t i = 0; i < sh.s; ++i) {
        VecD sc(static_cast<size_t>(sh.s), -std::numeric_limits<double>::infinity());
        double mx = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j < sh.s; ++j) {
          if (sh.causal && j > i) continue;
          double dot = 0;
          for (int64_t c = 0; c < sh.dqk; ++c) {
            dot += q[((bb * sh.heads + h) * sh.s + i) * sh.dqk + c] *
                   k[((bb * sh.kv_heads + kvh) * sh.s + j) * sh.dqk + c];
          }
          sc[j] = double(sh.scale) * dot;
          mx = std::max(mx, sc[j]);
        }
        double sum = 0;
        for (int64_t j = 0; j < sh.s; ++j) sum += std::exp(sc[j] - mx);
        (*lse)[(bb * sh.heads + h) * sh.s + i] = mx + std::log(sum);
        for (int64_t j = 0; j < sh.s; ++j) {
          const double pj = std::exp(sc[j] - mx) / sum;
          for (int64_t c = 0; c < sh.dv; ++c) {
            (*o)[((bb * sh.heads + h) * sh.s + i) * sh.dv + c] += pj * v[((bb * sh.kv_heads + kvh) * sh.s + j) * sh.dv + c];
          }
        }
      }
    }
  }
}

}  // namespace

TEST_CASE("Attention forward: naive formula, probs, flash == standard") {
  auto ops = mk::MakeRefOps();
  for (bool causal : {true, false}) {
    CAPTURE(causal);
    // s = 70 puts the flash forward over two key blocks (64 + 6).
    mk::AttentionShape sh{.b = 2, .heads = 4, .kv_heads = 2, .s = 70, .dqk = 16, .dv = 12, .scale = 0.25f,
                          .causal = causal};
    const VecF q = Rand(static_cast<int64_t>(QSize(sh)), 101, -2.f, 2.f);
    const VecF k = Rand(static_cast<int64_t>(KSize(sh)), 102, -2.f, 2.f);
    const VecF v = Rand(static_cast<int64_t>(VSize(sh)), 103);
    VecF probs(PSize(sh)), o(OSize(sh)), of(OSize(sh)), lse(LSize(sh));
    ops->AttentionFwd(sh, q.data(), k.data(), v.data(), probs.data(), o.data());
    ops->FlashAttentionFwd(sh, q.data(), k.data(), v.data(), of.data(), lse.data());

    VecD want_o, want_lse;
    NaiveAttention(sh, ToD(q), ToD(k), ToD(v), &want_o, &want_lse);
    ExpectClose(o, want_o, kF32Tol, "attention o");
    ExpectClose(of, ToD(o), 1e-5, "flash o vs standard o");
    ExpectClose(lse, want_lse, kF32Tol, "flash lse");

    for (int64_t row = 0; row < sh.b * sh.heads * sh.s; ++row) {
      const int64_t i = row % sh.s;
      double sum = 0;
      for (int64_t j = 0; j < sh.s; ++j) {
        const float pj = probs[row * sh.s + j];
        if (causal && j > i) CHECK(pj == 0.f);
        sum += pj;
      }
      CHECK(std::fabs(sum - 1) < 1e-5);
    }
  }
}

TEST_CASE("Attention backward (standard and flash) matches finite differences") {
  auto ops = mk::MakeRefOps();
  const mk::AttentionShape shapes[] = {
      // GQA: 4 query heads on 2 kv heads.
      {.b = 2, .heads = 4, .kv_heads = 2, .s = 9, .dqk = 3, .dv = 4, .scale = 0.7f},
      // Two flash key blocks (64 + 2); all heads share one kv head.
      {.b = 1, .heads = 2, .kv_heads = 1, .s = 66, .dqk = 2, .dv = 3, .scale = 0.5f},
  };
  for (mk::AttentionShape sh : shapes) {
    for (bool causal : {true, false}) {
      sh.causal = causal;
      CAPTURE(sh.s);
      CAPTURE(causal);
      const VecF qf = Rand(static_cast<int64_t>(QSize(sh)), 111, -2.f, 2.f);
      const VecF kf = Rand(static_cast<int64_t>(KSize(sh)), 112, -2.f, 2.f);
      const VecF vf = Rand(static_cast<int64_t>(VSize(sh)), 113);
      const VecF rf = Rand(static_cast<int64_t>(OSize(sh)), 114);
      VecD q = ToD(qf), k = ToD(kf), v = ToD(vf);
      const VecD r = ToD(rf);

      for (bool flash : {false, true}) {
        CAPTURE(flash);
        auto forward = [&](VecD* o, VecD* saved) {
          o->assign(OSize(sh), 0);
          if (flash) {
            saved->assign(LSize(sh), 0);
            AD::FlashAttentionFwd(sh, q.data(), k.data(), v.data(), o->data(), saved->data());
          } else {
            saved->assign(PSize(sh), 0);
            AD::AttentionFwd(sh, q.data(), k.data(), v.data(), saved->data(), o->data());
          }
        };
        auto loss = [&] {
          VecD o, saved;
          forward(&o, &saved);
          return Dot(r, o);
        };
        VecD o, saved;
        forward(&o, &saved);
        VecD dq(q.size()), dk(k.size()), dv(v.size());
        if (flash) {
          VecD ws(LSize(sh));
          AD::FlashAttentionBwd(sh, q.data(), k.data(), v.data(), o.data(), saved.data(), r.data(), dq.data(),
                                dk.data(), dv.data(), ws.data());
        } else {
          VecD ws(PSize(sh));
          AD::AttentionBwd(sh, q.data(), k.data(), v.data(), saved.data(), r.data(), dq.data(), dk.data(),
                           dv.data(), ws.data());
        }
        ExpectClose(dq, NumGrad(q, loss), kFdTol, "attention dq");
        ExpectClose(dk, NumGrad(k, loss), kFdTol, "attention dk");
        ExpectClose(dv, NumGrad(v, loss), kFdTol, "attention dv");

        // Float Ops; outputs pre-filled with NaN to prove they are overwritten.
        const float nan = std::numeric_limits<float>::quiet_NaN();
        VecF of(OSize(sh)), dqf(q.size(), nan), dkf(k.size(), nan), dvf(v.size(), nan);
        if (flash) {
          VecF lse(LSize(sh)), ws(LSize(sh));
          ops->FlashAttentionFwd(sh, qf.data(), kf.data(), vf.data(), of.data(), lse.data());
          ops->FlashAttentionBwd(sh, qf.data(), kf.data(), vf.data(), of.data(), lse.data(), rf.data(), dqf.data(),
                                 dkf.data(), dvf.data(), ws.data());
        } else {
          VecF probs(PSize(sh)), ws(PSize(sh));
          ops->AttentionFwd(sh, qf.data(), kf.data(), vf.data(), probs.data(), of.data());
          ops->AttentionBwd(sh, qf.data(), kf.data(), vf.data(), probs.data(), rf.data(), dqf.data(), dkf.data(),
                            dvf.data(), ws.data());
        }
        ExpectClose(dqf, dq, kF32Tol, "attention dq (float)");
        ExpectClose(dkf, dk, kF32Tol, "attention dk (float)");
        ExpectClose(dvf, dv, kF32Tol, "attention dv (float)");
      }
    }
  }
}

TEST_CASE("Attention with o_token_major: the transpose of the head-major o and d_o, bit for bit") {
  auto ops = mk::MakeRefOps();
  for (bool causal : {true, false}) {
    CAPTURE(causal);
    mk::AttentionShape hm{.b = 2, .heads = 4, .kv_heads = 2, .s = 70, .dqk = 8, .dv = 6, .scale = 0.3f,
                          .causal = causal};
    mk::AttentionShape tm = hm;
    tm.o_token_major = true;
    const VecF q = Rand(static_cast<int64_t>(QSize(hm)), 231), k = Rand(static_cast<int64_t>(KSize(hm)), 232);
    const VecF v = Rand(static_cast<int64_t>(VSize(hm)), 233), d_o = Rand(static_cast<int64_t>(OSize(hm)), 234);
    // [b, heads, s, dv] -> [b, s, heads, dv].
    auto to_token_major = [&](const VecF& x) {
      VecF y(x.size());
      for (int64_t bb = 0; bb < hm.b; ++bb) {
        for (int64_t h = 0; h < hm.heads; ++h) {
          for (int64_t i = 0; i < hm.s; ++i) {
            std::copy_n(x.begin() + ((bb * hm.heads + h) * hm.s + i) * hm.dv, hm.dv,
                        y.begin() + ((bb * hm.s + i) * hm.heads + h) * hm.dv);
          }
        }
      }
      return y;
    };
    const VecF d_o_tm = to_token_major(d_o);
    for (bool flash : {false, true}) {
      CAPTURE(flash);
      struct Out {
        VecF o, saved, dq, dk, dv;
      };
      auto run = [&](const mk::AttentionShape& sh, const VecF& dout) {
        Out r{VecF(OSize(sh)), VecF(flash ? LSize(sh) : PSize(sh)), VecF(QSize(sh)), VecF(KSize(sh)),
              VecF(VSize(sh))};
        VecF ws(flash ? LSize(sh) : PSize(sh));
        if (flash) {
          ops->FlashAttentionFwd(sh, q.data(), k.data(), v.data(), r.o.data(), r.saved.data());
          ops->FlashAttentionBwd(sh, q.data(), k.data(), v.data(), r.o.data(), r.saved.data(), dout.data(),
                                 r.dq.data(), r.dk.data(), r.dv.data(), ws.data());
        } else {
          ops->AttentionFwd(sh, q.data(), k.data(), v.data(), r.saved.data(), r.o.data());
          ops->AttentionBwd(sh, q.data(), k.data(), v.data(), r.saved.data(), dout.data(), r.dq.data(), r.dk.data(),
                            r.dv.data(), ws.data());
        }
        return r;
      };
      const Out a = run(hm, d_o), b = run(tm, d_o_tm);
      CHECK(Bytes(to_token_major(a.o)) == Bytes(b.o));
      CHECK(Bytes(a.saved, a.dq, a.dk, a.dv) == Bytes(b.saved, b.dq, b.dk, b.dv));
    }
  }
}

// --- Router, dispatch, combine --------------------------------------------------

TEST_CASE("Router forward: probabilities, sorted top-k, ties to the lower index") {
  auto ops = mk::MakeRefOps();
  const int64_t tokens = 6, experts = 9, top_k = 3;
  const VecF logits = Rand(tokens * experts, 121, -3.f, 3.f);
  for (bool sigmoid : {false, true}) {
    for (bool renorm : {false, true}) {
      CAPTURE(sigmoid);
      CAPTURE(renorm);
      VecF probs(logits.size()), wts(static_cast<size_t>(tokens * top_k));
      std::vector<int32_t> idx(wts.size());
      ops->RouterFwd(logits.data(), tokens, experts, top_k, sigmoid, renorm, probs.data(), idx.data(), wts.data());
      for (int64_t t = 0; t < tokens; ++t) {
        const float* p = probs.data() + t * experts;
        double sum_p = 0;
        for (int64_t e = 0; e < experts; ++e) {
          const double l = logits[t * experts + e];
          const double want = sigmoid ? 1 / (1 + std::exp(-l)) : 0;  // softmax checked by its sum
          if (sigmoid) CHECK(p[e] == doctest::Approx(want).epsilon(1e-6));
          sum_p += p[e];
        }
        if (!sigmoid) CHECK(std::fabs(sum_p - 1) < 1e-6);
        double sum_w = 0;
        for (int64_t i = 0; i < top_k; ++i) {
          const int32_t e = idx[t * top_k + i];
          if (i > 0) CHECK(p[e] <= p[idx[t * top_k + i - 1]]);
          // Nothing unselected beats a selected expert.
          for (int64_t o = 0; o < experts; ++o) {
            if (std::find(&idx[t * top_k], &idx[t * top_k] + top_k, o) == &idx[t * top_k] + top_k) {
              CHECK(p[o] <= p[e]);
            }
          }
          sum_w += wts[t * top_k + i];
          if (!renorm) CHECK(wts[t * top_k + i] == p[e]);
        }
        if (renorm) CHECK(std::fabs(sum_w - 1) < 1e-6);
      }
    }
  }

  // Ties: experts 1, 2, 4 share the top logit; lower index first.
  const float tied[] = {1.f, 3.f, 3.f, 0.f, 3.f};
  float probs[5], wts[3];
  int32_t idx[3];
  ops->RouterFwd(tied, 1, 5, 3, false, false, probs, idx, wts);
  CHECK(idx[0] == 1);
  CHECK(idx[1] == 2);
  CHECK(idx[2] == 4);
  ops->RouterFwd(tied, 1, 5, 2, true, true, probs, idx, wts);
  CHECK(idx[0] == 1);
  CHECK(idx[1] == 2);
  CHECK(wts[0] == 0.5f);
}

TEST_CASE("Router backward matches finite differences (softmax/sigmoid, renormalize on/off)") {
  auto ops = mk::MakeRefOps();
  const int64_t tokens = 5, experts = 9, top_k = 3;
  // Distinct, well separated logits (a permutation of 0.4-spaced levels plus
  // a little noise), so a 1e-6 step never changes the selection.
  VecF lf(static_cast<size_t>(tokens * experts));
  const VecF noise = Rand(tokens * experts, 131, 0.f, 0.05f);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t e = 0; e < experts; ++e) {
      lf[t * experts + e] = 0.4f * static_cast<float>((e * 7 + t * 3) % experts) - 1.6f + noise[t * experts + e];
    }
  }
  const VecF rf = Rand(tokens * top_k, 132);
  for (bool sigmoid : {false, true}) {
    for (bool renorm : {false, true}) {
      CAPTURE(sigmoid);
      CAPTURE(renorm);
      VecD logits = ToD(lf);
      const VecD r = ToD(rf);
      VecD probs(logits.size()), wts(r.size());
      std::vector<int32_t> idx(r.size()), idx_fd(r.size());
      MD::RouterFwd(logits.data(), tokens, experts, top_k, sigmoid, renorm, probs.data(), idx.data(), wts.data());
      auto loss = [&] {
        VecD p(logits.size()), w(r.size());
        MD::RouterFwd(logits.data(), tokens, experts, top_k, sigmoid, renorm, p.data(), idx_fd.data(), w.data());
        CHECK(idx_fd == idx);
        return Dot(r, w);
      };
      VecD dl(logits.size());
      MD::RouterBwd(probs.data(), idx.data(), wts.data(), r.data(), tokens, experts, top_k, sigmoid, renorm,
                    dl.data());
      ExpectClose(dl, NumGrad(logits, loss), kFdTol, "router dlogits");

      VecF pf(lf.size()), wf(rf.size()), dlf(lf.size(), std::numeric_limits<float>::quiet_NaN());
      std::vector<int32_t> idxf(rf.size());
      ops->RouterFwd(lf.data(), tokens, experts, top_k, sigmoid, renorm, pf.data(), idxf.data(), wf.data());
      CHECK(idxf == idx);
      ops->RouterBwd(pf.data(), idxf.data(), wf.data(), rf.data(), tokens, experts, top_k, sigmoid, renorm,
                     dlf.data());
      ExpectClose(dlf, dl, kF32Tol, "router dlogits (float)");
    }
  }
}

namespace {

// k distinct experts per token, drawn with a partial Fisher-Yates shuffle.
std::vector<int32_t> RandomTopk(int64_t tokens, int64_t top_k, int64_t experts, uint64_t seed) {
  std::vector<int32_t> idx(static_cast<size_t>(tokens * top_k));
  std::vector<int32_t> perm(static_cast<size_t>(experts));
  uint64_t draw = 0;
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t e = 0; e < experts; ++e) perm[e] = static_cast<int32_t>(e);
    for (int64_t i = 0; i < top_k; ++i) {
      const auto pick = i + static_cast<int64_t>(mk::Uniform01(seed, 0, draw++) * static_cast<float>(experts - i));
      std::swap(perm[i], perm[std::min(pick, experts - 1)]);
      idx[t * top_k + i] = perm[i];
    }
  }
  return idx;
}

}  // namespace

TEST_CASE("DispatchPlan is a stable sort by expert; dispatch and combine round trip and backward") {
  auto ops = mk::MakeRefOps();
  const int64_t tokens = 13, top_k = 3, experts = 6, d = 5;
  const std::vector<int32_t> topk = RandomTopk(tokens, top_k, experts, 141);
  std::vector<int32_t> slot_of(topk.size());
  std::vector<int64_t> offsets(static_cast<size_t>(experts + 1));
  ops->DispatchPlan(topk.data(), tokens, top_k, experts, slot_of.data(), offsets.data());
  CHECK(offsets[0] == 0);
  CHECK(offsets[experts] == tokens * top_k);
  std::vector<int> seen(topk.size());
  for (int64_t e = 0; e < experts; ++e) {
    CHECK(offsets[e] <= offsets[e + 1]);
    for (int64_t j = offsets[e]; j < offsets[e + 1]; ++j) {
      CHECK(topk[slot_of[j]] == e);
      if (j > offsets[e]) CHECK(slot_of[j - 1] < slot_of[j]);  // stable
      ++seen[slot_of[j]];
    }
  }
  for (int s : seen) CHECK(s == 1);

  // Round trip: with weights summing to 1 per token, combine(dispatch(x)) = x.
  const VecF xf = Rand(tokens * d, 142);
  VecF raw = Rand(tokens * top_k, 143, 0.1f, 1.f), wts(raw.size());
  for (int64_t t = 0; t < tokens; ++t) {
    float s = 0;
    for (int64_t i = 0; i < top_k; ++i) s += raw[t * top_k + i];
    for (int64_t i = 0; i < top_k; ++i) wts[t * top_k + i] = raw[t * top_k + i] / s;
  }
  VecF xs(static_cast<size_t>(tokens * top_k * d)), back(xf.size());
  ops->DispatchFwd(xf.data(), slot_of.data(), tokens, top_k, d, xs.data());
  for (size_t j = 0; j < slot_of.size(); ++j) {
    for (int64_t c = 0; c < d; ++c) CHECK(xs[j * d + c] == xf[(slot_of[j] / top_k) * d + c]);
  }
  ops->CombineFwd(xs.data(), slot_of.data(), wts.data(), tokens, top_k, d, back.data());
  ExpectClose(back, ToD(xf), 1e-6, "combine(dispatch(x))");

  // Dispatch backward.
  {
    VecD x = ToD(xf);
    const VecD r = ToD(Rand(tokens * top_k * d, 144));
    auto loss = [&] {
      VecD s(r.size());
      MD::DispatchFwd(x.data(), slot_of.data(), tokens, top_k, d, s.data());
      return Dot(r, s);
    };
    VecD dx(x.size());
    MD::DispatchBwd(r.data(), slot_of.data(), tokens, top_k, d, dx.data());
    ExpectClose(dx, NumGrad(x, loss), kFdTol, "dispatch dx");
    VecF rf(r.begin(), r.end()), dxf(x.size(), std::numeric_limits<float>::quiet_NaN());
    ops->DispatchBwd(rf.data(), slot_of.data(), tokens, top_k, d, dxf.data());
    ExpectClose(dxf, dx, kF32Tol, "dispatch dx (float)");
  }

  // Combine backward: d y_sorted and the native d topk_weights.
  {
    const VecF yf = Rand(tokens * top_k * d, 145), rf = Rand(tokens * d, 146);
    VecD y = ToD(yf), w = ToD(wts);
    const VecD r = ToD(rf);
    auto loss = [&] {
      VecD out(r.size());
      MD::CombineFwd(y.data(), slot_of.data(), w.data(), tokens, top_k, d, out.data());
      return Dot(r, out);
    };
    VecD dy(y.size()), dw(w.size());
    MD::CombineBwd(r.data(), slot_of.data(), w.data(), y.data(), tokens, top_k, d, dy.data(), dw.data());
    ExpectClose(dy, NumGrad(y, loss), kFdTol, "combine dy_sorted");
    ExpectClose(dw, NumGrad(w, loss), kFdTol, "combine d_topk_weights");

    VecF dyf(y.size()), dwf(w.size());
    ops->CombineBwd(rf.data(), slot_of.data(), wts.data(), yf.data(), tokens, top_k, d, dyf.data(), dwf.data());
    ExpectClose(dyf, dy, kF32Tol, "combine dy_sorted (float)");
    ExpectClose(dwf, dw, kF32Tol, "combine d_topk_weights (float)");
    // Without the expert output, d_topk_weights is left alone.
    VecF untouched(w.size(), 7.f);
    ops->CombineBwd(rf.data(), slot_of.data(), wts.data(), nullptr, tokens, top_k, d, dyf.data(), untouched.data());
    for (float u : untouched) CHECK(u == 7.f);
    ExpectClose(dyf, dy, kF32Tol, "combine dy_sorted without y (float)");
  }
}

TEST_CASE("SonicMoE router-gradient rewrite equals the native combine gradient") {
  auto ops = mk::MakeRefOps();
  const int64_t tokens = 11, top_k = 2, experts = 4, f = 6, d = 5;
  const std::vector<int32_t> topk = RandomTopk(tokens, top_k, experts, 151);
  std::vector<int32_t> slot_of(topk.size());
  std::vector<int64_t> offsets(static_cast<size_t>(experts + 1));
  mr::DispatchPlan(topk.data(), tokens, top_k, experts, slot_of.data(), offsets.data());
  const int64_t rows = tokens * top_k;
  const VecF actf = Rand(rows * f, 152), w2f = Rand(experts * f * d, 153), doutf = Rand(tokens * d, 154);
  const VecF wtsf = Rand(rows, 155, 0.1f, 1.f);

  // Native: y = act W2 is saved; d_topk_weights = <dout, y>.
  const VecD act = ToD(actf), w2 = ToD(w2f), dout = ToD(doutf), wts = ToD(wtsf);
  VecD y(static_cast<size_t>(rows * d)), dy(y.size()), native(static_cast<size_t>(rows));
  MD::GroupedGemm(offsets.data(), experts, f, d, act.data(), w2.data(), y.data());
  MD::CombineBwd(dout.data(), slot_of.data(), wts.data(), y.data(), tokens, top_k, d, dy.data(), native.data());

  // Rewrite: dA_unweighted = dout (gathered to the sorted rows) W2^T.
  VecD dout_sorted(y.size()), da(act.size()), dw2(w2.size()), rewrite(native.size());
  MD::DispatchFwd(dout.data(), slot_of.data(), tokens, top_k, d, dout_sorted.data());
  MD::GroupedGemmBwd(offsets.data(), experts, f, d, act.data(), w2.data(), dout_sorted.data(), da.data(),
                     dw2.data());
  MD::RouterGradRewrite(da.data(), act.data(), slot_of.data(), nullptr, tokens, top_k, f, rewrite.data());
  ExpectClose(rewrite, native, 1e-12, "rewrite vs native (double)");
  // The weighted form: da = w * dA_unweighted, as the fc2 backward of the
  // weighted rows gives it; dividing by w recovers the same gradient.
  VecD dy_w(y.size()), da_w(act.size()), dw2_w(w2.size()), rewrite_w(native.size()), unused(native.size());
  MD::CombineBwd(dout.data(), slot_of.data(), wts.data(), nullptr, tokens, top_k, d, dy_w.data(), unused.data());
  MD::GroupedGemmBwd(offsets.data(), experts, f, d, act.data(), w2.data(), dy_w.data(), da_w.data(), dw2_w.data());
  MD::RouterGradRewrite(da_w.data(), act.data(), slot_of.data(), wts.data(), tokens, top_k, f, rewrite_w.data());
  ExpectClose(rewrite_w, native, 1e-12, "weighted rewrite vs native (double)");

  VecF daf(da.begin(), da.end()), rewrite_f(native.size());
  ops->RouterGradRewrite(daf.data(), actf.data(), slot_of.data(), nullptr, tokens, top_k, f, rewrite_f.data());
  ExpectClose(rewrite_f, native, 1e-5, "rewrite (float)");
}

// --- Cross entropy ----------------------------------------------------------------

TEST_CASE("Cross entropy forward and backward") {
  auto ops = mk::MakeRefOps();
  const int64_t tokens = 7, vocab = 67;
  const VecF lf = Rand(tokens * vocab, 161, -4.f, 4.f);
  std::vector<int32_t> targets(static_cast<size_t>(tokens));
  for (int64_t t = 0; t < tokens; ++t) targets[t] = static_cast<int32_t>((t * 29 + 5) % vocab);

  VecF probs(lf.size()), loss(static_cast<size_t>(tokens));
  ops->CrossEntropyFwd(lf.data(), targets.data(), tokens, vocab, probs.data(), loss.data());
  for (int64_t t = 0; t < tokens; ++t) {
    double sum = 0, sum_exp = 0;
    for (int64_t v = 0; v < vocab; ++v) {
      sum += probs[t * vocab + v];
      sum_exp += std::exp(double(lf[t * vocab + v]));
    }
    CHECK(std::fabs(sum - 1) < 1e-5);
    const double want = std::log(sum_exp) - lf[t * vocab + targets[t]];
    CHECK(loss[t] == doctest::Approx(want).epsilon(1e-6));
    CHECK(loss[t] == doctest::Approx(-std::log(double(probs[t * vocab + targets[t]]))).epsilon(1e-5));
  }
  // Large logits stay finite (max subtracted), and a hopeless target gives a
  // finite loss rather than -log(0).
  const float big[] = {1000.f, -1000.f, 999.f};
  const int32_t tgt[] = {1};
  float pbig[3], lbig[1];
  ops->CrossEntropyFwd(big, tgt, 1, 3, pbig, lbig);
  CHECK(std::isfinite(pbig[0]));
  CHECK(lbig[0] == doctest::Approx(2000.0 + std::log1p(std::exp(-1.0))).epsilon(1e-6));

  const double scale = 1.0 / tokens;
  VecD logits = ToD(lf);
  auto mean_loss = [&] {
    VecD p(logits.size()), l(static_cast<size_t>(tokens));
    MD::CrossEntropyFwd(logits.data(), targets.data(), tokens, vocab, p.data(), l.data());
    double s = 0;
    for (double li : l) s += li;
    return s * scale;
  };
  VecD pd(logits.size()), ld(static_cast<size_t>(tokens)), dl(logits.size());
  MD::CrossEntropyFwd(logits.data(), targets.data(), tokens, vocab, pd.data(), ld.data());
  MD::CrossEntropyBwd(pd.data(), targets.data(), tokens, vocab, scale, dl.data());
  ExpectClose(dl, NumGrad(logits, mean_loss), kFdTol, "cross entropy dlogits");
  VecF dlf(lf.size());
  ops->CrossEntropyBwd(probs.data(), targets.data(), tokens, vocab, static_cast<float>(scale), dlf.data());
  ExpectClose(dlf, dl, kF32Tol, "cross entropy dlogits (float)");
}

// --- Block AttnRes ------------------------------------------------------------------

// Source i of n blocks stored back to back: its address.
template <typename T>
std::vector<T*> Blocks(std::vector<T>& v, int64_t n) {
  std::vector<T*> p;
  for (int64_t i = 0; i < n; ++i) p.push_back(v.data() + i * (static_cast<int64_t>(v.size()) / n));
  return p;
}
template <typename T>
std::vector<const T*> ConstBlocks(const std::vector<T>& v, int64_t n) {
  std::vector<const T*> p;
  for (int64_t i = 0; i < n; ++i) p.push_back(v.data() + i * (static_cast<int64_t>(v.size()) / n));
  return p;
}

TEST_CASE("AttnRes forward (naive formula) and backward") {
  auto ops = mk::MakeRefOps();
  const int64_t n = 3, tokens = 5, d = 67;
  const float eps = 1e-6f;
  const VecF sf = Rand(n * tokens * d, 171, -2.f, 2.f), wf = Rand(d, 172), gf = Rand(d, 173, 0.5f, 1.5f);
  const VecF rf = Rand(tokens * d, 174), dw0 = Rand(d, 175), dg0 = Rand(d, 176), ds0 = Rand(n * tokens * d, 177);

  VecF h(static_cast<size_t>(tokens * d)), a(static_cast<size_t>(tokens * n));
  ops->AttnResFwd(ConstBlocks(sf, n).data(), n, wf.data(), gf.data(), tokens, d, eps, h.data(), a.data());
  VecD want_h(h.size()), want_a(a.size());
  for (int64_t t = 0; t < tokens; ++t) {
    VecD z(static_cast<size_t>(n));
    double mx = -1e300, sum = 0;
    for (int64_t i = 0; i < n; ++i) {
      const float* v = sf.data() + (i * tokens + t) * d;
      double ms = 0;
      for (int64_t c = 0; c < d; ++c) ms += double(v[c]) * v[c];
      const double rs = 1 / std::sqrt(ms / d + eps);
      for (int64_t c = 0; c < d; ++c) z[i] += wf[c] * (v[c] * rs * gf[c]);
      mx = std::max(mx, z[i]);
    }
    for (int64_t i = 0; i < n; ++i) sum += std::exp(z[i] - mx);
    for (int64_t i = 0; i < n; ++i) {
      want_a[t * n + i] = std::exp(z[i] - mx) / sum;
      for (int64_t c = 0; c < d; ++c) want_h[t * d + c] += want_a[t * n + i] * sf[(i * tokens + t) * d + c];
    }
  }
  ExpectClose(a, want_a, kF32Tol, "attn_res weights");
  ExpectClose(h, want_h, kF32Tol, "attn_res h");

  VecD src = ToD(sf), w = ToD(wf), g = ToD(gf);
  const VecD r = ToD(rf);
  auto loss = [&] {
    VecD hd(r.size()), ad(static_cast<size_t>(tokens * n));
    MD::AttnResFwd(ConstBlocks(src, n).data(), n, w.data(), g.data(), tokens, d, eps, hd.data(), ad.data());
    return Dot(r, hd);
  };
  // Every gradient is added into what is there.
  VecD ds = ToD(ds0), dw = ToD(dw0), dg = ToD(dg0);
  MD::AttnResBwd(ConstBlocks(src, n).data(), n, w.data(), g.data(), r.data(), tokens, d, eps, Blocks(ds, n).data(),
                 dw.data(), dg.data());
  for (int64_t c = 0; c < d; ++c) {
    dw[c] -= dw0[c];
    dg[c] -= dg0[c];
  }
  for (size_t k = 0; k < ds.size(); ++k) ds[k] -= ds0[k];
  ExpectClose(ds, NumGrad(src, loss), kFdTol, "attn_res dsources");
  ExpectClose(dw, NumGrad(w, loss), kFdTol, "attn_res dw");
  ExpectClose(dg, NumGrad(g, loss), kFdTol, "attn_res dgamma");

  VecF dsf = ds0, dwf = dw0, dgf = dg0;
  ops->AttnResBwd(ConstBlocks(sf, n).data(), n, wf.data(), gf.data(), rf.data(), tokens, d, eps,
                  Blocks(dsf, n).data(), dwf.data(), dgf.data(), nullptr);
  for (int64_t c = 0; c < d; ++c) {
    dwf[c] -= dw0[c];
    dgf[c] -= dg0[c];
  }
  for (size_t k = 0; k < dsf.size(); ++k) dsf[k] -= ds0[k];
  ExpectClose(dsf, ds, kF32Tol, "attn_res dsources (float)");
  ExpectClose(dwf, dw, kF32Tol, "attn_res dw (float)");
  ExpectClose(dgf, dg, kF32Tol, "attn_res dgamma (float)");

  // The blocks need not be contiguous or in order: sources given in reverse
  // give the same h (a permutation of a softmax-weighted sum) up to rounding.
  std::vector<const float*> rev = ConstBlocks(sf, n);
  std::reverse(rev.begin(), rev.end());
  VecF h_rev(h.size()), a_rev(a.size());
  ops->AttnResFwd(rev.data(), n, wf.data(), gf.data(), tokens, d, eps, h_rev.data(), a_rev.data());
  ExpectClose(h_rev, want_h, kF32Tol, "attn_res h (sources reversed)");
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t i = 0; i < n; ++i) CHECK(a_rev[t * n + i] == doctest::Approx(a[t * n + (n - 1 - i)]).epsilon(1e-5));
  }
}

// --- Executor ops: softmax, sigmoid, top-k, embedding, split heads, optimizer ------

TEST_CASE("Softmax forward (scale, causal mask) and backward") {
  auto ops = mk::MakeRefOps();
  const int64_t rows = 10, cols = 7;
  const float scale = 0.7f;
  // causal_seq 5: rows 0-4 and 5-9 are queries 0-4 of two sequences; with
  // cols 7 > 5 the last query still sees only 5 columns.
  for (int64_t causal_seq : {int64_t{0}, int64_t{5}, int64_t{10}}) {
    CAPTURE(causal_seq);
    const VecF xf = Rand(rows * cols, 241, -3.f, 3.f), rf = Rand(rows * cols, 242);
    VecF y(xf.size(), std::numeric_limits<float>::quiet_NaN());
    ops->SoftmaxFwd(xf.data(), rows, cols, scale, causal_seq, y.data());
    VecD want(y.size());
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t visible = causal_seq > 0 ? std::min(cols, r % causal_seq + 1) : cols;
      double sum = 0;
      for (int64_t j = 0; j < visible; ++j) sum += std::exp(double(scale) * xf[r * cols + j]);
      for (int64_t j = 0; j < cols; ++j) {
        want[r * cols + j] = j < visible ? std::exp(double(scale) * xf[r * cols + j]) / sum : 0;
        if (j >= visible) CHECK(y[r * cols + j] == 0.f);
      }
    }
    ExpectClose(y, want, kF32Tol, "softmax");

    VecD x = ToD(xf);
    const VecD r = ToD(rf);
    auto loss = [&] {
      VecD yd(x.size());
      MD::SoftmaxFwd(x.data(), rows, cols, scale, causal_seq, yd.data());
      return Dot(r, yd);
    };
    VecD yd(x.size()), dx(x.size());
    MD::SoftmaxFwd(x.data(), rows, cols, scale, causal_seq, yd.data());
    MD::SoftmaxBwd(yd.data(), r.data(), rows, cols, scale, dx.data());
    ExpectClose(dx, NumGrad(x, loss), kFdTol, "softmax dx");
    VecF dxf(x.size(), std::numeric_limits<float>::quiet_NaN());
    ops->SoftmaxBwd(y.data(), rf.data(), rows, cols, scale, dxf.data());
    ExpectClose(dxf, dx, kF32Tol, "softmax dx (float)");
  }
}

TEST_CASE("Sigmoid forward and backward") {
  auto ops = mk::MakeRefOps();
  const int64_t n = 101;
  const VecF xf = Rand(n, 251, -6.f, 6.f), rf = Rand(n, 252);
  VecF y(xf.size());
  ops->SigmoidFwd(xf.data(), n, y.data());
  VecD want(y.size());
  for (int64_t i = 0; i < n; ++i) want[i] = 1 / (1 + std::exp(-double(xf[i])));
  ExpectClose(y, want, kF32Tol, "sigmoid");

  VecD x = ToD(xf);
  const VecD r = ToD(rf);
  auto loss = [&] {
    VecD yd(x.size());
    MD::SigmoidFwd(x.data(), n, yd.data());
    return Dot(r, yd);
  };
  VecD yd(x.size()), dx(x.size());
  MD::SigmoidFwd(x.data(), n, yd.data());
  MD::SigmoidBwd(yd.data(), r.data(), n, dx.data());
  ExpectClose(dx, NumGrad(x, loss), kFdTol, "sigmoid dx");
  VecF dxf(x.size());
  ops->SigmoidBwd(y.data(), rf.data(), n, dxf.data());
  ExpectClose(dxf, dx, kF32Tol, "sigmoid dx (float)");
}

TEST_CASE("TopK backward matches finite differences; Router == Softmax/Sigmoid + TopK, bit for bit") {
  auto ops = mk::MakeRefOps();
  const int64_t tokens = 5, experts = 9, top_k = 3;
  // Well separated probabilities (0.05-spaced levels plus a little noise).
  VecF pf(static_cast<size_t>(tokens * experts));
  const VecF noise = Rand(tokens * experts, 261, 0.f, 0.005f);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t e = 0; e < experts; ++e) {
      pf[t * experts + e] = 0.05f * static_cast<float>((e * 4 + t) % experts + 1) + noise[t * experts + e];
    }
  }
  const VecF rf = Rand(tokens * top_k, 262);
  for (bool renorm : {false, true}) {
    CAPTURE(renorm);
    VecD probs = ToD(pf);
    const VecD r = ToD(rf);
    VecD w(r.size());
    std::vector<int32_t> idx(r.size()), idx_fd(r.size());
    MD::TopKFwd(probs.data(), tokens, experts, top_k, renorm, idx.data(), w.data());
    auto loss = [&] {
      VecD wd(r.size());
      MD::TopKFwd(probs.data(), tokens, experts, top_k, renorm, idx_fd.data(), wd.data());
      CHECK(idx_fd == idx);
      return Dot(r, wd);
    };
    VecD dp(probs.size());
    MD::TopKBwd(probs.data(), idx.data(), w.data(), r.data(), tokens, experts, top_k, renorm, dp.data());
    ExpectClose(dp, NumGrad(probs, loss), kFdTol, "topk dprobs");

    VecF wf(rf.size()), dpf(pf.size(), std::numeric_limits<float>::quiet_NaN());
    std::vector<int32_t> idxf(rf.size());
    ops->TopKFwd(pf.data(), tokens, experts, top_k, renorm, idxf.data(), wf.data());
    CHECK(idxf == idx);
    ops->TopKBwd(pf.data(), idxf.data(), wf.data(), rf.data(), tokens, experts, top_k, renorm, dpf.data());
    ExpectClose(dpf, dp, kF32Tol, "topk dprobs (float)");
  }

  // Composition, including exact ties (token 0: all logits equal).
  VecF logits = Rand(tokens * experts, 263, -3.f, 3.f);
  std::fill_n(logits.begin(), experts, 0.5f);
  const VecF dwts = Rand(tokens * top_k, 264);
  for (bool sigmoid : {false, true}) {
    for (bool renorm : {false, true}) {
      CAPTURE(sigmoid);
      CAPTURE(renorm);
      VecF probs(logits.size()), wts(dwts.size()), dl(logits.size());
      std::vector<int32_t> idx(dwts.size());
      ops->RouterFwd(logits.data(), tokens, experts, top_k, sigmoid, renorm, probs.data(), idx.data(), wts.data());
      ops->RouterBwd(probs.data(), idx.data(), wts.data(), dwts.data(), tokens, experts, top_k, sigmoid, renorm,
                     dl.data());
      VecF probs2(logits.size()), wts2(dwts.size()), dp2(logits.size()), dl2(logits.size());
      std::vector<int32_t> idx2(dwts.size());
      if (sigmoid) {
        ops->SigmoidFwd(logits.data(), tokens * experts, probs2.data());
      } else {
        ops->SoftmaxFwd(logits.data(), tokens, experts, 1.f, 0, probs2.data());
      }
      ops->TopKFwd(probs2.data(), tokens, experts, top_k, renorm, idx2.data(), wts2.data());
      ops->TopKBwd(probs2.data(), idx2.data(), wts2.data(), dwts.data(), tokens, experts, top_k, renorm, dp2.data());
      if (sigmoid) {
        ops->SigmoidBwd(probs2.data(), dp2.data(), tokens * experts, dl2.data());
      } else {
        ops->SoftmaxBwd(probs2.data(), dp2.data(), tokens, experts, 1.f, dl2.data());
      }
      CHECK(Bytes(probs, idx, wts, dl) == Bytes(probs2, idx2, wts2, dl2));
      CHECK(idx[0] == 0);  // the tie: lower expert index first
      CHECK(idx[1] == 1);
    }
  }
}

TEST_CASE("Embedding forward and backward (accumulates in token order)") {
  auto ops = mk::MakeRefOps();
  const int64_t vocab = 7, n = 23, d = 5;
  std::vector<int32_t> tokens(static_cast<size_t>(n));
  for (int64_t t = 0; t < n; ++t) tokens[t] = static_cast<int32_t>((t * 5 + t / 3) % vocab);
  const VecF tf = Rand(vocab * d, 271), rf = Rand(n * d, 272), dt0 = Rand(vocab * d, 273);
  VecF y(rf.size());
  ops->EmbeddingFwd(tokens.data(), tf.data(), n, d, y.data());
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t c = 0; c < d; ++c) CHECK(y[t * d + c] == tf[tokens[t] * d + c]);
  }

  VecD table = ToD(tf);
  const VecD r = ToD(rf);
  auto loss = [&] {
    VecD yd(r.size());
    MD::EmbeddingFwd(tokens.data(), table.data(), n, d, yd.data());
    return Dot(r, yd);
  };
  VecD dt = ToD(dt0);
  MD::EmbeddingBwd(tokens.data(), r.data(), n, d, dt.data());
  for (size_t i = 0; i < dt.size(); ++i) dt[i] -= dt0[i];
  ExpectClose(dt, NumGrad(table, loss), kFdTol, "embedding dtable");

  // Float: exactly the token-order sum on top of the old value.
  VecF dtf = dt0, want = dt0;
  ops->EmbeddingBwd(tokens.data(), rf.data(), n, d, dtf.data());
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t c = 0; c < d; ++c) want[tokens[t] * d + c] += rf[t * d + c];
  }
  CHECK(Bytes(dtf) == Bytes(want));
}

TEST_CASE("MlaSplit: layout, RoPE on the rope parts, k_pe shared by heads; the backward is the adjoint") {
  auto ops = mk::MakeRefOps();
  const mk::MlaShape sh{2, 5, 3, 4, 6, 2, 10000.f};
  const int64_t t = sh.b * sh.s, qk = sh.nope + sh.rope;
  const VecF ql = Rand(t * sh.heads * qk, 401), kv = Rand(t * sh.heads * (sh.nope + sh.v), 402),
             pe = Rand(t * sh.rope, 403);
  VecF q(static_cast<size_t>(t * sh.heads * qk)), k(q.size()), v(static_cast<size_t>(t * sh.heads * sh.v));
  ops->MlaSplitFwd(ql.data(), kv.data(), pe.data(), sh, q.data(), k.data(), v.data());
  for (int64_t bb = 0; bb < sh.b; ++bb) {
    for (int64_t pos = 0; pos < sh.s; ++pos) {
      const int64_t row = bb * sh.s + pos;
      for (int64_t h = 0; h < sh.heads; ++h) {
        const int64_t o = (bb * sh.heads + h) * sh.s + pos;
        for (int64_t j = 0; j < sh.nope; ++j) {
          CHECK(q[static_cast<size_t>(o * qk + j)] == ql[static_cast<size_t>(row * sh.heads * qk + h * qk + j)]);
          CHECK(k[static_cast<size_t>(o * qk + j)] == kv[static_cast<size_t>(row * sh.heads * (sh.nope + sh.v) + h * (sh.nope + sh.v) + j)]);
        }
        for (int64_t j = 0; j < sh.v; ++j) {
          CHECK(v[static_cast<size_t>(o * sh.v + j)] ==
                kv[static_cast<size_t>(row * sh.heads * (sh.nope + sh.v) + h * (sh.nope + sh.v) + sh.nope + j)]);
        }
        const int64_t half = sh.rope / 2;
        for (int64_t i = 0; i < half; ++i) {  // k's rope part: k_pe rotated, the same for every head
          const double angle = static_cast<double>(pos) * std::pow(10000.0, -2.0 * static_cast<double>(i) / sh.rope);
          const double x0 = pe[static_cast<size_t>(row * sh.rope + i)], x1 = pe[static_cast<size_t>(row * sh.rope + i + half)];
          CHECK(k[static_cast<size_t>(o * qk + sh.nope + i)] == doctest::Approx(x0 * std::cos(angle) - x1 * std::sin(angle)).epsilon(1e-6));
          CHECK(k[static_cast<size_t>(o * qk + sh.nope + i + half)] == doctest::Approx(x1 * std::cos(angle) + x0 * std::sin(angle)).epsilon(1e-6));
        }
      }
    }
  }
  // <Fwd(x), g> == <x, Bwd(g)>: the backward is the forward's adjoint
  // (RoPE is orthogonal, the copies are identities, k_pe's heads sum).
  const VecF gq = Rand(static_cast<int64_t>(q.size()), 404), gk = Rand(static_cast<int64_t>(k.size()), 405),
             gv = Rand(static_cast<int64_t>(v.size()), 406);
  VecF dql(ql.size()), dkv(kv.size()), dpe(pe.size());
  ops->MlaSplitBwd(gq.data(), gk.data(), gv.data(), sh, dql.data(), dkv.data(), dpe.data());
  auto dot = [](const VecF& a, const VecF& b) {
    double s = 0;
    for (size_t i = 0; i < a.size(); ++i) s += double(a[i]) * double(b[i]);
    return s;
  };
  const double lhs = dot(q, gq) + dot(k, gk) + dot(v, gv);
  const double rhs = dot(ql, dql) + dot(kv, dkv) + dot(pe, dpe);
  CHECK(lhs == doctest::Approx(rhs).epsilon(1e-5));
}

TEST_CASE("SplitHeads: layout, RoPE, backward (adjoint and inverse)") {
  auto ops = mk::MakeRefOps();
  for (bool rope : {false, true}) {
    CAPTURE(rope);
    const mk::SplitShape sh{.b = 2, .s = 5, .heads = 4, .kv_heads = 2, .head_dim = 6, .rope = rope,
                            .rope_theta = 100.f};
    const int64_t width = (sh.heads + 2 * sh.kv_heads) * sh.head_dim, rows = sh.b * sh.s;
    const size_t nq = static_cast<size_t>(sh.b * sh.heads * sh.s * sh.head_dim);
    const size_t nkv = static_cast<size_t>(sh.b * sh.kv_heads * sh.s * sh.head_dim);
    const VecF xf = Rand(rows * width, 281);
    VecF q(nq), k(nkv), v(nkv);
    ops->SplitHeadsFwd(xf.data(), sh, q.data(), k.data(), v.data());

    // Naive: element (bb, pos, head slot, e) of qkv, rotated in double.
    VecD want_q(nq), want_k(nkv), want_v(nkv);
    const int64_t half = sh.head_dim / 2;
    for (int64_t bb = 0; bb < sh.b; ++bb) {
      for (int64_t pos = 0; pos < sh.s; ++pos) {
        const float* row = xf.data() + (bb * sh.s + pos) * width;
        auto put = [&](VecD& dst, int64_t heads, int64_t h, const float* src, bool rot) {
          double* out = dst.data() + ((bb * heads + h) * sh.s + pos) * sh.head_dim;
          for (int64_t e = 0; e < sh.head_dim; ++e) out[e] = src[e];
          if (!rot) return;
          for (int64_t i = 0; i < half; ++i) {
            const double ang = pos * std::pow(100.0, -2.0 * i / sh.head_dim);
            out[i] = src[i] * std::cos(ang) - src[i + half] * std::sin(ang);
            out[i + half] = src[i + half] * std::cos(ang) + src[i] * std::sin(ang);
          }
        };
        for (int64_t h = 0; h < sh.heads; ++h) put(want_q, sh.heads, h, row + h * sh.head_dim, rope);
        for (int64_t g = 0; g < sh.kv_heads; ++g) {
          put(want_k, sh.kv_heads, g, row + (sh.heads + g) * sh.head_dim, rope);
          put(want_v, sh.kv_heads, g, row + (sh.heads + sh.kv_heads + g) * sh.head_dim, false);
        }
      }
    }
    if (rope) {
      ExpectClose(q, want_q, kF32Tol, "split q");
      ExpectClose(k, want_k, kF32Tol, "split k");
    } else {
      CHECK(ToD(q) == want_q);
      CHECK(ToD(k) == want_k);
    }
    CHECK(ToD(v) == want_v);

    // Backward: the gradient of L = <rq, q> + <rk, k> + <rv, v>.
    VecD x = ToD(xf);
    const VecD rq = ToD(Rand(static_cast<int64_t>(nq), 282)), rk = ToD(Rand(static_cast<int64_t>(nkv), 283));
    const VecD rv = ToD(Rand(static_cast<int64_t>(nkv), 284));
    auto loss = [&] {
      VecD qd(nq), kd(nkv), vd(nkv);
      MD::SplitHeadsFwd(x.data(), sh, qd.data(), kd.data(), vd.data());
      return Dot(rq, qd) + Dot(rk, kd) + Dot(rv, vd);
    };
    VecD dx(x.size());
    MD::SplitHeadsBwd(rq.data(), rk.data(), rv.data(), sh, dx.data());
    ExpectClose(dx, NumGrad(x, loss), kFdTol, "split dqkv");
    const VecF rqf(rq.begin(), rq.end()), rkf(rk.begin(), rk.end()), rvf(rv.begin(), rv.end());
    VecF dxf(x.size(), std::numeric_limits<float>::quiet_NaN());
    ops->SplitHeadsBwd(rqf.data(), rkf.data(), rvf.data(), sh, dxf.data());
    ExpectClose(dxf, dx, kF32Tol, "split dqkv (float)");

    // The rotation is orthogonal: its backward undoes the forward.
    VecF back(xf.size());
    ops->SplitHeadsBwd(q.data(), k.data(), v.data(), sh, back.data());
    ExpectClose(back, ToD(xf), 1e-5, "split bwd(fwd(x))");
  }
}

TEST_CASE("AdamStep: the contract's order of float operations, and AdamW in double") {
  auto ops = mk::MakeRefOps();
  const int64_t n = 257;
  const mk::AdamConfig cfg{.lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f};
  const VecF p0 = Rand(n, 291), m0 = Rand(n, 292, -0.1f, 0.1f), v0 = Rand(n, 293, 0.f, 0.01f);
  VecF p = p0, m = m0, v = v0;
  VecD pd = ToD(p0), md = ToD(m0), vd = ToD(v0);
  VecF pw = p0, mw = m0, vw = v0;  // the contract, spelled out in float
  for (int64_t step = 1; step <= 3; ++step) {
    const VecF g = Rand(n, 300 + static_cast<uint64_t>(step));
    ops->AdamStep(p.data(), g.data(), m.data(), v.data(), n, cfg, step);
    const float bc1 = mk::AdamBiasCorrection(cfg.beta1, step), bc2 = mk::AdamBiasCorrection(cfg.beta2, step);
    CHECK(bc1 == static_cast<float>(1.0 - std::pow(double(cfg.beta1), double(step))));
    for (int64_t i = 0; i < n; ++i) {
      mw[i] = cfg.beta1 * mw[i] + (1.f - cfg.beta1) * g[i];
      vw[i] = cfg.beta2 * vw[i] + ((1.f - cfg.beta2) * g[i]) * g[i];
      const float mhat = mw[i] / bc1, vhat = vw[i] / bc2;
      const float u = mhat / (std::sqrt(vhat) + cfg.eps) + cfg.weight_decay * pw[i];
      pw[i] = pw[i] - cfg.lr * u;

      const double b1 = cfg.beta1, b2 = cfg.beta2;
      md[i] = b1 * md[i] + (1 - b1) * g[i];
      vd[i] = b2 * vd[i] + (1 - b2) * double(g[i]) * g[i];
      const double ud = (md[i] / (1 - std::pow(b1, double(step)))) /
                            (std::sqrt(vd[i] / (1 - std::pow(b2, double(step)))) + double(cfg.eps)) +
                        double(cfg.weight_decay) * pd[i];
      pd[i] -= double(cfg.lr) * ud;
    }
    CHECK(Bytes(p, m, v) == Bytes(pw, mw, vw));
  }
  ExpectClose(p, pd, 1e-5, "adam master vs double");
  ExpectClose(m, md, 1e-5, "adam m vs double");
  ExpectClose(v, vd, 1e-5, "adam v vs double");

  // Step 1 from zero moments, no decay: the update is lr * g / (|g| + eps).
  const mk::AdamConfig plain{.lr = 0.5f};
  const float g1[] = {2.f, -3.f, 0.f};
  float w[] = {1.f, 1.f, 1.f}, m1[3] = {}, v1[3] = {};
  ops->AdamStep(w, g1, m1, v1, 3, plain, 1);
  CHECK(w[0] == doctest::Approx(0.5).epsilon(1e-6));
  CHECK(w[1] == doctest::Approx(1.5).epsilon(1e-6));
  CHECK(w[2] == 1.f);
}

TEST_CASE("SquaredNorm sums double squares in order; Copy, Zero, Accumulate") {
  auto ops = mk::MakeRefOps();
  const float small[] = {3.f, -4.f};
  double out = -1;
  ops->SquaredNorm(small, 2, &out);
  CHECK(out == 25.0);
  ops->SquaredNorm(small, 0, &out);
  CHECK(out == 0.0);
  const VecF x = Rand(10007, 301, -10.f, 10.f);
  double want = 0;
  for (float xi : x) want += double(xi) * double(xi);
  ops->SquaredNorm(x.data(), static_cast<int64_t>(x.size()), &out);
  CHECK(out == want);

  VecF y(x.size(), 1.f);
  ops->Copy(y.data(), x.data(), static_cast<int64_t>(x.size() * sizeof(float)));
  CHECK(y == x);
  ops->Zero(y.data(), 8);
  CHECK(y[0] == 0.f);
  CHECK(y[1] == 0.f);
  CHECK(y[2] == x[2]);
  const VecF a = Rand(37, 302), b = Rand(37, 303);
  VecF acc = a;
  ops->Accumulate(acc.data(), b.data(), 37);
  for (size_t i = 0; i < acc.size(); ++i) CHECK(acc[i] == a[i] + b[i]);
}

TEST_CASE("Axpby rounds each product and the sum (no fused multiply-add); in place on x; y may be null") {
  auto ops = mk::MakeRefOps();
  const VecF x = Rand(1001, 311, -3.f, 3.f), y = Rand(1001, 312, -3.f, 3.f);
  const float a = 0.95f, b = -1.7f;
  VecF out(x.size());
  ops->Axpby(x.data(), y.data(), 1001, a, b, out.data());
  for (size_t i = 0; i < x.size(); ++i) {
    volatile float ax = a * x[i], by = b * y[i];  // rounded separately
    CHECK(out[i] == ax + by);
  }
  VecF inplace = x;
  ops->Axpby(inplace.data(), y.data(), 1001, a, b, inplace.data());
  CHECK(inplace == out);
  ops->Axpby(x.data(), nullptr, 1001, 0.5f, 0.f, out.data());
  for (size_t i = 0; i < x.size(); ++i) CHECK(out[i] == 0.5f * x[i]);
}

// --- Bit reproducibility -----------------------------------------------------------

TEST_CASE("Every op gives identical bytes when run twice") {
  auto ops = mk::MakeRefOps();
  // run(fill) allocates the overwritten outputs filled with `fill`, runs the
  // op(s) and returns every output's bytes; a second run with a different
  // fill must reproduce them exactly (which also shows every element is
  // written).
  auto twice = [](const char* what, const auto& run) {
    CAPTURE(what);
    CHECK(run(0.f) == run(std::numeric_limits<float>::quiet_NaN()));
  };
  const int64_t m = 70, n = 67, k = 65;
  const VecF a = Rand(m * k, 201), b = Rand(k * n, 202), c0 = Rand(m * n, 203);
  twice("gemm", [&](float fill) {
    VecF c(c0.size(), fill), c2 = c0;
    ops->Gemm(true, false, m, n, k, 1.f, a.data(), b.data(), 0.f, c.data(), nullptr);
    ops->Gemm(false, true, m, n, k, 0.5f, a.data(), b.data(), 2.f, c2.data(), nullptr);
    return Bytes(c, c2);
  });

  const int64_t offsets[] = {0, 30, 30, 100};
  const VecF gx = Rand(100 * 9, 205), gw = Rand(3 * 9 * 7, 206), gdy = Rand(100 * 7, 207);
  twice("grouped gemm", [&](float fill) {
    VecF y(gdy.size(), fill), dx(gx.size(), fill), dw = gw;
    ops->GroupedGemm(offsets, 3, 9, 7, gx.data(), gw.data(), y.data(), nullptr);
    ops->GroupedGemmBwd(offsets, 3, 9, 7, gx.data(), gw.data(), gdy.data(), dx.data(), dw.data(), nullptr);
    return Bytes(y, dx, dw);
  });

  const int64_t rows = 9, cols = 131;
  const VecF nx = Rand(rows * cols, 208), ng = Rand(cols, 209), nb = Rand(cols, 210), ndy = Rand(rows * cols, 211);
  twice("norms", [&](float fill) {
    VecF y1(nx.size(), fill), y2(nx.size(), fill), dx1(nx.size(), fill), dx2(nx.size(), fill);
    VecF dg1 = ng, db1 = nb, dg2 = nb;
    ops->LayerNormFwd(nx.data(), ng.data(), nb.data(), rows, cols, 1e-5f, y1.data());
    ops->LayerNormBwd(nx.data(), ng.data(), ndy.data(), rows, cols, 1e-5f, dx1.data(), dg1.data(), db1.data());
    ops->RmsNormFwd(nx.data(), ng.data(), rows, cols, 1e-6f, y2.data());
    ops->RmsNormBwd(nx.data(), ng.data(), ndy.data(), rows, cols, 1e-6f, dx2.data(), dg2.data());
    return Bytes(y1, dx1, dg1, db1, y2, dx2, dg2);
  });

  twice("elementwise", [&](float fill) {
    const int64_t len = rows * cols;
    VecF gy(nx.size(), fill), gdx(nx.size(), fill), sy(nx.size() / 2 + 1, fill), sdx(nx.size(), fill);
    VecF dy(nx.size(), fill), ddx(nx.size(), fill), add(nx.size(), fill);
    std::vector<uint8_t> mask(nx.size(), fill == 0.f ? 0 : 0xAB);
    ops->GeluFwd(nx.data(), len, gy.data());
    ops->GeluBwd(nx.data(), ndy.data(), len, gdx.data());
    ops->SwigluFwd(nx.data(), 1, len / 2, sy.data());
    ops->SwigluBwd(nx.data(), ndy.data(), 1, len / 2, sdx.data());
    ops->DropoutFwd(nx.data(), len, 0.1f, 5, 6, dy.data(), mask.data());
    ops->DropoutBwd(ndy.data(), mask.data(), len, 0.1f, ddx.data());
    ops->Add(nx.data(), ndy.data(), len, add.data());
    sy.pop_back();                   // one past the output: never written
    sdx.resize(sdx.size() / 2 * 2);  // odd length: the last element is not part of x
    return Bytes(gy, gdx, sy, sdx, dy, mask, ddx, add);
  });

  for (bool causal : {true, false}) {
    mk::AttentionShape sh{.b = 1, .heads = 4, .kv_heads = 2, .s = 70, .dqk = 8, .dv = 6, .scale = 0.3f,
                          .causal = causal};
    const VecF q = Rand(static_cast<int64_t>(QSize(sh)), 212), kk = Rand(static_cast<int64_t>(KSize(sh)), 213);
    const VecF v = Rand(static_cast<int64_t>(VSize(sh)), 214), d_o = Rand(static_cast<int64_t>(OSize(sh)), 215);
    twice(causal ? "attention causal" : "attention", [&](float fill) {
      VecF probs(PSize(sh), fill), o(OSize(sh), fill), dq(QSize(sh), fill), dk(KSize(sh), fill);
      VecF dv(VSize(sh), fill), ws(PSize(sh), fill);
      VecF fo(OSize(sh), fill), lse(LSize(sh), fill), fdq(QSize(sh), fill), fdk(KSize(sh), fill);
      VecF fdv(VSize(sh), fill), fws(LSize(sh), fill);
      ops->AttentionFwd(sh, q.data(), kk.data(), v.data(), probs.data(), o.data());
      ops->AttentionBwd(sh, q.data(), kk.data(), v.data(), probs.data(), d_o.data(), dq.data(), dk.data(), dv.data(),
                        ws.data());
      ops->FlashAttentionFwd(sh, q.data(), kk.data(), v.data(), fo.data(), lse.data());
      ops->FlashAttentionBwd(sh, q.data(), kk.data(), v.data(), fo.data(), lse.data(), d_o.data(), fdq.data(),
                             fdk.data(), fdv.data(), fws.data());
      return Bytes(probs, o, dq, dk, dv, fo, lse, fdq, fdk, fdv);
    });
  }

  const int64_t tokens = 17, experts = 8, top_k = 2, d = 10;
  const VecF logits = Rand(tokens * experts, 216, -3.f, 3.f), dwts = Rand(tokens * top_k, 217);
  const VecF x = Rand(tokens * d, 218), ys = Rand(tokens * top_k * d, 219), dout = Rand(tokens * d, 220);
  for (bool sigmoid : {false, true}) {
    twice("router, dispatch, combine", [&](float fill) {
      VecF probs(logits.size(), fill), wts(dwts.size(), fill), dl(logits.size(), fill);
      std::vector<int32_t> idx(dwts.size(), fill == 0.f ? 0 : -5), slot_of(idx);
      std::vector<int64_t> offs(static_cast<size_t>(experts + 1), fill == 0.f ? 0 : -5);
      VecF xs(ys.size(), fill), dx(x.size(), fill), out(x.size(), fill), dys(ys.size(), fill);
      VecF dw_native(dwts.size(), fill), dw_rewrite(dwts.size(), fill);
      ops->RouterFwd(logits.data(), tokens, experts, top_k, sigmoid, true, probs.data(), idx.data(), wts.data());
      ops->RouterBwd(probs.data(), idx.data(), wts.data(), dwts.data(), tokens, experts, top_k, sigmoid, true,
                     dl.data());
      ops->DispatchPlan(idx.data(), tokens, top_k, experts, slot_of.data(), offs.data());
      ops->DispatchFwd(x.data(), slot_of.data(), tokens, top_k, d, xs.data());
      ops->DispatchBwd(ys.data(), slot_of.data(), tokens, top_k, d, dx.data());
      ops->CombineFwd(ys.data(), slot_of.data(), wts.data(), tokens, top_k, d, out.data());
      ops->CombineBwd(dout.data(), slot_of.data(), wts.data(), ys.data(), tokens, top_k, d, dys.data(),
                      dw_native.data());
      ops->RouterGradRewrite(ys.data(), xs.data(), slot_of.data(), wts.data(), tokens, top_k, d, dw_rewrite.data());
      return Bytes(probs, idx, wts, dl, slot_of, offs, xs, dx, out, dys, dw_native, dw_rewrite);
    });
  }

  twice("softmax, sigmoid, top-k", [&](float fill) {
    VecF sm(logits.size(), fill), smc(logits.size(), fill), dsm(logits.size(), fill), sg(logits.size(), fill);
    VecF dsg(logits.size(), fill), wts(dwts.size(), fill), dp(logits.size(), fill);
    std::vector<int32_t> idx(dwts.size(), fill == 0.f ? 0 : -5);
    ops->SoftmaxFwd(logits.data(), tokens, experts, 0.5f, 0, sm.data());
    ops->SoftmaxFwd(logits.data(), tokens, experts, 0.5f, 6, smc.data());
    ops->SoftmaxBwd(sm.data(), logits.data(), tokens, experts, 0.5f, dsm.data());
    ops->SigmoidFwd(logits.data(), tokens * experts, sg.data());
    ops->SigmoidBwd(sg.data(), logits.data(), tokens * experts, dsg.data());
    ops->TopKFwd(sm.data(), tokens, experts, top_k, true, idx.data(), wts.data());
    ops->TopKBwd(sm.data(), idx.data(), wts.data(), dwts.data(), tokens, experts, top_k, true, dp.data());
    return Bytes(sm, smc, dsm, sg, dsg, idx, wts, dp);
  });

  twice("embedding, split heads", [&](float fill) {
    const std::vector<int32_t> tok = {0, 3, 7, 1, 2, 5, 4, 6, 0, 1, 2, 3, 4, 5, 6, 7, 0};
    VecF y(x.size(), fill), dt = ys;
    ops->EmbeddingFwd(tok.data(), ys.data(), tokens, d, y.data());
    ops->EmbeddingBwd(tok.data(), x.data(), tokens, d, dt.data());
    const mk::SplitShape sh{.b = 1, .s = tokens, .heads = 2, .kv_heads = 1, .head_dim = 4, .rope = true};
    const int64_t nh = tokens * 4;  // one head
    VecF q(2 * nh, fill), kk(nh, fill), vv(nh, fill), dqkv(4 * nh, fill);
    ops->SplitHeadsFwd(ys.data(), sh, q.data(), kk.data(), vv.data());
    ops->SplitHeadsBwd(q.data(), kk.data(), vv.data(), sh, dqkv.data());
    return Bytes(y, dt, q, kk, vv, dqkv);
  });

  twice("cross entropy", [&](float fill) {
    const std::vector<int32_t> tgt = {0, 3, 7, 1, 2, 5, 4, 6, 0, 1, 2, 3, 4, 5, 6, 7, 0};
    VecF probs(logits.size(), fill), loss(static_cast<size_t>(tokens), fill), dl(logits.size(), fill);
    ops->CrossEntropyFwd(logits.data(), tgt.data(), tokens, experts, probs.data(), loss.data());
    ops->CrossEntropyBwd(probs.data(), tgt.data(), tokens, experts, 1.f / tokens, dl.data());
    return Bytes(probs, loss, dl);
  });

  const int64_t nsrc = 4;
  const VecF src = Rand(nsrc * tokens * d, 221), w = Rand(d, 222), g = Rand(d, 223);
  twice("attn_res", [&](float fill) {
    VecF h(x.size(), fill), wts(static_cast<size_t>(tokens * nsrc), fill), ds(src.size(), 0.f), dw = w, dg = g;
    ops->AttnResFwd(ConstBlocks(src, nsrc).data(), nsrc, w.data(), g.data(), tokens, d, 1e-6f, h.data(), wts.data());
    ops->AttnResBwd(ConstBlocks(src, nsrc).data(), nsrc, w.data(), g.data(), dout.data(), tokens, d, 1e-6f,
                    Blocks(ds, nsrc).data(), dw.data(), dg.data(), nullptr);
    return Bytes(h, wts, ds, dw, dg);
  });
}

// bf16 storage: round to nearest even, ties to even, NaN to the canonical
// NaN, the largest finite values to infinity, as CUDA's __float2bfloat16_rn;
// checked against the nearest representable bf16 found by search in double.
TEST_CASE("bf16 rounding: nearest, ties to even, as CUDA") {
  auto bits = [](float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return u;
  };
  auto from = [](uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  };
  // Ties: 1 + 2^-8 is halfway between 1 and 1 + 2^-7: to 1 (even); the next
  // tie up goes up.
  CHECK(mk::FloatToBf16(from(0x3F808000u)) == 0x3F80);
  CHECK(mk::FloatToBf16(from(0x3F818000u)) == 0x3F82);
  CHECK(mk::FloatToBf16(from(0x3F808001u)) == 0x3F81);
  CHECK(mk::FloatToBf16(std::numeric_limits<float>::max()) == 0x7F80);  // to +inf
  CHECK(mk::FloatToBf16(-std::numeric_limits<float>::infinity()) == 0xFF80);
  // Every NaN becomes the canonical 0x7FFF (CUDA's), a signalling one too.
  CHECK(mk::FloatToBf16(std::numeric_limits<float>::quiet_NaN()) == 0x7FFF);
  CHECK(mk::FloatToBf16(from(0x7F800001u)) == 0x7FFF);
  CHECK(mk::FloatToBf16(from(0xFFC00000u)) == 0x7FFF);
  int checked = 0;
  for (uint64_t i = 0; i < 200000; ++i) {
    const uint32_t u = static_cast<uint32_t>(i * 2654435761u) & 0xFF7FFFFFu;  // finite, both signs
    const float f = from(u);
    const uint16_t got = mk::FloatToBf16(f);
    CHECK(bits(mk::Bf16ToFloat(got)) == (static_cast<uint32_t>(got) << 16));
    // The two bf16 neighbours of f and the nearer (ties: even mantissa).
    const uint16_t lo = static_cast<uint16_t>(u >> 16), hi = static_cast<uint16_t>(lo + 1);
    // Past the largest finite bf16 the upper neighbour is infinity, which
    // IEEE rounding places at 2^128 for the comparison.
    const double hv = (hi & 0x7FFF) == 0x7F80 ? std::copysign(std::ldexp(1.0, 128), double(f)) : mk::Bf16ToFloat(hi);
    const double dl = std::fabs(double(mk::Bf16ToFloat(lo)) - f), dh = std::fabs(hv - f);
    const uint16_t want = dl < dh ? lo : dh < dl ? hi : ((lo & 1) == 0 ? lo : hi);
    if (got != want) {
      CHECK(got == want);
      break;
    }
    ++checked;
  }
  CHECK(checked == 200000);
  auto ops = mk::MakeRefOps();
  const VecF x = Rand(1000, 990, -1e3f, 1e3f);
  std::vector<uint16_t> b(x.size());
  VecF back(x.size());
  ops->RoundToBf16(x.data(), static_cast<int64_t>(x.size()), b.data());
  ops->WidenBf16(b.data(), static_cast<int64_t>(b.size()), back.data());
  for (size_t i = 0; i < x.size(); ++i) CHECK(std::fabs(back[i] - x[i]) <= std::fabs(x[i]) * (1.f / 256));
}
