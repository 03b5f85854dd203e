// Element types: the floating-point types of weights, activations and gradients (f32, bf16) and
// the integer types of token ids, counts and byte sizes (i32, i64), which tensors hold and the
// collectives carry; the bf16 storage format used across the engine.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

namespace mt {

enum class DType : uint8_t { F32 = 0, BF16 = 1, I32 = 2, I64 = 3 };

inline size_t dtype_size(DType t) {
  switch (t) {
    case DType::BF16: return 2;
    case DType::I64: return 8;
    case DType::F32:
    case DType::I32: break;
  }
  return 4;
}
inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::BF16: return "bf16";
    case DType::I32: return "i32";
    case DType::I64: return "i64";
    case DType::F32: break;
  }
  return "f32";
}
inline bool is_integer(DType t) { return t == DType::I32 || t == DType::I64; }
// Parses "fp32"/"f32"/"float32", "bf16"/"bfloat16", "i32"/"int32" and "i64"/"int64"; returns
// false for anything else.
bool parse_dtype(std::string_view s, DType* out);

// bfloat16 as raw bits. Conversion from float rounds to nearest even; NaN stays NaN.
struct bf16 {
  uint16_t bits;
};

inline float bf16_to_float(bf16 v) {
  uint32_t u = static_cast<uint32_t>(v.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline bf16 float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{static_cast<uint16_t>((u >> 16) | 0x40)};  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16{static_cast<uint16_t>(u >> 16)};
}

// Rounds a float to the nearest bf16 value and back (what a bf16 round trip loses).
inline float round_to_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

}  // namespace mt
