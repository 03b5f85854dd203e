// The CPU backend is compiled once per instruction-set level (ggml's and PyTorch's CPU_CAPABILITY
// scheme): the kernels of activation, adamw, attention, embedding, loss, norm and the table are
// built for the baseline every supported server CPU has (x86-64-v3: AVX2, FMA, F16C; Zen 3 and
// newer, Intel Haswell and newer) and a second time for AVX-512 (F, BW, DQ, VL, CD and BF16:
// Zen 4/5, Intel Ice Lake / Sapphire Rapids and newer). cpu_isa.cpp picks one at run time.
//
// A variant's code lives in its own inline namespace (mt::kernels::cpu::base / ::avx512), so
// callers write kernels::cpu::gelu_forward and get the baseline, while the two variants' symbols
// never collide. The wider instructions are enabled with `#pragma GCC target` around a variant's
// function definitions only, never with a command-line -m flag: the standard library's templates
// and the inline helpers of vecmath.h are then instantiated for the baseline in every object (the
// linker may keep any one copy of them, and a copy with AVX-512 instructions would break AVX2
// machines), while the variant's loops, and the helpers inlined into them, get the wide
// instructions. tests/kernels/isa_test.cpp checks the binary for AVX-512 instructions outside the
// avx512 namespace.
//
// Usage in a kernel source: include every header first, then
//   MT_CPU_VARIANT_BEGIN   ... definitions ...   MT_CPU_VARIANT_END
// and in a kernel header:  MT_CPU_NS_BEGIN ... declarations ... MT_CPU_NS_END
#pragma once

#if defined(MT_CPU_VARIANT_AVX512)
#define MT_CPU_ISA avx512
#define MT_CPU_TARGET_PUSH                                                                            \
  _Pragma("GCC push_options")                                                                         \
      _Pragma("GCC target(\"avx512f,avx512bw,avx512dq,avx512vl,avx512cd,avx512bf16,prefer-vector-width=512\")")
#define MT_CPU_TARGET_POP _Pragma("GCC pop_options")
#else
#define MT_CPU_ISA base
#define MT_CPU_TARGET_PUSH
#define MT_CPU_TARGET_POP
#endif

#define MT_CPU_NS_BEGIN                \
  namespace mt::kernels::cpu {         \
  inline namespace MT_CPU_ISA {
#define MT_CPU_NS_END \
  }                   \
  }

#define MT_CPU_VARIANT_BEGIN MT_CPU_TARGET_PUSH MT_CPU_NS_BEGIN
#define MT_CPU_VARIANT_END MT_CPU_NS_END MT_CPU_TARGET_POP
