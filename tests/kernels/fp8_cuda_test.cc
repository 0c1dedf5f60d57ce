// GPU kernels vs the CPU reference, bit for bit. Exits 77 (Meson: skipped)
// when no CUDA device is visible.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "memplan/kernels/fp8.h"
#include "memplan/kernels/fp8_cuda.h"

namespace mk = memplan::kernels;

namespace {

// Owns one device allocation (test-only; the kernels never allocate).
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t size_bytes) {
    if (size_bytes > 0 && cudaMalloc(&ptr_, size_bytes) != cudaSuccess) ptr_ = nullptr;
  }
  ~DeviceBuffer() { cudaFree(ptr_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  bool ok() const { return ptr_ != nullptr; }
  template <typename T>
  T* As(size_t offset_bytes = 0) const {
    return reinterpret_cast<T*>(static_cast<char*>(ptr_) + offset_bytes);
  }

 private:
  void* ptr_ = nullptr;
};

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

// Random finite data over many binades, with an all-zero block, a block of
// float subnormals and a block of exact E4M3 rounding ties (pow2 scale 1).
std::vector<float> TestMatrix(mk::Fp8BlockLayout layout, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> unit(-1.f, 1.f);
  std::uniform_int_distribution<int> binade(-60, 60);
  std::vector<float> x(static_cast<size_t>(layout.ValueBytes()));
  for (int64_t r = 0; r < layout.rows; ++r) {
    const float row_scale = std::ldexp(1.f, binade(rng));
    for (int64_t c = 0; c < layout.cols; ++c) {
      x[static_cast<size_t>(r * layout.cols + c)] = unit(rng) * row_scale;
    }
  }
  const auto fill_block = [&](int64_t r, auto fn) {
    if (r >= layout.rows) return;
    for (int64_t c = 0; c < std::min<int64_t>(layout.cols, mk::kFp8Block); ++c) {
      x[static_cast<size_t>(r * layout.cols + c)] = fn(c);
    }
  };
  fill_block(1, [](int64_t) { return 0.f; });
  fill_block(2, [](int64_t c) { return static_cast<float>(c + 1) * 1e-42f; });
  static const float kTies[] = {448.f, 1.0625f, 1.1875f, 0x1p-10f, 3 * 0x1p-10f,
                                5 * 0x1p-10f, 15 * 0x1p-10f, 432.f, 1.9375f, -0.f};
  fill_block(3, [](int64_t c) {
    const float t = kTies[c % 10];
    return (c / 10) % 2 ? -t : t;
  });
  return x;
}

struct Case {
  int64_t rows;
  int64_t cols;
};

constexpr Case kCases[] = {{1, 1},   {3, 127},  {5, 128},   {7, 129},
                           {4, 300}, {9, 1000}, {64, 4096}, {257, 7168}};

// Runs quantize (fp32 or bf16 input, with `elem_offset` elements of input
// misalignment to force the scalar path) and dequantize on the GPU and compares
// against the references bit for bit.
template <typename In>
void CheckAgainstRef(const std::vector<In>& x, mk::Fp8BlockLayout layout,
                     mk::ScaleMode mode, size_t elem_offset) {
  const size_t n = static_cast<size_t>(layout.ValueBytes());
  const size_t num_scales = static_cast<size_t>(layout.rows * layout.BlocksPerRow());
  std::vector<uint8_t> ref_values(n);
  std::vector<float> ref_scales(num_scales);
  std::vector<float> ref_y(n);
  mk::QuantizeFp8BlockwiseRef(x.data(), layout, mode, ref_values.data(), ref_scales.data());
  mk::DequantizeFp8BlockwiseRef(ref_values.data(), ref_scales.data(), layout, ref_y.data());

  DeviceBuffer d_x((n + elem_offset) * sizeof(In));
  DeviceBuffer d_values(n + elem_offset);
  DeviceBuffer d_scales(num_scales * sizeof(float));
  DeviceBuffer d_y((n + elem_offset) * sizeof(float));
  In* dx = d_x.As<In>(elem_offset * sizeof(In));
  uint8_t* dv = d_values.As<uint8_t>(elem_offset);
  float* ds = d_scales.As<float>();
  float* dy = d_y.As<float>(elem_offset * sizeof(float));
  REQUIRE((d_x.ok() && d_values.ok() && d_scales.ok() && d_y.ok()));
  REQUIRE(cudaMemcpy(dx, x.data(), n * sizeof(In), cudaMemcpyHostToDevice) ==
          cudaSuccess);

  REQUIRE(mk::QuantizeFp8BlockwiseCuda(dx, layout, mode, dv, ds, nullptr) == 0);
  REQUIRE(mk::DequantizeFp8BlockwiseCuda(dv, ds, layout, dy, nullptr) == 0);
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);

  std::vector<uint8_t> values(n);
  std::vector<float> scales(num_scales);
  std::vector<float> y(n);
  REQUIRE(cudaMemcpy(values.data(), dv, n, cudaMemcpyDeviceToHost) == cudaSuccess);
  REQUIRE(cudaMemcpy(scales.data(), ds, num_scales * sizeof(float),
                     cudaMemcpyDeviceToHost) == cudaSuccess);
  REQUIRE(cudaMemcpy(y.data(), dy, n * sizeof(float), cudaMemcpyDeviceToHost) ==
          cudaSuccess);

  size_t bad_values = 0, bad_scales = 0, bad_y = 0;
  for (size_t i = 0; i < n; ++i) {
    bad_values += values[i] != ref_values[i];
    bad_y += Bits(y[i]) != Bits(ref_y[i]);
  }
  for (size_t i = 0; i < num_scales; ++i) bad_scales += Bits(scales[i]) != Bits(ref_scales[i]);
  CHECK(bad_values == 0);
  CHECK(bad_scales == 0);
  CHECK(bad_y == 0);
}

}  // namespace

