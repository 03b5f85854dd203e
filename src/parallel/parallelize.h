// parallelize(): a parallel plan applied to one rank's model. It builds the model in the plan's
// storage (this rank's pipeline stages, tensor-parallel slices, local experts, what the strategy
// shards), wires the model to its tensor-, context- and expert-parallel communicators, and makes
// the data-parallel strategy and the step's pipeline executor (pp = 1 is a one-stage schedule, as
// Megatron's forward_backward_no_pipelining). The result, ParallelModel, is what the trainer steps:
// it runs a step's forward and backward, reduces the loss over the pipeline and data-parallel
// ranks, composes the global gradient norm over the data-parallel, expert, pipeline and tensor
// ranks, and applies the optimizer - every collective of the step outside the model lives here.
//
//   ParallelGroups g = ParallelGroups::build(world, plan);   // parallel/mesh.h
//   auto pm = parallel::parallelize(model_config, plan, g, options);
//   parallel::StepResult r = pm->forward_backward(xs, ys, B, T, &comm);
//   pm->optimizer_step(lr, clip_scale, &comm);
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "model/transformer.h"
#include "parallel/context_parallel.h"
#include "parallel/expert_parallel.h"
#include "parallel/layout/parallel_plan.h"
#include "parallel/mesh.h"
#include "parallel/pipeline_executor.h"
#include "parallel/strategy.h"
#include "parallel/tensor_parallel.h"

namespace mt::parallel {

// What the engine needs beside the plan: the compute dtype and the strategy's and model's knobs.
struct ParallelizeOptions {
  DType dtype = DType::F32;
  StrategySpec spec;               // spec.strategy is the plan's
  bool tp_overlap = true;          // input-gradient reductions overlap the weight-gradient matmuls
  int64_t loss_chunk_tokens = 0;   // chunked LM head + loss (0 = off)
  std::string pp_partition;        // the stage cut (parallel.pp_partition; empty = balanced)
  StageCosts pp_costs;             // what zb1p / zbv are built for (parallel.pp_costs)
  bool flash_attention = false;    // bf16 q, k, v in the flash-attention kernels (model.attention_kernel)
  bool gelu_epilogue = false;      // GPT-2's MLP with the fused GELU epilogues (model.mlp_kernel)
  bool residual_bf16 = false;      // the residual stream in bf16 (model.residual_dtype)
  bool logits_bf16 = false;        // the LM head's logits in bf16 (model.logits_dtype)
};

// One step's forward and backward, reduced over the ranks.
struct StepResult {
  double loss = 0;          // mean over the global batch (the last stage's, summed over the pipeline)
  double grad_norm = 0;     // over every parameter of the model, each element counted once
  // The squared norm was left on the device (set_device_norm): grad_norm is not set; clip with
  // optimizer_step_clipped and read the norm from the device slot afterwards.
  bool grad_norm_on_device = false;
  double bubble = 0;        // pp > 1: idle share of the schedule, mean over the pipeline ranks
  // pp > 1: idle ms in the step's common window (the longest span on the pipeline: the ranks
  // start together), mean over the pipeline ranks. Unlike `bubble`, which ends each rank's span at
  // its own last action, it counts a rank that finishes early as idle until the last one ends.
  double idle_ms = 0;
  double window_ms = 0;  // pp > 1: that window (ms)
  PipelineStepStats stats;  // this rank's
  // pp > 1: per stage, the mean compute time of one micro-batch's forward, B and W (ms; W zero
  // without a split backward), from every pipeline rank: {F[0..S), B[0..S), W[0..S)}, then the
  // same in CPU time of the compute thread.
  std::vector<double> stage_ms;
};

class ParallelModel {
 public:
  ParallelModel(const ParallelPlan& plan, const ParallelGroups& groups) : plan_(plan), groups_(groups) {}

  Transformer& model() { return *model_; }
  const Transformer& model() const { return *model_; }
  Strategy& strategy() { return *strategy_; }
  PipelineExecutor& pipeline() { return *pipe_; }
  const PipeSchedule& schedule() const { return pipe_->schedule(); }
  const StagePartition& partition() const { return pipe_->partition(); }
  ExpertParallel* experts() { return ep_.get(); }  // null when ep = 1
  const ParallelPlan& plan() const { return plan_; }
  const StrategySpec& spec() const { return spec_; }
  bool context_parallel() const { return cp_comm_ != nullptr; }

