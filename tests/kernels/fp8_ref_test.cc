// CPU reference tests for FP8 E4M3 blockwise quantization (always run).
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "memplan/kernels/fp8.h"
// Included only to prove the launcher header builds without CUDA headers.
#include "memplan/kernels/fp8_cuda.h"

namespace mk = memplan::kernels;

namespace {

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

bool IsPowerOfTwo(float f) {
  return f > 0.f && std::isnormal(f) && (Bits(f) & 0x7FFFFFu) == 0;
}

// Independent E4M3 encoder: nearest of the 127 non-negative finite codes by
// exact (double) distance, ties to the even code, magnitudes > 448 saturate.
uint8_t BruteForceE4M3(float x) {
  if (std::isnan(x)) return 0x7F;
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  const double a = std::fabs(static_cast<double>(x));
  if (a > 448.0) return sign | 0x7E;
  int best = 0;
  double best_err = std::numeric_limits<double>::infinity();
  for (int c = 0; c <= 0x7E; ++c) {
    const double err = std::fabs(static_cast<double>(mk::E4M3ToFloat(
                                     static_cast<uint8_t>(c))) - a);
    if (err < best_err || (err == best_err && (c & 1) == 0)) {
      best = c;
      best_err = err;
    }
  }
  return static_cast<uint8_t>(sign | best);
}

// Random non-zero inputs; each row gets its own magnitude so scales vary over
// many binades (including very small and very large ones).
std::vector<float> RandomMatrix(mk::Fp8BlockLayout layout, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> unit(-1.f, 1.f);
  std::uniform_int_distribution<int> binade(-40, 40);
  std::vector<float> x(static_cast<size_t>(layout.ValueBytes()));
  for (int64_t r = 0; r < layout.rows; ++r) {
    const float row_scale = std::ldexp(1.f, binade(rng));
    for (int64_t c = 0; c < layout.cols; ++c) {
      float v = 0.f;
      while (v == 0.f) v = unit(rng);
      x[static_cast<size_t>(r * layout.cols + c)] = v * row_scale;
    }
  }
  return x;
}

float BlockAmax(const std::vector<float>& x, mk::Fp8BlockLayout layout,
                int64_t r, int64_t b) {
  float amax = 0.f;
  for (int64_t c = b * mk::kFp8Block;
       c < std::min(layout.cols, (b + 1) * mk::kFp8Block); ++c) {
    amax = std::fmax(amax, std::fabs(x[static_cast<size_t>(r * layout.cols + c)]));
  }
  return amax;
}

constexpr int64_t kTailCols[] = {1, 127, 128, 129, 300};

}  // namespace

TEST_CASE("E4M3 encodes known values") {
  CHECK(mk::FloatToE4M3(448.f) == 0x7E);
  CHECK(mk::FloatToE4M3(456.f) == 0x7E);
  CHECK(mk::FloatToE4M3(464.f) == 0x7E);  // tie between 448 and (NaN) 480
  CHECK(mk::FloatToE4M3(1000.f) == 0x7E);  // saturated
  CHECK(mk::FloatToE4M3(-1000.f) == 0xFE);
  CHECK(mk::FloatToE4M3(std::numeric_limits<float>::max()) == 0x7E);
  CHECK(mk::FloatToE4M3(std::numeric_limits<float>::infinity()) == 0x7E);
  CHECK(mk::FloatToE4M3(-std::numeric_limits<float>::infinity()) == 0xFE);
  CHECK(mk::FloatToE4M3(std::numeric_limits<float>::quiet_NaN()) == 0x7F);
  CHECK(mk::FloatToE4M3(-std::numeric_limits<float>::quiet_NaN()) == 0x7F);
  CHECK(mk::FloatToE4M3(0.f) == 0x00);
  CHECK(mk::FloatToE4M3(-0.f) == 0x80);
  CHECK(mk::FloatToE4M3(1.f) == 0x38);
  CHECK(mk::FloatToE4M3(-2.f) == 0xC0);
  CHECK(mk::FloatToE4M3(240.f) == 0x77);
  CHECK(mk::FloatToE4M3(0x1p-6f) == 0x08);   // smallest normal
  CHECK(mk::FloatToE4M3(0x1p-9f) == 0x01);   // smallest subnormal
  CHECK(mk::FloatToE4M3(-0x1p-9f) == 0x81);
  CHECK(mk::FloatToE4M3(7 * 0x1p-9f) == 0x07);  // largest subnormal
  CHECK(mk::FloatToE4M3(1e-30f) == 0x00);
  CHECK(mk::FloatToE4M3(-1e-30f) == 0x80);  // underflow keeps the sign
  CHECK(mk::FloatToE4M3(FromBits(1)) == 0x00);  // float subnormal
}

