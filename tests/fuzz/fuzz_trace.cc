// Fuzz target: TRACE.json as `memplan viz` reads it (viz::TraceSpans) and
// as the trace tests validate it (traces::ValidateNesting). A hostile trace
// (wrong types, the bare-array form, huge numbers) is an Error naming the
// file and the JSON path, or spans; never an exception.
#include <cstddef>
#include <cstdint>

#include "fuzz_util.h"
#include "memplan/traces/chrome_trace.h"
#include "memplan/viz/report.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace memplan;
  auto doc = fuzz::Parse(data, size);
  if (!doc) return 0;
  bool reduced = false;
  auto spans = viz::TraceSpans(*doc, fuzz::kFile, 1000, &reduced);
  if (!spans) {
    if (spans.error().code != ErrorCode::kBadInput) fuzz::Broken("a bad trace is not exit 2", spans.error().message);
    fuzz::CheckError(spans.error());
  } else if (!spans->is_array()) {
    fuzz::Broken("spans are not an array", spans->dump());
  }
  for (const auto& e : traces::ValidateNesting(*doc)) {
    if (e.empty() || e.find('\n') != std::string::npos || e[0] != '/') fuzz::Broken("nesting error is not a pointer line", e);
  }
  return 0;
}