  // One step's micro-batches through the pipeline (ids[m], targets[m]: B x T tokens each), the
  // loss reduced, the expert gradients reduced and the global gradient norm composed.
  // `loss_weight` multiplies the loss and its gradient (1: the mean over every token of the global
  // batch). Loss masks (targets < 0 are left out) pass D * B * T * n / G, D the data-parallel x cp
  // ranks and G the trained targets of the global batch: the mean over the trained tokens.
  // `lengths` (data.packing = false): micro-batch m is B x lengths[m] tokens (<= T), its loss
  // counted as its share of a B x T micro-batch (pipeline_executor.h), so the same loss_weight
  // gives the mean over the global batch's trained targets.
  StepResult forward_backward(const std::vector<const int32_t*>& ids, const std::vector<const int32_t*>& targets,
                              int64_t B, int64_t T, StepComm* comm, double loss_weight = 1.0,
                              const std::vector<int64_t>* lengths = nullptr);
  // Forward only: the mean loss of one micro-batch on the last stage (0 elsewhere).
  double eval_forward(const int32_t* ids, const int32_t* targets, int64_t B, int64_t T);
  // The mean over the data-parallel ranks of (a last-stage sum over the pipeline ranks) / n.
  double reduce_loss(double loss_sum, int64_t n);
  // Squared norms of the strategy's and the local experts' gradients, summed over the pipeline and
  // tensor-parallel ranks: the norm of the whole model's gradient.
  double global_grad_norm();
  // The optimizer step (experts first: a strategy's step may zero every gradient the model holds),
  // then the tied embedding's sync between the first and the last stage.
  void optimizer_step(double lr, float grad_scale, StepComm* comm);
  // A double in the device's memory where forward_backward leaves the squared gradient norm
  // instead of reading it, when the layout allows (one GPU, any data-parallel strategy:
  // StepResult::grad_norm_on_device);
  // null (the default): the norm is read on the host.
  void set_device_norm(double* norm_sq) { device_norm_ = norm_sq; }
  // The optimizer step of a grad_norm_on_device step: clipped to clip_max (<= 0: not clipped) on
  // the device, from that norm.
  void optimizer_step_clipped(double lr, double clip_max, StepComm* comm);
  // Since the last call: the tensor-parallel collectives' times added to `comm`, and the
  // context-parallel transfers' (added to `comm` and returned in cp_ms / cp_exposed_ms).
  void take_model_comm(StepComm* comm, double* cp_ms, double* cp_exposed_ms);
  // Since the last call: the expert all-to-alls' milliseconds and bytes (0 when ep = 1).
  void take_expert_comm(double* ms, int64_t* bytes);
  // Sum of a per-rank value over the pipeline ranks.
  double pp_sum(double v);
  // parallel.pp_costs = auto: rebuilds the zero-bubble schedule for the costs a step measured
  // (`r.stage_ms`' CPU times: one micro-batch's F, B and W per stage, their means over the stages
  // and over every rank of the world, so that every pipeline runs the same order) and runs it from
  // the next step on, unless it would hold more micro-batches in flight on some rank than the
  // current one or idle more with those costs. Collective over the world. Returns the measured costs
  // (relative to F = 1), and whether the schedule changed. `given` (tests): these costs instead of
  // the measured ones (the same on every rank).
  struct MeasuredSchedule {
    StageCosts costs;
    bool changed = false;
    double bubble_before = 0, bubble_after = 0;  // simulated with the measured costs
  };
  MeasuredSchedule adopt_measured_costs(const StepResult& r, const StageCosts* given = nullptr);
  const StageCosts& schedule_costs() const { return costs_; }  // what the schedule in use is built for

 private:
  friend std::unique_ptr<ParallelModel> parallelize(const ModelConfig&, const ParallelPlan&, const ParallelGroups&,
                                                    const ParallelizeOptions&);
  double dp_mean(double v);

  ParallelPlan plan_;
  const ParallelGroups& groups_;
  StrategySpec spec_;
  std::unique_ptr<ProcessGroupTpComm> tp_comm_;
  std::unique_ptr<ProcessGroupCpComm> cp_comm_;        // null when cp = 1
  std::unique_ptr<ProcessGroupExpertComm> ep_comm_;    // null when ep = 1
  std::unique_ptr<Transformer> model_;
  std::unique_ptr<ExpertParallel> ep_;
  std::vector<double> norm_weight_;  // 1/tp for parameters every tp rank holds whole
  double* device_norm_ = nullptr;    // set_device_norm
  std::unique_ptr<Strategy> strategy_;
  std::unique_ptr<PipelineExecutor> pipe_;
  StageCosts costs_;  // what the schedule in use is built for
};

// Applies `plan` to a model of `mc` on this rank. `groups` (kept by reference) must outlive the
// result. Collective over the data-parallel group (verify_same_model). Throws PlanError for a
// pipeline the schedule or the stage cut refuses.
std::unique_ptr<ParallelModel> parallelize(const ModelConfig& mc, const ParallelPlan& plan, const ParallelGroups& groups,
                                           const ParallelizeOptions& opts);

}  // namespace mt::parallel
