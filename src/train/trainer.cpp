#include "train/trainer.h"

#include <omp.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <numeric>
#include <optional>
#include <thread>

#include "comm/world.h"
#include "kernels/backend.h"
#include "model/transformer.h"
#include "parallel/mesh.h"
#include "parallel/optimizer.h"
#include "parallel/parallelize.h"
#include "runtime/clock.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/checkpoint_saver.h"
#include "train/auto_plan.h"
#include "train/chrome_trace.h"
#include "train/device_batches.h"
#include "data/data_loader.h"
#include "data/document_loader.h"
#include "train/job_agreement.h"
#include "train/metrics_processor.h"
#include "train/preflight.h"
#include "checkpoint/model_state.h"
#include "train/sampler.h"
#include "train/stop_signal.h"
#include "data/tokenizer.h"

namespace mt {

namespace {

// The training or validation data: one file or glob (BatchLoader, llm.c order) or a blend of
// several (BlendLoader, see data_loader.h).
struct AnyLoader {
  std::unique_ptr<TokenDataset> ds;
  std::unique_ptr<BatchLoader> plain;
  std::unique_ptr<BlendLoader> blend;
  std::unique_ptr<DocumentLoader> docs;  // data.packing = false
  void next(int32_t* x, int32_t* y) {
    if (blend) blend->next(x, y);
    else plain->next(x, y);
  }
  void reset() {
    if (docs) docs->reset();
    else if (blend) blend->reset();
    else plain->reset();
  }
  int64_t total_tokens() const { return blend ? blend->total_tokens() : ds->total_tokens(); }
  bool has_masks() const { return blend ? blend->has_masks() : ds->has_masks(); }
  // Targets that may be -1 (loss masks, or the padding of unpacked data): the loss is the mean over
  // the trained ones.
  bool masked_targets() const { return docs || has_masks(); }
  double bytes_per_token() const { return ds ? ds->bytes_per_token() : 0.0; }  // 0: unknown
};

std::unique_ptr<AnyLoader> make_loader(const std::string& spec, const char* key, int B, int T, int dp_rank,
                                       int dp_world, uint64_t seed, bool shuffle, int64_t vocab) {
  auto l = std::make_unique<AnyLoader>();
  try {
    check_data_spec(spec, key, vocab);  // a missing file, a directory, shards of a larger vocabulary
  } catch (const std::invalid_argument& e) {
    throw ConfigError(e.what());
  }
  if (is_blend_spec(spec)) {
    try {
      l->blend = std::make_unique<BlendLoader>(spec, key, B, T, dp_rank, dp_world, seed, shuffle, vocab);
    } catch (const std::invalid_argument& e) {
      throw ConfigError(e.what());
    }
    return l;
  }
  l->ds = std::make_unique<TokenDataset>(spec, vocab);
  l->plain = std::make_unique<BatchLoader>(*l->ds, B, T, dp_rank, dp_world);
  if (shuffle) l->plain->set_shuffle(seed);
  return l;
}

// data.packing = false: one document per sample (data/document_loader.h).
std::unique_ptr<AnyLoader> make_document_loader(const std::string& spec, const char* key, const DocumentBatching& o,
                                                int64_t vocab) {
  auto l = std::make_unique<AnyLoader>();
  try {
    check_data_spec(spec, key, vocab);
  } catch (const std::invalid_argument& e) {
    throw ConfigError(e.what());
  }
  if (is_blend_spec(spec))
    throw ConfigError(std::string(key) + " is a blend, which data.packing = false does not read yet: give one file or "
                      "glob, or set data.packing = true");
  l->ds = std::make_unique<TokenDataset>(spec, vocab);
  try {
    l->docs = std::make_unique<DocumentLoader>(*l->ds, o);
  } catch (const std::runtime_error& e) {
    throw ConfigError(std::string(key) + ": " + e.what());
  }
  return l;
}

// One training job on this rank (torchtitan's Trainer): build() makes the plan and its groups, the
// data, and the parallel model (parallelize(), parallel/parallelize.h); load_state() the initial or
// resumed state; train_step() one optimizer step through the ParallelModel, which owns the step's
// collectives (loss reduction, global gradient norm); evaluate(), save() and report() do what they
// say, the metrics assembled and reported by the MetricsProcessor (train/metrics_processor.h). A dry run (run_train_command set up a Meta world and device) builds
// rank R of the job alone, without data files, and prints and writes what rank 0 would.
class Trainer {
 public:
  explicit Trainer(const RunConfig& cfg) : cfg_(cfg), tc_(cfg.train) {}
  TrainResult run();

 private:
  void build();
  void check_train_config();
  void check_unpacked_config();
  void make_loaders();
  void make_checkpointing();
  void load_state();
  void train_step(int64_t step);
  double evaluate();
  void save();
  void report();
  void sample();
  void maybe_inject_fault(int64_t step);
  void read_slow_rank();
  void adopt_measured_pipeline_costs(const parallel::StepResult& r);
  // The next micro-batch of this data-parallel rank (token 0 everywhere in a dry run). Returns its
  // length per sequence on this rank (T_, or with data.packing = false the padded length / cp).
  int64_t next_batch(int32_t* x, int32_t* y);
  void prefetch_batches();
  // data.packing = false: the separator that starts a document, and the loaders' batching.
  DocumentBatching document_batching(bool train) const;
  // data.packing = false: the loader's B x L sequences (L its return) into this rank's x, y
  // (cp > 1: its chunks; the rest of the B x T_ buffers pad). Returns the local length and adds
  // the samples' tokens and the B x L positions to step_real_ / step_positions_.
  int64_t take_document_batch(AnyLoader& l, int32_t* x, int32_t* y);
  // cp > 1: this rank's chunks of full_x_ / full_y_ into x, y.
  void local_tokens(int32_t* x, int32_t* y);
  // Loss masks: the trained targets (>= 0) of `n` micro-batches of every rank's data, summed
  // over the data-parallel x cp ranks (one collective over the world).
  int64_t global_trained(const std::vector<std::vector<int32_t>>& ys, int64_t n);
  // The loss weight that makes the loss the mean over `trained` targets of n micro-batches.
  double mask_weight(int64_t trained, int64_t n) const;
  const RunConfig& cfg_;
  const RunConfig::Train& tc_;
  comm::World* W_ = nullptr;
  int rank_ = 0, world_ = 1;
  bool dry_ = false, log_ = false;
  bool flash_attn_ = false;  // model.attention_kernel resolved
  bool fused_mlp_ = false;   // model.mlp_kernel resolved
  bool res_bf16_ = false;    // model.residual_dtype resolved
  bool logits_bf16_ = false;  // model.logits_dtype resolved
  ModelConfig mc_;
  ParallelPlan plan_;
  ParallelGroups groups_;
  DType dt_ = DType::F32;
  int threads_ = 1;
  int64_t B_ = 0, T_ = 0, accum_ = 1;
  bool unpacked_ = false;                 // data.packing = false
  int32_t doc_separator_ = -1;            // unpacked: the token that starts a document
  std::vector<int64_t> lens_;             // unpacked: the step's micro-batch lengths on this rank
  int64_t step_real_ = 0, step_positions_ = 0;  // unpacked: this rank's sample tokens and B x L positions
  std::vector<int64_t> next_lens_;        // on a GPU: the same of the next step's batches (read ahead)
  int64_t next_real_ = 0, next_positions_ = 0;
  std::unique_ptr<AnyLoader> loader_, val_loader_;
  int64_t T_full_ = 0;                                     // tokens per sequence (T_ = T_full_ / cp per rank)
  std::vector<int32_t> full_x_, full_y_;                   // cp > 1: the loader's whole sequences
  std::unique_ptr<parallel::ParallelModel> pm_;            // the plan applied to the model
  Transformer* model_ = nullptr;
  parallel::Strategy* strategy_ = nullptr;
  parallel::ExpertParallel* ep_ = nullptr;  // expert parallelism (null when ep = 1)
  std::unique_ptr<Transformer> ref_;
  std::unique_ptr<Transformer> base_layout_;  // LoRA initialised from a base model: the file's layout
  std::unique_ptr<ModelState> state_;
  std::unique_ptr<CheckpointSaver> saver_;  // sharded checkpoints
  std::unique_ptr<ChromeTrace> trace_;
  std::unique_ptr<TracingHooks> tracing_;
  std::unique_ptr<MetricsProcessor> metrics_;
  std::unique_ptr<DeviceBatches> dbatch_;  // train.device = cuda: the step's inputs and loss on the GPU
  bool gpu_job_ = false;                   // train.device = cuda (a dry run of one too)
  int64_t run_first_step_ = 0;             // the step this run (or resumed run) started at
  std::vector<Tensor> dry_batches_;        // a dry run of a GPU job: dbatch_'s device buffers, on Meta
  TrainerState st_;

