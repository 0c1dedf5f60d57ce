#include "memplan/runtime/npy.h"

#include <cstring>
#include <fstream>
#include <sstream>

#include "memplan/common/json_util.h"

namespace memplan::runtime {
namespace {

Expected<std::monostate> Write(const std::string& path, const char* descr, const void* data, int64_t elements,
                               const std::vector<int64_t>& shape) {
  std::string dims;
  for (size_t i = 0; i < shape.size(); ++i) dims += std::to_string(shape[i]) + (shape.size() == 1 || i + 1 < shape.size() ? ", " : "");
  std::string header = std::string("{'descr': '") + descr + "', 'fortran_order': False, 'shape': (" + dims + "), }";
  // Magic (6) + version (2) + header length (2) + header, padded with
  // spaces and ended by a newline to a multiple of 64 bytes.
  size_t total = 10 + header.size() + 1;
  header.append((64 - total % 64) % 64, ' ');
  header.push_back('\n');
  std::string out("\x93NUMPY\x01\x00", 8);
  uint16_t len = static_cast<uint16_t>(header.size());
  out.push_back(static_cast<char>(len & 0xff));
  out.push_back(static_cast<char>(len >> 8));
  out += header;
  out.append(static_cast<const char*>(data), static_cast<size_t>(elements) * 4);
  auto st = WriteFileAtomic(path, out);
  if (!st.ok()) return st.error();
  return std::monostate{};
}

int64_t Count(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

}  // namespace

Expected<std::monostate> WriteNpy(const std::string& path, const float* data, const std::vector<int64_t>& shape) {
  return Write(path, "<f4", data, Count(shape), shape);
}

Expected<std::monostate> WriteNpy(const std::string& path, const int32_t* data, const std::vector<int64_t>& shape) {
  return Write(path, "<i4", data, Count(shape), shape);
}

Expected<NpyArray> ReadNpy(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return Error{ErrorCode::kRuntime, path + ": cannot open"};
  std::stringstream ss;
  ss << f.rdbuf();
  std::string s = ss.str();
  if (s.size() < 10 || s.compare(0, 6, "\x93NUMPY") != 0) return Error{ErrorCode::kBadInput, path + ": not a .npy file"};
  size_t len = static_cast<uint8_t>(s[8]) | (static_cast<size_t>(static_cast<uint8_t>(s[9])) << 8);
  std::string header = s.substr(10, len);
  NpyArray a;
  auto d = header.find("'descr': '");
  a.descr = header.substr(d + 10, 3);
  auto open = header.find('('), close = header.find(')');
  std::stringstream dims(header.substr(open + 1, close - open - 1));
  std::string item;
  while (std::getline(dims, item, ',')) {
    if (item.find_first_not_of(' ') != std::string::npos) a.shape.push_back(std::stoll(item));
  }
  a.bytes.assign(s.begin() + static_cast<std::ptrdiff_t>(10 + len), s.end());
  return a;
}

}  // namespace memplan::runtime
