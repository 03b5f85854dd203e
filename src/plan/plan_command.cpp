#include "plan/plan_command.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>
#include <vector>

#include "plan/published.h"
#include "plan/validate.h"
#include "plan/text_table.h"
#include "runtime/arg_parser.h"

namespace mt::plan {

namespace {

using json = nlohmann::ordered_json;

int64_t bytes(double b) { return static_cast<int64_t>(std::llround(b)); }

std::string fmt(const char* f, double v) {
  char buf[128];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

std::string join(const std::vector<std::string>& v, const std::string& sep) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? sep : "") + v[i];
  return s;
}


std::string human_count(double n) {
  if (n >= 1e9) return fmt("%.2f B", n / 1e9);
  if (n >= 1e6) return fmt("%.1f M", n / 1e6);
  return fmt("%.0f", n);
}

std::string dp_cell(const Layout& l) {
  switch (l.strategy) {
    case Strategy::DDP: return l.dp_replicate > 1 ? "DDP x" + std::to_string(l.dp_replicate) : "single";
    case Strategy::HSDP: return "HSDP " + std::to_string(l.dp_replicate) + "x" + std::to_string(l.dp_shard);
    default: return std::string(strategy_label(l.strategy)) + " x" + std::to_string(l.dp_shard);
  }
}

std::string sched_cell(const Layout& l) {
  if (l.pp == 1) return "-";
  if (l.schedule == Schedule::Interleaved) return "interl.v" + std::to_string(l.virtual_stages);
  return schedule_name(l.schedule);
}

json model_json(const ModelConfig& m, int64_t seq) {
  return {{"name", m.name},
          {"arch", arch_name(m.arch)},
          {"params", m.num_params()},
          {"n_layer", m.n_layer},
          {"n_embd", m.n_embd},
          {"n_head", m.n_head},
          {"n_kv_head", m.n_kv_head},
          {"ffn_hidden", m.ffn_hidden},
          {"vocab_size", m.vocab_size},
          {"padded_vocab", m.padded_vocab},
          {"seq_len", m.seq_len},
          {"train_seq", seq},
          {"tied_embeddings", m.tied_embeddings},
          {"flops_per_token", flops_per_token(m, seq)}};
}

json estimate_json(const Estimate& e) {
  const Layout& l = e.layout;
  return {{"strategy", strategy_config_name(l.strategy)},
          {"strategy_label", strategy_label(l.strategy)},
          {"dp_replicate", l.dp_replicate},
          {"dp_shard", l.dp_shard},
          {"tp", l.tp},
          {"pp", l.pp},
          {"pp_schedule", schedule_name(l.schedule)},
          {"pp_virtual_stages", l.virtual_stages},
          {"micro_batch", l.micro_batch},
          {"microbatches", l.microbatches},
          {"activation_checkpointing", checkpointing_name(l.checkpointing)},
          {"cpu_offload", l.cpu_offload},
          {"mem_per_gpu_bytes",
           {{"params", bytes(e.mem.params)},
            {"grads", bytes(e.mem.grads)},
            {"optimizer", bytes(e.mem.optimizer)},
            {"activations", bytes(e.mem.activations)},
            {"comm", bytes(e.mem.comm)},
            {"total", bytes(e.mem.total())}}},
          {"mem_usable_bytes", bytes(e.mem_usable)},
          {"host_bytes_per_node", bytes(e.host_bytes_per_node)},
          {"fits", e.fits},
          {"comm_bytes_per_step", {{"intra_node", bytes(e.comm.intra_node)}, {"inter_node", bytes(e.comm.inter_node)}}},
          {"step_time_s",
           {{"compute", e.time.compute},
            {"exposed_comm", e.time.exposed_comm},
            {"bubble", e.time.bubble},
            {"total", e.time.total()}}},
          {"tokens_per_s", e.tokens_per_s},
          {"mfu", e.mfu},
          {"why", e.why}};
}

}  // namespace

// ---- help -----------------------------------------------------------------------------------------------

