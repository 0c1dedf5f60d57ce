#include "memplan/common/units.h"

#include <array>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <limits>
#include <string>
#include <utility>

namespace memplan {
namespace {

struct Unit {
  std::string_view suffix;
  double factor;
};

// Longest suffixes first so "KiB" is not read as "B".
constexpr std::array<Unit, 11> kByteUnits{{
    {"KiB", 1024.0}, {"MiB", 1024.0 * 1024}, {"GiB", 1024.0 * 1024 * 1024},
    {"TiB", 1024.0 * 1024 * 1024 * 1024}, {"PiB", 1024.0 * 1024 * 1024 * 1024 * 1024},
    {"KB", 1e3}, {"MB", 1e6}, {"GB", 1e9}, {"TB", 1e12}, {"PB", 1e15}, {"B", 1.0},
}};

constexpr std::array<Unit, 6> kFlopUnits{{
    {"KFLOP/s", 1e3}, {"MFLOP/s", 1e6}, {"GFLOP/s", 1e9}, {"TFLOP/s", 1e12},
    {"PFLOP/s", 1e15}, {"FLOP/s", 1.0},
}};

std::string_view Trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

// Splits "4.8 TB" into 4.8 and "TB". The number is plain decimal: digits,
// at most one '.', no sign or exponent (sizes are never negative).
bool SplitNumber(std::string_view text, double* number, std::string_view* rest) {
  text = Trim(text);
  size_t i = 0;
  bool dot = false;
  bool digits = false;
  for (; i < text.size(); ++i) {
    char c = text[i];
    if (std::isdigit(static_cast<unsigned char>(c))) {
      digits = true;
    } else if (c == '.' && !dot) {
      dot = true;
    } else {
      break;
    }
  }
  if (!digits) return false;
  *number = std::stod(std::string(text.substr(0, i)));
  *rest = Trim(text.substr(i));
  return true;
}

template <size_t N>
Expected<double> ParseWithUnits(std::string_view text, const std::array<Unit, N>& units,
                                std::string_view suffix, bool unit_required,
                                std::string_view expected) {
  double number = 0;
  std::string_view rest;
  auto fail = [&]() -> Expected<double> {
    return Error{ErrorCode::kBadInput,
                 "expected " + std::string(expected) + ", got \"" + std::string(text) + "\""};
  };
  if (!SplitNumber(text, &number, &rest)) return fail();
  if (!suffix.empty()) {
    if (rest.size() < suffix.size() || rest.substr(rest.size() - suffix.size()) != suffix) {
      // Bandwidths must say "/s"; a bare "4.8TB" is a size, not a rate.
      return fail();
    }
    rest = Trim(rest.substr(0, rest.size() - suffix.size()));
    if (rest.empty() && unit_required) return fail();
  }
  if (rest.empty()) {
    if (unit_required) return fail();
    return number;
  }
  for (const Unit& u : units) {
    if (rest == u.suffix) return number * u.factor;
  }
  return fail();
}

}  // namespace

Expected<int64_t> ParseBytes(std::string_view text) {
  auto v = ParseWithUnits(text, kByteUnits, "", false,
                          "a size such as 80GiB or 141GB (units B, KB..PB, KiB..PiB)");
  if (!v) return v.error();
  double bytes = std::round(*v);
  if (!(bytes >= 1) || bytes > 9.0e18) {
    return Error{ErrorCode::kBadInput,
                 "expected a size between 1 B and 8 EiB, got \"" + std::string(text) + "\""};
  }
  return static_cast<int64_t>(bytes);
}

Expected<double> ParseBandwidth(std::string_view text) {
  // Units for bandwidth are byte units followed by "/s".
  auto v = ParseWithUnits(text, kByteUnits, "/s", true,
                          "a bandwidth such as 4.8TB/s or 50GB/s");
  if (!v) return v.error();
  if (!(*v > 0)) {
    return Error{ErrorCode::kBadInput, "expected a positive bandwidth, got \"" + std::string(text) + "\""};
  }
  return *v;
}

Expected<double> ParseFlopRate(std::string_view text) {
  auto v = ParseWithUnits(text, kFlopUnits, "", true, "a FLOP rate such as 989TFLOP/s");
  if (!v) return v.error();
  if (!(*v > 0)) {
    return Error{ErrorCode::kBadInput, "expected a positive FLOP rate, got \"" + std::string(text) + "\""};
  }
  return *v;
}

double ToGiB(int64_t bytes) { return static_cast<double>(bytes) / static_cast<double>(kGiB); }

std::string FormatBytes(int64_t bytes) {
  static constexpr std::array<std::string_view, 5> kNames{"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  size_t unit = 0;
  while (unit + 1 < kNames.size() && std::fabs(v) >= 1024.0) {
    v /= 1024.0;
    ++unit;
  }
  char buf[64];
  if (unit == 0) {
    std::snprintf(buf, sizeof(buf), "%lld B", static_cast<long long>(bytes));
  } else {
    std::snprintf(buf, sizeof(buf), "%.2f %s", v, std::string(kNames[unit]).c_str());
  }
  return buf;
}

int64_t CheckedMul(int64_t a, int64_t b, std::string_view what) {
  int64_t out = 0;
  if (__builtin_mul_overflow(a, b, &out)) {
    ThrowError(ErrorCode::kBadInput,
               std::string(what) + " overflows 64-bit byte counts: reduce the sizes");
  }
  return out;
}

int64_t CheckedAdd(int64_t a, int64_t b, std::string_view what) {
  int64_t out = 0;
  if (__builtin_add_overflow(a, b, &out)) {
    ThrowError(ErrorCode::kBadInput,
               std::string(what) + " overflows 64-bit byte counts: reduce the sizes");
  }
  return out;
}

}  // namespace memplan
