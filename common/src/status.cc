#include "memplan/common/status.h"

#include <cstdio>
#include <algorithm>
#include <cstdlib>

#include "memplan/common/check.h"

namespace memplan {

std::string_view ErrorCodeName(ErrorCode code) {
  switch (code) {
    case ErrorCode::kCheckFailed: return "check failed";
    case ErrorCode::kBadInput: return "bad input";
    case ErrorCode::kInfeasible: return "infeasible";
    case ErrorCode::kDigestMismatch: return "digest mismatch";
    case ErrorCode::kRuntime: return "runtime error";
  }
  return "unknown";
}

std::string OneLine(std::string_view text) {
  // A message quotes input (keys, tokens, paths): a hostile one must not
  // make it megabytes long.
  constexpr size_t kMaxBytes = 1000;
  std::string out;
  out.reserve(std::min(text.size(), kMaxBytes + 32));
  if (text.size() > kMaxBytes) {
    return OneLine(text.substr(0, kMaxBytes)) + "... (" + std::to_string(text.size() - kMaxBytes) + " more bytes)";
  }
  for (char c : text) {
    auto u = static_cast<unsigned char>(c);
    if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (u < 0x20 || u == 0x7f) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", u);
      out += buf;
    } else {
      out += c;
    }
  }
  return out;
}

void ThrowError(ErrorCode code, std::string message) {
  throw ErrorException(Error{code, OneLine(message)});
}

namespace internal {
void CheckFailed(const char* file, int line, const char* expr, const char* message) {
  std::fprintf(stderr, "memplan: internal error at %s:%d: %s (%s)\n", file, line, message, expr);
  std::abort();
}
}  // namespace internal

}  // namespace memplan