TEST_CASE("E4M3 rounds to nearest, ties to even") {
  // Normal range: 1.0 (m=0) | 1.125 (m=1) | 1.25 (m=2).
  CHECK(mk::FloatToE4M3(1.0625f) == 0x38);   // tie -> even m=0
  CHECK(mk::FloatToE4M3(std::nextafter(1.0625f, 2.f)) == 0x39);
  CHECK(mk::FloatToE4M3(std::nextafter(1.0625f, 0.f)) == 0x38);
  CHECK(mk::FloatToE4M3(1.1875f) == 0x3A);   // tie -> even m=2
  CHECK(mk::FloatToE4M3(-1.1875f) == 0xBA);
  CHECK(mk::FloatToE4M3(1.9375f) == 0x40);  // tie 1.875/2.0 -> carries into 2.0
  CHECK(mk::FloatToE4M3(432.f) == 0x7E);     // tie 416/448 -> even m=6
  CHECK(mk::FloatToE4M3(424.f) == 0x7D);
  // Subnormal range: multiples of 2^-9.
  CHECK(mk::FloatToE4M3(0x1p-10f) == 0x00);  // tie 0 / 2^-9 -> 0
  CHECK(mk::FloatToE4M3(-0x1p-10f) == 0x80);
  CHECK(mk::FloatToE4M3(std::nextafter(0x1p-10f, 1.f)) == 0x01);
  CHECK(mk::FloatToE4M3(3 * 0x1p-10f) == 0x02);   // tie 1/2 -> 2
  CHECK(mk::FloatToE4M3(5 * 0x1p-10f) == 0x02);   // tie 2/3 -> 2
  CHECK(mk::FloatToE4M3(15 * 0x1p-10f) == 0x08);  // tie 7/8 -> smallest normal
}

TEST_CASE("E4M3 decodes every code; decode-then-encode is the identity") {
  for (int c = 0; c < 256; ++c) {
    const auto code = static_cast<uint8_t>(c);
    const float f = mk::E4M3ToFloat(code);
    if ((c & 0x7F) == 0x7F) {
      CHECK(std::isnan(f));
      continue;
    }
    CHECK(std::signbit(f) == ((c & 0x80) != 0));
    CHECK(mk::FloatToE4M3(f) == code);
  }
  CHECK(mk::E4M3ToFloat(0x7E) == 448.f);
  CHECK(mk::E4M3ToFloat(0x01) == 0x1p-9f);
  CHECK(mk::E4M3ToFloat(0x08) == 0x1p-6f);
  CHECK(Bits(mk::E4M3ToFloat(0x80)) == Bits(-0.f));
  for (int c = 1; c <= 0x7E; ++c) {  // strictly increasing magnitudes
    CHECK(mk::E4M3ToFloat(static_cast<uint8_t>(c)) >
          mk::E4M3ToFloat(static_cast<uint8_t>(c - 1)));
  }
}