  std::vector<std::vector<int32_t>> xs_, ys_;  // the step's micro-batches
  std::vector<std::vector<int32_t>> next_xs_, next_ys_;  // on a GPU: the next step's, read one step ahead
  TrainResult res_;
  std::optional<double> val_start_;  // train.eval_at_start
  double val_bytes_per_token_ = 0;   // 0: the val shards do not record their text (no bits per byte)
  nlohmann::json load_info_;         // how the resumed checkpoint was loaded (final metrics)
  double full_save_ms_ = 0;          // train.checkpoint_format = full
  std::optional<int64_t> trained_total_;  // loss masks: targets trained by this run's steps
  int64_t full_saves_ = 0;
  struct {
    std::string part;  // MESHTRAIN_TEST_SLOW_RANK on this rank: "data_wait" | "compute" ("" = none)
    int64_t ms = 0;
  } slow_;
};

namespace {
// train.device: the job's device, CPU or CUDA, or the reason cuda cannot be used (one process on
// one GPU; a dry run, on Meta, models either device and needs no GPU).
Device train_device(const std::string& name, bool dry, int world) {
  Device d = Device::CPU;
  if (!parse_device(name, &d) || d == Device::Meta)
    throw ConfigError("train.device must be cpu or cuda, got '" + name + "'");
  if (d != Device::CUDA || dry) return d;
  std::string why;
  if (!device_available(Device::CUDA, &why)) throw ConfigError("train.device = cuda: " + why);
  if (world > 1)
    throw ConfigError("train.device = cuda trains in one process on one GPU, but this job has " + std::to_string(world) +
                      " ranks: run it without mpirun, or use train.device = cpu (several GPUs need NCCL, not built "
                      "yet; docs/gpu.md)");
  return d;
}
// model.attention_kernel: true for the bf16 (flash) attention kernels. auto = flash for bf16 on
// train.device = cuda (the dry run decides from the key, as the real run does), without context
// parallelism (also with document masking: the flash kernels take the document starts); reference
// otherwise.
bool use_flash_attention(const RunConfig& cfg, DType dt, int64_t cp, bool cuda) {
  const std::string& k = cfg.model.attention_kernel;
  if (k == "auto") return dt == DType::BF16 && cuda && cp <= 1;
  if (k == "reference") return false;
  if (k != "flash") throw ConfigError("model.attention_kernel must be auto, flash or reference, got '" + k + "'");
  if (dt != DType::BF16)
    throw ConfigError("model.attention_kernel = flash takes bf16 q, k, v: set train.dtype = bf16, or use auto / reference");
  if (cp > 1)
    throw ConfigError("model.attention_kernel = flash does not run with context parallelism (parallel.cp = " +
                      std::to_string(cp) + "): use auto or reference");
  return true;
}

// model.mlp_kernel: true for the bf16 MLP with bf16 pre-activations (ModelOptions::gelu_epilogue):
// GPT-2's fused GELU epilogues, Llama's bf16 gate / up and SwiGLU. auto = fused in bf16 on
// train.device = cuda where the fused ops apply (one rank of tensor and pipeline parallelism, no
// LoRA adapters); unfused otherwise, so CPU runs are unchanged.
bool use_fused_mlp(const RunConfig& cfg, const ModelConfig& mc, DType dt, const ParallelPlan& plan, bool cuda) {
  const std::string& k = cfg.model.mlp_kernel;
  const bool applies = dt == DType::BF16 && plan.tp <= 1 && plan.pp <= 1 && !mc.lora();
  if (k == "auto") return applies && cuda;
  if (k == "unfused") return false;
  if (k != "fused") throw ConfigError("model.mlp_kernel must be auto, fused or unfused, got '" + k + "'");
  if (dt != DType::BF16)
    throw ConfigError("model.mlp_kernel = fused keeps the MLP's activations in bf16: set train.dtype = bf16, or use "
                      "auto / unfused");
  if (plan.tp > 1 || plan.pp > 1 || mc.lora())
    throw ConfigError("model.mlp_kernel = fused runs without tensor or pipeline parallelism and without LoRA "
                      "adapters (parallel.tp = " + std::to_string(plan.tp) + ", parallel.pp = " +
                      std::to_string(plan.pp) + "): use auto or unfused");
  return true;
}

// An activation dtype key (model.residual_dtype, model.logits_dtype: auto | fp32 | bf16): true for
// bf16. auto = bf16 for bf16 runs on train.device = cuda where the choice `applies`; fp32 otherwise,
// so CPU runs are unchanged. bf16 needs bf16 compute, and where it does not apply it is refused:
// "<key> = bf16 <refusal>: use auto or fp32".
bool use_bf16_dtype(const char* key, const std::string& k, bool cuda, DType dt, bool applies,
                    const std::string& refusal) {
  if (k == "auto") return dt == DType::BF16 && applies && cuda;
  if (k == "fp32") return false;
  if (k != "bf16") throw ConfigError(std::string(key) + " must be auto, fp32 or bf16, got '" + k + "'");
  if (dt != DType::BF16)
    throw ConfigError(std::string(key) + " = bf16 needs bf16 compute: set train.dtype = bf16, or use auto / fp32");
  if (!applies) throw ConfigError(std::string(key) + " = bf16 " + refusal + ": use auto or fp32");
  return true;
}

// model.residual_dtype: the residual stream in bf16 (ModelOptions::residual_bf16), with one
// model-parallel rank (tp = pp = cp = 1).
bool use_bf16_residual(const RunConfig& cfg, DType dt, const ParallelPlan& plan, bool cuda) {
  return use_bf16_dtype("model.residual_dtype", cfg.model.residual_dtype, cuda, dt,
                        plan.tp <= 1 && plan.pp <= 1 && plan.cp <= 1,
                        "runs with one model-parallel rank (parallel.tp = " + std::to_string(plan.tp) +
                            ", parallel.pp = " + std::to_string(plan.pp) + ", parallel.cp = " +
                            std::to_string(plan.cp) + ")");
}

// model.logits_dtype: the LM head's logits in bf16 (ModelOptions::logits_bf16), where the head's
// bf16 gradient applies (the whole vocabulary on one rank: tp = 1, no train.loss_chunk_tokens).
bool use_bf16_logits(const RunConfig& cfg, DType dt, const ParallelPlan& plan, bool cuda) {
  return use_bf16_dtype("model.logits_dtype", cfg.model.logits_dtype, cuda, dt,
                        plan.tp <= 1 && cfg.train.loss_chunk_tokens == 0,
                        "needs the whole vocabulary's logits on one rank (parallel.tp = " + std::to_string(plan.tp) +
                            ", train.loss_chunk_tokens = " + std::to_string(cfg.train.loss_chunk_tokens) + ")");
}

parallel::ParallelizeOptions parallelize_options(const RunConfig& cfg, DType dt, bool flash, bool fused_mlp,
                                                 bool res_bf16, bool logits_bf16) {
  const RunConfig::Train& tc = cfg.train;
  parallel::ParallelizeOptions po;
  po.dtype = dt;
  po.spec.bucket_mb = cfg.parallel.bucket_mb;
  po.spec.reshard_after_forward = cfg.parallel.reshard_after_forward;
  po.spec.prefetch = static_cast<int>(cfg.parallel.prefetch);
  po.spec.reduce_every_microbatch = cfg.parallel.reduce_every_microbatch;
  po.spec.adam = AdamWConfig{tc.lr, tc.beta1, tc.beta2, tc.eps, tc.weight_decay};
  po.tp_overlap = cfg.parallel.tp_overlap;
  po.loss_chunk_tokens = tc.loss_chunk_tokens;
  po.pp_partition = cfg.parallel.pp_partition;
  po.pp_costs = cfg.pp_stage_costs();
  po.flash_attention = flash;
  po.gelu_epilogue = fused_mlp;
  po.residual_bf16 = res_bf16;
  po.logits_bf16 = logits_bf16;
  po.spec.variable_lengths = !cfg.data.packing;
  return po;
}

}  // namespace

void Trainer::build() {
  W_ = &comm::World::init(nullptr, nullptr);
  rank_ = W_->rank();
  world_ = W_->size();
  dry_ = W_->is_meta();
  log_ = dry_ || comm::should_print(rank_);
  mc_ = cfg_.model_config();
  const int tp = cfg_.parallel.tp > 0 ? static_cast<int>(cfg_.parallel.tp) : 1;
  if (tp > 1) mc_.padded_vocab = padded_vocab_for_tp(mc_.vocab_size, tp);
  plan_ = cfg_.parallel_plan(mc_, world_);
  groups_ = ParallelGroups::build(*W_, plan_);
  check_train_config();
  read_slow_rank();
  B_ = tc_.micro_batch;
  T_full_ = mc_.seq_len;
  T_ = T_full_ / plan_.cp;  // context parallelism: this rank's two chunks of every sequence
  accum_ = plan_.microbatches;
  // Every rank runs the same job (config, build, data), checked before anything is loaded.
  verify_same_job(*groups_.metrics, job_items(cfg_, mc_, !dry_), "configuration");
  // Before the model allocates: does every rank's dry-run peak fit? (In the meshtrain binary only:
  // the same decision on every rank, since every rank runs the same binary.)
  // A dry run makes the check's one collective only (its bytes per group are a real run's).
  if (tc_.preflight && (dry_ || !dry_run_binary().empty()))
    memory_preflight(cfg_, mc_, *groups_.metrics,
                     {.rank = rank_, .world = world_, .local_ranks = W_->local_size(), .host = W_->hostname(),
                      .device = current_device(),
                      .tokens_per_step = B_ * T_full_ * accum_ * plan_.dp(),
                      .count_only = dry_});
  if (cfg_.data.document_separator < -1 || cfg_.data.document_separator >= mc_.vocab_size)
    throw ConfigError("data.document_separator must be -1 or a token id below model.vocab_size (" +
                      std::to_string(mc_.vocab_size) + "), got " + std::to_string(cfg_.data.document_separator));
  unpacked_ = !cfg_.data.packing;
  check_unpacked_config();
  make_loaders();
  try {
    pm_ = parallel::parallelize(mc_, plan_, groups_,
                                parallelize_options(cfg_, dt_, flash_attn_, fused_mlp_, res_bf16_, logits_bf16_));
  } catch (const PlanError& e) {
    throw ConfigError(e.what());
  }
  model_ = &pm_->model();
  if (cfg_.data.document_masking) {
    int64_t sep = cfg_.data.document_separator;
    if (sep < 0) sep = make_tokenizer(cfg_.data.tokenizer, cfg_.data.gpt2_dir, cfg_.data.tokenizer_file)->document_separator();
    if (sep < 0 || sep >= mc_.vocab_size)
      throw ConfigError("data.document_masking: data.tokenizer = " + cfg_.data.tokenizer +
                        " gives no document separator inside the vocabulary: set data.document_separator");
    model_->set_document_masking(static_cast<int32_t>(sep));
  }
  strategy_ = &pm_->strategy();
  ep_ = pm_->experts();
  // The unsplit, unpadded layout of the same model: what checkpoints and initialisation use.
  ref_ = std::make_unique<Transformer>(
      mc_, ModelOptions{.storage = {.weights = false, .master = false, .grads = false}});
  trace_ = std::make_unique<ChromeTrace>(cfg_.log.trace_out, rank_);
  tracing_ = std::make_unique<TracingHooks>(strategy_->hooks(), trace_.get(), model_);
  if (trace_->enabled()) model_->set_hooks(tracing_.get());
  state_ = std::make_unique<ModelState>(*model_, *ref_, *strategy_, *groups_.tp_aux, groups_.pp_aux.get());
  state_->set_expert_parallel(ep_);
  make_checkpointing();
  xs_.assign(static_cast<size_t>(accum_), std::vector<int32_t>(static_cast<size_t>(B_ * T_)));
  ys_ = xs_;
  if (current_device() == Device::CUDA) {
    next_xs_ = xs_;
    next_ys_ = xs_;
    dbatch_ = std::make_unique<DeviceBatches>(*model_, accum_, B_ * T_);
    pm_->set_device_norm(dbatch_->norm_slot());
  } else if (dry_ && gpu_job_) {
    dry_batches_ = DeviceBatches::device_buffers(current_device(), accum_, B_ * T_);
  }
}

void Trainer::check_train_config() {
  if (!parse_dtype(tc_.dtype, &dt_) || is_integer(dt_)) throw ConfigError("train.dtype must be fp32 or bf16, got '" + tc_.dtype + "'");
  // The job's device, before anything allocates (a dry run keeps Meta).
  const Device job_device = train_device(tc_.device, dry_, world_);
  gpu_job_ = job_device == Device::CUDA;
  if (!dry_) set_current_device(job_device);
  if (plan_.offload_optimizer()) {
    if (!gpu_job_)
      throw ConfigError("train.offload = optimizer: with train.device = " + tc_.device +
                        " the optimizer state is already in host memory (the whole model trains there), so there is "
                        "nothing to offload: use train.offload = none, or train.device = cuda");
    if (world_ > 1)
      throw ConfigError("train.offload = optimizer runs on one GPU (one rank) so far, but this job has " +
                        std::to_string(world_) + " ranks: run it on one rank, or without train.offload");
  }
  kernels::require_ops(tc_.device, {.llama = mc_.arch == Arch::Llama, .rope_scaled = mc_.rope_scaled(),
                                    .bf16 = dt_ == DType::BF16, .tensor_parallel = plan_.tp > 1,
                                    .sequence_parallel = plan_.sequence_parallel, .context_parallel = plan_.cp > 1,
                                    .moe = mc_.moe()});
  flash_attn_ = use_flash_attention(cfg_, dt_, plan_.cp, gpu_job_);
  fused_mlp_ = use_fused_mlp(cfg_, mc_, dt_, plan_, gpu_job_);
  res_bf16_ = use_bf16_residual(cfg_, dt_, plan_, gpu_job_);
  logits_bf16_ = use_bf16_logits(cfg_, dt_, plan_, gpu_job_);
  if (tc_.micro_batch < 1) throw ConfigError("train.micro_batch must be >= 1");
  if (tc_.grad_accum < 1) throw ConfigError("train.grad_accum must be >= 1");
  if (tc_.steps < 0) throw ConfigError("train.steps must be >= 0");
  if (tc_.loss_chunk_tokens < 0) throw ConfigError("train.loss_chunk_tokens must be >= 0 (0 = off)");
  (void)lr_at(0, tc_.steps, tc_.warmup_steps, tc_.lr, tc_.min_lr_ratio, tc_.lr_schedule);  // validates the schedule name
  threads_ = tc_.threads > 0 ? static_cast<int>(tc_.threads) : std::max(1, hardware_threads() / W_->local_size());
  omp_set_num_threads(threads_);
}

// data.packing = false and its keys; the document separator.
void Trainer::check_unpacked_config() {
  const RunConfig::Data& d = cfg_.data;
  if (d.group_by_length && !unpacked_)
    throw ConfigError("data.group_by_length = true groups documents by length, which needs data.packing = false "
                      "(packed rows all hold seq_len tokens)");
  if (!unpacked_) return;
  if (d.pad_to_multiple < 0)
    throw ConfigError("data.pad_to_multiple must be >= 0 (0 = pad every micro-batch to seq_len), got " +
                      std::to_string(d.pad_to_multiple));
  if (d.length_group_window < 1)
    throw ConfigError("data.length_group_window must be >= 1 (global batches per sorted megabatch), got " +
                      std::to_string(d.length_group_window));
  if (d.document_masking)
    throw ConfigError("data.document_masking is for packed rows; with data.packing = false every row already holds one "
                      "document: set data.document_masking = false");
  if (mc_.moe())
    throw ConfigError("data.packing = false does not run mixture-of-experts models yet (the routers would see the "
                      "padding): set data.packing = true");
  int64_t sep = d.document_separator;
  if (sep < 0) sep = make_tokenizer(d.tokenizer, d.gpt2_dir, d.tokenizer_file)->document_separator();
  if (sep < 0 || sep >= mc_.vocab_size)
    throw ConfigError("data.packing = false: data.tokenizer = " + d.tokenizer +
                      " gives no document separator inside the vocabulary: set data.document_separator");
  doc_separator_ = static_cast<int32_t>(sep);
}

DocumentBatching Trainer::document_batching(bool train) const {
  DocumentBatching o;
  o.B = static_cast<int>(B_);
  o.T = static_cast<int>(T_full_);
  o.accum = train ? static_cast<int>(accum_) : 1;
  o.dp_rank = groups_.data_rank;
  o.dp_world = groups_.data_world;
  // Lengths every layout can run: whole chunks for context parallelism, rows the tensor-parallel
  // ranks split evenly for sequence parallelism (seq_len itself satisfies both: parallel/mesh.cpp).
  int64_t mult = cfg_.data.pad_to_multiple;
  if (mult > 0 && plan_.cp > 1) mult = std::lcm(mult, int64_t{2} * plan_.cp);
  if (mult > 0 && plan_.sequence_parallel) mult = std::lcm(mult, int64_t{plan_.tp} / std::gcd(B_, int64_t{plan_.tp}));
  o.multiple = mult;
  o.separator = doc_separator_;
  o.shuffle = train && cfg_.data.shuffle;
  o.seed = static_cast<uint64_t>(tc_.seed);
  o.group_by_length = train && cfg_.data.group_by_length;
  o.window = cfg_.data.length_group_window;
  return o;
}

// The cp ranks of one data-parallel rank read the same sequences (and keep their own chunks).
void Trainer::make_loaders() {
  if (!dry_ && unpacked_) {
    loader_ = make_document_loader(cfg_.data.train, "data.train", document_batching(true), mc_.vocab_size);
    if (!cfg_.data.val.empty() && (tc_.eval_every > 0 || tc_.eval_at_start))
      val_loader_ = make_document_loader(cfg_.data.val, "data.val", document_batching(false), mc_.vocab_size);
    if (log_)
      std::printf("unpacked data: %lld documents, %lld steps per epoch%s\n",
                  static_cast<long long>(loader_->docs->num_documents()),
                  static_cast<long long>(loader_->docs->steps_per_epoch()),
                  cfg_.data.group_by_length ? ", grouped by length" : "");
  } else if (!dry_) {
    const uint64_t seed = static_cast<uint64_t>(tc_.seed);
    const int B = static_cast<int>(B_), T = static_cast<int>(T_full_);
    loader_ = make_loader(cfg_.data.train, "data.train", B, T, groups_.data_rank, groups_.data_world, seed,
                          cfg_.data.shuffle, mc_.vocab_size);
    if (!cfg_.data.val.empty() && (tc_.eval_every > 0 || tc_.eval_at_start))
      val_loader_ = make_loader(cfg_.data.val, "data.val", B, T, groups_.data_rank, groups_.data_world, seed, false,
                                mc_.vocab_size);
  }
  if (plan_.cp > 1) {
    full_x_.resize(static_cast<size_t>(B_ * T_full_));
    full_y_.resize(full_x_.size());
  }
}

void Trainer::make_checkpointing() {
  const std::string& ckpt_format = tc_.checkpoint_format;
  if (ckpt_format != "sharded" && ckpt_format != "full")
    throw ConfigError("train.checkpoint_format must be sharded or full, got '" + ckpt_format + "'");
  if (tc_.checkpoint_async && ckpt_format != "sharded")
    throw ConfigError("train.checkpoint_async needs train.checkpoint_format = \"sharded\"");
  if (!tc_.checkpoint_dir.empty() && ckpt_format == "sharded") {
    const nlohmann::json layout = {{"world", world_},
                                   {"strategy", strategy_->name()},
                                   {"dp_replicate", plan_.dp_replicate},
                                   {"dp_shard", plan_.dp_shard},
                                   {"cp", plan_.cp},
                                   {"tp", plan_.tp},
                                   {"pp", plan_.pp},
                                   {"ep", plan_.ep},
                                   {"dtype", dtype_name(dt_)}};
    const std::map<std::string, std::string> coords = {{"rank", std::to_string(rank_)},
                                                       {"world", std::to_string(world_)},
                                                       {"dp_rank", std::to_string(groups_.data_rank)},
                                                       {"cp_rank", std::to_string(groups_.cp ? groups_.cp->rank() : 0)},
                                                       {"tp_rank", std::to_string(groups_.tp->rank())},
                                                       {"ep_rank", std::to_string(groups_.ep ? groups_.ep->rank() : 0)},
                                                       {"pp_rank", std::to_string(groups_.pp_rank)}};
    saver_ = std::make_unique<CheckpointSaver>(*state_, *ref_, *groups_.metrics, rank_, tc_.checkpoint_dir,
                                               tc_.checkpoint_async, cfg_.checkpoint_record(), layout, coords);
  }
}

int64_t Trainer::next_batch(int32_t* x, int32_t* y) {
  if (!loader_) {
    std::fill(x, x + B_ * T_, 0);
    std::fill(y, y + B_ * T_, 0);
  } else if (unpacked_) {
    return take_document_batch(*loader_, x, y);
  } else if (plan_.cp > 1) {
    loader_->next(full_x_.data(), full_y_.data());
    local_tokens(x, y);
  } else {
    loader_->next(x, y);
  }
  return T_;
}

int64_t Trainer::take_document_batch(AnyLoader& l, int32_t* x, int32_t* y) {
  int64_t real = 0, L = 0;
  if (plan_.cp == 1) {
    L = l.docs->next(x, y, &real);
  } else {
    L = l.docs->next(full_x_.data(), full_y_.data(), &real);
    std::fill(x, x + B_ * T_, 0);
    std::fill(y, y + B_ * T_, -1);
    const int r = groups_.cp->rank();
    cp_take_local(full_x_.data(), x, B_, L, r, plan_.cp);
    cp_take_local(full_y_.data(), y, B_, L, r, plan_.cp);
  }
  step_real_ += real;
  step_positions_ += B_ * L;
  return L / plan_.cp;
}

void Trainer::local_tokens(int32_t* x, int32_t* y) {
  const int r = groups_.cp->rank();
  cp_take_local(full_x_.data(), x, B_, T_full_, r, plan_.cp);
  cp_take_local(full_y_.data(), y, B_, T_full_, r, plan_.cp);
}

int64_t Trainer::global_trained(const std::vector<std::vector<int32_t>>& ys, int64_t n) {
  int64_t c = 0;
  for (int64_t m = 0; m < n; ++m)
    for (int64_t i = 0; i < B_ * T_; ++i) c += ys[static_cast<size_t>(m)][static_cast<size_t>(i)] >= 0;
  groups_.metrics->all_reduce(&c, 1, DType::I64, comm::ReduceOp::Sum)->wait();
  // Every data share (a data-parallel x cp rank) is held by world / D ranks (tp x pp).
  return c * groups_.dp->size() / world_;
}

double Trainer::mask_weight(int64_t trained, int64_t n) const {
  if (trained <= 0) return 0.0;  // nothing trained in this step: no loss, no gradient
  return static_cast<double>(groups_.dp->size()) * static_cast<double>(B_ * T_ * n) / static_cast<double>(trained);
}

namespace {
// LoRA and train.resume: a checkpoint resumes only into a run with the same adapters (its
// config.toml's [lora] against this run's); otherwise one line says what to do.
void check_lora_resume(const std::string& dir, const ModelConfig& mc) {
  if (!std::filesystem::exists(checkpoint_config_toml(dir))) return;  // nothing recorded: the tensor checks decide
  RunConfig c;
  try {
    c = load_checkpoint_config(dir);
  } catch (const std::exception&) {
    return;  // an unreadable record: the tensor checks decide
  }
  const bool ck = c.lora.rank > 0;
  auto num = [](double v) {
    char b[32];
    std::snprintf(b, sizeof b, "%g", v);
    return std::string(b);
  };
  const std::string ckdesc = "lora.rank " + std::to_string(c.lora.rank) + ", lora.alpha " + num(c.lora.alpha) +
                             ", lora.targets " + c.lora.targets;
  if (ck && !mc.lora())
    throw ConfigError("train.resume: " + dir + " is a LoRA checkpoint (" + ckdesc +
                      ") and this run has no adapters (lora.rank = 0): resume with the checkpoint's [lora] settings, "
                      "or export it merged (meshtrain export) and start from that with train.init_from");
  if (!ck && mc.lora())
    throw ConfigError("train.resume: " + dir + " holds no LoRA adapters and this run has lora.rank = " +
                      std::to_string(mc.lora_rank) + ": to train adapters on that model use train.init_from " + dir +
                      " instead of train.resume, or resume it with lora.rank = 0");
  if (!ck) return;
  uint32_t targets = 0;
  try {
    targets = parse_lora_targets(c.lora.targets, mc.arch);
  } catch (const std::invalid_argument&) {
  }
  const float alpha = c.lora.alpha > 0 ? static_cast<float>(c.lora.alpha) : static_cast<float>(c.lora.rank);
  const float run_alpha = mc.lora_alpha > 0 ? mc.lora_alpha : static_cast<float>(mc.lora_rank);
  if (c.lora.rank != mc.lora_rank || targets != mc.lora_targets || alpha != run_alpha)
    throw ConfigError("train.resume: " + dir + " was trained with " + ckdesc + " and this run has lora.rank " +
                      std::to_string(mc.lora_rank) + ", lora.alpha " + num(mc.lora_alpha) +
                      ", lora.targets " + lora_targets_string(mc.lora_targets, mc.arch) +
                      ": resume with the checkpoint's [lora] settings");
}
}  // namespace

void Trainer::load_state() {
  std::unique_ptr<CheckpointReader> reader;
  std::string resume_dir;
  bool resume = !tc_.resume.empty();
  if (tc_.resume == "latest") {
    if (tc_.checkpoint_dir.empty()) throw ConfigError("train.resume = \"latest\" needs train.checkpoint_dir");
    // Like torchtitan: a restartable job's first launch has nothing to resume yet.
    if (!std::filesystem::exists(std::filesystem::path(tc_.checkpoint_dir) / "latest")) {
      resume = false;
      if (log_) std::printf("train.resume = latest: no checkpoint in %s yet, starting fresh\n", tc_.checkpoint_dir.c_str());
    }
  }
  bool loaded = false;
  LoraBaseSource base_source{tc_.init_from, tc_.seed};
  if (!base_source.init_from.empty()) {  // recorded as the file or checkpoint read (not a `latest` that may move)
    if (std::filesystem::is_directory(base_source.init_from)) base_source.init_from = resolve_checkpoint(base_source.init_from);
    base_source.init_from = std::filesystem::absolute(base_source.init_from).lexically_normal().string();
  }
  if (resume) {
    std::string src = tc_.resume == "latest" ? tc_.checkpoint_dir : tc_.resume;
    resume_dir = resolve_checkpoint(src);
    check_lora_resume(resume_dir, mc_);
    // A LoRA checkpoint holds the adapters only: the base comes from this run's train.init_from
    // (or seed), as on a fresh start, and must be the one the adapters were trained on.
    // (Every LoRA resume reads full units on every rank, which also gives the base's fingerprint.)
    const bool adapters_only = mc_.lora() && !read_trainer_state(resume_dir).lora_base.is_null();
    if (mc_.lora()) {
      reader = std::make_unique<CheckpointReader>(resume_dir, *ref_, true, &base_source);
      st_ = reader->state();
    } else if (ShardedCheckpoint::is_sharded(resume_dir)) {
      // Every rank reads only its own new share; the files' checks are spread over the ranks.
      auto t0 = Clock::now();
      ShardedCheckpoint ck(resume_dir);
      st_ = read_trainer_state(resume_dir);
      ck.check_model(*ref_, true);
      std::string err = ck.check_files(rank_, world_, tc_.verify_checkpoint);
      err = agree_on_error(*groups_.metrics, err);
      if (!err.empty()) throw std::runtime_error("cannot resume from " + resume_dir + ": " + err);
      const double check_ms = ms_since(t0);
      state_->load_owned(ck, true, st_.adam_steps);
      load_info_ = {{"format", "sharded"},
                    {"ms", ms_since(t0)},
                    {"check_ms", check_ms},
                    {"verified", tc_.verify_checkpoint},
                    {"bytes_read", ck.bytes_read()},
                    {"saved_world", ck.num_files()}};
      loaded = true;
    } else {
      reader = std::make_unique<CheckpointReader>(resume_dir, *ref_, true);
      st_ = reader->state();
    }
    if (log_ && !tc_.init_from.empty())
      std::printf(adapters_only ? "resuming: the LoRA base model is train.init_from (%s)\n"
                                : "resuming: train.init_from (%s) is not used\n",
                  tc_.init_from.c_str());
  } else if (!tc_.init_from.empty()) {
    // Weights only (fine-tuning): a safetensors file, or a checkpoint (directory or root with `latest`).
    std::string file = tc_.init_from;
    // LoRA: the file holds the base model (without adapters); the adapters start fresh.
    const Transformer* layout = ref_.get();
    if (mc_.lora()) {
      ModelConfig base = mc_;
      base.lora_rank = 0;
      base.lora_targets = 0;
      base_layout_ = std::make_unique<Transformer>(
          base, ModelOptions{.storage = {.weights = false, .master = false, .grads = false}});
      layout = base_layout_.get();
    }
    if (std::filesystem::is_directory(file)) {
      file = resolve_checkpoint(file);
      reader = std::make_unique<CheckpointReader>(file, *layout, false);
    } else {
      reader = std::make_unique<CheckpointReader>(*layout, file);
    }
    if (log_) std::printf("initialised from %s (weights only: optimizer state and step start fresh)\n", file.c_str());
  }
  if (!loaded) {
    auto t0 = Clock::now();
    state_->load(reader.get(), static_cast<uint64_t>(tc_.seed), base_layout_.get());
    strategy_->end_load(st_.adam_steps);
    if (ep_) ep_->end_load(st_.adam_steps);
    if (reader && resume) load_info_ = {{"format", "full"}, {"ms", ms_since(t0)}};
  }
  if (mc_.lora()) {
    // The base's fingerprint (every unit's, from the ranks that loaded it), recorded in every
    // checkpoint so that a resume or an export can tell whether its base is the same.
    const std::vector<uint32_t>& mine = state_->base_unit_crcs();
    std::vector<int64_t> all(mine.begin(), mine.end());
    groups_.metrics->all_reduce(all.data(), all.size(), DType::I64, comm::ReduceOp::Max)->wait();
    std::vector<uint32_t> crcs(all.begin(), all.end());
    st_.lora_base = {{"init_from", base_source.init_from},
                     {"seed", base_source.seed},
                     {"crc32c", static_cast<int64_t>(lora_base_fingerprint(crcs))}};
  }
  // All ranks continue from the same point.
  verify_same_job(*groups_.metrics,
                  {{"resumed from", resume_dir},
                   {"step", std::to_string(st_.step)},
                   {"adam steps", std::to_string(st_.adam_steps)},
                   {"micro-batches consumed", std::to_string(st_.micro_batches)}},
                  "restored state");
  if (!load_info_.is_null())  // the loading's buffers: the largest workspace so far (before training)
    load_info_["workspace_peak_bytes"] = MemoryTracker::instance().stats().peak[static_cast<int>(MemCategory::Workspace)];
  if (!resume_dir.empty() && loader_ && loader_->blend && st_.has_blend) {
    if (!loader_->blend->set_state(st_.blend) && log_)
      std::printf("resuming with a different data.train blend: datasets are matched by pattern, new ones start "
                  "at their first sample\n");
  } else if (!resume_dir.empty()) {
    std::vector<int32_t> skip_x(static_cast<size_t>(B_ * T_)), skip_y(skip_x.size());
    for (int64_t i = 0; i < st_.micro_batches; ++i) next_batch(skip_x.data(), skip_y.data());  // data position
    if (log_) std::printf("resumed from %s at step %lld\n", resume_dir.c_str(), static_cast<long long>(st_.step));
  }
}

// Sharded (default): every rank writes its own file, rank 0 the metadata. Full: only rank 0
// writes; every rank takes part in the gathers.
void Trainer::save() {
  st_.has_blend = loader_ && loader_->blend;
  if (st_.has_blend) st_.blend = loader_->blend->state();
  if (saver_) {
    saver_->save(st_);
    return;
  }
  auto t0 = Clock::now();
  std::unique_ptr<CheckpointWriter> writer;
  if (rank_ == 0) writer = std::make_unique<CheckpointWriter>(tc_.checkpoint_dir, *ref_, true, st_.step);
  state_->save(writer.get());
  if (writer) writer->commit(st_, cfg_.checkpoint_record());
  full_save_ms_ += ms_since(t0);
  ++full_saves_;
}

double Trainer::evaluate() {
  trace_->begin("eval", "eval");
  val_loader_->reset();
  std::vector<int32_t>& x = xs_[0];
  std::vector<int32_t>& y = ys_[0];
  double s = 0;
  const bool masks = val_loader_->masked_targets();
  int64_t trained = 0;
  for (int64_t i = 0; i < tc_.eval_batches; ++i) {
    int64_t L = T_;
    if (unpacked_) {
      L = take_document_batch(*val_loader_, x.data(), y.data());
    } else if (plan_.cp > 1) {
      val_loader_->next(full_x_.data(), full_y_.data());
      local_tokens(x.data(), y.data());
    } else {
      val_loader_->next(x.data(), y.data());
    }
    if (masks) trained += global_trained(ys_, 1);
    if (dbatch_) dbatch_->upload(0, x.data(), y.data());
    const double l = dbatch_ ? pm_->eval_forward(dbatch_->ids(0), dbatch_->targets(0), B_, L)
                             : pm_->eval_forward(x.data(), y.data(), B_, L);
    s += unpacked_ ? l * static_cast<double>(L) / static_cast<double>(T_) : l;  // its share of a B x T_ batch
  }
  strategy_->after_eval();
  trace_->end();
  const int64_t nb = std::max<int64_t>(1, tc_.eval_batches);
  return pm_->reduce_loss(s, nb) * (masks ? mask_weight(trained, nb) : 1.0);
}

void Trainer::train_step(int64_t step) {
  const auto t0 = Clock::now();
  trace_->begin("step " + std::to_string(step + 1), "step");
  parallel::StepComm cs;
  std::vector<const int32_t*> xp, yp;
  // The data wait: the time the step waits for its batches (read, and copied to the device).
  if (slow_.part == "data_wait") std::this_thread::sleep_for(std::chrono::milliseconds(slow_.ms));
  if (!dbatch_) {
    step_real_ = step_positions_ = 0;
    lens_.assign(static_cast<size_t>(accum_), T_);
    for (int64_t m = 0; m < accum_; ++m) lens_[static_cast<size_t>(m)] = next_batch(xs_[m].data(), ys_[m].data());
  } else {
    // On a GPU the batches were read and queued on the copy stream during the previous step (the
    // first step, and a step after a run that stopped reading ahead, read them here).
    if (!dbatch_->next_ready()) prefetch_batches();
    std::swap(xs_, next_xs_);
    std::swap(ys_, next_ys_);
    lens_ = next_lens_;
    step_real_ = next_real_;
    step_positions_ = next_positions_;
    dbatch_->begin_step();  // the compute stream waits for the uploads (an event, not the host)
  }
  for (int64_t m = 0; m < accum_; ++m) {
    xp.push_back(dbatch_ ? dbatch_->ids(m) : xs_[m].data());
    yp.push_back(dbatch_ ? dbatch_->targets(m) : ys_[m].data());
  }
  const double data_ms = ms_since(t0);
  if (slow_.part == "compute") std::this_thread::sleep_for(std::chrono::milliseconds(slow_.ms));
  st_.micro_batches += accum_;
  // Loss masks: the loss is the mean over the global batch's trained targets, whatever the
  // accumulation and the number of ranks (see docs/finetuning.md).
  std::optional<int64_t> trained;
  if (loader_ && loader_->masked_targets()) trained = global_trained(ys_, accum_);
  // Unpacked data: the step's padding share and real tokens, all ranks.
  std::optional<double> padding_share;
  if (loader_ && unpacked_) {
    int64_t c[2] = {step_real_, step_positions_};
    groups_.metrics->all_reduce(c, 2, DType::I64, comm::ReduceOp::Sum)->wait();
    padding_share = c[1] > 0 ? 1.0 - static_cast<double>(c[0]) / static_cast<double>(c[1]) : 0.0;
    metrics_->set_step_tokens(c[0] * groups_.data_world / world_);  // every data share is held by world / D ranks
  }
  const double weight = trained ? mask_weight(*trained, accum_) : 1.0;
  if (mc_.lora() && mc_.lora_dropout > 0)
    model_->set_lora_dropout_step(static_cast<uint64_t>(tc_.seed), st_.micro_batches - accum_, groups_.data_rank);
  parallel::StepResult r = pm_->forward_backward(xp, yp, B_, T_, &cs, weight, unpacked_ ? &lens_ : nullptr);
  // The next step's batches are read and uploaded while this step's work runs on the GPU.
  if (dbatch_ && step + 1 < tc_.steps) prefetch_batches();
  const double lr = lr_at(step, tc_.steps, tc_.warmup_steps, tc_.lr, tc_.min_lr_ratio, tc_.lr_schedule);
  auto check_finite = [&] {
    if (!std::isfinite(r.grad_norm) || !std::isfinite(r.loss))
      throw std::runtime_error("step " + std::to_string(step + 1) + ": loss or gradient is not finite (loss " +
                               std::to_string(r.loss) + ", grad norm " + std::to_string(r.grad_norm) + ")");
  };
  if (r.grad_norm_on_device) {
    // One GPU: the norm stays on the device, AdamW clips from it there, and the loss and the norm
    // come back in one read after the update (the step's only wait). A non-finite norm leaves the
    // weights as they were (adamw_update_multi) and stops the run here.
    dbatch_->finish_step();
    trace_->begin("optimizer + parameter sync", "optimizer");
    pm_->optimizer_step_clipped(lr, tc_.grad_clip, &cs);
    trace_->end();
    double loss_sum = 0, norm_sq = 0;
    dbatch_->read_step(&loss_sum, &norm_sq);
    r.loss = pm_->reduce_loss(loss_sum, accum_) * weight;
    r.grad_norm = std::sqrt(norm_sq);
    check_finite();
  } else {
    if (dbatch_)  // the loss summed on the device: one read
      r.loss = pm_->reduce_loss(dbatch_->end_step(), accum_) * weight;
    check_finite();
    const double norm = r.grad_norm;
    float scale = 1.0f;
    if (tc_.grad_clip > 0 && norm > tc_.grad_clip) scale = static_cast<float>(tc_.grad_clip / (norm + 1e-6));
    trace_->begin("optimizer + parameter sync", "optimizer");
    pm_->optimizer_step(lr, scale, &cs);
    trace_->end();
  }
  const double loss = r.loss;
  trace_->end();  // step
  st_.step = step + 1;
  st_.adam_steps = strategy_->adam_steps();
  StepMetrics sm = metrics_->step(step, r, lr, t0, cs, data_ms);
  if (step == run_first_step_ + 1) adopt_measured_pipeline_costs(r);
  sm.trained_tokens = trained;
  sm.padding_share = padding_share;
  if (trained) trained_total_ = trained_total_.value_or(0) + *trained;
  if (val_loader_ && tc_.eval_every > 0 && ((step + 1) % tc_.eval_every == 0 || step + 1 == tc_.steps)) {
    sm.val_loss = evaluate();
    sm.val_bits_per_byte = bits_per_byte(*sm.val_loss, val_bytes_per_token_);
    res_.val_losses.push_back(*sm.val_loss);
    res_.final_val_loss = *sm.val_loss;
  }
  if (loader_ && loader_->blend) sm.data_tokens_by_dataset = tokens_by_dataset(*loader_->blend);
  res_.losses.push_back(loss);
  metrics_->emit(sm);
  if (saver_) saver_->poll();  // commits an async save once every rank has written its file
  if (!tc_.checkpoint_dir.empty() && tc_.checkpoint_every > 0 && (step + 1) % tc_.checkpoint_every == 0) save();
  maybe_inject_fault(step + 1);
}

// parallel.pp_costs = auto: after the run's second step (the first pays warm-up costs) the
// zero-bubble schedule is rebuilt for the F / B / W costs that step measured, where that helps
// (ParallelModel::adopt_measured_costs); the run says which.
// MESHTRAIN_TEST_PP_COSTS=F,B,W (test-only): these instead of the measured costs.
void Trainer::adopt_measured_pipeline_costs(const parallel::StepResult& r) {
  if (!cfg_.pp_costs_auto() || plan_.pp == 1 || dry_ || !pm_->schedule().split_backward) return;
  parallel::StageCosts given;
  const char* t = std::getenv("MESHTRAIN_TEST_PP_COSTS");
  if (t && !parse_stage_costs(t, &given))
    throw ConfigError(std::string("MESHTRAIN_TEST_PP_COSTS must be three positive numbers F,B,W, got '") + t + "'");
  const auto m = pm_->adopt_measured_costs(r, t ? &given : nullptr);
  if (!log_) return;
  std::printf("pipeline: measured costs F,B,W = 1,%.2f,%.2f; %s (simulated bubble with them %.1f%%, before %.1f%%)\n",
              m.costs.b, m.costs.w,
              m.changed ? ("the " + pm_->schedule().name + " order rebuilt for them").c_str()
                        : "the order kept (rebuilding gains nothing within its activation limit)",
              100.0 * (m.changed ? m.bubble_after : m.bubble_before), 100.0 * m.bubble_before);
  std::fflush(stdout);
}

// On a GPU: reads the next step's micro-batches into next_xs_ / next_ys_ and queues their uploads
// on the copy stream (DeviceBatches::upload_next).
void Trainer::prefetch_batches() {
  step_real_ = step_positions_ = 0;
  next_lens_.assign(static_cast<size_t>(accum_), T_);
  for (int64_t m = 0; m < accum_; ++m) {
    next_lens_[static_cast<size_t>(m)] = next_batch(next_xs_[m].data(), next_ys_[m].data());
    dbatch_->upload_next(m, next_xs_[m].data(), next_ys_[m].data());
  }
  next_real_ = step_real_;
  next_positions_ = step_positions_;
}

// MESHTRAIN_TEST_SLOW_RANK=RANK:MS[:compute] (test-only, for the straggler tests): rank RANK sleeps
// MS ms every step while waiting for its data (or, with :compute, after it, counted as compute).
void Trainer::read_slow_rank() {
  const char* v = std::getenv("MESHTRAIN_TEST_SLOW_RANK");
  if (!v || dry_) return;
  int rank = -1;
  long long ms = 0;
  char part[16] = {};
  const int n = std::sscanf(v, "%d:%lld:%15s", &rank, &ms, part);
  if (n < 2 || (n == 3 && std::strcmp(part, "compute") != 0 && std::strcmp(part, "data") != 0))
    throw ConfigError(std::string("MESHTRAIN_TEST_SLOW_RANK must be RANK:MS or RANK:MS:compute, got '") + v + "'");
  if (rank != rank_) return;
  slow_.part = n == 3 && std::strcmp(part, "compute") == 0 ? "compute" : "data_wait";
  slow_.ms = ms;
}

// MESHTRAIN_FAULT_KILL=RANK:STEP:FILE (fault injection for restart tests): rank RANK kills itself
// with SIGKILL after step STEP, once - it creates FILE first and does nothing while FILE exists.
void Trainer::maybe_inject_fault(int64_t step) {
  const char* f = std::getenv("MESHTRAIN_FAULT_KILL");
  if (!f || dry_) return;
  int rank = -1;
  long long at = -1;
  char file[4096] = {};
  if (std::sscanf(f, "%d:%lld:%4095s", &rank, &at, file) != 3 || rank != rank_ || at != step) return;
  if (std::filesystem::exists(file)) return;
  std::FILE* marker = std::fopen(file, "w");
  if (marker) std::fclose(marker);
  std::fprintf(stderr, "meshtrain[rank %d]: MESHTRAIN_FAULT_KILL: killing myself (SIGKILL) after step %lld\n", rank_, at);
  std::fflush(stderr);
  ::kill(::getpid(), SIGKILL);
}

TrainResult Trainer::run() {
  build();
  load_state();
  mem_release_cache();
  MemoryTracker::instance().reset_peaks();  // peaks describe training, not the one-off setup
  metrics_ = std::make_unique<MetricsProcessor>(cfg_, mc_, groups_, *pm_, dt_, rank_, world_, dry_, st_.step);
  if (rank_ == 0 && !dry_) metrics_->attach_tensorboard(cfg_.log.tensorboard_dir, cfg_.to_toml());
  metrics_->print_header(ref_->num_params(), loader_ ? loader_->total_tokens() : 0, threads_);
  // Bits per byte relate a loss over every token to the bytes of all of them: not a loss over the
  // trained tokens of masked data.
  if (val_loader_ && !val_loader_->has_masks()) val_bytes_per_token_ = val_loader_->bytes_per_token();
  if (val_loader_ && log_ && val_bytes_per_token_ <= 0) std::printf("%s\n", no_bits_per_byte_note(cfg_.data.val).c_str());
  if (val_loader_ && tc_.eval_at_start) {
    val_start_ = evaluate();
    if (log_) {
      std::printf("step %5lld/%lld | val %.4f%s (before training)\n", static_cast<long long>(st_.step),
                  static_cast<long long>(tc_.steps), *val_start_,
                  bits_per_byte_note(bits_per_byte(*val_start_, val_bytes_per_token_)).c_str());
      std::fflush(stdout);
    }
  }
  const StopOnSignal stop;  // Ctrl-C: stop after this step (all ranks agree), checkpoint, report
  bool stopped = false;
  run_first_step_ = st_.step;
  for (int64_t step = st_.step; step < tc_.steps && !stopped; ++step) {
    train_step(step);
    stopped = stop.requested(world_ > 1 ? groups_.metrics.get() : nullptr);  // also counted in a dry run
  }
  if (stopped && log_)
    std::printf("stop requested (%s): stopped after step %lld of %lld%s\n", StopOnSignal::signal_name(),
                static_cast<long long>(st_.step), static_cast<long long>(tc_.steps),
                tc_.checkpoint_dir.empty() ? "; no checkpoint (train.checkpoint_dir is not set)"
                                           : "; writing the checkpoint (--train.resume latest continues from it)");
  if (!tc_.checkpoint_dir.empty() && (tc_.checkpoint_every <= 0 || st_.step % tc_.checkpoint_every != 0)) save();
  if (saver_) saver_->finish(true);  // the job waits for the save in flight
  res_.tokens_per_s = metrics_->tokens_per_s();
  report();
  if (tc_.sample_tokens > 0 && !stopped) sample();
  return res_;
}

void Trainer::report() {
  RunOutcome o;
  o.steps = st_.step;
  o.val_losses = res_.val_losses;
  o.final_val_loss = res_.final_val_loss;
  o.val_start = val_start_;
  o.val_bytes_per_token = val_bytes_per_token_;
  o.load_info = load_info_;
  o.saver = saver_.get();
  o.full_saves = full_saves_;
  o.full_save_ms = full_save_ms_;
  o.blend = loader_ ? loader_->blend.get() : nullptr;
  o.trained_tokens = trained_total_;
  metrics_->report(o);
}

// Samples from an unsharded copy of the trained weights (gathered unit by unit onto rank 0).
void Trainer::sample() {
  const bool r0 = rank_ == 0;
  const int64_t RF = ref_->flat_size();
  Tensor full = r0 ? Tensor::zeros({RF}, DType::F32, MemCategory::Workspace) : Tensor();
  for (int u = 0; u < ref_->num_units(); ++u) {
    Tensor w;
    state_->gather_full_unit(u, false, &w);
    if (r0)
      dev::copy(full.device(), full.f32() + ref_->unit(u).offset, w.f32(),
                static_cast<size_t>(ref_->unit(u).numel) * sizeof(float));
  }
  if (!r0) return;
  Transformer plain(mc_, DType::F32);
  dev::copy(full.device(), plain.weights().f32(), full.f32(), static_cast<size_t>(RF) * sizeof(float));
  auto tok = make_tokenizer(cfg_.data.tokenizer, cfg_.data.gpt2_dir, cfg_.data.tokenizer_file);
  std::vector<int32_t> prompt = tok->encode(tc_.sample_prompt);
  if (prompt.empty()) prompt.push_back(tok->eot_token() >= 0 ? tok->eot_token() : static_cast<int32_t>('\n'));
  SampleOptions so;
  so.tokens = tc_.sample_tokens;
  so.temperature = 0.8f;
  so.top_k = 40;
  so.seed = static_cast<uint64_t>(tc_.seed);
  auto out = generate(plain, prompt, so, tok->eot_token());
  std::printf("\n--- sample (%lld tokens, temperature 0.8, top-k 40) ---\n%s\n---\n",
              static_cast<long long>(tc_.sample_tokens), tok->decode(out).c_str());
}

}  // namespace

TrainResult train(const RunConfig& cfg) {
  Trainer t(cfg);
  return t.run();
}

void prepare_dry_run(RunConfig& cfg, int world, int rank) {
  if (world < 1) throw ConfigError("--world must be >= 1, got " + std::to_string(world));
  if (rank < 0 || rank >= world)
    throw ConfigError("--rank " + std::to_string(rank) + " is not a rank of --world " + std::to_string(world));
  set_current_device(Device::Meta);
  comm::World::init_meta(world, rank);
  // One training step; nothing read or written but the metrics.
  cfg.train.steps = 1;
  cfg.train.eval_every = 0;
  cfg.train.eval_at_start = false;
  cfg.train.checkpoint_dir.clear();
  cfg.train.resume.clear();
  cfg.train.init_from.clear();
  cfg.train.sample_tokens = 0;
  cfg.log.trace_out.clear();
}

}  // namespace mt
