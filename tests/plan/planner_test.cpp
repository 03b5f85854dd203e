// The planner: enumeration, ranking, explanations and Hugging Face configs (the command: tests/cli).
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "plan/planner.h"

namespace mt::plan {
namespace {

Cluster cluster(const std::string& name, int gpus) {
  Cluster c = cluster_preset(name);
  c.gpus = gpus;
  return c;
}

TEST(Planner, RanksFittingLayoutsByStepTime) {
  TrainSetup st;
  PlanOptions o;
  o.top_k = 0;
  const PlanResult r = plan(model_preset("llama3-8b"), cluster("h100-80g-ib400", 16), st, o);
  ASSERT_GT(r.candidates.size(), 10u);
  EXPECT_EQ(r.setup.global_batch, 128);  // default: 2^20 tokens / 8192
  EXPECT_EQ(r.setup.seq, 8192);
  bool seen_unfit = false;
  for (size_t i = 0; i < r.candidates.size(); ++i) {
    const Estimate& e = r.candidates[i];
    EXPECT_EQ(e.world, 16);
    EXPECT_EQ(e.layout.global_batch(), 128);
    if (!e.fits) {
      seen_unfit = true;
    } else {
      EXPECT_FALSE(seen_unfit) << "a fitting layout ranked after one that does not fit";
    }
    if (i > 0 && e.fits && r.candidates[i - 1].fits) {
      EXPECT_LE(rank_score(r.candidates[i - 1]), rank_score(e));
    }
    EXPECT_FALSE(e.why.empty());
    EXPECT_NEAR(e.time.total(), e.time.compute + e.time.exposed_comm + e.time.bubble, 1e-12);
    EXPECT_NEAR(e.tokens_per_s, 128.0 * 8192 / e.time.total(), 1e-6 * e.tokens_per_s);
  }
  EXPECT_TRUE(r.candidates[0].fits);
  EXPECT_FALSE(r.recommendation.empty());
  EXPECT_NE(r.runner_up.find("lost because"), std::string::npos);
  EXPECT_EQ(r.best_per_strategy.size(), 5u);
}

TEST(Planner, ExplainsTopChoiceAndNothingFits) {
  const PlanResult r = plan(model_preset("gpt3-175b"), cluster("h100-80g-ib400", 8), TrainSetup{});
  EXPECT_FALSE(r.candidates[0].fits);
  EXPECT_EQ(r.fitting, 0);
  EXPECT_NE(r.recommendation.find("Nothing fits"), std::string::npos);
  EXPECT_TRUE(r.candidates[0].why.find("Does not fit") != std::string::npos ||
              r.candidates[0].why.find("host memory") != std::string::npos)
      << r.candidates[0].why;
}

TEST(Planner, SmallModelOnOneNodeIsPlainDataParallel) {
  TrainSetup st;
  st.global_batch = 512;  // 0.5M tokens per step, as llm.c trains it
  const PlanResult r = plan(model_preset("gpt2-124m"), cluster("h100-80g-ib400", 8), st);
  const Layout& l = r.candidates[0].layout;
  EXPECT_EQ(l.tp, 1);
  EXPECT_EQ(l.pp, 1);
  EXPECT_TRUE(l.strategy == Strategy::NoShard || l.strategy == Strategy::Zero1 || l.strategy == Strategy::ShardGradOp)
      << l.describe();
  EXPECT_EQ(l.checkpointing, Checkpointing::None);
}

TEST(Planner, HonoursConstraints) {
  PlanOptions o;
  o.tp = 2;
  o.strategy = Strategy::FullShard;
  o.checkpointing = Checkpointing::Full;
  o.top_k = 0;
  const PlanResult r = plan(model_preset("llama3-8b"), cluster("h100-80g-ib400", 16), TrainSetup{}, o);
  for (const auto& e : r.candidates) {
    EXPECT_EQ(e.layout.tp, 2);
    EXPECT_EQ(e.layout.strategy, Strategy::FullShard);
    EXPECT_EQ(e.layout.checkpointing, Checkpointing::Full);
  }
  PlanOptions bad;
  bad.tp = 3;
  EXPECT_THROW(plan(model_preset("llama3-8b"), cluster("h100-80g-ib400", 16), TrainSetup{}, bad), std::invalid_argument);
  TrainSetup odd;
  odd.global_batch = 7;  // no data-parallel degree of 16 GPUs divides it except with dp = 1
  odd.micro_batch = 2;
  EXPECT_THROW(plan(model_preset("gpt2-124m"), cluster("h100-80g-ib400", 16), odd), std::invalid_argument);
}

// Each candidate costs one closed-form estimate, so the plan's time is proportional to the number
// of layouts it evaluates (a count, not a stopwatch): a large cluster must stay a search of
// thousands of candidates, not one that a new dimension multiplies out of bounds. Llama 3 405B on
// 256 GPUs evaluates about 12.7k layouts.
constexpr int64_t kMaxEvaluated = 20000;

TEST(Planner, SearchStaysBoundedForLargeClusters) {
  PlanOptions o;
  o.top_k = 10;
  const PlanResult r = plan(model_preset("llama3-405b"), cluster("h100-80g-ib400", 256), TrainSetup{}, o);
  EXPECT_GT(r.evaluated, 1000);
  EXPECT_LT(r.evaluated, kMaxEvaluated);
  EXPECT_TRUE(r.candidates[0].fits);
}

TEST(Planner, CpuClusterPlansForThisMachine) {
  TrainSetup st;
  st.global_batch = 8;
  const PlanResult r = plan(model_preset("gpt2-small-cpu"), cluster("this-cpu", 2), st);
  EXPECT_TRUE(r.candidates[0].fits);
  for (const auto& e : r.candidates) EXPECT_FALSE(e.layout.offload_optimizer());  // host memory is device memory
  EXPECT_GT(r.candidates[0].tokens_per_s, 0.0);
  EXPECT_LT(r.candidates[0].mfu, 0.6);
}

TEST(Presets, ExtraModelsAndTiedLlama) {
  const ModelConfig m = plan_model_preset("llama3.2-1b");
  EXPECT_TRUE(m.tied_embeddings);
  EXPECT_NEAR(static_cast<double>(m.num_params()), 1.236e9, 0.005e9);  // meta-llama/Llama-3.2-1B
  EXPECT_NEAR(static_cast<double>(plan_model_preset("llama2-7b").num_params()), 6.74e9, 0.01e9);
  EXPECT_NEAR(static_cast<double>(plan_model_preset("llama2-13b").num_params()), 13.02e9, 0.01e9);
  EXPECT_EQ(plan_model_preset("llama3-70b").n_layer, 80);  // falls back to model_preset
  EXPECT_THROW(plan_model_preset("nope"), std::invalid_argument);
}

TEST(HfConfig, LlamaAndGpt2) {
  const ModelConfig l = model_from_hf_json(
      R"({"model_type":"llama","hidden_size":4096,"num_hidden_layers":32,"num_attention_heads":32,
          "num_key_value_heads":8,"intermediate_size":14336,"vocab_size":128256,
          "max_position_embeddings":8192,"tie_word_embeddings":false})",
      "cfg");
  const ModelConfig ref = model_preset("llama3-8b");
  EXPECT_EQ(l.num_params(), ref.num_params());
  EXPECT_EQ(l.n_kv_head, 8);
  const ModelConfig t = model_from_hf_json(
      R"({"model_type":"llama","hidden_size":2048,"num_hidden_layers":16,"num_attention_heads":32,
          "num_key_value_heads":8,"intermediate_size":8192,"vocab_size":128256,"tie_word_embeddings":true})",
      "cfg");
  EXPECT_TRUE(t.tied_embeddings);
  EXPECT_EQ(t.num_params(), plan_model_preset("llama3.2-1b").num_params());
  const ModelConfig g = model_from_hf_json(
      R"({"model_type":"gpt2","n_embd":768,"n_layer":12,"n_head":12,"n_positions":1024,"vocab_size":50257,
          "n_inner":null})",
      "cfg");
  EXPECT_EQ(g.num_params(), model_preset("gpt2-124m").num_params());
}

TEST(HfConfig, ErrorsNameFileAndKey) {
  try {
    model_from_hf_json(R"({"model_type":"llama","hidden_size":64,"num_attention_heads":4})", "x.json");
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("x.json"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("num_hidden_layers"), std::string::npos);
  }
  EXPECT_THROW(model_from_hf_json("{not json", "x.json"), std::invalid_argument);
  EXPECT_THROW(model_from_hf_json(R"({"model_type":"t5"})", "x.json"), std::invalid_argument);
  EXPECT_THROW(model_from_hf_config("/nonexistent/config.json"), std::invalid_argument);
}

}  // namespace
}  // namespace mt::plan
