// The main() of the GPU test executables: exits 77 (Meson: skipped) when no
// CUDA device is visible, else runs the doctest cases. Include once, in a
// file that defines DOCTEST_CONFIG_IMPLEMENT before including doctest.
#pragma once

#include <cuda_runtime_api.h>
#include <doctest/doctest.h>

#include <cstdio>

int main(int argc, char** argv) {
  int device_count = 0;
  if (cudaGetDeviceCount(&device_count) != cudaSuccess || device_count == 0) {
    std::printf("no CUDA device: skipping\n");
    return 77;
  }
  doctest::Context context(argc, argv);
  return context.run();
}
