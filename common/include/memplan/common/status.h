// Error values shared by every memplan library.
//
// Libraries report bad input and infeasible requests as `Error` values inside
// `Expected<T>`; only tools/ turn them into exit codes and messages. Broken
// internal invariants are not errors: they abort through MEMPLAN_CHECK
// (check.h).
#pragma once

#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace memplan {

// Exit codes of the memplan command line (docs/design.md, "Command line and exit
// codes"). The enum value is the process exit status.
enum class ErrorCode : int {
  kCheckFailed = 1,     // a check verdict failed
  kBadInput = 2,        // bad input or usage
  kInfeasible = 3,      // budget below the any-plan lower bound
  kDigestMismatch = 4,  // plan and measurement are from different models
  kRuntime = 5,         // runtime error (I/O, device)
};

std::string_view ErrorCodeName(ErrorCode code);

// `text` with every control character (a newline in a file name or an
// argument, say) written as a C escape, so a message stays one line, and
// cut after 1000 bytes (saying how many more there were).
std::string OneLine(std::string_view text);

// One user-actionable, single-line message plus its category.
struct Error {
  ErrorCode code = ErrorCode::kBadInput;
  std::string message;
};

// Thrown inside a library pass and caught at its public entry point, which
// returns it as an `Expected` error. Never escapes a public API.
class ErrorException : public std::runtime_error {
 public:
  explicit ErrorException(Error error)
      : std::runtime_error(error.message), error_(std::move(error)) {}
  const Error& error() const { return error_; }

 private:
  Error error_;
};

// `message` is made one line (OneLine): names and keys taken from input
// may hold newlines.
[[noreturn]] void ThrowError(ErrorCode code, std::string message);

// A value or an Error (std::expected arrives only with C++23).
template <class T>
class Expected {
 public:
  Expected(T value) : v_(std::move(value)) {}          // NOLINT: implicit by design
  Expected(Error error) : v_(std::move(error)) {}      // NOLINT
  bool ok() const { return v_.index() == 0; }
  explicit operator bool() const { return ok(); }
  T& value() { return std::get<0>(v_); }
  const T& value() const { return std::get<0>(v_); }
  T& operator*() { return value(); }
  const T& operator*() const { return value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  const Error& error() const { return std::get<1>(v_); }

 private:
  std::variant<T, Error> v_;
};

// Runs `fn` and converts an ErrorException into an Error value.
template <class Fn>
auto CatchErrors(Fn&& fn) -> Expected<decltype(fn())> {
  try {
    return fn();
  } catch (const ErrorException& e) {
    return e.error();
  }
}

}  // namespace memplan
