// Byte sizes, bandwidths and FLOP rates as users write them ("141GiB",
// "4.8TB/s", "989TFLOP/s"), and their human-readable forms.
//
// Units: B, KB/MB/GB/TB/PB are powers of 1000; KiB/MiB/GiB/TiB/PiB powers of
// 1024. Byte counts are int64_t; a size that does not fit is an error.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "memplan/common/status.h"

namespace memplan {

inline constexpr int64_t kKiB = 1024;
inline constexpr int64_t kMiB = 1024 * kKiB;
inline constexpr int64_t kGiB = 1024 * kMiB;

// "141GiB", "80 GB", "512" -> bytes. Fractions are allowed and rounded to
// the nearest byte ("1.5KiB" = 1536). Rejects negative, zero-unit or unknown
// suffixes with a message naming what was expected.
Expected<int64_t> ParseBytes(std::string_view text);

// "4.8TB/s" -> bytes per second (same units as ParseBytes, plus "/s").
Expected<double> ParseBandwidth(std::string_view text);

// "989TFLOP/s" -> FLOP per second (FLOP/s with K, M, G, T, P prefixes).
Expected<double> ParseFlopRate(std::string_view text);

double ToGiB(int64_t bytes);

// "12.34 GiB" style, picking B/KiB/MiB/GiB/TiB by magnitude.
std::string FormatBytes(int64_t bytes);

// Checked int64 arithmetic: throws ErrorException(kBadInput, what + overflow)
// instead of wrapping. Sizes in model files multiply into large products.
int64_t CheckedMul(int64_t a, int64_t b, std::string_view what);
int64_t CheckedAdd(int64_t a, int64_t b, std::string_view what);

}  // namespace memplan
