// The planner checked against this engine (issue 7 part 5): `meshtrain plan --validate`.
//
// 1. Ceilings, measured first, the way the ranks of a job will see the machine:
//    * compute: N probe processes at once (N = the job's ranks, each with the OpenMP threads
//      `meshtrain launch` gives a rank) time the model's own linear layers (kernels::linear_* over
//      gemm_f32 / gemm_bf16, forward and backward, one micro-batch) and its attention kernel, and a
//      streaming kernel — just before and just after each job (the mean is used; the spread shows
//      how much the shared machine's load moved meanwhile);
//    * collectives: `meshtrain launch -n N -- bench comm` at the sizes the layouts use, on an idle
//      machine and with one single-threaded compute process per rank keeping a core busy (the job's
//      conditions: on a CPU the communication threads compete with the compute threads), fitted to
//      the planner's t = bytes per rank / bw + ring steps x alpha.
// 2. Real jobs: `meshtrain launch -n N -- train ...` for each layout, a few steps of a small model.
// 3. Predicted vs measured:
//    * per-rank memory by category: the model state from the planner's ZeRO formulas under this
//      engine's precision policy (fp32 gradients; a sharded-parameter strategy keeps no bf16 shard,
//      it casts the fp32 master when it gathers) against `mem_resident_by_category_per_rank` on every
//      rank — to the byte; the activations this engine keeps — within 10% (exact in practice); the
//      model's backward workspace — a lower bound (kernels add scratch of their own);
//    * bytes per collective group: the planner's collective volumes (all-reduce 2(n-1)/n x buffer,
//      all-gather / reduce-scatter (n-1)/n x full buffer) applied to the engine's schedule of
//      collectives (per bucket, per unit, roots kept through backward) plus the one-off setup and
//      summary traffic predicted the same way, against `comm_bytes_by_group` — exactly;
//    * step time: mt::plan::estimate() on a cluster built from the measured ceilings, against the
//      median measured step (the steps after the first) — within 25%, one rerun on a miss.
// Tensor parallelism (`parallel.tp`, Megatron-style, no sequence parallelism): every rank holds its
// tp share of each split parameter (heads, MLP width, vocabulary), the data-parallel strategy works
// on that share over the ranks ranks / tp of its dp group; the model's own all-reduces (embedding,
// two per block forward and backward, head input gradient, vocab-parallel cross-entropy) go over the
// "tp" group and are exposed (on the critical path) except the backward input-gradient reductions,
// which overlap the weight-gradient matmuls; gradient norms travel on "tp_aux".
// Sequence parallelism (`parallel.sequence_parallel`, tp > 1): norms, residuals and the pipeline's
// stage boundaries hold B*T/tp rows per rank; all-gathers before the column-parallel matmuls and
// reduce-scatters after the row-parallel ones replace the all-reduces (engine_tp_collectives).
// Pipeline parallelism (`parallel.pp`, GPipe or 1F1B, one stage per rank): every pipeline rank holds
// its stage's units only (the engine's cost-balanced cut, engine_stage_partition), keeps its schedule's
// peak of in-flight micro-batches' activations, sends activations and input gradients over "pp" and
// losses, gradient norms and bubble figures over "pp_aux"; a tied GPT-2 embedding cut apart by the
// pipeline adds a replica (last stage) and a gradient buffer (first stage). Its step time comes from a
// timeline of the schedule with each stage's forward / backward time (engine_pp_timeline).
#pragma once
#include <algorithm>
#include <cstdint>
#include <map>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "model/model_config.h"
#include "plan/cluster.h"
#include "plan/cost_model.h"

