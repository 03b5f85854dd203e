// Helpers shared by the kernel tests: random data, double-precision comparisons and central
// finite differences.
#pragma once
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <sstream>
#include <vector>

namespace kt {

inline std::vector<float> randn(size_t n, uint64_t seed, float scale = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

inline std::vector<float> uniform(size_t n, uint64_t seed, float lo, float hi) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

inline std::vector<double> to_double(const std::vector<float>& v) {
  return std::vector<double>(v.begin(), v.end());
}

// Passes when |got[i] - want[i]| <= atol + rtol * |want[i]| for every i; on failure reports the
// worst element.
inline ::testing::AssertionResult close(const float* got, const double* want, size_t n, double rtol,
                                        double atol) {
  size_t bad = 0, worst = 0;
  double worst_excess = -1.0;
  for (size_t i = 0; i < n; ++i) {
    const double err = std::abs(static_cast<double>(got[i]) - want[i]);
    const double tol = atol + rtol * std::abs(want[i]);
    if (!(err <= tol)) {  // also catches NaN
      ++bad;
      const double ex = std::isnan(err) ? 1e300 : err - tol;
      if (ex > worst_excess) {
        worst_excess = ex;
        worst = i;
      }
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  std::ostringstream os;
  os.precision(10);
  os << bad << " of " << n << " elements out of tolerance (rtol " << rtol << ", atol " << atol
     << "); worst at " << worst << ": got " << got[worst] << ", want " << want[worst];
  return ::testing::AssertionFailure() << os.str();
}

inline ::testing::AssertionResult close(const std::vector<float>& got, const std::vector<double>& want,
                                        double rtol, double atol) {
  if (got.size() != want.size()) return ::testing::AssertionFailure() << "size mismatch";
  return close(got.data(), want.data(), got.size(), rtol, atol);
}

// Central finite differences of a scalar function of x (double precision), for the indices in
// idx (all when empty): g[i] = (f(x + h e_i) - f(x - h e_i)) / 2h, with h scaled to |x_i|.
inline std::vector<double> numgrad(const std::function<double(const std::vector<double>&)>& f,
                                   std::vector<double> x, const std::vector<size_t>& idx = {}) {
  std::vector<double> g(x.size(), 0.0);
  auto one = [&](size_t i) {
    const double x0 = x[i];
    const double h = 1e-6 * std::max(1.0, std::abs(x0));
    x[i] = x0 + h;
    const double fp = f(x);
    x[i] = x0 - h;
    const double fm = f(x);
    x[i] = x0;
    g[i] = (fp - fm) / (2.0 * h);
  };
  if (idx.empty()) {
    for (size_t i = 0; i < x.size(); ++i) one(i);
  } else {
    for (size_t i : idx) one(i);
  }
  return g;
}

inline double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0.0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

inline bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() &&
         std::equal(a.begin(), a.end(), b.begin(), [](float x, float y) {
           uint32_t u, v;
           std::memcpy(&u, &x, 4);
           std::memcpy(&v, &y, 4);
           return u == v;
         });
}

// Runs fn with the OpenMP thread count set to n, then restores the previous count.
template <class F>
void with_threads(int n, F&& fn) {
  const int old = omp_get_max_threads();
  omp_set_num_threads(n);
  fn();
  omp_set_num_threads(old);
}

}  // namespace kt
