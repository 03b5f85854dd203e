// `meshtrain diagnose`, `report` and `compare` on real runs of the engine (the meshtrain binary,
// small models on this machine's cores): a single rank is compute-bound, FULL_SHARD of a tiny model
// on 2 ranks with one sequence per step is communication-bound, NO_SHARD and FULL_SHARD train alike,
// another learning rate does not. The report page is rendered by headless Chromium when installed.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

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

const std::string kBin = MT_BINARY;

class Observe : public ::testing::Test {
 protected:
  static fs::path dir;

  static void SetUpTestSuite() {
    setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
    setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
    dir = fs::temp_directory_path() / ("mt_observe_" + std::to_string(::getpid()));
    fs::remove_all(dir);
    fs::create_directories(dir);
    const Result p = sh(kBin + " prepare --tokenizer byte --out " + (dir / "data").string() +
                        " --val-fraction 0.05 " MT_SHARED_DATA "/tinyshakespeare/input.txt");
    ASSERT_EQ(p.rc, 0) << p.out;
    const std::string d = (dir / "data").string();
    std::ofstream(dir / "run.toml") << "[model]\npreset = \"gpt2-mini\"\nseq_len = 64\n"
                                    << "[data]\ntrain = \"" << d << "/train.bin\"\nval = \"" << d
                                    << "/val.bin\"\ntokenizer = \"byte\"\n"
                                    << "[train]\nsteps = 6\nmicro_batch = 4\neval_every = 0\nsample_tokens = 0\n"
                                    << "warmup_steps = 2\nlr = 3e-3\ndtype = \"fp32\"\n[log]\nprint_every = 100\n";
  }
  static void TearDownTestSuite() { fs::remove_all(dir); }

  // Trains run.toml with `args` on `ranks` ranks; returns the metrics file.
  static std::string train(const std::string& name, int ranks, const std::string& args) {
    const std::string m = (dir / (name + ".jsonl")).string();
    const std::string launch = ranks > 1 ? " launch -n " + std::to_string(ranks) + " --" : "";
    const Result r = sh(kBin + launch + " train --config " + (dir / "run.toml").string() + " " + args +
                        " --log.metrics_out " + m);
    EXPECT_EQ(r.rc, 0) << r.out;
    return m;
  }
};
fs::path Observe::dir;

TEST_F(Observe, SingleRankIsComputeBound) {
  const std::string tb = (dir / "tb").string();
  const std::string m = train("single", 1, "--log.tensorboard_dir " + tb);
  const Result r = sh(kBin + " diagnose " + m);
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("verdict: compute-bound"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("waiting for data"), std::string::npos) << r.out;  // every run records data_wait_ms
  EXPECT_NE(r.out.find("straggler not recorded"), std::string::npos) << r.out;  // one rank compares with nobody
  // The trainer's TensorBoard events hold the same numbers as its JSON lines (TensorBoard's reader).
  const Result o = sh("python3 " MT_SOURCE_DIR "/tests/train/tensorboard_oracle.py " + tb + " " + m +
                      " tensorboard_dir");
  if (o.rc == 3) GTEST_SKIP() << "python3 cannot import tensorboard (pip install tensorboard)";
  EXPECT_EQ(o.rc, 0) << o.out;
}

