// SPDX-License-Identifier: Apache-2.0
// `simulate --plot`: cache occupancy and prefix-cache hit rate against the step, as two
// polylines in a standalone SVG (no script, no external style), readable in any browser.
#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>

#include "commands.h"
#include "json.h"

namespace blockkv::tool {
namespace {

constexpr double kWidth = 800, kHeight = 360;
constexpr double kLeft = 60, kRight = 20, kTop = 40, kBottom = 50;
constexpr size_t kMaxPoints = 1500;  // per line; more only bloats the file

std::string Fixed(double x) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.1f", x);
  return text;
}

std::string XmlEscape(std::string_view text) {
  std::string out;
  for (const char c : text) {
    switch (c) {
      case '\'':
        out += "&apos;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '&':
        out += "&amp;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

}  // namespace

std::string PlotSvg(std::span<const StepSample> samples, std::string_view title) {
  const double plot_w = kWidth - kLeft - kRight, plot_h = kHeight - kTop - kBottom;
  const double first = samples.empty() ? 0 : static_cast<double>(samples.front().step);
  const double last = samples.empty() ? 1 : static_cast<double>(samples.back().step);
  const double span = std::max(1.0, last - first);
  const auto x_of = [&](double step) { return kLeft + (step - first) / span * plot_w; };
  const auto y_of = [&](double fraction) {
    return kTop + (1 - std::clamp(fraction, 0.0, 1.0)) * plot_h;
  };
  std::string svg =
      "<svg xmlns='http://www.w3.org/2000/svg' width='800' height='360' "
      "viewBox='0 0 800 360' font-family='sans-serif' font-size='12'>\n"
      "<rect width='800' height='360' fill='white'/>\n";
  svg +=
      "<text x='400' y='22' text-anchor='middle' font-size='14'>" + XmlEscape(title) + "</text>\n";
  // Grid and axes: 0-100 % on the left, steps below.
  for (int i = 0; i <= 4; ++i) {
    const double y = y_of(i / 4.0);
    svg += "<line x1='" + Fixed(kLeft) + "' y1='" + Fixed(y) + "' x2='" + Fixed(kLeft + plot_w) +
           "' y2='" + Fixed(y) + "' stroke='#ddd'/>\n";
    svg += "<text x='" + Fixed(kLeft - 6) + "' y='" + Fixed(y + 4) + "' text-anchor='end'>" +
           std::to_string(25 * i) + "%</text>\n";
  }
  for (int i = 0; i <= 5; ++i) {
    const double step = first + span * i / 5;
    svg += "<text x='" + Fixed(x_of(step)) + "' y='" + Fixed(kTop + plot_h + 18) +
           "' text-anchor='middle'>" + std::to_string(static_cast<long long>(step)) + "</text>\n";
  }
  svg += "<text x='" + Fixed(kLeft + plot_w / 2) + "' y='" + Fixed(kHeight - 10) +
         "' text-anchor='middle'>step</text>\n";
  svg += "<rect x='" + Fixed(kLeft) + "' y='" + Fixed(kTop) + "' width='" + Fixed(plot_w) +
         "' height='" + Fixed(plot_h) + "' fill='none' stroke='#444'/>\n";
  // The two series, thinned to at most kMaxPoints points by stride.
  const size_t stride = std::max<size_t>(1, (samples.size() + kMaxPoints - 1) / kMaxPoints);
  const auto polyline = [&](const char* color, double StepSample::*field) {
    std::string points;
    for (size_t i = 0; i < samples.size(); i += stride) {
      points += Fixed(x_of(static_cast<double>(samples[i].step))) + "," +
                Fixed(y_of(samples[i].*field)) + " ";
    }
    if (!samples.empty() && (samples.size() - 1) % stride != 0) {
      points += Fixed(x_of(static_cast<double>(samples.back().step))) + "," +
                Fixed(y_of(samples.back().*field));
    }
    return "<polyline fill='none' stroke='" + std::string(color) + "' stroke-width='1.5' points='" +
           points + "'/>\n";
  };
  svg += polyline("#1f77b4", &StepSample::occupancy);
  svg += polyline("#ff7f0e", &StepSample::hit_rate);
  // Legend.
  svg +=
      "<line x1='80' y1='52' x2='100' y2='52' stroke='#1f77b4' stroke-width='2'/>"
      "<text x='105' y='56'>cache occupancy (blocks held by sequences)</text>\n"
      "<line x1='80' y1='68' x2='100' y2='68' stroke='#ff7f0e' stroke-width='2'/>"
      "<text x='105' y='72'>prefix-cache hit rate (cumulative)</text>\n";
  svg += "</svg>\n";
  return svg;
}

Status WriteFile(const std::string& path, std::string_view text) {
  std::FILE* out = std::fopen(path.c_str(), "wb");
  if (out == nullptr) return FileError("cannot write", path, errno);
  const bool written = std::fwrite(text.data(), 1, text.size(), out) == text.size();
  const int error = errno;
  if (std::fclose(out) != 0 || !written)
    return FileError("cannot write", path, written ? errno : error);
  return Status::Ok();
}

}  // namespace blockkv::tool
