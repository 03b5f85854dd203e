#include "train/metrics_processor.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "comm/world.h"
#include "kernels/backend.h"
#include "parallel/offload.h"
#include "runtime/host_transfer.h"
#include "runtime/memory.h"

namespace mt {

nlohmann::json tokens_by_dataset(const BlendLoader& blend) {
  nlohmann::json j = nlohmann::json::object();
  for (size_t d = 0; d < blend.num_datasets(); ++d) j[blend.pattern(d)] = blend.dataset_tokens(d);
  return j;
}

MetricsProcessor::MetricsProcessor(const RunConfig& cfg, const ModelConfig& mc, const ParallelGroups& groups,
                                   parallel::ParallelModel& pm, DType dtype, int rank, int world, bool dry,
                                   int64_t first_step)
    : cfg_(cfg), tc_(cfg.train), mc_(mc), plan_(pm.plan()), groups_(groups), pm_(pm), dt_(dtype), rank_(rank),
      world_(world), dry_(dry), log_(dry || comm::should_print(rank)), first_step_(first_step),
      writer_(rank == 0 || dry ? cfg.log.metrics_out : ""),
      stragglers_(groups.metrics.get(), comm::World::get().hostname(),  // a dry run counts its bytes too
                  cfg.log.straggler_every, cfg.log.straggler_ratio, cfg.log.straggler_min_ms, first_step) {
  if (cfg.log.straggler_every < 0) throw ConfigError("log.straggler_every must be >= 0 (0 = never)");
  if (cfg.log.straggler_ratio < 1.0) throw ConfigError("log.straggler_ratio must be >= 1");
  if (cfg.log.straggler_min_ms < 0) throw ConfigError("log.straggler_min_ms must be >= 0");
}

void MetricsProcessor::print_header(int64_t params, int64_t data_tokens, int threads) const {
  if (!log_) return;
  const int64_t B = plan_.micro_batch, T_full = mc_.seq_len, T_rank = T_full / plan_.cp, accum = plan_.microbatches;
  const Recompute rc = plan_.checkpointing;
  std::printf("model %s (%s): %lld parameters, %lld layers, %lld heads, width %lld, seq %lld, vocab %lld (padded %lld)\n",
              mc_.name.c_str(), arch_name(mc_.arch), static_cast<long long>(params),
              static_cast<long long>(mc_.n_layer), static_cast<long long>(mc_.n_head), static_cast<long long>(mc_.n_embd),
              static_cast<long long>(mc_.seq_len), static_cast<long long>(mc_.vocab_size),
              static_cast<long long>(mc_.padded_vocab));
  std::printf("data %s: %lld tokens | batch %lld x %lld x %lld micro-batches x %d ranks = %lld tokens/step | %s | "
              "recompute %s | %d threads\n",
              cfg_.data.train.c_str(), static_cast<long long>(data_tokens),
              static_cast<long long>(B), static_cast<long long>(T_full), static_cast<long long>(accum), plan_.dp(),
              static_cast<long long>(B * T_full * accum * plan_.dp()), dtype_name(dt_), to_string(rc), threads);
  if (plan_.cp > 1)
    std::printf("context parallel: cp %d (%s), each sequence in %d chunks of %lld tokens, %lld tokens per rank\n",
                plan_.cp, plan_.cp_mode.c_str(), 2 * plan_.cp, static_cast<long long>(T_full / (2 * plan_.cp)),
                static_cast<long long>(T_rank));
  std::printf("device %s\n", kernels::describe(current_device()).c_str());
  if (world_ > 1)
    std::printf("parallel: %s over %s (shard group %d, replicas %d); %lld parameters per tp rank before sharding\n",
                pm_.strategy().name(), groups_.mesh->describe().c_str(), groups_.shard->size(), groups_.replicate->size(),
                static_cast<long long>(pm_.model().num_params()));
  if (plan_.pp > 1)
    std::printf("pipeline: %s, %d ranks x %d virtual stages, %lld micro-batches; stages %s%s\n",
                pm_.schedule().name.c_str(), plan_.pp, pm_.schedule().virtual_stages, static_cast<long long>(accum),
                pm_.partition().describe().c_str(),
                pm_.pipeline().tied_split() ? "; tied embedding replicated on the last stage" : "");
  std::fflush(stdout);
}

StepMetrics MetricsProcessor::step(int64_t step, const parallel::StepResult& r, double lr, Clock::time_point t0,
                                   parallel::StepComm cs, double data_ms) {
  double a2a_ms = 0;
  int64_t a2a_bytes = 0;
  nlohmann::json moe = mc_.moe() ? moe_step_metrics(&a2a_ms, &a2a_bytes) : nlohmann::json();
  const double step_ms = ms_since(t0);
  double cp_ms = 0, cp_exposed = 0;
  pm_.take_model_comm(&cs, &cp_ms, &cp_exposed);
  cs.comm_ms += a2a_ms;  // the token exchanges: synchronous, so all of it exposed
  cs.exposed_ms += a2a_ms;
  resident_ = MemoryTracker::instance().stats().current;
  const bool counted = step > first_step_;  // the first step of a run pays warm-up costs
  StepMetrics sm;
  sm.step = step + 1;
  sm.loss = r.loss;
  sm.lr = lr;
  sm.grad_norm = r.grad_norm;
  sm.step_ms = step_ms;
  sm.compute_ms = step_ms - cs.exposed_ms - data_ms;
  sm.data_wait_ms = data_ms;
  sm.comm_ms = cs.comm_ms;
  sm.exposed_comm_ms = cs.exposed_ms;
  if (plan_.pp > 1) {
    sm.pp_bubble = r.bubble;
    sm.pp_idle_ms = r.idle_ms;
    sm.pp_bubble_formula = parallel::bubble_formula(pm_.schedule()).fraction;
    peak_slots_ = std::max(peak_slots_, r.stats.peak_slots);
  }
  double tokens_per_step = static_cast<double>(plan_.micro_batch * (mc_.seq_len / plan_.cp) * plan_.microbatches *
                                               groups_.dp->size());
  if (step_tokens_) tokens_per_step = static_cast<double>(*step_tokens_);
  step_tokens_.reset();
  sm.tokens_per_s = tokens_per_step / (step_ms / 1000.0);
  if (cfg_.log.peak_flops > 0) sm.mfu = mc_.flops_per_token() * sm.tokens_per_s / (cfg_.log.peak_flops * world_);
  sm.mem_peak_bytes = MemoryTracker::instance().stats().total_peak;
  sm.moe = moe;
  if (mc_.moe()) moe_aux_last_ = moe.value("moe_aux_loss", 0.0);
  std::string slow;
  sm.stragglers = stragglers_.add(step, {step_ms, data_ms, sm.compute_ms, cs.exposed_ms}, &slow);
  if (sm.stragglers.is_object()) {
    ++straggler_checks_;
    if (!sm.stragglers["straggler"].is_null()) ++straggler_named_;
  }
  if (!slow.empty() && log_) {
    std::printf("%s\n", slow.c_str());
    std::fflush(stdout);
  }
  if (!counted) return sm;
  data_ms_total_ += data_ms;
  cp_comm_ms_total_ += cp_ms;
  cp_exposed_ms_total_ += cp_exposed;
  if (plan_.pp > 1) {
    bubble_sum_ += r.bubble;
    idle_ms_.push_back(r.idle_ms);
    window_ms_sum_ += r.window_ms;
    if (stage_ms_sum_.size() != r.stage_ms.size()) stage_ms_sum_.assign(r.stage_ms.size(), 0.0);
    for (size_t i = 0; i < r.stage_ms.size(); ++i) stage_ms_sum_[i] += r.stage_ms[i];
  }
  comm_ms_total_ += cs.comm_ms;
  exposed_ms_total_ += cs.exposed_ms;
  if (mc_.moe()) {
    moe_imb_sum_ += moe.value("expert_imbalance", 0.0);
    a2a_ms_sum_ += a2a_ms;
    a2a_bytes_sum_ += a2a_bytes;
  }
  tps_sum_ += sm.tokens_per_s;
  ++tps_n_;
  return sm;
}

void MetricsProcessor::emit(const StepMetrics& m) {
  if (log_ && (cfg_.log.print_every <= 1 || m.step % cfg_.log.print_every == 0 || m.step == tc_.steps || m.val_loss)) {
    std::printf("%s\n", progress_line(m, tc_.steps).c_str());
    std::fflush(stdout);
  }
  writer_.step(m);
}

nlohmann::json MetricsProcessor::moe_step_metrics(double* a2a_ms, int64_t* a2a_bytes) {
  Transformer::MoeStats st = pm_.model().take_moe_stats();
  pm_.take_expert_comm(a2a_ms, a2a_bytes);
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
  const double dp = plan_.dp(), tpn = plan_.tp;
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

std::vector<int64_t> MetricsProcessor::gather_memory(const MemStats& ms) {
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
  return every;
}

void MetricsProcessor::print_memory(const MemStats& ms) const {
  const Recompute rc = plan_.checkpointing;
  std::printf("\nmemory per rank (rank %d)      peak          resident after step\n", rank_);
  for (int i = 0; i < kNumMemCategories; ++i)
    std::printf("  %-12s %16s %16s\n", mem_category_name(static_cast<MemCategory>(i)), format_bytes(ms.peak[i]).c_str(),
                format_bytes(resident_[i]).c_str());
  std::printf("  %-12s %16s\n", "total", format_bytes(ms.total_peak).c_str());
  if (rc != Recompute::None)
    std::printf("  activation checkpointing (%s) saved %s of activations (%s held)\n", to_string(rc),
                format_bytes(pm_.model().activation_bytes_saved()).c_str(), format_bytes(pm_.model().activation_bytes()).c_str());
  const int64_t F = pm_.model().flat_size();
  parallel::StateBytes want =
      parallel::expected_state_bytes(plan_.strategy, dt_, F, groups_.shard->size(),
                                     pm_.model().compact_state() ? pm_.model().state_size() : -1);
  if (plan_.offload_optimizer()) {  // the device keeps the compute-dtype weights and the gradients
    want = {(dt_ == DType::BF16 ? 2 : 4) * F, 4 * F, 0};
    const MemStats h = pinned_memory_tracker().stats();
    const parallel::StateBytes hw = parallel::offload_host_bytes(dt_, F);
    std::printf("  offloaded to pinned host memory: %s measured, %s expected (params %s, grads %s, optimizer %s)\n",
                format_bytes(h.total_current).c_str(), format_bytes(hw.total()).c_str(),
                format_bytes(h.current[0]).c_str(), format_bytes(h.current[1]).c_str(),
                format_bytes(h.current[2]).c_str());
  }
  if (pm_.model().has_tied_replica()) {  // the last pipeline stage's copy of a tied embedding
    want.params += static_cast<int64_t>(pm_.model().tied_replica().nbytes());
    want.grads += static_cast<int64_t>(pm_.model().tied_replica_grad().nbytes());
  }
  want.grads += pm_.pipeline().grad_bytes();
  if (pm_.experts()) {  // the local experts' state, outside the strategy's flat buffers
    const parallel::StateBytes e = pm_.experts()->state_bytes();
    want.params += e.params;
    want.grads += e.grads;
    want.optimizer += e.optimizer;
  }
  std::printf("  model state (params+grads+optimizer) %s measured, %s expected for %s %s with %d-way shards "
              "(params %s, grads %s, optimizer %s)\n",
              format_bytes(resident_[0] + resident_[1] + resident_[2]).c_str(), format_bytes(want.total()).c_str(),
              pm_.strategy().name(), dtype_name(dt_), groups_.shard->size(), format_bytes(want.params).c_str(),
              format_bytes(want.grads).c_str(), format_bytes(want.optimizer).c_str());
  if (dt_ == DType::BF16)
    std::printf("  ZeRO paper's mixed-precision figure: %s (it assumes bf16 gradients; this engine keeps them fp32)\n",
                format_bytes(parallel::zero_paper_bytes(plan_.strategy, F, groups_.shard->size())).c_str());
}

std::vector<std::array<double, 3>> MetricsProcessor::stage_costs(bool cpu) const {
  std::vector<std::array<double, 3>> c;
  const size_t S = stage_ms_sum_.size() / 6, o = cpu ? 3 * S : 0;
  if (!tps_n_ || !S) return c;
  for (size_t s = 0; s < S; ++s)
    c.push_back({stage_ms_sum_[o + s] / tps_n_, stage_ms_sum_[o + S + s] / tps_n_, stage_ms_sum_[o + 2 * S + s] / tps_n_});
  return c;
}

double MetricsProcessor::idle_ms_mean() const {
  double sum = 0;
  for (double v : idle_ms_) sum += v;
  return idle_ms_.empty() ? 0.0 : sum / static_cast<double>(idle_ms_.size());
}

double MetricsProcessor::idle_ms_median() const { return median(idle_ms_); }

double MetricsProcessor::costed_bubble() const {
  // The simulation gives every stage the same costs: the mean over the stages, scaled to one
  // rank's share (v stages), with W's share of the backward as measured (CPU time: what the work
  // costs, whatever else ran on the cores).
  const auto c = stage_costs(true);
  if (c.empty()) return 0.0;
  double f = 0, b = 0, w = 0;
  for (const auto& x : c) f += x[0], b += x[1], w += x[2];
  const double v = pm_.schedule().virtual_stages, S = static_cast<double>(c.size());
  if (f <= 0 || b + w <= 0) return 0.0;
  const parallel::PipeSchedule& s = pm_.schedule();
  return parallel::simulate_timeline(s, f * v / S, (b + w) * v / S, 0.0, s.split_backward ? w / (b + w) : 0.5)
      .bubble_fraction;
}

void MetricsProcessor::print_run_summary() const {
  const bool pp = plan_.pp > 1;
  const double bubble_formula = parallel::bubble_formula(pm_.schedule()).fraction;
  if (tps_n_) std::printf("throughput: %.0f tokens/s (mean over steps after the first)\n", tokens_per_s());
  if (mc_.moe() && tps_n_) {
    std::printf("mixture of experts: %lld experts, top-%lld, %lld MoE layers; expert load max/mean %.2f (mean over steps "
                "after the first); aux loss %.4f (last step); %lld token choices dropped",
                static_cast<long long>(mc_.moe_experts), static_cast<long long>(mc_.moe_top_k),
                static_cast<long long>(mc_.moe_layers()), moe_imb_sum_ / tps_n_, moe_aux_last_,
                static_cast<long long>(moe_dropped_));
    if (pm_.experts())
      std::printf("; ep %d: all-to-all %s per step sent by rank %d, %.2f ms exposed", plan_.ep,
                  format_bytes(a2a_bytes_sum_ / tps_n_).c_str(), rank_, a2a_ms_sum_ / tps_n_);
    std::printf("\n");
  }
  if (pp && tps_n_)
    std::printf("pipeline bubble: %.1f%% of the step idle (mean over pp ranks and steps after the first); "
                "formula %s = %.1f%%; peak activation slots on rank 0: %d\n",
                100.0 * bubble_sum_ / tps_n_, parallel::bubble_formula(pm_.schedule()).text.c_str(), 100.0 * bubble_formula,
                peak_slots_);
  if (pp && !idle_ms_.empty())
    std::printf("pipeline idle time: %.2f ms per step within the step's window (longest rank span; mean over pp "
                "ranks), median over steps after the first %.2f ms\n",
                idle_ms_mean(), idle_ms_median());
  if (pp && tps_n_) {
    std::printf("pipeline stage costs per micro-batch (ms, F / B / W; wall, CPU time):");
    const auto c = stage_costs(), u = stage_costs(true);
    for (size_t i = 0; i < c.size(); ++i)
      std::printf(" stage %zu %.2f / %.2f / %.2f, %.2f / %.2f / %.2f;", i, c[i][0], c[i][1], c[i][2], u[i][0], u[i][1], u[i][2]);
    std::printf(" simulated bubble with the CPU-time costs %.1f%%\n", 100.0 * costed_bubble());
  }
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
    if (pm_.context_parallel())
      std::printf("context parallel (%s): %.1f ms of cp transfers per step, %.1f ms exposed -> %.0f%% hidden behind "
                  "attention\n",
                  plan_.cp_mode.c_str(), tps_n_ ? cp_comm_ms_total_ / tps_n_ : 0.0,
                  tps_n_ ? cp_exposed_ms_total_ / tps_n_ : 0.0,
                  cp_comm_ms_total_ > 0
                      ? std::clamp(100.0 * (1.0 - cp_exposed_ms_total_ / cp_comm_ms_total_), 0.0, 100.0)
                      : 0.0);
    std::printf("%s", comm::comm_summary_table().c_str());
  }
}

nlohmann::json MetricsProcessor::final_json(const MemStats& ms, const std::vector<int64_t>& every) const {
  const bool pp = plan_.pp > 1;
  const double bubble_formula = parallel::bubble_formula(pm_.schedule()).fraction;
  const int64_t accum = plan_.microbatches;
  nlohmann::json fin = {{"final", true},
                        {"tokens_per_s", tokens_per_s()},
                        {"mem_peak_by_category", category_json(ms.peak)},
                        {"mem_resident_by_category", category_json(resident_)},
                        {"comm_bytes_by_group", nlohmann::json::object()},
                        {"comm_ms_per_step", tps_n_ ? comm_ms_total_ / tps_n_ : 0.0},
                        {"exposed_comm_ms_per_step", tps_n_ ? exposed_ms_total_ / tps_n_ : 0.0},
                        {"data_wait_ms_per_step", tps_n_ ? data_ms_total_ / tps_n_ : 0.0},
                        {"world_size", world_},
                        {"device", device_name(current_device())},
                        {"strategy", pm_.strategy().name()},
                        {"shard_group_size", groups_.shard->size()},
                        {"flat_size", pm_.model().flat_size()},
                        {"state_size", pm_.model().state_size()},
                        {"activation_bytes_saved_by_recompute", pm_.model().activation_bytes_saved()},
                        {"num_params", pm_.model().num_params()}};
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
    fin["ep"] = plan_.ep;
    if (pm_.experts()) {
      fin["ep_all_to_all_bytes_per_step"] = tps_n_ ? a2a_bytes_sum_ / tps_n_ : 0;
      fin["ep_all_to_all_ms_per_step"] = tps_n_ ? a2a_ms_sum_ / tps_n_ : 0.0;
      const parallel::StateBytes e = pm_.experts()->state_bytes();
      fin["expert_state_bytes"] = {{"params", e.params}, {"grads", e.grads}, {"optimizer", e.optimizer}};
    }
  }
  if (pm_.context_parallel()) {
    fin["cp"] = plan_.cp;
    fin["cp_mode"] = plan_.cp_mode;
    fin["cp_comm_ms_per_step"] = tps_n_ ? cp_comm_ms_total_ / tps_n_ : 0.0;
    fin["cp_exposed_ms_per_step"] = tps_n_ ? cp_exposed_ms_total_ / tps_n_ : 0.0;
  }
  if (pp) {
    fin["pp_schedule"] = pm_.schedule().name;
    fin["pp_microbatches"] = accum;
    fin["pp_virtual_stages"] = pm_.schedule().virtual_stages;
    fin["pp_bubble"] = tps_n_ ? bubble_sum_ / tps_n_ : 0.0;
    fin["pp_bubble_formula"] = bubble_formula;
    fin["pp_idle_ms"] = idle_ms_mean();
    fin["pp_idle_ms_median"] = idle_ms_median();
    fin["pp_window_ms"] = idle_ms_.empty() ? 0.0 : window_ms_sum_ / static_cast<double>(idle_ms_.size());
    fin["pp_peak_activation_slots"] = peak_slots_;
    nlohmann::json costs = nlohmann::json::array();
    for (const auto& x : stage_costs()) costs.push_back({{"F", x[0]}, {"B", x[1]}, {"W", x[2]}});
    fin["pp_stage_ms"] = costs;  // per stage: mean ms of one micro-batch's forward, B and W
    nlohmann::json cpu = nlohmann::json::array();
    for (const auto& x : stage_costs(true)) cpu.push_back({{"F", x[0]}, {"B", x[1]}, {"W", x[2]}});
    fin["pp_stage_cpu_ms"] = cpu;  // the same in the compute thread's CPU time
    fin["pp_bubble_costed"] = costed_bubble();
    const parallel::StageCosts& sc = pm_.schedule_costs();
    fin["pp_costs"] = {{"F", sc.f}, {"B", sc.b}, {"W", sc.w}};  // what the schedule in use is built for
    fin["pp_stages"] = pm_.partition().describe();
  }
  for (const auto& [g, b] : comm::comm_bytes_by_group()) fin["comm_bytes_by_group"][g] = b;
  if (straggler_checks_) {
    fin["straggler_checks"] = straggler_checks_;
    fin["straggler_checks_naming_a_rank"] = straggler_named_;
  }
  fin["offload"] = to_string(plan_.offload);
  if (plan_.offload_optimizer()) {  // the host side of the split: page-locked bytes by category
    fin["mem_host_by_category"] = category_json(pinned_memory_tracker().stats().current);
  }
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
  return fin;
}