TEST_F(Observe, TinyFullShardOnTwoRanksIsCommunicationBound) {
  const std::string args = "--parallel.strategy FULL_SHARD --train.micro_batch 1 --model.seq_len 16 "
                           "--parallel.prefetch 0 --parallel.bucket_mb 100";
  const std::string m = train("fsdp", 2, args);
  const Result r = sh(kBin + " diagnose " + m + " --config " + (dir / "run.toml").string() + " " + args);
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("verdict: communication-bound"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("most bytes on"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("planner (this-cpu model)"), std::string::npos) << r.out;

  // The same run against a capacity just above its peak is memory-bound.
  const Result mem = sh(kBin + " diagnose " + m + " --capacity-gib 0.001");
  EXPECT_NE(mem.out.find("! memory"), std::string::npos) << mem.out;

  // The report of both runs: a page Chromium renders without console errors, with its charts drawn.
  const std::string single = (dir / "single.jsonl").string();
  if (!fs::exists(single)) train("single", 1, "");
  // A copy of the FULL_SHARD run with per-rank step times (rank 1 taking 30% longer) adds its heat map.
  const std::string per_rank = (dir / "per_rank.jsonl").string();
  {
    std::ifstream in(m);
    std::ofstream out(per_rank);
    for (std::string line; std::getline(in, line);) {
      nlohmann::json j = nlohmann::json::parse(line);
      if (j.contains("step_ms")) j["step_ms_per_rank"] = {j["step_ms"], j["step_ms"].get<double>() * 1.3};
      out << j.dump() << "\n";
    }
  }
  const std::string page = (dir / "report.html").string();
  const Result rep = sh(kBin + " report " + single + " " + m + " " + per_rank + " --labels single,fsdp,per-rank --out " +
                        page);
  ASSERT_EQ(rep.rc, 0) << rep.out;
  const Result chrome = sh("command -v chromium");
  if (chrome.rc != 0) GTEST_SKIP() << "chromium is not installed (apt-get install chromium)";
  const std::string flags = "chromium --headless --no-sandbox --disable-gpu --enable-logging=stderr --v=0 ";
  const Result dom = sh(flags + "--dump-dom file://" + page);
  EXPECT_EQ(dom.out.find("Uncaught"), std::string::npos) << dom.out;
  EXPECT_EQ(dom.out.find("CONSOLE"), std::string::npos) << dom.out;
  // Nine charts hold data: loss, tokens/s, step time, exposed communication, data wait, peak memory,
  // memory by category, bytes by group and the third run's heat map (MFU is not recorded).
  EXPECT_NE(dom.out.find("data-charts-drawn=\"9\""), std::string::npos) << dom.out.substr(std::min(dom.out.find("<html"), dom.out.size()), 2000);
  const std::string png = (dir / "report.png").string();
  const Result shot = sh(flags + "--window-size=1000,900 --screenshot=" + png + " file://" + page);
  ASSERT_TRUE(fs::exists(png)) << shot.out;
  // The first two runs' colours (the report's palette) are on the screen: their lines were drawn.
  const Result px = sh("python3 " MT_SOURCE_DIR "/tests/cli/png_colours.py " + png + " 1f77b4 d62728");
  ASSERT_EQ(px.rc, 0) << px.out;
  int colours = 0, found = 0;
  std::istringstream(px.out) >> colours >> found;
  EXPECT_GE(colours, 8) << "a blank screenshot";
  EXPECT_EQ(found, 2) << "the runs' lines are not on the screenshot";
}

TEST_F(Observe, CompareNoShardAndFullShardAreEqualAnotherLrIsNot) {
  const std::string base = kBin + " compare --config " + (dir / "run.toml").string() + " --ranks 2 --steps 4 ";
  const Result same = sh(base + "--a 'parallel.strategy=NO_SHARD' --b '--parallel.strategy FULL_SHARD' --dir " +
                         (dir / "cmp_same").string());
  EXPECT_EQ(same.rc, 0) << same.out;
  EXPECT_NE(same.out.find("verdict: EQUAL within the tolerance over 4 steps and the final weights"), std::string::npos)
      << same.out;
  const Result lr = sh(base + "--a 'train.lr=3e-3' --b 'train.lr=1e-3' --dir " + (dir / "cmp_lr").string());
  EXPECT_EQ(lr.rc, 1) << lr.out;
  EXPECT_NE(lr.out.find("first diverging at step 2"), std::string::npos) << lr.out;
  EXPECT_NE(lr.out.find("<- outside the tolerance\nverdict"), std::string::npos) << "the final weights: " << lr.out;
  const Result bad = sh(base + "--a 'train.lr' --b ''");
  EXPECT_EQ(bad.rc, 2) << bad.out;
}

}  // namespace
