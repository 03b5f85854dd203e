// Element types: sizes, names and spellings of every dtype, and tensors of integers (token ids,
// counts) with their checked accessors.
#include <gtest/gtest.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "runtime/dtype.h"
#include "runtime/tensor.h"

namespace mt {
namespace {

TEST(DType, SizesNamesAndSpellings) {
  struct Want {
    DType dt;
    size_t size;
    const char* name;
    bool integer;
  };
  for (const Want& w : {Want{DType::F32, 4, "f32", false}, Want{DType::BF16, 2, "bf16", false},
                        Want{DType::I32, 4, "i32", true}, Want{DType::I64, 8, "i64", true}}) {
    EXPECT_EQ(dtype_size(w.dt), w.size) << w.name;
    EXPECT_STREQ(dtype_name(w.dt), w.name);
    EXPECT_EQ(is_integer(w.dt), w.integer) << w.name;
    DType back = w.dt == DType::F32 ? DType::BF16 : DType::F32;
    ASSERT_TRUE(parse_dtype(w.name, &back)) << w.name;  // every printed name parses back
    EXPECT_EQ(back, w.dt) << w.name;
  }
  DType d = DType::F32;
  for (const char* s : {"fp32", "float32", "bfloat16", "int32", "int64"}) EXPECT_TRUE(parse_dtype(s, &d)) << s;
  EXPECT_EQ(d, DType::I64);
  for (const char* s : {"", "fp16", "i8", "int", "I32", "uint64"}) EXPECT_FALSE(parse_dtype(s, &d)) << s;
}

TEST(Tensor, HoldsIntegersWithCheckedAccess) {
  Tensor ids = Tensor::empty({2, 3}, DType::I32, MemCategory::Activations);
  EXPECT_EQ(ids.nbytes(), 6u * 4);
  for (int i = 0; i < 6; ++i) ids.i32()[i] = 50000 + i;
  // A view starts at its element, counted in the tensor's own element size.
  EXPECT_EQ(ids.view(4, {2}).i32()[1], 50005);
  Tensor bytes = Tensor::zeros({3}, DType::I64, MemCategory::Workspace);
  EXPECT_EQ(bytes.nbytes(), 3u * 8);
  EXPECT_EQ(bytes.i64()[2], 0);
  bytes.i64()[1] = (int64_t{1} << 53) + 1;  // not a float: every bit kept
  EXPECT_EQ(bytes.view(1, {2}).i64()[0], (int64_t{1} << 53) + 1);
  // The wrong accessor names both types.
  try {
    (void)ids.f32();
    FAIL() << "f32() of an i32 tensor";
  } catch (const std::logic_error& e) {
    EXPECT_NE(std::string(e.what()).find("i32"), std::string::npos) << e.what();
  }
  EXPECT_THROW((void)ids.i64(), std::logic_error);
  EXPECT_THROW((void)bytes.i32(), std::logic_error);
  EXPECT_THROW((void)Tensor::empty({1}, DType::F32, MemCategory::Workspace).i32(), std::logic_error);
}

}  // namespace
}  // namespace mt
