#include "parallel/parallelize.h"

#include "parallel/offload.h"

#include <cmath>
#include <stdexcept>
#include <utility>

namespace mt::parallel {

std::unique_ptr<ParallelModel> parallelize(const ModelConfig& mc, const ParallelPlan& plan, const ParallelGroups& g,
                                           const ParallelizeOptions& o) {
  auto pm = std::make_unique<ParallelModel>(plan, g);
  ParallelModel& p = *pm;
  p.spec_ = o.spec;
  p.spec_.strategy = plan.strategy;
  const int pp = plan.pp, tp = plan.tp;
  p.tp_comm_ = std::make_unique<ProcessGroupTpComm>(g.tp);
  p.tp_comm_->set_activation_dtype(o.dtype);  // bf16 runs move activations in bf16 (Megatron)

  // The step's schedule, checked before it runs, and the stages' units (one stage without a pipeline).
  PipeSchedule schedule;
  StagePartition partition;
  try {
    const PipelineSchedule kind = pp > 1 ? plan.schedule : PipelineSchedule::OneFOneB;
    schedule = make_schedule(kind, pp, static_cast<int>(plan.microbatches), plan.virtual_stages,
                             CommPlacement::Eager, o.pp_costs);
    partition = partition_stages(mc, schedule.num_stages(), pp > 1 ? o.pp_partition : "");
  } catch (const std::invalid_argument& e) {
    throw PlanError(std::string("pipeline: ") + e.what());
  }
  std::vector<char> owned;
  if (pp > 1)
    owned = stage_units_of_rank(partition, pp, g.pp_rank, static_cast<int>(mc.n_layer) + 2, schedule.vshape);
  if (plan.ep_enabled()) p.ep_comm_ = std::make_unique<ProcessGroupExpertComm>(g.ep);
  if (plan.cp > 1) p.cp_comm_ = std::make_unique<ProcessGroupCpComm>(g.cp);
  // The model's settings that depend on the plan, all given at construction.
  p.model_ = std::make_unique<Transformer>(
      mc, ModelOptions{.compute = o.dtype,
                       .recompute = plan.checkpointing,
                       .storage = plan.offload_optimizer() ? offload_model_storage()
                                                           : model_storage(p.spec_, o.dtype, g.shard->size()),
                       .tp = tp > 1 ? p.tp_comm_.get() : nullptr,
                       .sequence_parallel = plan.sequence_parallel,
                       .tp_overlap = o.tp_overlap,
                       .loss_chunk = o.loss_chunk_tokens,
                       .flash_attention = o.flash_attention,
                       .gelu_epilogue = o.gelu_epilogue,
                       .residual_bf16 = o.residual_bf16,
                       .logits_bf16 = o.logits_bf16,
                       .cp = p.cp_comm_.get(),
                       .cp_allgather = plan.cp_mode == "allgather",
                       .ep = plan.ep_enabled() ? plan.ep : 1,
                       .ep_rank = plan.ep_enabled() ? g.ep->rank() : 0,
                       .ep_comm = p.ep_comm_.get(),
                       .owned_units = owned,
                       .split_backward = schedule.split_backward});
  // Expert gradients are averaged like the dense ones: over the dp ranks times the cp ranks.
  if (plan.ep_enabled())
    p.ep_ = std::make_unique<ExpertParallel>(*p.model_, g.edp, g.ep_aux, g.tp_aux, plan.dp() * plan.cp, p.spec_.adam);
  const auto& params = p.model_->params();
  p.norm_weight_.assign(params.size(), 1.0);
  for (size_t i = 0; i < params.size(); ++i)
    if (params[i].tp_split == TpSplit::None) p.norm_weight_[i] = 1.0 / tp;  // replicated on every tp rank
  verify_same_model(*p.model_, *g.dp);
  p.strategy_ = plan.offload_optimizer() ? make_offload_strategy(p.spec_, *p.model_, g.dp)
                                         : make_strategy(p.spec_, *p.model_, g.dp, g.shard, g.replicate, g.grad_norm);
  p.pipe_ = std::make_unique<PipelineExecutor>(*p.model_, std::move(schedule), std::move(partition), g.pp,
                                               p.strategy_.get());
  p.costs_ = o.pp_costs;
  p.model_->set_hooks(p.strategy_->hooks());
  return pm;
}

StepResult ParallelModel::forward_backward(const std::vector<const int32_t*>& ids,
                                           const std::vector<const int32_t*>& targets, int64_t B, int64_t T,
                                           StepComm* comm, double loss_weight,
                                           const std::vector<int64_t>* lengths) {
  const auto n = static_cast<int64_t>(ids.size());
  const float dloss = static_cast<float>(loss_weight / static_cast<double>(B * T * n));
  // The routers' auxiliary losses are means over every routed token: the loss-mask weight is the
  // cross-entropy's alone.
  model_->set_router_loss_scale(static_cast<float>(1.0 / static_cast<double>(B * T * n)));
  StepResult r;
  model_->zero_grads();
  r.stats = pipe_->train_step(ids, targets, B, T, dloss, comm, lengths);
  if (plan_.pp > 1) {
    r.bubble = pp_sum(r.stats.idle_fraction()) / plan_.pp;
    // Each stage runs on one pipeline rank (the others hold zeros): a sum gathers them.
    std::vector<float> t;
    for (const auto* v : {&r.stats.f_ms, &r.stats.b_ms, &r.stats.w_ms, &r.stats.f_cpu_ms, &r.stats.b_cpu_ms,
                          &r.stats.w_cpu_ms})
      for (double x : *v) t.push_back(static_cast<float>(x / static_cast<double>(n)));
    if (groups_.pp_aux) groups_.pp_aux->all_reduce(t.data(), t.size(), DType::F32, comm::ReduceOp::Sum)->wait();
    r.stage_ms.assign(t.begin(), t.end());
    // The pipeline's compute: every F, B and W of every stage (each rank's busy time is the sum of
    // its stages' times), as per-micro-batch means summed over the ranks above.
    double busy_sum = 0;
    for (size_t i = 0; i < 3 * r.stats.f_ms.size(); ++i) busy_sum += r.stage_ms[i] * static_cast<double>(n);
    const PipelineWindow w = pipeline_window(groups_.pp_aux.get(), r.stats.span_ms,
                                             groups_.pp_aux ? busy_sum / plan_.pp : r.stats.busy_ms);
    r.window_ms = w.window_ms;
    r.idle_ms = w.idle_ms;
  }
  r.loss = reduce_loss(r.stats.loss_sum, n) * loss_weight;
  if (ep_) ep_->reduce_grads(comm);
  if (device_norm_ && !ep_ && plan_.pp == 1 && plan_.tp == 1 && strategy_->grad_norm_sq_to(device_norm_, norm_weight_))
    r.grad_norm_on_device = true;
  else
    r.grad_norm = global_grad_norm();
  return r;
}

ParallelModel::MeasuredSchedule ParallelModel::adopt_measured_costs(const StepResult& r, const StageCosts* given) {
  MeasuredSchedule out;
  out.costs = costs_;
  const size_t S = r.stage_ms.size() / 6;
  // The mean over the stages of the CPU-time costs, then over every rank of the world.
  float c[3] = {0, 0, 0};
  for (size_t s = 0; s < S; ++s)
    for (size_t k = 0; k < 3; ++k) c[k] += static_cast<float>(r.stage_ms[3 * S + k * S + s] / static_cast<double>(S));
  if (groups_.metrics) {
    groups_.metrics->all_reduce(c, 3, DType::F32, comm::ReduceOp::Sum)->wait();
    for (float& x : c) x /= static_cast<float>(groups_.metrics->size());
  }
  if (given) {
    c[0] = static_cast<float>(given->f);
    c[1] = static_cast<float>(given->b);
    c[2] = static_cast<float>(given->w);
  }
  if (S == 0 || !(c[0] > 0 && c[1] > 0 && c[2] > 0)) return out;  // nothing measured (no split backward)
  const StageCosts measured{1.0, static_cast<double>(c[1]) / c[0], static_cast<double>(c[2]) / c[0]};
  out.costs = measured;
  const PipeSchedule& cur = pipe_->schedule();
  const double w_share = measured.w / (measured.b + measured.w);
  const double v = cur.virtual_stages;
  auto bubble = [&](const PipeSchedule& s) {
    return simulate_timeline(s, v * measured.f, v * (measured.b + measured.w), 0, w_share).bubble_fraction;
  };
  out.bubble_before = bubble(cur);
  const std::vector<int> pa = check_schedule(cur).peak_in_flight;
  // The list scheduler's order depends on the costs it is given, and small changes of them can move
  // the result either way: the orders built for costs around the measured ones, each judged by its
  // simulated bubble with the measured costs, within the current order's activations per rank.
  PipeSchedule next;
  out.bubble_after = out.bubble_before;
  bool found = false;
  for (double fb : {1.0, 0.8, 0.9, 1.1, 1.25})
    for (double fw : {1.0, 0.8, 0.9, 1.1, 1.25}) {
      PipeSchedule cand = make_schedule(plan_.schedule, plan_.pp, static_cast<int>(plan_.microbatches),
                                        plan_.virtual_stages, CommPlacement::Eager,
                                        StageCosts{1.0, measured.b * fb, measured.w * fw});
      const std::vector<int> pc = check_schedule(cand).peak_in_flight;
      bool fits = pc.size() == pa.size();
      for (size_t i = 0; fits && i < pa.size(); ++i) fits = pc[i] <= pa[i];
      const double b = fits ? bubble(cand) : 1.0;
      if (b < out.bubble_after - 1e-9) {
        out.bubble_after = b;
        next = std::move(cand);
        found = true;
      }
    }
  if (found && pipe_->replace_schedule(std::move(next))) {
    costs_ = measured;
    out.changed = true;
  }
  return out;
}

double ParallelModel::eval_forward(const int32_t* ids, const int32_t* targets, int64_t B, int64_t T) {
  return pipe_->eval_forward(ids, targets, B, T);
}

double ParallelModel::reduce_loss(double loss_sum, int64_t n) {
  return dp_mean(pp_sum(loss_sum) / static_cast<double>(n));
}

double ParallelModel::global_grad_norm() {
  double norm_sq = strategy_->grad_norm_sq(norm_weight_);
  if (ep_) norm_sq += ep_->grad_norm_sq();
  norm_sq = pp_sum(norm_sq);
  if (plan_.tp > 1) {  // tp-split parameters are summed across tp ranks, replicated ones weighted 1/tp
    float f = static_cast<float>(norm_sq);
    groups_.tp_aux->all_reduce(&f, 1, DType::F32, comm::ReduceOp::Sum)->wait();
    norm_sq = f;
  }
  return std::sqrt(norm_sq);
}

void ParallelModel::optimizer_step(double lr, float grad_scale, StepComm* comm) {
  if (ep_) ep_->optimizer_step(lr, grad_scale);  // first: a strategy's step may zero every gradient the model holds
  strategy_->optimizer_step(lr, grad_scale, comm);
  pipe_->tied_weights_sync();
}

void ParallelModel::optimizer_step_clipped(double lr, double clip_max, StepComm* comm) {
  strategy_->optimizer_step_clipped(lr, device_norm_, clip_max, comm);
  pipe_->tied_weights_sync();
}

void ParallelModel::take_model_comm(StepComm* comm, double* cp_ms, double* cp_exposed_ms) {
  double tp_ms = 0, tp_exposed = 0;  // tensor-parallel collectives (mostly on the critical path)
  tp_comm_->take_times(&tp_ms, &tp_exposed);
  comm->comm_ms += tp_ms;
  comm->exposed_ms += tp_exposed;
  *cp_ms = *cp_exposed_ms = 0;
  if (!cp_comm_) return;
  // Ring attention's transfers (mostly hidden behind the attention of the block in hand).
  cp_comm_->take_times(cp_ms, cp_exposed_ms);
  comm->comm_ms += *cp_ms;
  comm->exposed_ms += *cp_exposed_ms;
}

void ParallelModel::take_expert_comm(double* ms, int64_t* bytes) {
  if (ep_comm_) ep_comm_->take(ms, bytes);
}

double ParallelModel::pp_sum(double v) {
  if (!groups_.pp_aux) return v;
  float f = static_cast<float>(v);
  groups_.pp_aux->all_reduce(&f, 1, DType::F32, comm::ReduceOp::Sum)->wait();
  return static_cast<double>(f);
}

double ParallelModel::dp_mean(double v) {
  if (groups_.dp->size() == 1) return v;
  float f = static_cast<float>(v);
  groups_.metrics->all_reduce(&f, 1, DType::F32, comm::ReduceOp::Avg)->wait();
  return static_cast<double>(f);
}

}  // namespace mt::parallel
