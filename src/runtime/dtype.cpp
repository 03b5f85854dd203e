#include "runtime/dtype.h"

namespace mt {

bool parse_dtype(std::string_view s, DType* out) {
  if (s == "fp32" || s == "f32" || s == "float32") {
    *out = DType::F32;
    return true;
  }
  if (s == "bf16" || s == "bfloat16") {
    *out = DType::BF16;
    return true;
  }
  if (s == "i32" || s == "int32") {
    *out = DType::I32;
    return true;
  }
  if (s == "i64" || s == "int64") {
    *out = DType::I64;
    return true;
  }
  return false;
}

}  // namespace mt
