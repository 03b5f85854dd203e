#include "plan/planner.h"

#include "model/config/hf_config.h"
#include "plan/text_table.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>
#include <tuple>

namespace mt::plan {

// ---- presets and Hugging Face configs ------------------------------------------------------------------

namespace {

ModelConfig llama_like(const char* name, int64_t L, int64_t H, int64_t KV, int64_t C, int64_t F, int64_t T,
                       int64_t V, bool tied) {
  ModelConfig m = llama_config(name, L, H, KV, C, F, T, V);
  m.resolve();
  m.tied_embeddings = tied;  // resolve() unties every Llama; Llama 3.2 1B/3B tie them
  return m;
}

std::vector<ModelConfig> extra_presets() {
  return {
      // meta-llama/Llama-3.2-1B and -3B config.json (tie_word_embeddings: true)
      llama_like("llama3.2-1b", 16, 32, 8, 2048, 8192, 8192, 128256, true),
      llama_like("llama3.2-3b", 28, 24, 8, 3072, 8192, 8192, 128256, true),
      // meta-llama/Llama-2-7b-hf, -13b-hf config.json
      llama_like("llama2-7b", 32, 32, 32, 4096, 11008, 4096, 32000, false),
      llama_like("llama2-13b", 40, 40, 40, 5120, 13824, 4096, 32000, false),
      // LLaMA-1 33B (Touvron et al. 2023, Table 2: 60 layers, 6656 wide, 52 heads)
      llama_like("llama-33b", 60, 52, 52, 6656, 17920, 2048, 32000, false),
  };
}

}  // namespace

ModelConfig plan_model_preset(const std::string& name) {
  for (ModelConfig& m : extra_presets())
    if (m.name == name) return m;
  try {
    return model_preset(name);
  } catch (const std::invalid_argument&) {
    std::string known;
    for (const auto& n : plan_model_preset_names()) known += (known.empty() ? "" : ", ") + n;
    throw std::invalid_argument("unknown model preset '" + name + "' (known: " + known + ")");
  }
}

std::vector<std::string> plan_model_preset_names() {
  std::vector<std::string> v = model_preset_names();
  for (const auto& m : extra_presets()) v.push_back(m.name);
  return v;
}

ModelConfig model_from_hf_json(const std::string& text, const std::string& origin) {
  return mt::model_from_hf_json(text, origin, /*strict=*/false);  // sizes only: see model/config/hf_config.h
}

ModelConfig model_from_hf_config(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::invalid_argument("--hf-config: cannot open '" + path + "'");
  std::stringstream ss;
  ss << in.rdbuf();
  return model_from_hf_json(ss.str(), path);
}

// ---- ranking ---------------------------------------------------------------------------------------------

double layout_complexity(const Layout& l) {
  double c = static_cast<int>(l.strategy);  // DDP 0 .. HSDP 4
  if (l.tp > 1) c += 2;
  if (l.cp > 1) c += 2;
  if (l.pp > 1) c += 3;
  if (l.schedule == Schedule::Interleaved) c += 1;
  if (l.schedule == Schedule::ZeroBubbleH1 || l.schedule == Schedule::ZeroBubbleV) c += 1;  // split backward
  if (l.schedule == Schedule::GPipe) c += 0.5;  // same speed as 1F1B, more memory
  if (l.checkpointing == Checkpointing::Selective) c += 0.5;
  if (l.checkpointing == Checkpointing::Full) c += 1;
  if (l.offload_optimizer()) c += 3;
  return c;
}

double rank_score(const Estimate& e) { return e.time.total() * (1.0 + kComplexityPenalty * layout_complexity(e.layout)); }

namespace {

std::vector<int> divisors(int64_t n) {
  std::vector<int> d;
  for (int64_t i = 1; i <= n; ++i)
    if (n % i == 0) d.push_back(static_cast<int>(i));
  return d;
}

bool better(const Estimate& a, const Estimate& b) {
  if (a.fits != b.fits) return a.fits;
  if (a.fits) {
    const double sa = rank_score(a), sb = rank_score(b);
    if (sa != sb) return sa < sb;
    return a.mem.total() < b.mem.total();
  }
  auto overflow = [](const Estimate& e) {  // how far over its memory (device or host) a layout is
    double r = e.mem.total() / e.mem_usable;
    if (e.host_usable > 0) r = std::max(r, e.host_bytes_per_node / e.host_usable);
    return r;
  };
  const double ra = overflow(a), rb = overflow(b);
  if (ra != rb) return ra < rb;
  return a.time.total() < b.time.total();
}

std::string gib(double b) { return fmt("%.1f GiB", b / GiB); }
std::string secs(double s) {
  if (s >= 1.0) return fmt("%.2f s", s);
  if (s >= 0.1) return fmt("%.0f ms", s * 1e3);
  if (s >= 0.001) return fmt("%.2f ms", s * 1e3);
  return fmt("%.0f us", s * 1e6);
}

std::string layout_words(const Layout& l) {
  std::string s;
  switch (l.strategy) {
    case Strategy::NoShard:
      s = l.dp_replicate > 1 ? "DDP over " + std::to_string(l.dp_replicate) + " replicas" : "a single model replica";
      break;
    case Strategy::Zero1: s = "ZeRO-1 (optimizer state sharded " + std::to_string(l.dp_shard) + " ways)"; break;
    case Strategy::ShardGradOp:
      s = "ZeRO-2 / SHARD_GRAD_OP (optimizer state and gradients sharded " + std::to_string(l.dp_shard) + " ways)";
      break;
    case Strategy::FullShard: s = "ZeRO-3 / FULL_SHARD (everything sharded " + std::to_string(l.dp_shard) + " ways)"; break;
    case Strategy::HybridShard:
      s = "HSDP (full shard inside groups of " + std::to_string(l.dp_shard) + ", " + std::to_string(l.dp_replicate) +
          " replicas)";
      break;
    case Strategy::HybridShardZero2:
      s = "HSDP-ZeRO-2 (optimizer state and gradients sharded inside groups of " + std::to_string(l.dp_shard) + ", " +
          std::to_string(l.dp_replicate) + " replicas)";
      break;
  }
  if (l.tp > 1) s += ", tensor parallel " + std::to_string(l.tp) + " with sequence parallelism";
  if (l.ep > 1) s += ", experts split over " + std::to_string(l.ep) + " ranks (parallel.ep)";
  if (l.cp > 1) s += ", context parallel " + std::to_string(l.cp) + " (ring attention)";
  if (l.pp > 1) {
    s += ", pipeline " + std::to_string(l.pp) + " stages (" + to_string(l.schedule);
    if (l.schedule == Schedule::Interleaved) s += ", " + std::to_string(l.virtual_stages) + " chunks per rank";
    s += ")";
  }
  switch (l.checkpointing) {
    case Checkpointing::None: s += ", no activation checkpointing"; break;
    case Checkpointing::Selective: s += ", selective activation checkpointing (every second block recomputed)"; break;
    case Checkpointing::Full: s += ", full activation checkpointing"; break;
  }
  if (l.offload_optimizer()) s += ", optimizer state offloaded to CPU";
  s += ", micro-batch " + std::to_string(l.micro_batch) + " x " + std::to_string(l.microbatches) + " per step";
  return s;
}

// Why `b` (ranked after `a`) lost, in one sentence.
std::string lost_because(const Estimate& a, const Estimate& b) {
  if (!b.fits) {
    if (a.fits) return b.why;
    std::string w = b.why;
    if (!w.empty()) w[0] = static_cast<char>(std::tolower(static_cast<unsigned char>(w[0])));
    return "it is even further from fitting (" + w.substr(0, w.size() - 1) + ").";
  }
  const double ta = a.time.total(), tb = b.time.total();
  const double slower = tb / ta - 1.0;
  const double cb = layout_complexity(b.layout), ca = layout_complexity(a.layout);
  if (slower < 0)
    return "it is " + fmt("%.1f", -slower * 100) + "% faster but more complex (complexity " + fmt("%.1f", cb) + " vs " +
           fmt("%.1f", ca) + "); the planner takes a simpler layout unless the complex one wins by more than " +
           fmt("%.1f", kComplexityPenalty * 100) + "% per unit.";
  if (slower < 0.01) {
    std::string s = "it is only " + fmt("%.1f", slower * 100) + "% slower";
    if (cb > ca) s += " and more complex";
    if (b.mem.total() < 0.85 * a.mem.total())
      s += "; it needs less memory (" + gib(b.mem.total()) + " vs " + gib(a.mem.total()) +
           "), a fair choice if headroom matters more";
    return s + ".";
  }
  struct D {
    double d;
    std::string what;
  };
  std::vector<D> ds;
  const double dre = b.recompute_s - a.recompute_s;
  const double dopt = b.optimizer_s - a.optimizer_s;
  ds.push_back({b.time.compute - a.time.compute - dre - dopt, "more compute per GPU"});
  if (dre > 0) ds.push_back({dre, "activation recomputation (" + std::string(to_string(b.layout.checkpointing)) + " checkpointing)"});
  if (dopt > 0) ds.push_back({dopt, b.layout.offload_optimizer() ? "the CPU Adam step" : "a larger optimizer step"});
  ds.push_back({b.dp_exposed_s - a.dp_exposed_s, std::string("exposed data-parallel communication") +
                                                       (b.dp_inter_node ? " across nodes" : "")});
  ds.push_back({b.tp_exposed_s - a.tp_exposed_s, "exposed tensor-parallel collectives"});
  ds.push_back({b.pp_comm_s - a.pp_comm_s, "pipeline sends"});
  ds.push_back({b.offload_s - a.offload_s, "PCIe offload copies"});
  ds.push_back({b.time.bubble - a.time.bubble, "its pipeline bubble"});
  std::sort(ds.begin(), ds.end(), [](const D& x, const D& y) { return x.d > y.d; });
  std::string s = fmt("%.1f", slower * 100) + "% slower (" + secs(tb) + " vs " + secs(ta) + " per step), mostly " +
                  ds[0].what + " (+" + secs(ds[0].d) + ")";
  if (ds.size() > 1 && ds[1].d > 0.25 * ds[0].d) s += " and " + ds[1].what + " (+" + secs(ds[1].d) + ")";
  return s + ".";
}

// The setup's defaults filled in (seq, ~1M tokens per step) and checked against the model.
TrainSetup resolve_setup(const ModelConfig& model, int N, TrainSetup st) {
  if (st.seq <= 0) st.seq = model.seq_len;
  if (model.arch == Arch::GPT2 && st.seq > model.seq_len)
    throw std::invalid_argument("--seq " + std::to_string(st.seq) + " exceeds the model's " +
                                std::to_string(model.seq_len) + " positions");
  if (st.global_batch <= 0) {  // ~1M tokens per step, at least one sequence per GPU, a multiple of N
    const int64_t seqs = std::max<int64_t>(1, ((int64_t{1} << 20) + st.seq - 1) / st.seq);
    st.global_batch = static_cast<int64_t>(N) * ((seqs + N - 1) / N);
  }
  if (st.micro_batch < 0) throw std::invalid_argument("--micro-batch must be positive");
  return st;
}

// A pinned tp or pp degree must fit the job and the model.
void check_pinned_degrees(const ModelConfig& model, int N, int G, const PlanOptions& opts) {
  if (opts.tp) {
    const std::string t = "--tp " + std::to_string(opts.tp);
    if (N % opts.tp) throw std::invalid_argument(t + " does not divide --gpus " + std::to_string(N));
    if (opts.tp_within_node && opts.tp > G)
      throw std::invalid_argument(t + " exceeds --gpus-per-node " + std::to_string(G) + " (TP stays inside a node)");
    for (auto [v, what] : {std::pair{model.n_head, "n_head"}, {model.n_kv_head, "n_kv_head"},
                           {model.ffn_hidden, "ffn_hidden"}, {model.padded_vocab, "padded vocabulary"}})
      if (v % opts.tp) throw std::invalid_argument(t + " does not divide the model's " + what + " (" + std::to_string(v) + ")");
  }
  if (opts.pp) {
    const std::string p = "--pp " + std::to_string(opts.pp);
    if (N % opts.pp) throw std::invalid_argument(p + " does not divide --gpus " + std::to_string(N));
    if (opts.pp > model.n_layer) throw std::invalid_argument(p + " exceeds the model's " + std::to_string(model.n_layer) + " layers");
  }
}

// Micro-batch sizes for `local` sequences per step per replica.
std::vector<int64_t> micro_batches(int64_t local, const TrainSetup& st, const PlanOptions& opts) {
  std::vector<int64_t> mbs;
  if (st.micro_batch > 0) {
    if (local % st.micro_batch == 0) mbs.push_back(st.micro_batch);
  } else {
    for (int d : divisors(local))
      if (d <= opts.max_micro_batch) mbs.push_back(d);
  }
  return mbs;
}

// (strategy, dp_replicate, dp_shard) over dp ranks for fixed tp, pp, cp; for MoE models each with
// every expert-parallel degree that divides dp and the expert count.
std::vector<Layout> data_parallel_layouts(const ModelConfig& model, int tp, int pp, int cp, int dp) {
  std::vector<Layout> dps;
  Layout l;
  l.tp = tp;
  l.pp = pp;
  l.cp = cp;
  if (dp == 1) {
    dps.push_back(l);
  } else {
    l.strategy = Strategy::NoShard, l.dp_replicate = dp, l.dp_shard = 1;
    dps.push_back(l);
    for (Strategy s : {Strategy::Zero1, Strategy::ShardGradOp, Strategy::FullShard}) {
      l.strategy = s, l.dp_replicate = 1, l.dp_shard = dp;
      dps.push_back(l);
    }
    for (int g : divisors(dp))
      if (g > 1 && g < dp) {
        l.strategy = Strategy::HybridShard, l.dp_shard = g, l.dp_replicate = dp / g;
        dps.push_back(l);
      }
  }
  if (!model.moe()) return dps;
  std::vector<Layout> with_ep;
  for (const Layout& b : dps)
    for (int ep : divisors(dp))
      if (model.moe_experts % ep == 0) {
        Layout e = b;
        e.ep = ep;
        with_ep.push_back(e);
      }
  return with_ep;
}

// Pipeline schedules with their virtual stages for pp stages.
std::vector<std::pair<Schedule, int>> schedules(const ModelConfig& model, int pp, const PlanOptions& opts) {
  std::vector<std::pair<Schedule, int>> scheds;
  if (pp == 1) {
    scheds.push_back({Schedule::None, 1});
  } else {
    scheds.push_back({Schedule::GPipe, 1});
    scheds.push_back({Schedule::OneFOneB, 1});
    for (int v = 2; v <= opts.max_virtual_stages; ++v)
      if (static_cast<int64_t>(pp) * v <= model.n_layer) scheds.push_back({Schedule::Interleaved, v});
    scheds.push_back({Schedule::ZeroBubbleH1, 1});
    if (2LL * pp <= model.n_layer) scheds.push_back({Schedule::ZeroBubbleV, 2});
  }
  return scheds;
}

// Every valid layout with these tp, pp and cp degrees, estimated, appended to `all`.
void estimate_degrees(const ModelConfig& model, const Cluster& cluster, const TrainSetup& st, const PlanOptions& opts,
                      int tp, int pp, int cp, std::vector<Estimate>& all) {
  const int dp = cluster.gpus / tp / pp / cp;
  if (st.global_batch % dp) return;
  const int64_t local = st.global_batch / dp;  // sequences per step per replica
  const std::vector<int64_t> mbs = micro_batches(local, st, opts);
  const auto scheds = schedules(model, pp, opts);
  for (Layout base : data_parallel_layouts(model, tp, pp, cp, dp)) {
    if (opts.strategy && base.strategy != *opts.strategy) continue;
    for (auto [sched, v] : scheds) {
      if (opts.schedule && sched != *opts.schedule) continue;
      for (int64_t mb : mbs) {
        const int64_t m = local / mb;
        if (sched == Schedule::Interleaved && m % pp) continue;
        for (Checkpointing ac : {Checkpointing::None, Checkpointing::Selective, Checkpointing::Full}) {
          if (opts.checkpointing && ac != *opts.checkpointing) continue;
          for (bool off : {false, true}) {
            if (off && (!opts.allow_offload || (base.strategy == Strategy::NoShard && base.world() > 1) ||
                        cluster.host_link_bw <= 0))
              continue;
            Layout l = base;
            l.schedule = sched;
            l.virtual_stages = v;
            l.micro_batch = mb;
            l.microbatches = m;
            l.checkpointing = ac;
            l.offload = off ? Offload::Optimizer : Offload::None;
            if (!check_layout(model, cluster, st, l).empty()) continue;
            all.push_back(estimate(model, cluster, st, l));
          }
        }
      }
    }
  }
}

// Every tp x pp x cp factorisation of the job the model and the options allow.
std::vector<Estimate> estimate_all(const ModelConfig& model, const Cluster& cluster, const TrainSetup& st,
                                   const PlanOptions& opts) {
  const int N = cluster.gpus, G = cluster.gpus_per_node;
  std::vector<Estimate> all;
  all.reserve(4096);
  const int max_tp = opts.tp_within_node ? std::min(G, N) : N;
  for (int tp : divisors(max_tp)) {
    if (opts.tp && tp != opts.tp) continue;
    if (N % tp) continue;
    if (model.n_head % tp || model.n_kv_head % tp || model.ffn_hidden % tp || model.padded_vocab % tp) continue;
    for (int pp : divisors(N / tp)) {
      if (opts.pp && pp != opts.pp) continue;
      if (pp > model.n_layer) continue;
      for (int cp : divisors(N / tp / pp)) {
        if (opts.cp ? cp != opts.cp : (cp > 1 && st.seq_or(model) < opts.cp_min_seq)) continue;
        if (cp > 1 && st.seq_or(model) % (2 * cp) != 0) continue;
        if (cp > 1 && model.moe() && model.moe_capacity_factor > 0) continue;  // the engine refuses it (moe.md)
        estimate_degrees(model, cluster, st, opts, tp, pp, cp, all);
      }
    }
  }
  return all;
}

// Ranks `all` into R: best per strategy (before de-duplication: the first of each in rank order),
// then one micro-batch choice per layout family and the top k.
void rank_candidates(std::vector<Estimate> all, const PlanOptions& opts, PlanResult& R) {
  for (const auto& e : all) R.fitting += e.fits;
  std::sort(all.begin(), all.end(), better);
  {  // layouts that fit only with offload (the same layout without it does not): the best of each family
    using Key = std::tuple<int, int, int, int, int, int, int, int, int64_t, int64_t, int>;
    auto key = [](const Layout& l) {
      return Key{static_cast<int>(l.strategy), l.dp_replicate, l.dp_shard, l.tp, l.pp, static_cast<int>(l.schedule),
                 l.virtual_stages, static_cast<int>(l.checkpointing), l.micro_batch, l.microbatches, l.cp};
    };
    std::map<Key, const Estimate*> plain;
    for (const auto& e : all)
      if (!e.layout.offload_optimizer()) plain.emplace(key(e.layout), &e);
    std::map<Key, bool> family;
    for (const auto& e : all) {
      if (!e.layout.offload_optimizer() || !e.fits) continue;
      const auto it = plain.find(key(e.layout));
      if (it == plain.end() || it->second->fits) continue;
      ++R.offload_only_count;
      Key f = key(e.layout);
      std::get<8>(f) = std::get<9>(f) = 0;  // one micro-batch choice per family
      if (R.offload_only.size() < 5 && family.emplace(f, true).second)
        R.offload_only.push_back({e, *it->second});
    }
  }
  for (Strategy s : {Strategy::NoShard, Strategy::Zero1, Strategy::ShardGradOp, Strategy::FullShard, Strategy::HybridShard})
    for (const auto& e : all)
      if (e.layout.strategy == s) {
        R.best_per_strategy.push_back(e);
        break;
      }
  if (opts.best_per_family) {
    std::map<std::tuple<int, int, int, int, int, int, int, int, bool, int>, bool> seen;
    std::vector<Estimate> kept;
    for (auto& e : all) {
      const Layout& l = e.layout;
      auto key = std::make_tuple(static_cast<int>(l.strategy), l.dp_replicate, l.dp_shard, l.tp, l.pp,
                                 static_cast<int>(l.schedule), l.virtual_stages, static_cast<int>(l.checkpointing),
                                 l.offload_optimizer(), l.cp);
      if (seen.emplace(key, true).second) kept.push_back(std::move(e));
    }
    all = std::move(kept);
  }
  if (opts.top_k > 0 && static_cast<int>(all.size()) > opts.top_k) all.resize(opts.top_k);
  R.candidates = std::move(all);
}

// The recommendation, why the runner-up lost, and the notes.
void explain(PlanResult& R) {
  const Estimate& top = R.candidates[0];
  if (top.fits) {
    R.recommendation = "Run " + layout_words(top.layout) + ". Predicted " + fmt("%.0f", top.tokens_per_s) +
                       " tokens/s (" + fmt("%.1f", 100 * top.mfu) + "% MFU), " + secs(top.time.total()) +
                       " per step, " + gib(top.mem.total()) + " of " + gib(top.mem_usable) + " usable per " + top.device + ". " +
                       top.why;
  } else {
    R.recommendation = "Nothing fits on " + std::to_string(R.cluster.gpus) + " " + top.device + "s of " +
                       gib(top.mem_usable) + " usable memory. The closest layout is " + layout_words(top.layout) +
                       ". " + top.why + " Add " + top.device + "s, shorten --seq, or use a smaller micro-batch.";
  }
  if (R.candidates.size() > 1) {
    const Estimate& ru = R.candidates[1];
    R.runner_up = "Runner-up: " + layout_words(ru.layout) + ". It lost because " + lost_because(top, ru);
  }
  if (!R.setup.fp32 && R.setup.reduce_bytes == 4)
    R.notes.push_back("gradients are reduced in fp32 (this engine's policy); --reduce-dtype bf16 halves that traffic");
  R.notes.push_back("selective checkpointing = every second block recomputed (the engine's policy)");
}

}  // namespace

PlanResult plan(const ModelConfig& model, const Cluster& cluster, const TrainSetup& setup_in, const PlanOptions& opts) {
  cluster.validate();
  const int N = cluster.gpus;
  if (N < 1) throw std::invalid_argument("--gpus must be at least 1");
  PlanResult R;
  R.model = model;
  R.cluster = cluster;
  R.setup = resolve_setup(model, N, setup_in);
  const TrainSetup& st = R.setup;
  R.model_state_bytes = bytes_per_param(st.fp32, st.grad_bytes).total() * static_cast<double>(model.num_params());
  check_pinned_degrees(model, N, cluster.gpus_per_node, opts);
  std::vector<Estimate> all = estimate_all(model, cluster, st, opts);
  R.evaluated = static_cast<int64_t>(all.size());
  if (all.empty())
    throw std::invalid_argument("no valid layout: check that --global-batch (" + std::to_string(st.global_batch) +
                                ") is divisible by the data-parallel degree and that --gpus (" + std::to_string(N) +
                                ") factors into tp x pp x dp for this model");
  rank_candidates(std::move(all), opts, R);
  explain(R);
  return R;
}

}  // namespace mt::plan
