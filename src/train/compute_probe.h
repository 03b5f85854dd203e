// The ceilings the planner's `this-cpu` model is built from, measured on this machine at a model's
// own shapes: the matmul and attention rate of the engine's kernels (one rank's share) and the
// streaming memory bandwidth. Used by `plan --validate` (one probe process per rank, all at once)
// and by `train --auto` / `plan --cluster this-cpu` (plan/cluster.h measured_cpu_cluster).
#pragma once
#include <cstdint>
#include <string>

#include "model/config/model_config.h"
#include "plan/cluster.h"

namespace mt {

struct ComputeCeiling {
  double flops_per_s = 0;   // matmul + attention FLOPs (the planner's count) per second, per rank
  double gemm_flops_per_s = 0;  // the matmuls alone
  double mem_bw = 0;        // bytes/s per rank, streaming (triad)
  // The engine's own non-matmul kernels of one micro-batch (norms, activations, residual adds,
  // casts, embedding, loss) and of the optimizer step, timed at the model's shapes: the planner's
  // byte count for that work (plan/estimate.cpp) divided by their time, i.e. the bandwidth at which
  // the planner's elementwise model reproduces what the kernels really take. 0: not measured.
  double elem_bw = 0;
  double elem_s = 0;        // that time, seconds per micro-batch + optimizer step
  int procs = 0, threads = 0;
};
// Runs in this process on the current OpenMP thread count: times the model's forward and backward
// matmuls (its exact shapes, one micro-batch, one tp rank's share when tp > 1) and its attention
// kernel (the rank's heads) for about `seconds`, and a triad over `stream_bytes`. `sp`: the layout
// runs sequence parallelism (norms and residual adds on the rank's rows, bf16 gathers' casts).
ComputeCeiling measure_compute_here(const ModelConfig& m, int64_t micro_batch, bool bf16, double seconds,
                                    double stream_bytes = 48e6, int tp = 1, bool sp = false);
// `meshtrain plan --probe-compute` (internal): measure_compute_here, printed as one JSON line.
std::string compute_probe_json(const ComputeCeiling& c);

// fp32 FMA peak of this process's OpenMP threads (independent vector FMA chains, the widest
// vector ISA the CPU has), FLOP/s; median of 3 trials of about seconds / 3.
double fma_peak_here(double seconds = 0.06);

// This rank's figures for the planner's measured this-cpu cluster (plan::measured_cpu_cluster):
// measure_compute_here at the model's shapes (~`seconds`), the FMA peak, the node's memory, and
// the CPU's description. Run it on every rank at once (the ranks share cores and memory
// bandwidth) and agree on one set of figures so they all plan alike: the slowest rank's when each
// rank has CPUs of its own (the job runs at its pace), the mean when they time-share cores.
plan::CpuMeasurement measure_this_cpu(const ModelConfig& m, int64_t micro_batch, bool bf16, int ranks_per_node,
                                      double seconds = 0.3);

}  // namespace mt
