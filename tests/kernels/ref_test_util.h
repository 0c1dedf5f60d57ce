// Helpers of the reference-kernel suites (ops_ref_test.cc, kda_ref_test.cc):
// deterministic inputs, central differences, relative-error checks.
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "memplan/kernels/ops.h"

namespace memplan::test::kernels {

namespace mk = memplan::kernels;
using VecF = std::vector<float>;
using VecD = std::vector<double>;

constexpr double kStep = 1e-6;    // finite-difference step
constexpr double kFdTol = 1e-6;   // analytic (double) vs finite differences
constexpr double kF32Tol = 1e-4;  // float Ops vs double reference

// Inputs in [lo, hi) from a stream of our own, independent of the standard
// library's distributions (same numbers on every platform).
inline VecF Rand(int64_t n, uint64_t seed, float lo = -1.f, float hi = 1.f) {
  VecF v(static_cast<size_t>(n));
  for (size_t i = 0; i < v.size(); ++i) v[i] = lo + (hi - lo) * mk::Uniform01(seed, 0x5EED, i);
  return v;
}

inline VecD ToD(const VecF& v) { return VecD(v.begin(), v.end()); }

inline double Dot(const VecD& a, const VecD& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// Central-difference gradient of loss() with respect to every element of x;
// loss must read x through a reference.
inline VecD NumGrad(VecD& x, const std::function<double()>& loss) {
  VecD g(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const double saved = x[i];
    x[i] = saved + kStep;
    const double up = loss();
    x[i] = saved - kStep;
    const double down = loss();
    x[i] = saved;
    g[i] = (up - down) / (2 * kStep);
  }
  return g;
}

// Element-wise relative error, with a floor of 1% of the largest |want| so
// that near-zero components (where finite differences carry only absolute
// accuracy) do not dominate.
inline void ExpectClose(const VecD& got, const VecD& want, double tol, const std::string& what) {
  REQUIRE(got.size() == want.size());
  double scale = 0;
  for (double w : want) scale = std::max(scale, std::fabs(w));
  CHECK_MESSAGE(scale > 0, what << ": the reference is all zeros, the check would be vacuous");
  double worst = 0;
  size_t at = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::fabs(got[i] - want[i]) / (std::fabs(want[i]) + 1e-2 * scale);
    if (!(err <= worst)) {  // also catches NaN
      worst = err;
      at = i;
    }
  }
  CHECK_MESSAGE(worst <= tol, what << ": worst relative error " << worst << " at " << at << " (got " << got[at]
                                   << ", want " << want[at] << ")");
}

inline void ExpectClose(const VecF& got, const VecD& want, double tol, const std::string& what) {
  ExpectClose(ToD(got), want, tol, what);
}

}  // namespace memplan::test::kernels
