// Aligned plain-text tables for human output: a header row, a rule, rows;
// numeric-looking cells are right-aligned, text left-aligned.
#pragma once

#include <string>
#include <vector>

namespace memplan {

class Table {
 public:
  explicit Table(std::vector<std::string> header);
  void AddRow(std::vector<std::string> cells);
  std::string Render() const;

 private:
  std::vector<std::string> header_;
  std::vector<std::vector<std::string>> rows_;
};

// Fixed-point formatting helpers for table cells.
std::string FormatFixed(double value, int decimals);
std::string FormatGiB(long long bytes);  // "12.34" (unit goes in the header)

}  // namespace memplan
