// Run-time choice of the CPU backend's instruction-set level (see cpu_isa.h). Compiled for the
// baseline only.
#include "kernels/cpu/cpu_isa.h"

#include <cpuid.h>

#include <array>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <oneapi/dnnl/dnnl.hpp>
#include <stdexcept>
#include <string_view>

#include "kernels/backend.h"
#include "kernels/cpu/gemm_internal.h"

namespace mt::kernels::cpu {

namespace {

constexpr std::array<const char*, 4> kNames = {"avx2", "avx512", "avx512_bf16", "amx_bf16"};

uint64_t xgetbv0() {
  uint32_t lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

CpuFeatures detect() {
  CpuFeatures f;
  unsigned a, b, c, d;
  if (!__get_cpuid(0, &a, &b, &c, &d)) return f;
  const unsigned max_leaf = a;
  char vendor[13] = {};
  std::memcpy(vendor, &b, 4);
  std::memcpy(vendor + 4, &d, 4);
  std::memcpy(vendor + 8, &c, 4);
  f.vendor = vendor;
  __cpuid(1, a, b, c, d);
  const unsigned base_family = (a >> 8) & 0xf, ext_family = (a >> 20) & 0xff;
  const unsigned base_model = (a >> 4) & 0xf, ext_model = (a >> 16) & 0xf;
  f.family = static_cast<int>(base_family == 0xf ? base_family + ext_family : base_family);
  f.model_id = static_cast<int>((base_family == 0xf || base_family == 0x6) ? (ext_model << 4) + base_model : base_model);
  f.fma = (c >> 12) & 1;
  f.f16c = (c >> 29) & 1;
  const bool osxsave = (c >> 27) & 1, avx = (c >> 28) & 1;
  if (osxsave) {
    const uint64_t xcr0 = xgetbv0();
    f.os_avx = avx && (xcr0 & 0x6) == 0x6;                     // XMM and YMM state
    f.os_avx512 = f.os_avx && (xcr0 & 0xe0) == 0xe0;           // opmask, ZMM_Hi256, Hi16_ZMM
    f.os_amx = (xcr0 & 0x60000) == 0x60000;                    // XTILECFG, XTILEDATA (permitted per process)
  }
  if (max_leaf >= 7) {
    __cpuid_count(7, 0, a, b, c, d);
    f.avx2 = (b >> 5) & 1;
    f.avx512f = (b >> 16) & 1;
    f.avx512dq = (b >> 17) & 1;
    f.avx512cd = (b >> 28) & 1;
    f.avx512bw = (b >> 30) & 1;
    f.avx512vl = (b >> 31) & 1;
    f.amx_bf16 = (d >> 22) & 1;
    f.amx_tile = (d >> 24) & 1;
    const unsigned max_sub = a;
    if (max_sub >= 1) {
      __cpuid_count(7, 1, a, b, c, d);
      f.avx512bf16 = (a >> 5) & 1;
    }
  }
  __cpuid(0x80000000, a, b, c, d);
  if (a >= 0x80000004) {
    char brand[49] = {};
    for (unsigned i = 0; i < 3; ++i) {
      __cpuid(0x80000002 + i, a, b, c, d);
      std::memcpy(brand + 16 * i, &a, 4);
      std::memcpy(brand + 16 * i + 4, &b, 4);
      std::memcpy(brand + 16 * i + 8, &c, 4);
      std::memcpy(brand + 16 * i + 12, &d, 4);
    }
    std::string s = brand;
    const size_t first = s.find_first_not_of(' '), last = s.find_last_not_of(' ');
    f.model = first == std::string::npos ? "" : s.substr(first, last - first + 1);
  }
  return f;
}

dnnl::cpu_isa onednn_cap(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::AVX2: return dnnl::cpu_isa::avx2;
    case CpuIsa::AVX512: return dnnl::cpu_isa::avx512_core_vnni;
    case CpuIsa::AVX512_BF16: return dnnl::cpu_isa::avx512_core_bf16;
    case CpuIsa::AMX_BF16: return dnnl::cpu_isa::all;
  }
  return dnnl::cpu_isa::all;
}

CpuIsa choose_active() {
  // MESHTRAIN_AMX_GEMM (amx_gemm.cpp) is read at the first bf16 GEMM; a wrong value is refused
  // here, at start-up, with the level cap's other errors.
  (void)detail::amx_gemm_env();
  CpuIsa isa = detected_isa();
  if (const char* env = std::getenv("MESHTRAIN_CPU_ISA"); env && *env) {
    const CpuIsa want = parse_isa(env);
    const std::string miss = missing_for(want);
    if (!miss.empty()) {
      const CpuFeatures& f = cpu_features();
      throw std::runtime_error(std::string("meshtrain: MESHTRAIN_CPU_ISA=") + env + " but this CPU (" +
                               (f.model.empty() ? f.vendor : f.model) + ") lacks " + miss);
    }
    isa = want;
  }
  if (isa != detected_isa()) {
    // Only possible before oneDNN first looks at the CPU: the first GEMM calls active_isa().
    if (dnnl::set_max_cpu_isa(onednn_cap(isa)) != dnnl::status::success) {
      throw std::runtime_error(std::string("meshtrain: could not cap oneDNN at ") + isa_name(isa) +
                               " (set MESHTRAIN_CPU_ISA before the first kernel runs)");
    }
  }
  return isa;
}

}  // namespace

const char* isa_name(CpuIsa isa) { return kNames[static_cast<size_t>(isa)]; }

CpuIsa parse_isa(std::string_view name) {
  for (size_t i = 0; i < kNames.size(); ++i)
    if (name == kNames[i]) return static_cast<CpuIsa>(i);
  throw std::invalid_argument("meshtrain: unknown CPU ISA level '" + std::string(name) +
                              "' (expected avx2, avx512, avx512_bf16 or amx_bf16)");
}

const CpuFeatures& cpu_features() {
  static const CpuFeatures f = detect();
  return f;
}

std::string missing_for(CpuIsa isa) {
  const CpuFeatures& f = cpu_features();
  std::string miss;
  auto need = [&](bool have, const char* what) {
    if (!have) miss += (miss.empty() ? "" : ", ") + std::string(what);
  };
  need(f.avx2, "avx2");
  need(f.fma, "fma");
  need(f.f16c, "f16c");
  need(f.os_avx, "OS support for AVX state");
  if (isa >= CpuIsa::AVX512) {
    need(f.avx512f, "avx512f");
    need(f.avx512bw, "avx512bw");
    need(f.avx512dq, "avx512dq");
    need(f.avx512vl, "avx512vl");
    need(f.avx512cd, "avx512cd");
    need(f.os_avx512, "OS support for AVX-512 state");
  }
  if (isa >= CpuIsa::AVX512_BF16) need(f.avx512bf16, "avx512_bf16");
  if (isa >= CpuIsa::AMX_BF16) {
    need(f.amx_tile, "amx_tile");
    need(f.amx_bf16, "amx_bf16");
  }
  return miss;
}

CpuIsa detected_isa() {
  static const CpuIsa best = [] {
    CpuIsa b = CpuIsa::AVX2;
    for (CpuIsa i : {CpuIsa::AVX512, CpuIsa::AVX512_BF16, CpuIsa::AMX_BF16})
      if (missing_for(i).empty()) b = i;
    return b;
  }();
  return best;
}

CpuIsa active_isa() {
  static const CpuIsa isa = choose_active();
  return isa;
}

const char* kernel_variant(CpuIsa isa) { return isa >= CpuIsa::AVX512 ? "avx512" : "avx2"; }

const KernelTable& table_for(CpuIsa isa) {
  const std::string miss = missing_for(isa);
  if (!miss.empty())
    throw std::runtime_error(std::string("meshtrain: the ") + isa_name(isa) + " kernels need " + miss +
                             ", which this CPU lacks");
  return isa >= CpuIsa::AVX512 ? avx512::isa_table() : base::isa_table();
}

std::string onednn_isa() {
  switch (dnnl::get_effective_cpu_isa()) {
    case dnnl::cpu_isa::sse41: return "sse41";
    case dnnl::cpu_isa::avx: return "avx";
    case dnnl::cpu_isa::avx2: return "avx2";
    case dnnl::cpu_isa::avx2_vnni: return "avx2_vnni";
    case dnnl::cpu_isa::avx512_core: return "avx512_core";
    case dnnl::cpu_isa::avx512_core_vnni: return "avx512_core_vnni";
    case dnnl::cpu_isa::avx512_core_bf16: return "avx512_core_bf16";
    case dnnl::cpu_isa::avx512_core_amx: return "avx512_core_amx";
    default: return "other";
  }
}

std::string isa_summary() {
  const CpuFeatures& f = cpu_features();
  const CpuIsa isa = active_isa();
  std::string s = "cpu " + (f.model.empty() ? f.vendor : f.model) + " (family " + std::to_string(f.family) +
                  " model " + std::to_string(f.model_id) + "), isa " + isa_name(isa);
  if (isa != detected_isa()) s += std::string(" (capped; the CPU has ") + isa_name(detected_isa()) + ")";
  s += std::string(", kernels ") + kernel_variant(isa) + ", oneDNN " + onednn_isa();
  if (detail::amx_gemm_ready()) s += ", bf16 GEMMs on AMX tiles";
  return s;
}

const KernelTable& cpu_table() {
  static const KernelTable& t = table_for(active_isa());
  return t;
}

}  // namespace mt::kernels::cpu
