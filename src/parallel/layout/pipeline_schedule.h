// Pipeline-parallel schedules as data.
//
// A schedule is, for every pipeline rank, the ordered list of actions that rank performs in one
// training step: forward / backward of micro-batch m on (virtual) stage s, and the point-to-point
// sends and receives that move activations forward and gradients backward. Because it is plain
// data it can be printed, checked (complete, matched, deadlock-free) and timed without a model;
// parallel::PipelineExecutor (pipeline_executor.h) runs exactly these lists when the trainer has
// pp > 1. This module depends on nothing but the parallel configuration's vocabulary (both are the
// layout library, mt_layout: no MPI, no kernels), so the planner can use it.
//
// Layout (Megatron): the model is cut into pp * v contiguous virtual stages; rank r owns stages
// r, r + pp, r + 2pp, ... (v = 1 is the ordinary one-stage-per-rank pipeline). The output of
// stage s feeds stage s + 1 on rank (s + 1) % pp; the gradient of stage s's input goes back to
// stage s - 1. A hand-off between two stages on the same rank is local and has no send/recv.
//
// Executor contract (what check_schedule proves safe): a rank walks its list in order; a send is
// posted asynchronously and never blocks the list (isend; its handle is waited on later, before
// the buffer is reused or at the end of the step); a receive blocks at its position until the
// matching send has been posted (an executor may also post it early and wait just before the
// consuming compute: waiting later never creates a deadlock). This is the model of our MPI
// ProcessGroup, whose send/recv are asynchronous. The checker also runs a stricter model,
// rendezvous sends posted in batches (ScheduleCheck::rendezvous_safe), which is what an executor
// needs when a send cannot complete before its receive is posted and it waits on each batch (NCCL
// p2p, Megatron's batch_isend_irecv); CommPlacement::Batched builds lists that pass it.
#pragma once
#include <string>
#include <vector>

#include "parallel/layout/parallel_config.h"

namespace mt::parallel {

struct PipeAction {
  // Weight: the deferred weight gradient (W) of a split backward (PipeSchedule::split_backward),
  // whose Backward then computes only the input gradient (B).
  enum Kind { Forward, Backward, SendAct, RecvAct, SendGrad, RecvGrad, Weight } kind;
  int microbatch;  // 0 .. microbatches-1
  // Virtual stage 0 .. pp*v-1. For compute: the stage computed. For communication: the stage
  // whose result travels, i.e. SendAct/RecvAct(m, s) carry the output of Forward(m, s) from
  // rank(s) to rank(s+1), and SendGrad/RecvGrad(m, s) carry the input gradient produced by
  // Backward(m, s) from rank(s) to rank(s-1). A send and its receive therefore have the same
  // micro-batch and stage.
  int stage;
  int peer;  // the other rank of a send/recv; -1 for compute
};

bool is_compute(PipeAction::Kind k);
bool is_send(PipeAction::Kind k);
bool is_recv(PipeAction::Kind k);
bool valid_kind(PipeAction::Kind k);  // one of the seven kinds (a list built elsewhere may hold anything)
// Largest pp * v * m a builder accepts and the checker takes (the lists and the checker's tables
// grow with it).
inline constexpr long long kMaxScheduleSize = 1 << 20;
const char* kind_name(PipeAction::Kind k);  // "Forward", "SendAct", ...
// Short form used in tables: F3.1, B3.1, W3.1, sA3.1>2 (send activation to rank 2), rA3.1<1,
// sG3.1>0, rG3.2<2.
std::string short_string(const PipeAction& a);
// Long form used in messages: "Forward(mb 3, stage 1)", "SendAct(mb 3, stage 1 -> rank 2)".
std::string describe(const PipeAction& a);
bool operator==(const PipeAction& a, const PipeAction& b);

struct PipeSchedule {
  std::string name;        // "gpipe", "1f1b", "interleaved_1f1b", "zb1p", "zbv" or anything for hand-made ones
  int pp = 1;              // pipeline ranks
  int microbatches = 1;    // micro-batches per step
  int virtual_stages = 1;  // stages per rank (v)
  // Split backward: every Backward computes the input gradient only and a Weight action of the
  // same (micro-batch, stage), later on the same rank, computes the weight gradients.
  bool split_backward = false;
  // V placement (v = 2): rank r owns stages r and 2*pp-1-r, so the first and the last stage are
  // both on rank 0 and stage pp-1 hands its output to stage pp on the same rank.
  bool vshape = false;
  std::vector<std::vector<PipeAction>> per_rank;  // per_rank[r] = rank r's actions in order

