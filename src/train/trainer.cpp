#include "train/trainer.h"

#include <omp.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <optional>
#include <thread>

#include "comm/world.h"
#include "kernels/cpu/activation.h"
#include "parallel/pipeline_executor.h"
#include "parallel/strategy.h"
#include "plan/auto_layout.h"
#include "parallel/tensor_parallel.h"
#include "model/transformer.h"
#include "runtime/arg_parser.h"
#include "train/checkpoint.h"
#include "train/chrome_trace.h"
#include "train/data_loader.h"
#include "train/metrics.h"
#include "parallel/optimizer.h"
#include "train/sampler.h"
#include "train/tokenizer.h"

namespace mt {

namespace {

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t) { return std::chrono::duration<double, std::milli>(Clock::now() - t).count(); }

void validate_parallel(const RunConfig& c, int world) {
  const auto& p = c.parallel;
  static const char* strategies[] = {"NO_SHARD", "ZERO1", "SHARD_GRAD_OP", "FULL_SHARD", "HYBRID_SHARD",
                                     "HYBRID_SHARD_ZERO2"};
  bool known = false;
  for (const char* s : strategies) known |= p.strategy == s;
  if (!known)
    throw ConfigError("parallel.strategy must be one of NO_SHARD, ZERO1, SHARD_GRAD_OP, FULL_SHARD, HYBRID_SHARD, "
                      "HYBRID_SHARD_ZERO2; got '" + p.strategy + "'");
  for (auto [name, v] : {std::pair<const char*, int64_t>{"parallel.dp_replicate", p.dp_replicate},
                         {"parallel.tp", p.tp}, {"parallel.pp", p.pp}, {"parallel.pp_virtual_stages", p.pp_virtual_stages}})
    if (v < 1) throw ConfigError(std::string(name) + " must be >= 1, got " + std::to_string(v));
  if (p.dp_shard == 0 || p.dp_shard < -1) throw ConfigError("parallel.dp_shard must be -1 or >= 1");
  if (p.pp_microbatches < 0) throw ConfigError("parallel.pp_microbatches must be >= 0");
  if (p.prefetch < 0) throw ConfigError("parallel.prefetch must be >= 0");
  if (p.strategy.rfind("HYBRID", 0) != 0 && p.dp_replicate > 1)
    throw ConfigError("parallel.dp_replicate = " + std::to_string(p.dp_replicate) + " needs a HYBRID_* strategy (" +
                      p.strategy + " shards or replicates over every data-parallel rank; set dp_shard instead)");
  try {
    comm::DeviceMesh::resolve({{"pp", static_cast<int>(p.pp)},
                               {"dp_replicate", static_cast<int>(p.dp_replicate)},
                               {"dp_shard", static_cast<int>(p.dp_shard)},
                               {"tp", static_cast<int>(p.tp)}},
                              world);
  } catch (const std::exception& e) {
    throw ConfigError(std::string("parallel mesh: ") + e.what());
  }
}

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

AnyLoader make_loader(const std::string& spec, const char* key, int B, int T, int dp_rank, int dp_world, uint64_t seed,
                      bool shuffle, int64_t vocab) {
  AnyLoader l;
  if (is_blend_spec(spec)) {
    try {
      l.blend = std::make_unique<BlendLoader>(spec, key, B, T, dp_rank, dp_world, seed, shuffle, vocab);
    } catch (const std::invalid_argument& e) {
      throw ConfigError(e.what());
    }
    return l;
  }
  l.ds = std::make_unique<TokenDataset>(spec, vocab);
  l.plain = std::make_unique<BatchLoader>(*l.ds, B, T, dp_rank, dp_world);
  if (shuffle) l.plain->set_shuffle(seed);
  return l;
}

int auto_threads() {
  unsigned hc = std::thread::hardware_concurrency();
  return hc == 0 ? 1 : static_cast<int>(hc);
}

}  // namespace

