#include "train/metrics_plot.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>


namespace mt {

namespace {

const char* const kPalette[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"};

std::string xml_escape(const std::string& s) {
  std::string o;
  for (char c : s) {
    switch (c) {
      case '&': o += "&amp;"; break;
      case '<': o += "&lt;"; break;
      case '>': o += "&gt;"; break;
      case '"': o += "&quot;"; break;
      default: o += c;
    }
  }
  return o;
}

std::string fmt(const char* f, double v) {
  char b[64];
  std::snprintf(b, sizeof b, f, v);
  return b;
}

// Tick label with as many decimals as the tick spacing needs.
std::string tick_label(double v, double spacing) {
  const int dec = spacing >= 1.0 ? 0 : static_cast<int>(std::ceil(-std::log10(spacing) - 1e-9));
  char b[64];
  std::snprintf(b, sizeof b, "%.*f", dec, std::abs(v) < spacing * 1e-6 ? 0.0 : v);
  return b;
}

struct Panel {
  std::string title;
  std::vector<const std::vector<double>*> ys;  // per run, aligned with that run's step
  bool val_dots = false;                        // loss panel: validation points
};

}  // namespace

std::vector<double> nice_ticks(double lo, double hi, int target) {
  if (!(hi > lo)) hi = lo + 1.0;
  const double raw = (hi - lo) / std::max(1, target);
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  double step = mag;
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (m * mag >= raw) {
      step = m * mag;
      break;
    }
  std::vector<double> t;
  const long long k0 = std::llround(std::ceil(lo / step - 1e-9)), k1 = std::llround(std::floor(hi / step + 1e-9));
  for (long long k = k0; k <= k1; ++k) t.push_back(static_cast<double>(k) * step);
  return t;
}

MetricsSeries read_metrics_series(const std::string& path, const std::string& label) {
  std::ifstream f(path);
  if (!f) throw std::runtime_error("cannot read " + path);
  MetricsSeries s;
  s.label = label;
  std::string line;
  int n = 0;
  while (std::getline(f, line)) {
    ++n;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const std::exception& e) {
      throw std::runtime_error(path + ":" + std::to_string(n) + ": not a JSON object (" + e.what() + ")");
    }
    if (!j.is_object() || j.value("final", false)) continue;
    if (!j.contains("step") || !j.contains("loss")) continue;
    auto num = [&](const char* k) { return j.contains(k) && j[k].is_number() ? j[k].get<double>() : 0.0; };
    const double step = num("step");
    s.step.push_back(step);
    s.loss.push_back(num("loss"));
    s.tokens_per_s.push_back(num("tokens_per_s"));
    s.exposed_comm_ms.push_back(num("exposed_comm_ms"));
    if (j.contains("val_loss") && j["val_loss"].is_number()) {
      s.val_step.push_back(step);
      s.val_loss.push_back(j["val_loss"].get<double>());
    }
  }
  if (s.step.empty()) throw std::runtime_error(path + " has no per-step records (is it a --log.metrics_out file?)");
  return s;
}

std::string metrics_svg(const std::vector<MetricsSeries>& runs, const std::string& title) {
  const double W = 960, left = 80, right = 24, plot_w = W - left - right;
  const double panel_h = 260, top_pad = 34, bottom_pad = 46, plot_h = panel_h - top_pad - bottom_pad;
  const double header = 36, legend_h = 22.0 * static_cast<double>(runs.size()) + 12;
  std::vector<Panel> panels(3);
  panels[0].title = "training loss (dots: validation loss)";
  panels[0].val_dots = true;
  panels[1].title = "throughput, tokens/s (global)";
  panels[2].title = "exposed communication, ms per step";
  for (const auto& r : runs) {
    panels[0].ys.push_back(&r.loss);
    panels[1].ys.push_back(&r.tokens_per_s);
    panels[2].ys.push_back(&r.exposed_comm_ms);
  }
  const double H = header + legend_h + panel_h * static_cast<double>(panels.size());

  double x0 = INFINITY, x1 = -INFINITY;
  for (const auto& r : runs)
    for (double s : r.step) x0 = std::min(x0, s), x1 = std::max(x1, s);
  if (!(x1 > x0)) {
    x0 -= 0.5;
    x1 += 0.5;
  }

  std::string o;
  o += "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" + fmt("%.0f", W) + "\" height=\"" + fmt("%.0f", H) +
       "\" font-family=\"sans-serif\" font-size=\"12\">\n";
  o += "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  o += "<text x=\"" + fmt("%.0f", left) + "\" y=\"24\" font-size=\"16\">" + xml_escape(title) + "</text>\n";
  for (size_t i = 0; i < runs.size(); ++i) {
    const double y = header + 14 + 22.0 * static_cast<double>(i);
    const char* c = kPalette[i % (sizeof kPalette / sizeof *kPalette)];
    o += "<line x1=\"" + fmt("%.0f", left) + "\" y1=\"" + fmt("%.1f", y - 4) + "\" x2=\"" + fmt("%.0f", left + 28) +
         "\" y2=\"" + fmt("%.1f", y - 4) + "\" stroke=\"" + c + "\" stroke-width=\"2\"/>\n";
    o += "<text x=\"" + fmt("%.0f", left + 36) + "\" y=\"" + fmt("%.1f", y) + "\" class=\"legend\">" +
         xml_escape(runs[i].label) + "</text>\n";
  }

  for (size_t p = 0; p < panels.size(); ++p) {
    const Panel& pan = panels[p];
    const double py = header + legend_h + panel_h * static_cast<double>(p) + top_pad;  // top of the plot area
    double y0 = INFINITY, y1 = -INFINITY;
    for (size_t r = 0; r < runs.size(); ++r) {
      for (double v : *pan.ys[r]) y0 = std::min(y0, v), y1 = std::max(y1, v);
      if (pan.val_dots)
        for (double v : runs[r].val_loss) y0 = std::min(y0, v), y1 = std::max(y1, v);
    }
    if (!(y1 > y0)) {
      y0 -= 0.5;
      y1 += 0.5;
    }
    const double pad = 0.05 * (y1 - y0);
    y0 -= pad;
    y1 += pad;
    if (y0 < 0 && y0 + pad >= 0) y0 = 0;  // non-negative data: the axis does not go below 0
    auto X = [&](double s) { return left + (s - x0) / (x1 - x0) * plot_w; };
    auto Y = [&](double v) { return py + plot_h - (v - y0) / (y1 - y0) * plot_h; };

    o += "<g class=\"panel\">\n";
    o += "<text x=\"" + fmt("%.0f", left) + "\" y=\"" + fmt("%.1f", py - 10) + "\" font-size=\"13\">" +
         xml_escape(pan.title) + "</text>\n";
    const std::vector<double> yt = nice_ticks(y0, y1), xt = nice_ticks(x0, x1, 8);
    const double ys = yt.size() > 1 ? yt[1] - yt[0] : 1.0, xs = xt.size() > 1 ? xt[1] - xt[0] : 1.0;
    for (double v : yt) {
      if (v < y0 || v > y1) continue;
      o += "<line x1=\"" + fmt("%.1f", left) + "\" y1=\"" + fmt("%.1f", Y(v)) + "\" x2=\"" + fmt("%.1f", left + plot_w) +
           "\" y2=\"" + fmt("%.1f", Y(v)) + "\" stroke=\"#e0e0e0\"/>\n";
      o += "<text x=\"" + fmt("%.1f", left - 6) + "\" y=\"" + fmt("%.1f", Y(v) + 4) + "\" text-anchor=\"end\">" +
           tick_label(v, ys) + "</text>\n";
    }
    for (double v : xt) {
      if (v < x0 || v > x1) continue;
      o += "<line x1=\"" + fmt("%.1f", X(v)) + "\" y1=\"" + fmt("%.1f", py + plot_h) + "\" x2=\"" + fmt("%.1f", X(v)) +
           "\" y2=\"" + fmt("%.1f", py + plot_h + 4) + "\" stroke=\"black\"/>\n";
      o += "<text x=\"" + fmt("%.1f", X(v)) + "\" y=\"" + fmt("%.1f", py + plot_h + 18) + "\" text-anchor=\"middle\">" +
           tick_label(v, xs) + "</text>\n";
    }
    o += "<text x=\"" + fmt("%.1f", left + plot_w / 2) + "\" y=\"" + fmt("%.1f", py + plot_h + 36) +
         "\" text-anchor=\"middle\">step</text>\n";
    o += "<rect x=\"" + fmt("%.1f", left) + "\" y=\"" + fmt("%.1f", py) + "\" width=\"" + fmt("%.1f", plot_w) +
         "\" height=\"" + fmt("%.1f", plot_h) + "\" fill=\"none\" stroke=\"black\"/>\n";
    for (size_t r = 0; r < runs.size(); ++r) {
      const char* c = kPalette[r % (sizeof kPalette / sizeof *kPalette)];
      const std::vector<double>& ysr = *pan.ys[r];
      o += "<polyline class=\"series\" fill=\"none\" stroke=\"" + std::string(c) + "\" stroke-width=\"1.5\" points=\"";
      for (size_t i = 0; i < ysr.size(); ++i) o += (i ? " " : "") + fmt("%.1f", X(runs[r].step[i])) + "," + fmt("%.1f", Y(ysr[i]));
      o += "\"/>\n";
      if (pan.val_dots)
        for (size_t i = 0; i < runs[r].val_loss.size(); ++i)
          o += "<circle class=\"val\" cx=\"" + fmt("%.1f", X(runs[r].val_step[i])) + "\" cy=\"" +
               fmt("%.1f", Y(runs[r].val_loss[i])) + "\" r=\"3.5\" fill=\"" + c + "\"/>\n";
    }
    o += "</g>\n";
  }
  o += "</svg>\n";
  return o;
}

}  // namespace mt