std::string plan_help() {
  std::string models = join(plan_model_preset_names(), ", ");
  std::string clusters = join(cluster_preset_names(), ", ");
  return "usage: meshtrain plan --gpus N (--model PRESET | --hf-config FILE | --layers L --hidden H --heads A --vocab V ...)\n"
         "                      [--cluster PRESET] [--gpus-per-node G] [--global-batch B] [--micro-batch b]\n"
         "                      [--seq S] [--dtype bf16|fp32] [--top K] [--json]\n"
         "       meshtrain plan --published [--json]     predicted vs published results (Megatron-LM, torchtitan, llm.c)\n"
         "       meshtrain plan --article [--cluster PRESET] [--json]\n"
         "                                               the seed article's numbers checked, and its decision bands recomputed\n"
         "       meshtrain plan --validate [--steps N] [--layouts LIST] [--no-time-check] [--keep DIR] [--json]\n"
         "                                               runs real jobs of this engine and checks the planner against them\n"
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
         "  --reduce-dtype fp32|bf16  gradient reduction dtype (default fp32)\n"
         "  --grad-dtype bf16|fp32  stored gradient dtype (default: the parameter dtype)\n"
         "  --attention flash|unfused  attention kernel (default flash: no s x s scores kept)\n"
         "  --dropout               dropout masks are stored (default off)\n"
         "  --no-sp                 no sequence parallelism with tp > 1\n"
         "  --tp-overlap            TP collectives overlap the GEMMs (async TP)\n"
         "  --overlap-param-gather  ZeRO-1/2 post-step all-gather overlaps the next forward\n"
         "  --bucket-mb MB          gradient bucket size (default 25)\n"
         "Cluster (a preset, then overrides):\n"
         "  --cluster PRESET        " + clusters + " (default h100-80g-ib400)\n"
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
         "Search constraints:\n"
         "  --strategy S            DDP|ZeRO-1|ZeRO-2|ZeRO-3|HSDP (or NO_SHARD, ZERO1, SHARD_GRAD_OP, FULL_SHARD, HYBRID_SHARD)\n"
         "  --tp T  --pp P          fix the tensor / pipeline degree\n"
         "  --schedule S            gpipe|1f1b|interleaved_1f1b\n"
         "  --ac none|selective|full  fix activation checkpointing (selective = every second block recomputed)\n"
         "  --no-offload            do not consider CPU offload\n"
         "Validation against this engine (--validate):\n"
         "  Measures the machine first (the model's matmul and attention kernels with as many probe processes as\n"
         "  the job has ranks, a streaming kernel, `launch -n N -- bench comm`), then runs `meshtrain launch -n N --\n"
         "  train` for each layout and prints predicted vs measured per-rank memory by category (model state to the\n"
         "  byte), bytes per collective group (exactly) and step time (within 25%). Exit status 1 when a check fails.\n"
         "  --steps N               training steps per job (default 8; the first is not timed)\n"
         "  --layouts LIST          comma-separated subset of: ddp, zero1, zero2, zero3, zero3x4, hsdp, ddp-bf16,\n"
         "                          llama-zero3-bf16, tp2 (tp = 2 on 2 ranks), tp2-zero3x4 (tp = 2 x ZeRO-3\n"
         "                          dp_shard = 2 on 4 ranks), tp2-sp (tp = 2 + sequence parallelism), tp2-sp-bf16,\n"
         "                          pp2 (pp = 2 1f1b, 4 micro-batches), pp2-gpipe, pp2-dp2 (pp = 2 x DDP 2 on 4\n"
         "                          ranks), pp2-interleaved (2 chunks per rank) (default: all sixteen)\n"
         "  --no-time-check         report step time without failing on it (shared, noisy machines)\n"
         "  --keep DIR              run in DIR and keep the metrics and logs\n"
         "Output:\n"
         "  --top K                 candidates shown (default 10; the best micro-batch of each layout family)\n"
         "  --json                  JSON (keys as in INTERFACE.md: model, model_state_bytes, candidates[...])\n"
         "  --help                  this text\n";
}

// ---- human output ---------------------------------------------------------------------------------------

