// Sharded data parallelism: ZeRO-1 (ZERO1), ZeRO-2 (SHARD_GRAD_OP), ZeRO-3 (FULL_SHARD) and the
// hybrid forms (HYBRID_SHARD, HYBRID_SHARD_ZERO2: sharded inside dp_shard, replicated across
// dp_replicate).
//
// Sharding is per unit, FSDP1 style: each unit's range of the flat buffer is padded to a multiple
// of the shard-group size N and rank r owns the r-th contiguous 1/N of every unit. A rank's shard
// buffers (fp32 master weights, gradients, AdamW moments) are the concatenation of its slices, so
// one unit's gather / reduce-scatter is a single collective on contiguous memory (docs/design.md
// explains why units and not single parameters).
//
// ZeRO-3 gathers a unit's parameters (in the compute dtype: bf16 all-gathers in mixed precision)
// just before its forward, frees them after (reshard_after_forward), gathers again before its
// backward, and reduce-scatters its gradients (fp32) right after. The next `prefetch` units are
// gathered ahead, on the shard group's communication thread, while the current one computes.
// The root units (embedding and, with tied embeddings, the head that shares its weight) stay
// gathered from their forward to their backward, like FSDP's root.
#pragma once
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "comm/process_group.h"
#include "model/transformer.h"
#include "parallel/layout/parallel_config.h"
#include "parallel/optimizer.h"

namespace mt::parallel {

struct ShardOptions {
  ShardingStrategy strategy = ShardingStrategy::FullShard;  // any but NO_SHARD
  bool reshard_after_forward = true;
  int prefetch = 1;
  // Gradient accumulation: reduce-scatter after every micro-batch (less memory) or keep unsharded
  // gradients until the last one (less communication). The cross-replica all-reduce of hybrid
  // strategies always waits for the last micro-batch.
  bool reduce_every_microbatch = true;
};

struct ShardStepStats {
  double comm_ms = 0;     // time this step's collectives ran on the communication threads
  double exposed_ms = 0;  // time the compute thread waited for them
};

class ShardedDataParallel : public UnitHooks {
 public:
  // How the model must be built for this strategy (which flat buffers it keeps, unit padding).
  static ModelStorage storage_for(ShardingStrategy s, DType compute, int shard_size);

  // `shard`: the group parameters are sharded over; `replicate`: the group across which shards are
  // replicated (size 1 unless hybrid); `norm`: the shard group's members on a communicator of
  // their own, for the gradient norm (keeps the shard group's counters to gradients and parameters).
  ShardedDataParallel(Transformer& model, std::shared_ptr<comm::ProcessGroup> shard,
                      std::shared_ptr<comm::ProcessGroup> replicate, std::shared_ptr<comm::ProcessGroup> norm,
                      ShardOptions opts, AdamWConfig adam);
  ~ShardedDataParallel() override;

  // Unit u's full fp32 values (model layout, the unit's model.unit(u).numel elements; moments may be
  // null = zero), the same on every rank: each keeps its shard (after initialisation and when
  // loading a checkpoint; call release_all() first and set the optimizer's step count after).
  void load_unit(int u, const float* weights, const float* exp_avg, const float* exp_avg_sq);
  // Collective over the shard group: unit u's full fp32 weights and moments (null = skip) on every
  // rank (checkpoints, the final sample).
  void gather_unit(int u, float* weights, float* exp_avg, float* exp_avg_sq);
  // This rank's own slice of unit u (unit_shard(u) elements at shard_rank() x unit_shard(u) of the
  // unit), without communication: read, or set (loading; then finish_owned_load() once, collective
  // over the shard group: ZeRO-1/2 rebuild their full parameters from the slices). With a compact
  // LoRA state both are collective over the shard group (each unit's adapters are split otherwise
  // than its weights: their fp32 master and moments are gathered, or summed from the slices), so
  // every rank calls them for the same units in the same order, as the checkpoint code does.
  void read_owned(int u, float* weights, float* exp_avg, float* exp_avg_sq);
  void write_owned(int u, const float* weights, const float* exp_avg, const float* exp_avg_sq);
  void finish_owned_load();
  int64_t unit_shard(int u) const;
  int shard_rank() const { return r_; }
  int replicate_rank() const { return replicate_->rank(); }
  int replicas() const { return replicate_->size(); }

