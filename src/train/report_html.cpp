#include "train/report_html.h"

#include <nlohmann/json.hpp>

namespace mt {

namespace {

// The page's style and the script that draws every chart from the inline DATA object.
const char* const kHead = R"HTML(<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>%TITLE%</title>
<style>
body{font-family:sans-serif;margin:24px;color:#222;background:#fff}
h1{font-size:22px} h2{font-size:17px;margin-top:28px}
.charts{display:flex;flex-wrap:wrap;gap:12px}
.chart{border:1px solid #ddd;padding:6px;width:460px}
.chart h3{font-size:13px;margin:2px 0 4px 0}
.note{color:#888;font-size:12px}
pre{background:#f6f6f6;padding:8px;font-size:12px;overflow-x:auto}
table{border-collapse:collapse;font-size:13px} td,th{border:1px solid #ddd;padding:3px 8px;text-align:left}
.legend span{display:inline-block;margin-right:16px;font-size:13px}
</style></head><body>
)HTML";

const char* const kScript = R"HTML(<script>
"use strict";
const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"];
const SVGNS = "http://www.w3.org/2000/svg";
const W = 460, H = 230, L = 64, R = 12, T = 10, B = 34;
function el(tag, attrs, parent, text) {
  const e = document.createElementNS(SVGNS, tag);
  for (const k in attrs) e.setAttribute(k, attrs[k]);
  if (text !== undefined) e.textContent = text;
  if (parent) parent.appendChild(e);
  return e;
}
function ticks(lo, hi) {
  if (!(hi > lo)) hi = lo + 1;
  const raw = (hi - lo) / 5, mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 5, 10].map(m => m * mag).find(s => s >= raw);
  const out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(v);
  return out;
}
function fmt(v) {
  const a = Math.abs(v);
  if (a >= 1e9) return (v / 1e9).toPrecision(3) + "G";
  if (a >= 1e6) return (v / 1e6).toPrecision(3) + "M";
  if (a >= 1e4) return (v / 1e3).toPrecision(3) + "k";
  return +v.toPrecision(4) + "";
}
function panel(title, note) {
  const div = document.createElement("div");
  div.className = "chart";
  const h = document.createElement("h3");
  h.textContent = title;
  div.appendChild(h);
  document.getElementById("charts").appendChild(div);
  if (note) {
    const p = document.createElement("p");
    p.className = "note";
    p.textContent = note;
    div.appendChild(p);
    return null;
  }
  return el("svg", {width: W, height: H, viewBox: "0 0 " + W + " " + H}, div);
}
function axes(svg, xlo, xhi, ylo, yhi) {
  const sx = x => L + (x - xlo) / ((xhi - xlo) || 1) * (W - L - R);
  const sy = y => H - B - (y - ylo) / ((yhi - ylo) || 1) * (H - T - B);
  el("rect", {x: L, y: T, width: W - L - R, height: H - T - B, fill: "none", stroke: "#999"}, svg);
  for (const v of ticks(ylo, yhi)) {
    el("line", {x1: L, x2: W - R, y1: sy(v), y2: sy(v), stroke: "#eee"}, svg);
    el("text", {x: L - 4, y: sy(v) + 4, "text-anchor": "end", "font-size": 10}, svg, fmt(v));
  }
  for (const v of ticks(xlo, xhi))
    el("text", {x: sx(v), y: H - B + 14, "text-anchor": "middle", "font-size": 10}, svg, fmt(v));
  el("text", {x: (L + W - R) / 2, y: H - 4, "text-anchor": "middle", "font-size": 11}, svg, "step");
  return [sx, sy];
}
// One line per run of the numeric per-step key `key` (scaled by `scale`); `dots` adds a key drawn as points.
function lineChart(title, key, scale, dots) {
  const series = DATA.runs.map(r => r.steps.filter(s => typeof s[key] === "number").map(s => [s.step, s[key] * scale]));
  const points = dots ? DATA.runs.map(r => r.steps.filter(s => typeof s[dots] === "number").map(s => [s.step, s[dots] * scale])) : [];
  const all = series.concat(points).flat();
  const svg = panel(title, all.length ? "" : key + " not recorded");
  if (!svg) return;
  const xs = all.map(p => p[0]), ys = all.map(p => p[1]);
  let ylo = Math.min(...ys), yhi = Math.max(...ys);
  if (ylo > 0 && key !== "loss") ylo = 0;  // amounts from zero; the loss on its own range
  const [sx, sy] = axes(svg, Math.min(...xs), Math.max(...xs), ylo, yhi);
  series.forEach((s, i) => {
    if (s.length) el("polyline", {points: s.map(p => sx(p[0]) + "," + sy(p[1])).join(" "), fill: "none",
                                  stroke: COLORS[i % COLORS.length], "stroke-width": 1.5}, svg);
  });
  points.forEach((s, i) => s.forEach(p => el("circle", {cx: sx(p[0]), cy: sy(p[1]), r: 3, fill: COLORS[i % COLORS.length]}, svg)));
}
// Grouped bars of an object of the final summary (category -> bytes), one colour per run.
function barChart(title, key) {
  const objs = DATA.runs.map(r => (r.final && r.final[key]) || {});
  const cats = [...new Set(objs.flatMap(o => Object.keys(o).filter(k => o[k] > 0)))];  // groups never used left out
  const svg = panel(title, cats.length ? "" : key + " not recorded");
  if (!svg) return;
  const max = Math.max(1, ...objs.flatMap(o => Object.values(o)));
  const sy = y => H - B - y / max * (H - T - B), cw = (W - L - R) / cats.length, bw = cw * 0.8 / objs.length;
  el("rect", {x: L, y: T, width: W - L - R, height: H - T - B, fill: "none", stroke: "#999"}, svg);
  for (const v of ticks(0, max)) el("text", {x: L - 4, y: sy(v) + 4, "text-anchor": "end", "font-size": 10}, svg, fmt(v) + "B");
  cats.forEach((c, j) => {
    el("text", {x: L + cw * (j + 0.5), y: H - B + 14, "text-anchor": "middle", "font-size": 10}, svg, c);
    objs.forEach((o, i) => {
      const v = o[c] || 0;
      el("rect", {x: L + cw * j + cw * 0.1 + bw * i, y: sy(v), width: bw, height: H - B - sy(v),
                  fill: COLORS[i % COLORS.length]}, svg);
    });
  });
}
// Ranks x steps, coloured by each rank's time relative to that step's fastest rank: the busy time
// (data wait + compute) when the run records it - synchronous ranks share one step time, the slow
// one shows in what it did before the collectives - else the step time.
function heatMap() {
  DATA.runs.forEach((r, i) => {
    const busy = r.steps.some(s => Array.isArray(s.busy_ms_per_rank));
    const key = busy ? "busy_ms_per_rank" : "step_ms_per_rank";
    const rows = r.steps.filter(s => Array.isArray(s[key]));
    const svg = panel("per-rank " + (busy ? "busy" : "step") + " time, " + r.label + " (darker = slower than the step's fastest rank)",
                      rows.length ? "" : "step_ms_per_rank not recorded (" + r.label + ")");
    if (!svg) return;
    const nr = Math.max(...rows.map(s => s[key].length));
    const cw = (W - L - R) / rows.length, ch = (H - T - B) / nr;
    rows.forEach((s, x) => {
      const lo = Math.max(1e-3, Math.min(...s[key]));
      s[key].forEach((v, y) => {
        const f = Math.min(1, (v / lo - 1) / 0.5), c = Math.round(255 * (1 - f));
        el("rect", {x: L + x * cw, y: T + y * ch, width: cw + 0.5, height: ch + 0.5, fill: "rgb(255," + c + "," + c + ")"}, svg)
          .appendChild(el("title", {}, null, "step " + s.step + " rank " + y + ": " + v.toFixed(1) + " ms"));
      });
    });
    for (let y = 0; y < nr; ++y) el("text", {x: L - 4, y: T + (y + 0.5) * ch + 4, "text-anchor": "end", "font-size": 10}, svg, "rank " + y);
  });
}
const legend = document.getElementById("legend");
DATA.runs.forEach((r, i) => {
  const s = document.createElement("span");
  s.style.color = COLORS[i % COLORS.length];
  s.textContent = "\u25a0 " + r.label;
  legend.appendChild(s);
});
lineChart("loss (dots: validation loss)", "loss", 1, "val_loss");
lineChart("tokens/s (global)", "tokens_per_s", 1);
lineChart("MFU, %", "mfu", 100);
lineChart("step time, ms", "step_ms", 1);
lineChart("exposed communication, ms per step", "exposed_comm_ms", 1);
lineChart("data wait, ms per step", "data_wait_ms", 1);
// Unpacked data only (data.packing = false): padded positions per step, percent.
if (DATA.runs.some(r => r.steps.some(s => typeof s.padding_share === "number")))
  lineChart("padding share, % of positions", "padding_share", 100);
lineChart("peak memory of rank 0, bytes", "mem_peak_bytes", 1);
barChart("peak memory by category (rank 0)", "mem_peak_by_category");
barChart("bytes sent by group (rank 0, whole run)", "comm_bytes_by_group");
heatMap();
document.body.setAttribute("data-charts-drawn", document.querySelectorAll("svg").length);
</script>
)HTML";

std::string html_escape(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '&') o += "&amp;";
    else if (c == '<') o += "&lt;";
    else if (c == '>') o += "&gt;";
    else if (c == '"') o += "&quot;";
    else o += c;
  }
  return o;
}

// The layout keys of the final summary, as table rows.
std::string layout_table(const nlohmann::json& fin) {
  if (!fin.is_object()) return "<p class=\"note\">no final summary (the run did not finish)</p>\n";
  std::string t = "<table>\n";
  for (const char* k : {"strategy", "world_size", "shard_group_size", "num_params", "steps", "tokens_per_s", "cp",
                        "cp_mode", "ep", "pp_schedule", "pp_microbatches", "pp_stages", "pp_bubble"})
    if (fin.contains(k)) {
      const auto& v = fin[k];
      t += "<tr><th>" + std::string(k) + "</th><td>" + html_escape(v.is_string() ? v.get<std::string>() : v.dump()) +
           "</td></tr>\n";
    }
  return t + "</table>\n";
}

}  // namespace

std::string report_html(const std::vector<ReportRun>& runs, const std::string& title) {
  std::string head = kHead;
  head.replace(head.find("%TITLE%"), 7, html_escape(title));
  std::string h = head + "<h1>" + html_escape(title) + "</h1>\n<div class=\"legend\" id=\"legend\"></div>\n";
  h += "<div class=\"charts\" id=\"charts\"></div>\n";
  nlohmann::json data = {{"runs", nlohmann::json::array()}};
  for (const auto& r : runs) {
    data["runs"].push_back({{"label", r.metrics.label}, {"steps", r.metrics.steps}, {"final", r.metrics.final}});
    h += "<h2>" + html_escape(r.metrics.label) + "</h2>\n<p class=\"note\">" + html_escape(r.metrics.path) + "</p>\n";
    h += "<h3>diagnosis</h3>\n<pre>" + html_escape(r.diagnosis.text()) + "</pre>\n";
    h += "<h3>layout</h3>\n" + layout_table(r.metrics.final);
    h += "<h3>config</h3>\n" + (r.config_text.empty() ? std::string("<p class=\"note\">not given (meshtrain report --config)</p>\n")
                                                        : "<pre>" + html_escape(r.config_text) + "</pre>\n");
  }
  std::string js = data.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  for (size_t p = 0; (p = js.find("</", p)) != std::string::npos; p += 3) js.replace(p, 2, "<\\/");
  h += "<script>const DATA = " + js + ";</script>\n";
  return h + kScript + "</body></html>\n";
}

}  // namespace mt
