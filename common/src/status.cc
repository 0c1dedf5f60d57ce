#include "memplan/common/status.h"

#include <cstdio>
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

namespace internal {
void CheckFailed(const char* file, int line, const char* expr, const char* message) {
  std::fprintf(stderr, "memplan: internal error at %s:%d: %s (%s)\n", file, line, message, expr);
  std::abort();
}
}  // namespace internal

}  // namespace memplan
