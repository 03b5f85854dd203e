// Expert parallelism (MoE): the routed experts of every MoE layer are split over the `ep` group (a
// block of ep data-parallel ranks; Megatron's and torchtitan's layout, EP borrowed from DP). The
// model moves tokens to their experts' ranks and back through ProcessGroupExpertComm (the process
// group's variable-size all_to_all_v, counts exchanged first); ExpertParallel owns what the
// data-parallel strategy does not: the local experts' gradient reduction over `edp` (the dp ranks
// holding the same experts), their AdamW state, their share of the gradient norm, and their part of
// checkpoints. Everything else (attention, norms, routers, shared experts, embeddings) stays with
// the data-parallel strategy, whichever it is.
#pragma once
#include <memory>

#include "comm/process_group.h"
#include "model/expert_comm.h"
#include "model/transformer.h"
#include "parallel/optimizer.h"
#include "parallel/strategy.h"

namespace mt::parallel {

class ProcessGroupExpertComm final : public ExpertComm {
 public:
  explicit ProcessGroupExpertComm(std::shared_ptr<comm::ProcessGroup> g) : g_(std::move(g)) {}
  int rank() const override { return g_->rank(); }
  int size() const override { return g_->size(); }
  void all_gather_counts(const int64_t* mine, int64_t* all, int64_t n) override;
  void all_to_all_v(const void* send, const int64_t* send_rows, void* recv, const int64_t* recv_rows, int64_t row_elems,
                    DType dt) override;
  // Since the last call: milliseconds the compute thread spent in the exchanges (all exposed: the
  // layer waits for its tokens), and the bytes this rank sent to other ranks.
  void take(double* ms, int64_t* bytes) {
    *ms = ms_;
    *bytes = bytes_;
    ms_ = 0;
    bytes_ = 0;
  }

 private:
  std::shared_ptr<comm::ProcessGroup> g_;
  double ms_ = 0;
  int64_t bytes_ = 0;
};

class ExpertParallel {
 public:
  // `edp`: the ranks holding this rank's experts (the same tp slice of them); `ep_aux`: the ep
  // group's members (norms, checkpoint gathers); `tp_aux`: the tensor-parallel ranks, which hold
  // the other slices of the same experts (null or of size 1 without tp; checkpoint gathers);
  // `dp`: the data-parallel degree times cp (gradients are averaged over those ranks, as the
  // dense part's are).
  ExpertParallel(Transformer& model, std::shared_ptr<comm::ProcessGroup> edp, std::shared_ptr<comm::ProcessGroup> ep_aux,
                 std::shared_ptr<comm::ProcessGroup> tp_aux, int dp, AdamWConfig adam);
  // After the step's backward: the expert gradients summed over edp and divided by dp (the mean
  // over every data-parallel (x cp) rank's tokens: each rank's experts already saw its whole ep
  // group's).
  void reduce_grads(StepComm* c);
  // The local experts' squared gradient norm summed over the ep group (every expert once). With
  // tp the caller sums it over the tp ranks: parameters every tp rank holds whole (GPT-2's
  // down-projection biases) count 1/tp here.
  double grad_norm_sq();
  void optimizer_step(double lr, float grad_scale);
  // Checkpoints and initialisation, one unit at a time: `w`, `m`, `v` point at unit u's first
  // element in `ref` (the unsplit layout, every expert in the unit). load_unit takes this rank's
  // experts out of it (m / v null: zero moments); gather_unit writes every ep rank's experts into
  // it (collective over ep_aux; m / v may be null).
  void load_unit(const Transformer& ref, int u, const float* w, const float* m, const float* v);
  void end_load(int64_t adam_steps) { adam_.set_step_count(adam_steps); }
  void gather_unit(const Transformer& ref, int u, float* w, float* m, float* v);
  // The experts' state this rank keeps: weights (bf16 copy in bf16 mode), gradients, optimizer.
  StateBytes state_bytes() const;

  // ---- sharded checkpoints: this rank's own experts, no communication ----
  // Unit u's local experts are the range [begin, begin + numel) of the expert buffers.
  int64_t unit_begin(int u) const;
  int64_t unit_numel(int u) const;
  // Whether this rank writes its experts into a sharded checkpoint: the first of the edp ranks
  // holding them (the others hold the same values).
  bool writes_checkpoint() const { return edp_->rank() == 0; }
  // Copies unit u's local fp32 weights and moments out (unit_numel(u) elements each, device
  // buffers), and in (m / v null: zero moments; then end_load).
  void read_local(int u, float* w, float* m, float* v);
  void write_local(int u, const float* w, const float* m, const float* v);

 private:
  Transformer& model_;
  std::shared_ptr<comm::ProcessGroup> edp_, ep_aux_, tp_aux_;
  int dp_;
  AdamW adam_;
  // The name of local expert parameter `p` as ep rank r holds it (its expert index shifted).
  std::string name_on_rank(const ParamInfo& p, int r) const;
};

}  // namespace mt::parallel
