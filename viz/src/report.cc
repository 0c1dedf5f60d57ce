// The page (report.h): viz/web/report.html with the styles, uPlot, the
// page's modules (one per view) and the data inline. The data is JSON in a
// <script type="application/json"> element. Every '<', '>' and '&' in it
// is written as a JSON escape (\u003c, \u003e, \u0026): JSON puts them only
// inside strings, where the escape means the same character, and the HTML
// tokenizer then never sees "</script", "<!--" or "<script" in the data (any
// of which would end the element or swallow the page's own scripts).
#include <string>

#include "memplan/viz/report.h"
#include "viz_assets.h"

namespace memplan::viz {
namespace {

void Replace(std::string& s, std::string_view marker, std::string_view with) {
  const size_t at = s.find(marker);
  if (at != std::string::npos) s.replace(at, marker.size(), with);
}

std::string Script(std::string_view name, std::string_view code) {
  return "<script>/* " + std::string(name) + " */\n" + std::string(code) + "\n</script>\n";
}

}  // namespace

std::string_view ChartLibrary() { return "uPlot " MEMPLAN_UPLOT_VERSION; }

std::string RenderReportHtml(const Json& data) {
  const std::string json = data.dump();
  std::string safe;
  safe.reserve(json.size() + 64);
  for (char c : json) {
    switch (c) {
      case '<': safe += "\\u003c"; break;
      case '>': safe += "\\u003e"; break;
      case '&': safe += "\\u0026"; break;
      default: safe += c;
    }
  }
  std::string html(assets::report_html());
  Replace(html, "<!--STYLE-->", "<style>\n" + std::string(assets::uplot_css()) + "\n" +
                                    std::string(assets::report_css()) + "\n</style>");
  std::string scripts = "<!-- uPlot " MEMPLAN_UPLOT_VERSION " (MIT License, viz/vendor/uplot-" MEMPLAN_UPLOT_VERSION
                        "/LICENSE):\n" + std::string(assets::uplot_license()) + "-->\n";
  scripts += Script("uPlot " MEMPLAN_UPLOT_VERSION, assets::uplot_js());
  scripts += Script("common.js", assets::common_js());
  scripts += Script("ranks.js", assets::ranks_js());
  scripts += Script("memory.js", assets::memory_js());
  scripts += Script("schedule.js", assets::schedule_js());
  scripts += Script("tensors.js", assets::tensors_js());
  scripts += Script("tradeoff.js", assets::tradeoff_js());
  scripts += Script("main.js", assets::main_js());
  Replace(html, "<!--DATA-->", "<script type=\"application/json\" id=\"memplan-data\">" + safe + "</script>");
  Replace(html, "<!--SCRIPTS-->", scripts);
  return html;
}

}  // namespace memplan::viz