TEST_CASE("E4M3 encoder matches a brute-force nearest-code search") {
  // Every midpoint between neighbouring codes and its float neighbours: the
  // places where rounding decisions are made.
  std::vector<float> probes;
  for (int c = 0; c < 0x7E; ++c) {
    const double lo = mk::E4M3ToFloat(static_cast<uint8_t>(c));
    const double hi = mk::E4M3ToFloat(static_cast<uint8_t>(c + 1));
    const auto mid = static_cast<float>((lo + hi) / 2);  // exact in float
    float below = mid;
    float above = mid;
    for (int k = 0; k < 3; ++k) {
      below = std::nextafter(below, 0.f);
      above = std::nextafter(above, 1e9f);
      probes.push_back(below);
      probes.push_back(above);
    }
    probes.push_back(mid);
    probes.push_back(static_cast<float>(lo));
  }
  for (const float p : {448.f, 456.f, 464.f, 465.f, 480.f}) probes.push_back(p);
  std::mt19937 rng(1234);
  std::uniform_int_distribution<uint32_t> in_range(0x39000000u, 0x44000000u);
  for (int i = 0; i < 100000; ++i) probes.push_back(FromBits(in_range(rng)));
  int mismatches = 0;
  for (const float p : probes) {
    for (const float s : {p, -p}) {
      if (mk::FloatToE4M3(s) != BruteForceE4M3(s)) ++mismatches;
    }
  }
  CHECK(mismatches == 0);
}

TEST_CASE("Fp8BlockLayout sizes") {
  const mk::Fp8BlockLayout l{3, 300};
  CHECK(l.BlocksPerRow() == 3);
  CHECK(l.ValueBytes() == 900);
  CHECK(l.ScaleBytes() == 36);
  CHECK(l.PackedScaleOffsetBytes() == 912);
  CHECK(l.PackedBytes() == 948);
  CHECK(mk::Fp8BlockLayout{5, 0}.BlocksPerRow() == 0);
  CHECK(mk::Fp8BlockLayout{5, 0}.PackedBytes() == 0);
  CHECK(mk::Fp8BlockLayout{2, 128}.PackedBytes() == 256 + 8);
  CHECK(mk::Fp8BlockLayout{1, 129}.BlocksPerRow() == 2);
}

TEST_CASE("quantize/dequantize error bound with tails") {
  for (const mk::ScaleMode mode : {mk::ScaleMode::kAmax, mk::ScaleMode::kPow2}) {
    for (const int64_t cols : kTailCols) {
      const mk::Fp8BlockLayout layout{7, cols};
      CAPTURE(cols);
      CAPTURE(static_cast<int>(mode));
      const std::vector<float> x = RandomMatrix(layout, static_cast<uint32_t>(cols));
      std::vector<uint8_t> values(static_cast<size_t>(layout.ValueBytes()));
      std::vector<float> scales(static_cast<size_t>(layout.rows * layout.BlocksPerRow()));
      std::vector<float> y(x.size());
      mk::QuantizeFp8BlockwiseRef(x.data(), layout, mode, values.data(), scales.data());
      mk::DequantizeFp8BlockwiseRef(values.data(), scales.data(), layout, y.data());

      int bad = 0;
      for (int64_t r = 0; r < layout.rows; ++r) {
        for (int64_t c = 0; c < cols; ++c) {
          const auto i = static_cast<size_t>(r * cols + c);
          const float scale = scales[static_cast<size_t>(r * layout.BlocksPerRow() +
                                                         c / mk::kFp8Block)];
          const double xi = x[i];
          const double err = std::fabs(static_cast<double>(y[i]) - xi);
          // Normal E4M3 range: half an ulp of a 3-bit mantissa, 2^-4
          // relative. Subnormal range: half the 2^-9 spacing, absolute.
          const bool normal = std::fabs(xi) / scale >= 0x1p-6;
          const double bound = normal ? 0x1p-4 * std::fabs(xi) * (1 + 0x1p-12)
                                      : 0x1p-10 * scale * (1 + 0x1p-12);
          if (err > bound) ++bad;
          if (y[i] != mk::E4M3ToFloat(values[i]) * scale) ++bad;
        }
      }
      CHECK(bad == 0);
    }
  }
}

