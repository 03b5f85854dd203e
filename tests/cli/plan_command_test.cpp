// `meshtrain plan` (cli/plan.cpp): help, bad input naming the flag, the table, JSON keys, HF configs.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "plan/planner.h"

namespace mt::plan {
namespace {

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
  const int rc = cli::run_plan_command(static_cast<int>(argv.size()), argv.data());
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