namespace mt::plan {

// One job of the engine: what `meshtrain train` is given.
struct EngineLayout {
  std::string model = "gpt2-mini";   // model preset
  std::string strategy = "NO_SHARD"; // --parallel.strategy (INTERFACE.md spelling)
  int ranks = 2;
  int tp = 1;                        // --parallel.tp: tensor-parallel degree (innermost mesh dimension)
  bool sequence_parallel = false;    // --parallel.sequence_parallel (needs tp > 1)
  int pp = 1;                        // --parallel.pp: pipeline ranks (outermost mesh dimension)
  std::string pp_schedule = "1f1b";  // --parallel.pp_schedule: gpipe | 1f1b | interleaved_1f1b
  int pp_virtual_stages = 1;         // --parallel.pp_virtual_stages (interleaved_1f1b: model chunks per rank)
  int dp_replicate = 1;              // HYBRID_*: replicas; the shard group is dp_ranks() / dp_replicate
  bool bf16 = false;                 // --train.dtype bf16 (bf16 compute, fp32 master, fp32 gradients)
  Checkpointing checkpointing = Checkpointing::None;
  int64_t micro_batch = 4;           // sequences per rank per micro-batch
  int64_t grad_accum = 1;            // micro-batches per step (with pp > 1: the schedule's)
  bool reduce_every_microbatch = true;  // --parallel.reduce_every_microbatch
  bool reshard_after_forward = true;
  double bucket_mb = 25.0;           // --parallel.bucket_mb (the engine's MB are 1e6 bytes)