std::string format_plan(const PlanResult& r) {
  const ModelConfig& m = r.model;
  const Cluster& c = r.cluster;
  std::ostringstream o;
  o << "model    " << m.name << ": " << human_count(static_cast<double>(m.num_params())) << " params, " << m.n_layer
    << " layers, hidden " << m.n_embd << ", " << m.n_head << " heads";
  if (m.n_kv_head != m.n_head) o << " / " << m.n_kv_head << " kv";
  o << ", ffn " << m.ffn_hidden << ", vocab " << m.padded_vocab << (m.tied_embeddings ? " (tied)" : "") << "\n";
  o << "cluster  " << c.gpus << " GPUs, " << c.name << ": " << c.description << "\n";
  o << "setup    global batch " << r.setup.global_batch << " x " << r.setup.seq << " tokens, "
    << (r.setup.fp32 ? "fp32" : "bf16 mixed precision") << ", model state "
    << fmt("%.1f GB", r.model_state_bytes / 1e9) << " unsharded ("
    << fmt("%.0f", bytes_per_param(r.setup.fp32, r.setup.grad_bytes).total()) << " B/param)\n";
  o << "searched " << r.evaluated << " layouts, " << r.fitting << " fit in "
    << fmt("%.1f GiB", (r.candidates.empty() ? c.usable_mem() : r.candidates[0].mem_usable) / GiB)
    << " usable per GPU\n\n";

  std::vector<std::vector<std::string>> rows;
  int i = 0;
  for (const Estimate& e : r.candidates) {
    const Layout& l = e.layout;
    const MemoryBytes& mb = e.mem;
    rows.push_back({std::to_string(++i), dp_cell(l), std::to_string(l.tp), std::to_string(l.pp), sched_cell(l),
                    std::to_string(l.micro_batch) + "x" + std::to_string(l.microbatches), checkpointing_name(l.checkpointing),
                    l.cpu_offload ? "yes" : "-", fmt("%.1f", mb.total() / GiB),
                    fmt("%.1f", mb.params / GiB) + "/" + fmt("%.1f", mb.grads / GiB) + "/" + fmt("%.1f", mb.optimizer / GiB) +
                        "/" + fmt("%.1f", mb.activations / GiB) + "/" + fmt("%.1f", mb.comm / GiB),
                    e.fits ? "yes" : "NO", fmt("%.1f", e.comm.intra_node / 1e9), fmt("%.1f", e.comm.inter_node / 1e9),
                    fmt("%.3f", e.time.total()), fmt("%.3f", e.time.compute), fmt("%.3f", e.time.exposed_comm),
                    fmt("%.3f", e.time.bubble), fmt("%.0f", e.tokens_per_s), fmt("%.1f%%", 100 * e.mfu)});
  }
  o << format_table({"#", "data par.", "tp", "pp", "sched", "mb x m", "ac", "offl", "GiB/GPU", "par/grad/opt/act/comm", "fits",
              "GB intra", "GB inter", "step s", "compute", "exp.comm", "bubble", "tok/s", "MFU"},
             rows,
             {true, false, true, true, false, false, false, false, true, false, false, true, true, true, true, true, true,
              true, true});
  o << "\n(memory per GPU at peak; GB sent per GPU per step; step = compute + exposed communication + bubble)\n\n";
  o << "Recommendation: " << r.recommendation << "\n";
  if (!r.runner_up.empty()) o << r.runner_up << "\n";
  if (!r.candidates.empty()) {
    const Estimate& top = r.candidates[0];
    std::vector<std::string> others;
    for (const Estimate& b : r.best_per_strategy) {
      if (b.layout.strategy == top.layout.strategy) continue;
      std::string s = std::string("  best ") + strategy_label(b.layout.strategy) + " (" + dp_cell(b.layout) + ", tp " +
                      std::to_string(b.layout.tp) + ", pp " + std::to_string(b.layout.pp) + ", ac " +
                      checkpointing_name(b.layout.checkpointing) + (b.layout.cpu_offload ? ", offload" : "") + "): ";
      if (!b.fits)
        s += "does not fit (" + fmt("%.1f GiB", b.mem.total() / GiB) + " needed)";
      else if (top.fits) {
        const double d = b.time.total() / top.time.total() - 1;
        s += (d >= 0 ? fmt("%.1f%% slower", 100 * d) : fmt("%.1f%% faster but more complex", -100 * d)) + ", " +
             fmt("%.1f GiB", b.mem.total() / GiB);
      }
      else
        s += "fits";
      others.push_back(s);
    }
    if (!others.empty()) o << "Other strategies:\n" << join(others, "\n") << "\n";
  }
  for (const auto& n : r.notes) o << "note: " << n << "\n";
  return o.str();
}

