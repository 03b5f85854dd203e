#include "plan/report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>
#include <vector>

#include "plan/published.h"
#include "plan/text_table.h"

namespace mt::plan {

namespace {

using json = nlohmann::ordered_json;

int64_t bytes(double b) { return static_cast<int64_t>(std::llround(b)); }


std::string human_count(double n) {
  if (n >= 1e9) return fmt("%.2f B", n / 1e9);
  if (n >= 1e6) return fmt("%.1f M", n / 1e6);
  return fmt("%.0f", n);
}

std::string dp_cell_no_cp(const Layout& l) {
  switch (l.strategy) {
    case Strategy::NoShard: return l.dp_replicate > 1 ? "DDP x" + std::to_string(l.dp_replicate) : "single";
    case Strategy::HybridShard: return "HSDP " + std::to_string(l.dp_replicate) + "x" + std::to_string(l.dp_shard);
    default: return std::string(strategy_label(l.strategy)) + " x" + std::to_string(l.dp_shard);
  }
}
// The data-parallel cell, with the context- and expert-parallel degrees when there are ones ("ZeRO-3 x2 cp4").
std::string dp_cell(const Layout& l) {
  std::string s = l.cp > 1 ? dp_cell_no_cp(l) + " cp" + std::to_string(l.cp) : dp_cell_no_cp(l);
  return l.ep > 1 ? s + " ep" + std::to_string(l.ep) : s;
}

std::string sched_cell(const Layout& l) {
  if (l.pp == 1) return "-";
  if (l.schedule == Schedule::Interleaved) return "interl.v" + std::to_string(l.virtual_stages);
  return to_string(l.schedule);
}

json model_json(const ModelConfig& m, int64_t seq) {
  return {{"name", m.name},
          {"arch", arch_name(m.arch)},
          {"params", m.num_params()},
          {"active_params", m.active_params()},
          {"moe_experts", m.moe_experts},
          {"moe_top_k", m.moe_top_k},
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
  return {{"strategy", to_string(l.strategy)},
          {"strategy_label", strategy_label(l.strategy)},
          {"dp_replicate", l.dp_replicate},
          {"dp_shard", l.dp_shard},
          {"tp", l.tp},
          {"pp", l.pp},
          {"ep", l.ep},
          {"cp", l.cp},
          {"pp_schedule", to_string(l.schedule)},
          {"pp_virtual_stages", l.virtual_stages},
          {"micro_batch", l.micro_batch},
          {"microbatches", l.microbatches},
          {"activation_checkpointing", to_string(l.checkpointing)},
          {"cpu_offload", l.offload_optimizer()},
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

std::string format_plan(const PlanResult& r) {
  const ModelConfig& m = r.model;
  const Cluster& c = r.cluster;
  std::ostringstream o;
  o << "model    " << m.name << ": " << human_count(static_cast<double>(m.num_params())) << " params, " << m.n_layer
    << " layers, hidden " << m.n_embd << ", " << m.n_head << " heads";
  if (m.n_kv_head != m.n_head) o << " / " << m.n_kv_head << " kv";
  o << ", ffn " << m.ffn_hidden << ", vocab " << m.padded_vocab << (m.tied_embeddings ? " (tied)" : "") << "\n";
  if (m.moe())
    o << "         mixture of experts: " << m.moe_experts << " experts of width " << m.expert_ffn() << ", top-"
      << m.moe_top_k << (m.moe_shared_experts ? " + " + std::to_string(m.moe_shared_experts) + " shared" : "") << ", "
      << (m.moe_sigmoid ? "sigmoid" : "softmax") << " router; " << human_count(static_cast<double>(m.active_params()))
      << " params active per token\n";
  o << "cluster  " << c.gpus << " " << c.device << "s, " << c.name << ": " << c.description << "\n";
  o << "setup    global batch " << r.setup.global_batch << " x " << r.setup.seq << " tokens, "
    << (r.setup.fp32 ? "fp32" : "bf16 mixed precision") << ", model state "
    << fmt("%.1f GB", r.model_state_bytes / 1e9) << " unsharded ("
    << fmt("%.0f", bytes_per_param(r.setup.fp32, r.setup.grad_bytes).total()) << " B/param)\n";
  o << "searched " << r.evaluated << " layouts, " << r.fitting << " fit in "
    << fmt("%.1f GiB", (r.candidates.empty() ? c.usable_mem() : r.candidates[0].mem_usable) / GiB)
    << " usable per " << c.device << "\n\n";

  std::vector<std::vector<std::string>> rows;
  int i = 0;
  for (const Estimate& e : r.candidates) {
    const Layout& l = e.layout;
    const MemoryBytes& mb = e.mem;
    rows.push_back({std::to_string(++i), dp_cell(l), std::to_string(l.tp), std::to_string(l.pp), sched_cell(l),
                    std::to_string(l.micro_batch) + "x" + std::to_string(l.microbatches), to_string(l.checkpointing),
                    l.offload_optimizer() ? "yes" : "-", fmt("%.1f", mb.total() / GiB),
                    fmt("%.1f", mb.params / GiB) + "/" + fmt("%.1f", mb.grads / GiB) + "/" + fmt("%.1f", mb.optimizer / GiB) +
                        "/" + fmt("%.1f", mb.activations / GiB) + "/" + fmt("%.1f", mb.comm / GiB),
                    e.fits ? "yes" : "NO", fmt("%.1f", e.comm.intra_node / 1e9), fmt("%.1f", e.comm.inter_node / 1e9),
                    fmt("%.3f", e.time.total()), fmt("%.3f", e.time.compute), fmt("%.3f", e.time.exposed_comm),
                    fmt("%.3f", e.time.bubble), fmt("%.0f", e.tokens_per_s), fmt("%.1f%%", 100 * e.mfu)});
  }
  o << format_table({"#", "data par.", "tp", "pp", "sched", "mb x m", "ac", "offl", "GiB/" + c.device, "par/grad/opt/act/comm", "fits",
              "GB intra", "GB inter", "step s", "compute", "exp.comm", "bubble", "tok/s", "MFU"},
             rows,
             {true, false, true, true, false, false, false, false, true, false, false, true, true, true, true, true, true,
              true, true});
  o << "\n(memory per " << c.device << " at peak; GB sent per " << c.device
    << " per step; step = compute + exposed communication + bubble)\n\n";
  o << "Recommendation: " << r.recommendation << "\n";
  if (!r.runner_up.empty()) o << r.runner_up << "\n";
  if (!r.candidates.empty()) {
    const Estimate& top = r.candidates[0];
    std::vector<std::string> others;
    for (const Estimate& b : r.best_per_strategy) {
      if (b.layout.strategy == top.layout.strategy) continue;
      std::string s = std::string("  best ") + strategy_label(b.layout.strategy) + " (" + dp_cell(b.layout) + ", tp " +
                      std::to_string(b.layout.tp) + ", pp " + std::to_string(b.layout.pp) + ", ac " +
                      to_string(b.layout.checkpointing) + (b.layout.offload_optimizer() ? ", offload" : "") + "): ";
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
  if (r.offload_only_count > 0) {
    o << "Fits only with CPU offload of the optimizer state (" << r.offload_only_count
      << (r.offload_only_count == 1 ? " layout; the same layout" : " layouts; the same layouts")
      << " without offload do" << (r.offload_only_count == 1 ? "es" : "") << " not fit):\n";
    for (const auto& [e, w] : r.offload_only) {
      const Layout& l = e.layout;
      o << "  " << strategy_label(l.strategy) << " (" << dp_cell(l) << ", tp " << l.tp << ", pp " << l.pp << ", ac "
        << to_string(l.checkpointing) << ", mb " << l.micro_batch << "x" << l.microbatches << "): "
        << fmt("%.1f GiB", e.mem.total() / GiB) << " per " << e.device << " (" << fmt("%.1f GiB", w.mem.total() / GiB)
        << " without offload), " << fmt("%.0f GB", e.host_bytes_per_node / 1e9) << " of host memory per node; step "
        << fmt("%.2f s", e.time.total()) << " vs " << fmt("%.2f s", w.time.total())
        << " without offload (if it fit): " << fmt("%.2fx", e.time.total() / w.time.total()) << " (CPU Adam "
        << fmt("%.2f s", e.optimizer_s) << ", PCIe copies " << fmt("%.2f s", e.offload_s) << ")\n";
    }
    o << "  (CPU Adam at " << fmt("%.0f GB/s", c.host_mem_bw_per_node / 1e9) << " of host memory traffic per node, 28 B per"
      << " parameter; PCIe " << fmt("%.0f GB/s", c.host_link_bw / 1e9) << " per " << c.device
      << ", not overlapped: docs/plan.md, \"CPU offload\")\n";
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
  j["offload_only_count"] = r.offload_only_count;
  j["offload_only"] = json::array();
  for (const auto& [e, w] : r.offload_only) {
    json x = estimate_json(e);
    x["step_time_without_offload_s"] = w.time.total();
    x["mem_per_gpu_without_offload_bytes"] = bytes(w.mem.total());
    x["slowdown_vs_without_offload"] = e.time.total() / w.time.total();
    j["offload_only"].push_back(x);
  }
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
    cell += std::string(" ac:") + to_string(l.checkpointing);
    if (l.offload_optimizer()) cell += " offload";
    rows.push_back({b.model, human_count(b.params), std::to_string(b.gpus), article_band(b.params),
                    b.any_fits ? cell : "nothing fits", b.any_fits ? fmt("%.1f%%", 100 * b.top.mfu) : "-",
                    b.any_fits ? fmt("%.1f", b.top.mem.total() / GiB) : fmt("(%.0f)", b.top.mem.total() / GiB)});
  }
  o << format_table({"model", "params", "GPUs", "article says", "planner's top layout", "MFU", "GiB/GPU"}, rows,
             {false, true, true, false, false, true, true});
  return o.str();
}

}  // namespace mt::plan
