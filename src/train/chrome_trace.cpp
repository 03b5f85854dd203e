#include "train/chrome_trace.h"

#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>

namespace mt {

ChromeTrace::ChromeTrace(const std::string& path, int rank)
    : path_(path.empty() ? "" : rank_path(path, rank)), rank_(rank), t0_(std::chrono::steady_clock::now()) {}

std::string ChromeTrace::rank_path(const std::string& path, int rank) {
  const std::string tag = ".rank" + std::to_string(rank);
  auto dot = path.find_last_of('.');
  auto slash = path.find_last_of('/');
  if (dot == std::string::npos || (slash != std::string::npos && dot < slash)) return path + tag;
  return path.substr(0, dot) + tag + path.substr(dot);
}

int64_t ChromeTrace::now_us() const {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0_).count();
}

void ChromeTrace::begin(const std::string& name, const char* category) {
  if (!enabled()) return;
  open_.push_back(events_.size());
  events_.push_back({name, category, now_us(), 0});
}

void ChromeTrace::end() {
  if (!enabled() || open_.empty()) return;
  Event& e = events_[open_.back()];
  open_.pop_back();
  e.dur_us = now_us() - e.ts_us;
}

void ChromeTrace::flush() {
  if (!enabled()) return;
  nlohmann::json arr = nlohmann::json::array();
  arr.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", rank_}, {"args", {{"name", "rank " + std::to_string(rank_)}}}});
  for (const auto& e : events_)
    arr.push_back({{"name", e.name}, {"cat", e.cat}, {"ph", "X"}, {"ts", e.ts_us}, {"dur", e.dur_us}, {"pid", rank_}, {"tid", 0}});
  std::ofstream f(path_, std::ios::trunc);
  if (!f) throw std::runtime_error("log.trace_out: cannot write " + path_);
  f << nlohmann::json{{"traceEvents", arr}, {"displayTimeUnit", "ms"}}.dump() << "\n";
}

ChromeTrace::~ChromeTrace() {
  try {
    flush();
  } catch (...) {
  }
}

void TracingHooks::pre_forward(int u) {
  if (inner_) inner_->pre_forward(u);
  trace_->begin("forward " + model_->unit(u).name, "compute");
}
void TracingHooks::post_forward(int u) {
  trace_->end();
  if (inner_) inner_->post_forward(u);
}
void TracingHooks::pre_backward(int u) {
  if (inner_) inner_->pre_backward(u);
  trace_->begin("backward " + model_->unit(u).name, "compute");
}
void TracingHooks::post_backward(int u) {
  trace_->end();
  if (inner_) inner_->post_backward(u);
}

}  // namespace mt
