// `meshtrain bench attention` (cli/bench_attention.cpp) on the CPU: one row per attention op with a
// positive time and FLOP rate; the usage errors exit with status 2 and name the option.
#include <gtest/gtest.h>

#include <sstream>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "run_command.h"

namespace {

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

TEST(BenchAttention, TimesEachAttentionOpOnTheCpu) {
  std::string out, err;
  ASSERT_EQ(run_cmd(mt::cli::run_bench_attention_command,
                    {"attention", "--device", "cpu", "--shape", "1,33,4,2,16", "--iters", "2"}, &out, &err),
            0)
      << err;
  int rows = 0;
  for (const char* op : {"attention_forward", "attention_backward", "attention_forward_bf16",
                         "attention_backward_bf16"}) {
    std::istringstream lines(out);
    std::string line;
    bool found = false;
    while (std::getline(lines, line)) {
      std::istringstream f(line);
      std::string shape, dims, kernel;
      double ms = 0, tflops = 0;
      if (!(f >> shape >> dims >> kernel >> ms >> tflops) || kernel != op) continue;
      EXPECT_EQ(dims, "1,33,4,2,16") << line;
      EXPECT_GT(ms, 0.0) << line;
      EXPECT_GT(tflops, 0.0) << line;
      found = true;
      ++rows;
    }
    EXPECT_TRUE(found) << op << " missing from:\n" << out;
  }
  EXPECT_EQ(rows, 4) << out;
}

TEST(BenchAttention, UsageErrorsExitWithStatus2) {
  std::string err;
  EXPECT_EQ(run_cmd(mt::cli::run_bench_attention_command, {"attention", "--shape", "1,2,3,2,4"}, nullptr, &err), 2);
  EXPECT_TRUE(contains(err, "--shape must be B,T,NH,NKV,HD")) << err;
  EXPECT_EQ(run_cmd(mt::cli::run_bench_attention_command, {"attention", "--shapes", "gpt3"}, nullptr, &err), 2);
  EXPECT_TRUE(contains(err, "--shapes takes gpt2 and llama")) << err;
  EXPECT_EQ(run_cmd(mt::cli::run_bench_attention_command, {"attention", "--iters", "0"}, nullptr, &err), 2);
  EXPECT_TRUE(contains(err, "--iters")) << err;
  EXPECT_EQ(run_cmd(mt::cli::run_bench_attention_command, {"attention", "--device", "tpu"}, nullptr, &err), 2);
  EXPECT_TRUE(contains(err, "--device")) << err;
}

}  // namespace