std::string plan_json(const PlanResult& r) {
  json j;
  j["model"] = model_json(r.model, r.setup.seq);
  j["model_state_bytes"] = bytes(r.model_state_bytes);
  j["gpus"] = r.cluster.gpus;
  j["cluster"] = {{"name", r.cluster.name},
                  {"gpus_per_node", r.cluster.gpus_per_node},
                  {"mem_per_gpu_bytes", bytes(r.cluster.mem_per_gpu)},
                  {"mem_reserved_bytes", bytes(r.cluster.mem_reserved)},
                  {"peak_flops", r.cluster.peak_flops(r.setup.fp32)},
                  {"compute_efficiency", r.cluster.compute_efficiency},
                  {"intra_bw", r.cluster.intra.bw},
                  {"inter_bw", r.cluster.inter.bw}};
  j["setup"] = {{"global_batch", r.setup.global_batch},
                {"seq", r.setup.seq},
                {"dtype", r.setup.fp32 ? "fp32" : "bf16"},
                {"reduce_dtype", r.setup.reduce_bytes == 4 ? "fp32" : "bf16"}};
  j["evaluated"] = r.evaluated;
  j["fitting"] = r.fitting;
  j["candidates"] = json::array();
  for (const Estimate& e : r.candidates) j["candidates"].push_back(estimate_json(e));
  j["recommendation"] = r.recommendation;
  j["runner_up"] = r.runner_up;
  return j.dump(2) + "\n";
}

std::string format_published(bool as_json) {
  std::vector<PublishedResult> res;
  for (const auto& c : published_cases()) res.push_back(evaluate_published(c));
  if (as_json) {
    json j = json::array();
    for (const auto& r : res)
      j.push_back({{"id", r.c.id},
                   {"system", r.c.system},
                   {"description", r.c.description},
                   {"source", r.c.source},
                   {"assumptions", r.c.assumptions},
                   {"metric", metric_name(r.c.metric)},
                   {"published", r.c.published},
                   {"predicted", r.predicted},
                   {"error", r.error},
                   {"tolerance", kPublishedTolerance},
                   {"within", r.within},
                   {"published_mfu", r.c.published_mfu < 0 ? json(nullptr) : json(r.c.published_mfu)},
                   {"predicted_mfu", r.e.mfu},
                   {"estimate", estimate_json(r.e)}});
    return json({{"published", j}}).dump(2) + "\n";
  }
  std::ostringstream o;
  o << "Published results predicted from their setups alone (stated error: +/-" << fmt("%.0f", kPublishedTolerance * 100)
    << "%)\n\n";
  std::vector<std::vector<std::string>> rows;
  for (const auto& r : res)
    rows.push_back({r.c.id, r.c.system, metric_name(r.c.metric), fmt("%.3g", r.c.published), fmt("%.3g", r.predicted),
                    fmt("%+.1f%%", 100 * r.error), r.within ? "yes" : "NO",
                    r.c.published_mfu < 0 ? "-" : fmt("%.1f%%", 100 * r.c.published_mfu), fmt("%.1f%%", 100 * r.e.mfu),
                    fmt("%.2f", r.e.time.total()),
                    fmt("%.2f", r.e.time.compute) + "/" + fmt("%.2f", r.e.time.exposed_comm) + "/" +
                        fmt("%.2f", r.e.time.bubble)});
  o << format_table({"case", "system", "metric", "published", "predicted", "error", "within", "MFU pub", "MFU pred", "step s",
              "compute/comm/bubble"},
             rows, {false, false, false, true, true, true, false, true, true, true, false});
  o << "\n";
  for (const auto& r : res) {
    o << r.c.id << ": " << r.c.description << "\n  source: " << r.c.source << "\n  assumed: " << r.c.assumptions
      << "\n";
  }
  o << "\nMFU columns: the source's own figure, and ours with 6N + 12Lhs FLOPs per token (embedding lookups "
       "excluded); Megatron's TFLOP/s counts recomputation (96 B s L h^2 ...), so its 44% is hardware, not model, "
       "utilisation.\n";
  return o.str();
}

