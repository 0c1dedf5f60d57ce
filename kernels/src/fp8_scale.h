// Private: the block-scale formula shared by the CPU reference and the CUDA
// kernel. One definition compiled for both sides is what makes their scales
// (and therefore their values) bit-identical.
#pragma once

#include <cstdint>
#include <cstring>

#include "memplan/kernels/fp8.h"

#if defined(__CUDACC__)
#define MEMPLAN_FP8_HD __host__ __device__ __forceinline__
#else
#define MEMPLAN_FP8_HD inline
#endif

namespace memplan::kernels::detail {

MEMPLAN_FP8_HD uint32_t FloatBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

MEMPLAN_FP8_HD float BitsFloat(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

// Exact widening of a bf16 bit pattern.
MEMPLAN_FP8_HD float Bf16BitsToFloat(uint16_t b) {
  return BitsFloat(static_cast<uint32_t>(b) << 16);
}

// Dequant scale of a block whose largest magnitude is `amax` (>= 0, NaN
// already dropped by the fmax reduction). See ScaleMode for the contract.
MEMPLAN_FP8_HD float BlockScale(float amax, ScaleMode mode) {
  if (amax == 0.f) return 1.f;
  if (mode == ScaleMode::kAmax) {
    // One correctly rounded division on both host and device (nvcc's default
    // -prec-div=true); comparing against the floor is exact.
    const float s = amax / kE4M3Max;
    return s < kFp8MinScale ? kFp8MinScale : s;
  }
  // kPow2. amax = 1.m * 2^e; 448 = 1.75 * 2^8, so amax / 448 =
  // (1.m / 1.75) * 2^(e-8) with 1.m / 1.75 in [0.57, 1.15). The smallest k with
  // 2^k >= amax/448 is therefore e-8 when 1.m <= 1.75, else e-7. Deciding this
  // on the mantissa bits avoids rounding amax/448 first, which could land on a
  // power of two just below the true quotient and overflow 448.
  const uint32_t bits = FloatBits(amax);
  const int biased_exp = static_cast<int>((bits >> 23) & 0xFFu);
  if (biased_exp == 0) return kFp8MinScale;  // subnormal amax < 2^-126
  if (biased_exp == 0xFF) return amax;       // infinite amax: garbage in
  const uint32_t mantissa = bits & 0x7FFFFFu;
  int k = biased_exp - 127 - 8 + (mantissa > 0x600000u ? 1 : 0);
  if (k < -126) k = -126;
  return BitsFloat(static_cast<uint32_t>(k + 127) << 23);
}

}  // namespace memplan::kernels::detail
