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

#include "memplan/common/output.h"  // WriteFileAtomic
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

  // Returns the raw child (marking it read) or nullptr when absent. An
  // explicit null is refused (omit the key to get its default) unless the
  // key is documented as nullable: then GetNullable returns nullptr for it.
  const Json* Get(std::string_view key);
  const Json* GetNullable(std::string_view key);
  const Json& Required(std::string_view key);

  int64_t Int(std::string_view key, int64_t min, int64_t max);
  int64_t Int(std::string_view key, int64_t min, int64_t max, int64_t fallback);
  std::optional<int64_t> OptInt(std::string_view key, int64_t min, int64_t max);
  // As OptInt, for a key whose documented default is null.
  std::optional<int64_t> OptIntNullable(std::string_view key, int64_t min, int64_t max);
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
// An array of strings, each checked at its own pointer.
std::vector<std::string> ExpectStrings(const Json& value, const JsonLocation& where);

// What memplan reads at most (docs/design.md, "Input limits and hostile
// input"). Beyond a limit the input is refused with kBadInput, the file and
// the JSON pointer where the limit was crossed; nothing is half-read.
struct JsonLimits {
  int64_t max_bytes = int64_t{256} << 20;     // a whole input file
  int max_depth = 64;                         // nested arrays and objects
  int64_t max_string_bytes = int64_t{64} << 10;  // one string or key
};

// Parses `text` (named `file` in messages) into a document. Besides JSON's
// own syntax (RFC 8259), refuses: duplicate keys in an object, nesting
// deeper than limits.max_depth, strings or keys longer than
// limits.max_string_bytes or holding U+0000, numbers beyond a double's
// range, and text longer than limits.max_bytes. A leading UTF-8 byte-order
// mark is skipped (RFC 8259 section 8.1 lets parsers ignore it). Errors are
// one line: "FILE: POINTER: MESSAGE". Never recurses: a hostile nesting
// cannot exhaust the stack.
Expected<Json> ParseJsonText(std::string_view text, const std::string& file, const JsonLimits& limits = {});

// The JSON document in the file at `path`, under ParseJsonText's rules,
// parsed as it is read: garbage (/dev/urandom) is refused at its first bad
// byte; a stream longer than limits.max_bytes once that many are read, a
// regular file longer than that unread. Never blocks forever: a FIFO,
// terminal or device is opened non-blocking and may stay silent at most
// $MEMPLAN_INPUT_TIMEOUT_S seconds (default 10) between reads; a FIFO
// nobody writes is refused after that. Errors (kBadInput) are one line
// naming `path`.
Expected<Json> ReadJsonFile(const std::string& path, const JsonLimits& limits = {});

// The pointer of the first number in `doc` that is not finite, or nullopt.
// Writers call it so that no file ever holds a NaN or infinity (which JSON
// cannot spell: nlohmann would write null). Iterative.
std::optional<std::string> FindNonFinite(const Json& doc);
std::optional<std::string> FindNonFinite(const OrderedJson& doc);

// sha256 of `data`, lower-case hex.
std::string Sha256Hex(std::string_view data);

}  // namespace memplan
