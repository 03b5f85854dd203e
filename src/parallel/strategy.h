// The trainer's view of a data-parallel strategy: who holds which part of the weights, gradients
// and optimizer state, and what happens between backward and the next forward.
#pragma once
#include <functional>
#include <memory>
#include <string>

#include "comm/process_group.h"
#include "model/transformer.h"
#include "parallel/layout/parallel_config.h"
#include "parallel/optimizer.h"

namespace mt::parallel {

struct StepComm {
  double comm_ms = 0;     // time the step's collectives ran (communication threads)
  double exposed_ms = 0;  // time the compute thread waited for them
};

class Strategy {
 public:
  virtual ~Strategy() = default;
  virtual const char* name() const = 0;
  virtual UnitHooks* hooks() = 0;
  // Model state moves in and out one unit at a time (checkpoints, initialisation, the final
  // sample), so no rank needs the whole model's full state at once. Buffers hold unit u's range in
  // this rank's model layout (model.unit(u).numel fp32 elements); units a pipeline rank does not
  // own (numel 0) are skipped. Loading: begin_load(), load_unit for every unit (every rank passes
  // the same values; null moments = zero), end_load(). Not collective except end_load (DDP
  // broadcasts rank 0's weights).
  virtual void begin_load() {}
  virtual void load_unit(int u, const float* w, const float* m, const float* v) = 0;
  virtual void end_load(int64_t adam_steps) = 0;
  // Unit u's fp32 weights and moments (m / v may be null); collective over the shard group when
  // the strategy shards them (every rank calls it for the same units in the same order).
  virtual void gather_unit(int u, float* w, float* m, float* v) = 0;
  // What this rank itself holds of unit u's fp32 weights and moments - the part a sharded
  // checkpoint writes and reads with no communication: the range [begin, end) of the unit's
  // elements in this rank's model layout, held identically by `replicas` ranks of which this one
  // is number `replica` (DDP: the whole unit, replicated over dp; ZeRO: the shard group rank's
  // 1/N, replicated over dp_replicate).
  struct OwnedSpan {
    int64_t begin = 0, end = 0;
    int replica = 0, replicas = 1;
  };
  virtual OwnedSpan owned_span(int u) const = 0;
  // Copies the owned range (end - begin elements) of the weights and moments (m / v may be null).
  virtual void read_owned(int u, float* w, float* m, float* v) = 0;
  // Loading only the owned ranges: begin_load(), write_owned for every unit (null moments = zero),
  // then end_load_owned (collective: ZeRO-1/2 all-gather the full parameters, DDP broadcasts rank 0's).
  virtual void write_owned(int u, const float* w, const float* m, const float* v) = 0;
  virtual void end_load_owned(int64_t adam_steps) = 0;
  virtual void begin_microbatch(bool last) = 0;
  // After each micro-batch's backward (communication of the last one finishes here).
  virtual void finish_backward(StepComm* c) = 0;
  // Squared gradient norm over the data-parallel ranks (each element counted once), each
  // parameter's part multiplied by weight[param index] (empty = 1): tensor parallelism weights
  // replicated parameters by 1/tp so that a sum over tp ranks counts them once.
  virtual double grad_norm_sq(const std::vector<double>& weight) = 0;
  virtual void optimizer_step(double lr, float grad_scale, StepComm* c) = 0;
  // The device form of grad_norm_sq and clipping, where the strategy has one (on a GPU with every
  // weight 1: DDP, and the sharded strategies on a shard group of one rank): grad_norm_sq_to queues the squared norm into *norm_sq (a double in the
  // device's memory) and returns true, or returns false having done nothing; then
  // optimizer_step_clipped clips on the device from that norm (clip_max <= 0: no clipping), so the
  // host reads nothing in between.
  virtual bool grad_norm_sq_to(double* norm_sq, const std::vector<double>& weight) { return false; }
  virtual void optimizer_step_clipped(double lr, const double* norm_sq, double clip_max, StepComm* c);
  // After a forward-only pass (eval): drop whatever it gathered.
  virtual void after_eval() {}
  // Calls f with unit u's full weights in the compute dtype (gathered for the call when the
  // strategy shards parameters: then collective over the shard group).
  virtual void with_full_unit(int u, const std::function<void(const void*)>& f) = 0;
  virtual int64_t adam_steps() const = 0;
};

struct StrategySpec {
  ShardingStrategy strategy = ShardingStrategy::NoShard;
  double bucket_mb = 25.0;
  bool reshard_after_forward = true;
  int prefetch = 1;
  bool reduce_every_microbatch = true;
  AdamWConfig adam;
};

// How to build the model for this strategy with a shard group of `shard_size` ranks.
ModelStorage model_storage(const StrategySpec& spec, DType compute, int shard_size);
// `dp`: all data-parallel ranks; `shard` / `replicate`: the hybrid split (for non-hybrid sharded
// strategies shard = dp and replicate has size 1); `norm`: the shard group's members on their own
// communicator, for gradient norms (sharded strategies only; DDP takes null).
std::unique_ptr<Strategy> make_strategy(const StrategySpec& spec, Transformer& model,
                                        std::shared_ptr<comm::ProcessGroup> dp,
                                        std::shared_ptr<comm::ProcessGroup> shard,
                                        std::shared_ptr<comm::ProcessGroup> replicate,
                                        std::shared_ptr<comm::ProcessGroup> norm = nullptr);

// Model-state bytes per rank (params, grads, optimizer) this engine keeps between steps for a
// strategy: fp32 gradients always (reduce_dtype fp32), fp32 master + two moments in the optimizer;
// in bf16 mode the params category is the bf16 compute copy. `flat` counts elements with padding.
struct StateBytes {
  int64_t params = 0, grads = 0, optimizer = 0;
  int64_t total() const { return params + grads + optimizer; }
};
StateBytes expected_state_bytes(ShardingStrategy strategy, DType compute, int64_t flat, int shard_size);
// The ZeRO paper's mixed-precision figure (bf16 params and grads, fp32 master and moments):
// DDP 16P, ZeRO-1 4P + 12P/N, ZeRO-2 2P + 14P/N, ZeRO-3 16P/N.
int64_t zero_paper_bytes(ShardingStrategy strategy, int64_t params, int shard_size);

// Collective over `group`: throws, naming the rank and what differs, unless every rank built the
// same model (parameter count, unit count and sizes).
void verify_same_model(const Transformer& model, comm::ProcessGroup& group);

}  // namespace mt::parallel
