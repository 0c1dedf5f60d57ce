#include "memplan/runtime/storage.h"

#include <algorithm>

#include "memplan/common/units.h"

namespace memplan::runtime {

Expected<Policy> ParsePolicy(std::string_view name) {
  for (Policy p : {Policy::kKeep, Policy::kRecompute, Policy::kFp8, Policy::kOffloadHost, Policy::kOffloadRemote}) {
    if (PolicyName(p) == name) return p;
  }
  return Error{ErrorCode::kBadInput, "unknown storage policy \"" + std::string(name) +
                                         "\": expected keep, recompute, fp8, offload_host or offload_remote"};
}

namespace {
bool Has(const StorageSpec& s, Policy p) {
  return std::find(s.policies.begin(), s.policies.end(), p) != s.policies.end();
}
}  // namespace

bool StorageSpec::fp8() const { return Has(*this, Policy::kFp8); }
bool StorageSpec::offload_host() const { return Has(*this, Policy::kOffloadHost); }
bool StorageSpec::offload_remote() const { return Has(*this, Policy::kOffloadRemote); }
bool StorageSpec::recompute() const { return Has(*this, Policy::kRecompute); }

std::optional<Error> ValidateStorageSpec(const StorageSpec& spec) {
  const auto& p = spec.policies;
  auto bad = [&](std::string why) {
    return Error{ErrorCode::kBadInput, "illegal storage " + DescribeStorageSpec(spec) + ": " + why +
                                           " (legal: keep, recompute, fp8, [fp8,] offload_host|offload_remote)"};
  };
  if (p.empty()) return bad("no policy");
  bool legal = false;
  if (p.size() == 1) {
    legal = true;
  } else if (p.size() == 2) {
    legal = p[0] == Policy::kFp8 && (p[1] == Policy::kOffloadHost || p[1] == Policy::kOffloadRemote);
  }
  if (!legal) return bad("not a legal composition");
  if (spec.offload_remote() && spec.remote == nullptr) return bad("offload_remote needs a target device");
  return std::nullopt;
}

std::string DescribeStorageSpec(const StorageSpec& spec) {
  if (spec.policies.empty()) return "[]";
  std::string out;
  for (Policy p : spec.policies) {
    if (!out.empty()) out += '+';
    out += PolicyName(p);
  }
  return out;
}

int64_t NumElements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n = CheckedMul(n, d, "tensor elements");
  return n;
}

}  // namespace memplan::runtime
