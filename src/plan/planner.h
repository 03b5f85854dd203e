// The planner: enumerate every valid layout of a model on a cluster, estimate each (cost_model.h),
// rank them and explain the choice. This is the API `meshtrain plan` prints and `meshtrain train
// --auto` calls:
//
//   mt::plan::Cluster c = mt::plan::cluster_preset("h100-80g-ib400");
//   c.gpus = world_size;
//   mt::plan::PlanResult r = mt::plan::plan(model_config, c, setup);
//   if (r.candidates.empty() || !r.candidates[0].fits) ...;  // nothing fits
//   const mt::plan::Layout& best = r.candidates[0].layout;
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "model/config/model_config.h"
#include "plan/cluster.h"
#include "plan/cost_model.h"

namespace mt::plan {

struct PlanOptions {
  int top_k = 10;                 // candidates returned (0 = all, after de-duplication)
  bool allow_offload = true;      // consider CPU offload of the optimizer state
  bool tp_within_node = true;     // TP groups never cross a node (Megatron practice; Playbook 14% vs 43%)
  int max_virtual_stages = 4;     // interleaved 1F1B chunks per rank considered
  int64_t max_micro_batch = 64;   // largest micro-batch size tried
  bool best_per_family = true;    // keep one micro-batch choice per layout family
  // Constraints (unset = free): pin what the user or the trainer has already decided.
  std::optional<Strategy> strategy;
  int tp = 0, pp = 0;             // 0 = free
  // Context parallelism: 0 = free (cp > 1 is tried for sequences of at least cp_min_seq tokens,
  // where activations dominate), else exactly this degree.
  int cp = 0;
  int64_t cp_min_seq = 16384;
  std::optional<Checkpointing> checkpointing;
  std::optional<Schedule> schedule;
};

struct PlanResult {
  ModelConfig model;
  Cluster cluster;          // as given (gpus set)
  TrainSetup setup;         // resolved: global_batch and seq filled in
  double model_state_bytes = 0;
  int64_t evaluated = 0;    // layouts estimated
  int64_t fitting = 0;      // of them fitting in memory
  std::vector<Estimate> candidates;          // ranked, best first: fitting by step time, then the rest by memory
  std::vector<Estimate> best_per_strategy;   // best layout of each strategy (DDP, ZeRO-1/2/3, HSDP) present
  // Layouts that fit only with CPU offload of the optimizer state (the same layout without it does
  // not): how many, and the best few (one per layout family), each with its step time without offload.
  struct OffloadOnly {
    Estimate with, without;  // the offloaded layout, and the same layout without offload
  };
  int64_t offload_only_count = 0;
  std::vector<OffloadOnly> offload_only;
  std::string recommendation;  // the top choice in plain words
  std::string runner_up;       // why the runner-up lost
  std::vector<std::string> notes;
};

// Ranks layouts of `model` on `cluster` (cluster.gpus ranks). Throws std::invalid_argument for bad
// inputs (no GPUs, global batch not divisible, ...), naming the offending setting.
PlanResult plan(const ModelConfig& model, const Cluster& cluster, const TrainSetup& setup,
                const PlanOptions& opts = {});

// Ordering score used for ranking fitting layouts: step time with a 0.5% penalty per unit of
// complexity, so near-ties go to the simpler layout (DDP 0 < ZeRO-1 1 < ZeRO-2 2 < ZeRO-3 3 < HSDP 4;
// tp +2, pp +3, interleaving +1, GPipe +0.5, selective +0.5, full checkpointing +1, offload +3).
// ZeRO-3 must thus beat DDP by more than 1.5% to be recommended over it.
constexpr double kComplexityPenalty = 0.005;
double rank_score(const Estimate& e);
double layout_complexity(const Layout& l);

// Extra model presets the planner knows beyond mt::model_preset (llama3.2-1b, llama3.2-3b,
// llama2-7b, llama2-13b, llama-33b); falls back to mt::model_preset. Throws std::invalid_argument.
ModelConfig plan_model_preset(const std::string& name);
std::vector<std::string> plan_model_preset_names();

// A Hugging Face config.json (hidden_size, num_hidden_layers, num_attention_heads,
// num_key_value_heads, intermediate_size, vocab_size, max_position_embeddings, model_type,
// tie_word_embeddings; GPT-2's n_embd/n_layer/n_head/n_positions/n_inner). Throws
// std::invalid_argument naming the file and key.
ModelConfig model_from_hf_config(const std::string& path);
ModelConfig model_from_hf_json(const std::string& json_text, const std::string& origin);

}  // namespace mt::plan
