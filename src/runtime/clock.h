// Wall-clock intervals in milliseconds on the steady clock (step, communication and bubble times),
// and its time points in nanoseconds (the same clock in every process of a machine: the pipeline
// trace compares its own times with the communication layer's).
#pragma once
#include <chrono>
#include <cstdint>

namespace mt {

using Clock = std::chrono::steady_clock;
inline double ms_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}
inline double ms_since(Clock::time_point t) { return ms_between(t, Clock::now()); }
inline int64_t ns_of(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}
inline int64_t now_ns() { return ns_of(Clock::now()); }

}  // namespace mt
