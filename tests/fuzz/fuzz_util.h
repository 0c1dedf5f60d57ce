// What every fuzz target asserts about memplan's answer to hostile input:
// an Error is a value (never a crash, hang or exception), its message is
// one line, and a bad-input message names the file and a JSON pointer.
// A broken property aborts, which libFuzzer and the replay driver report
// with the input that caused it.
#pragma once

#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "memplan/common/json_util.h"
#include "memplan/common/status.h"

namespace memplan::fuzz {

inline constexpr const char* kFile = "fuzz.json";

[[noreturn]] inline void Broken(std::string_view what, const std::string& message) {
  std::fprintf(stderr, "fuzz property broken: %.*s: %s\n", static_cast<int>(what.size()), what.data(),
               message.c_str());
  std::abort();
}

// One line; bad input names `file` (or a file-less usage message for CLI
// errors, where `file` is empty).
inline void CheckError(const Error& e, const std::string& file = kFile) {
  if (e.message.empty() || e.message.find('\n') != std::string::npos) Broken("error is not one line", e.message);
  if (e.code == ErrorCode::kBadInput && !file.empty() && e.message.rfind(file + ":", 0) != 0 &&
      e.message.rfind(file + " /", 0) != 0) {
    Broken("bad-input error does not name the file", e.message);
  }
}

// An argument vector from fuzz bytes: arguments split at NUL bytes (no
// bytes: no arguments at all), at most 65 of them.
inline std::vector<std::string> Arguments(const uint8_t* data, size_t size) {
  std::vector<std::string> args(size == 0 ? 0 : 1);
  for (size_t i = 0; i < size && args.size() <= 64; ++i) {
    if (data[i] == 0) {
      args.emplace_back();
    } else {
      args.back() += static_cast<char>(data[i]);
    }
  }
  return args;
}

// The input as a document, or nullopt after checking the reader's error.
inline std::optional<Json> Parse(const uint8_t* data, size_t size) {
  auto doc = ParseJsonText(std::string_view(reinterpret_cast<const char*>(data), size), kFile);
  if (!doc) {
    CheckError(doc.error());
    return std::nullopt;
  }
  return std::move(*doc);
}

}  // namespace memplan::fuzz
