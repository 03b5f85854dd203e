#include "plan/published.h"

#include <cmath>
#include <cstdio>
#include <stdexcept>

#include "plan/planner.h"

namespace mt::plan {

const char* metric_name(Metric m) {
  switch (m) {
    case Metric::TokensPerSecPerGpu: return "tokens/s/GPU";
    case Metric::TflopsPerGpuMegatron: return "TFLOP/s/GPU";
    case Metric::SecondsPerStep: return "s/step";
  }
  return "?";
}

namespace {

Cluster sized(const std::string& preset, int gpus) {
  Cluster c = cluster_preset(preset);
  c.gpus = gpus;
  return c;
}

Layout layout(Strategy s, int dp, int tp, int pp, Schedule sched, int64_t mb, int64_t m, Checkpointing ac) {
  Layout l;
  l.strategy = s;
  if (s == Strategy::NoShard)
    l.dp_replicate = dp;
  else
    l.dp_shard = dp;
  l.tp = tp;
  l.pp = pp;
  l.schedule = sched;
  l.micro_batch = mb;
  l.microbatches = m;
  l.checkpointing = ac;
  return l;
}

PublishedCase llmc(const std::string& id, const std::string& preset_model, const std::string& cluster, int64_t mb,
                   int64_t accum, double seconds, const std::string& script, const std::string& hw) {
  PublishedCase c;
  c.id = id;
  c.system = "llm.c";
  c.model = model_preset(preset_model);
  c.description = preset_model + " on 8x " + hw + ", ZeRO-1, micro-batch " + std::to_string(mb) + " x 1024 tokens, " +
                  std::to_string(accum) + " accumulation step(s), no recompute";
  c.source = "karpathy/llm.c " + script + " (header comment: s/iter)";
  c.assumptions = "bf16 gradients reduced in bf16 (llm.c ncclFloatX), cuDNN flash attention, no dropout";
  c.cluster = sized(cluster, 8);
  c.setup.global_batch = 8 * mb * accum;
  c.setup.micro_batch = mb;
  c.setup.seq = 1024;
  c.setup.reduce_bytes = 2;
  c.layout = layout(Strategy::Zero1, 8, 1, 1, Schedule::None, mb, accum, Checkpointing::None);
  c.metric = Metric::SecondsPerStep;
  c.published = seconds;
  return c;
}

}  // namespace

std::vector<PublishedCase> published_cases() {
  std::vector<PublishedCase> v;
  {
    PublishedCase c;
    c.id = "megatron-gpt3-175b";
    c.system = "Megatron-LM";
    c.model = model_preset("gpt3-175b");
    c.model.padded_vocab = 51200;  // Megatron pads 50257 to a multiple of 128 x tp
    c.description = "GPT-3 175B on 1024 A100 (DGX A100, HDR 200 Gb/s per GPU), tp 8 x pp 16 x dp 8, 1F1B, "
                    "micro-batch 1, global batch 1536 x 2048, fp16, full recompute";
    c.source = "NVIDIA/Megatron-LM README (GPT-3 example) and examples/pretrain_gpt3_175B.sh: ~32 s/iter, "
               "138 TFLOP/s per GPU (44% of peak)";
    c.assumptions = "2020 software: no sequence parallelism, unfused attention with dropout 0.1, TP and PP "
                    "communication not overlapped, fp16 gradients all-reduced after the pipeline flush";
    c.cluster = sized("a100-80g-ib200", 1024);
    c.setup.global_batch = 1536;
    c.setup.micro_batch = 1;
    c.setup.seq = 2048;
    c.setup.reduce_bytes = 2;
    c.setup.attention = AttentionImpl::Unfused;
    c.setup.dropout = true;
    c.setup.sequence_parallel = false;
    c.layout = layout(Strategy::NoShard, 8, 8, 16, Schedule::OneFOneB, 1, 1536 / 8, Checkpointing::Full);
    c.metric = Metric::TflopsPerGpuMegatron;
    c.published = 138;
    c.published_mfu = 0.44;
    v.push_back(c);
  }
  auto titan = [&](const std::string& id, const std::string& model, Checkpointing ac, double rc, double tps,
                   double mfu, const std::string& ac_words) {
    PublishedCase c;
    c.id = id;
    c.system = "torchtitan";
    c.model = model_preset(model);
    c.description = model + " on 64 A100-80GB, FSDP2 (ZeRO-3 over 64), local batch 1 x 8192 tokens, " + ac_words;
    c.source = "pytorch/torchtitan docs/performance.md (Llama 3, 64 A100)";
    c.assumptions = "network not stated: DGX A100 with 200 Gb/s per GPU assumed; bf16 all-gather, fp32 "
                    "reduce-scatter (torchtitan default); flash attention";
    c.cluster = sized("a100-80g-ib200", 64);
    c.setup.global_batch = 64;
    c.setup.micro_batch = 1;
    c.setup.seq = 8192;
    c.setup.recompute_fraction = rc;
    c.layout = layout(Strategy::FullShard, 64, 1, 1, Schedule::None, 1, 1, ac);
    c.metric = Metric::TokensPerSecPerGpu;
    c.published = tps;
    c.published_mfu = mfu;
    v.push_back(c);
  };
  // Op-level selective AC saves matmul outputs except every second one (torchtitan's _save_list
  // policy), so about half the forward matmul FLOPs are recomputed.
  titan("torchtitan-llama3-8b-op-sac", "llama3-8b", Checkpointing::Selective, 0.5, 2973, 0.582,
        "selective op AC (every other matmul recomputed)");
  titan("torchtitan-llama3-8b-layer-sac", "llama3-8b", Checkpointing::Selective, -1, 2904, 0.568,
        "selective layer AC (every second block recomputed)");
  titan("torchtitan-llama3-70b", "llama3-70b", Checkpointing::Full, -1, 331, 0.517, "full AC");
  v.push_back(llmc("llmc-gpt2-124m", "gpt2-124m", "a100-80g-ib400", 64, 1, 0.300, "scripts/run_gpt2_124M.sh",
                   "A100-80GB SXM"));
  v.push_back(llmc("llmc-gpt2-350m", "gpt2-350m", "a100-80g-ib400", 64, 1, 0.820, "scripts/run_gpt2_350M.sh",
                   "A100-80GB SXM"));
  v.push_back(llmc("llmc-gpt2-1558m", "gpt2-1.5b", "h100-80g-ib400", 16, 8, 2.80, "scripts/run_gpt2_1558M.sh",
                   "H100-80GB SXM"));
  return v;
}

PublishedResult evaluate_published(const PublishedCase& c) {
  PublishedResult r;
  r.c = c;
  r.e = estimate(c.model, c.cluster, c.setup, c.layout);
  const double step = r.e.time.total();
  switch (c.metric) {
    case Metric::TokensPerSecPerGpu: r.predicted = r.e.tokens_per_s / r.e.world; break;
    case Metric::TflopsPerGpuMegatron:
      r.predicted = megatron_flops_per_iteration(c.model, c.layout.global_batch(), c.setup.seq_or(c.model)) /
                    (step * r.e.world) / 1e12;
      break;
    case Metric::SecondsPerStep: r.predicted = step; break;
  }
  r.error = r.predicted / c.published - 1.0;
  r.within = std::fabs(r.error) <= kPublishedTolerance;
  return r;
}

// ---- the article's worked numbers --------------------------------------------------------------------

double article_70b_model_state_bytes() { return bytes_per_param(false).total() * 70e9; }

double article_70b_model_state_as_article_adds() { return (140 + 280 + 280) * 1e9; }

double allreduce_seconds(double bytes, int gpus, const Cluster& c) {
  return collective(Collective::AllReduce, bytes, group_shape(gpus, 1, c.gpus_per_node), c).time;
}

double fsdp_over_ddp_comm_ratio(bool fp32_reduce, int64_t microbatches) {
  const ModelConfig m = model_preset("llama3-8b");
  Cluster c = cluster_preset("h100-80g-ib400");
  c.gpus = 8;
  TrainSetup st;
  st.reduce_bytes = fp32_reduce ? 4 : 2;
  st.seq = 4096;
  Layout ddp = layout(Strategy::NoShard, 8, 1, 1, Schedule::None, 1, microbatches, Checkpointing::Full);
  Layout z3 = layout(Strategy::FullShard, 8, 1, 1, Schedule::None, 1, microbatches, Checkpointing::Full);
  const Estimate a = estimate(m, c, st, ddp), b = estimate(m, c, st, z3);
  return (b.comm.intra_node + b.comm.inter_node) / (a.comm.intra_node + a.comm.inter_node);
}

namespace {

std::string f1(const char* fmtstr, double v) {
  char buf[96];
  std::snprintf(buf, sizeof buf, fmtstr, v);
  return buf;
}

}  // namespace

std::vector<ArticleCheck> article_checks() {
  std::vector<ArticleCheck> v;
  {
    const double ours = article_70b_model_state_bytes();
    v.push_back({"70b-model-state",
                 "70B in mixed precision: 140 GB for bf16 params and grads + ~280 GB Adam moments + 280 GB fp32 "
                 "master = ~700 GB of model state",
                 "2 B params (140 GB) + 2 B grads (140 GB) + 4 B master (280 GB) + 8 B moments (560 GB) = 16 B x 70e9 = " +
                     f1("%.2f TB", ours / 1e12),
                 "wrong: params and grads are 140 GB each (280 GB together) and the two fp32 moments are 560 GB; "
                 "the total is 1.12 TB, 1.6x the article's figure"});
  }
  {
    const double psi = 3e9;
    const ModelStateBytes ddp = zero_model_state(psi, Strategy::NoShard, 8, false);
    const ModelStateBytes z1 = zero_model_state(psi, Strategy::Zero1, 8, false);
    const ModelStateBytes z2 = zero_model_state(psi, Strategy::ShardGradOp, 8, false);
    const ModelStateBytes z3 = zero_model_state(psi, Strategy::FullShard, 8, false);
    v.push_back({"3b-on-8x40gb",
                 "3B in bf16: params ~6 GB + Adam ~24 GB = ~30 GB per GPU with DDP; FSDP cuts it to ~3.75 GB per GPU",
                 "DDP " + f1("%.0f GB", ddp.total() / 1e9) + " per GPU (6 params + 6 grads + 12 master + 24 moments); "
                     "ZeRO-1 " + f1("%.1f GB", z1.total() / 1e9) + ", ZeRO-2 " + f1("%.2f GB", z2.total() / 1e9) +
                     ", FSDP/ZeRO-3 " + f1("%.1f GB", z3.total() / 1e9) + " over 8 GPUs",
                 "wrong: the article forgot the gradients (6 GB) and the fp32 master weights (12 GB). DDP needs "
                 "48 GB per GPU and does not fit a 40 GB GPU at all; FSDP gives 6 GB, not 3.75 (even without a "
                 "master copy it is 36 GB and 4.5 GB)"});
  }
  {
    const double bytes = 14e9;
    Cluster h = cluster_preset("h100-80g-ib400"), a = cluster_preset("a100-80g-ib200"),
            r = cluster_preset("h100-80g-roce100");
    const double th = allreduce_seconds(bytes, 32, h), ta = allreduce_seconds(bytes, 32, a),
                 tr = allreduce_seconds(bytes, 32, r);
    v.push_back({"7b-allreduce-32",
                 "7B with bf16 gradients (14 GB): an all-reduce across 32 GPUs over NVLink + InfiniBand takes "
                 "~150-250 ms if not overlapped",
                 "ring over 4 nodes x 8: each GPU sends 2(n-1)/n x 14 GB = 27.1 GB, 1/8 of it through its NIC: " +
                     f1("%.0f ms", th * 1e3) + " on H100 + 400 Gb/s IB, " + f1("%.0f ms", ta * 1e3) +
                     " on A100 + 200 Gb/s IB, " + f1("%.0f ms", tr * 1e3) + " on 100 Gb/s RoCE",
                 "depends on the network: right for 200 Gb/s per GPU (A100 generation), about 2x too slow for "
                 "400 Gb/s per GPU, and too fast for 100 Gb/s RoCE"});
  }
  {
    const double same = fsdp_over_ddp_comm_ratio(false, 1), mixed = fsdp_over_ddp_comm_ratio(true, 1),
                 accum = fsdp_over_ddp_comm_ratio(false, 4);
    v.push_back({"fsdp-1.5x-ddp",
                 "FSDP costs 1.5x the communication of DDP (all-gather forward + all-gather backward + "
                 "reduce-scatter vs one all-reduce)",
                 f1("%.2fx", same) + " in bytes when gathers and reductions use the same dtype; " + f1("%.2fx", mixed) +
                     " with bf16 gathers and fp32 reduction (DDP then all-reduces fp32 too); " + f1("%.2fx", accum) +
                     " with 4 accumulation micro-batches (FSDP re-gathers per micro-batch, DDP reduces once)",
                 "correct per micro-batch in a single dtype (ZeRO paper §7); it grows with gradient accumulation"});
  }
  {
    const ModelStateBytes k = bytes_per_param(false);
    v.push_back({"7b-optimizer-80gb", "7B: the Adam optimizer states alone consume over 80 GB",
                 f1("%.0f GB", k.optimizer * 7e9 / 1e9) + " (fp32 master 28 GB + moments 56 GB)",
                 "correct if the fp32 master copy counts as optimizer state (ZeRO's K = 12); moments alone are 56 GB"});
  }
  {
    const ModelStateBytes z3 = zero_model_state(70e9, Strategy::FullShard, 32, false);
    v.push_back({"70b-fsdp-32", "70B fits on 32x80GB with FSDP, where DDP would need 700 GB per GPU",
                 "ZeRO-3 over 32: " + f1("%.0f GB", z3.total() / 1e9) + " of model state per GPU; DDP would need 1120 GB",
                 "correct that FSDP fits (35 GB + activations); DDP's figure is 1.12 TB, not 700 GB"});
  }
  {
    const ModelStateBytes z3o = zero_model_state(70e9, Strategy::FullShard, 4, false, true);
    // The planner on 4 H100s at 1024-token sequences, 64 per step: the best layout that fits only
    // with offload against the same layout without it (which does not fit: a step time "if it fit").
    Cluster c = cluster_preset("h100-80g-ib400");
    c.gpus = 4;
    TrainSetup st;
    st.seq = 1024;
    st.global_batch = 64;
    const PlanResult r = plan(plan_model_preset("llama3-70b"), c, st);
    std::string cost = "the planner finds no layout that fits only with offload";
    if (!r.offload_only.empty()) {
      const Estimate &e = r.offload_only[0].with, &w = r.offload_only[0].without;
      cost = "the planner (seq 1024, 64 sequences per step): " + e.layout.describe() + " fits only with offload, " +
             f1("%.1f s", e.time.total()) + " per step against " + f1("%.1f s", w.time.total()) + " without (" +
             f1("%.2fx", e.time.total() / w.time.total()) + ": CPU Adam " + f1("%.1f s", e.optimizer_s) +
             ", PCIe copies " + f1("%.1f s", e.offload_s) + ")";
    }
    v.push_back({"70b-offload-4", "Fully sharded + CPU offload can fit 70B on 4x80GB (step ~1.6x slower)",
                 "ZeRO-3 + optimizer offload over 4: " + f1("%.0f GB", z3o.total() / 1e9) +
                     " of bf16 params + grads per GPU (65 GiB of the ~75 usable) and 840 GB of optimizer state in "
                     "host RAM; " + cost,
                 "barely: only with full checkpointing and a short sequence; the host needs ~1 TB of RAM. The "
                 "slowdown is a fixed cost per step (CPU Adam and PCIe copies), so its ratio depends on the "
                 "tokens per step: about 1.5x at 64K tokens, 1.1x at 256K"});
  }
  {
    v.push_back({"tp-allreduces",
                 "Tensor parallelism needs one all-reduce per transformer block forward and one backward (the "
                 "table says 2x)",
                 "Megatron TP: 2 all-reduces forward (after attention and after the MLP) and 2 backward, each of "
                 "b x s x h (arXiv 1909.08053 §3); with sequence parallelism each becomes an all-gather + "
                 "reduce-scatter of the same volume",
                 "wrong in the text (one), right in the table (two)"});
  }
  return v;
}

// ---- decision bands ------------------------------------------------------------------------------------

std::string article_band(double params) {
  if (params < 3e9) return "DDP or ZeRO-2";
  if (params < 20e9) return "FSDP full shard, HSDP across nodes";
  if (params < 100e9) return "HSDP + checkpointing (+TP)";
  return "TP x PP x DP/FSDP";
}

std::vector<BandCell> decision_bands(const Cluster& cluster, const std::vector<int>& gpu_counts) {
  const char* models[] = {"llama3.2-1b", "llama2-7b", "llama2-13b", "llama-33b", "llama3-70b", "gpt3-175b", "llama3-405b"};
  std::vector<BandCell> out;
  for (const char* name : models) {
    const ModelConfig m = plan_model_preset(name);
    for (int g : gpu_counts) {
      Cluster c = cluster;
      c.gpus = g;
      TrainSetup st;
      st.seq = m.seq_len;
      st.global_batch = std::max<int64_t>(g, (int64_t{1} << 21) / st.seq);  // ~2M tokens per step
      PlanOptions o;
      o.top_k = 1;
      BandCell cell;
      cell.model = name;
      cell.params = static_cast<double>(m.num_params());
      cell.gpus = g;
      PlanResult r = plan(m, c, st, o);
      cell.top = r.candidates[0];
      cell.any_fits = cell.top.fits;
      out.push_back(cell);
    }
  }
  return out;
}

}  // namespace mt::plan
