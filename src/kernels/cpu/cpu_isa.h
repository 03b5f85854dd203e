// Which instruction-set level the CPU backend runs at, chosen at run time: the CPU's features
// (cpuid, and the operating system's XSAVE state for the wide registers), optionally capped by
// the environment variable MESHTRAIN_CPU_ISA = avx2 | avx512 | avx512_bf16 | amx_bf16 (to compare
// paths or to reproduce another machine's arithmetic). The level picks the variant of meshtrain's
// own kernels (kernels/cpu/isa.h: avx2 or avx512) and caps oneDNN's GEMMs (dnnl_set_max_cpu_isa),
// so both follow one knob. A cap above what the CPU has is refused with the missing feature named.
#pragma once
#include <string>
#include <string_view>

#include "kernels/cpu/isa.h"

MT_CPU_NS_BEGIN
MT_CPU_NS_END

namespace mt::kernels {
struct KernelTable;
}

namespace mt::kernels::cpu {

// Ordered: each level includes the ones before it.
enum class CpuIsa { AVX2 = 0, AVX512 = 1, AVX512_BF16 = 2, AMX_BF16 = 3 };

const char* isa_name(CpuIsa isa);  // "avx2", "avx512", "avx512_bf16", "amx_bf16"
// Parses a level name (as isa_name); throws std::invalid_argument naming the valid ones.
CpuIsa parse_isa(std::string_view name);

struct CpuFeatures {
  std::string vendor, model;  // cpuid vendor and brand strings
  int family = 0, model_id = 0;
  bool avx2 = false, fma = false, f16c = false;
  bool avx512f = false, avx512bw = false, avx512dq = false, avx512vl = false, avx512cd = false;
  bool avx512bf16 = false, amx_tile = false, amx_bf16 = false;
  bool os_avx = false, os_avx512 = false, os_amx = false;  // XCR0 state enabled by the kernel
};
const CpuFeatures& cpu_features();
// The highest level this CPU (and its OS) supports.
CpuIsa detected_isa();
// What the CPU lacks for `isa` (e.g. "avx512bf16"), empty when it has everything.
std::string missing_for(CpuIsa isa);
// The level in force: detected_isa() or the MESHTRAIN_CPU_ISA cap. The first call applies the cap
// to oneDNN; it throws std::runtime_error for an unknown value or one the CPU cannot run.
CpuIsa active_isa();
// The kernel variant a level runs ("avx2" or "avx512").
const char* kernel_variant(CpuIsa isa);
// The kernel table of a level's variant; throws if the CPU cannot run it.
const KernelTable& table_for(CpuIsa isa);
// oneDNN's effective ISA as a name ("avx2", "avx512_core_bf16", ...).
std::string onednn_isa();
// One line for run headers and benchmarks: "cpu AMD EPYC 9B14 (family 25 model 17), isa
// avx512_bf16, kernels avx512, oneDNN avx512_core_bf16" (", bf16 GEMMs on AMX tiles" when
// meshtrain's AMX GEMM serves them).
std::string isa_summary();

}  // namespace mt::kernels::cpu

namespace mt::kernels::cpu::avx512 {
const KernelTable& isa_table();
}
namespace mt::kernels::cpu::base {
const KernelTable& isa_table();
}
