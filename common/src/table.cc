#include "memplan/common/table.h"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <sstream>

#include "memplan/common/check.h"

namespace memplan {
namespace {

bool LooksNumeric(const std::string& s) {
  if (s.empty()) return false;
  for (char c : s) {
    if (!std::isdigit(static_cast<unsigned char>(c)) && c != '.' && c != '-' && c != '+' &&
        c != '%' && c != 'x' && c != ',') {
      return false;
    }
  }
  return true;
}

}  // namespace

Table::Table(std::vector<std::string> header) : header_(std::move(header)) {}

void Table::AddRow(std::vector<std::string> cells) {
  MEMPLAN_CHECK(cells.size() == header_.size(), "table row width differs from header");
  rows_.push_back(std::move(cells));
}

std::string Table::Render() const {
  std::vector<size_t> width(header_.size());
  for (size_t c = 0; c < header_.size(); ++c) width[c] = header_[c].size();
  for (const auto& row : rows_) {
    for (size_t c = 0; c < row.size(); ++c) width[c] = std::max(width[c], row[c].size());
  }
  // A header sits over its column: right-aligned over numbers, left over
  // text (a column with any text cell is text).
  std::vector<bool> numeric(header_.size(), true);
  for (const auto& row : rows_) {
    for (size_t c = 0; c < row.size(); ++c) {
      if (!row[c].empty() && !LooksNumeric(row[c])) numeric[c] = false;
    }
  }
  std::ostringstream out;
  auto emit = [&](const std::vector<std::string>& row, bool header) {
    for (size_t c = 0; c < row.size(); ++c) {
      if (c) out << "  ";
      size_t pad = width[c] - row[c].size();
      bool right = !header && LooksNumeric(row[c]);
      if (header && c > 0) right = numeric[c];
      if (right) out << std::string(pad, ' ') << row[c];
      else if (c + 1 < row.size()) out << row[c] << std::string(pad, ' ');
      else out << row[c];
    }
    out << '\n';
  };
  emit(header_, true);
  size_t total = 0;
  for (size_t c = 0; c < width.size(); ++c) total += width[c] + (c ? 2 : 0);
  out << std::string(total, '-') << '\n';
  for (const auto& row : rows_) emit(row, false);
  return out.str();
}

std::string FormatFixed(double value, int decimals) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.*f", decimals, value);
  return buf;
}

std::string FormatGiB(long long bytes) {
  return FormatFixed(static_cast<double>(bytes) / (1024.0 * 1024.0 * 1024.0), 2);
}

}  // namespace memplan