  int dp_ranks() const { return ranks / ((tp > 0 ? tp : 1) * (pp > 0 ? pp : 1)); }  // ranks / (tp x pp)
  int pp_rank_of(int rank) const { return rank / std::max(1, ranks / std::max(1, pp)); }  // pp is outermost
  int virtual_stages() const { return pp > 1 && pp_schedule == "interleaved_1f1b" ? std::max(1, pp_virtual_stages) : 1; }
  int num_stages() const { return std::max(1, pp) * virtual_stages(); }  // stage s runs on pp rank s % pp
  int shard_size() const;            // ranks the parameters / gradients / optimizer are split over
  int replicas() const;              // 1 unless hybrid
  bool hybrid() const { return strategy.rfind("HYBRID", 0) == 0; }
  std::string label() const;         // "ZeRO-3 x2 fp32 gpt2-mini", "ZeRO-3 x2 tp2 fp32 gpt2-mini",
                                     // "DDP x1 pp2 1f1b fp32 accum4 gpt2-mini", "DDP x1 tp2 sp fp32 gpt2-mini"
  // The engine's command line after `train` (without data / metrics paths).
  std::vector<std::string> train_args() const;
};

// The planner's layout and setup for an engine job (DDP = dp_replicate x ranks for the planner,
// `dp_shard = ranks` for the engine's mesh).
Layout planner_layout(const EngineLayout& e);
TrainSetup planner_setup(const ModelConfig& m, const EngineLayout& e);
// Throws std::invalid_argument when the engine cannot run the layout.
void check_engine_layout(const EngineLayout& e);

// ---- this engine's exact accounting, from the model's dimensions --------------------------------

// The model as the engine builds it for the layout: resolved, and with tp > 1 the vocabulary padded
// to a multiple of 64 x tp so that every tp rank holds whole 64-row blocks (train/trainer.cpp).
ModelConfig engine_model(const ModelConfig& m, const EngineLayout& e);

// Elements of each unit (embedding, blocks, head) of one tp rank's share as the engine lays them out
// (model/transformer.cpp build_params: heads, MLP width and vocabulary divided by tp; norms,
// position table and row-parallel biases replicated), each padded to a multiple of `align`
// (16 x shard size for sharded strategies, 1 for DDP). `m` must already carry the engine's padded
// vocabulary (engine_model) when tp > 1.
std::vector<int64_t> engine_unit_sizes(const ModelConfig& m, int64_t align, int tp = 1);
int64_t engine_unit_align(const EngineLayout& e);
// The padded flat size of pipeline rank `pp_rank`'s share (its stage's units; all units when pp = 1).
int64_t engine_flat_size(const ModelConfig& m, const EngineLayout& e, int pp_rank = 0);

// ---- pipeline stages: the engine's own cut (parallel/pipeline_executor.h), for a model as the
// validation builds it; each real job also checks it against the run's `pp_stages` ----
// Relative forward + backward cost per token of every unit (parallel::unit_costs).
std::vector<double> engine_unit_costs(const ModelConfig& m);
// Units [first, last] of each of `stages` contiguous stages minimising the most expensive one (ties:
// the earlier cut). `m` as the engine builds it (engine_model: tp-padded vocabulary).
std::vector<std::pair<int, int>> engine_stage_partition(const ModelConfig& m, int stages);
std::string describe_stage_partition(const std::vector<std::pair<int, int>>& p);  // "units 0-2 | units 3-5"
// One flag per unit: the units pipeline rank `pp_rank` owns (all when pp = 1) — what the engine
// gives mt::Transformer's owned-units argument.
std::vector<char> engine_owned_units(const ModelConfig& m, const EngineLayout& e, int pp_rank);
// engine_unit_sizes of pp_rank's share: the units it does not own are 0.
std::vector<int64_t> engine_stage_unit_sizes(const ModelConfig& m, const EngineLayout& e, int pp_rank);
// Micro-batches whose activations a pipeline rank holds at once, i.e. the activation slots the
// executor creates (the schedule checker's peak_in_flight: GPipe M, 1F1B min(pp - r, M)); 1 without
// a pipeline.
int engine_activation_slots(const EngineLayout& e, int pp_rank);
// Bytes of one stage boundary's message (an activation or its gradient): B*T rows (B*T / tp with
// sequence parallelism) x C, fp32.
uint64_t engine_pp_message_bytes(const ModelConfig& m, const EngineLayout& e);
// Stage boundaries pipeline rank `pp_rank` sends or receives across (each one: an activation and a
// gradient per micro-batch).
int engine_pp_boundaries(const EngineLayout& e, int pp_rank);
// The tied GPT-2 embedding cut apart by the pipeline: [Vp/tp x C] rows of the token embedding.
bool engine_tied_split(const ModelConfig& m, const EngineLayout& e);
uint64_t engine_tied_rows_elems(const ModelConfig& m, const EngineLayout& e);

// Per-rank bytes by category between steps. Params / grads / optimizer are the planner's
// zero_model_state() over the padded flat size with fp32 gradients (grad_bytes 4), adjusted for the
// one policy the ZeRO table does not describe: ZeRO-3 / HSDP in bf16 keep no bf16 shard (0 params;
// the fp32 master is optimizer state). Activations and workspace are what the engine's model keeps
// for one micro-batch (see engine_activation_bytes).
struct EngineMemory {
  double params = 0, grads = 0, optimizer = 0, activations = 0, workspace = 0;
};
// With a pipeline: pipeline rank `pp_rank`'s stage; the last stage of a tied model adds the embedding
// replica (compute dtype, params) and its fp32 gradient (grads), the first stage the fp32 buffer that
// receives the head's gradient (grads); activations x engine_activation_slots().
EngineMemory engine_memory(const ModelConfig& m, const EngineLayout& e, int pp_rank = 0);
// Activation bytes the engine's Transformer keeps for backward (MemCategory::Activations): per
// stored block the norm inputs (compute dtype) and statistics, fused qkv, attention output (+ its
// bf16 copy), log-sum-exp, the second residual input, FFN pre-activation (and Llama's up
// projection) in fp32 and the FFN activation in the compute dtype; every unit's output; the head's
// input, statistics, fp32 logits and losses. With recomputation only the kept blocks store theirs,
// plus one scratch block.
// With sequence parallelism the norms' inputs, outputs and statistics, the residual and every
// unit's output hold B*T / tp rows. With a pipeline: the units of pp_rank's stage, per activation
// slot (engine_activation_slots), plus the recomputation scratch block once.
double engine_activation_bytes(const ModelConfig& m, const EngineLayout& e, int pp_rank = 0);
// Backward workspace (MemCategory::Workspace): the residual gradient and seven per-token scratch
// buffers, fp32 (+ with sequence parallelism the gathered rows, their gradient, the partial sums
// and the norms' gradient contributions).
double engine_workspace_bytes(const ModelConfig& m, const EngineLayout& e, int pp_rank = 0);

// Tensor parallelism's all-reduces (fp32 elements each, in issue order) of one training micro-batch
// (forward + backward) on the "tp" group: embedding (N x C, N = micro_batch x seq tokens); per block
// the attention and MLP row-parallel outputs (2 x N x C); the vocab-parallel cross-entropy's row
// maxima (N) and its sums of exponentials with the target logits (2 N); in backward the head's input
// gradient (N x C), per block the forward ones again when the block is recomputed, then the MLP and
// attention input gradients (2 x N x C). Empty when tp = 1.
// (Rank 0's units with a pipeline.) With sequence parallelism: the all-reduce ones of
// engine_tp_collectives.
std::vector<uint64_t> engine_tp_allreduces(const ModelConfig& m, const EngineLayout& e);
// Every collective of one micro-batch on the "tp" group for pipeline rank pp_rank's units, in issue
// order. `count`: elements of an all-reduce; for an all-gather / reduce-scatter this rank's part
// (R x C, R = B*T / tp), as collective_bytes() takes it. Without sequence parallelism:
// engine_tp_allreduces. With it, per micro-batch: embedding reduce-scatter; per block forward
// all-gather (ln1), reduce-scatter (attention), all-gather (ln2), reduce-scatter (MLP); head
// all-gather, the cross-entropy's N and 2N all-reduces; backward: head reduce-scatter + the final
// norm's gradient all-reduce (2C GPT-2, C Llama); per block (the recomputed forward's four again
// when recomputed) all-gather (output gradient), all-gather (ln2 re-gathered), reduce-scatter (MLP
// input gradient), norm-gradient all-reduce, and the same for attention; embedding all-gather of
// the input gradient.
struct TpCollective {
  Collective kind;
  uint64_t count;
  int elem_bytes = 4;  // activations travel in the compute dtype; statistics and gradients in fp32
  // Started before a matmul that does not need it and waited for after: the backward input-gradient
  // reductions (under the weight-gradient matmul) and, with sequence parallelism, the norm output's
  // re-gather (under the input-gradient matmul). Counted as hidden.
  bool overlapped = false;
};
std::vector<TpCollective> engine_tp_collectives(const ModelConfig& m, const EngineLayout& e, int pp_rank = 0);
// Seconds of those collectives per step (grad_accum micro-batches) on the cluster that the compute
// thread waits for: every collective on the critical path; the overlapped ones (above) count as
// hidden behind their matmul (as long as the other ranks' matmuls, the same size).
double engine_tp_seconds(const ModelConfig& m, const EngineLayout& e, const Cluster& c, int pp_rank = 0);

// The schedule's timeline (GPipe / 1F1B / interleaved 1F1B) with per-stage forward and backward
// seconds per micro-batch (stage s runs on rank s % pp; one stage per rank unless interleaved) and
// `msg_s` per stage-boundary message (delays the receiver).
struct PipeTimeline {
  double makespan = 0;
  std::vector<double> busy;  // per rank
  double bubble = 0;         // mean over ranks of 1 - busy / makespan (the engine's pp_bubble)
};
PipeTimeline engine_pp_timeline(const EngineLayout& e, const std::vector<double>& fwd_s, const std::vector<double>& bwd_s,
                                double msg_s);

// Bytes (the comm layer's algorithm volume, rank 0) per process-group name.
struct EngineComm {
  std::map<std::string, uint64_t> per_step;  // every training step
  std::map<std::string, uint64_t> setup;     // once per run: model check, DDP broadcast, final summary
  uint64_t total(const std::string& group, int64_t steps) const;
  uint64_t dp_per_step() const;              // gradient and parameter traffic only (no losses / norms / tp)
  uint64_t tp_per_step() const;              // the "tp" group (the model's activations)
};
// Volume of one collective as the comm layer counts it (integer bytes): all-reduce
// 2(n-1)/n x buffer, all-gather / reduce-scatter (n-1) x per-rank count (= (n-1)/n x full buffer),
// broadcast the buffer.
uint64_t collective_bytes(Collective kind, uint64_t count, int elem_bytes, int n);
uint64_t broadcast_bytes(uint64_t count, int elem_bytes, int n);
// The engine's collectives for a run: DDP buckets (first bucket capped at 1 MB, walking units from
// the head), ZeRO-1/2 per-unit reduce-scatter (fp32) and post-step all-gather (compute dtype),
// ZeRO-3 per-unit gathers in forward and backward (the head — and the tied embedding — stay
// gathered from their forward through their backward), per-unit reduce-scatters, the hybrid
// all-reduce of gradient shards across replicas, the gradient-norm and loss all-reduces, and the
// setup / summary traffic. With tp > 1 the data-parallel traffic is that of one tp rank's share over
// the dp group (ranks / tp), the "tp" group carries engine_tp_allreduces() every micro-batch, and
// "tp_aux" the gradient norm summed over the tp ranks (1 float per step); the mean loss is
// all-reduced over every rank only when there is more than one data-parallel rank. With a pipeline
// (rank 0 = the first stage is what the metrics report): the dp traffic of its stage's units; "pp"
// carries per micro-batch an activation and a gradient (engine_pp_message_bytes) across each of its
// boundaries, and per step the tied embedding's head gradient (fp32) in and its updated weights
// (compute dtype) out; "pp_aux" three 1-float all-reduces per step (loss, gradient norm, bubble).
EngineComm engine_comm(const ModelConfig& m, const EngineLayout& e);

// ---- ceilings ----------------------------------------------------------------------------------------

struct ComputeCeiling {
  double flops_per_s = 0;   // matmul + attention FLOPs (the planner's count) per second, per rank
  double gemm_flops_per_s = 0;  // the matmuls alone
  double mem_bw = 0;        // bytes/s per rank, streaming (triad)
  int procs = 0, threads = 0;
};
// Runs in this process: times the model's forward and backward matmuls (its exact shapes, one
// micro-batch, one tp rank's share when tp > 1) and its attention kernel (the rank's heads) for about
// `seconds`, and a triad over `stream_bytes`.
ComputeCeiling measure_compute_here(const ModelConfig& m, int64_t micro_batch, bool bf16, double seconds,
                                    double stream_bytes = 48e6, int tp = 1);

struct CommCeiling {
  int ranks = 0;
  double bw = 0;          // bytes per rank per second (nccl-tests busbw) at the layouts' sizes
  double latency_s = 0;   // per ring step
  bool busy = false;      // measured while one single-threaded compute process per rank ran (the
                          // job's conditions; used for the prediction), or on an otherwise idle machine
  std::string source;     // how it was measured
};

// ---- the validation run --------------------------------------------------------------------------------

struct ValidateOptions {
  std::string binary;        // the meshtrain executable (default: this process's executable)
  std::vector<EngineLayout> layouts;  // default: default_validation_layouts()
  int steps = 8;
  bool check_time = true;    // step time within time_tolerance (the command; the test skips it)
  double mem_tolerance = 0.10;
  double time_tolerance = 0.25;
  double probe_seconds = 0.4;
  int retries = 1;           // extra runs of a layout whose step time missed (noisy shared machines)
  std::string work_dir;      // default: a fresh directory under $TMPDIR, removed afterwards
  bool keep = false;         // keep work_dir (metrics, logs)
  std::ostream* progress = nullptr;  // one line per job as it runs
};

// DDP, ZeRO-1, ZeRO-2 (2 micro-batches), ZeRO-3 at 2 and 4 ranks, HSDP 2x2 in fp32 on gpt2-mini;
// DDP bf16 on gpt2-mini; ZeRO-3 bf16 with selective checkpointing on llama-mini (untied embeddings);
// tensor parallelism: tp = 2 alone on 2 ranks (NO_SHARD over one dp rank), and tp = 2 x ZeRO-3
// dp_shard = 2 on 4 ranks, fp32 gpt2-mini; tp = 2 with sequence parallelism on 2 ranks; pipelines
// (NO_SHARD, 4 micro-batches, fp32 gpt2-mini, tied embedding cut apart): pp = 2 1F1B, pp = 2 GPipe,
// and pp = 2 1F1B x DDP over 2 data-parallel ranks (4 ranks).
std::vector<EngineLayout> default_validation_layouts();
// The `--layouts` names of default_validation_layouts(), in the same order: ddp, zero1, zero2, zero3,
// zero3x4, hsdp, ddp-bf16, llama-zero3-bf16, tp2, tp2-zero3x4.
std::vector<std::string> validation_layout_names();

// Exact: to the byte (the model state). Within: mem_tolerance (activations). AtLeast: the model's own
// buffers, the kernels add scratch of their own (workspace). Info: measured only (comm buffers).
enum class MemCheck { Exact, Within, AtLeast, Info };
struct MemRow {
  std::string category;
  int pp_rank = -1;                    // the pipeline rank's stage it describes (-1: every rank)
  double predicted = 0, measured = 0;  // measured: the rank furthest from the prediction
  MemCheck check = MemCheck::Exact;
  bool ok = false;
};
struct CommRow {
  std::string group;
  uint64_t per_step = 0, setup = 0;    // predicted
  uint64_t measured_total = 0;         // comm_bytes_by_group
  double measured_per_step = 0;        // (measured_total - predicted setup) / steps
  bool ok = false;                     // measured_total == setup + steps x per_step
};
struct TimeRow {
  double predicted_s = 0, compute_s = 0, exposed_s = 0;
  double measured_s = 0;               // median step after the first
  double measured_min_s = 0, measured_max_s = 0;
  double measured_exposed_s = 0;       // median exposed_comm_ms (the engine's own measure)
  double tp_exposed_s = 0;             // of exposed_s: the tp all-reduces (engine_tp_seconds)
  double bubble_s = 0;                 // pipeline: idle time of the critical rank (timeline - its compute)
  double bubble_predicted = 0, bubble_measured = 0;  // pp_bubble: mean idle fraction over pp ranks
  double error = 0;                    // predicted / measured - 1
  double ceiling_drift = 0;            // compute ceiling after the job / before - 1
  bool checked = false, ok = false;
};
struct LayoutResult {
  EngineLayout layout;
  std::string error;                   // the job failed (then nothing else is valid)
  ComputeCeiling compute;
  CommCeiling comm_ceiling;
  CommCeiling tp_comm_ceiling;         // the link the tp all-reduces are charged on (idle when ranks <= cores)
  int64_t flat_predicted = 0, flat_measured = 0;  // rank 0's (the first stage's with a pipeline)
  std::string stages_predicted, stages_measured;  // pipeline: the stage cut ("units 0-2 | units 3-5")
  int slots_predicted = 0, slots_measured = 0;    // pipeline: rank 0's peak activation slots
  std::vector<MemRow> mem;
  std::vector<CommRow> comm;
  double textbook_dp_bytes = 0;        // estimate().comm for the same layout (the generic formula)
  TimeRow time;
  int attempts = 0;                    // jobs run (a step-time miss is retried `retries` times)
  double first_time_error = 0;         // the first attempt's error when it was retried
  bool ok = false;
};
struct ValidationReport {
  std::vector<CommCeiling> comm_ceilings;
  std::vector<LayoutResult> results;
  int cores = 0;
  double seconds = 0;
  bool ok = false;
};

// Runs everything above. Throws std::runtime_error when the binary or the data preparation fails.
ValidationReport run_validation(const ValidateOptions& o);
std::string format_validation(const ValidationReport& r);
std::string validation_json(const ValidationReport& r);

// `meshtrain plan --probe-compute` (internal): measure_compute_here, printed as one JSON line.
std::string compute_probe_json(const ComputeCeiling& c);

}  // namespace mt::plan
