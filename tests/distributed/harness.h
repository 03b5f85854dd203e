// Helpers for tests that run `meshtrain train` as real processes (single, or under mpirun) and
// compare what they wrote: metrics JSON lines and checkpoints.
#pragma once
#include <sys/wait.h>

#include <gtest/gtest.h>
#include <unistd.h>

#include <array>
#include <cmath>
#include <filesystem>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "../test_files.h"
#include "checkpoint/safetensors.h"
#include "data/token_shards.h"

namespace mt {

struct RunOut {
  int code = -1;
  std::string output;
};

inline RunOut run(const std::string& cmd) {
  RunOut r;
  FILE* p = ::popen((cmd + " 2>&1").c_str(), "r");
  if (!p) return r;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = std::fread(buf.data(), 1, buf.size(), p)) > 0) r.output.append(buf.data(), n);
  int st = ::pclose(p);
  r.code = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  return r;
}

inline std::string mpirun(int np) {
  return "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 timeout 300 mpirun -np " + std::to_string(np) +
         " --oversubscribe --bind-to none --mca mpi_yield_when_idle 1 -x OMP_NUM_THREADS=1 "
         "-x GLIBC_TUNABLES=glibc.malloc.hugetlb=1 ";
}

inline std::vector<double> losses(const std::string& metrics) {
  std::vector<double> v;
  std::ifstream f(metrics);
  std::string line;
  while (std::getline(f, line)) {
    auto j = nlohmann::json::parse(line);
    if (!j.contains("final")) v.push_back(j["loss"].get<double>());
  }
  return v;
}

// The weights of a checkpoint directory's latest checkpoint, every tensor concatenated in name
// order. A sharded checkpoint (metadata.json) is assembled here from its pieces, independently of
// the engine's reader (engine layout); a full one is read from model.safetensors (HF layout).
inline std::vector<float> weights(const std::string& ckdir) {
  std::ifstream latest(ckdir + "/latest");
  std::string step;
  std::getline(latest, step);
  const std::string dir = ckdir + "/" + step;
  std::vector<float> all;
  if (std::filesystem::exists(dir + "/metadata.json")) {
    const auto meta = nlohmann::json::parse(std::ifstream(dir + "/metadata.json"));
    for (auto it = meta["tensors"].begin(); it != meta["tensors"].end(); ++it) {
      if (it.key().rfind("exp_avg", 0) == 0) continue;  // moments
      const auto shape = (*it)["shape"].get<std::vector<int64_t>>();
      const int64_t rows = shape[0], cols = shape.size() > 1 ? shape[1] : 1;
      std::vector<float> t(static_cast<size_t>(rows * cols), std::nanf(""));
      for (const auto& p : (*it)["pieces"]) {
        std::ifstream f(dir + "/" + meta["files"][p[0].get<size_t>()]["name"].get<std::string>(), std::ios::binary);
        f.seekg(p[1].get<int64_t>());
        const int64_t r0 = p[2], nr = p[3], c0 = p[4], nc = p[5];
        std::vector<float> buf(static_cast<size_t>(nr * nc));
        f.read(reinterpret_cast<char*>(buf.data()), static_cast<std::streamsize>(buf.size() * 4));
        for (int64_t r = 0; r < nr; ++r)
          for (int64_t c = 0; c < nc; ++c) t[static_cast<size_t>((r0 + r) * cols + c0 + c)] = buf[static_cast<size_t>(r * nc + c)];
      }
      all.insert(all.end(), t.begin(), t.end());  // an element no piece held stays NaN and fails any comparison
    }
    return all;
  }
  auto ts = read_safetensors(dir + "/model.safetensors");
  for (auto& [name, t] : ts) {
    const float* p = reinterpret_cast<const float*>(t.bytes.data());
    all.insert(all.end(), p, p + t.bytes.size() / 4);
  }
  return all;
}

using test::final_metrics;  // the final summary object of a metrics file

struct RunResult {
  std::vector<double> losses;
  std::vector<float> weights;  // final weights, every tensor concatenated (HF layout)
  nlohmann::json final;        // the metrics file's summary object
};