TEST_CASE("amax scales: amax/448, zero block gets 1, tiny amax floored") {
  const mk::Fp8BlockLayout layout{3, 300};
  std::vector<float> x = RandomMatrix(layout, 99);
  for (int64_t c = 128; c < 256; ++c) x[static_cast<size_t>(c)] = 0.f;  // row 0, block 1
  x[static_cast<size_t>(129)] = -0.f;
  for (int64_t c = 256; c < 300; ++c) x[static_cast<size_t>(300 + c)] = 1e-40f;  // row 1 tail
  std::vector<uint8_t> values(static_cast<size_t>(layout.ValueBytes()));
  std::vector<float> scales(9);
  mk::QuantizeFp8BlockwiseRef(x.data(), layout, mk::ScaleMode::kAmax, values.data(),
                              scales.data());
  CHECK(scales[1] == 1.f);
  for (int64_t c = 128; c < 256; ++c) {
    CHECK((values[static_cast<size_t>(c)] & 0x7F) == 0);
  }
  CHECK(scales[5] == mk::kFp8MinScale);
  for (int64_t r = 0; r < layout.rows; ++r) {
    for (int64_t b = 0; b < layout.BlocksPerRow(); ++b) {
      const float amax = BlockAmax(x, layout, r, b);
      const float s = scales[static_cast<size_t>(r * 3 + b)];
      if (amax == 0.f) {
        CHECK(s == 1.f);
      } else {
        CHECK(s == std::fmax(amax / 448.f, mk::kFp8MinScale));
      }
    }
  }
  // The largest element of each block with an unclamped scale lands on +-448.
  int hits = 0;
  for (int64_t r = 0; r < layout.rows; ++r) {
    for (int64_t c = 0; c < layout.cols; ++c) {
      const int64_t b = c / mk::kFp8Block;
      const float amax = BlockAmax(x, layout, r, b);
      const auto i = static_cast<size_t>(r * layout.cols + c);
      if (amax / 448.f >= mk::kFp8MinScale && std::fabs(x[i]) == amax) {
        ++hits;
        CHECK((values[i] & 0x7F) == 0x7E);
      }
    }
  }
  CHECK(hits > 0);
}

TEST_CASE("pow2 scales are minimal powers of two and never overflow") {
  for (const int64_t cols : kTailCols) {
    const mk::Fp8BlockLayout layout{9, cols};
    const std::vector<float> x = RandomMatrix(layout, 7 + static_cast<uint32_t>(cols));
    std::vector<uint8_t> values(static_cast<size_t>(layout.ValueBytes()));
    std::vector<float> scales(static_cast<size_t>(layout.rows * layout.BlocksPerRow()));
    mk::QuantizeFp8BlockwiseRef(x.data(), layout, mk::ScaleMode::kPow2, values.data(),
                                scales.data());
    int bad = 0;
    for (int64_t r = 0; r < layout.rows; ++r) {
      for (int64_t b = 0; b < layout.BlocksPerRow(); ++b) {
        const double amax = BlockAmax(x, layout, r, b);
        const float s = scales[static_cast<size_t>(r * layout.BlocksPerRow() + b)];
        if (!IsPowerOfTwo(s)) ++bad;
        if (amax > 448.0 * s) ++bad;  // exact in double
        if (s > mk::kFp8MinScale && amax <= 224.0 * s) ++bad;  // not minimal
      }
    }
    for (size_t i = 0; i < x.size(); ++i) {
      // x/scale is exact, so no code beyond 448 and no saturation clamp.
      if (std::fabs(mk::E4M3ToFloat(values[i])) > 448.f) ++bad;
    }
    CHECK(bad == 0);
  }

  // Edges of the exponent decision: amax/448 exactly a power of two, just
  // above it, and the example from the notes (3/448 -> 2^-7).
  const auto pow2_scale = [](float amax) {
    float x[2] = {amax, -amax / 3};
    uint8_t v[2];
    float s = 0.f;
    mk::QuantizeFp8BlockwiseRef(x, mk::Fp8BlockLayout{1, 2}, mk::ScaleMode::kPow2, v,
                                &s);
    return s;
  };
  CHECK(pow2_scale(448.f) == 1.f);
  CHECK(pow2_scale(std::nextafter(448.f, 1e9f)) == 2.f);
  CHECK(pow2_scale(224.f) == 0.5f);
  CHECK(pow2_scale(3.f) == 0x1p-7f);
  CHECK(pow2_scale(1.f) == 0x1p-8f);
  CHECK(pow2_scale(std::numeric_limits<float>::max()) == 0x1p120f);
  CHECK(pow2_scale(1e-40f) == mk::kFp8MinScale);
  CHECK(pow2_scale(448.f * 0x1p-127f) == mk::kFp8MinScale);
  CHECK(pow2_scale(448.f * 0x1p-126f) == mk::kFp8MinScale);
  CHECK(pow2_scale(448.f * 0x1p-125f) == 0x1p-125f);
}

