#include "train/trainer.h"

#include <omp.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <optional>
#include <thread>

#include "comm/world.h"
#include "kernels/backend.h"
#include "model/transformer.h"
#include "parallel/expert_parallel.h"
#include "parallel/context_parallel.h"
#include "parallel/optimizer.h"
#include "parallel/pipeline_executor.h"
#include "parallel/strategy.h"
#include "parallel/tensor_parallel.h"
#include "plan/auto_layout.h"
#include "runtime/clock.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/checkpoint_saver.h"
#include "train/chrome_trace.h"
#include "train/compute_probe.h"
#include "data/data_loader.h"
#include "train/job_agreement.h"
#include "train/metrics.h"
#include "checkpoint/model_state.h"
#include "train/parallel_dims.h"
#include "train/sampler.h"
#include "data/tokenizer.h"

namespace mt {

namespace {

// The training or validation data: one file or glob (BatchLoader, llm.c order) or a blend of
// several (BlendLoader, see data_loader.h).
struct AnyLoader {
  std::unique_ptr<TokenDataset> ds;
  std::unique_ptr<BatchLoader> plain;
  std::unique_ptr<BlendLoader> blend;
  void next(int32_t* x, int32_t* y) {
    if (blend) blend->next(x, y);
    else plain->next(x, y);
  }
  void reset() {
    if (blend) blend->reset();
    else plain->reset();
  }
  int64_t total_tokens() const { return blend ? blend->total_tokens() : ds->total_tokens(); }
  // {pattern: input tokens seen so far by all data-parallel ranks together}.
  nlohmann::json tokens_by_dataset() const {
    nlohmann::json j = nlohmann::json::object();
    for (size_t d = 0; d < blend->num_datasets(); ++d) j[blend->pattern(d)] = blend->dataset_tokens(d);
    return j;
  }
};

std::unique_ptr<AnyLoader> make_loader(const std::string& spec, const char* key, int B, int T, int dp_rank,
                                       int dp_world, uint64_t seed, bool shuffle, int64_t vocab) {
  auto l = std::make_unique<AnyLoader>();
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

int auto_threads() {
  unsigned hc = std::thread::hardware_concurrency();
  return hc == 0 ? 1 : static_cast<int>(hc);
}

// One training job on this rank (torchtitan's Trainer): build() makes the groups, data, model,
// strategy and step executor; load_state() the initial or resumed state; train_step() one
// optimizer step - for every layout the step runs through the pipeline executor (pp = 1 is a
// one-stage schedule, as Megatron's forward_backward_no_pipelining); evaluate(), save() and
// report() do what they say. A dry run (run_train_command set up a Meta world and device) builds
// rank R of the job alone, without data files, and prints and writes what rank 0 would.
class Trainer {
 public:
  explicit Trainer(const RunConfig& cfg) : cfg_(cfg), tc_(cfg.train) {}
  TrainResult run();

 private:
  void build();
  void load_state();
  void train_step(int64_t step);
  double evaluate();
  void save();
  void report();
  void sample();
  void maybe_inject_fault(int64_t step);
  // The next micro-batch of this data-parallel rank (token 0 everywhere in a dry run).
  void next_batch(int32_t* x, int32_t* y);
  // cp > 1: this rank's chunks of full_x_ / full_y_ into x, y.
  void local_tokens(int32_t* x, int32_t* y);
  // Sum of a per-rank value over the pipeline ranks (each stage holds its own part).
  double pp_sum(double v);
  // Mean of a per-rank value over the data-parallel ranks (losses are per rank).
  double dp_mean(double v);

  const RunConfig& cfg_;
  const RunConfig::Train& tc_;
  comm::World* W_ = nullptr;
  int rank_ = 0, world_ = 1;
  bool dry_ = false, log_ = false;
  ModelConfig mc_;
  ParallelDims dims_;
  ParallelGroups groups_;
  DType dt_ = DType::F32;
  Recompute rc_ = Recompute::None;
  int threads_ = 1;
  int64_t B_ = 0, T_ = 0, accum_ = 1;
  std::unique_ptr<AnyLoader> loader_, val_loader_;
  parallel::StrategySpec spec_;
  std::unique_ptr<parallel::ProcessGroupTpComm> tp_comm_;
  std::unique_ptr<parallel::ProcessGroupCpComm> cp_comm_;  // context parallelism (null when cp = 1)
  int64_t T_full_ = 0;                                     // tokens per sequence (T_ = T_full_ / cp per rank)
  std::vector<int32_t> full_x_, full_y_;                   // cp > 1: the loader's whole sequences
  std::unique_ptr<parallel::PipeSchedule> schedule_;
  parallel::StagePartition partition_;
  std::unique_ptr<Transformer> model_, ref_;
  std::vector<double> norm_weight_;
  std::unique_ptr<parallel::Strategy> strategy_;
  std::unique_ptr<parallel::ProcessGroupExpertComm> ep_comm_;  // expert parallelism (null when ep = 1)
  std::unique_ptr<parallel::ExpertParallel> ep_;
  std::unique_ptr<parallel::PipelineExecutor> pipe_;
  std::unique_ptr<ModelState> state_;
  std::unique_ptr<CheckpointSaver> saver_;  // sharded checkpoints
  std::unique_ptr<ChromeTrace> trace_;
  std::unique_ptr<TracingHooks> tracing_;
  std::unique_ptr<MetricsWriter> metrics_;
  TrainerState st_;

  // Per step and over the run.
  std::vector<std::vector<int32_t>> xs_, ys_;
  TrainResult res_;
  double tps_sum_ = 0, comm_ms_total_ = 0, exposed_ms_total_ = 0, bubble_sum_ = 0;
  double cp_comm_ms_total_ = 0, cp_exposed_ms_total_ = 0;
  int64_t tps_n_ = 0, first_step_ = 0;
  int peak_slots_ = 0;
  std::array<int64_t, kNumMemCategories> resident_{};
  // Mixture of experts over the run (steps after the first): imbalance, all-to-all bytes and ms.
  double moe_imb_sum_ = 0, a2a_ms_sum_ = 0, moe_aux_last_ = 0;
  int64_t a2a_bytes_sum_ = 0, moe_dropped_ = 0;
  std::vector<double> moe_tokens_total_;  // per MoE layer x expert, the whole run
  // This step's expert statistics over every rank (collective over the world).
  nlohmann::json moe_step_metrics(double* a2a_ms, int64_t* a2a_bytes);
  std::optional<double> val_start_;  // train.eval_at_start
  nlohmann::json load_info_;         // how the resumed checkpoint was loaded (final metrics)
  double full_save_ms_ = 0;          // train.checkpoint_format = full
  int64_t full_saves_ = 0;
};

namespace {
// train.device: cpu, or cuda with the reason it cannot be used. The dry run (Meta) models either.
void check_train_device(const std::string& name, bool dry) {
  Device d = Device::CPU;
  if (!parse_device(name, &d) || d == Device::Meta)
    throw ConfigError("train.device must be cpu or cuda, got '" + name + "'");
  if (d != Device::CUDA || dry) return;
  std::string why;
  if (!device_available(Device::CUDA, &why)) throw ConfigError("train.device = cuda: " + why);
  throw ConfigError("train.device = cuda: this build has the CUDA device and kernels, but training on it is not wired "
                    "into the model and strategies yet (docs/gpu.md, 'What remains')");
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
  dims_ = ParallelDims::from_config(cfg_, mc_, world_);
  groups_ = ParallelGroups::build(*W_, dims_);
  if (!parse_dtype(tc_.dtype, &dt_) || is_integer(dt_)) throw ConfigError("train.dtype must be fp32 or bf16, got '" + tc_.dtype + "'");
  check_train_device(tc_.device, dry_);
  kernels::require_ops(tc_.device, {.llama = mc_.arch == Arch::Llama, .rope_scaled = mc_.rope_scaled(),
                                    .bf16 = dt_ == DType::BF16, .tensor_parallel = tp > 1,
                                    .sequence_parallel = dims_.sequence_parallel, .context_parallel = dims_.cp > 1,
                                    .moe = mc_.moe()});
  try {
    rc_ = parse_recompute(tc_.activation_checkpointing, "train.activation_checkpointing");
  } catch (const std::invalid_argument& e) {
    throw ConfigError(e.what());
  }
  if (tc_.micro_batch < 1) throw ConfigError("train.micro_batch must be >= 1");
  if (tc_.grad_accum < 1) throw ConfigError("train.grad_accum must be >= 1");
  if (tc_.steps < 0) throw ConfigError("train.steps must be >= 0");
  if (tc_.loss_chunk_tokens < 0) throw ConfigError("train.loss_chunk_tokens must be >= 0 (0 = off)");
  (void)lr_at(0, tc_.steps, tc_.warmup_steps, tc_.lr, tc_.min_lr_ratio, tc_.lr_schedule);  // validates the schedule name
  threads_ = tc_.threads > 0 ? static_cast<int>(tc_.threads) : std::max(1, auto_threads() / W_->local_size());
  omp_set_num_threads(threads_);

  // With a pipeline the step's micro-batches are the schedule's (pp_microbatches, default grad_accum).
  const int pp = dims_.pp;
  B_ = tc_.micro_batch;
  T_full_ = mc_.seq_len;
  T_ = T_full_ / dims_.cp;  // context parallelism: this rank's two chunks of every sequence
  accum_ = pp > 1 && cfg_.parallel.pp_microbatches > 0 ? cfg_.parallel.pp_microbatches : tc_.grad_accum;
  // The cp ranks of one data-parallel rank read the same sequences (and keep their own chunks).
  const int dp_rank = groups_.data_rank, dp_world = groups_.data_world;
  // Every rank runs the same job (config, build, data), checked before anything is loaded.
  verify_same_job(*groups_.metrics, job_items(cfg_, mc_, !dry_), "configuration");
  if (!dry_) {
    const uint64_t seed = static_cast<uint64_t>(tc_.seed);
    loader_ = make_loader(cfg_.data.train, "data.train", static_cast<int>(B_), static_cast<int>(T_full_), dp_rank,
                          dp_world, seed, cfg_.data.shuffle, mc_.vocab_size);
    if (!cfg_.data.val.empty() && tc_.eval_every > 0)
      val_loader_ = make_loader(cfg_.data.val, "data.val", static_cast<int>(B_), static_cast<int>(T_full_), dp_rank,
                                dp_world, seed, false, mc_.vocab_size);
  }
  if (dims_.cp > 1) {
    full_x_.resize(static_cast<size_t>(B_ * T_full_));
    full_y_.resize(full_x_.size());
  }

  spec_.strategy = dims_.strategy;
  spec_.bucket_mb = cfg_.parallel.bucket_mb;
  spec_.reshard_after_forward = cfg_.parallel.reshard_after_forward;
  spec_.prefetch = static_cast<int>(cfg_.parallel.prefetch);
  spec_.reduce_every_microbatch = cfg_.parallel.reduce_every_microbatch;
  spec_.adam = AdamWConfig{tc_.lr, tc_.beta1, tc_.beta2, tc_.eps, tc_.weight_decay};
  tp_comm_ = std::make_unique<parallel::ProcessGroupTpComm>(groups_.tp);
  tp_comm_->set_activation_dtype(dt_);  // bf16 runs move activations in bf16 (Megatron)

  // The step's schedule, checked before it runs, and the stages' units (one stage without a pipeline).
  try {
    const PipelineSchedule kind =
        pp > 1 ? parse_pipeline_schedule(cfg_.parallel.pp_schedule, "parallel.pp_schedule") : PipelineSchedule::OneFOneB;
    schedule_ = std::make_unique<parallel::PipeSchedule>(
        parallel::make_schedule(kind, pp, static_cast<int>(accum_), dims_.pp_virtual_stages));
    partition_ = parallel::partition_stages(mc_, schedule_->num_stages(), pp > 1 ? cfg_.parallel.pp_partition : "");
  } catch (const std::invalid_argument& e) {
    throw ConfigError(std::string("pipeline: ") + e.what());
  }
  std::vector<char> owned;
  if (pp > 1) owned = parallel::stage_units_of_rank(partition_, pp, groups_.pp_rank, static_cast<int>(mc_.n_layer) + 2);
  if (dims_.ep_enabled()) ep_comm_ = std::make_unique<parallel::ProcessGroupExpertComm>(groups_.ep);
  if (dims_.cp > 1) cp_comm_ = std::make_unique<parallel::ProcessGroupCpComm>(groups_.cp);
  model_ = std::make_unique<Transformer>(
      mc_, ModelOptions{.compute = dt_,
                        .recompute = rc_,
                        .storage = parallel::model_storage(spec_, dt_, groups_.shard->size()),
                        .tp = tp > 1 ? tp_comm_.get() : nullptr,
                        .sequence_parallel = dims_.sequence_parallel,
                        .tp_overlap = cfg_.parallel.tp_overlap,
                        .loss_chunk = tc_.loss_chunk_tokens,
                        .cp = cp_comm_.get(),
                        .cp_allgather = dims_.cp_mode == "allgather",
                        .ep = dims_.ep_enabled() ? dims_.ep : 1,
                        .ep_rank = dims_.ep_enabled() ? groups_.ep->rank() : 0,
                        .ep_comm = ep_comm_.get(),
                        .owned_units = owned});
  // Expert gradients are averaged like the dense ones: over the dp ranks times the cp ranks.
  if (dims_.ep_enabled())
    ep_ = std::make_unique<parallel::ExpertParallel>(*model_, groups_.edp, groups_.ep_aux, groups_.tp_aux,
                                                     dims_.dp() * dims_.cp, spec_.adam);
  // The unsplit, unpadded layout of the same model: what checkpoints and initialisation use.
  ref_ = std::make_unique<Transformer>(
      mc_, ModelOptions{.storage = {.weights = false, .master = false, .grads = false}});
  norm_weight_.assign(model_->params().size(), 1.0);
  for (size_t i = 0; i < model_->params().size(); ++i)
    if (model_->params()[i].tp_split == TpSplit::None) norm_weight_[i] = 1.0 / tp;  // replicated on every tp rank
  parallel::verify_same_model(*model_, *groups_.dp);
  strategy_ = parallel::make_strategy(spec_, *model_, groups_.dp, groups_.shard, groups_.replicate, groups_.grad_norm);
  pipe_ = std::make_unique<parallel::PipelineExecutor>(*model_, *schedule_, partition_, groups_.pp, strategy_.get());
  trace_ = std::make_unique<ChromeTrace>(cfg_.log.trace_out, rank_);
  tracing_ = std::make_unique<TracingHooks>(strategy_->hooks(), trace_.get(), model_.get());
  model_->set_hooks(trace_->enabled() ? static_cast<UnitHooks*>(tracing_.get()) : strategy_->hooks());
  state_ = std::make_unique<ModelState>(*model_, *ref_, *strategy_, *groups_.tp_aux, groups_.pp_aux.get());
  state_->set_expert_parallel(ep_.get());
  // The sharded format writes what the strategy owns and, with expert parallelism, each ep rank's
  // local experts (ModelState::owned_pieces).
  const std::string& ckpt_format = tc_.checkpoint_format;
  if (ckpt_format != "sharded" && ckpt_format != "full")
    throw ConfigError("train.checkpoint_format must be sharded or full, got '" + ckpt_format + "'");
  if (tc_.checkpoint_async && ckpt_format != "sharded")
    throw ConfigError("train.checkpoint_async needs train.checkpoint_format = \"sharded\"");
  if (!tc_.checkpoint_dir.empty() && ckpt_format == "sharded") {
    const nlohmann::json layout = {{"world", world_},
                                   {"strategy", strategy_->name()},
                                   {"dp_replicate", dims_.dp_replicate},
                                   {"dp_shard", dims_.dp_shard},
                                   {"cp", dims_.cp},
                                   {"tp", dims_.tp},
                                   {"pp", dims_.pp},
                                   {"ep", dims_.ep},
                                   {"dtype", dtype_name(dt_)}};
    const std::map<std::string, std::string> coords = {{"rank", std::to_string(rank_)},
                                                       {"world", std::to_string(world_)},
                                                       {"dp_rank", std::to_string(dp_rank)},
                                                       {"cp_rank", std::to_string(groups_.cp ? groups_.cp->rank() : 0)},
                                                       {"tp_rank", std::to_string(groups_.tp->rank())},
                                                       {"ep_rank", std::to_string(groups_.ep ? groups_.ep->rank() : 0)},
                                                       {"pp_rank", std::to_string(groups_.pp_rank)}};
    saver_ = std::make_unique<CheckpointSaver>(*state_, *ref_, *groups_.metrics, rank_, tc_.checkpoint_dir,
                                               tc_.checkpoint_async, cfg_.checkpoint_record(), layout, coords);
  }
  xs_.assign(static_cast<size_t>(accum_), std::vector<int32_t>(static_cast<size_t>(B_ * T_)));
  ys_ = xs_;
}

nlohmann::json Trainer::moe_step_metrics(double* a2a_ms, int64_t* a2a_bytes) {
  Transformer::MoeStats st = model_->take_moe_stats();
  if (ep_comm_) ep_comm_->take(a2a_ms, a2a_bytes);
  // Every MoE layer's token counts, this rank's layers filled in, summed over the world (each
  // layer's counts come from its stage's data-parallel ranks), then aux, z and dropped.
  const int64_t E = mc_.moe_experts;
  std::vector<int> layers;
  for (int64_t l = 0; l < mc_.n_layer; ++l)
    if (mc_.is_moe_layer(l)) layers.push_back(static_cast<int>(l));
  const size_t nl = layers.size();
  std::vector<float> v(nl * static_cast<size_t>(E) + 4, 0.0f);
  for (size_t i = 0; i < st.layers.size(); ++i) {
    const size_t li = static_cast<size_t>(std::find(layers.begin(), layers.end(), st.layers[i]) - layers.begin());
    for (int64_t e = 0; e < E; ++e) v[li * E + e] = static_cast<float>(st.tokens[i][e]);
  }
  v[nl * E] = static_cast<float>(st.aux_loss);
  v[nl * E + 1] = static_cast<float>(st.z_loss);
  v[nl * E + 2] = static_cast<float>(st.dropped);
  v[nl * E + 3] = static_cast<float>(*a2a_bytes);
  if (world_ > 1) groups_.metrics->all_reduce(v.data(), v.size(), DType::F32, comm::ReduceOp::Sum)->wait();
  // Every tensor-parallel rank routes the same tokens: counted once.
  const double dp = dims_.dp(), tpn = dims_.tp;
  for (size_t i = 0; i < nl * E + 3; ++i) v[i] = static_cast<float>(v[i] / tpn);

  nlohmann::json tokens = nlohmann::json::array(), imb = nlohmann::json::array();
  double worst = 0;
  if (moe_tokens_total_.size() != nl * E) moe_tokens_total_.assign(nl * E, 0.0);
  for (size_t li = 0; li < nl; ++li) {
    nlohmann::json t = nlohmann::json::array();
    double mx = 0, sum = 0;
    for (int64_t e = 0; e < E; ++e) {
      const double c = v[li * E + e];
      t.push_back(static_cast<int64_t>(c));
      mx = std::max(mx, c);
      sum += c;
      moe_tokens_total_[li * E + e] += c;
    }
    const double r = sum > 0 ? mx / (sum / static_cast<double>(E)) : 0.0;
    tokens.push_back(t);
    imb.push_back(r);
    worst = std::max(worst, r);
  }
  moe_dropped_ += static_cast<int64_t>(v[nl * E + 2]);
  return {{"expert_tokens", tokens},
          {"expert_imbalance", worst},
          {"expert_imbalance_by_layer", imb},
          {"moe_aux_loss", v[nl * E] / dp},
          {"moe_z_loss", v[nl * E + 1] / dp},
          {"moe_dropped_tokens", static_cast<int64_t>(v[nl * E + 2])},
          {"ep_all_to_all_bytes", static_cast<int64_t>(v[nl * E + 3] / std::max(1, world_))},
          {"ep_all_to_all_ms", *a2a_ms}};
}

void Trainer::next_batch(int32_t* x, int32_t* y) {
  if (!loader_) {
    std::fill(x, x + B_ * T_, 0);
    std::fill(y, y + B_ * T_, 0);
  } else if (dims_.cp > 1) {
    loader_->next(full_x_.data(), full_y_.data());
    local_tokens(x, y);
  } else {
    loader_->next(x, y);
  }
}

void Trainer::local_tokens(int32_t* x, int32_t* y) {
  const int r = groups_.cp->rank();
  cp_take_local(full_x_.data(), x, B_, T_full_, r, dims_.cp);
  cp_take_local(full_y_.data(), y, B_, T_full_, r, dims_.cp);
}

double Trainer::pp_sum(double v) {
  if (!groups_.pp_aux) return v;
  float f = static_cast<float>(v);
  groups_.pp_aux->all_reduce(&f, 1, DType::F32, comm::ReduceOp::Sum)->wait();
  return static_cast<double>(f);
}

double Trainer::dp_mean(double v) {
  if (groups_.dp->size() == 1) return v;
  float f = static_cast<float>(v);
  groups_.metrics->all_reduce(&f, 1, DType::F32, comm::ReduceOp::Avg)->wait();
  return static_cast<double>(f);
}

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
  if (resume) {
    std::string src = tc_.resume == "latest" ? tc_.checkpoint_dir : tc_.resume;
    resume_dir = resolve_checkpoint(src);
    if (ShardedCheckpoint::is_sharded(resume_dir)) {
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
    if (log_ && !tc_.init_from.empty()) std::printf("resuming: train.init_from (%s) is not used\n", tc_.init_from.c_str());
  } else if (!tc_.init_from.empty()) {
    // Weights only (fine-tuning): a safetensors file, or a checkpoint (directory or root with `latest`).
    std::string file = tc_.init_from;
    if (std::filesystem::is_directory(file)) {
      file = resolve_checkpoint(file);
      reader = std::make_unique<CheckpointReader>(file, *ref_, false);
    } else {
      reader = std::make_unique<CheckpointReader>(*ref_, file);
    }
    if (log_) std::printf("initialised from %s (weights only: optimizer state and step start fresh)\n", file.c_str());
  }
  if (!loaded) {
    auto t0 = Clock::now();
    state_->load(reader.get(), static_cast<uint64_t>(tc_.seed));
    strategy_->end_load(st_.adam_steps);
    if (ep_) ep_->end_load(st_.adam_steps);
    if (reader && resume) load_info_ = {{"format", "full"}, {"ms", ms_since(t0)}};
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
  for (int64_t i = 0; i < tc_.eval_batches; ++i) {
    if (dims_.cp > 1) {
      val_loader_->next(full_x_.data(), full_y_.data());
      local_tokens(x.data(), y.data());
    } else {
      val_loader_->next(x.data(), y.data());
    }
    s += pipe_->eval_forward(x.data(), y.data(), B_, T_);
  }
  strategy_->after_eval();
  trace_->end();
  return dp_mean(pp_sum(s) / static_cast<double>(std::max<int64_t>(1, tc_.eval_batches)));
}

void Trainer::train_step(int64_t step) {
  const int pp = dims_.pp;
  const int64_t dp_world = groups_.dp->size();
  const double tokens_per_step = static_cast<double>(B_ * T_ * accum_ * dp_world);
  const float dloss = static_cast<float>(1.0 / static_cast<double>(B_ * T_ * accum_));
  auto t0 = Clock::now();
  trace_->begin("step " + std::to_string(step + 1), "step");
  model_->zero_grads();
  parallel::StepComm cs;
  std::vector<const int32_t*> xp, yp;
  for (int64_t m = 0; m < accum_; ++m) {
    next_batch(xs_[m].data(), ys_[m].data());
    xp.push_back(xs_[m].data());
    yp.push_back(ys_[m].data());
  }
  st_.micro_batches += accum_;
  parallel::PipelineStepStats ps = pipe_->train_step(xp, yp, B_, T_, dloss, &cs);
  std::optional<double> bubble;
  if (pp > 1) {
    bubble = pp_sum(ps.idle_fraction()) / pp;
    peak_slots_ = std::max(peak_slots_, ps.peak_slots);
  }
  // The last stage's loss, summed over the pipeline.
  const double loss = dp_mean(pp_sum(ps.loss_sum) / static_cast<double>(accum_));
  if (ep_) ep_->reduce_grads(&cs);
  double norm_sq = strategy_->grad_norm_sq(norm_weight_);
  if (ep_) norm_sq += ep_->grad_norm_sq();
  norm_sq = pp_sum(norm_sq);
  if (dims_.tp > 1) {  // tp-split parameters are summed across tp ranks, replicated ones weighted 1/tp
    float f = static_cast<float>(norm_sq);
    groups_.tp_aux->all_reduce(&f, 1, DType::F32, comm::ReduceOp::Sum)->wait();
    norm_sq = f;
  }
  const double norm = std::sqrt(norm_sq);
  if (!std::isfinite(norm) || !std::isfinite(loss))
    throw std::runtime_error("step " + std::to_string(step + 1) + ": loss or gradient is not finite (loss " +
                             std::to_string(loss) + ", grad norm " + std::to_string(norm) + ")");
  float scale = 1.0f;
  if (tc_.grad_clip > 0 && norm > tc_.grad_clip) scale = static_cast<float>(tc_.grad_clip / (norm + 1e-6));
  const double lr = lr_at(step, tc_.steps, tc_.warmup_steps, tc_.lr, tc_.min_lr_ratio, tc_.lr_schedule);
  trace_->begin("optimizer + parameter sync", "optimizer");
  if (ep_) ep_->optimizer_step(lr, scale);  // first: a strategy's step may zero every gradient the model holds
  strategy_->optimizer_step(lr, scale, &cs);
  pipe_->tied_weights_sync();
  trace_->end();
  trace_->end();  // step
  st_.step = step + 1;
  st_.adam_steps = strategy_->adam_steps();
  double a2a_ms = 0;
  int64_t a2a_bytes = 0;
  nlohmann::json moe = mc_.moe() ? moe_step_metrics(&a2a_ms, &a2a_bytes) : nlohmann::json();
  const double step_ms = ms_since(t0);
  double tp_comm_ms = 0, tp_exposed_ms = 0;  // tensor-parallel collectives (mostly on the critical path)
  tp_comm_->take_times(&tp_comm_ms, &tp_exposed_ms);
  cs.comm_ms += tp_comm_ms;
  cs.exposed_ms += tp_exposed_ms;
  cs.comm_ms += a2a_ms;  // the token exchanges: synchronous, so all of it exposed
  cs.exposed_ms += a2a_ms;
  if (cp_comm_) {  // ring attention's transfers (mostly hidden behind the attention of the block in hand)
    double cp_ms = 0, cp_exposed = 0;
    cp_comm_->take_times(&cp_ms, &cp_exposed);
    cs.comm_ms += cp_ms;
    cs.exposed_ms += cp_exposed;
    if (step > first_step_) {
      cp_comm_ms_total_ += cp_ms;
      cp_exposed_ms_total_ += cp_exposed;
    }
  }
  resident_ = MemoryTracker::instance().stats().current;

  StepMetrics sm;
  sm.step = step + 1;
  sm.loss = loss;
  sm.lr = lr;
  sm.grad_norm = norm;
  sm.step_ms = step_ms;
  sm.compute_ms = step_ms - cs.exposed_ms;
  sm.comm_ms = cs.comm_ms;
  sm.exposed_comm_ms = cs.exposed_ms;
  if (bubble) {
    sm.pp_bubble = bubble;
    sm.pp_bubble_formula = parallel::bubble_formula(*schedule_).fraction;
    if (step > first_step_) bubble_sum_ += *bubble;
  }
  if (step > first_step_) {  // the first step of a run pays warm-up costs
    comm_ms_total_ += cs.comm_ms;
    exposed_ms_total_ += cs.exposed_ms;
  }
  sm.tokens_per_s = tokens_per_step / (step_ms / 1000.0);
  if (cfg_.log.peak_flops > 0) sm.mfu = mc_.flops_per_token() * sm.tokens_per_s / (cfg_.log.peak_flops * world_);
  sm.mem_peak_bytes = MemoryTracker::instance().stats().total_peak;
  sm.moe = moe;
  if (mc_.moe() && step > first_step_) {
    moe_imb_sum_ += moe.value("expert_imbalance", 0.0);
    a2a_ms_sum_ += a2a_ms;
    a2a_bytes_sum_ += a2a_bytes;
  }
  if (mc_.moe()) moe_aux_last_ = moe.value("moe_aux_loss", 0.0);
  if (step > first_step_) {
    tps_sum_ += sm.tokens_per_s;
    ++tps_n_;
  }
  if (val_loader_ && ((step + 1) % tc_.eval_every == 0 || step + 1 == tc_.steps)) {
    sm.val_loss = evaluate();
    res_.val_losses.push_back(*sm.val_loss);
    res_.final_val_loss = *sm.val_loss;
  }
  if (loader_ && loader_->blend) sm.data_tokens_by_dataset = loader_->tokens_by_dataset();
  res_.losses.push_back(loss);
  if (log_ && (cfg_.log.print_every <= 1 || (step + 1) % cfg_.log.print_every == 0 || step + 1 == tc_.steps ||
               sm.val_loss)) {
    std::printf("%s\n", progress_line(sm, tc_.steps).c_str());
    std::fflush(stdout);
  }
  metrics_->step(sm);
  if (saver_) saver_->poll();  // commits an async save once every rank has written its file
  if (!tc_.checkpoint_dir.empty() && tc_.checkpoint_every > 0 && (step + 1) % tc_.checkpoint_every == 0) save();
  maybe_inject_fault(step + 1);
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
  if (log_) {
    std::printf("model %s (%s): %lld parameters, %lld layers, %lld heads, width %lld, seq %lld, vocab %lld (padded %lld)\n",
                mc_.name.c_str(), arch_name(mc_.arch), static_cast<long long>(ref_->num_params()),
                static_cast<long long>(mc_.n_layer), static_cast<long long>(mc_.n_head), static_cast<long long>(mc_.n_embd),
                static_cast<long long>(mc_.seq_len), static_cast<long long>(mc_.vocab_size),
                static_cast<long long>(mc_.padded_vocab));
    std::printf("data %s: %lld tokens | batch %lld x %lld x %lld micro-batches x %d ranks = %lld tokens/step | %s | "
                "recompute %s | %d threads\n",
                cfg_.data.train.c_str(), static_cast<long long>(loader_ ? loader_->total_tokens() : 0),
                static_cast<long long>(B_), static_cast<long long>(T_full_), static_cast<long long>(accum_), dims_.dp(),
                static_cast<long long>(B_ * T_full_ * accum_ * dims_.dp()), dtype_name(dt_), to_string(rc_), threads_);
    if (dims_.cp > 1)
      std::printf("context parallel: cp %d (%s), each sequence in %d chunks of %lld tokens, %lld tokens per rank\n",
                  dims_.cp, dims_.cp_mode.c_str(), 2 * dims_.cp, static_cast<long long>(T_full_ / (2 * dims_.cp)),
                  static_cast<long long>(T_));
    std::printf("device %s\n", kernels::describe(current_device()).c_str());
    if (world_ > 1)
      std::printf("parallel: %s over %s (shard group %d, replicas %d); %lld parameters per tp rank before sharding\n",
                  strategy_->name(), groups_.mesh->describe().c_str(), groups_.shard->size(), groups_.replicate->size(),
                  static_cast<long long>(model_->num_params()));
    if (dims_.pp > 1)
      std::printf("pipeline: %s, %d ranks x %d virtual stages, %lld micro-batches; stages %s%s\n",
                  schedule_->name.c_str(), dims_.pp, schedule_->virtual_stages, static_cast<long long>(accum_),
                  partition_.describe().c_str(), pipe_->tied_split() ? "; tied embedding replicated on the last stage" : "");
    std::fflush(stdout);
  }
  metrics_ = std::make_unique<MetricsWriter>(rank_ == 0 || dry_ ? cfg_.log.metrics_out : "");
  first_step_ = st_.step;
  if (val_loader_ && tc_.eval_at_start) {
    val_start_ = evaluate();
    if (log_) {
      std::printf("step %5lld/%lld | val %.4f (before training)\n", static_cast<long long>(first_step_),
                  static_cast<long long>(tc_.steps), *val_start_);
      std::fflush(stdout);
    }
  }
  for (int64_t step = st_.step; step < tc_.steps; ++step) train_step(step);
  if (!tc_.checkpoint_dir.empty() && (tc_.checkpoint_every <= 0 || st_.step % tc_.checkpoint_every != 0)) save();
  if (saver_) saver_->finish(true);  // the job waits for the save in flight
  res_.tokens_per_s = tps_n_ ? tps_sum_ / static_cast<double>(tps_n_) : 0.0;
  report();
  if (tc_.sample_tokens > 0) sample();
  return res_;
}

void Trainer::report() {
  MemStats ms = MemoryTracker::instance().stats();
  // Every rank's peak and resident bytes per category, gathered to all.
  std::vector<int64_t> mine(2 * kNumMemCategories), every(2 * kNumMemCategories * world_);
  for (int i = 0; i < kNumMemCategories; ++i) {
    mine[i] = ms.peak[i];
    mine[kNumMemCategories + i] = resident_[i];
  }
  if (world_ > 1)
    groups_.metrics->all_gather(mine.data(), every.data(), mine.size(), DType::I64)->wait();
  else
    every = mine;
  const bool pp = dims_.pp > 1;
  const double bubble_formula = parallel::bubble_formula(*schedule_).fraction;
  if (rank_ == 0 || dry_) {
    std::printf("\nmemory per rank (rank %d)      peak          resident after step\n", rank_);
    for (int i = 0; i < kNumMemCategories; ++i)
      std::printf("  %-12s %16s %16s\n", mem_category_name(static_cast<MemCategory>(i)), format_bytes(ms.peak[i]).c_str(),
                  format_bytes(resident_[i]).c_str());
    std::printf("  %-12s %16s\n", "total", format_bytes(ms.total_peak).c_str());
    if (rc_ != Recompute::None)
      std::printf("  activation checkpointing (%s) saved %s of activations (%s held)\n", to_string(rc_),
                  format_bytes(model_->activation_bytes_saved()).c_str(), format_bytes(model_->activation_bytes()).c_str());
    const int64_t F = model_->flat_size();
    parallel::StateBytes want = parallel::expected_state_bytes(spec_.strategy, dt_, F, groups_.shard->size());
    if (model_->has_tied_replica()) {  // the last pipeline stage's copy of a tied embedding
      want.params += static_cast<int64_t>(model_->tied_replica().nbytes());
      want.grads += static_cast<int64_t>(model_->tied_replica_grad().nbytes());
    }
    want.grads += pipe_->grad_bytes();
    if (ep_) {  // the local experts' state, outside the strategy's flat buffers
      const parallel::StateBytes e = ep_->state_bytes();
      want.params += e.params;
      want.grads += e.grads;
      want.optimizer += e.optimizer;
    }
    std::printf("  model state (params+grads+optimizer) %s measured, %s expected for %s %s with %d-way shards "
                "(params %s, grads %s, optimizer %s)\n",
                format_bytes(resident_[0] + resident_[1] + resident_[2]).c_str(), format_bytes(want.total()).c_str(),
                strategy_->name(), dtype_name(dt_), groups_.shard->size(), format_bytes(want.params).c_str(),
                format_bytes(want.grads).c_str(), format_bytes(want.optimizer).c_str());
    if (dt_ == DType::BF16)
      std::printf("  ZeRO paper's mixed-precision figure: %s (it assumes bf16 gradients; this engine keeps them fp32)\n",
                  format_bytes(parallel::zero_paper_bytes(spec_.strategy, F, groups_.shard->size())).c_str());
    if (tps_n_) std::printf("throughput: %.0f tokens/s (mean over steps after the first)\n", res_.tokens_per_s);
    if (mc_.moe() && tps_n_) {
      std::printf("mixture of experts: %lld experts, top-%lld, %lld MoE layers; expert load max/mean %.2f (mean over steps "
                  "after the first); aux loss %.4f (last step); %lld token choices dropped",
                  static_cast<long long>(mc_.moe_experts), static_cast<long long>(mc_.moe_top_k),
                  static_cast<long long>(mc_.moe_layers()), moe_imb_sum_ / tps_n_, moe_aux_last_,
                  static_cast<long long>(moe_dropped_));
      if (ep_)
        std::printf("; ep %d: all-to-all %s per step sent by rank %d, %.2f ms exposed", dims_.ep,
                    format_bytes(a2a_bytes_sum_ / tps_n_).c_str(), rank_, a2a_ms_sum_ / tps_n_);
      std::printf("\n");
    }
    if (pp && tps_n_)
      std::printf("pipeline bubble: %.1f%% of the step idle (mean over pp ranks and steps after the first); "
                  "formula %s = %.1f%%; peak activation slots on rank 0: %d\n",
                  100.0 * bubble_sum_ / tps_n_, parallel::bubble_formula(*schedule_).text.c_str(), 100.0 * bubble_formula,
                  peak_slots_);
    if (world_ > 1) {
      // Exposed time is measured on the compute thread (waits), communication time on the
      // communication threads; on tiny runs the waits include queueing and can exceed it.
      const double hidden = comm_ms_total_ > 0 ? 100.0 * (1.0 - exposed_ms_total_ / comm_ms_total_) : 0.0;
      std::printf("communication (rank %d): %.1f ms per step, %.1f ms exposed -> %.0f%% hidden behind compute%s\n", rank_,
                  tps_n_ ? comm_ms_total_ / tps_n_ : 0.0, tps_n_ ? exposed_ms_total_ / tps_n_ : 0.0,
                  std::clamp(hidden, 0.0, 100.0),
                  hidden < 0 ? " (the waits, which include queueing behind other collectives, exceeded the "
                               "communication time)"
                             : "");
      if (cp_comm_)
        std::printf("context parallel (%s): %.1f ms of cp transfers per step, %.1f ms exposed -> %.0f%% hidden behind "
                    "attention\n",
                    dims_.cp_mode.c_str(), tps_n_ ? cp_comm_ms_total_ / tps_n_ : 0.0,
                    tps_n_ ? cp_exposed_ms_total_ / tps_n_ : 0.0,
                    cp_comm_ms_total_ > 0
                        ? std::clamp(100.0 * (1.0 - cp_exposed_ms_total_ / cp_comm_ms_total_), 0.0, 100.0)
                        : 0.0);
      std::printf("%s", comm::comm_summary_table().c_str());
    }
  }
  nlohmann::json fin = {{"final", true},
                        {"steps", st_.step},
                        {"tokens_per_s", res_.tokens_per_s},
                        {"mem_peak_by_category", category_json(ms.peak)},
                        {"mem_resident_by_category", category_json(resident_)},
                        {"comm_bytes_by_group", nlohmann::json::object()},
                        {"comm_ms_per_step", tps_n_ ? comm_ms_total_ / tps_n_ : 0.0},
                        {"exposed_comm_ms_per_step", tps_n_ ? exposed_ms_total_ / tps_n_ : 0.0},
                        {"world_size", world_},
                        {"strategy", strategy_->name()},
                        {"shard_group_size", groups_.shard->size()},
                        {"flat_size", model_->flat_size()},
                        {"activation_bytes_saved_by_recompute", model_->activation_bytes_saved()},
                        {"num_params", model_->num_params()}};
  if (mc_.moe()) {
    nlohmann::json t = nlohmann::json::array();
    const int64_t E = mc_.moe_experts;
    for (size_t i = 0; E > 0 && i + static_cast<size_t>(E) <= moe_tokens_total_.size(); i += static_cast<size_t>(E))
      t.push_back(std::vector<int64_t>(moe_tokens_total_.begin() + static_cast<std::ptrdiff_t>(i),
                                       moe_tokens_total_.begin() + static_cast<std::ptrdiff_t>(i) + E));
    fin["expert_tokens_total"] = t;
    fin["expert_imbalance_mean"] = tps_n_ ? moe_imb_sum_ / tps_n_ : 0.0;
    fin["moe_dropped_tokens"] = moe_dropped_;
    fin["moe_active_params"] = mc_.active_params();
    fin["ep"] = dims_.ep;
    if (ep_) {
      fin["ep_all_to_all_bytes_per_step"] = tps_n_ ? a2a_bytes_sum_ / tps_n_ : 0;
      fin["ep_all_to_all_ms_per_step"] = tps_n_ ? a2a_ms_sum_ / tps_n_ : 0.0;
      const parallel::StateBytes e = ep_->state_bytes();
      fin["expert_state_bytes"] = {{"params", e.params}, {"grads", e.grads}, {"optimizer", e.optimizer}};
    }
  }
  if (cp_comm_) {
    fin["cp"] = dims_.cp;
    fin["cp_mode"] = dims_.cp_mode;
    fin["cp_comm_ms_per_step"] = tps_n_ ? cp_comm_ms_total_ / tps_n_ : 0.0;
    fin["cp_exposed_ms_per_step"] = tps_n_ ? cp_exposed_ms_total_ / tps_n_ : 0.0;
  }
  if (pp) {
    fin["pp_schedule"] = schedule_->name;
    fin["pp_microbatches"] = accum_;
    fin["pp_virtual_stages"] = schedule_->virtual_stages;
    fin["pp_bubble"] = tps_n_ ? bubble_sum_ / tps_n_ : 0.0;
    fin["pp_bubble_formula"] = bubble_formula;
    fin["pp_peak_activation_slots"] = peak_slots_;
    fin["pp_stages"] = partition_.describe();
  }
  for (const auto& [g, b] : comm::comm_bytes_by_group()) fin["comm_bytes_by_group"][g] = b;
  if (dry_) {
    fin["dry_run"] = true;
    fin["rank"] = rank_;
  }
  if (world_ > 1 && !dry_) {  // a dry run knows only its own rank
    nlohmann::json peaks = nlohmann::json::array(), res_all = nlohmann::json::array();
    for (int r = 0; r < world_; ++r) {
      std::array<int64_t, kNumMemCategories> pk{}, rs{};
      for (int i = 0; i < kNumMemCategories; ++i) {
        pk[i] = every[r * 2 * kNumMemCategories + i];
        rs[i] = every[r * 2 * kNumMemCategories + kNumMemCategories + i];
      }
      peaks.push_back(category_json(pk));
      res_all.push_back(category_json(rs));
    }
    fin["mem_peak_by_category_per_rank"] = peaks;
    fin["mem_resident_by_category_per_rank"] = res_all;
  }
  if (saver_ && saver_->stats().saves > 0) {
    const SaverStats& cs = saver_->stats();
    fin["checkpoint"] = {{"format", "sharded"},
                         {"async", tc_.checkpoint_async},
                         {"saves", cs.saves},
                         {"stall_ms_per_save", cs.stall_ms / static_cast<double>(cs.saves)},
                         {"write_ms_per_save", cs.write_ms / static_cast<double>(cs.saves)},
                         {"bytes_written_per_save", cs.bytes_written / cs.saves},
                         {"staging_bytes", cs.staging_bytes},
                         {"final_wait_ms", cs.final_wait_ms}};
    if (log_)
      std::printf("checkpoints (rank %d): %lld sharded saves%s, training stalled %.1f ms per save (file written in "
                  "%.1f ms, %s per save%s)%s\n",
                  rank_, static_cast<long long>(cs.saves), tc_.checkpoint_async ? " (async)" : "",
                  cs.stall_ms / static_cast<double>(cs.saves), cs.write_ms / static_cast<double>(cs.saves),
                  format_bytes(cs.bytes_written / cs.saves).c_str(),
                  tc_.checkpoint_async ? (", staging buffer " + format_bytes(cs.staging_bytes)).c_str() : "",
                  tc_.checkpoint_async ? ("; the end of the run waited " + std::to_string(static_cast<int64_t>(cs.final_wait_ms)) +
                                          " ms for the last one").c_str()
                                       : "");
  } else if (full_saves_ > 0) {
    fin["checkpoint"] = {{"format", "full"}, {"saves", full_saves_},
                         {"stall_ms_per_save", full_save_ms_ / static_cast<double>(full_saves_)}};
    if (log_)
      std::printf("checkpoints: %lld full saves (rank 0 writes), training stalled %.1f ms per save\n",
                  static_cast<long long>(full_saves_), full_save_ms_ / static_cast<double>(full_saves_));
  }
  if (!load_info_.is_null()) fin["checkpoint_load"] = load_info_;
  if (!res_.val_losses.empty()) fin["val_loss"] = res_.final_val_loss;
  if (val_start_) fin["val_loss_start"] = *val_start_;
  if (log_ && val_start_ && !res_.val_losses.empty())
    std::printf("validation loss: %.4f before training -> %.4f after %lld steps\n", *val_start_, res_.final_val_loss,
                static_cast<long long>(st_.step));
  if (loader_ && loader_->blend) {
    fin["data_tokens_by_dataset"] = loader_->tokens_by_dataset();
    if (log_) {
      std::printf("data seen (all ranks):");
      for (size_t d = 0; d < loader_->blend->num_datasets(); ++d)
        std::printf("%s %s %lld tokens (weight %.3f)", d ? "," : "", loader_->blend->pattern(d).c_str(),
                    static_cast<long long>(loader_->blend->dataset_tokens(d)), loader_->blend->weight(d));
      std::printf("\n");
    }
  }
  metrics_->final(fin);
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
  cfg.train.checkpoint_dir.clear();
  cfg.train.resume.clear();
  cfg.train.init_from.clear();
  cfg.train.sample_tokens = 0;
  cfg.log.trace_out.clear();
}

// The planner picks the data-parallel layout for this job's ranks (same global batch).
void choose_layout(RunConfig& cfg) {
  comm::World& W = comm::World::init(nullptr, nullptr);
  const ModelConfig mc = cfg.model_config();
  plan::AutoLayoutOptions o;
  o.fp32 = cfg.train.dtype != "bf16";
  const int64_t tokens = cfg.train.micro_batch * cfg.train.grad_accum * mc.seq_len * W.size();
  // The planner's picture of this machine comes from this machine: every rank measures the
  // engine's kernels at the model's shapes on the threads it will train with, all at once (they
  // share the cores and the memory bandwidth), and the ranks agree on one set of figures (below).
  {
    const int threads = cfg.train.threads > 0 ? static_cast<int>(cfg.train.threads)
                                              : std::max(1, auto_threads() / W.local_size());
    const int before = omp_get_max_threads();
    omp_set_num_threads(threads);
    plan::CpuMeasurement cm = measure_this_cpu(mc, std::max<int64_t>(1, cfg.train.micro_batch), !o.fp32, W.local_size());
    omp_set_num_threads(before);
    if (W.size() > 1) {
      // The same figures on every rank, so all choose the same layout. With each rank on CPUs of
      // its own, the slowest rank's (the largest reciprocal): every collective waits for it, so
      // the job runs at its pace. Ranks that time-share cores even out: the mean.
      const bool own_cpus = static_cast<int64_t>(W.local_size()) * threads <= auto_threads();
      float f[4] = {static_cast<float>(cm.model_flops), static_cast<float>(cm.mem_bw),
                    static_cast<float>(cm.peak_flops_fp32), static_cast<float>(cm.peak_flops_bf16)};
      if (own_cpus)
        for (float& v : f) v = 1.0f / v;
      W.world()->all_reduce(f, 4, DType::F32, own_cpus ? comm::ReduceOp::Max : comm::ReduceOp::Avg)->wait();
      if (own_cpus)
        for (float& v : f) v = 1.0f / v;
      cm.model_flops = f[0], cm.mem_bw = f[1], cm.peak_flops_fp32 = f[2], cm.peak_flops_bf16 = f[3];
    }
    o.cluster_model = plan::measured_cpu_cluster(cm);
  }
  plan::AutoLayout a = plan::auto_layout(mc, W.size(), W.local_size(), tokens, o);
  cfg.parallel.strategy = a.strategy;
  cfg.parallel.dp_replicate = a.dp_replicate;
  cfg.parallel.dp_shard = a.dp_shard;
  cfg.parallel.tp = a.tp;
  cfg.parallel.pp = a.pp;
  cfg.train.activation_checkpointing = a.activation_checkpointing;
  cfg.train.micro_batch = a.micro_batch;
  cfg.train.grad_accum = a.grad_accum;
  if (comm::should_print(W.rank()))
    std::printf("--auto: %s dp_replicate %d x dp_shard %d, activation checkpointing %s, micro-batch %lld x %lld%s\n"
                "        %s\n",
                a.strategy.c_str(), a.dp_replicate, a.dp_shard, a.activation_checkpointing.c_str(),
                static_cast<long long>(a.micro_batch), static_cast<long long>(a.grad_accum),
                a.fits ? "" : " (nothing fits: the closest layout)", a.why.c_str());
}

}  // namespace mt
