// The kernel table: every op the model, the strategies and the optimizer run on tensor data, one
// table per device (ggml's backend interface, llm.c's kernel signatures). Callers pick the table of
// the device their tensors live on (`kernels::table(d)`) and never include a backend's headers.
//
// The ops are declared once, in kernels/ops.def (signature, dtypes, whether it adds into its
// outputs, which runs need it, the contract); the table's members and every backend's table are
// generated from that list (kernels/table_builder.h). A backend without a kernel for an op says so
// through supports(op); its entry is then a function that throws the registry's error, never null.
// tests/kernels/backend_test.cpp checks every table against the registry, and `meshtrain
// check-ops` (kernels/conformance/) runs every supported op of a device against the CPU baseline.
#pragma once
#include <array>
#include <cstdint>
#include <string>

#include "kernels/ops.h"
#include "runtime/device.h"
#include "runtime/dtype.h"

namespace mt::kernels {

struct KernelTable {
  Device device;
  std::array<bool, kNumOps> supported;  // by Op; read through supports()
#define MT_OP(name, flags, dtypes, needs, ret, params) ret(*name) params;
#include "kernels/ops.def"
#undef MT_OP

  bool supports(Op op) const { return supported[static_cast<size_t>(op)]; }
};

// The table of device d. For Device::CUDA in a build without the CUDA backend this throws an error
// saying so; in a CUDA build it returns the table even without a GPU (its kernels then throw the
// device's "no usable CUDA device" error on first use).
const KernelTable& table(Device d);
// One line naming what runs device d's kernels (for run headers and benchmarks), e.g. "cpu AMD
// EPYC 9B14 (family 25 model 17), isa avx512_bf16, kernels avx512, oneDNN avx512_core_bf16".
std::string describe(Device d);

namespace cpu {
const KernelTable& cpu_table();
}
namespace meta {
const KernelTable& meta_table();
}
namespace cuda {  // defined only in CUDA builds (kernels/cuda/)
const KernelTable& cuda_table();
}

}  // namespace mt::kernels