TrainResult train(const RunConfig& cfg) {
  comm::World& W = comm::World::init(nullptr, nullptr);
  const int rank = W.rank(), world = W.size();
  validate_parallel(cfg, world);
  const bool log = comm::should_print(rank);
  comm::DeviceMesh mesh(W, {{"pp", static_cast<int>(cfg.parallel.pp)},
                            {"dp_replicate", static_cast<int>(cfg.parallel.dp_replicate)},
                            {"dp_shard", static_cast<int>(cfg.parallel.dp_shard)},
                            {"tp", static_cast<int>(cfg.parallel.tp)}});
  auto dp_group = mesh.group(std::vector<std::string>{"dp_replicate", "dp_shard"});
  // Losses and summaries travel on their own group so the dp group's counters hold only gradients.
  auto metrics_group = W.split(0, rank, "metrics");
  const int dp_rank = dp_group->rank(), dp_world = dp_group->size();
  ModelConfig mc = cfg.model_config();
  const int tp = static_cast<int>(cfg.parallel.tp);
  if (tp > 1) {  // vocabulary padded to a multiple of 64 * tp so every tp rank holds whole 64-row blocks
    mc.padded_vocab = (mc.vocab_size + 64 * tp - 1) / (64 * tp) * (64 * tp);
    for (auto [v, what] : {std::pair<int64_t, const char*>{mc.n_head, "model.n_head"}, {mc.n_kv_head, "model.n_kv_head"},
                           {mc.ffn_hidden, "model.ffn_hidden"}})
      if (v % tp != 0)
        throw ConfigError(std::string(what) + " (" + std::to_string(v) + ") must be divisible by parallel.tp (" +
                          std::to_string(tp) + ")");
  }
  DType dt;
  if (!parse_dtype(cfg.train.dtype, &dt)) throw ConfigError("train.dtype must be fp32 or bf16, got '" + cfg.train.dtype + "'");
  Recompute rc;
  if (!parse_recompute(cfg.train.activation_checkpointing, &rc))
    throw ConfigError("train.activation_checkpointing must be none, full or selective, got '" +
                      cfg.train.activation_checkpointing + "'");
  const auto& tc = cfg.train;
  if (tc.micro_batch < 1) throw ConfigError("train.micro_batch must be >= 1");
  if (tc.grad_accum < 1) throw ConfigError("train.grad_accum must be >= 1");
  if (tc.steps < 0) throw ConfigError("train.steps must be >= 0");
  (void)lr_at(0, tc.steps, tc.warmup_steps, tc.lr, tc.min_lr_ratio, tc.lr_schedule);  // validates the schedule name
  const int threads = tc.threads > 0 ? static_cast<int>(tc.threads) : std::max(1, auto_threads() / W.local_size());
  omp_set_num_threads(threads);

  const int pp = static_cast<int>(cfg.parallel.pp);
  // With a pipeline the step's micro-batches are the schedule's (pp_microbatches, default grad_accum).
  const int64_t B = tc.micro_batch, T = mc.seq_len,
                accum = pp > 1 && cfg.parallel.pp_microbatches > 0 ? cfg.parallel.pp_microbatches : tc.grad_accum;
  AnyLoader loader = make_loader(cfg.data.train, "data.train", static_cast<int>(B), static_cast<int>(T), dp_rank,
                                 dp_world, static_cast<uint64_t>(tc.seed), cfg.data.shuffle, mc.vocab_size);
  std::unique_ptr<AnyLoader> val_loader;
  if (!cfg.data.val.empty() && tc.eval_every > 0)
    val_loader = std::make_unique<AnyLoader>(make_loader(cfg.data.val, "data.val", static_cast<int>(B),
                                                         static_cast<int>(T), dp_rank, dp_world,
                                                         static_cast<uint64_t>(tc.seed), false, mc.vocab_size));

  // Groups: non-hybrid strategies shard over every data-parallel rank; hybrid ones shard inside
  // dp_shard and replicate across dp_replicate.
  const bool hybrid = cfg.parallel.strategy.rfind("HYBRID", 0) == 0;
  auto shard_group = hybrid ? mesh.group("dp_shard") : dp_group;
  auto replicate_group = hybrid ? mesh.group("dp_replicate") : W.split(rank, 0, "replicate_none");
  parallel::StrategySpec spec;
  spec.strategy = cfg.parallel.strategy;
  spec.bucket_mb = cfg.parallel.bucket_mb;
  spec.reshard_after_forward = cfg.parallel.reshard_after_forward;
  spec.prefetch = static_cast<int>(cfg.parallel.prefetch);
  spec.reduce_every_microbatch = cfg.parallel.reduce_every_microbatch;
  spec.adam = AdamWConfig{tc.lr, tc.beta1, tc.beta2, tc.eps, tc.weight_decay};
  auto tp_group = mesh.group("tp");
  // Ranks of one tp group are adjacent (tp is the mesh's last dimension): a second communicator
  // over them carries gradient norms and checkpoint gathers, keeping the tp counters to the model.
  auto tp_aux = W.split(rank - mesh.coord("tp"), mesh.coord("tp"), "tp_aux");
  parallel::ProcessGroupTpComm tp_comm(tp_group);
  tp_comm.set_activation_dtype(dt);  // bf16 runs move activations in bf16 (Megatron)
  // Pipeline: the schedule (checked before it runs), the stages' units, this rank's share.
  const int pp_rank = mesh.coord("pp");
  std::unique_ptr<parallel::PipeSchedule> schedule;
  parallel::StagePartition partition;
  std::vector<char> owned;
  std::shared_ptr<comm::ProcessGroup> pp_group, pp_aux;
  if (pp > 1) {
    try {
      schedule = std::make_unique<parallel::PipeSchedule>(parallel::make_schedule(
          cfg.parallel.pp_schedule, pp, static_cast<int>(accum), static_cast<int>(cfg.parallel.pp_virtual_stages)));
      partition = parallel::partition_stages(mc, schedule->num_stages(), cfg.parallel.pp_partition);
    } catch (const std::invalid_argument& e) {
      throw ConfigError(std::string("pipeline: ") + e.what());
    }
    owned = parallel::stage_units_of_rank(partition, pp, pp_rank, static_cast<int>(mc.n_layer) + 2);
    pp_group = mesh.group("pp");
    // Same members as the pp group, for loss and gradient-norm sums (keeps the pp counters to
    // activations and gradients): colour = this rank's coordinates with pp = 0.
    std::vector<int> c0 = {0, mesh.coord("dp_replicate"), mesh.coord("dp_shard"), mesh.coord("tp")};
    pp_aux = W.split(mesh.rank_at(c0), pp_rank, "pp_aux");
  } else if (cfg.parallel.pp_virtual_stages != 1) {
    throw ConfigError("parallel.pp_virtual_stages = " + std::to_string(cfg.parallel.pp_virtual_stages) +
                      " needs parallel.pp > 1");
  }
  Transformer model(mc, dt, rc, parallel::model_storage(spec, dt, shard_group->size()), tp > 1 ? &tp_comm : nullptr,
                    owned);
  model.set_tp_overlap(cfg.parallel.tp_overlap);
  if (tc.loss_chunk_tokens < 0) throw ConfigError("train.loss_chunk_tokens must be >= 0 (0 = off)");
  model.set_loss_chunk(tc.loss_chunk_tokens);
  if (cfg.parallel.sequence_parallel) {
    if (tp == 1) throw ConfigError("parallel.sequence_parallel needs parallel.tp > 1 (it splits the tensor-parallel group's rows)");
    if ((B * T) % tp != 0)
      throw ConfigError("parallel.sequence_parallel: micro_batch x seq_len = " + std::to_string(B * T) +
                        " tokens is not divisible by parallel.tp = " + std::to_string(tp));
    model.set_sequence_parallel(true);
  }
  // The unsplit, unpadded layout of the same model: what checkpoints and initialisation use.
  const Transformer ref(mc, DType::F32, Recompute::None, ModelStorage{false, false, false, 1});
  std::vector<double> norm_weight(model.params().size(), 1.0);
  for (size_t i = 0; i < model.params().size(); ++i)
    if (model.params()[i].tp_split == TpSplit::None) norm_weight[i] = 1.0 / tp;  // replicated on every tp rank
  parallel::verify_same_model(model, *dp_group);
  auto strategy = parallel::make_strategy(spec, model, dp_group, shard_group, replicate_group);
  std::unique_ptr<parallel::PipelineExecutor> pipe;
  if (pp > 1) pipe = std::make_unique<parallel::PipelineExecutor>(model, *schedule, partition, pp_group, strategy.get());
  // Sum of a per-rank value over the pipeline ranks (each stage holds its own part).
  auto pp_sum = [&](double v) {
    if (pp == 1) return v;
    float f = static_cast<float>(v);
    pp_aux->all_reduce(&f, 1, DType::F32, comm::ReduceOp::Sum)->wait();
    return static_cast<double>(f);
  };
  ChromeTrace trace(cfg.log.trace_out, rank);
  TracingHooks tracing(strategy->hooks(), &trace, &model);
  model.set_hooks(trace.enabled() ? static_cast<UnitHooks*>(&tracing) : strategy->hooks());
  const int64_t F = model.flat_size();

  TrainerState st;
  const int U = model.num_units();
  const int64_t RF = ref.flat_size();
  auto workspace = [](int64_t n) { return Tensor::empty({n}, DType::F32, MemCategory::Workspace); };
  if (ref.unit(0).offset != 0) throw std::logic_error("the embedding unit must start the flat buffer");
  // Model state moves between the unsplit layout `ref` (checkpoints, initialisation) and this rank's
  // strategy one unit at a time, so no rank ever holds the whole model's full state for it.
  {
    std::unique_ptr<CheckpointReader> reader;
    Tensor init;  // a fresh run's initial weights (one random stream over the whole model)
    std::string resume_dir;
    bool resume = !tc.resume.empty();
    if (tc.resume == "latest") {
      if (cfg.train.checkpoint_dir.empty()) throw ConfigError("train.resume = \"latest\" needs train.checkpoint_dir");
      // Like torchtitan: a restartable job's first launch has nothing to resume yet.
      if (!std::filesystem::exists(std::filesystem::path(cfg.train.checkpoint_dir) / "latest")) {
        resume = false;
        if (log) std::printf("train.resume = latest: no checkpoint in %s yet, starting fresh\n", cfg.train.checkpoint_dir.c_str());
      }
    }
    if (resume) {
      std::string src = tc.resume == "latest" ? cfg.train.checkpoint_dir : tc.resume;
      resume_dir = resolve_checkpoint(src);
      reader = std::make_unique<CheckpointReader>(resume_dir, ref, true);
      st = reader->state();
      if (log && !tc.init_from.empty()) std::printf("resuming: train.init_from (%s) is not used\n", tc.init_from.c_str());
    } else if (!tc.init_from.empty()) {
      // Weights only (fine-tuning): a safetensors file, or a checkpoint (directory or root with `latest`).
      std::string file = tc.init_from;
      if (std::filesystem::is_directory(file)) file = resolve_checkpoint(file) + "/model.safetensors";
      reader = std::make_unique<CheckpointReader>(ref, file);
      if (log) std::printf("initialised from %s (weights only: optimizer state and step start fresh)\n", file.c_str());
    } else {
      init = workspace(RF);
      ref.init_weights_into(static_cast<uint64_t>(tc.seed), init.f32());
    }
    const bool moments = reader && reader->has_moments();
    strategy->begin_load();
    for (int u = 0; u < U; ++u) {
      const int64_t rn = ref.unit(u).numel, ln = model.unit(u).numel;
      const bool replica = u == 0 && model.has_tied_replica();
      if (ln == 0 && !replica) continue;  // another pipeline stage's unit
      Tensor fw, fm, fv;
      const float* w = init.defined() ? init.f32() + ref.unit(u).offset : nullptr;
      if (reader) {
        fw = workspace(rn);
        if (moments) {
          fm = workspace(rn);
          fv = workspace(rn);
        }
        reader->read_unit(u, fw.f32(), moments ? fm.f32() : nullptr, moments ? fv.f32() : nullptr);
        w = fw.f32();
      }
      if (replica) model.load_tied_replica(ref, w);  // unit 0's range starts with the token embedding
      if (ln == 0) continue;
      Tensor lw = workspace(ln), lm, lv;
      model.shard_unit_from_full(ref, u, w, lw.f32());
      if (moments) {
        lm = workspace(ln);
        lv = workspace(ln);
        model.shard_unit_from_full(ref, u, fm.f32(), lm.f32());
        model.shard_unit_from_full(ref, u, fv.f32(), lv.f32());
      }
      strategy->load_unit(u, lw.f32(), moments ? lm.f32() : nullptr, moments ? lv.f32() : nullptr);
    }
    strategy->end_load(st.adam_steps);
    if (!resume_dir.empty() && loader.blend && st.has_blend) {
      if (!loader.blend->set_state(st.blend) && log)
        std::printf("resuming with a different data.train blend: datasets are matched by pattern, new ones start "
                    "at their first sample\n");
    } else if (!resume_dir.empty()) {
      std::vector<int32_t> skip_x(B * T), skip_y(B * T);
      for (int64_t i = 0; i < st.micro_batches; ++i) loader.next(skip_x.data(), skip_y.data());  // data position
      if (log) std::printf("resumed from %s at step %lld\n", resume_dir.c_str(), static_cast<long long>(st.step));
    }
  }
  mem_release_cache();
  MemoryTracker::instance().reset_peaks();  // peaks describe training, not the one-off setup
  // Unit u's full fp32 state in `ref` layout (collective: every rank calls it for every unit): the
  // strategy gathers this tp rank's part, the tp ranks' parts are assembled, and pipeline stages,
  // which hold disjoint units (zero elsewhere), are summed. `out` gets 1 (weights) or 3 tensors.
  auto gather_full_unit = [&](int u, bool moments, Tensor* out) {
    const int64_t rn = ref.unit(u).numel, ln = model.unit(u).numel;
    const int n = moments ? 3 : 1;
    Tensor local[3];
    for (int i = 0; i < n; ++i) out[i] = Tensor::zeros({rn}, DType::F32, MemCategory::Workspace);
    if (ln > 0) {
      for (int i = 0; i < n; ++i) local[i] = workspace(ln);
      strategy->gather_unit(u, local[0].f32(), moments ? local[1].f32() : nullptr, moments ? local[2].f32() : nullptr);
      Tensor all = tp > 1 ? workspace(ln * tp) : Tensor();
      for (int i = 0; i < n; ++i) {
        std::vector<const float*> parts{local[i].f32()};
        if (tp > 1) {
          tp_aux->all_gather(local[i].f32(), all.f32(), static_cast<size_t>(ln), DType::F32)->wait();
          parts.clear();
          for (int r = 0; r < tp; ++r) parts.push_back(all.f32() + r * ln);
        }
        model.assemble_unit_full(ref, u, parts, out[i].f32());
      }
    }
    if (pp > 1)
      for (int i = 0; i < n; ++i)
        pp_aux->all_reduce(out[i].f32(), static_cast<size_t>(rn), DType::F32, comm::ReduceOp::Sum)->wait();
  };
  // Only rank 0 writes; every rank takes part in the gathers.
  auto save = [&]() {
    std::unique_ptr<CheckpointWriter> writer;
    if (rank == 0) writer = std::make_unique<CheckpointWriter>(tc.checkpoint_dir, ref, true, st.step);
    for (int u = 0; u < U; ++u) {
      Tensor full[3];
      gather_full_unit(u, true, full);
      if (writer) writer->write_unit(u, full[0].f32(), full[1].f32(), full[2].f32());
    }
    st.has_blend = loader.blend != nullptr;
    if (loader.blend) st.blend = loader.blend->state();
    if (writer) writer->commit(st, cfg);
  };

  if (log) {
    std::printf("model %s (%s): %lld parameters, %lld layers, %lld heads, width %lld, seq %lld, vocab %lld (padded %lld)\n",
                mc.name.c_str(), arch_name(mc.arch), static_cast<long long>(ref.num_params()),
                static_cast<long long>(mc.n_layer), static_cast<long long>(mc.n_head), static_cast<long long>(mc.n_embd),
                static_cast<long long>(mc.seq_len), static_cast<long long>(mc.vocab_size),
                static_cast<long long>(mc.padded_vocab));
    std::printf("data %s: %lld tokens | batch %lld x %lld x %lld micro-batches x %d ranks = %lld tokens/step | %s | "
                "recompute %s | %d threads\n",
                cfg.data.train.c_str(), static_cast<long long>(loader.total_tokens()), static_cast<long long>(B),
                static_cast<long long>(T), static_cast<long long>(accum), dp_world,
                static_cast<long long>(B * T * accum * dp_world), dtype_name(dt), recompute_name(rc), threads);
    if (world > 1)
      std::printf("parallel: %s over %s (shard group %d, replicas %d); %lld parameters per tp rank before sharding\n",
                  strategy->name(), mesh.describe().c_str(), shard_group->size(), replicate_group->size(),
                  static_cast<long long>(model.num_params()));
    if (pipe)
      std::printf("pipeline: %s, %d ranks x %d virtual stages, %lld micro-batches; stages %s%s\n",
                  schedule->name.c_str(), pp, schedule->virtual_stages, static_cast<long long>(accum),
                  partition.describe().c_str(), pipe->tied_split() ? "; tied embedding replicated on the last stage" : "");
    std::fflush(stdout);
  }

  MetricsWriter metrics(rank == 0 ? cfg.log.metrics_out : "");
  std::vector<int32_t> x(B * T), y(B * T);
  const double tokens_per_step = static_cast<double>(B * T * accum * dp_world);
  const float dloss = static_cast<float>(1.0 / static_cast<double>(B * T * accum));
  TrainResult res;
  double tps_sum = 0;
  int64_t tps_n = 0;
  std::array<int64_t, kNumMemCategories> resident{};

  // Mean of a per-rank value over the data-parallel ranks (losses are per rank).
  auto dp_mean = [&](double v) {
    if (dp_world == 1) return v;
    float f = static_cast<float>(v);
    metrics_group->all_reduce(&f, 1, DType::F32, comm::ReduceOp::Avg)->wait();
    return static_cast<double>(f);
  };
  auto evaluate = [&]() {
    trace.begin("eval", "eval");
    val_loader->reset();
    double s = 0;
    for (int64_t i = 0; i < tc.eval_batches; ++i) {
      val_loader->next(x.data(), y.data());
      s += pipe ? pipe->eval_forward(x.data(), y.data(), B, T) : model.forward(x.data(), y.data(), B, T, false);
    }
    strategy->after_eval();
    trace.end();
    return dp_mean(pp_sum(s) / static_cast<double>(std::max<int64_t>(1, tc.eval_batches)));
  };
  double comm_ms_total = 0, exposed_ms_total = 0;
  double bubble_sum = 0;
  int peak_slots = 0;
  std::vector<std::vector<int32_t>> xs(pipe ? accum : 0, std::vector<int32_t>(B * T)), ys = xs;
  std::vector<const int32_t*> xp, yp;
  for (int64_t m = 0; m < static_cast<int64_t>(xs.size()); ++m) {
    xp.push_back(xs[m].data());
    yp.push_back(ys[m].data());
  }
  const double bubble_formula = pipe ? parallel::bubble_formula(*schedule).fraction : 0.0;

  const int64_t first_step = st.step;
  std::optional<double> val_start;
  if (val_loader && tc.eval_at_start) {
    val_start = evaluate();
    if (log) {
      std::printf("step %5lld/%lld | val %.4f (before training)\n", static_cast<long long>(first_step),
                  static_cast<long long>(tc.steps), *val_start);
      std::fflush(stdout);
    }
  }
  for (int64_t step = st.step; step < tc.steps; ++step) {
    auto t0 = Clock::now();
    trace.begin("step " + std::to_string(step + 1), "step");
    model.zero_grads();
    double loss = 0;
    parallel::StepComm cs;
    std::optional<double> bubble;
    if (pipe) {
      for (int64_t m = 0; m < accum; ++m) loader.next(xs[m].data(), ys[m].data());
      st.micro_batches += accum;
      parallel::PipelineStepStats ps = pipe->train_step(xp, yp, B, T, dloss, &cs);
      loss = ps.loss_sum;  // the last stage's; summed over the pipeline below
      bubble = pp_sum(ps.idle_fraction()) / pp;
      peak_slots = std::max(peak_slots, ps.peak_slots);
    } else {
      for (int64_t m = 0; m < accum; ++m) {
        loader.next(x.data(), y.data());
        strategy->begin_microbatch(m + 1 == accum);  // only the last micro-batch synchronises
        loss += model.forward(x.data(), y.data(), B, T, true, dloss);
        model.backward();
        ++st.micro_batches;
        strategy->finish_backward(&cs);
      }
    }
    loss = dp_mean(pp_sum(loss) / static_cast<double>(accum));
    double norm_sq = pp_sum(strategy->grad_norm_sq(norm_weight));
    if (tp > 1) {  // tp-split parameters are summed across tp ranks, replicated ones weighted 1/tp
      float f = static_cast<float>(norm_sq);
      tp_aux->all_reduce(&f, 1, DType::F32, comm::ReduceOp::Sum)->wait();
      norm_sq = f;
    }
    double norm = std::sqrt(norm_sq);
    if (!std::isfinite(norm) || !std::isfinite(loss))
      throw std::runtime_error("step " + std::to_string(step + 1) + ": loss or gradient is not finite (loss " +
                               std::to_string(loss) + ", grad norm " + std::to_string(norm) + ")");
    float scale = 1.0f;
    if (tc.grad_clip > 0 && norm > tc.grad_clip) scale = static_cast<float>(tc.grad_clip / (norm + 1e-6));
    const double lr = lr_at(step, tc.steps, tc.warmup_steps, tc.lr, tc.min_lr_ratio, tc.lr_schedule);
    trace.begin("optimizer + parameter sync", "optimizer");
    strategy->optimizer_step(lr, scale, &cs);
    if (pipe) pipe->tied_weights_sync();
    trace.end();
    trace.end();  // step
    st.step = step + 1;
    st.adam_steps = strategy->adam_steps();
    const double step_ms = ms_since(t0);
    double tp_comm_ms = 0, tp_exposed_ms = 0;  // tensor-parallel collectives (mostly on the critical path)
    tp_comm.take_times(&tp_comm_ms, &tp_exposed_ms);
    cs.comm_ms += tp_comm_ms;
    cs.exposed_ms += tp_exposed_ms;
    const double compute_ms = step_ms - cs.exposed_ms;
    resident = MemoryTracker::instance().stats().current;

    StepMetrics sm;
    sm.step = step + 1;
    sm.loss = loss;
    sm.lr = lr;
    sm.grad_norm = norm;
    sm.step_ms = step_ms;
    sm.compute_ms = compute_ms;
    sm.comm_ms = cs.comm_ms;
    sm.exposed_comm_ms = cs.exposed_ms;
    if (bubble) {
      sm.pp_bubble = bubble;
      sm.pp_bubble_formula = bubble_formula;
      if (step > first_step) bubble_sum += *bubble;
    }
    if (step > first_step) {
      comm_ms_total += cs.comm_ms;
      exposed_ms_total += cs.exposed_ms;
    }
    sm.tokens_per_s = tokens_per_step / (step_ms / 1000.0);
    if (cfg.log.peak_flops > 0) sm.mfu = mc.flops_per_token() * sm.tokens_per_s / (cfg.log.peak_flops * world);
    sm.mem_peak_bytes = MemoryTracker::instance().stats().total_peak;
    if (step > first_step) {  // the first step of a run pays warm-up costs
      tps_sum += sm.tokens_per_s;
      ++tps_n;
    }
    if (val_loader && ((step + 1) % tc.eval_every == 0 || step + 1 == tc.steps)) {
      sm.val_loss = evaluate();
      res.val_losses.push_back(*sm.val_loss);
      res.final_val_loss = *sm.val_loss;
    }
    if (loader.blend) sm.data_tokens_by_dataset = loader.tokens_by_dataset();
    res.losses.push_back(loss);
    if (log && (cfg.log.print_every <= 1 || (step + 1) % cfg.log.print_every == 0 || step + 1 == tc.steps ||
                sm.val_loss)) {
      std::printf("%s\n", progress_line(sm, tc.steps).c_str());
      std::fflush(stdout);
    }
    metrics.step(sm);
    if (!tc.checkpoint_dir.empty() && tc.checkpoint_every > 0 && (step + 1) % tc.checkpoint_every == 0) save();
  }
  if (!tc.checkpoint_dir.empty() && (tc.checkpoint_every <= 0 || st.step % tc.checkpoint_every != 0)) save();
  res.tokens_per_s = tps_n ? tps_sum / static_cast<double>(tps_n) : 0.0;

  MemStats ms = MemoryTracker::instance().stats();
  // Every rank's peak and resident bytes per category, gathered to all (raw int64 bytes carried
  // as pairs of f32 slots: all_gather only copies).
  std::vector<int64_t> mine(2 * kNumMemCategories), every(2 * kNumMemCategories * world);
  for (int i = 0; i < kNumMemCategories; ++i) {
    mine[i] = ms.peak[i];
    mine[kNumMemCategories + i] = resident[i];
  }
  if (world > 1)
    metrics_group->all_gather(mine.data(), every.data(), mine.size() * 2, DType::F32)->wait();
  else
    every = mine;
  const bool r0 = rank == 0;
  if (r0) {
    std::printf("\nmemory per rank (rank 0)      peak          resident after step\n");
    for (int i = 0; i < kNumMemCategories; ++i)
      std::printf("  %-12s %16s %16s\n", mem_category_name(static_cast<MemCategory>(i)), format_bytes(ms.peak[i]).c_str(),
                  format_bytes(resident[i]).c_str());
    std::printf("  %-12s %16s\n", "total", format_bytes(ms.total_peak).c_str());
    if (rc != Recompute::None)
      std::printf("  activation checkpointing (%s) saved %s of activations (%s held)\n", recompute_name(rc),
                  format_bytes(model.activation_bytes_saved()).c_str(), format_bytes(model.activation_bytes()).c_str());
    parallel::StateBytes want = parallel::expected_state_bytes(spec.strategy, dt, F, shard_group->size());
    if (model.has_tied_replica()) {  // the last pipeline stage's copy of a tied embedding
      want.params += static_cast<int64_t>(model.tied_replica().nbytes());
      want.grads += static_cast<int64_t>(model.tied_replica_grad().nbytes());
    }
    if (pipe) want.grads += pipe->grad_bytes();
    std::printf("  model state (params+grads+optimizer) %s measured, %s expected for %s %s with %d-way shards "
                "(params %s, grads %s, optimizer %s)\n",
                format_bytes(resident[0] + resident[1] + resident[2]).c_str(), format_bytes(want.total()).c_str(),
                strategy->name(), dtype_name(dt), shard_group->size(), format_bytes(want.params).c_str(),
                format_bytes(want.grads).c_str(), format_bytes(want.optimizer).c_str());
    if (dt == DType::BF16)
      std::printf("  ZeRO paper's mixed-precision figure: %s (it assumes bf16 gradients; this engine keeps them fp32)\n",
                  format_bytes(parallel::zero_paper_bytes(spec.strategy, F, shard_group->size())).c_str());
    if (tps_n) std::printf("throughput: %.0f tokens/s (mean over steps after the first)\n", res.tokens_per_s);
    if (pipe && tps_n)
      std::printf("pipeline bubble: %.1f%% of the step idle (mean over pp ranks and steps after the first); "
                  "formula %s = %.1f%%; peak activation slots on rank 0: %d\n",
                  100.0 * bubble_sum / tps_n, parallel::bubble_formula(*schedule).text.c_str(), 100.0 * bubble_formula,
                  peak_slots);
    if (world > 1) {
      std::printf("communication (rank 0): %.1f ms per step, %.1f ms exposed -> %.0f%% hidden behind compute\n",
                  tps_n ? comm_ms_total / tps_n : 0.0, tps_n ? exposed_ms_total / tps_n : 0.0,
                  comm_ms_total > 0 ? 100.0 * (1.0 - exposed_ms_total / comm_ms_total) : 0.0);
      std::printf("%s", comm::comm_summary_table().c_str());
    }
  }
  nlohmann::json fin = {{"final", true},
                        {"steps", st.step},
                        {"tokens_per_s", res.tokens_per_s},
                        {"mem_peak_by_category", category_json(ms.peak)},
                        {"mem_resident_by_category", category_json(resident)},
                        {"comm_bytes_by_group", nlohmann::json::object()},
                        {"comm_ms_per_step", tps_n ? comm_ms_total / tps_n : 0.0},
                        {"exposed_comm_ms_per_step", tps_n ? exposed_ms_total / tps_n : 0.0},
                        {"world_size", world},
                        {"strategy", strategy->name()},
                        {"shard_group_size", shard_group->size()},
                        {"flat_size", F},
                        {"activation_bytes_saved_by_recompute", model.activation_bytes_saved()},
                        {"num_params", model.num_params()}};
  if (pipe) {
    fin["pp_schedule"] = schedule->name;
    fin["pp_microbatches"] = accum;
    fin["pp_virtual_stages"] = schedule->virtual_stages;
    fin["pp_bubble"] = tps_n ? bubble_sum / tps_n : 0.0;
    fin["pp_bubble_formula"] = bubble_formula;
    fin["pp_peak_activation_slots"] = peak_slots;
    fin["pp_stages"] = partition.describe();
  }
  for (const auto& [g, b] : comm::comm_bytes_by_group()) fin["comm_bytes_by_group"][g] = b;
  if (world > 1) {
    nlohmann::json peaks = nlohmann::json::array(), res_all = nlohmann::json::array();
    for (int r = 0; r < world; ++r) {
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
  if (!res.val_losses.empty()) fin["val_loss"] = res.final_val_loss;
  if (val_start) fin["val_loss_start"] = *val_start;
  if (log && val_start && !res.val_losses.empty())
    std::printf("validation loss: %.4f before training -> %.4f after %lld steps\n", *val_start, res.final_val_loss,
                static_cast<long long>(st.step));
  if (loader.blend) {
    fin["data_tokens_by_dataset"] = loader.tokens_by_dataset();
    if (log) {
      std::printf("data seen (all ranks):");
      for (size_t d = 0; d < loader.blend->num_datasets(); ++d)
        std::printf("%s %s %lld tokens (weight %.3f)", d ? "," : "", loader.blend->pattern(d).c_str(),
                    static_cast<long long>(loader.blend->dataset_tokens(d)), loader.blend->weight(d));
      std::printf("\n");
    }
  }
  metrics.final(fin);

  if (tc.sample_tokens > 0) {
    // Sample from an unsharded copy of the trained weights (gathered unit by unit onto rank 0).
    Tensor full = r0 ? Tensor::zeros({RF}, DType::F32, MemCategory::Workspace) : Tensor();
    for (int u = 0; u < U; ++u) {
      Tensor w;
      gather_full_unit(u, false, &w);
      if (r0) std::memcpy(full.f32() + ref.unit(u).offset, w.f32(), ref.unit(u).numel * sizeof(float));
    }
    if (!r0) return res;
    Transformer plain(mc, DType::F32);
    std::memcpy(plain.weights().f32(), full.f32(), RF * sizeof(float));
    auto tok = make_tokenizer(cfg.data.tokenizer, cfg.data.gpt2_dir, cfg.data.tokenizer_file);
    std::vector<int32_t> prompt = tok->encode(tc.sample_prompt);
    if (prompt.empty()) prompt.push_back(tok->eot_token() >= 0 ? tok->eot_token() : static_cast<int32_t>('\n'));
    SampleOptions so;
    so.tokens = tc.sample_tokens;
    so.temperature = 0.8f;
    so.top_k = 40;
    so.seed = static_cast<uint64_t>(tc.seed);
    auto out = generate(plain, prompt, so, tok->eot_token());
    std::printf("\n--- sample (%lld tokens, temperature 0.8, top-k 40) ---\n%s\n---\n",
                static_cast<long long>(tc.sample_tokens), tok->decode(out).c_str());
  }
  return res;
}

// `train --auto`: the planner picks the data-parallel layout for this job's ranks (same global batch).
static void choose_layout(RunConfig& cfg) {
  comm::World& W = comm::World::init(nullptr, nullptr);
  const ModelConfig mc = cfg.model_config();
  plan::AutoLayoutOptions o;
  o.fp32 = cfg.train.dtype != "bf16";
  const int64_t tokens = cfg.train.micro_batch * cfg.train.grad_accum * mc.seq_len * W.size();
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

// Reports an error. In a multi-rank job the whole job is ended (MPI_Abort via World::abort, which
// names this rank and dumps its recent collectives) so no rank is left waiting in a collective.
static int fail(const std::string& msg, int code) {
  if (comm::World::initialized() && comm::World::get().size() > 1)
    comm::World::get().abort("meshtrain train: " + msg, code);
  std::fprintf(stderr, "meshtrain train: %s\n", msg.c_str());
  return code;
}

int run_train_command(int argc, char** argv) {
  ArgParser ap({"config", "model.*", "data.*", "train.*", "parallel.*", "log.*"}, {"help", "auto"});
  try {
    ap.parse(argc, argv, 1);
  } catch (const ArgError& e) {
    std::fprintf(stderr, "meshtrain train: %s (see --help)\n", e.what());
    return 2;
  }
  if (ap.flag("help")) {
    std::printf(
        "usage: meshtrain train [--config FILE] [--section.key value ...]\n\n"
        "Trains a GPT-2 or Llama-style model. Run it directly for one process, or under mpirun\n"
        "(or `meshtrain launch -n N -- train ...`) where each process is one rank.\n"
        "The config is TOML with sections [model] [data] [train] [parallel] [log]; any key can be\n"
        "overridden on the command line as --section.key value or --section.key=value.\n"
        "--auto lets the planner choose parallel.strategy, dp_replicate / dp_shard, activation\n"
        "checkpointing and the micro-batch split for the ranks the job was given, keeping the global\n"
        "batch (micro_batch x grad_accum x ranks sequences).\n\n"
        "keys (default value, meaning):\n%s\n"
        "model presets: ",
        RunConfig::keys_help().c_str());
    for (const auto& n : model_preset_names()) std::printf("%s ", n.c_str());
    std::printf("\n");
    return 0;
  }
  try {
    RunConfig cfg = RunConfig::load(ap.get("config"), ap.dotted());
    if (ap.flag("auto")) choose_layout(cfg);
    train(cfg);
  } catch (const ConfigError& e) {
    return fail(std::string("config error: ") + e.what(), 2);
  } catch (const std::exception& e) {
    return fail(e.what(), 1);
  }
  if (comm::World::initialized()) comm::World::get().finalize();
  return 0;
}

}  // namespace mt
