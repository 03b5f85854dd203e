// Element-wise reduction of the contributions of all ranks to one segment. Sources are combined in
// rank order with an fp32 accumulator, so results do not depend on message arrival order and equal
// a sequential loop over ranks (bit for bit).
#include <algorithm>
#include <cstring>

#include "comm/detail.h"

namespace mt::comm::detail {

namespace {

constexpr size_t kBlock = 1024;  // elements per block: the accumulator stays in L1

inline float load(const float* p, size_t i) { return p[i]; }
inline float load(const uint16_t* p, size_t i) {
  uint32_t u = static_cast<uint32_t>(p[i]) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline void store(float* p, size_t i, float v) { p[i] = v; }
// Round to nearest even, NaN kept quiet; identical to mt::float_to_bf16, written without branches
// so the loop vectorises.
inline void store(uint16_t* p, size_t i, float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  uint32_t nan = (u >> 16) | 0x40u;
  p[i] = static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

// Max that propagates NaN from any source.
inline float max_nan(float a, float b) { return (b > a || b != b) ? b : a; }

template <typename T>
void reduce_typed(ReduceOp op, int n, const T* const* srcs, T* out, size_t len) {
  float acc[kBlock];
  const float inv_n = static_cast<float>(n);
  for (size_t b = 0; b < len; b += kBlock) {
    const size_t m = std::min(kBlock, len - b);
    const T* s0 = srcs[0] + b;
    for (size_t i = 0; i < m; ++i) acc[i] = load(s0, i);
    for (int q = 1; q < n; ++q) {
      const T* s = srcs[q] + b;
      if (op == ReduceOp::Max) {
        for (size_t i = 0; i < m; ++i) acc[i] = max_nan(acc[i], load(s, i));
      } else {
        for (size_t i = 0; i < m; ++i) acc[i] += load(s, i);
      }
    }
    T* o = out + b;
    if (op == ReduceOp::Avg) {
      for (size_t i = 0; i < m; ++i) store(o, i, acc[i] / inv_n);
    } else {
      for (size_t i = 0; i < m; ++i) store(o, i, acc[i]);
    }
  }
}

}  // namespace

void reduce_into(DType dt, ReduceOp op, int n, const void* const* srcs, void* out, size_t len) {
  if (len == 0) return;
  if (dt == DType::F32) {
    reduce_typed<float>(op, n, reinterpret_cast<const float* const*>(srcs),
                        static_cast<float*>(out), len);
  } else {
    reduce_typed<uint16_t>(op, n, reinterpret_cast<const uint16_t* const*>(srcs),
                           static_cast<uint16_t*>(out), len);
  }
}

}  // namespace mt::comm::detail