void MetricsProcessor::add_checkpoints(nlohmann::json& fin, const RunOutcome& o) const {
  if (o.saver && o.saver->stats().saves > 0) {
    const SaverStats& cs = o.saver->stats();
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
  } else if (o.full_saves > 0) {
    fin["checkpoint"] = {{"format", "full"}, {"saves", o.full_saves},
                         {"stall_ms_per_save", o.full_save_ms / static_cast<double>(o.full_saves)}};
    if (log_)
      std::printf("checkpoints: %lld full saves (rank 0 writes), training stalled %.1f ms per save\n",
                  static_cast<long long>(o.full_saves), o.full_save_ms / static_cast<double>(o.full_saves));
  }
  if (!o.load_info.is_null()) fin["checkpoint_load"] = o.load_info;
}

void MetricsProcessor::report(const RunOutcome& o) {
  const MemStats ms = MemoryTracker::instance().stats();
  const std::vector<int64_t> every = gather_memory(ms);
  if (rank_ == 0 || dry_) {
    print_memory(ms);
    print_run_summary();
  }
  nlohmann::json fin = final_json(ms, every);
  fin["steps"] = o.steps;
  add_checkpoints(fin, o);
  if (!o.val_losses.empty()) fin["val_loss"] = o.final_val_loss;
  const auto final_bpb = o.val_losses.empty() ? std::nullopt : bits_per_byte(o.final_val_loss, o.val_bytes_per_token);
  if (final_bpb) fin["val_bits_per_byte"] = *final_bpb;
  if (o.val_start) fin["val_loss_start"] = *o.val_start;
  if (o.trained_tokens) {
    fin["trained_tokens"] = *o.trained_tokens;
    if (log_) std::printf("loss masks: %lld targets trained (all ranks)\n", static_cast<long long>(*o.trained_tokens));
  }
  if (log_ && o.val_start && !o.val_losses.empty())
    std::printf("validation loss: %.4f before training -> %.4f%s after %lld steps\n", *o.val_start, o.final_val_loss,
                bits_per_byte_note(final_bpb).c_str(), static_cast<long long>(o.steps));
  if (o.blend) {
    fin["data_tokens_by_dataset"] = tokens_by_dataset(*o.blend);
    if (log_) {
      std::printf("data seen (all ranks):");
      for (size_t d = 0; d < o.blend->num_datasets(); ++d)
        std::printf("%s %s %lld tokens (weight %.3f)", d ? "," : "", o.blend->pattern(d).c_str(),
                    static_cast<long long>(o.blend->dataset_tokens(d)), o.blend->weight(d));
      std::printf("\n");
    }
  }
  writer_.final(fin);
}

}  // namespace mt
