// Reading JSON input with errors that name the file and the RFC 6901 pointer.
//
// ObjectReader wraps one JSON object: typed getters validate ranges and
// enums, remember which keys were read, and Finish() rejects every key that
// was not, so unknown keys are errors instead of silently ignored settings.
// Every failure throws ErrorException(kBadInput) with the one-line message
// "FILE: POINTER: expected ..., got ...".
#pragma once

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "memplan/common/status.h"

namespace memplan {

using Json = nlohmann::json;
using OrderedJson = nlohmann::ordered_json;

// RFC 6901: appends one reference token, escaping '~' as ~0 and '/' as ~1.
std::string PointerAppend(std::string_view pointer, std::string_view token);
std::string PointerAppend(std::string_view pointer, size_t index);

// Where a value sits: file name and JSON pointer ("" is the whole document;
// printed as "/").
struct JsonLocation {
  std::string file;
  std::string pointer;
  JsonLocation Child(std::string_view key) const;
  JsonLocation Child(size_t index) const;
  std::string Describe() const;  // "FILE: /a/b"
};

// Throws ErrorException(kBadInput): "FILE: POINTER: MESSAGE".
[[noreturn]] void ThrowAt(const JsonLocation& where, std::string_view message);

// Short rendering of a JSON value for messages (truncated at ~40 chars).
std::string Brief(const Json& value);

class ObjectReader {
 public:
  // Throws unless `value` is an object.
  ObjectReader(const Json& value, JsonLocation where);

  bool Has(std::string_view key) const;
  const JsonLocation& where() const { return where_; }
  JsonLocation At(std::string_view key) const { return where_.Child(key); }

  // Returns the raw child (marking it read) or nullptr when absent/null.
  const Json* Get(std::string_view key);
  const Json& Required(std::string_view key);

  int64_t Int(std::string_view key, int64_t min, int64_t max);
  int64_t Int(std::string_view key, int64_t min, int64_t max, int64_t fallback);
  std::optional<int64_t> OptInt(std::string_view key, int64_t min, int64_t max);
  double Number(std::string_view key, double min, double max, double fallback);
  bool Bool(std::string_view key, bool fallback);
  std::optional<bool> OptBool(std::string_view key);
  std::string String(std::string_view key);
  std::string Enum(std::string_view key, std::initializer_list<std::string_view> choices,
                   std::string_view fallback);
  std::string Enum(std::string_view key, std::initializer_list<std::string_view> choices);

  // Sizes: an integer byte count or a string with a unit.
  int64_t Bytes(std::string_view key, int64_t fallback);
  std::optional<int64_t> OptBytes(std::string_view key);
  std::optional<double> OptBandwidth(std::string_view key);
  std::optional<double> OptFlopRate(std::string_view key);

  // Rejects keys that no getter asked for.
  void Finish() const;

 private:
  const Json& object_;
  JsonLocation where_;
  std::set<std::string, std::less<>> read_;
};

// Checks `value` is an integer in [min, max]; throws otherwise.
int64_t ExpectInt(const Json& value, const JsonLocation& where, int64_t min, int64_t max);
const Json& ExpectArray(const Json& value, const JsonLocation& where);
std::string ExpectString(const Json& value, const JsonLocation& where);

// Reads a whole file and parses it as JSON; syntax errors name the file and
// the line/column.
Expected<Json> ReadJsonFile(const std::string& path);

// Writes `content` to `path` through a temporary file and rename(2), so a
// failure never leaves a half-written file behind.
Expected<bool> WriteFileAtomic(const std::string& path, std::string_view content);

// sha256 of `data`, lower-case hex.
std::string Sha256Hex(std::string_view data);

}  // namespace memplan
