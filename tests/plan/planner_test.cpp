// The planner: enumeration, ranking, explanations, Hugging Face configs and the command line.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "plan/plan_command.h"
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
  EXPECT_TRUE(l.strategy == Strategy::DDP || l.strategy == Strategy::ZeRO1 || l.strategy == Strategy::ZeRO2)
      << l.describe();
  EXPECT_EQ(l.checkpointing, Checkpointing::None);
}

TEST(Planner, HonoursConstraints) {
  PlanOptions o;
  o.tp = 2;
  o.strategy = Strategy::ZeRO3;
  o.checkpointing = Checkpointing::Full;
  o.top_k = 0;
  const PlanResult r = plan(model_preset("llama3-8b"), cluster("h100-80g-ib400", 16), TrainSetup{}, o);
  for (const auto& e : r.candidates) {
    EXPECT_EQ(e.layout.tp, 2);
    EXPECT_EQ(e.layout.strategy, Strategy::ZeRO3);
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

TEST(Planner, FastForLargeClusters) {
  const auto t0 = std::chrono::steady_clock::now();
  PlanOptions o;
  o.top_k = 10;
  const PlanResult r = plan(model_preset("llama3-405b"), cluster("h100-80g-ib400", 256), TrainSetup{}, o);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(s, 1.0);
  EXPECT_GT(r.evaluated, 1000);
  EXPECT_TRUE(r.candidates[0].fits);
}

TEST(Planner, CpuClusterPlansForThisMachine) {
  TrainSetup st;
  st.global_batch = 8;
  const PlanResult r = plan(model_preset("gpt2-small-cpu"), cluster("this-cpu", 2), st);
  EXPECT_TRUE(r.candidates[0].fits);
  for (const auto& e : r.candidates) EXPECT_FALSE(e.layout.cpu_offload);  // host memory is device memory
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

// ---- the command ----

struct CmdRun {
  int rc;
  std::string out, err;
};

CmdRun run(std::vector<std::string> args) {
  args.insert(args.begin(), "plan");
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  testing::internal::CaptureStdout();
  testing::internal::CaptureStderr();
  const int rc = run_plan_command(static_cast<int>(argv.size()), argv.data());
  CmdRun r{rc, testing::internal::GetCapturedStdout(), testing::internal::GetCapturedStderr()};
  return r;
}

TEST(Command, HelpAndErrors) {
  CmdRun h = run({"--help"});
  EXPECT_EQ(h.rc, 0);
  for (const char* flag : {"--model", "--hf-config", "--gpus", "--gpus-per-node", "--cluster", "--global-batch",
                           "--micro-batch", "--seq", "--dtype", "--json", "--top", "--mem-per-gpu", "--peak-tflops",
                           "--intra-bw", "--inter-bw", "--inter-latency-us", "--published", "--article"})
    EXPECT_NE(h.out.find(flag), std::string::npos) << flag;
  struct Case {
    std::vector<std::string> args;
    const char* names;
  } cases[] = {
      {{"--model", "gpt2-124m"}, "--gpus"},
      {{"--model", "gpt2-124m", "--gpus", "0"}, "--gpus"},
      {{"--model", "gpt2-124m", "--gpus", "x"}, "--gpus"},
      {{"--model", "nope", "--gpus", "8"}, "--model"},
      {{"--model", "gpt2-124m", "--gpus", "8", "--dtype", "fp16"}, "--dtype"},
      {{"--model", "gpt2-124m", "--gpus", "8", "--cluster", "dgx"}, "--cluster"},
      {{"--model", "gpt2-124m", "--gpus", "8", "--frobnicate"}, "--frobnicate"},
      {{"--model", "gpt2-124m", "--gpus", "8", "--tp", "3"}, "--tp"},
      {{"--model", "gpt2-124m", "--gpus", "8", "--ac", "some"}, "--ac"},
      {{"--hf-config", "/nonexistent.json", "--gpus", "8"}, "--hf-config"},
      {{"--layers", "4", "--gpus", "8"}, "--hidden"},
      {{"--model", "gpt2-124m", "--gpus", "8", "--inter-bw", "-1"}, "--inter-bw"},
  };
  for (const auto& c : cases) {
    CmdRun r = run(c.args);
    EXPECT_EQ(r.rc, 2) << c.names;
    EXPECT_NE(r.err.find(c.names), std::string::npos) << r.err;
    EXPECT_TRUE(r.out.empty());
  }
}

TEST(Command, HumanTableAndExplicitDims) {
  CmdRun r = run({"--model", "llama3-8b", "--gpus", "16", "--top", "4"});
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("Recommendation:"), std::string::npos);
  EXPECT_NE(r.out.find("Runner-up:"), std::string::npos);
  EXPECT_NE(r.out.find("exp.comm"), std::string::npos);
  CmdRun e = run({"--layers", "8", "--hidden", "512", "--heads", "8", "--kv-heads", "4", "--vocab", "32000", "--seq", "1024",
               "--gpus", "4", "--cluster", "a100-80g-ib400", "--gpus-per-node", "4", "--mem-per-gpu", "40"});
  ASSERT_EQ(e.rc, 0) << e.err;
  EXPECT_NE(e.out.find("custom"), std::string::npos);
}

TEST(Command, JsonHasTheInterfaceKeys) {
  CmdRun r = run({"--model", "llama3-70b", "--gpus", "64", "--json", "--top", "3"});
  ASSERT_EQ(r.rc, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["model"]["params"].get<int64_t>(), model_preset("llama3-70b").num_params());
  EXPECT_EQ(j["model"]["n_layer"].get<int>(), 80);
  EXPECT_EQ(j["model"]["n_embd"].get<int>(), 8192);
  EXPECT_NEAR(j["model_state_bytes"].get<double>(), 16.0 * model_preset("llama3-70b").num_params(), 2.0);
  ASSERT_EQ(j["candidates"].size(), 3u);
  for (const auto& c : j["candidates"]) {
    for (const char* k : {"strategy", "dp_replicate", "dp_shard", "tp", "pp", "pp_schedule", "microbatches",
                          "activation_checkpointing", "cpu_offload", "mem_per_gpu_bytes", "fits", "comm_bytes_per_step",
                          "step_time_s", "tokens_per_s", "mfu", "why"})
      EXPECT_TRUE(c.contains(k)) << k;
    for (const char* k : {"params", "grads", "optimizer", "activations", "comm", "total"})
      EXPECT_TRUE(c["mem_per_gpu_bytes"].contains(k)) << k;
    for (const char* k : {"intra_node", "inter_node"}) EXPECT_TRUE(c["comm_bytes_per_step"].contains(k)) << k;
    for (const char* k : {"compute", "exposed_comm", "bubble", "total"}) EXPECT_TRUE(c["step_time_s"].contains(k)) << k;
    Strategy s;
    EXPECT_TRUE(parse_strategy(c["strategy"].get<std::string>(), &s));  // config spelling, e.g. FULL_SHARD
    EXPECT_EQ(c["dp_replicate"].get<int>() * c["dp_shard"].get<int>() * c["tp"].get<int>() * c["pp"].get<int>(), 64);
  }
}

TEST(Command, HfConfigFile) {
  const std::string path = testing::TempDir() + "plan_hf_config.json";
  {
    std::ofstream f(path);
    f << R"({"model_type":"llama","hidden_size":2048,"num_hidden_layers":16,"num_attention_heads":32,
             "num_key_value_heads":8,"intermediate_size":8192,"vocab_size":128256,
             "max_position_embeddings":131072,"tie_word_embeddings":true})";
  }
  CmdRun r = run({"--hf-config", path, "--gpus", "8", "--json", "--top", "1"});
  ASSERT_EQ(r.rc, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["model"]["train_seq"].get<int>(), 8192);  // capped from 131072
  EXPECT_TRUE(j["model"]["tied_embeddings"].get<bool>());
  std::remove(path.c_str());
}

}  // namespace
}  // namespace mt::plan
