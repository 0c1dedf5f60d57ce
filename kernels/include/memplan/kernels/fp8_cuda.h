// CUDA launchers for FP8 E4M3 blockwise (1x128) quantization.
//
// Same contract and bit-exact results as the CPU references in fp8.h (values,
// scales and dequantized outputs compare equal bit for bit on finite input);
// see fp8.h for the layout and the scale formulas. This header pulls in no
// CUDA header: the stream is the runtime's `cudaStream_t` (== CUstream_st*),
// forward-declared here, and errors are returned as the int value of a
// cudaError_t (0 == cudaSuccess). It is only meaningful to call these when the
// library was built with CUDA (Meson variable have_kernels_cuda).
//
// All pointers are device pointers (or managed memory) that stay valid until
// the stream reaches the work; nothing is allocated or synchronized. Launches
// are asynchronous; the return value reports launch errors only.
//
// Performance: one warp per 1x128 block; 16-byte (fp32) / 8-byte (bf16) loads
// per lane when cols % 4 == 0 and the pointers are aligned, scalar coalesced
// loads otherwise. Memory bound: ~5 B/element fp32 in, ~3 B/element bf16 in.
#pragma once

#include <cstdint>

#include "memplan/kernels/fp8.h"

struct CUstream_st;  // the CUDA runtime's cudaStream_t is CUstream_st*

namespace memplan::kernels {

// Quantizes fp32 x[rows][cols] into values[rows][cols] and
// scales[rows][BlocksPerRow()] on `stream` (nullptr = legacy default stream).
// Returns cudaErrorInvalidValue (1) for negative dimensions or a null pointer
// with a non-empty layout; an empty layout launches nothing and returns 0.
int QuantizeFp8BlockwiseCuda(const float* x, Fp8BlockLayout layout,
                             ScaleMode mode, uint8_t* values, float* scales,
                             CUstream_st* stream);

// bf16 input as raw bit patterns (e.g. __nv_bfloat16 storage); otherwise as
// above.
int QuantizeFp8BlockwiseCuda(const uint16_t* x_bf16, Fp8BlockLayout layout,
                             ScaleMode mode, uint8_t* values, float* scales,
                             CUstream_st* stream);

// y[r][c] = E4M3ToFloat(values[r][c]) * scales[r][c / 128] on `stream`.
// Same error rules as the quantizers.
int DequantizeFp8BlockwiseCuda(const uint8_t* values, const float* scales,
                               Fp8BlockLayout layout, float* y,
                               CUstream_st* stream);

}  // namespace memplan::kernels
