// The CPU backend's kernel table of one instruction-set variant (kernels/cpu/isa.h): the functions
// of kernels/cpu/*.h as this variant compiled them, every op of the registry (kernels/ops.def).
// GEMMs are oneDNN's, which dispatches on the CPU itself, so both variants share them.
// cpu_isa.cpp chooses the variant.
#include "kernels/backend.h"
#include "kernels/cpu/activation.h"
#include "kernels/cpu/adamw.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/attention_block.h"
#include "kernels/cpu/embedding.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/loss.h"
#include "kernels/cpu/moe.h"
#include "kernels/cpu/norm.h"
#include "kernels/table_builder.h"

MT_CPU_VARIANT_BEGIN
namespace {
// Ops whose CPU kernel is an overload of another op's name.
constexpr OpFn<Op::rope_forward_freq> rope_forward_freq = rope_forward;
constexpr OpFn<Op::rope_backward_freq> rope_backward_freq = rope_backward;
}  // namespace

const KernelTable& isa_table() {
#define MT_TABLE_DEVICE_ Device::CPU
  static const KernelTable t =
#include "kernels/table_init.inc"
      ;
#undef MT_TABLE_DEVICE_
  return t;
}
MT_CPU_VARIANT_END
