// The memory preflight (train.preflight, train/preflight.h) and the straggler comparison
// (log.straggler_every, train/straggler.h) on real runs of the meshtrain binary: a job whose dry-run
// peak exceeds the memory free for it is refused on every rank with exit code 2 and one message
// (the figures by category and the planner's layout), one that fits trains, train.preflight = false
// skips the check; Llama 3 8B on this machine is refused without allocating it. On 2 ranks a rank
// slowed in its data path or its compute (MESHTRAIN_TEST_SLOW_RANK, test-only) is named with that
// part, an even run names nobody, and `meshtrain diagnose` reads it back.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace fs = std::filesystem;

namespace {

struct Result {
  int rc = -1;
  std::string out;
};

Result sh(const std::string& cmd) {
  Result r;
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  if (!p) return r;
  char buf[4096];
  for (size_t n; (n = std::fread(buf, 1, sizeof buf, p)) > 0;) r.out.append(buf, n);
  const int st = pclose(p);
  r.rc = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return r;
}

size_t count(const std::string& s, const std::string& what) {
  size_t n = 0;
  for (size_t at = s.find(what); at != std::string::npos; at = s.find(what, at + 1)) ++n;
  return n;
}

std::vector<nlohmann::json> steps(const std::string& path) {
  std::vector<nlohmann::json> v;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    nlohmann::json j = nlohmann::json::parse(line);
    if (!j.contains("final")) v.push_back(j);
  }
  return v;
}

const std::string kBin = MT_BINARY;

class PreflightStraggler : public ::testing::Test {
 protected:
  static fs::path dir;
  static std::string run;  // "<binary> train --config run.toml"

  static void SetUpTestSuite() {
    setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
    setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
    dir = fs::temp_directory_path() / ("mt_preflight_" + std::to_string(::getpid()));
    fs::remove_all(dir);
    fs::create_directories(dir);
    const Result p = sh(kBin + " prepare --tokenizer byte --out " + (dir / "data").string() +
                        " --val-fraction 0.05 " MT_SOURCE_DIR "/tests/data/fixtures/tinyshakespeare_head.txt");
    ASSERT_EQ(p.rc, 0) << p.out;
    const std::string d = (dir / "data").string();
    std::ofstream(dir / "run.toml") << "[model]\npreset = \"gpt2-mini\"\nseq_len = 32\n"
                                    << "[data]\ntrain = \"" << d << "/train.bin\"\nval = \"" << d
                                    << "/val.bin\"\ntokenizer = \"byte\"\n"
                                    << "[train]\nsteps = 3\nmicro_batch = 2\neval_every = 0\nsample_tokens = 0\n"
                                    << "warmup_steps = 1\nthreads = 1\n[log]\nprint_every = 100\n";
  }
  static void TearDownTestSuite() { fs::remove_all(dir); }

  static std::string train(int ranks, const std::string& env, const std::string& args) {
    const std::string launch = ranks > 1 ? " launch -n " + std::to_string(ranks) + " --" : "";
    return env + " " + kBin + launch + " train --config " + (dir / "run.toml").string() + " " + args;
  }
};
fs::path PreflightStraggler::dir;

