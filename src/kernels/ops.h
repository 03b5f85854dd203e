// The op registry (kernels/ops.def): every kernel-table op by enum and name, what the registry says
// about it, and which ops a run needs, so that a run a device cannot serve is refused before it
// starts (ggml's supports_op). Each backend's table answers supports(op) (kernels/backend.h).
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/device.h"
#include "runtime/dtype.h"

namespace mt::kernels {

struct KernelTable;

// One tensor of a multi-tensor AdamW update (adamw_update_multi): n elements of param, grad, m and
// v (the device's memory), param_bf16 (may be null) the bf16 copy refreshed in the same pass.
struct AdamWTensor {
  float* param = nullptr;
  const float* grad = nullptr;
  float* m = nullptr;
  float* v = nullptr;
  bf16* param_bf16 = nullptr;
  int64_t n = 0;
  float weight_decay = 0.0f;
};

// Registry bits (their meaning: kernels/ops.def).
enum OpFlag : uint32_t { kAccumulates = 1u << 0, kHostResult = 1u << 1 };
enum OpDtype : uint32_t { kF32 = 1u << 0, kBF16 = 1u << 1 };
enum OpNeed : uint32_t {
  kNeedGpt2 = 1u << 0,
  kNeedLlama = 1u << 1,
  kNeedRopeScaled = 1u << 2,
  kNeedBf16 = 1u << 3,
  kNeedTp = 1u << 4,
  kNeedSp = 1u << 5,
  kNeedCp = 1u << 6,
  kNeedMoe = 1u << 7,
};

enum class Op : uint16_t {
#define MT_OP(name, flags, dtypes, needs, ret, params) name,
#include "kernels/ops.def"
#undef MT_OP
};
inline constexpr int kNumOps = 0
#define MT_OP(name, flags, dtypes, needs, ret, params) +1
#include "kernels/ops.def"
#undef MT_OP
    ;

// The function-pointer type of an op's table entry, and its name.
template <Op O>
struct OpSignature;
#define MT_OP(name, flags, dtypes, needs, ret, params) \
  template <>                                          \
  struct OpSignature<Op::name> {                       \
    using Fn = ret(*) params;                          \
    static constexpr const char* kName = #name;        \
  };
#include "kernels/ops.def"
#undef MT_OP
template <Op O>
using OpFn = typename OpSignature<O>::Fn;

struct OpInfo {
  const char* name;
  uint32_t flags;         // OpFlag bits
  uint32_t dtypes;        // OpDtype bits
  uint32_t needs;         // OpNeed bits
  const char* signature;  // "void gelu_forward(float* out, const float* inp, int64_t n)"
};
const OpInfo& op_info(Op op);
inline const char* op_name(Op op) { return op_info(op).name; }
inline Op op_at(int i) { return static_cast<Op>(i); }  // 0 <= i < kNumOps, in ops.def order
// The op of a name ("gelu_forward"), or none.
std::optional<Op> find_op(std::string_view name);

// What a run uses, as plain flags (the trainer fills them from its configuration).
struct RunFeatures {
  bool llama = false;  // the Llama architecture (else GPT-2)
  bool rope_scaled = false;
  bool bf16 = false;
  bool tensor_parallel = false;
  bool sequence_parallel = false;
  bool context_parallel = false;
  bool moe = false;
};
// The ops the engine may call in such a run (a superset where a choice is made at run time).
std::vector<Op> ops_needed(const RunFeatures& f);
// Empty when table t supports every op f needs; else one line naming the first op it lacks, the
// device, the feature that needs it and what to do.
std::string unsupported_need(const KernelTable& t, const RunFeatures& f);
// Throws std::runtime_error with unsupported_need's line when device `device` (a train.device name)
// cannot serve the run. Devices whose kernels are not in this build are left to the device check.
void require_ops(const std::string& device, const RunFeatures& f);

}  // namespace mt::kernels
