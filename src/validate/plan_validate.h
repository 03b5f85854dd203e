// `meshtrain plan --validate`: the planner checked against this engine.
//
// The engine's exact figures come from the engine itself: `meshtrain train --dry-run --world N
// --rank R` builds rank R of the job on the count-only Meta device and reports its memory by
// category and its bytes by process group (docs/design.md, "Devices, kernel tables and the dry
// run"). The harness runs it as a subprocess (one dry run per process) and compares three things:
//
// 1. Small jobs this machine can run (gpt2-mini / llama-mini on 2-4 ranks): a real one-step job
//    (`meshtrain launch -n N -- train`) against the dry runs of its ranks: every rank's resident
//    bytes by category, rank 0's bytes by group, the flat size, the pipeline's stage cut and
//    activation slots - exactly (the CPU kernels' own `scratch` buffers are shown, not checked).
// 2. Step time of the same layouts: mt::plan::estimate() on a cluster built from ceilings measured
//    just before and after a job of `steps` steps (compute probes of the model's own matmul and
//    attention kernels, N at once; `bench comm` fitted to t = bytes / bw + ring steps x alpha),
//    against the median measured step - within 25%, one rerun on a miss.
// 3. The planner's own predictions, for those layouts and for large ones no machine here can run
//    (Llama 3 70B and 405B at 64-512 ranks): estimate()'s per-GPU memory by category and bytes per
//    step by group against the dry run of the first and the last pipeline stage. Reported, not
//    checked: the gaps are where the planner's model and the engine disagree.
#pragma once
#include <cstdint>
#include <map>
#include <ostream>
#include <string>
#include <vector>

#include "model/config/model_config.h"
#include "parallel/layout/parallel_config.h"
#include "parallel/layout/parallel_plan.h"
#include "plan/cluster.h"
#include "plan/cost_model.h"
#include "train/compute_probe.h"

namespace mt::validate {

using plan::Checkpointing;

// One job of the engine: what `meshtrain train` is given.
struct EngineLayout {
  std::string model = "gpt2-mini";   // model preset
  ShardingStrategy strategy = ShardingStrategy::NoShard;  // --parallel.strategy
  int ranks = 2;
  int tp = 1;                        // --parallel.tp: tensor-parallel degree (innermost mesh dimension)
  bool sequence_parallel = false;    // --parallel.sequence_parallel (needs tp > 1)
  int cp = 1;                        // --parallel.cp: context-parallel degree (between dp_shard and tp)
  int pp = 1;                        // --parallel.pp: pipeline ranks (outermost mesh dimension)
  PipelineSchedule pp_schedule = PipelineSchedule::OneFOneB;  // --parallel.pp_schedule
  int pp_virtual_stages = 1;         // --parallel.pp_virtual_stages (interleaved_1f1b: model chunks per rank)
  int dp_replicate = 1;              // HYBRID_*: replicas; the shard group is dp_ranks() / dp_replicate
  bool bf16 = false;                 // --train.dtype bf16 (bf16 compute, fp32 master, fp32 gradients)
  Checkpointing checkpointing = Checkpointing::None;
  int64_t micro_batch = 4;           // sequences per rank per micro-batch
  int64_t grad_accum = 1;            // micro-batches per step (with pp > 1: the schedule's)
  bool reduce_every_microbatch = true;  // --parallel.reduce_every_microbatch
  bool reshard_after_forward = true;
  double bucket_mb = 25.0;           // --parallel.bucket_mb (the engine's MB are 1e6 bytes)
  // Mixture of experts (0 experts = the preset's dense model): --model.moe_experts / moe_top_k,
  // --model.moe_capacity_factor / moe_pad_to_capacity and --parallel.ep. With ep > 1 the routed rows
  // a rank holds depend on the routing, which a dry run cannot see (it assumes an even spread):
  // activations, workspace and the ep group's bytes are then shown as info; the model state and
  // every other group's bytes stay exact. Padded to a capacity, every expert receives exactly its
  // capacity of rows from each rank whatever the routing: everything is checked exactly.
  int64_t moe_experts = 0, moe_top_k = 2;
  double moe_capacity_factor = 0;    // 0 = dropless
  bool moe_pad_to_capacity = false;  // needs moe_capacity_factor > 0
  int ep = 1;
  bool routing_dependent() const { return moe_experts > 0 && !moe_pad_to_capacity; }