TEST_F(PreflightStraggler, TooLittleMemoryIsRefusedWithFiguresAndALayout) {
  // 8 MB free: gpt2-mini's peak (about 15 MiB with Adam and activations) is above it.
  const Result r = sh(train(1, "MESHTRAIN_TEST_AVAILABLE_BYTES=8000000", ""));
  EXPECT_EQ(r.rc, 2) << r.out;
  EXPECT_NE(r.out.find("config error: memory preflight: rank 0"), std::string::npos) << r.out;
  for (const char* c : {"params ", "grads ", "optimizer ", "activations ", "workspace "})
    EXPECT_NE(r.out.find(c), std::string::npos) << c << "\n" << r.out;
  EXPECT_NE(r.out.find("the planner"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("train.preflight = false"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("step "), std::string::npos) << "it trained:\n" << r.out;

  // Enough memory, or the check off: the same job trains.
  const Result fits = sh(train(1, "MESHTRAIN_TEST_AVAILABLE_BYTES=100000000000", ""));
  EXPECT_EQ(fits.rc, 0) << fits.out;
  const Result off = sh(train(1, "MESHTRAIN_TEST_AVAILABLE_BYTES=8000000", "--train.preflight false"));
  EXPECT_EQ(off.rc, 0) << off.out;
  EXPECT_EQ(off.out.find("memory preflight"), std::string::npos) << off.out;
}

TEST_F(PreflightStraggler, AllRanksStopWithOneMessage) {
  const Result r = sh(train(2, "MESHTRAIN_TEST_AVAILABLE_BYTES=8000000", "--parallel.strategy FULL_SHARD"));
  EXPECT_EQ(r.rc, 2) << r.out;
  EXPECT_EQ(count(r.out, "memory preflight"), 1u) << r.out;
  EXPECT_NE(r.out.find("ranks do not fit"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("MPI_ABORT"), std::string::npos) << r.out;
}

TEST_F(PreflightStraggler, Llama3_8BIsRefusedWithoutAllocatingIt) {
  // The real machine's memory (unless it has the ~130 GB Llama 3 8B needs with Adam).
  const Result r = sh(train(1, "", "--model.preset llama3-8b --model.seq_len 256 --train.micro_batch 1"));
  struct rusage ru {};
  getrusage(RUSAGE_CHILDREN, &ru);
  if (r.rc == 0) GTEST_SKIP() << "this machine has the memory for Llama 3 8B";
  EXPECT_EQ(r.rc, 2) << r.out;
  EXPECT_NE(r.out.find("memory preflight"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("the planner needs"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("out of host memory"), std::string::npos) << r.out;
  // No child of this test (the train command, its dry run) held 1 GiB: nothing of the model was allocated.
  EXPECT_LT(ru.ru_maxrss, 1024L * 1024L) << "KiB";
}

TEST_F(PreflightStraggler, SlowRankIsNamedWithItsPartEvenRunNamesNobody) {
  const std::string common = "--train.steps 6 --log.straggler_every 3 --log.straggler_min_ms 100 ";
  auto named = [&](const std::string& name, const std::string& env) {
    const std::string m = (dir / (name + ".jsonl")).string();
    const Result r = sh(train(2, env, common + "--log.metrics_out " + m));
    EXPECT_EQ(r.rc, 0) << r.out;
    std::vector<nlohmann::json> out;
    for (const auto& j : steps(m))
      if (j.contains("straggler")) {
        EXPECT_EQ(j["busy_ms_per_rank"].size(), 2u) << j.dump();
        EXPECT_EQ(j["step_ms_per_rank"].size(), 2u) << j.dump();
        out.push_back(j["straggler"]);
      }
    EXPECT_EQ(out.size(), 2u) << "comparisons at steps 3 and 6";
    return std::make_pair(out, r.out);
  };
  const auto [data, data_log] = named("slow_data", "MESHTRAIN_TEST_SLOW_RANK=1:400");
  for (const auto& s : data) {
    ASSERT_TRUE(s.is_object()) << s.dump();
    EXPECT_EQ(s["rank"], 1);
    EXPECT_EQ(s["part"], "data_wait");
    EXPECT_FALSE(s["host"].get<std::string>().empty());
  }
  EXPECT_NE(data_log.find("straggler: rank 1 on"), std::string::npos) << data_log;
  const auto [comp, comp_log] = named("slow_compute", "MESHTRAIN_TEST_SLOW_RANK=1:400:compute");
  for (const auto& s : comp) {
    ASSERT_TRUE(s.is_object()) << s.dump();
    EXPECT_EQ(s["rank"], 1);
    EXPECT_EQ(s["part"], "compute");
  }
  const auto [even, even_log] = named("even", "");
  for (const auto& s : even) EXPECT_TRUE(s.is_null()) << s.dump();
  EXPECT_EQ(even_log.find("straggler:"), std::string::npos) << even_log;

  // diagnose reads the runs back: the slowed rank and its part, nobody in the even run.
  const Result d = sh(kBin + " diagnose " + (dir / "slow_data.jsonl").string());
  EXPECT_NE(d.out.find("verdict: straggling"), std::string::npos) << d.out;
  EXPECT_NE(d.out.find("(data_wait)"), std::string::npos) << d.out;
  const Result e = sh(kBin + " diagnose " + (dir / "even.jsonl").string());
  EXPECT_EQ(e.out.find("verdict: straggling"), std::string::npos) << e.out;
  EXPECT_NE(e.out.find("no rank named a straggler in 2 comparisons"), std::string::npos) << e.out;
}

}  // namespace
