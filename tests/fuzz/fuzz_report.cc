// Fuzz target: the report's embedded data. Any document RenderReportHtml
// embeds must (1) leave no '<' inside the data element, so no string can
// end it or open a comment or script that swallows the page's own scripts
// (issue 23: "<!--<script" once blanked the page), and (2) parse back to
// the very document. The browser test renders such a page
// (tests/viz_test.sh, "Hostile strings").
#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz_util.h"
#include "memplan/viz/report.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace memplan;
  auto doc = fuzz::Parse(data, size);
  if (!doc) return 0;
  const std::string html = viz::RenderReportHtml(*doc);
  const std::string open = "<script type=\"application/json\" id=\"memplan-data\">";
  const size_t begin = html.find(open);
  if (begin == std::string::npos) fuzz::Broken("no data element", "");
  const size_t from = begin + open.size();
  const size_t end = html.find("</script>", from);
  if (end == std::string::npos) fuzz::Broken("the data element is not closed", "");
  const std::string embedded = html.substr(from, end - from);
  if (embedded.find('<') != std::string::npos) fuzz::Broken("a '<' inside the data element", embedded.substr(0, 200));
  auto back = ParseJsonText(embedded, "embedded");
  if (!back) fuzz::Broken("the embedded data does not parse", back.error().message);
  if (*back != *doc) fuzz::Broken("the embedded data is another document", embedded.substr(0, 200));
  return 0;
}