  // Before each micro-batch: whether it is the last of the step (the one that synchronises).
  void begin_microbatch(bool last);
  void pre_forward(int unit) override;
  void post_forward(int unit) override;
  void pre_backward(int unit) override;
  void post_backward(int unit) override;
  void pre_weights(int unit) override;
  // After each micro-batch's backward: on the last one, waits for every reduction (and throws,
  // naming the units, if backward skipped any).
  ShardStepStats finish_backward();
  // Sum of squared gradients (own shard, summed over the shard group), each parameter's
  // contribution multiplied by weight[param index] (empty = all 1).
  double grad_norm_sq(const std::vector<double>& weight = {});
  // The device form (Strategy::grad_norm_sq_to): on a GPU, with every weight 1 and the shard group
  // of one rank, one reduction over the local gradient (the shard buffer, or the whole gradient
  // for ZeRO-1; padding holds zeros) into *norm_sq in device memory, and true; otherwise false
  // having done nothing. Several ranks would sum the local norms with one all-reduce of the device
  // value, which needs a device collective (NCCL) that this build does not have.
  bool grad_norm_sq_to(double* norm_sq, const std::vector<double>& weight);
  // AdamW on the shards, then (ZeRO-1/2) all-gathers the updated parameters. Adds its
  // communication to `stats`. norm_sq (device memory, from grad_norm_sq_to; may be null): the
  // clipping scale comes from it on the device where the norm exceeds clip_max.
  void optimizer_step(double lr, float grad_scale, ShardStepStats* stats, const double* norm_sq = nullptr,
                      double clip_max = 0.0);
  // Frees every gathered unit (after an eval forward, at the end) and forgets the communication
  // since the last optimizer step (it was not a training step's).
  void release_all();
  // f(unit u's full weights in the compute dtype): ZeRO-3 gathers the unit for the call
  // (collective over the shard group) and frees it after; ZeRO-1/2 pass the full parameters.
  void with_full_unit(int u, const std::function<void(const void*)>& f);

  int64_t shard_elements() const { return shard_total_; }
  int max_units_gathered() const { return max_gathered_; }
  void reset_max_units_gathered() { max_gathered_ = gathered_count_; }
  AdamW& optimizer() { return *adam_; }
  ShardingStrategy strategy() const { return opts_.strategy; }
  bool params_sharded() const;
  bool grads_sharded() const;

 private:
  struct UnitState;
  void gather(int u);                 // issue (ZeRO-3)
  void ensure_gathered(int u);        // issue if needed and wait
  void release(int u);
  void ensure_grad_buffer(int u);
  void launch_reduce(int u);
  // Completes finished reductions in launch order; wait_all: all of them; until >= 0: waits up to
  // and including unit `until`'s.
  void poll(bool wait_all, int until = -1);
  void complete_reduce(int u);
  float* master_slice(int u);
  int64_t my_offset(int u) const;     // flat offset of this rank's slice of unit u

  Transformer& model_;
  std::shared_ptr<comm::ProcessGroup> shard_, replicate_, norm_group_;
  ShardOptions opts_;
  DType cd_;
  int N_, r_;
  bool tied_;
  std::vector<UnitState> units_;
  int64_t shard_total_ = 0;
  Tensor master_;      // fp32 shard of the weights (ZeRO-3 always; ZeRO-1/2 in bf16 mode); compact: of the state
  Tensor grad_shard_;  // fp32 shard of the gradients (ZeRO-2/3), in the state layout
  // LoRA with a compact state (Transformer::compact_state): gradients, moments and the fp32 master
  // cover each unit's state range (the adapters) sharded N ways; the weights - the frozen base with
  // the adapters' compute-dtype copy - are sharded as without LoRA (ZeRO-3: wshard_, in the compute
  // dtype) or kept whole (ZeRO-1/2). After each step the adapters are all-gathered into them.
  bool compact_ = false;
  int64_t state_total_ = 0;  // elements of this rank's state shard
  Tensor wshard_;            // compact ZeRO-3: this rank's slice of every unit, compute dtype
  void push_adapters();      // compact: the updated master into the weights (collective)
  // compact: unit u's whole state run (fp32 master, or a moment) on every rank (collective)
  void gather_run(int u, const Tensor& src, float* run);
  // compact: unit u's whole run from pieces each rank knows (zeros elsewhere), kept as this
  // rank's state slice of `dst` (collective: a sum over the shard group)
  void scatter_run(int u, float* run, Tensor& dst);
  std::unique_ptr<AdamW> adam_;
  bool last_micro_ = true;
  int gathered_count_ = 0, max_gathered_ = 0;
  std::vector<comm::WorkHandle> step_works_;
  std::deque<int> inflight_;  // units whose reduce-scatter runs, in launch order
  double exposed_ms_ = 0;
};

}  // namespace mt::parallel
