// The report's web assets, compiled in by viz/embed.py (viz/meson.build).
#pragma once

#include <string_view>

namespace memplan::viz::assets {

std::string_view report_html();
std::string_view report_css();
std::string_view common_js();
std::string_view ranks_js();
std::string_view memory_js();
std::string_view schedule_js();
std::string_view tensors_js();
std::string_view tradeoff_js();
std::string_view main_js();
std::string_view uplot_js();
std::string_view uplot_css();
std::string_view uplot_license();

}  // namespace memplan::viz::assets