std::string format_article(const Cluster& bands_cluster, bool as_json) {
  const auto checks = article_checks();
  const auto bands = decision_bands(bands_cluster);
  if (as_json) {
    json j;
    j["checks"] = json::array();
    for (const auto& c : checks)
      j["checks"].push_back({{"id", c.id}, {"claim", c.claim}, {"computed", c.computed}, {"verdict", c.verdict}});
    j["bands_cluster"] = bands_cluster.name;
    j["bands"] = json::array();
    for (const auto& b : bands)
      j["bands"].push_back({{"model", b.model},
                            {"params", b.params},
                            {"gpus", b.gpus},
                            {"article_band", article_band(b.params)},
                            {"top", estimate_json(b.top)}});
    return j.dump(2) + "\n";
  }
  std::ostringstream o;
  o << "The seed article's worked numbers, recomputed\n\n";
  for (const auto& c : checks)
    o << "[" << c.id << "]\n  article:  " << c.claim << "\n  computed: " << c.computed << "\n  verdict:  " << c.verdict
      << "\n\n";
  o << "Decision framework recomputed on " << bands_cluster.name << " (~2M tokens per step; top layout per cell)\n\n";
  std::vector<std::vector<std::string>> rows;
  for (const auto& b : bands) {
    const Layout& l = b.top.layout;
    std::string cell = dp_cell(l);
    if (l.tp > 1) cell += " tp" + std::to_string(l.tp);
    if (l.pp > 1) cell += " pp" + std::to_string(l.pp) + "(" + sched_cell(l) + ")";
    cell += std::string(" ac:") + checkpointing_name(l.checkpointing);
    if (l.cpu_offload) cell += " offload";
    rows.push_back({b.model, human_count(b.params), std::to_string(b.gpus), article_band(b.params),
                    b.any_fits ? cell : "nothing fits", b.any_fits ? fmt("%.1f%%", 100 * b.top.mfu) : "-",
                    b.any_fits ? fmt("%.1f", b.top.mem.total() / GiB) : fmt("(%.0f)", b.top.mem.total() / GiB)});
  }
  o << format_table({"model", "params", "GPUs", "article says", "planner's top layout", "MFU", "GiB/GPU"}, rows,
             {false, true, true, false, false, true, true});
  return o.str();
}

// ---- the command ----------------------------------------------------------------------------------------

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
  std::cout << compute_probe_json(measure_compute_here(m, pos_int(a, "micro-batch", 4), d == "bf16", secs, 48e6, tp));
  return 0;
}

std::vector<EngineLayout> pick_layouts(const std::string& list) {
  const std::vector<EngineLayout> all = default_validation_layouts();
  const std::vector<std::string> names = validation_layout_names();
  if (list.empty()) return all;
  std::vector<EngineLayout> out;
  for (const std::string& item : split_list(list)) {
    bool found = false;
    for (size_t i = 0; i < all.size() && i < names.size(); ++i)
      if (item == names[i]) out.push_back(all[i]), found = true;
    if (!found) throw Bad("--layouts: unknown layout '" + item + "' (known: " + join(names, ", ") + ")");
  }
  return out;
}

