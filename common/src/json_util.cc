#include "memplan/common/json_util.h"

#include <fcntl.h>
#include <openssl/evp.h>
#include <poll.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <optional>
#include <string_view>
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

std::vector<std::string> ExpectStrings(const Json& value, const JsonLocation& where) {
  ExpectArray(value, where);
  std::vector<std::string> out;
  for (size_t i = 0; i < value.size(); ++i) out.push_back(ExpectString(value[i], where.Child(i)));
  return out;
}

ObjectReader::ObjectReader(const Json& value, JsonLocation where)
    : object_(value), where_(std::move(where)) {
  if (!value.is_object()) ThrowAt(where_, "expected an object, got " + Brief(value));
}

bool ObjectReader::Has(std::string_view key) const { return object_.contains(std::string(key)); }

const Json* ObjectReader::Get(std::string_view key) {
  const Json* v = GetNullable(key);
  if (v == nullptr && Has(key)) {
    ThrowAt(At(key), "expected a value, got null (omit the key to use its default)");
  }
  return v;
}

const Json* ObjectReader::GetNullable(std::string_view key) {
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

std::optional<int64_t> ObjectReader::OptIntNullable(std::string_view key, int64_t min, int64_t max) {
  const Json* v = GetNullable(key);
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
// A number, or a string with a unit read by `parse`, in [min, max]: rates
// far outside any real machine's would make step times overflow to
// infinity or vanish (docs/design.md, "Input limits and hostile input").
std::optional<double> OptRate(ObjectReader& r, std::string_view key, Expected<double> (*parse)(std::string_view),
                              std::string_view example, double min, double max, std::string_view range) {
  const Json* v = r.Get(key);
  if (!v) return std::nullopt;
  double rate = 0;
  if (v->is_number()) {
    rate = v->get<double>();
  } else if (v->is_string()) {
    auto parsed = parse(v->get<std::string>());
    if (!parsed) ThrowAt(r.At(key), parsed.error().message);
    rate = *parsed;
  } else {
    ThrowAt(r.At(key), "expected " + std::string(example) + ", got " + Brief(*v));
  }
  if (!std::isfinite(rate) || rate < min || rate > max) {
    ThrowAt(r.At(key), "expected " + std::string(example) + " " + std::string(range) + ", got " + Brief(*v));
  }
  return rate;
}
}  // namespace

std::optional<double> ObjectReader::OptBandwidth(std::string_view key) {
  return OptRate(*this, key, &ParseBandwidth, "a bandwidth such as \"4.8TB/s\" or bytes/s", 1e6, 1e15,
                 "between 1MB/s and 1PB/s");
}

std::optional<double> ObjectReader::OptFlopRate(std::string_view key) {
  return OptRate(*this, key, &ParseFlopRate, "a FLOP rate such as \"989TFLOP/s\"", 1e6, 1e21,
                 "between 1MFLOP/s and 1000000PFLOP/s");
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

namespace {

// Builds the document from nlohmann's SAX events (its parser is iterative),
// enforcing JsonLimits and refusing duplicate keys, and remembering where
// it is so that every refusal names its JSON pointer.
class BoundedDomBuilder {
 public:
  using number_integer_t = Json::number_integer_t;
  using number_unsigned_t = Json::number_unsigned_t;
  using number_float_t = Json::number_float_t;
  using string_t = Json::string_t;
  using binary_t = Json::binary_t;

  BoundedDomBuilder(const std::string& file, const JsonLimits& limits) : file_(file), limits_(limits) {}

  bool null() { return Put(Json(nullptr)); }
  bool boolean(bool v) { return Put(Json(v)); }
  bool number_integer(number_integer_t v) { return Put(Json(v)); }
  bool number_unsigned(number_unsigned_t v) { return Put(Json(v)); }
  bool number_float(number_float_t v, const string_t&) { return Put(Json(v)); }
  bool string(string_t& v) { return CheckString(v, "string") && Put(Json(std::move(v))); }
  bool binary(binary_t&) { return Fail("binary values are not JSON"); }

  bool start_object(std::size_t) { return Open(Json::object()); }
  bool start_array(std::size_t) { return Open(Json::array()); }
  bool end_object() { return Close(); }
  bool end_array() { return Close(); }

  bool key(string_t& k) {
    Frame& f = stack_.back();
    f.key = k;  // before the checks: the pointer names the offending key
    if (!CheckString(k, "key")) return false;
    if (f.value->contains(k)) return Fail("duplicate key \"" + Shorten(k) + "\" (each key may appear once)");
    f.slot = &(*f.value)[k];
    return true;
  }

  bool parse_error(std::size_t, const std::string& token, const nlohmann::detail::exception& e) {
    if (error_) return false;  // a refusal of ours stopped the parser
    if (e.id == 406) return Fail("number out of range: " + Shorten(token));
    // nlohmann's message carries line and column; keep it on one line.
    std::string what = e.what();
    for (char& c : what) {
      if (c == '\n' || c == '\r') c = ' ';
    }
    return Fail("invalid JSON: " + what);
  }

  Json TakeRoot() { return std::move(root_); }
  const std::optional<Error>& error() const { return error_; }

 private:
  struct Frame {
    Json* value;
    std::string key;       // objects: the key being read
    Json* slot = nullptr;  // objects: where that key's value goes
  };

  std::string Pointer() const {
    // An array frame below the top already holds the child being read (its
    // last element); the top one's next value goes at index size().
    std::string p;
    for (size_t i = 0; i < stack_.size(); ++i) {
      const Frame& f = stack_[i];
      size_t next = f.value->size() - (i + 1 < stack_.size() ? 1 : 0);
      p = f.value->is_array() ? PointerAppend(p, next) : PointerAppend(p, f.key);
    }
    return p;
  }

  static std::string Shorten(const std::string& s) { return s.size() > 40 ? s.substr(0, 37) + "..." : s; }

  bool Fail(const std::string& message) {
    if (!error_) {
      std::string pointer = Pointer();
      error_ = Error{ErrorCode::kBadInput, OneLine(file_ + ": " + (pointer.empty() ? "/" : pointer) + ": " + message)};
    }
    return false;
  }

  bool CheckString(const std::string& s, const char* what) {
    if (static_cast<int64_t>(s.size()) > limits_.max_string_bytes) {
      return Fail(std::string(what) + " of " + std::to_string(s.size()) + " bytes exceeds the limit of " +
                  std::to_string(limits_.max_string_bytes) + " bytes");
    }
    if (s.find('\0') != std::string::npos) return Fail(std::string(what) + " contains U+0000");
    return true;
  }

  // Places `v` where the parser is (array end, object slot or the root).
  Json* PutRaw(Json&& v) {
    if (stack_.empty()) {
      root_ = std::move(v);
      return &root_;
    }
    Frame& f = stack_.back();
    if (f.value->is_array()) {
      f.value->push_back(std::move(v));
      return &f.value->back();
    }
    *f.slot = std::move(v);
    return f.slot;
  }
  bool Put(Json&& v) {
    PutRaw(std::move(v));
    return true;
  }

  bool Open(Json&& container) {
    if (static_cast<int>(stack_.size()) >= limits_.max_depth) {
      return Fail("nesting deeper than " + std::to_string(limits_.max_depth) + " levels");
    }
    Json* at = PutRaw(std::move(container));
    stack_.push_back(Frame{at, {}, nullptr});
    return true;
  }

  bool Close() {
    stack_.pop_back();
    return true;
  }

  const std::string& file_;
  const JsonLimits& limits_;
  Json root_;
  std::vector<Frame> stack_;
  std::optional<Error> error_;
};

// The document in [first, last) under `limits` (all but the size, which
// the callers bound). `stopped`: a reason the input ended early (a failed
// read, the size limit), said instead of the parser's "unexpected end".
template <class It>
Expected<Json> ParseBounded(It first, It last, const std::string& file, const JsonLimits& limits,
                            const std::optional<Error>* stopped = nullptr) {
  BoundedDomBuilder builder(file, limits);
  const bool ok = Json::sax_parse(first, last, &builder);
  if (stopped != nullptr && *stopped) return **stopped;
  if (builder.error()) return *builder.error();
  if (!ok) return Error{ErrorCode::kBadInput, file + ": /: invalid JSON"};
  return builder.TakeRoot();
}

std::string OverLimitMessage(int64_t max_bytes) {
  return "/: input exceeds the limit of " + std::to_string(max_bytes) + " bytes";
}

}  // namespace

Expected<Json> ParseJsonText(std::string_view text, const std::string& file, const JsonLimits& limits) {
  if (static_cast<int64_t>(text.size()) > limits.max_bytes) {
    return Error{ErrorCode::kBadInput, file + ": " + OverLimitMessage(limits.max_bytes)};
  }
  return ParseBounded(text.begin(), text.end(), file, limits);
}

namespace {

// Seconds a stream input (a FIFO, a terminal, a character device) may stay
// silent before the read gives up: $MEMPLAN_INPUT_TIMEOUT_S, default 10.
int InputTimeoutMs() {
  double s = 10;
  if (const char* env = std::getenv("MEMPLAN_INPUT_TIMEOUT_S")) {
    char* end = nullptr;
    double v = std::strtod(env, &end);
    if (end != env && *end == '\0' && std::isfinite(v) && v > 0 && v <= 86400) s = v;
  }
  return static_cast<int>(std::ceil(s * 1000));
}

}  // namespace

namespace {

// The input file at `path`, read a chunk at a time: at most max_bytes (a
// regular file longer than that is refused unread), and never blocking
// for ever on a stream (a FIFO, terminal or device is opened non-blocking
// and may stay silent at most $MEMPLAN_INPUT_TIMEOUT_S seconds, default 10,
// between reads).
class InputReader {
 public:
  InputReader(const std::string& path, int64_t max_bytes) : path_(path), max_bytes_(max_bytes) {
    // O_NONBLOCK: opening a FIFO nobody writes returns at once (a blocking
    // open would wait for a writer forever); reads wait in poll() below.
    fd_ = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
    if (fd_ < 0) {
      Fail("cannot open: " + std::string(std::strerror(errno)));
      return;
    }
    struct stat st {};
    if (::fstat(fd_, &st) != 0) {
      Fail("cannot read: " + std::string(std::strerror(errno)));
      return;
    }
    if (S_ISDIR(st.st_mode)) {
      Fail("cannot read: is a directory");
      return;
    }
    stream_ = !S_ISREG(st.st_mode);
    if (!stream_) {
      (void)::fcntl(fd_, F_SETFL, ::fcntl(fd_, F_GETFL) & ~O_NONBLOCK);
      if (st.st_size > max_bytes_) OverLimit();  // refused unread
    }
    timeout_ms_ = stream_ ? InputTimeoutMs() : -1;
  }
  ~InputReader() {
    if (fd_ >= 0) ::close(fd_);
  }
  InputReader(const InputReader&) = delete;
  InputReader& operator=(const InputReader&) = delete;

  // The next chunk (empty at the end or after an error). One byte past the
  // limit is read: a longer input, or an endless device, is refused
  // without reading the rest.
  std::string_view Next() {
    while (!error_ && !done_) {
      if (total_ > max_bytes_) {
        OverLimit();
        break;
      }
      if (stream_) {
        pollfd p{fd_, POLLIN, 0};
        const int ready = ::poll(&p, 1, timeout_ms_);
        if (ready < 0 && errno == EINTR) continue;
        if (ready < 0) {
          Fail("cannot read: " + std::string(std::strerror(errno)));
          break;
        }
        if (ready == 0) {
          char seconds[32];
          std::snprintf(seconds, sizeof seconds, "%g", timeout_ms_ / 1000.0);
          Fail("cannot read: no data for " + std::string(seconds) +
               " s (a FIFO or device nobody writes? MEMPLAN_INPUT_TIMEOUT_S sets the wait)");
          break;
        }
      }
      const auto want = static_cast<size_t>(std::min<int64_t>(sizeof chunk_, max_bytes_ + 1 - total_));
      const ssize_t got = ::read(fd_, chunk_, want);
      if (got < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
      if (got < 0) {
        Fail("cannot read: " + std::string(std::strerror(errno)));
        break;
      }
      if (got == 0) {
        done_ = true;
        break;
      }
      total_ += got;
      if (total_ > max_bytes_) {
        OverLimit();
        break;
      }
      return {chunk_, static_cast<size_t>(got)};
    }
    return {};
  }

  const std::optional<Error>& error() const { return error_; }

 private:
  void Fail(const std::string& message) {
    if (!error_) error_ = Error{ErrorCode::kBadInput, path_ + ": " + message};
  }
  void OverLimit() { Fail(OverLimitMessage(max_bytes_)); }

  std::string path_;
  int64_t max_bytes_;
  int fd_ = -1;
  bool stream_ = false;
  bool done_ = false;
  int timeout_ms_ = -1;
  int64_t total_ = 0;
  std::optional<Error> error_;
  char chunk_[1 << 16];
};

// An input iterator over an InputReader's bytes for nlohmann's parser:
// the document is parsed as it is read, so that garbage (/dev/urandom) is
// refused at its first bad byte instead of after max_bytes of it.
class InputBytes {
 public:
  using iterator_category = std::input_iterator_tag;
  using value_type = char;
  using difference_type = std::ptrdiff_t;
  using pointer = const char*;
  using reference = const char&;

  InputBytes() = default;  // the end
  explicit InputBytes(InputReader* reader) : reader_(reader) {}

  reference operator*() const { return chunk_[at_]; }
  InputBytes& operator++() {
    ++at_;
    return *this;
  }
  bool operator==(const InputBytes& other) const { return AtEnd() == other.AtEnd(); }
  bool operator!=(const InputBytes& other) const { return !(*this == other); }

 private:
  bool AtEnd() const {
    if (reader_ == nullptr) return true;
    if (at_ < chunk_.size()) return false;
    chunk_ = reader_->Next();
    at_ = 0;
    return chunk_.empty();
  }

  InputReader* reader_ = nullptr;
  mutable std::string_view chunk_;
  mutable size_t at_ = 0;
};

}  // namespace

Expected<Json> ReadJsonFile(const std::string& path, const JsonLimits& limits) {
  InputReader reader(path, limits.max_bytes);
  if (reader.error()) return *reader.error();
  return ParseBounded(InputBytes(&reader), InputBytes(), path, limits, &reader.error());
}

namespace {
template <class J>
std::optional<std::string> FindNonFiniteImpl(const J& doc) {
  // Depth-first over (value, pointer) pairs, with an explicit stack.
  std::vector<std::pair<const J*, std::string>> todo{{&doc, ""}};
  while (!todo.empty()) {
    auto [v, pointer] = std::move(todo.back());
    todo.pop_back();
    if (v->is_number_float() && !std::isfinite(v->template get<double>())) {
      return pointer.empty() ? std::string("/") : pointer;
    }
    if (v->is_object()) {
      for (auto it = v->begin(); it != v->end(); ++it) todo.emplace_back(&*it, PointerAppend(pointer, it.key()));
    } else if (v->is_array()) {
      for (size_t i = 0; i < v->size(); ++i) todo.emplace_back(&(*v)[i], PointerAppend(pointer, i));
    }
  }
  return std::nullopt;
}
}  // namespace

std::optional<std::string> FindNonFinite(const Json& doc) { return FindNonFiniteImpl(doc); }
std::optional<std::string> FindNonFinite(const OrderedJson& doc) { return FindNonFiniteImpl(doc); }

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
