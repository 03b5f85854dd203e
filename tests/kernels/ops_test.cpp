// The op registry (kernels/ops.def, ops.h): names and lookup, the ops a run needs, and a run refused
// before it starts when its device lacks one of them.
#include "kernels/ops.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/backend.h"

namespace mt::kernels {
namespace {

bool has(const std::vector<Op>& v, Op op) { return std::find(v.begin(), v.end(), op) != v.end(); }

TEST(OpRegistry, NamesAreUniqueAndFoundAgain) {
  EXPECT_EQ(kNumOps, 73);
  std::set<std::string> names;
  for (int i = 0; i < kNumOps; ++i) {
    const OpInfo& info = op_info(op_at(i));
    EXPECT_TRUE(names.insert(info.name).second) << info.name;
    EXPECT_EQ(find_op(info.name), op_at(i)) << info.name;
    EXPECT_NE(info.dtypes, 0u) << info.name;
    // The signature as written in ops.def: return type, name, parameters.
    EXPECT_NE(std::string(info.signature).find(std::string(" ") + info.name + "("), std::string::npos)
        << info.signature;
  }
  EXPECT_EQ(find_op("gelu_forwardx"), std::nullopt);
  EXPECT_EQ(find_op(""), std::nullopt);
  EXPECT_STREQ(op_info(Op::adamw_update).signature,
               "void adamw_update(float* param, const float* grad, float* m, float* v, int64_t n, float lr, "
               "float beta1, float beta2, float eps, float weight_decay, int64_t step, float grad_scale, "
               "bf16* param_bf16)");
  EXPECT_TRUE(op_info(Op::layernorm_backward).flags & kAccumulates);
  EXPECT_FALSE(op_info(Op::moe_router_backward).flags & kAccumulates);  // it writes dlogits
  EXPECT_TRUE(op_info(Op::sum).flags & kHostResult);
  EXPECT_EQ(op_info(Op::vocab_embedding_forward).dtypes, kF32 | kBF16);
}

TEST(OpRegistry, OpsNeededFollowTheRunsFeatures) {
  const std::vector<Op> gpt2 = ops_needed({});
  for (Op op : {Op::gelu_forward, Op::layernorm_backward, Op::position_add_forward, Op::linear_backward,
                Op::attention_backward, Op::softmax_cross_entropy, Op::adamw_update, Op::sum_squares})
    EXPECT_TRUE(has(gpt2, op)) << op_name(op);
  for (Op op :
       {Op::swiglu_forward, Op::rmsnorm_forward, Op::rope_forward, Op::linear_forward_bf16, Op::cast_f32_to_bf16,
        Op::vp_ce_stats, Op::attention_block_forward, Op::moe_combine, Op::position_add_rows, Op::rope_forward_freq})
    EXPECT_FALSE(has(gpt2, op)) << op_name(op);

  const std::vector<Op> llama_cp = ops_needed({.llama = true, .context_parallel = true});
  for (Op op : {Op::swiglu_backward, Op::rmsnorm_backward, Op::rope_forward, Op::attention_block_backward,
                Op::rope_backward_pos, Op::add_columns, Op::copy_columns})
    EXPECT_TRUE(has(llama_cp, op)) << op_name(op);
  for (Op op : {Op::gelu_forward, Op::position_add_pos, Op::rope_forward_freq, Op::moe_router_forward})
    EXPECT_FALSE(has(llama_cp, op)) << op_name(op);

  // Llama's bf16 MLP with bf16 gate and up: bf16 Llama runs only.
  const std::vector<Op> llama_bf16 = ops_needed({.llama = true, .bf16 = true});
  for (Op op : {Op::swiglu_forward_bf16, Op::swiglu_backward_bf16, Op::linear_forward_bf16_out16})
    EXPECT_TRUE(has(llama_bf16, op)) << op_name(op);
  for (Op op : {Op::swiglu_forward_bf16, Op::swiglu_backward_bf16})
    EXPECT_FALSE(has(llama_cp, op)) << op_name(op);

  const std::vector<Op> every = ops_needed({.rope_scaled = true,
                                            .bf16 = true,
                                            .tensor_parallel = true,
                                            .sequence_parallel = true,
                                            .context_parallel = true,
                                            .moe = true});
  for (Op op : {Op::linear_backward_bf16_dy, Op::softmax_cross_entropy_bf16, Op::vp_ce_finish, Op::position_add_rows,
                Op::position_backward_pos, Op::moe_gather_rows, Op::add_bias})
    EXPECT_TRUE(has(every, op)) << op_name(op);
  // GPT-2 with every feature needs everything but the Llama-only ops.
  for (int i = 0; i < kNumOps; ++i)
    EXPECT_EQ(has(every, op_at(i)), !(op_info(op_at(i)).needs & kNeedLlama)) << op_name(op_at(i));
}

TEST(OpRegistry, AMissingOpIsNamedWithItsDeviceAndFeature) {
  KernelTable t = table(Device::CPU);
  EXPECT_EQ(unsupported_need(t, {.bf16 = true, .context_parallel = true, .moe = true}), "");
  t.supported[static_cast<size_t>(Op::moe_combine)] = false;
  EXPECT_EQ(unsupported_need(t, {.context_parallel = true}), "");  // a dense run does not need it
  const std::string why = unsupported_need(t, {.moe = true});
  EXPECT_NE(why.find("device cpu has no kernel for moe_combine"), std::string::npos) << why;
  EXPECT_NE(why.find("mixture of experts (model.moe_experts > 0)"), std::string::npos) << why;
  EXPECT_EQ(why.find('\n'), std::string::npos) << "one line";
  EXPECT_NO_THROW(require_ops("cpu", {.llama = true, .bf16 = true, .tensor_parallel = true, .moe = true}));
  EXPECT_NO_THROW(require_ops("meta", {.moe = true}));
}

TEST(OpRegistry, CudaSupportsRunsWithEveryFeature) {
  if (!cuda_built()) {
    EXPECT_NO_THROW(require_ops("cuda", {.moe = true})) << "no CUDA table to ask: the device check says why";
    GTEST_SKIP() << "built without the CUDA backend";
  }
  EXPECT_NO_THROW(require_ops("cuda", {.llama = true, .rope_scaled = true, .bf16 = true, .tensor_parallel = true,
                                       .sequence_parallel = true, .context_parallel = true, .moe = true}));
  EXPECT_NO_THROW(require_ops("cuda", {.bf16 = true, .tensor_parallel = true, .sequence_parallel = true,
                                       .context_parallel = true, .moe = true}));
}

}  // namespace
}  // namespace mt::kernels
