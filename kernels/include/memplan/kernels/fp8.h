// FP8 E4M3 blockwise (1x128) quantization: CPU reference.
//
// Glossary
//   E4M3   OCP FP8 format: 1 sign, 4 exponent (bias 7), 3 mantissa bits. Largest
//          finite magnitude 448 (0x7E), smallest subnormal 2^-9 (0x01), no
//          infinity; 0x7F / 0xFF are NaN.
//   block  1x128 run of consecutive elements within one row of a row-major
//          [rows, cols] matrix. Block b of a row covers columns
//          [128*b, min(128*(b+1), cols)); the last block of a row is short when
//          cols % 128 != 0 (a "tail"). Blocks never span rows.
//   scale  fp32 *dequantization* scale of one block: x ~= E4M3ToFloat(v) * scale.
//          Quantized values are v = FloatToE4M3(x / scale) (one IEEE division,
//          round to nearest even, then saturating conversion).
//
// Layout of a quantized matrix (see Fp8BlockLayout):
//   values  uint8_t[rows][cols], row-major, one E4M3 code per element;
//   scales  float[rows][BlocksPerRow()], row-major.
//
// These functions are the bit-exact reference for the CUDA kernels in
// fp8_cuda.h: same scale formula, same division, same rounding. Nothing here
// allocates; callers own every output buffer. Inputs are expected to be finite:
// a NaN is ignored by the block's amax and encodes as a NaN code, an infinity
// makes its block's scale infinite (values and dequantized output of that block
// are then meaningless).
#pragma once

#include <cstddef>
#include <cstdint>

namespace memplan::kernels {

// Elements per quantization block (along a row).
inline constexpr int64_t kFp8Block = 128;
// Largest finite E4M3 magnitude.
inline constexpr float kE4M3Max = 448.f;
// Smallest scale ever produced (2^-126, the smallest normal float). Blocks whose
// amax is so small that amax/448 would be below it use this floor, so that
// scales are always normal floats and x/scale cannot overflow.
inline constexpr float kFp8MinScale = 0x1p-126f;
// Alignment in bytes of the scale array inside a packed buffer.
inline constexpr int64_t kFp8PackAlignBytes = 16;

// Converts a float to E4M3: round to nearest, ties to even; saturating
// (SATFINITE): any finite or infinite magnitude above 448 becomes +-448
// (0x7E / 0xFE); NaN becomes 0x7F. Magnitudes <= 2^-10 round to a signed zero
// (0x00 / 0x80); subnormals (multiples of 2^-9) are produced below 2^-6.
// Bit-identical to cuda_fp8.h's
// __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3) for every non-NaN input.
// Plain C++, O(1).
uint8_t FloatToE4M3(float x);

// Exact decode of an E4M3 code. 0x7F / 0xFF decode to a quiet NaN carrying the
// code's sign; every other code decodes exactly (0x80 -> -0.0f).
float E4M3ToFloat(uint8_t v);

// Shape of one quantized row-major [rows, cols] matrix and the byte sizes of its
// parts. Invariant: rows >= 0, cols >= 0. Either may be 0 (empty matrix).
struct Fp8BlockLayout {
  int64_t rows = 0;
  int64_t cols = 0;

  // Blocks per row: ceil(cols / kFp8Block); 0 when cols == 0.
  int64_t BlocksPerRow() const { return (cols + kFp8Block - 1) / kFp8Block; }
  // Bytes of the E4M3 value array: rows * cols.
  int64_t ValueBytes() const { return rows * cols; }
  // Bytes of the fp32 scale array: rows * BlocksPerRow() * 4.
  int64_t ScaleBytes() const {
    return rows * BlocksPerRow() * static_cast<int64_t>(sizeof(float));
  }
  // Byte offset of the scales inside a packed buffer: ValueBytes() rounded up
  // to kFp8PackAlignBytes.
  int64_t PackedScaleOffsetBytes() const {
    return (ValueBytes() + kFp8PackAlignBytes - 1) / kFp8PackAlignBytes *
           kFp8PackAlignBytes;
  }
  // Bytes of the packed buffer (values, zero padding, scales):
  // PackedScaleOffsetBytes() + ScaleBytes().
  int64_t PackedBytes() const { return PackedScaleOffsetBytes() + ScaleBytes(); }
};

// How a block's dequantization scale is chosen from its amax (the largest |x|
// in the block, NaN ignored).
enum class ScaleMode {
  // scale = amax / 448 (one fp32 division, round to nearest even), floored at
  // kFp8MinScale; an all-zero block gets scale 1. The largest element maps to
  // (about) +-448, so the full E4M3 range is used.
  kAmax,
  // UE8M0-style: scale = 2^ceil(log2(amax / 448)) computed exactly from the
  // bits of amax (no rounding of amax/448 first), floored at kFp8MinScale; an
  // all-zero block gets scale 1. Because scale >= amax/448 exactly,
  // |x / scale| <= 448 for every element: conversion never saturates.
  // x / scale is exact (power-of-two divisor), so only the E4M3 rounding errs.
  kPow2,
};

// Quantizes a row-major fp32 matrix blockwise.
//   x       [layout.rows][layout.cols] fp32, read only.
//   values  [layout.rows][layout.cols] E4M3 codes, written.
//   scales  [layout.rows][layout.BlocksPerRow()] fp32 dequant scales, written.
// Deterministic; O(rows * cols). Pointers may be null only when the matching
// array is empty.
void QuantizeFp8BlockwiseRef(const float* x, Fp8BlockLayout layout,
                             ScaleMode mode, uint8_t* values, float* scales);

// Same as above for bf16 input given as raw bf16 bit patterns (the upper 16
// bits of an fp32). Each element is widened exactly to fp32 first, so the
// result equals the fp32 overload applied to the widened matrix.
void QuantizeFp8BlockwiseRef(const uint16_t* x_bf16, Fp8BlockLayout layout,
                             ScaleMode mode, uint8_t* values, float* scales);

// Dequantizes: y[r][c] = E4M3ToFloat(values[r][c]) * scales[r][c / 128] (one
// fp32 multiplication, round to nearest even).
//   y  [layout.rows][layout.cols] fp32, written.
void DequantizeFp8BlockwiseRef(const uint8_t* values, const float* scales,
                               Fp8BlockLayout layout, float* y);

// Packs values and scales into one contiguous buffer of layout.PackedBytes()
// bytes: values at offset 0, zero padding up to PackedScaleOffsetBytes(), then
// the scales (native-endian fp32). The scales are 16-byte aligned whenever
// `packed` is.
void PackFp8(const uint8_t* values, const float* scales, Fp8BlockLayout layout,
             std::byte* packed);

// Inverse of PackFp8: copies values (layout.ValueBytes()) and scales
// (layout.ScaleBytes()) out of a packed buffer. `packed` needs no alignment.
void UnpackFp8(const std::byte* packed, Fp8BlockLayout layout, uint8_t* values,
               float* scales);

}  // namespace memplan::kernels
