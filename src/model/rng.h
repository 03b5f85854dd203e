// Deterministic random numbers, identical on every platform and thread count
// (std::normal_distribution is implementation-defined, so it is not used for weights).
#pragma once
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

namespace mt {

// splitmix64 as a hash: z advanced by the golden-ratio step, then mixed (Rng's generator is this
// function of its running state).
inline uint64_t splitmix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

class Rng {
 public:
  explicit Rng(uint64_t seed) : s_(seed * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull) {}
  uint64_t next_u64() {
    const uint64_t z = s_;
    s_ += 0x9E3779B97F4A7C15ull;
    return splitmix64(z);
  }
  // Uniform in [0, 1).
  double uniform() { return static_cast<double>(next_u64() >> 11) * (1.0 / 9007199254740992.0); }
  // Standard normal (Box-Muller).
  double normal() {
    double u1 = uniform(), u2 = uniform();
    if (u1 < 1e-300) u1 = 1e-300;
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }

 private:
  uint64_t s_;
};

// Fisher-Yates with Rng(seed): the same order on every platform (std::shuffle's algorithm is not
// specified).
template <class T>
void shuffle_with_seed(std::vector<T>& v, uint64_t seed) {
  Rng rng(seed);
  for (size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[static_cast<size_t>(rng.next_u64() % i)]);
}

}  // namespace mt
