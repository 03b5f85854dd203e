// Checks of the planner against numbers outside it:
//  * published training results whose setup is fully described (Megatron-LM, torchtitan, llm.c):
//    the planner predicts them from the setup alone and must land within the stated error;
//  * the seed article's worked numbers, reproduced and corrected;
//  * the article's decision framework (which layout wins at which size), recomputed.
// `meshtrain plan --published` and `meshtrain plan --article` print them; tests assert them;
// docs/plan.md tabulates them.
#pragma once
#include <string>
#include <vector>

#include "model/config/model_config.h"
#include "plan/cluster.h"
#include "plan/cost_model.h"

namespace mt::plan {

// The error the planner claims against published step times (relative, either direction).
constexpr double kPublishedTolerance = 0.20;

enum class Metric { TokensPerSecPerGpu, TflopsPerGpuMegatron, SecondsPerStep };
const char* metric_name(Metric m);

struct PublishedCase {
  std::string id;           // e.g. "megatron-gpt3-175b"
  std::string system;       // "Megatron-LM", "torchtitan", "llm.c"
  std::string description;  // model, GPUs, layout in words
  std::string source;       // file / paper the number comes from
  std::string assumptions;  // what the source leaves open and we assumed
  ModelConfig model;
  Cluster cluster;          // gpus set
  TrainSetup setup;
  Layout layout;
  Metric metric = Metric::TokensPerSecPerGpu;
  double published = 0;
  double published_mfu = -1;  // when the source states one (its own FLOP convention)
};

struct PublishedResult {
  PublishedCase c;
  Estimate e;
  double predicted = 0;  // in the case's metric
  double error = 0;      // predicted / published - 1
  bool within = false;   // |error| <= kPublishedTolerance
};

std::vector<PublishedCase> published_cases();
PublishedResult evaluate_published(const PublishedCase& c);

// One worked number from the seed article.
struct ArticleCheck {
  std::string id;
  std::string claim;     // what the article says
  std::string computed;  // what the formulas give
  std::string verdict;   // "correct", "wrong: ...", "depends: ..."
};
std::vector<ArticleCheck> article_checks();

// Numeric pieces of the article checks, exposed for tests.
double article_70b_model_state_bytes();                 // 16 x 70e9
double article_70b_model_state_as_article_adds();       // the article's own parts: 140 + 280 + 280 GB
double allreduce_seconds(double bytes, int gpus, const Cluster& c);  // ring/hierarchical over `gpus` GPUs
double fsdp_over_ddp_comm_ratio(bool fp32_reduce, int64_t microbatches);

// The article's decision framework recomputed: the planner's top layout per model size and GPU count.
struct BandCell {
  std::string model;
  double params = 0;
  int gpus = 0;
  bool any_fits = false;
  Estimate top;
};
// Models: llama3.2-1b, llama2-7b, llama2-13b, llama-33b, llama3-70b, gpt3-175b, llama3-405b; GPU counts
// 8..256 on `cluster` (h100-80g-ib400 in the docs); ~2M tokens per step.
std::vector<BandCell> decision_bands(const Cluster& cluster, const std::vector<int>& gpu_counts = {8, 16, 32, 64, 128, 256});
// The article's band for a parameter count: "DDP or ZeRO-2" (< 3B), "FSDP (ZeRO-3), HSDP across nodes"
// (7-13B), "HSDP + checkpointing (+TP)" (30-70B), "TP x PP x DP" (>= 100B).
std::string article_band(double params);

}  // namespace mt::plan
