// NumPy .npy files (format version 1.0), little-endian, C order: what
// `memplan run --dump` writes so that another framework can load the
// weights, the batch and the gradients (numpy.load).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "memplan/common/status.h"

namespace memplan::runtime {

// Writes `data` (product(shape) elements) to `path` atomically (a temporary
// file renamed into place). Errors: kRuntime naming the path.
Expected<std::monostate> WriteNpy(const std::string& path, const float* data, const std::vector<int64_t>& shape);
Expected<std::monostate> WriteNpy(const std::string& path, const int32_t* data, const std::vector<int64_t>& shape);

// Reads a file WriteNpy wrote (tests). `descr` is "<f4" or "<i4".
struct NpyArray {
  std::string descr;
  std::vector<int64_t> shape;
  std::vector<char> bytes;
};
Expected<NpyArray> ReadNpy(const std::string& path);

}  // namespace memplan::runtime
