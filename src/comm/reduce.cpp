// Element-wise reduction of the contributions of all ranks to one segment. Sources are combined in
// rank order with an fp32 accumulator, so results do not depend on message arrival order and equal
// a sequential loop over ranks (bit for bit). Integers are combined in their own type: exact.
#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

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

template <typename TIn, typename TOut>
void reduce_typed(ReduceOp op, int n, const TIn* const* srcs, TOut* out, size_t len,
                  float divisor) {
  float acc[kBlock];
  for (size_t b = 0; b < len; b += kBlock) {
    const size_t m = std::min(kBlock, len - b);
    const TIn* s0 = srcs[0] + b;
    for (size_t i = 0; i < m; ++i) acc[i] = load(s0, i);
    for (int q = 1; q < n; ++q) {
      const TIn* s = srcs[q] + b;
      if (op == ReduceOp::Max) {
        for (size_t i = 0; i < m; ++i) acc[i] = max_nan(acc[i], load(s, i));
      } else {
        for (size_t i = 0; i < m; ++i) acc[i] += load(s, i);
      }
    }
    TOut* o = out + b;
    if (op == ReduceOp::Avg && divisor != 1.0f) {
      for (size_t i = 0; i < m; ++i) store(o, i, acc[i] / divisor);
    } else {
      for (size_t i = 0; i < m; ++i) store(o, i, acc[i]);
    }
  }
}

// Integer sums wrap around (two's complement, through the unsigned type) instead of overflowing.
template <typename T>
void reduce_integer(ReduceOp op, int n, const T* const* srcs, T* out, size_t len) {
  using U = std::make_unsigned_t<T>;
  U acc[kBlock];
  for (size_t b = 0; b < len; b += kBlock) {
    const size_t m = std::min(kBlock, len - b);
    const T* s0 = srcs[0] + b;
    for (size_t i = 0; i < m; ++i) acc[i] = static_cast<U>(s0[i]);
    for (int q = 1; q < n; ++q) {
      const T* s = srcs[q] + b;
      if (op == ReduceOp::Max) {
        for (size_t i = 0; i < m; ++i) acc[i] = static_cast<U>(std::max(static_cast<T>(acc[i]), s[i]));
      } else {
        for (size_t i = 0; i < m; ++i) acc[i] += static_cast<U>(s[i]);
      }
    }
    T* o = out + b;
    for (size_t i = 0; i < m; ++i) o[i] = static_cast<T>(acc[i]);
  }
}

}  // namespace

void reduce_mixed(DType in_dt, DType out_dt, ReduceOp op, int n, const void* const* srcs,
                  void* out, size_t len, int divisor) {
  if (len == 0) return;
  if (is_integer(in_dt) || is_integer(out_dt)) {
    if (in_dt != out_dt || op == ReduceOp::Avg)
      throw std::logic_error(std::string("reduce: ") + reduce_op_name(op) + " of " + dtype_name(in_dt) + " into " +
                             dtype_name(out_dt) + " (integers sum and max in their own type)");
    if (in_dt == DType::I32)
      reduce_integer<int32_t>(op, n, reinterpret_cast<const int32_t* const*>(srcs), static_cast<int32_t*>(out), len);
    else
      reduce_integer<int64_t>(op, n, reinterpret_cast<const int64_t* const*>(srcs), static_cast<int64_t*>(out), len);
    return;
  }
  const float div = static_cast<float>(divisor);
  if (in_dt == DType::F32) {
    auto sp = reinterpret_cast<const float* const*>(srcs);
    if (out_dt == DType::F32)
      reduce_typed<float, float>(op, n, sp, static_cast<float*>(out), len, div);
    else
      reduce_typed<float, uint16_t>(op, n, sp, static_cast<uint16_t*>(out), len, div);
  } else {
    auto sp = reinterpret_cast<const uint16_t* const*>(srcs);
    if (out_dt == DType::F32)
      reduce_typed<uint16_t, float>(op, n, sp, static_cast<float*>(out), len, div);
    else
      reduce_typed<uint16_t, uint16_t>(op, n, sp, static_cast<uint16_t*>(out), len, div);
  }
}

void reduce_into(DType dt, ReduceOp op, int n, const void* const* srcs, void* out, size_t len) {
  reduce_mixed(dt, dt, op, n, srcs, out, len, n);
}

}  // namespace mt::comm::detail
