#include "plan/auto_layout.h"

#include <stdexcept>

#include "plan/planner.h"

namespace mt::plan {

AutoLayout auto_layout(const ModelConfig& model, int world_size, int gpus_per_node, int64_t global_batch_tokens,
                       const AutoLayoutOptions& opts) {
  if (world_size < 1) throw std::invalid_argument("auto layout: world size must be >= 1, got " + std::to_string(world_size));
  if (gpus_per_node < 1)
    throw std::invalid_argument("auto layout: ranks per node must be >= 1, got " + std::to_string(gpus_per_node));
  if (global_batch_tokens < 1)
    throw std::invalid_argument("auto layout: tokens per step must be >= 1, got " + std::to_string(global_batch_tokens));
  if (opts.micro_batch < 0) throw std::invalid_argument("auto layout: micro_batch must be >= 0");
  // throws for an unknown preset, listing the known ones
  Cluster c = opts.cluster_model ? *opts.cluster_model : cluster_preset(opts.cluster);
  c.gpus = world_size;
  c.gpus_per_node = gpus_per_node;

  TrainSetup st;
  st.fp32 = opts.fp32;
  st.seq = opts.seq > 0 ? opts.seq : model.seq_len;
  st.grad_bytes = 4;    // this engine keeps fp32 gradients
  st.reduce_bytes = 4;  // and reduces them in fp32
  st.attention = AttentionImpl::Flash;  // kernels/cpu/attention.h keeps only the log-sum-exp
  st.dropout = false;
  st.bucket_bytes = 25e6;  // parallel.bucket_mb = 25 (MB of 1e6 bytes)
  st.micro_batch = opts.micro_batch;
  const int64_t step = static_cast<int64_t>(world_size) * (opts.micro_batch > 0 ? opts.micro_batch : 1);
  const int64_t seqs = (global_batch_tokens + st.seq - 1) / st.seq;
  st.global_batch = (seqs + step - 1) / step * step;

  PlanOptions po;
  po.top_k = 1;
  po.tp = 1;  // data-parallel layouts only (see auto_layout.h)
  po.pp = 1;
  po.allow_offload = false;
  // One rank has nothing to shard: the planner only knows the single-replica layout then.
  if (world_size > 1) po.strategy = opts.strategy;
  if (world_size == 1 && opts.strategy == Strategy::HybridShard)
    throw std::invalid_argument("auto layout: HYBRID_SHARD needs at least 4 ranks (2 replicas x 2 shards)");
  po.checkpointing = opts.checkpointing;
  PlanResult r;
  try {
    r = plan(model, c, st, po);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(std::string("auto layout: ") + e.what());
  }
  const Estimate& best = r.candidates.at(0);
  const Layout& l = best.layout;
  AutoLayout a;
  a.estimate = best;
  a.fits = best.fits;
  a.why = r.recommendation;
  a.global_batch = r.setup.global_batch;
  a.plan = l;
  if (world_size == 1 && opts.strategy) a.plan.strategy = *opts.strategy;
  if (l.strategy != Strategy::HybridShard) {
    // The engine's mesh replicates only for HYBRID_*: DDP and ZeRO run over dp_shard = every rank.
    a.plan.dp_replicate = 1;
    a.plan.dp_shard = l.dp();
  }
  return a;
}

}  // namespace mt::plan
