// MEMPLAN_CHECK: the one way a broken internal invariant stops the program.
// Bad user input never reaches it: that is reported as an Error (status.h).
#pragma once

namespace memplan::internal {
[[noreturn]] void CheckFailed(const char* file, int line, const char* expr, const char* message);
}  // namespace memplan::internal

#define MEMPLAN_CHECK(cond, message)                                          \
  do {                                                                        \
    if (!(cond)) [[unlikely]]                                                 \
      ::memplan::internal::CheckFailed(__FILE__, __LINE__, #cond, (message)); \
  } while (0)