TEST_CASE("CUDA fp32 quantize/dequantize == reference, bit for bit") {
  for (const Case& tc : kCases) {
    const mk::Fp8BlockLayout layout{tc.rows, tc.cols};
    const std::vector<float> x = TestMatrix(layout, static_cast<uint32_t>(tc.cols));
    for (const mk::ScaleMode mode : {mk::ScaleMode::kAmax, mk::ScaleMode::kPow2}) {
      for (const size_t offset : {size_t{0}, size_t{1}}) {
        CAPTURE(tc.rows);
        CAPTURE(tc.cols);
        CAPTURE(static_cast<int>(mode));
        CAPTURE(offset);
        CheckAgainstRef(x, layout, mode, offset);
      }
    }
  }
}

TEST_CASE("CUDA bf16 quantize == reference, bit for bit") {
  for (const Case& tc : kCases) {
    const mk::Fp8BlockLayout layout{tc.rows, tc.cols};
    const std::vector<float> wide = TestMatrix(layout, 100 + static_cast<uint32_t>(tc.cols));
    std::vector<uint16_t> x(wide.size());
    for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<uint16_t>(Bits(wide[i]) >> 16);
    for (const mk::ScaleMode mode : {mk::ScaleMode::kAmax, mk::ScaleMode::kPow2}) {
      for (const size_t offset : {size_t{0}, size_t{1}}) {
        CAPTURE(tc.rows);
        CAPTURE(tc.cols);
        CAPTURE(static_cast<int>(mode));
        CAPTURE(offset);
        CheckAgainstRef(x, layout, mode, offset);
      }
    }
  }
}

TEST_CASE("CUDA launchers validate arguments") {
  float* null_f = nullptr;
  uint8_t* null_v = nullptr;
  CHECK(mk::QuantizeFp8BlockwiseCuda(null_f, mk::Fp8BlockLayout{0, 128},
                                     mk::ScaleMode::kAmax, null_v, nullptr,
                                     nullptr) == 0);
  CHECK(mk::QuantizeFp8BlockwiseCuda(null_f, mk::Fp8BlockLayout{1, 128},
                                     mk::ScaleMode::kAmax, null_v, nullptr,
                                     nullptr) == static_cast<int>(cudaErrorInvalidValue));
  CHECK(mk::QuantizeFp8BlockwiseCuda(null_f, mk::Fp8BlockLayout{-1, 128},
                                     mk::ScaleMode::kAmax, null_v, nullptr,
                                     nullptr) == static_cast<int>(cudaErrorInvalidValue));
  CHECK(mk::DequantizeFp8BlockwiseCuda(null_v, nullptr, mk::Fp8BlockLayout{3, 0},
                                       nullptr, nullptr) == 0);
  CHECK(mk::DequantizeFp8BlockwiseCuda(null_v, nullptr, mk::Fp8BlockLayout{3, 5},
                                       nullptr, nullptr) ==
        static_cast<int>(cudaErrorInvalidValue));
}

#include "gpu_test_main.h"
