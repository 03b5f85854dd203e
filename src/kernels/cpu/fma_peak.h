// The CPU's fp32 FMA peak: what no GEMM, and so no engine performing a model's FLOPs, can exceed.
// Used by the planner's measured this-cpu (train/compute_probe.cpp) and bench/kernel_bench.
#pragma once

namespace mt::kernels::cpu {

// FLOP/s of `threads` OpenMP threads (0: omp_get_max_threads()) each running 12 independent
// chains of vector FMAs (latency x two FMA pipes) with the widest vector this CPU's active level
// has (AVX-512 from MESHTRAIN_CPU_ISA=avx512 up, else AVX2+FMA): the median of `trials` trials of
// about `seconds` each (a short calibration run first).
double fma_peak(int threads, double seconds, int trials);

// Whether fma_peak uses 512-bit vectors here.
bool fma_peak_uses_avx512();

}  // namespace mt::kernels::cpu
