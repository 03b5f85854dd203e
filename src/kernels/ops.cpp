// The op registry's tables (kernels/ops.def) and the ops a run needs.
#include "kernels/ops.h"

#include <array>
#include <stdexcept>

#include "kernels/backend.h"

namespace mt::kernels {

namespace {

constexpr std::array<OpInfo, kNumOps> kOps = {{
#define MT_OP(name, flags, dtypes, needs, ret, params) {#name, flags, dtypes, needs, #ret " " #name #params},
#include "kernels/ops.def"
#undef MT_OP
}};

// The run features as OpNeed bits (GPT-2 is "not Llama").
uint32_t feature_bits(const RunFeatures& f) {
  uint32_t b = f.llama ? kNeedLlama : kNeedGpt2;
  if (f.rope_scaled) b |= kNeedRopeScaled;
  if (f.bf16) b |= kNeedBf16;
  if (f.tensor_parallel) b |= kNeedTp;
  if (f.sequence_parallel) b |= kNeedSp;
  if (f.context_parallel) b |= kNeedCp;
  if (f.moe) b |= kNeedMoe;
  return b;
}

// What in a configuration makes a run need an op with these bits (the most specific feature).
const char* need_reason(uint32_t needs) {
  if (needs & kNeedMoe) return "mixture of experts (model.moe_experts > 0)";
  if (needs & kNeedCp) return "context parallelism (parallel.cp > 1)";
  if (needs & kNeedSp) return "sequence parallelism (parallel.sequence_parallel)";
  if (needs & kNeedTp) return "tensor parallelism (parallel.tp > 1)";
  if (needs & kNeedBf16) return "bf16 compute (train.dtype = bf16)";
  if (needs & kNeedRopeScaled) return "scaled rotary embedding (Llama 3.1 rope_scaling)";
  if (needs & kNeedLlama) return "the Llama architecture";
  if (needs & kNeedGpt2) return "the GPT-2 architecture";
  return "every training run";
}

}  // namespace

const OpInfo& op_info(Op op) { return kOps[static_cast<size_t>(op)]; }

std::optional<Op> find_op(std::string_view name) {
  for (int i = 0; i < kNumOps; ++i)
    if (name == kOps[static_cast<size_t>(i)].name) return op_at(i);
  return std::nullopt;
}

std::vector<Op> ops_needed(const RunFeatures& f) {
  const uint32_t have = feature_bits(f);
  std::vector<Op> ops;
  for (int i = 0; i < kNumOps; ++i)
    if ((kOps[static_cast<size_t>(i)].needs & ~have) == 0) ops.push_back(op_at(i));
  return ops;
}

std::string unsupported_need(const KernelTable& t, const RunFeatures& f) {
  for (Op op : ops_needed(f)) {
    if (t.supports(op)) continue;
    const OpInfo& info = op_info(op);
    return std::string("device ") + device_name(t.device) + " has no kernel for " + info.name + ", which " +
           need_reason(info.needs) + " needs; run it with train.device = cpu or without that feature " +
           "(`meshtrain check-ops --device " + device_name(t.device) + " --list` lists what the device supports)";
  }
  return "";
}

void require_ops(const std::string& device, const RunFeatures& f) {
  Device d = Device::CPU;
  if (!parse_device(device, &d) || (d == Device::CUDA && !cuda_built())) return;
  const std::string why = unsupported_need(table(d), f);
  if (!why.empty()) throw std::runtime_error(why);
}

}  // namespace mt::kernels
