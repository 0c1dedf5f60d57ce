#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "fp8_scale.h"
#include "memplan/kernels/fp8.h"

namespace memplan::kernels {
namespace {

constexpr uint32_t kF32AbsMask = 0x7FFFFFFFu;
constexpr uint32_t kF32Inf = 0x7F800000u;
// 464 = 448 + half an E4M3 ulp at the top binade. Anything strictly above
// rounds past 448 and saturates; 464 itself ties to the even 448 (0x7E).
constexpr uint32_t kF32Bits464 = 0x43E80000u;
// 2^-10 = half the smallest subnormal; at or below it rounds (ties-to-even)
// to zero.
constexpr uint32_t kF32Bits2PowM10 = 0x3A800000u;

template <typename LoadFn>
void QuantizeImpl(LoadFn load, Fp8BlockLayout layout, ScaleMode mode,
                  uint8_t* values, float* scales) {
  const int64_t blocks_per_row = layout.BlocksPerRow();
  for (int64_t r = 0; r < layout.rows; ++r) {
    for (int64_t b = 0; b < blocks_per_row; ++b) {
      const int64_t begin = r * layout.cols + b * kFp8Block;
      const int64_t len = std::min(kFp8Block, layout.cols - b * kFp8Block);
      // fmax drops NaN, matching the device's fmaxf warp reduction; max is
      // exact, so the order of the reduction cannot change the result.
      float amax = 0.f;
      for (int64_t i = 0; i < len; ++i) {
        amax = std::fmax(amax, std::fabs(load(begin + i)));
      }
      const float scale = detail::BlockScale(amax, mode);
      scales[r * blocks_per_row + b] = scale;
      for (int64_t i = 0; i < len; ++i) {
        values[begin + i] = FloatToE4M3(load(begin + i) / scale);
      }
    }
  }
}

}  // namespace

uint8_t FloatToE4M3(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const uint32_t abs_bits = bits & kF32AbsMask;
  if (abs_bits > kF32Inf) return 0x7F;  // NaN: canonical, sign dropped (as CUDA)
  const auto sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  if (abs_bits > kF32Bits464) return sign | 0x7E;  // SATFINITE, incl. +-inf
  if (abs_bits <= kF32Bits2PowM10) return sign;    // signed zero

  // Here 2^-10 < |x| <= 464, so x is a normal float: |x| = sig * 2^(e-23)
  // with sig in [2^23, 2^24).
  const int e = static_cast<int>(abs_bits >> 23) - 127;
  const uint32_t sig = (abs_bits & 0x7FFFFFu) | 0x800000u;
  // Normal E4M3 (e >= -6) keeps 3 of the 23 fraction bits; below that the
  // value is counted in units of 2^-9 (subnormal spacing), so more bits go.
  const int shift = e >= -6 ? 20 : 14 - e;  // 20..24
  uint32_t q = sig >> shift;
  const uint32_t rem = sig & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  if (rem > half || (rem == half && (q & 1u))) ++q;
  // Normal: q in [8, 16] is 1.mmm scaled by 8, and exponent field e+7
  // contributes (e+7)*8; the implicit 8 is folded into (e+6)*8. A carry to 16
  // bumps the exponent field naturally. Subnormal: q is the code itself (and
  // q == 8 is exactly the smallest normal, 0x08).
  const int code = e >= -6 ? ((e + 6) << 3) + static_cast<int>(q)
                           : static_cast<int>(q);
  // code <= 0x7E here because |x| <= 464 ties down to 448.
  return static_cast<uint8_t>(sign | code);
}

float E4M3ToFloat(uint8_t v) {
  const bool negative = (v & 0x80u) != 0;
  const uint32_t exp_field = (v >> 3) & 0xFu;
  const uint32_t mantissa = v & 0x7u;
  float mag;
  if (exp_field == 0xF && mantissa == 0x7) {
    mag = std::numeric_limits<float>::quiet_NaN();
  } else if (exp_field == 0) {
    mag = static_cast<float>(mantissa) * 0x1p-9f;  // exact
  } else {
    // Rebias 7 -> 127 and widen the 3-bit mantissa; exact.
    mag = detail::BitsFloat(((exp_field + 120u) << 23) | (mantissa << 20));
  }
  return negative ? -mag : mag;
}

void QuantizeFp8BlockwiseRef(const float* x, Fp8BlockLayout layout,
                             ScaleMode mode, uint8_t* values, float* scales) {
  QuantizeImpl([x](int64_t i) { return x[i]; }, layout, mode, values, scales);
}

void QuantizeFp8BlockwiseRef(const uint16_t* x_bf16, Fp8BlockLayout layout,
                             ScaleMode mode, uint8_t* values, float* scales) {
  QuantizeImpl([x_bf16](int64_t i) { return detail::Bf16BitsToFloat(x_bf16[i]); },
               layout, mode, values, scales);
}

void DequantizeFp8BlockwiseRef(const uint8_t* values, const float* scales,
                               Fp8BlockLayout layout, float* y) {
  const int64_t blocks_per_row = layout.BlocksPerRow();
  for (int64_t r = 0; r < layout.rows; ++r) {
    const float* row_scales = scales + r * blocks_per_row;
    for (int64_t c = 0; c < layout.cols; ++c) {
      const int64_t i = r * layout.cols + c;
      y[i] = E4M3ToFloat(values[i]) * row_scales[c / kFp8Block];
    }
  }
}

void PackFp8(const uint8_t* values, const float* scales, Fp8BlockLayout layout,
             std::byte* packed) {
  const int64_t value_bytes = layout.ValueBytes();
  const int64_t scale_offset = layout.PackedScaleOffsetBytes();
  if (value_bytes > 0) std::memcpy(packed, values, static_cast<size_t>(value_bytes));
  // Zero the padding so packed buffers are byte-for-byte deterministic.
  if (scale_offset > value_bytes) {
    std::memset(packed + value_bytes, 0,
                static_cast<size_t>(scale_offset - value_bytes));
  }
  if (layout.ScaleBytes() > 0) {
    std::memcpy(packed + scale_offset, scales,
                static_cast<size_t>(layout.ScaleBytes()));
  }
}

void UnpackFp8(const std::byte* packed, Fp8BlockLayout layout, uint8_t* values,
               float* scales) {
  if (layout.ValueBytes() > 0) {
    std::memcpy(values, packed, static_cast<size_t>(layout.ValueBytes()));
  }
  if (layout.ScaleBytes() > 0) {
    std::memcpy(scales, packed + layout.PackedScaleOffsetBytes(),
                static_cast<size_t>(layout.ScaleBytes()));
  }
}

}  // namespace memplan::kernels
