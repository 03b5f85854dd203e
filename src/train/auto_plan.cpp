#include "train/auto_plan.h"

#include <omp.h>

#include <algorithm>
#include <cstdio>
#include <thread>

#include "comm/world.h"
#include "plan/auto_layout.h"
#include "train/compute_probe.h"

namespace mt {

int hardware_threads() {
  unsigned hc = std::thread::hardware_concurrency();
  return hc == 0 ? 1 : static_cast<int>(hc);
}

// The planner picks the data-parallel layout for this job's ranks (same global batch).
void choose_layout(RunConfig& cfg) {
  comm::World& W = comm::World::init(nullptr, nullptr);
  const ModelConfig mc = cfg.model_config();
  plan::AutoLayoutOptions o;
  o.fp32 = cfg.train.dtype != "bf16";
  const int64_t tokens = cfg.train.micro_batch * cfg.train.grad_accum * mc.seq_len * W.size();
  // The planner's picture of this machine comes from this machine: every rank measures the
  // engine's kernels at the model's shapes on the threads it will train with, all at once (they
  // share the cores and the memory bandwidth), and the ranks agree on one set of figures (below).
  {
    const int threads = cfg.train.threads > 0 ? static_cast<int>(cfg.train.threads)
                                              : std::max(1, hardware_threads() / W.local_size());
    const int before = omp_get_max_threads();
    omp_set_num_threads(threads);
    plan::CpuMeasurement cm = measure_this_cpu(mc, std::max<int64_t>(1, cfg.train.micro_batch), !o.fp32, W.local_size());
    omp_set_num_threads(before);
    if (W.size() > 1) {
      // The same figures on every rank, so all choose the same layout. With each rank on CPUs of
      // its own, the slowest rank's (the largest reciprocal): every collective waits for it, so
      // the job runs at its pace. Ranks that time-share cores even out: the mean.
      const bool own_cpus = static_cast<int64_t>(W.local_size()) * threads <= hardware_threads();
      float f[4] = {static_cast<float>(cm.model_flops), static_cast<float>(cm.mem_bw),
                    static_cast<float>(cm.peak_flops_fp32), static_cast<float>(cm.peak_flops_bf16)};
      if (own_cpus)
        for (float& v : f) v = 1.0f / v;
      W.world()->all_reduce(f, 4, DType::F32, own_cpus ? comm::ReduceOp::Max : comm::ReduceOp::Avg)->wait();
      if (own_cpus)
        for (float& v : f) v = 1.0f / v;
      cm.model_flops = f[0], cm.mem_bw = f[1], cm.peak_flops_fp32 = f[2], cm.peak_flops_bf16 = f[3];
    }
    o.cluster_model = plan::measured_cpu_cluster(cm);
  }
  plan::AutoLayout a = plan::auto_layout(mc, W.size(), W.local_size(), tokens, o);
  cfg.set_parallel_plan(a.plan);
  if (comm::should_print(W.rank()))
    std::printf("--auto: %s dp_replicate %d x dp_shard %d, activation checkpointing %s, micro-batch %lld x %lld%s\n"
                "        %s\n",
                to_string(a.plan.strategy), a.plan.dp_replicate, a.plan.dp_shard, to_string(a.plan.checkpointing),
                static_cast<long long>(a.plan.micro_batch), static_cast<long long>(a.plan.microbatches),
                a.fits ? "" : " (nothing fits: the closest layout)", a.why.c_str());
}

}  // namespace mt