  int dp_ranks() const;              // ranks / (tp x pp x cp): the ranks that see different data
  int pp_rank_of(int rank) const;    // pp is the outermost mesh dimension
  int virtual_stages() const;        // interleaved_1f1b: pp_virtual_stages, else 1
  int shard_size() const;            // ranks the parameters / gradients / optimizer are split over (x cp)
  int replicas() const;              // 1 unless hybrid
  bool hybrid() const { return is_hybrid(strategy); }
  std::string label() const;         // "ZeRO-3 x2 fp32 gpt2-mini", "DDP x1 pp2 1f1b fp32 accum4 gpt2-mini", ...
  // The engine's command line after `train` (without data / metrics paths).
  std::vector<std::string> train_args() const;
  // The engine's parallel plan for the job (what `train` builds from train_args()), dp_shard not
  // yet resolved (-1: check_plan resolves it).
  ParallelPlan plan() const;
};

// The planner's layout and setup for an engine job (DDP = dp_replicate x ranks for the planner,
// `dp_shard = ranks` for the engine's mesh).
plan::Layout planner_layout(const EngineLayout& e);
plan::TrainSetup planner_setup(const ModelConfig& m, const EngineLayout& e);
// Throws std::invalid_argument when the engine cannot run the layout.
void check_engine_layout(const EngineLayout& e);

// ---- the engine's figures: a dry run ----------------------------------------------------------------

// One rank's final metrics (a dry run's, or a real run's for that rank).
struct EngineFigures {
  int rank = 0;
  std::map<std::string, int64_t> peak, resident;  // bytes by memory category
  std::map<std::string, uint64_t> comm;           // bytes by group (the run's steps + one-off traffic)
  int64_t flat_size = 0;
  int shard_group_size = 0;
  std::string pp_stages;                          // "units 0-2 | units 3-5" (pipelines)
  int pp_slots = 0;                               // peak activation slots (pipelines)
};
// `binary train --dry-run --world e.ranks --rank rank <e.train_args()>`, its metrics written under
// `dir`. Throws std::runtime_error with the command's output when it fails.
EngineFigures dry_run(const std::string& binary, const EngineLayout& e, int rank, const std::string& dir);

// ---- the planner against the engine --------------------------------------------------------------

// One figure the planner predicts (or does not) next to the engine's.
struct GapRow {
  std::string what;        // "params", "activations", ..., "bytes dp", "bytes tp", ...
  double planner = 0;      // estimate(): per GPU, the heaviest pipeline stage; bytes per step
  double engine = 0;       // the dry run: the largest peak over the ranks run; rank 0's bytes
  bool modelled = true;    // false: the planner has no such figure (workspace, scratch, grad_norm, ...)
};
struct PlannerGaps {
  std::vector<GapRow> rows;
  double psi_planner = 0;           // estimate().psi_stage
  int64_t flat_engine = 0;          // the largest dry-run flat_size (elements of the heaviest stage)
  std::vector<int> ranks;           // the dry runs' ranks
  // The engine's bytes: the dry run's one step with the one-off traffic, or (after a timed job of
  // S steps) per step: (timed job - one-step job) / (S - 1), rank 0.
  bool bytes_per_step = false;
};
// `dry`: dry runs of the first rank of the first and of the last pipeline stage (one when pp = 1).
PlannerGaps compare_with_planner(const ModelConfig& m, const EngineLayout& e, const std::vector<EngineFigures>& dry);

// ---- ceilings ----------------------------------------------------------------------------------------

struct CommCeiling {
  int ranks = 0;
  double bw = 0;          // bytes per rank per second (nccl-tests busbw) at the layouts' sizes
  double latency_s = 0;   // per ring step
  bool busy = false;      // measured while one single-threaded compute process per rank ran (the
                          // job's conditions; used for the prediction), or on an otherwise idle machine
  std::string source;     // how it was measured
  // For a busy ceiling, the same ranks' idle figures: what blocking collectives see (tensor and
  // context parallelism: every rank at the collective, cores otherwise idle). 0: not measured.
  double sync_bw = 0, sync_latency_s = 0;
};

// ---- the validation run --------------------------------------------------------------------------------

struct ValidateOptions {
  std::string binary;        // the meshtrain executable (default: this process's executable)
  std::vector<EngineLayout> layouts;  // real jobs; default: default_validation_layouts()
  std::vector<EngineLayout> scale_layouts;  // dry runs only; default: default_scale_layouts()
  bool run_scale = true;     // false: no scale layouts
  int steps = 8;             // steps of the timed job
  bool measure_time = true;  // run the timed jobs and their ceiling probes (the tests skip them)
  bool check_time = true;    // fail on a step time outside time_tolerance (--no-time-check: report only)
  double time_tolerance = 0.25;
  double probe_seconds = 0.4;
  int retries = 1;           // extra runs of a layout whose step time missed (noisy shared machines)
  std::string work_dir;      // default: a fresh directory under $TMPDIR, removed afterwards
  bool keep = false;         // keep work_dir (metrics, logs)
  std::ostream* progress = nullptr;  // one line per job as it runs
};

// DDP, ZeRO-1, ZeRO-2 (2 micro-batches), ZeRO-3 at 2 and 4 ranks, HSDP 2x2 in fp32 on gpt2-mini;
// DDP bf16; ZeRO-3 bf16 with selective checkpointing on llama-mini (untied embeddings); tp = 2 alone
// and inside ZeRO-3 over 2 data-parallel ranks; tp = 2 with sequence parallelism (fp32 and bf16);
// pipelines (4 micro-batches, GPT-2's tied embedding cut apart): pp = 2 1F1B, GPipe, 1F1B x DDP over
// 2 data-parallel ranks, interleaved 1F1B with 2 chunks per rank.
std::vector<EngineLayout> default_validation_layouts();
// The `--layouts` names of default_validation_layouts(), in the same order.
std::vector<std::string> validation_layout_names();
// Layouts no machine here can run, compared through dry runs only: Llama 3 70B with ZeRO-3 x tp 8 on
// 64 ranks, HSDP 2 x 8 x tp 8 on 128, ZeRO-3 x tp 8 x pp 4 on 512; Llama 3 405B ZeRO-3 x tp 8 x pp 8
// on 512 and ZeRO-1 x tp 8 x pp 16 on 256 (bf16, full recomputation, sequence parallelism).
std::vector<EngineLayout> default_scale_layouts();
std::vector<std::string> scale_layout_names();  // the `--scale-layouts` names

// Exact: a real run's figure equal to the dry run's. Info: shown only (the kernels' scratch).
enum class MemCheck { Exact, Info };
struct MemRow {
  std::string category;
  int pp_rank = -1;                    // the pipeline rank's stage it describes (-1: every rank)
  double dry = 0, measured = 0;        // measured: the real run's rank furthest from its dry run
  MemCheck check = MemCheck::Exact;
  bool ok = false;
};
struct CommRow {
  std::string group;
  uint64_t dry = 0, measured = 0;      // rank 0, the one-step job and its dry run
  bool ok = false;
  bool info = false;                   // not checked (expert parallelism's routing-dependent exchange)
};
// The model of an engine job: its preset with the layout's MoE keys applied.
ModelConfig engine_model(const EngineLayout& e);
struct TimeRow {
  double predicted_s = 0, compute_s = 0, exposed_s = 0;
  double measured_s = 0;               // median step after the first
  double measured_min_s = 0, measured_max_s = 0;
  double measured_exposed_s = 0;       // median exposed_comm_ms (the engine's own measure)
  double tp_exposed_s = 0;             // of exposed_s: estimate()'s tensor-parallel part
  double bubble_s = 0;                 // estimate()'s pipeline bubble
  double bubble_predicted = 0, bubble_measured = 0;  // pp_bubble: idle fraction, formula / measured
  double error = 0;                    // predicted / measured - 1
  double ceiling_drift = 0;            // compute ceiling after the job / before - 1
  double steal = -1;                   // share of the machine's CPU time stolen by the hypervisor during the job (-1: unknown)
  bool checked = false, ok = false;
};
struct LayoutResult {
  EngineLayout layout;
  std::string error;                   // a job or dry run failed (then nothing else is valid)
  ComputeCeiling compute;
  CommCeiling comm_ceiling;
  int64_t flat_dry = 0, flat_measured = 0;        // rank 0's (the first stage's with a pipeline)
  std::string stages_dry, stages_measured;        // pipeline: the stage cut
  int slots_dry = 0, slots_measured = 0;          // pipeline: rank 0's peak activation slots
  std::vector<MemRow> mem;
  std::vector<CommRow> comm;
  PlannerGaps gaps;
  TimeRow time;
  int attempts = 0;                    // timed jobs run (a step-time miss is retried `retries` times)
  double first_time_error = 0;         // the first attempt's error when it was retried
  bool ok = false;
};
struct ScaleResult {
  EngineLayout layout;
  std::string error;
  PlannerGaps gaps;
  double seconds = 0;                  // the dry runs' wall time
};
struct ValidationReport {
  std::vector<CommCeiling> comm_ceilings;
  std::vector<LayoutResult> results;
  std::vector<ScaleResult> scale;
  int cores = 0;
  double seconds = 0;
  bool ok = false;
};

// Runs everything above. Throws std::runtime_error when the binary or the data preparation fails.
ValidationReport run_validation(const ValidateOptions& o);
std::string format_validation(const ValidationReport& r);
std::string validation_json(const ValidationReport& r);

}  // namespace mt::validate
