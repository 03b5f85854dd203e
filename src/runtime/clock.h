// Wall-clock intervals in milliseconds on the steady clock (step, communication and bubble times).
#pragma once
#include <chrono>

namespace mt {

using Clock = std::chrono::steady_clock;
inline double ms_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}
inline double ms_since(Clock::time_point t) { return ms_between(t, Clock::now()); }

}  // namespace mt