int run_validate(const ArgParser& a, bool as_json) {
  ValidateOptions o;
  o.steps = static_cast<int>(pos_int(a, "steps", 8));
  if (o.steps < 2) throw Bad("--steps must be at least 2 (the first step is not timed)");
  o.layouts = pick_layouts(a.get("layouts"));
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

int run(int argc, char** argv) {
  ArgParser a({"model", "hf-config", "arch", "layers", "hidden", "heads", "kv-heads", "ffn", "vocab", "gpus",
               "gpus-per-node", "cluster", "global-batch", "micro-batch", "seq", "dtype", "reduce-dtype", "grad-dtype",
               "attention", "bucket-mb", "mem-per-gpu", "peak-tflops", "compute-efficiency", "mem-bw", "intra-bw",
               "intra-latency-us", "inter-bw", "inter-latency-us", "host-bw", "host-mem", "strategy", "tp", "pp",
               "schedule", "ac", "top", "steps", "layouts", "keep", "probe-seconds"},
              {"json", "help", "published", "article", "dropout", "no-sp", "tp-overlap", "overlap-param-gather",
               "no-offload", "validate", "no-time-check", "probe-compute"});
  a.parse(argc, argv, 1);
  if (!a.positional().empty()) throw Bad("unexpected argument '" + a.positional()[0] + "'");
  if (a.flag("help")) {
    std::cout << plan_help();
    return 0;
  }
  const bool as_json = a.flag("json");
  if (a.flag("probe-compute")) return run_probe(a);
  if (a.flag("validate")) return run_validate(a, as_json);

  // Cluster.
  Cluster c;
  try {
    c = cluster_preset(a.get("cluster", "h100-80g-ib400"));
  } catch (const std::invalid_argument& e) {
    throw Bad(std::string("--cluster: ") + e.what());
  }
  if (a.has("gpus-per-node")) c.gpus_per_node = static_cast<int>(pos_int(a, "gpus-per-node", 8));
  const bool fp32 = [&] {
    const std::string d = a.get("dtype", "bf16");
    if (d == "bf16") return false;
    if (d == "fp32") return true;
    throw Bad("--dtype must be bf16 or fp32, got '" + d + "'");
  }();
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

  if (a.flag("published")) {
    std::cout << format_published(as_json);
    return 0;
  }
  if (a.flag("article")) {
    std::cout << format_article(c, as_json);
    return 0;
  }

  // Model.
  ModelConfig m;
  bool have_model = false, from_hf = false;
  if (a.has("model") && a.has("hf-config")) throw Bad("--model and --hf-config are exclusive");
  try {
    if (a.has("model")) {
      m = plan_model_preset(a.get("model"));
      have_model = true;
    } else if (a.has("hf-config")) {
      m = model_from_hf_config(a.get("hf-config"));
      have_model = from_hf = true;
    }
  } catch (const std::invalid_argument& e) {
    throw Bad((a.has("model") ? "--model: " : "") + std::string(e.what()));
  }
  const bool explicit_dims = a.has("layers") || a.has("hidden") || a.has("heads") || a.has("kv-heads") ||
                             a.has("ffn") || a.has("vocab") || a.has("arch");
  if (!have_model && !explicit_dims) throw Bad("--model, --hf-config or explicit dimensions (--layers ...) are required");
  if (explicit_dims) {
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
  }

  // Setup.
  TrainSetup st;
  st.fp32 = fp32;
  st.global_batch = pos_int(a, "global-batch", 0);
  st.micro_batch = pos_int(a, "micro-batch", 0);
  st.seq = pos_int(a, "seq", 0);
  std::vector<std::string> notes;
  if (st.seq == 0 && from_hf && m.seq_len > 8192) {
    st.seq = 8192;
    notes.push_back("training sequence capped at 8192 of the config's " + std::to_string(m.seq_len) +
                    " positions; pass --seq to change");
  }
  {
    const std::string r = a.get("reduce-dtype", "fp32");
    if (r == "fp32") st.reduce_bytes = 4;
    else if (r == "bf16") st.reduce_bytes = fp32 ? 4 : 2;
    else throw Bad("--reduce-dtype must be fp32 or bf16, got '" + r + "'");
  }
  if (a.has("grad-dtype")) {
    const std::string g = a.get("grad-dtype");
    if (g == "fp32") st.grad_bytes = 4;
    else if (g == "bf16") st.grad_bytes = 2;
    else throw Bad("--grad-dtype must be fp32 or bf16, got '" + g + "'");
  }
  {
    const std::string at = a.get("attention", "flash");
    if (at == "flash") st.attention = AttentionImpl::Flash;
    else if (at == "unfused") st.attention = AttentionImpl::Unfused;
    else throw Bad("--attention must be flash or unfused, got '" + at + "'");
  }
  st.dropout = a.flag("dropout");
  st.sequence_parallel = !a.flag("no-sp");
  st.tp_comm_overlap = a.flag("tp-overlap");
  st.overlap_param_gather = a.flag("overlap-param-gather");
  if (a.has("bucket-mb")) st.bucket_bytes = pos_num(a, "bucket-mb", 25) * 1024 * 1024;

  if (!a.has("gpus")) throw Bad("--gpus is required");
  c.gpus = static_cast<int>(pos_int(a, "gpus", 0));

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
  if (st.global_batch > 0 && st.micro_batch > 0 && st.global_batch % st.micro_batch)
    throw Bad("--global-batch " + std::to_string(st.global_batch) + " is not divisible by --micro-batch " +
              std::to_string(st.micro_batch));

  PlanResult r;
  try {
    r = plan(m, c, st, o);
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

}  // namespace mt::plan
