// MEASURED.json (`memplan.measured/1`, schemas/measured.schema.json): what
// `memplan run` measured while executing one step of a plan.
//
// Glossary: allocated_peak is the maximum of live allocated bytes (compare
// with the plan's lower_bound); peak is the allocator's high-water mark, the
// host arena's offset + size or the CUDA pool's reserved high-water (compare
// with the plan's peak).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "memplan/common/json_util.h"
#include "memplan/common/status.h"

namespace memplan::traces {

inline constexpr std::string_view kMeasuredSchema = "memplan.measured/1";

// One sample of the allocated-bytes timeline.
struct TimelinePoint {
  double t_us = 0;  // microseconds from the start of the step, >= 0
  int64_t allocated_bytes = 0;
};

struct MeasuredRank {
  int64_t pp_rank = 0;
  int64_t allocated_peak = 0;  // bytes
  int64_t peak = 0;            // bytes
  int64_t static_bytes = 0;    // JSON key "static"
  std::vector<TimelinePoint> timeline;  // t_us non-decreasing
  std::map<std::string, int64_t> events;  // name -> count
};

struct Measured {
  std::string backend = "host";  // "host" | "cuda"
  std::string device;
  std::string plan_digest;  // "sha256:<64 hex>"
  double step_s = 0;
  double loss = 0;
  double grad_norm = 0;
  std::vector<MeasuredRank> ranks;  // pp_rank unique
};

// Parses and validates a MEASURED.json document. Unknown keys, missing keys,
// out-of-range values, a timeline going back in time and duplicate pp ranks
// are kBadInput errors, one line: "FILE: /ranks/0/peak: expected ...".
Expected<Measured> ParseMeasured(const Json& json, const std::string& file);

// ReadJsonFile + ParseMeasured.
Expected<Measured> LoadMeasured(const std::string& path);

// The inverse of ParseMeasured: ParseMeasured(MeasuredToJson(m)) == m.
OrderedJson MeasuredToJson(const Measured& measured);

}  // namespace memplan::traces
