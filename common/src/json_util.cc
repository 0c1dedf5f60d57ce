#include "memplan/common/json_util.h"

#include <openssl/evp.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

#include "memplan/common/units.h"

namespace memplan {

std::string PointerAppend(std::string_view pointer, std::string_view token) {
  std::string out(pointer);
  out += '/';
  for (char c : token) {
    if (c == '~') out += "~0";
    else if (c == '/') out += "~1";
    else out += c;
  }
  return out;
}

std::string PointerAppend(std::string_view pointer, size_t index) {
  return std::string(pointer) + "/" + std::to_string(index);
}

JsonLocation JsonLocation::Child(std::string_view key) const {
  return {file, PointerAppend(pointer, key)};
}
JsonLocation JsonLocation::Child(size_t index) const { return {file, PointerAppend(pointer, index)}; }

std::string JsonLocation::Describe() const {
  return (file.empty() ? std::string("<input>") : file) + ": " + (pointer.empty() ? "/" : pointer);
}

void ThrowAt(const JsonLocation& where, std::string_view message) {
  ThrowError(ErrorCode::kBadInput, where.Describe() + ": " + std::string(message));
}

std::string Brief(const Json& value) {
  std::string s = value.dump();
  if (s.size() > 40) s = s.substr(0, 37) + "...";
  return s;
}

std::string FormatFixedRange(double v);

namespace {
std::string Range(int64_t min, int64_t max) {
  return "[" + std::to_string(min) + ", " + std::to_string(max) + "]";
}
}  // namespace

int64_t ExpectInt(const Json& value, const JsonLocation& where, int64_t min, int64_t max) {
  int64_t v = 0;
  if (value.is_number_integer()) {
    if (value.is_number_unsigned() && value.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) {
      ThrowAt(where, "expected an integer in " + Range(min, max) + ", got " + Brief(value));
    }
    v = value.get<int64_t>();
  } else if (value.is_number_float()) {
    double d = value.get<double>();
    // 1e3 is a fine way to write 1000; 1e15 is refused by the range below.
    if (!std::isfinite(d) || std::floor(d) != d || std::fabs(d) > 9.0e18) {
      ThrowAt(where, "expected an integer in " + Range(min, max) + ", got " + Brief(value));
    }
    v = static_cast<int64_t>(d);
  } else {
    ThrowAt(where, "expected an integer in " + Range(min, max) + ", got " + Brief(value));
  }
  if (v < min || v > max) {
    ThrowAt(where, "expected an integer in " + Range(min, max) + ", got " + Brief(value));
  }
  return v;
}

const Json& ExpectArray(const Json& value, const JsonLocation& where) {
  if (!value.is_array()) ThrowAt(where, "expected an array, got " + Brief(value));
  return value;
}

std::string ExpectString(const Json& value, const JsonLocation& where) {
  if (!value.is_string()) ThrowAt(where, "expected a string, got " + Brief(value));
  return value.get<std::string>();
}

ObjectReader::ObjectReader(const Json& value, JsonLocation where)
    : object_(value), where_(std::move(where)) {
  if (!value.is_object()) ThrowAt(where_, "expected an object, got " + Brief(value));
}

bool ObjectReader::Has(std::string_view key) const {
  auto it = object_.find(std::string(key));
  return it != object_.end() && !it->is_null();
}

const Json* ObjectReader::Get(std::string_view key) {
  read_.insert(std::string(key));
  auto it = object_.find(std::string(key));
  if (it == object_.end() || it->is_null()) return nullptr;
  return &*it;
}

const Json& ObjectReader::Required(std::string_view key) {
  const Json* v = Get(key);
  if (!v) ThrowAt(where_, "missing required key \"" + std::string(key) + "\"");
  return *v;
}

int64_t ObjectReader::Int(std::string_view key, int64_t min, int64_t max) {
  return ExpectInt(Required(key), At(key), min, max);
}

int64_t ObjectReader::Int(std::string_view key, int64_t min, int64_t max, int64_t fallback) {
  const Json* v = Get(key);
  return v ? ExpectInt(*v, At(key), min, max) : fallback;
}

std::optional<int64_t> ObjectReader::OptInt(std::string_view key, int64_t min, int64_t max) {
  const Json* v = Get(key);
  if (!v) return std::nullopt;
  return ExpectInt(*v, At(key), min, max);
}

double ObjectReader::Number(std::string_view key, double min, double max, double fallback) {
  const Json* v = Get(key);
  if (!v) return fallback;
  if (!v->is_number() || !std::isfinite(v->get<double>()) || v->get<double>() < min ||
      v->get<double>() > max) {
    ThrowAt(At(key), "expected a number in [" + FormatFixedRange(min) + ", " +
                         FormatFixedRange(max) + "], got " + Brief(*v));
  }
  return v->get<double>();
}

bool ObjectReader::Bool(std::string_view key, bool fallback) {
  auto v = OptBool(key);
  return v ? *v : fallback;
}

std::optional<bool> ObjectReader::OptBool(std::string_view key) {
  const Json* v = Get(key);
  if (!v) return std::nullopt;
  if (!v->is_boolean()) ThrowAt(At(key), "expected true or false, got " + Brief(*v));
  return v->get<bool>();
}

std::string ObjectReader::String(std::string_view key) {
  const Json& v = Required(key);
  return ExpectString(v, At(key));
}

std::string ObjectReader::Enum(std::string_view key, std::initializer_list<std::string_view> choices,
                               std::string_view fallback) {
  const Json* v = Get(key);
  if (!v) return std::string(fallback);
  std::string list;
  for (auto c : choices) list += (list.empty() ? "" : "|") + std::string(c);
  if (!v->is_string()) ThrowAt(At(key), "expected one of " + list + ", got " + Brief(*v));
  std::string s = v->get<std::string>();
  for (auto c : choices) {
    if (s == c) return s;
  }
  ThrowAt(At(key), "expected one of " + list + ", got " + Brief(*v));
}

std::string ObjectReader::Enum(std::string_view key, std::initializer_list<std::string_view> choices) {
  Required(key);
  return Enum(key, choices, "");
}

int64_t ObjectReader::Bytes(std::string_view key, int64_t fallback) {
  auto v = OptBytes(key);
  return v ? *v : fallback;
}

std::optional<int64_t> ObjectReader::OptBytes(std::string_view key) {
  const Json* v = Get(key);
  if (!v) return std::nullopt;
  if (v->is_number()) return ExpectInt(*v, At(key), 1, INT64_MAX);
  if (!v->is_string()) ThrowAt(At(key), "expected a size such as \"80GiB\" or a byte count, got " + Brief(*v));
  auto bytes = ParseBytes(v->get<std::string>());
  if (!bytes) ThrowAt(At(key), bytes.error().message);
  return *bytes;
}

namespace {
// A positive number, or a string with a unit read by `parse`.
std::optional<double> OptRate(ObjectReader& r, std::string_view key, Expected<double> (*parse)(std::string_view),
                              std::string_view example) {
  const Json* v = r.Get(key);
  if (!v) return std::nullopt;
  if (v->is_number() && v->get<double>() > 0 && std::isfinite(v->get<double>())) return v->get<double>();
  if (!v->is_string()) ThrowAt(r.At(key), "expected " + std::string(example) + ", got " + Brief(*v));
  auto rate = parse(v->get<std::string>());
  if (!rate) ThrowAt(r.At(key), rate.error().message);
  return *rate;
}
}  // namespace

std::optional<double> ObjectReader::OptBandwidth(std::string_view key) {
  return OptRate(*this, key, &ParseBandwidth, "a bandwidth such as \"4.8TB/s\" or bytes/s");
}

std::optional<double> ObjectReader::OptFlopRate(std::string_view key) {
  return OptRate(*this, key, &ParseFlopRate, "a FLOP rate such as \"989TFLOP/s\"");
}

void ObjectReader::Finish() const {
  for (auto it = object_.begin(); it != object_.end(); ++it) {
    if (!read_.contains(it.key())) {
      std::string known;
      for (const auto& k : read_) known += (known.empty() ? "" : ", ") + k;
      ThrowAt(where_.Child(it.key()), "unknown key \"" + it.key() + "\" (expected one of: " + known + ")");
    }
  }
}

std::string FormatFixedRange(double v) {
  std::ostringstream s;
  s << v;
  return s.str();
}

Expected<Json> ReadJsonFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return Error{ErrorCode::kBadInput, path + ": cannot open: " + std::strerror(errno)};
  }
  std::stringstream buf;
  buf << in.rdbuf();
  try {
    return Json::parse(buf.str());
  } catch (const Json::parse_error& e) {
    // nlohmann's message carries line and column; keep it on one line.
    std::string what = e.what();
    for (char& c : what) {
      if (c == '\n') c = ' ';
    }
    return Error{ErrorCode::kBadInput, path + ": /: invalid JSON: " + what};
  }
}

Expected<bool> WriteFileAtomic(const std::string& path, std::string_view content) {
  std::string tmp = path + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) {
      return Error{ErrorCode::kRuntime, path + ": cannot write: " + std::strerror(errno)};
    }
    out.write(content.data(), static_cast<std::streamsize>(content.size()));
    out.flush();
    if (!out) {
      std::remove(tmp.c_str());
      return Error{ErrorCode::kRuntime, path + ": write failed: " + std::strerror(errno)};
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    int err = errno;
    std::remove(tmp.c_str());
    return Error{ErrorCode::kRuntime, path + ": cannot rename into place: " + std::strerror(err)};
  }
  return true;
}

std::string Sha256Hex(std::string_view data) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  EVP_Digest(data.data(), data.size(), digest, &length, EVP_sha256(), nullptr);
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  for (unsigned int i = 0; i < length; ++i) {
    out += kHex[digest[i] >> 4];
    out += kHex[digest[i] & 15];
  }
  return out;
}

}  // namespace memplan
