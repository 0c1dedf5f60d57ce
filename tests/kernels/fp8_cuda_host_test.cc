// Checks the plain-C++ E4M3 codec against cuda_fp8.h's host implementation
// (the same rounding the device's cvt.rn.satfinite performs). Needs the CUDA
// headers, not a GPU.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <cuda_fp8.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "memplan/kernels/fp8.h"

namespace mk = memplan::kernels;

namespace {

float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

uint8_t CudaE4M3(float x) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3));
}

}  // namespace

TEST_CASE("FloatToE4M3 == __nv_cvt_float_to_fp8(SATFINITE, E4M3) on strided bits") {
  // Every 7th of the 2^32 patterns (7 is odd, so all low-bit residues and
  // every exponent are visited); NaN inputs are checked separately below.
  constexpr uint64_t kStride = 7;
  uint64_t checked = 0;
  uint64_t mismatches = 0;
  uint32_t first_bad = 0;
  for (uint64_t u = 0; u < (uint64_t{1} << 32); u += kStride) {
    const auto bits = static_cast<uint32_t>(u);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) continue;  // NaN
    const float x = FromBits(bits);
    if (mk::FloatToE4M3(x) != CudaE4M3(x)) {
      if (mismatches == 0) first_bad = bits;
      ++mismatches;
    }
    ++checked;
  }
  CAPTURE(first_bad);
  CHECK(checked > 600'000'000u);
  CHECK(mismatches == 0);
}

TEST_CASE("FloatToE4M3 == CUDA near every rounding midpoint") {
  int mismatches = 0;
  for (int c = 0; c < 0x7E; ++c) {
    const float lo = mk::E4M3ToFloat(static_cast<uint8_t>(c));
    const float hi = mk::E4M3ToFloat(static_cast<uint8_t>(c + 1));
    const uint32_t mid = Bits((lo + hi) / 2);  // exact: one extra bit
    for (uint32_t m = mid - 64; m <= mid + 64; ++m) {
      for (const float x : {FromBits(m), -FromBits(m)}) {
        if (mk::FloatToE4M3(x) != CudaE4M3(x)) ++mismatches;
      }
    }
  }
  for (const float x : {448.f, 464.f, 465.f, 480.f, 1e30f,
                        std::numeric_limits<float>::infinity(),
                        -std::numeric_limits<float>::infinity()}) {
    if (mk::FloatToE4M3(x) != CudaE4M3(x)) ++mismatches;
  }
  CHECK(mismatches == 0);
}

TEST_CASE("NaN inputs encode as 0x7F on both sides") {
  for (const uint32_t bits : {0x7FC00000u, 0xFFC00000u, 0x7F800001u, 0xFFFFFFFFu}) {
    CHECK(mk::FloatToE4M3(FromBits(bits)) == 0x7F);
    CHECK(CudaE4M3(FromBits(bits)) == 0x7F);
  }
}

TEST_CASE("E4M3ToFloat == CUDA decode for all 256 codes") {
  for (int c = 0; c < 256; ++c) {
    const auto code = static_cast<uint8_t>(c);
    const __half_raw h = __nv_cvt_fp8_to_halfraw(code, __NV_E4M3);
    const float cuda = __half2float(__half(h));
    const float mine = mk::E4M3ToFloat(code);
    CAPTURE(c);
    if (std::isnan(cuda)) {
      CHECK(std::isnan(mine));
    } else {
      CHECK(Bits(mine) == Bits(cuda));
    }
  }
}