// A temporary directory with a small byte-level corpus, and runs of 8 training steps on it.
class ParityFixture : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("mt_par_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
    std::string text;
    for (int i = 0; i < 300; ++i) text += "to be or not to be, that is the question " + std::to_string(i % 11) + ";\n";
    std::vector<int32_t> toks(text.begin(), text.end());
    write_token_shard((dir_ / "train.bin").string(), toks);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  // 8 steps of gpt2-tiny (or what `extra` overrides) on `np` ranks (np = 1: a plain process).
  RunResult train(int np, int micro_batch, int accum, const std::string& tag, const std::string& extra = "") {
    std::string ck = (dir_ / ("ck_" + tag)).string(), m = (dir_ / ("m_" + tag + ".jsonl")).string();
    std::string args = std::string(" train --model.preset gpt2-tiny --data.train ") + (dir_ / "train.bin").string() +
                       " --data.val '' --train.steps 8 --train.warmup_steps 2 --train.lr 3e-3 --train.threads 1"
                       " --train.micro_batch " + std::to_string(micro_batch) + " --train.grad_accum " +
                       std::to_string(accum) + " --train.checkpoint_dir " + ck + " --log.metrics_out " + m +
                       " --parallel.bucket_mb 0.01 " + extra;  // tiny DDP buckets: several all-reduces per step
    std::string cmd = (np > 1 ? mpirun(np) : std::string("MESHTRAIN_MPI=0 ")) + MT_BINARY + args;
    RunOut r = run(cmd);
    EXPECT_EQ(r.code, 0) << cmd << "\n" << r.output;
    RunResult out;
    if (r.code != 0) return out;
    out.losses = losses(m);
    if (out.losses.empty()) return out;
    out.weights = weights(ck);
    out.final = final_metrics(m);
    return out;
  }
  std::filesystem::path dir_;
};

// The two runs' per-step losses side by side: printed, and written to
// <temp dir>/meshtrain-parity/<test name>.txt (never into the working directory or the repository):
// the first table of a test in this process rewrites the file, later ones append.
inline void loss_table(const std::string& what, const RunResult& a, const RunResult& b) {
  std::string out = "# " + what + "\nstep  reference       run             difference\n";
  for (size_t i = 0; i < a.losses.size() && i < b.losses.size(); ++i) {
    char line[128];
    std::snprintf(line, sizeof line, "%4zu  %.9f  %.9f  %+.3e\n", i + 1, a.losses[i], b.losses[i],
                  b.losses[i] - a.losses[i]);
    out += line;
  }
  std::printf("%s", out.c_str());
  static std::set<std::string> written;
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / "meshtrain-parity";
  std::filesystem::create_directories(dir);
  const std::string file = (dir / (std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()) + ".txt")).string();
  const bool fresh = written.insert(file).second;
  std::ofstream(file, fresh ? std::ios::trunc : std::ios::app) << out << "\n";
}

// Losses within loss_tol and weights within weight_tol (absolute), over 8 steps.
inline void expect_close(const RunResult& a, const RunResult& b, double loss_tol, double weight_tol, const std::string& what) {
  loss_table(what, a, b);
  ASSERT_EQ(a.losses.size(), 8u) << what;
  ASSERT_EQ(b.losses.size(), 8u) << what;
  double maxl = 0;
  for (size_t i = 0; i < a.losses.size(); ++i) {
    EXPECT_NEAR(a.losses[i], b.losses[i], loss_tol) << what << " step " << i + 1;
    maxl = std::max(maxl, std::abs(a.losses[i] - b.losses[i]));
  }
  ASSERT_EQ(a.weights.size(), b.weights.size());
  double maxd = 0;
  size_t nans = 0;
  for (size_t i = 0; i < a.weights.size(); ++i) {
    const double d = std::abs(static_cast<double>(a.weights[i]) - static_cast<double>(b.weights[i]));
    if (std::isnan(d)) ++nans;
    else maxd = std::max(maxd, d);
  }
  EXPECT_EQ(nans, 0u) << what << ": weights missing from a checkpoint";
  EXPECT_LT(maxd, weight_tol) << what << ": max weight difference " << maxd;
  std::printf("[%s] final loss %.6f vs %.6f, max |dloss| %.3g, max |dw| %.3g\n", what.c_str(), a.losses.back(),
              b.losses.back(), maxl, maxd);
}

}  // namespace mt