TEST_CASE("bf16 input equals fp32 input widened") {
  const mk::Fp8BlockLayout layout{4, 300};
  const std::vector<float> wide = RandomMatrix(layout, 5);
  std::vector<uint16_t> bf16(wide.size());
  std::vector<float> widened(wide.size());
  for (size_t i = 0; i < wide.size(); ++i) {
    bf16[i] = static_cast<uint16_t>(Bits(wide[i]) >> 16);  // truncation is fine
    widened[i] = FromBits(static_cast<uint32_t>(bf16[i]) << 16);
  }
  for (const mk::ScaleMode mode : {mk::ScaleMode::kAmax, mk::ScaleMode::kPow2}) {
    std::vector<uint8_t> v1(wide.size()), v2(wide.size());
    std::vector<float> s1(12), s2(12);
    mk::QuantizeFp8BlockwiseRef(bf16.data(), layout, mode, v1.data(), s1.data());
    mk::QuantizeFp8BlockwiseRef(widened.data(), layout, mode, v2.data(), s2.data());
    CHECK(v1 == v2);
    CHECK(s1 == s2);
  }
}

TEST_CASE("quantization is deterministic") {
  const mk::Fp8BlockLayout layout{5, 129};
  const std::vector<float> x = RandomMatrix(layout, 11);
  std::vector<uint8_t> v1(x.size()), v2(x.size(), 0xAA);
  std::vector<float> s1(10), s2(10, -1.f);
  mk::QuantizeFp8BlockwiseRef(x.data(), layout, mk::ScaleMode::kAmax, v1.data(), s1.data());
  mk::QuantizeFp8BlockwiseRef(x.data(), layout, mk::ScaleMode::kAmax, v2.data(), s2.data());
  CHECK(v1 == v2);
  CHECK(s1 == s2);
}

TEST_CASE("pack/unpack round trip") {
  for (const int64_t cols : kTailCols) {
    const mk::Fp8BlockLayout layout{3, cols};
    const std::vector<float> x = RandomMatrix(layout, 21);
    std::vector<uint8_t> values(static_cast<size_t>(layout.ValueBytes()));
    std::vector<float> scales(static_cast<size_t>(layout.rows * layout.BlocksPerRow()));
    mk::QuantizeFp8BlockwiseRef(x.data(), layout, mk::ScaleMode::kPow2, values.data(),
                                scales.data());
    std::vector<std::byte> packed(static_cast<size_t>(layout.PackedBytes()),
                                  std::byte{0xCD});
    mk::PackFp8(values.data(), scales.data(), layout, packed.data());
    CHECK(layout.PackedScaleOffsetBytes() % mk::kFp8PackAlignBytes == 0);
    CHECK(layout.PackedBytes() == layout.PackedScaleOffsetBytes() + layout.ScaleBytes());
    for (int64_t i = layout.ValueBytes(); i < layout.PackedScaleOffsetBytes(); ++i) {
      CHECK(packed[static_cast<size_t>(i)] == std::byte{0});
    }
    std::vector<uint8_t> values2(values.size());
    std::vector<float> scales2(scales.size());
    mk::UnpackFp8(packed.data(), layout, values2.data(), scales2.data());
    CHECK(values2 == values);
    CHECK(scales2 == scales);
  }
  // Empty layouts touch nothing.
  mk::PackFp8(nullptr, nullptr, mk::Fp8BlockLayout{0, 128}, nullptr);
  mk::UnpackFp8(nullptr, mk::Fp8BlockLayout{4, 0}, nullptr, nullptr);
}
