// `meshtrain plan`: parses the flags, runs the planner (plan/planner.h) and prints its report
// (plan/report.h); `--validate` runs the harness in validate/plan_validate.h.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <stdexcept>
#include <thread>
#include <string>
#include <vector>

#include "cli/arg_parser.h"
#include "cli/commands.h"
#include "plan/published.h"
#include "plan/report.h"
#include "plan/text_table.h"
#include "validate/plan_validate.h"

namespace mt::cli {

using namespace mt::plan;
using namespace mt::validate;

std::string plan_help() {
  std::string models = join(plan_model_preset_names(), ", ");
  std::string clusters = join(cluster_preset_names(), ", ");
  return "usage: meshtrain plan --gpus N (--model PRESET | --hf-config FILE | --layers L --hidden H --heads A --vocab V ...)\n"
         "                      [--cluster PRESET] [--gpus-per-node G] [--global-batch B] [--micro-batch b]\n"
         "                      [--seq S] [--dtype bf16|fp32] [--top K] [--json]\n"
         "       meshtrain plan --published [--json]     predicted vs published results (Megatron-LM, torchtitan, llm.c)\n"
         "       meshtrain plan --article [--cluster PRESET] [--json]\n"
         "                                               the seed article's numbers checked, and its decision bands recomputed\n"
         "       meshtrain plan --validate [--steps N] [--layouts LIST] [--scale-layouts LIST] [--no-time-check]\n"
         "                                 [--keep DIR] [--json]\n"
         "                                               runs real jobs and dry runs of this engine next to the planner\n"
         "\n"
         "Enumerates every layout of the model on N GPUs - strategy (DDP, ZeRO-1, ZeRO-2, ZeRO-3, HSDP with each\n"
         "shard-group size), tensor parallel (inside a node), pipeline parallel with schedule and micro-batches,\n"
         "activation checkpointing, CPU offload of the optimizer state - predicts per-GPU memory by category,\n"
         "communication bytes per link type and step time (compute / exposed communication / bubble), and prints\n"
         "them ranked, best first, with the top choice explained and why the runner-up lost. Formulas and their\n"
         "sources: docs/plan.md.\n"
         "\n"
         "Model (one of):\n"
         "  --model PRESET          " + models + "\n"
         "  --hf-config FILE        a Hugging Face config.json (Llama-style or gpt2)\n"
         "  --layers L --hidden H --heads A --vocab V [--kv-heads K] [--ffn F] [--arch llama|gpt2]\n"
         "                          explicit dimensions (default arch llama); with --model or --hf-config they override\n"
         "Training setup:\n"
         "  --gpus N                GPUs (ranks) in the job (required)\n"
         "  --global-batch B        sequences per optimizer step (default ~1M tokens, at least one per GPU)\n"
         "  --micro-batch b         sequences per micro-batch (default: the planner chooses)\n"
         "  --seq S                 tokens per sequence (default: the model's; Hugging Face configs capped at 8192)\n"
         "  --dtype bf16|fp32       bf16 mixed precision (default; fp32 master + Adam) or fp32 training\n"
         "  --lora-rank R           LoRA fine-tuning: adapters of rank R, the base frozen (kept in the compute dtype,\n"
         "                          no gradients or optimizer state); --lora-targets LIST as lora.targets (default q,v)\n"
         "  --reduce-dtype fp32|bf16  gradient reduction dtype (default fp32)\n"
         "  --grad-dtype bf16|fp32  stored gradient dtype (default: the parameter dtype)\n"
         "  --attention flash|unfused  attention kernel (default flash: no s x s scores kept)\n"
         "  --residual-dtype bf16|fp32  residual stream and norm inputs (default: the activation dtype; fp32 is\n"
         "                          this engine's model.residual_dtype = fp32 in a bf16 run)\n"
         "  --logits-dtype fp32|bf16  the LM head's logits (default fp32; bf16 is this engine's\n"
         "                          model.logits_dtype = bf16, its default for bf16 on a GPU at tp = 1)\n"
         "  --dropout               dropout masks are stored (default off)\n"
         "  --no-sp                 no sequence parallelism with tp > 1\n"
         "  --tp-overlap            TP collectives overlap the GEMMs (async TP)\n"
         "  --overlap-param-gather  ZeRO-1/2 post-step all-gather overlaps the next forward\n"
         "  --bucket-mb MB          gradient bucket size (default 25)\n"
         "Cluster (a preset, then overrides):\n"
         "  --cluster PRESET        " + clusters + " (default h100-80g-ib400); this-cpu is\n"
         "                          measured on this machine (the engine's kernels at the model's shapes,\n"
         "                          the FMA peak, the memory), its figures per rank\n"
         "  --no-measure            this-cpu: the reference preset (2 Zen 3 cores), node-wide figures\n"
         "  --gpus-per-node G       GPUs per node (NVLink domain)\n"
         "  --mem-per-gpu GIB       device memory per GPU (this-cpu: the node's memory, shared by its ranks)\n"
         "  --peak-tflops TF        dense peak per GPU for the chosen --dtype (this-cpu: the node's)\n"
         "  --compute-efficiency F  achievable fraction of peak on matmul/attention FLOPs\n"
         "  --mem-bw GBS            device memory bandwidth, GB/s (this-cpu: the node's)\n"
         "  --intra-bw GBS          achievable intra-node bus bandwidth per GPU, GB/s\n"
         "  --intra-latency-us US   intra-node latency per ring step\n"
         "  --inter-bw GBS          achievable inter-node bandwidth per GPU (its NIC), GB/s\n"
         "  --inter-latency-us US   inter-node latency per ring step\n"
         "  --host-bw GBS           host<->device bandwidth per GPU (PCIe), GB/s\n"
         "  --host-mem GIB          host memory per node\n"
         "  --host-mem-bw GBS       host memory traffic CPU Adam achieves per node (offload; 28 bytes per\n"
         "                          parameter; `meshtrain bench adamw` measures it on this machine)\n"
         "Search constraints:\n"
         "  --strategy S            DDP|ZeRO-1|ZeRO-2|ZeRO-3|HSDP (or NO_SHARD, ZERO1, SHARD_GRAD_OP, FULL_SHARD, HYBRID_SHARD)\n"
         "  --tp T  --pp P          fix the tensor / pipeline degree\n"
         "  --cp C                  fix the context-parallel degree (default: cp > 1 tried from --seq 16384 on)\n"
         "  --schedule S            gpipe|1f1b|interleaved_1f1b\n"
         "  --ac none|selective|full  fix activation checkpointing (selective = every second block recomputed)\n"
         "  --no-offload            do not consider CPU offload\n"
         "Validation against this engine (--validate):\n"
         "  For each layout: the engine's dry run (`train --dry-run --world N --rank R`, every rank) against a real\n"
         "  one-step job (`meshtrain launch -n N -- train`): per-rank memory by category and bytes per group, to the\n"
         "  byte. Then the machine's ceilings (the model's matmul and attention kernels with as many probe processes\n"
         "  as the job has ranks, a streaming kernel, `launch -n N -- bench comm`) and a job of --steps steps: the\n"
         "  planner's step time against the measured one (within 25%). Finally the planner's memory by category and\n"
         "  bytes per group against the dry runs, for these layouts and for Llama 3 70B / 405B layouts on 64-512\n"
         "  ranks (reported, not checked). Exit status 1 when a check fails.\n"
         "  --steps N               training steps per job (default 8; the first is not timed)\n"
         "  --layouts LIST          comma-separated subset of: ddp, zero1, zero2, zero3, zero3x4, hsdp, ddp-bf16,\n"
         "                          llama-zero3-bf16, tp2 (tp = 2 on 2 ranks), tp2-zero3x4 (tp = 2 x ZeRO-3\n"
         "                          dp_shard = 2 on 4 ranks), tp2-sp (tp = 2 + sequence parallelism), tp2-sp-bf16,\n"
         "                          pp2 (pp = 2 1f1b, 4 micro-batches), pp2-gpipe, pp2-dp2 (pp = 2 x DDP 2 on 4\n"
         "                          ranks), pp2-interleaved (2 chunks per rank), cp2 (context parallel 2, Llama),\n"
         "                          cp2-zero3x4 (ZeRO-3 over dp_shard 2 x cp 2 on 4 ranks) (default: all eighteen)\n"
         "  --scale-layouts LIST    dry-run-only layouts: 70b-zero3-tp8 (64 ranks), 70b-hsdp-tp8 (128), 70b-zero3-tp8-pp4\n"
         "                          (512), 405b-zero3-tp8-pp8 (512), 405b-zero1-tp8-pp16 (256), or none (default: all)\n"
         "  --no-time-check         report step time without failing on it (shared, noisy machines)\n"
         "  --keep DIR              run in DIR and keep the metrics and logs\n"
         "Output:\n"
         "  --top K                 candidates shown (default 10; the best micro-batch of each layout family)\n"
         "  --json                  JSON (model, model_state_bytes, candidates[...]; docs/plan.md)\n"
         "  --help                  this text\n";
}

namespace {

struct Bad : std::runtime_error {
  using std::runtime_error::runtime_error;
};

long long pos_int(const ArgParser& a, const std::string& name, long long fallback) {
  long long v = a.get_int(name, fallback);
  if (a.has(name) && v <= 0) throw Bad("--" + name + " must be a positive integer, got '" + a.get(name) + "'");
  return v;
}

double pos_num(const ArgParser& a, const std::string& name, double fallback) {
  double v = a.get_double(name, fallback);
  if (a.has(name) && !(v > 0) ) throw Bad("--" + name + " must be a positive number, got '" + a.get(name) + "'");
  return v;
}

// Internal (used by --validate): this process's compute ceiling for a model, as one JSON line.
int run_probe(const ArgParser& a) {
  ModelConfig m;
  try {
    m = plan_model_preset(a.get("model", "gpt2-mini"));
  } catch (const std::invalid_argument& e) {
    throw Bad(std::string("--model: ") + e.what());
  }
  const std::string d = a.get("dtype", "fp32");
  if (d != "fp32" && d != "bf16") throw Bad("--dtype must be bf16 or fp32, got '" + d + "'");
  const double secs = pos_num(a, "probe-seconds", 0.4);
  const int tp = static_cast<int>(pos_int(a, "tp", 1));
  for (int64_t v : {m.n_head, m.n_kv_head, m.ffn_hidden})
    if (v % tp != 0) throw Bad("--tp " + std::to_string(tp) + " does not divide the model's heads / kv heads / ffn");
  std::cout << compute_probe_json(
      measure_compute_here(m, pos_int(a, "micro-batch", 4), d == "bf16", secs, 48e6, tp, a.flag("sequence-parallel")));
  return 0;
}

std::vector<EngineLayout> pick_layouts(const std::string& flag, const std::string& list,
                                       const std::vector<EngineLayout>& all, const std::vector<std::string>& names) {
  if (list.empty()) return all;
  std::vector<EngineLayout> out;
  for (const std::string& item : split_list(list)) {
    bool found = false;
    for (size_t i = 0; i < all.size() && i < names.size(); ++i)
      if (item == names[i]) out.push_back(all[i]), found = true;
    if (!found) throw Bad("--" + flag + ": unknown layout '" + item + "' (known: " + join(names, ", ") + ")");
  }
  return out;
}

int run_validate(const ArgParser& a, bool as_json) {
  ValidateOptions o;
  o.steps = static_cast<int>(pos_int(a, "steps", 8));
  if (o.steps < 2) throw Bad("--steps must be at least 2 (the first step is not timed)");
  o.layouts = pick_layouts("layouts", a.get("layouts"), default_validation_layouts(), validation_layout_names());
  if (a.get("scale-layouts") == "none") o.run_scale = false;
  else o.scale_layouts = pick_layouts("scale-layouts", a.get("scale-layouts"), default_scale_layouts(), scale_layout_names());
  o.check_time = !a.flag("no-time-check");
  if (a.has("keep")) {
    o.work_dir = a.get("keep");
    o.keep = true;
  }
  if (a.has("probe-seconds")) o.probe_seconds = pos_num(a, "probe-seconds", 0.4);
  o.progress = &std::cerr;
  ValidationReport r = run_validation(o);
  std::cout << (as_json ? validation_json(r) : format_validation(r));
  return r.ok ? 0 : 1;
}

bool fp32_from_args(const ArgParser& a) {
  const std::string d = a.get("dtype", "bf16");
  if (d == "bf16") return false;
  if (d == "fp32") return true;
  throw Bad("--dtype must be bf16 or fp32, got '" + d + "'");
}

// The explicit figures (--mem-per-gpu, --peak-tflops, ...) replace the cluster's.
void apply_cluster_overrides(const ArgParser& a, bool fp32, Cluster& c) {
  if (a.has("gpus-per-node")) c.gpus_per_node = static_cast<int>(pos_int(a, "gpus-per-node", 8));
  if (a.has("mem-per-gpu")) {
    c.mem_per_gpu = pos_num(a, "mem-per-gpu", 0) * GiB;  // shared CPU nodes: the node's memory
    if (!c.shared_node) c.mem_reserved = 1.0 * GiB + 0.05 * c.mem_per_gpu;
    if (c.mem_reserved >= c.mem_per_gpu) c.mem_reserved = 0.1 * c.mem_per_gpu;
  }
  if (a.has("peak-tflops")) (fp32 ? c.peak_flops_fp32 : c.peak_flops_bf16) = pos_num(a, "peak-tflops", 0) * 1e12;
  if (a.has("compute-efficiency")) {
    c.compute_efficiency = a.get_double("compute-efficiency", 0);
    if (!(c.compute_efficiency > 0 && c.compute_efficiency <= 1))
      throw Bad("--compute-efficiency must be in (0, 1], got '" + a.get("compute-efficiency") + "'");
  }
  if (a.has("mem-bw")) c.mem_bw = pos_num(a, "mem-bw", 0) * GB;
  if (a.has("intra-bw")) c.intra.bw = pos_num(a, "intra-bw", 0) * GB;
  if (a.has("inter-bw")) c.inter.bw = pos_num(a, "inter-bw", 0) * GB;
  if (a.has("intra-latency-us")) c.intra.latency_s = pos_num(a, "intra-latency-us", 0) * 1e-6;
  if (a.has("inter-latency-us")) c.inter.latency_s = pos_num(a, "inter-latency-us", 0) * 1e-6;
  if (a.has("host-bw")) c.host_link_bw = pos_num(a, "host-bw", 0) * GB;
  if (a.has("host-mem")) c.host_mem_per_node = pos_num(a, "host-mem", 0) * GiB;
  if (a.has("host-mem-bw")) c.host_mem_bw_per_node = pos_num(a, "host-mem-bw", 0) * GB;
}

// --model, --hf-config and explicit dimensions (which override the first two). *from_hf: the
// model came from a Hugging Face config.
ModelConfig model_from_args(const ArgParser& a, bool* from_hf) {
  ModelConfig m;
  bool have_model = false;
  *from_hf = false;
  if (a.has("model") && a.has("hf-config")) throw Bad("--model and --hf-config are exclusive");
  try {
    if (a.has("model")) {
      m = plan_model_preset(a.get("model"));
      have_model = true;
    } else if (a.has("hf-config")) {
      m = model_from_hf_config(a.get("hf-config"));
      have_model = *from_hf = true;
    }
  } catch (const std::invalid_argument& e) {
    throw Bad((a.has("model") ? "--model: " : "") + std::string(e.what()));
  }
  const bool explicit_dims = a.has("layers") || a.has("hidden") || a.has("heads") || a.has("kv-heads") ||
                             a.has("ffn") || a.has("vocab") || a.has("arch");
  if (!have_model && !explicit_dims) throw Bad("--model, --hf-config or explicit dimensions (--layers ...) are required");
  if (!explicit_dims) return m;
  const bool tied = m.tied_embeddings;
  if (!have_model) {
    m = ModelConfig();
    m.name = "custom";
    m.arch = Arch::Llama;
    m.tied_embeddings = false;
    for (const char* k : {"layers", "hidden", "heads", "vocab"})
      if (!a.has(k)) throw Bad(std::string("--") + k + " is required when no --model or --hf-config is given");
  }
  if (a.has("arch") && !parse_arch(a.get("arch"), &m.arch)) throw Bad("--arch must be gpt2 or llama, got '" + a.get("arch") + "'");
  if (a.has("layers")) m.n_layer = pos_int(a, "layers", 0);
  if (a.has("hidden")) m.n_embd = pos_int(a, "hidden", 0), m.ffn_hidden = 0;
  if (a.has("heads")) m.n_head = pos_int(a, "heads", 0), m.n_kv_head = m.n_head;
  if (a.has("kv-heads")) m.n_kv_head = pos_int(a, "kv-heads", 0);
  if (a.has("ffn")) m.ffn_hidden = pos_int(a, "ffn", 0);
  if (a.has("vocab")) m.vocab_size = pos_int(a, "vocab", 0), m.padded_vocab = 0;
  if (!have_model && a.has("seq")) m.seq_len = pos_int(a, "seq", 0);
  if (have_model) m.name += "+overrides";
  try {
    m.resolve();
  } catch (const std::invalid_argument& e) {
    throw Bad(std::string("model dimensions: ") + e.what());
  }
  if (m.arch == Arch::Llama && have_model) m.tied_embeddings = tied;
  return m;
}

// --lora-rank R [--lora-targets LIST]: LoRA fine-tuning of the model (the frozen base in the
// compute dtype; gradients and optimizer state for the adapters only).
void apply_lora_args(const ArgParser& a, ModelConfig& m) {
  if (!a.has("lora-rank")) {
    if (a.has("lora-targets")) throw Bad("--lora-targets needs --lora-rank");
    return;
  }
  m.lora_rank = pos_int(a, "lora-rank", 0);
  try {
    m.lora_targets = parse_lora_targets(a.get("lora-targets", "q,v"), m.arch);
  } catch (const std::invalid_argument& e) {
    throw Bad(std::string("--lora-targets: ") + e.what());
  }
  if (m.moe()) throw Bad("--lora-rank: LoRA is for dense models (this one is a mixture of experts)");
  if (a.has("tp") && a.get("tp") != "1") throw Bad("--lora-rank: the planner does not model LoRA with tensor parallelism (drop --tp)");
}

// The training setup's flags; a note for each default the planner chose.
TrainSetup setup_from_args(const ArgParser& a, bool fp32, const ModelConfig& m, bool from_hf,
                           std::vector<std::string>& notes) {
  TrainSetup st;
  st.fp32 = fp32;
  st.global_batch = pos_int(a, "global-batch", 0);
  st.micro_batch = pos_int(a, "micro-batch", 0);
  st.seq = pos_int(a, "seq", 0);
  if (st.seq == 0 && from_hf && m.seq_len > 8192) {
    st.seq = 8192;
    notes.push_back("training sequence capped at 8192 of the config's " + std::to_string(m.seq_len) +
                    " positions; pass --seq to change");
  }
  // --NAME fp32 | bf16 as bytes per element; bf16 is 4 bytes in an fp32 run where it follows the
  // compute dtype (follows_compute).
  auto dtype_bytes = [&](const char* name, bool follows_compute) {
    const std::string v = a.get(name);
    if (v == "fp32") return 4;
    if (v == "bf16") return follows_compute && fp32 ? 4 : 2;
    throw Bad(std::string("--") + name + " must be fp32 or bf16, got '" + v + "'");
  };
  if (a.has("reduce-dtype")) st.reduce_bytes = dtype_bytes("reduce-dtype", true);
  if (a.has("grad-dtype")) st.grad_bytes = dtype_bytes("grad-dtype", false);
  const std::string at = a.get("attention", "flash");
  if (at == "flash") st.attention = AttentionImpl::Flash;
  else if (at == "unfused") st.attention = AttentionImpl::Unfused;
  else throw Bad("--attention must be flash or unfused, got '" + at + "'");
  if (a.has("logits-dtype")) st.logits_bytes = dtype_bytes("logits-dtype", true);
  if (a.has("residual-dtype")) st.residual_bytes = dtype_bytes("residual-dtype", true);
  st.dropout = a.flag("dropout");
  st.sequence_parallel = !a.flag("no-sp");
  st.tp_comm_overlap = a.flag("tp-overlap");
  st.overlap_param_gather = a.flag("overlap-param-gather");
  if (a.has("bucket-mb")) st.bucket_bytes = pos_num(a, "bucket-mb", 25) * 1024 * 1024;
  return st;
}

// this-cpu: the machine this runs on, measured (the engine's kernels at the model's shapes, one
// rank's threads), unless --no-measure keeps the reference preset or the model is too large to
// probe here.
void measure_cpu_cluster(const ArgParser& a, const ModelConfig& m, const TrainSetup& st, Cluster& c,
                         std::vector<std::string>& notes) {
  if (c.name != "this-cpu" || a.flag("no-measure")) return;
  const int64_t probe_mb = st.micro_batch > 0 ? st.micro_batch : 1;
  const int64_t seq = st.seq > 0 ? st.seq : m.seq_len;
  const double tok = static_cast<double>(probe_mb * seq);
  const double wide = static_cast<double>(std::max(m.padded_vocab, 4 * m.ffn_hidden));
  // matmul buffers, and the optimizer-step probe's weights, gradients and moments (16 B/param)
  const double probe_bytes = 4.0 * (4.0 * tok * wide + 2.0 * m.n_embd * wide) + 16.0 * static_cast<double>(m.num_params());
  if (probe_bytes > 2.0 * GiB) {
    notes.push_back("this-cpu: the model is too large to probe on this machine (" +
                    std::to_string(static_cast<int>(probe_bytes / GiB)) +
                    " GiB of probe buffers): the reference preset's figures are used");
    return;
  }
  ModelConfig pm = m;
  pm.seq_len = seq;
  const int ranks = std::max(1, c.gpus);
  const int cores = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  const int before = omp_get_max_threads();
  omp_set_num_threads(std::max(1, cores / ranks));
  const plan::CpuMeasurement cm = measure_this_cpu(pm, probe_mb, !st.fp32, std::min(ranks, cores));
  omp_set_num_threads(before);
  const int gpus = c.gpus;
  c = plan::measured_cpu_cluster(cm);
  c.gpus = gpus;
  apply_cluster_overrides(a, st.fp32, c);
  notes.push_back("this-cpu measured here with one rank running (" + c.efficiency_note +
                  "); ranks that share the machine share its memory bandwidth: `plan --validate` measures "
                  "them all at once");
}

// The search constraints (--strategy, --tp, ...) and --top.
PlanOptions options_from_args(const ArgParser& a) {
  PlanOptions o;
  o.top_k = static_cast<int>(pos_int(a, "top", 10));
  o.allow_offload = !a.flag("no-offload");
  if (a.has("strategy")) {
    Strategy s;
    if (!parse_strategy(a.get("strategy"), &s)) throw Bad("--strategy: unknown strategy '" + a.get("strategy") + "'");
    o.strategy = s;
  }
  if (a.has("tp")) o.tp = static_cast<int>(pos_int(a, "tp", 0));
  if (a.has("pp")) o.pp = static_cast<int>(pos_int(a, "pp", 0));
  if (a.has("cp")) o.cp = static_cast<int>(pos_int(a, "cp", 0));
  if (a.has("schedule")) {
    Schedule s;
    if (!parse_schedule(a.get("schedule"), &s) || s == Schedule::None)
      throw Bad("--schedule must be gpipe, 1f1b or interleaved_1f1b, got '" + a.get("schedule") + "'");
    o.schedule = s;
  }
  if (a.has("ac")) {
    Checkpointing ck;
    if (!parse_checkpointing(a.get("ac"), &ck)) throw Bad("--ac must be none, selective or full, got '" + a.get("ac") + "'");
    o.checkpointing = ck;
  }
  return o;
}

int run(int argc, char** argv) {
  ArgParser a({"model", "hf-config", "arch", "layers", "hidden", "heads", "kv-heads", "ffn", "vocab", "gpus",
               "gpus-per-node", "cluster", "global-batch", "micro-batch", "seq", "dtype", "reduce-dtype", "grad-dtype",
               "residual-dtype", "logits-dtype", "attention", "bucket-mb", "mem-per-gpu", "peak-tflops",
               "compute-efficiency", "mem-bw", "intra-bw", "intra-latency-us", "inter-bw", "inter-latency-us", "host-bw", "host-mem", "host-mem-bw",
               "strategy", "tp", "pp", "cp", "schedule", "ac", "top", "steps", "layouts", "scale-layouts", "keep",
               "probe-seconds", "lora-rank", "lora-targets"},
              {"json", "help", "published", "article", "dropout", "no-sp", "tp-overlap", "overlap-param-gather",
               "no-offload", "validate", "no-time-check", "probe-compute", "no-measure", "sequence-parallel"});
  a.parse(argc, argv, 1);
  if (!a.positional().empty()) throw Bad("unexpected argument '" + a.positional()[0] + "'");
  if (a.flag("help")) {
    std::cout << plan_help();
    return 0;
  }
  const bool as_json = a.flag("json");
  if (a.flag("probe-compute")) return run_probe(a);
  if (a.flag("validate")) return run_validate(a, as_json);

  Cluster c;
  try {
    c = cluster_preset(a.get("cluster", "h100-80g-ib400"));
  } catch (const std::invalid_argument& e) {
    throw Bad(std::string("--cluster: ") + e.what());
  }
  const bool fp32 = fp32_from_args(a);
  apply_cluster_overrides(a, fp32, c);
  if (a.flag("published")) {
    std::cout << format_published(as_json);
    return 0;
  }
  if (a.flag("article")) {
    std::cout << format_article(c, as_json);
    return 0;
  }

  bool from_hf = false;
  ModelConfig m = model_from_args(a, &from_hf);
  apply_lora_args(a, m);
  std::vector<std::string> notes;
  const TrainSetup st = setup_from_args(a, fp32, m, from_hf, notes);
  if (m.lora()) {
    const double ad = static_cast<double>(m.n_layer * m.lora_block_params());
    char buf[256];
    std::snprintf(buf, sizeof buf,
                  "LoRA rank %lld on %s: %.1f M adapter parameters (%.3f%% of %.2f B); the base is frozen "
                  "(compute dtype only), gradients and optimizer state are the adapters'; layouts without tensor parallelism",
                  static_cast<long long>(m.lora_rank), lora_targets_string(m.lora_targets, m.arch).c_str(), ad / 1e6,
                  100.0 * ad / static_cast<double>(m.num_params()), static_cast<double>(m.num_params()) / 1e9);
    notes.push_back(buf);
  }
  if (!a.has("gpus")) throw Bad("--gpus is required");
  c.gpus = static_cast<int>(pos_int(a, "gpus", 0));
  measure_cpu_cluster(a, m, st, c, notes);
  const PlanOptions o = options_from_args(a);
  if (st.global_batch > 0 && st.micro_batch > 0 && st.global_batch % st.micro_batch)
    throw Bad("--global-batch " + std::to_string(st.global_batch) + " is not divisible by --micro-batch " +
              std::to_string(st.micro_batch));

  PlanResult r;
  try {
    r = plan::plan(m, c, st, o);
  } catch (const std::invalid_argument& e) {
    throw Bad(e.what());
  }
  for (auto& n : notes) r.notes.insert(r.notes.begin(), n);
  std::cout << (as_json ? plan_json(r) : format_plan(r));
  return 0;
}

}  // namespace

int run_plan_command(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const ArgError& e) {
    std::fprintf(stderr, "meshtrain plan: %s (see meshtrain plan --help)\n", e.what());
    return 2;
  } catch (const Bad& e) {
    std::fprintf(stderr, "meshtrain plan: %s\n", e.what());
    return 2;
  } catch (const std::invalid_argument& e) {
    std::fprintf(stderr, "meshtrain plan: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "meshtrain plan: internal error: %s\n", e.what());
    return 1;
  }
}

}  // namespace mt::cli