  int num_stages() const { return pp * virtual_stages; }
  int stage_rank(int stage) const {
    if (vshape) return stage < pp ? stage : 2 * pp - 1 - stage;
    return stage % pp;
  }
  // Which of its rank's stages `stage` is (0 .. v-1, in stage order).
  int stage_chunk(int stage) const { return stage / pp; }
};

// Where the builders put the sends and receives.
//  Eager:   each send right after the compute that produces it, each receive right before the
//           compute that consumes it. Fastest with asynchronous sends (nothing waits longer than
//           the data dependency requires). GPipe and 1F1B lists are then exactly Megatron's
//           ("send forward, receive backward" pairs) and also safe with rendezvous sends;
//           interleaved 1F1B is not (the ring of virtual stages can wait on itself).
//  Batched: Megatron's interleaved placement: the computes form steps (warm-up: one forward,
//           steady: a forward and a backward, cool-down: one backward) and after each step one
//           batch sends what the step produced and receives what the next step needs. Safe with
//           rendezvous sends (e.g. NCCL), at the price of sending a forward's output only after
//           the step's backward. Only changes interleaved_1f1b.
enum class CommPlacement { Eager, Batched };
const char* placement_name(CommPlacement p);  // "eager" | "batched"
bool parse_placement(const std::string& s, CommPlacement* out);

// GPipe: all m forwards, then all m backwards, both in micro-batch order (mb 0's gradient is the
// first to come back). Peak activations: all m micro-batches on every rank.
PipeSchedule gpipe(int pp, int microbatches);
// 1F1B / PipeDream-flush (Megatron's non-interleaved schedule): rank r runs min(pp-r-1, m)
// warm-up forwards, then alternates one forward and one backward, then drains the remaining
// backwards. Peak activations on rank r: min(pp - r, m).
PipeSchedule one_f_one_b(int pp, int microbatches);
// Megatron's interleaved 1F1B with v virtual stages per rank. Micro-batches go through the
// chunks in groups of pp; requires microbatches % pp == 0 and v >= 2 (v = 1 is plain 1f1b).
PipeSchedule interleaved_1f1b(int pp, int microbatches, int virtual_stages,
                              CommPlacement placement = CommPlacement::Eager);
// One micro-batch's forward (F), input gradient (B) and weight gradient (W) on one stage, in any
// unit (only the ratios matter): what the zero-bubble schedules are built for. {1, 1, 1} are the
// paper's T_F = T_B = T_W; `meshtrain train` can take measured ones (parallel.pp_costs).
struct StageCosts {
  double f = 1.0, b = 1.0, w = 1.0;
};

// Zero-bubble schedules (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024), split backward.
// Per stage the F, B and W run in micro-batch order (the weight gradients accumulate in the order
// of the unsplit backward).
// ZB-H1: one stage per rank; rank r runs 1F1B's pp - r warm-up forwards, then steps of B, the W
// postponed by r steps, F; the postponed W's end its list. At most pp sets in flight on a rank
// (1F1B's rank-0 peak); with T_F = T_B = T_W and m >= pp the bubble is (p-1)/(3m+p-1). With other
// costs: this order or the list scheduler below under the same limit of pp sets per rank (the
// paper's automatic "ZB-1p"), whichever idles less in simulate_timeline with those costs.
PipeSchedule zero_bubble_h1(int pp, int microbatches, const StageCosts& costs = {});
// ZB-V: two stages per rank in a V (rank r: stages r and 2pp-1-r), ordered by a list scheduler
// over the costs (F, B, W of a stage; event-driven: with unit costs every action is one slot):
// whenever a rank is free it runs a ready B first (the critical path), else a ready F (the later
// stage first) while it holds under 2*pp sets (pp micro-batches' worth, 1F1B's rank-0 peak), else
// its oldest pending W, else it waits for the next action anywhere to end. With costs other than
// {1, 1, 1}: that list or the unit-cost one, whichever idles less with the costs.
PipeSchedule zero_bubble_v(int pp, int microbatches, const StageCosts& costs = {});
// By kind (parallel_config.h: GPipe, OneFOneB, Interleaved, ZeroBubbleH1, ZeroBubbleV; ZeroBubbleV
// takes virtual_stages 1 or 2 and always builds 2). Throws std::invalid_argument
// with a clear message for invalid sizes (pp, m, v < 1, v != 1 for a non-interleaved schedule,
// m % pp != 0 for interleaved) and for PipelineSchedule::None.
PipeSchedule make_schedule(PipelineSchedule kind, int pp, int microbatches, int virtual_stages = 1,
                           CommPlacement placement = CommPlacement::Eager, const StageCosts& costs = {});
// By name: "gpipe" | "1f1b" | "interleaved_1f1b" (to_string of the kinds); an unknown name throws
// std::invalid_argument listing the known ones.
PipeSchedule make_schedule(const std::string& name, int pp, int microbatches, int virtual_stages = 1,
                           CommPlacement placement = CommPlacement::Eager, const StageCosts& costs = {});
std::vector<std::string> schedule_names();

struct ScheduleCheck {
  // True when the schedule is complete, every send/recv is matched, the local ordering is right
  // and the lists run to the end under the executor contract (buffered sends, blocking receives).
  bool ok = false;
  std::string message;                // "ok: ..." or the first problem (+ how many more)
  std::vector<std::string> problems;  // every problem found (at most 100 listed)
  bool deadlock_free = false;         // buffered sends, blocking receives
  std::string deadlock_message;       // why not (the wait-for cycle), or empty
  // Stricter model: sends are unbuffered (a send completes only when its receive is posted), and
  // every maximal run of consecutive comm actions in a list is posted as one batch and waited on
  // together (batch_isend_irecv + wait). True if the lists also run to the end under that model.
  bool rendezvous_safe = false;
  std::string rendezvous_message;
  // Per rank: the largest number of (micro-batch, stage) activation sets alive at once (forward
  // done, backward not yet - with a split backward: its Weight not yet, the inputs the weight
  // gradients need are held until then), walking the rank's list. With v virtual stages one such set holds
  // 1/v of the rank's layers, so activation memory is peak_in_flight[r] / v micro-batches' worth.
  std::vector<int> peak_in_flight;
  int compute_actions = 0, sends = 0, recvs = 0;
};
ScheduleCheck check_schedule(const PipeSchedule& s);

struct TimedAction {
  PipeAction action;
  double start = 0, end = 0;  // compute: when it ran; send: post time (start == end);
                              // recv: when the rank reached it .. when the data was there
};

struct Timeline {
  bool completed = false;  // false if the schedule deadlocks (per_rank holds what ran)
  std::string message;
  double makespan = 0;             // time the last rank finishes
  std::vector<double> busy, idle;  // per rank: compute time, makespan - busy
  double bubble_fraction = 0;      // sum(idle) / (pp * makespan)
  double bubble_relative = 0;      // sum(idle) / sum(busy)  ("bubble time / ideal time")
  std::vector<std::vector<TimedAction>> per_rank;
};
// Runs the lists with buffered sends and blocking receives. t_fwd / t_bwd are the times of one
// micro-batch's forward / backward through ONE RANK'S share of the model, so a virtual stage
// (1/v of it) takes t_fwd / v; this keeps schedules with different v comparable. t_comm is the
// latency of one message; it costs the sender no time (asynchronous) and delays the receiver.
// With a split backward, B takes (1 - w_share) * t_bwd and W takes w_share * t_bwd (the paper's
// T_B = T_W: w_share = 0.5).
Timeline simulate_timeline(const PipeSchedule& s, double t_fwd, double t_bwd, double t_comm, double w_share = 0.5);

struct BubbleFormula {
  std::string text;  // e.g. "(p-1)/(m+p-1)"
  double fraction;   // idle share of the step: (p-1)/(m+p-1), interleaved (p-1)/(v*m+p-1),
                     // ZB-H1 (p-1)/(3m+p-1) (T_F = T_B = T_W, m >= p); ZB-V has no closed form:
                     // its simulated timeline with T_F = T_B = T_W
  double relative;   // idle / ideal: (p-1)/m, interleaved (p-1)/(v*m)
};
BubbleFormula bubble_formula(const PipeSchedule& s);

// The schedule as a table: one column per rank, one row per time slot of the timeline with every
// forward/backward (with a split backward: every F, B and W) of a virtual stage taking one slot and free communication; "." is idle. With
// show_comm, a row of the sends/receives each rank posts between two slots is printed before the
// slot. Micro-batches and stages are numbered from 0.
std::string format_schedule(const PipeSchedule& s, bool show_comm = false);
// Every rank's action list in order, one rank per line.
std::string format_actions(const PipeSchedule& s);

}  // namespace mt::parallel
