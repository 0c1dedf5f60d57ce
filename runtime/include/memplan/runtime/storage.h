// Storage policies of saved activations, as the unified activation manager
// binds them (mission-notes.md, "Unified activation manager").
//
// A StorageSpec is a composition of policies. The legal ones are those of
// design.md: `keep`, `recompute`, `fp8`, and `[fp8,] offload_host` or
// `[fp8,] offload_remote` (fp8 first: the FP8 bytes are what moves). Each
// policy is a storage backend; a composition stacks them (the activation
// manager's fp8 backend wraps the offload backend).
//
// Footprints between forward and backward (docs/planner.md, "Liveness"):
// keep holds the full bytes, fp8 FP8Bytes(shape), recompute and the offloads
// nothing on the device.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "memplan/common/status.h"
#include "memplan/planner/liveness.h"
#include "memplan/planner/model.h"

namespace memplan::runtime {

class Device;

// The plan's policies and their spelling ("keep", "recompute", "fp8",
// "offload_host", "offload_remote"), shared with the planner.
using Policy = planner::Policy;
using planner::PolicyName;
Expected<Policy> ParsePolicy(std::string_view name);

struct StorageSpec {
  std::vector<Policy> policies{Policy::kKeep};
  // The device that receives an offload_remote (another pipeline rank's
  // memory). Not owned; must outlive the activation manager.
  Device* remote = nullptr;

  bool fp8() const;
  bool offload_host() const;
  bool offload_remote() const;
  bool recompute() const;
};

// The error (kBadInput) that makes `spec` illegal, or nullopt: an empty or
// unknown composition, duplicates, wrong order, or offload_remote without a
// target.
std::optional<Error> ValidateStorageSpec(const StorageSpec& spec);
// "keep", "fp8+offload_host", ...
std::string DescribeStorageSpec(const StorageSpec& spec);

// Elements of a row-major shape (an empty shape is a scalar). Both counts
// throw ErrorException when they overflow int64 (the manager's entry points
// turn that into an Error).
int64_t NumElements(const std::vector<int64_t>& shape);
// FP8 1x128 blockwise footprint of an fp32/bf16 tensor of `shape`: E4M3
// values plus one fp32 scale per block of the last dimension,
// rows*cols + 4*rows*ceil(cols/128) bytes (1.03125 B/element when 128 divides
// cols): the planner's own formula, so device bytes match the plan.
using planner::Fp8Bytes;

}  // namespace memplan::runtime
