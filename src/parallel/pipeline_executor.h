// Pipeline parallelism: running a schedule's action lists.
//
// The model's units (embedding, blocks, head) are cut into pp * v contiguous virtual stages
// (pipeline_stages.h; pipeline_schedule.h: rank r runs stages r, r + pp, ...). Each pipeline rank builds a Transformer
// that owns only its stages' units; the executor walks the rank's list of the schedule in order:
// a forward or backward of micro-batch m on stage s runs those units on m's activation slot,
// activations and input gradients travel as asynchronous point-to-point messages over the pp
// group (a receive is posted at its place in the list and waited on just before the compute that
// needs it), and the data-parallel strategy's hooks see every unit exactly as without a pipeline
// (only the last micro-batch of a stage synchronises gradients).
//
// Tied embeddings (GPT-2) cut apart by the pipeline: the last stage keeps a replica of the token
// embedding for its head. Its gradient, summed over the step's micro-batches, is sent to the first
// stage before that stage's last backward and added to the embedding's own gradient (so the data-
// parallel reduction and the optimizer see one tied parameter); after the optimizer step the first
// stage sends the updated weights back (tied_weights_sync).
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "comm/process_group.h"
#include "model/transformer.h"
#include "parallel/layout/pipeline_schedule.h"
#include "parallel/layout/pipeline_stages.h"
#include "parallel/strategy.h"

namespace mt::parallel {

struct PipelineStepStats {
  double loss_sum = 0;     // sum of the micro-batch losses (last stage only; 0 elsewhere)
  double span_ms = 0;      // first action to the end of the last one on this rank
  double busy_ms = 0;      // forward / backward compute
  double wait_ms = 0;      // blocked on receives (pipeline bubble and transfer)
  int peak_slots = 0;      // most micro-batch activation sets alive at once
  // Compute time per stage (index: stage; zero for the stages of other ranks), summed over the
  // step's micro-batches: forwards, backwards (B: the input gradient alone under a split
  // backward, the whole backward otherwise) and weight-gradient passes (W; split backward only).
  std::vector<double> f_ms, b_ms, w_ms;
  // The same as the compute thread's CPU time: what the actions cost without the time the thread
  // waited for a core (on a loaded machine the wall times above include it).
  std::vector<double> f_cpu_ms, b_cpu_ms, w_cpu_ms;
  double idle_fraction() const { return span_ms > 0 ? 1.0 - busy_ms / span_ms : 0.0; }
};

// The step's common window on a pipeline: the longest span over its ranks (they start together,
// after the previous step's synchronisation), and the mean over the ranks of the idle time within
// it (window - compute) - the bubble as the formulas count it, where a rank that finishes early
// idles until the last one ends. `mean_busy_ms`: the ranks' mean compute time (the caller has it
// from the stage times it sums anyway). `pp`: the pipeline's group (null: this rank alone).
// Collective.
struct PipelineWindow {
  double window_ms = 0, idle_ms = 0;
};
PipelineWindow pipeline_window(comm::ProcessGroup* pp, double span_ms, double mean_busy_ms);

class PipelineExecutor {
 public:
  PipelineExecutor(Transformer& model, PipeSchedule schedule, StagePartition partition,
                   std::shared_ptr<comm::ProcessGroup> pp, Strategy* strategy);

  // One training step: the schedule's micro-batches (ids[m], targets[m]: B*T tokens each; only the
  // first stage reads ids and the last targets), each token's loss gradient scaled by dloss.
  // `lengths` (variable-length micro-batches, data.packing = false): micro-batch m is B x lengths[m]
  // tokens (<= T; every stage of it, and the messages between them, take that shape), and its loss
  // counts in loss_sum as its mean times lengths[m] / T (its share of a B x T micro-batch).
  PipelineStepStats train_step(const std::vector<const int32_t*>& ids, const std::vector<const int32_t*>& targets,
                               int64_t B, int64_t T, float dloss, StepComm* comm,
                               const std::vector<int64_t>* lengths = nullptr);
  // Forward only, one micro-batch after the other: returns the mean loss on the last stage, 0 elsewhere.
  double eval_forward(const int32_t* ids, const int32_t* targets, int64_t B, int64_t T);
  // After the optimizer step (tied embeddings cut apart): the first stage sends the updated token
  // embedding to the last stage's replica. Collective over the pp group's first and last rank.
  void tied_weights_sync();

  const PipeSchedule& schedule() const { return sched_; }
  // Between steps: runs `s` from the next step on - the same kind of schedule for the same ranks,
  // stages and micro-batches in another order (a zero-bubble schedule rebuilt for measured costs).
  // It must pass check_schedule and place every stage on the rank the current one does; false
  // (nothing changed) otherwise.
  bool replace_schedule(PipeSchedule s);
  const StagePartition& partition() const { return part_; }
  bool tied_split() const { return tied_split_; }
  // Gradient bytes the executor itself keeps (the first stage's receive buffer for the head's
  // contribution to a tied embedding).
  int64_t grad_bytes() const { return tied_grad_in_.defined() ? static_cast<int64_t>(tied_grad_in_.nbytes()) : 0; }

 private:
  int acquire_slot(int m, int s);
  void release_slot(int m, int s);
  int tag(int kind, int m, int s) const;

  Transformer& model_;
  PipeSchedule sched_;
  StagePartition part_;
  std::shared_ptr<comm::ProcessGroup> pp_;
  Strategy* strategy_;
  int rank_, S_, head_unit_;
  bool tied_split_ = false;  // tied embeddings whose embedding and head live on different ranks
  std::map<int, int> slot_of_;  // m * S + s -> activation slot
  std::map<int, std::vector<int>> free_slots_;  // per chunk
  int slots_used_ = 0, peak_slots_ = 0, slots_made_ = 0;
  Tensor tied_grad_in_;  // first stage: the head's contribution to the tied embedding's gradient
};

}  // namespace mt::parallel
