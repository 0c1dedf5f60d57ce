// REPORT.html (docs/viz.md): the plan, its bounds and, when given, the
// measurement and the trace of a run, side by side in one self-contained
// page (every script, style and the charting library inline; no network
// when it is opened).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "memplan/common/json_util.h"
#include "memplan/common/status.h"

namespace memplan::viz {

struct ReportOptions {
  std::string plan_file;      // PLAN.json (required)
  std::string measured_file;  // MEASURED.json (optional)
  std::string trace_file;     // TRACE.json (optional)
  // A measurement of another plan (digest mismatch) is drawn with a warning
  // banner instead of refused (kDigestMismatch).
  bool force = false;
  // Timelines longer than this are down-sampled, each bucket keeping its
  // maximum (the page says so).
  int64_t max_points = 4000;
  // Schedule passes, copies and trace spans drawn per rank at most.
  int64_t max_spans = 20000;
};

// What the page draws, as one JSON document (its schema: docs/viz.md).
// Errors: kBadInput (a malformed file: its name and JSON path),
// kDigestMismatch (MEASURED.json of another plan, without `force`).
Expected<Json> BuildReportData(const ReportOptions& options, std::vector<std::string>* warnings);

// The page: the template with the data, the page's modules and uPlot inline.
std::string RenderReportHtml(const Json& data);

// A Chrome trace (the object form, or the Trace Event format's bare array)
// as the report draws it: its complete events per pid, at most `max_spans`
// each (`*reduced` set when some were left out), thread names from its
// metadata. Every field read is type-checked: errors (kBadInput) are one
// line naming `file` and the JSON path ("t.json: /traceEvents/3/tid:
// expected an integer").
Expected<Json> TraceSpans(const Json& trace, const std::string& file, int64_t max_spans, bool* reduced);

// The version of the inlined charting library ("uPlot 1.6.32").
std::string_view ChartLibrary();

}  // namespace memplan::viz
