// CPU offload of the optimizer state (train.offload = optimizer) against the same run with the
// optimizer on the device: losses, final weights and Adam moments; where the model state lives
// (device and host bytes by category) and the dry run's figures for it; the host waits per step.
// They run where a GPU is usable (a GPU, or the emulator build: CTest CudaEmu.TrainOffload);
// OffloadRefusal runs everywhere.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "../test_files.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/safetensors.h"
#include "data/token_shards.h"
#include "runtime/device.h"
#include "train/config.h"
#include "train/trainer.h"

namespace mt {
namespace {

using test::final_metrics;

using Overrides = std::vector<std::pair<std::string, std::string>>;

constexpr int kSteps = 6;

class GpuOffload : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!device_available(Device::CUDA, &why)) GTEST_SKIP() << "GPU offload test not run: " << why;
    std::string text;
    for (int i = 0; i < 300; ++i) text += "the quick brown fox jumps over the lazy dog " + std::to_string(i % 7) + "\n";
    std::vector<int32_t> toks(text.begin(), text.end());
    write_token_shard(tmp_.file("train.bin"), toks);
  }
  Overrides overrides(const std::string& offload, const Overrides& extra) {
    Overrides ov = {{"model.preset", "gpt2-tiny"}, {"data.train", tmp_.file("train.bin")},
                    {"data.val", ""},              {"train.steps", std::to_string(kSteps)},
                    {"train.micro_batch", "2"},    {"train.warmup_steps", "2"},
                    {"train.lr", "3e-3"},          {"train.eval_every", "0"},
                    {"train.threads", "1"},        {"log.print_every", "100"},
                    {"train.device", "cuda"},      {"train.offload", offload}};
    ov.insert(ov.end(), extra.begin(), extra.end());
    return ov;
  }
  RunConfig config(const std::string& offload, const Overrides& extra = {}) {
    return RunConfig::load("", overrides(offload, extra));
  }
  // Trains with the optimizer on the device and offloaded, each saving a full checkpoint at the
  // end; the losses and every saved tensor (weights and both moments) agree within `rel` of the
  // largest magnitude of their tensor.
  void expect_same_training(const Overrides& extra, double rel) {
    TrainResult r[2];
    std::string ck[2];
    const char* mode[2] = {"none", "optimizer"};
    for (int i = 0; i < 2; ++i) {
      ck[i] = tmp_.file(std::string("ck_") + mode[i]);
      Overrides ov = extra;
      ov.insert(ov.end(), {{"train.checkpoint_dir", ck[i]},
                           {"train.checkpoint_every", std::to_string(kSteps)},
                           {"train.checkpoint_format", "full"}});
      r[i] = train(config(mode[i], ov));
    }
    ASSERT_EQ(r[0].losses.size(), static_cast<size_t>(kSteps));
    ASSERT_EQ(r[1].losses.size(), r[0].losses.size());
    EXPECT_LT(r[0].losses.back(), r[0].losses.front() - 0.3);  // it trains
    double worst = 0;
    for (size_t s = 0; s < r[0].losses.size(); ++s) {
      EXPECT_NEAR(r[1].losses[s], r[0].losses[s], rel * std::abs(r[0].losses[s])) << "step " << s + 1;
      worst = std::max(worst, std::abs(r[1].losses[s] - r[0].losses[s]) / std::abs(r[0].losses[s]));
    }
    std::printf("loss: largest relative difference %.2e over %d steps (tolerance %.0e)\n", worst, kSteps, rel);
    for (const char* file : {"model.safetensors", "optimizer.safetensors"}) {
      const auto a = read_safetensors(resolve_checkpoint(ck[0]) + "/" + file);
      const auto b = read_safetensors(resolve_checkpoint(ck[1]) + "/" + file);
      ASSERT_EQ(a.size(), b.size()) << file;
      ASSERT_FALSE(a.empty()) << file;
      double worst_t = 0;
      size_t exact = 0, total = 0;
      for (const auto& [name, ta] : a) {
        ASSERT_TRUE(b.count(name)) << name;
        const SafeTensor& tb = b.at(name);
        ASSERT_EQ(ta.dtype, "F32") << name;
        ASSERT_EQ(ta.bytes.size(), tb.bytes.size()) << name;
        const size_t n = ta.bytes.size() / sizeof(float);
        std::vector<float> x(n), y(n);
        std::memcpy(x.data(), ta.bytes.data(), ta.bytes.size());
        std::memcpy(y.data(), tb.bytes.data(), tb.bytes.size());
        float scale = 0;
        for (float v : x) scale = std::max(scale, std::abs(v));
        double d = 0;
        for (size_t i = 0; i < n; ++i) {
          d = std::max(d, static_cast<double>(std::abs(x[i] - y[i])));
          exact += std::memcmp(&x[i], &y[i], sizeof(float)) == 0;
        }
        total += n;
        const double dr = scale > 0 ? d / scale : d;
        EXPECT_LE(dr, rel) << file << ": " << name << " differs by " << d << " (largest magnitude " << scale << ")";
        worst_t = std::max(worst_t, dr);
      }
      std::printf("%s: largest difference %.2e of its tensor's largest magnitude (tolerance %.0e); %zu of %zu values "
                  "bitwise equal\n",
                  file, worst_t, rel, exact, total);
    }
  }
  test::TestDir tmp_;
};

// The offloaded AdamW is the CPU's kernel, the device optimizer the CUDA kernel: the same formula
// (bias corrections computed alike), rounded differently (the emulated kernel fuses multiply-adds,
// the CPU's does not), so a few fp32 ulps per step; the tolerances are those of the CPU-against-GPU
// training tests (gpu_train_test.cpp).
constexpr double kFp32Rel = 1e-5;
constexpr double kBf16Rel = 2e-3;

TEST_F(GpuOffload, Gpt2Fp32MatchesTheDeviceOptimizer) {
  expect_same_training({{"train.grad_accum", "2"}}, kFp32Rel);
}

TEST_F(GpuOffload, LlamaBf16MatchesTheDeviceOptimizer) {
  expect_same_training({{"model.preset", "llama-tiny"}, {"train.dtype", "bf16"}}, kBf16Rel);
}

// A checkpoint holds the same tensors with and without offload: one saved by either resumes in the
// other and continues as the run that saved it did.
TEST_F(GpuOffload, CheckpointsResumeAcrossOffload) {
  for (const auto& [from, to] : {std::pair<std::string, std::string>{"optimizer", "none"}, {"none", "optimizer"}}) {
    SCOPED_TRACE("saved with offload " + from + ", resumed with " + to);
    const std::string ck = tmp_.file("ck_" + from);
    const TrainResult whole =
        train(config(from, {{"train.steps", "4"}, {"train.checkpoint_dir", ck}, {"train.checkpoint_every", "2"}}));
    const TrainResult resumed = train(config(to, {{"train.steps", "4"}, {"train.resume", ck + "/step_00000002"}}));
    ASSERT_EQ(whole.losses.size(), 4u);
    ASSERT_EQ(resumed.losses.size(), 2u);
    for (size_t i = 0; i < 2; ++i)
      EXPECT_NEAR(resumed.losses[i], whole.losses[i + 2], kFp32Rel * std::abs(whole.losses[i + 2])) << "step " << i + 3;
  }
}

// bf16: without offload the device holds bf16 weights, fp32 gradients and 12 bytes per element of
// optimizer state (fp32 master and moments); with it the device keeps the weights and gradients
// and the host the optimizer state, the gradient copies and the bf16 upload copy. The dry run
// (`train --dry-run`, the Meta device) counts the same bytes on both sides.
TEST_F(GpuOffload, StateMovesToHostAndTheDryRunCountsIt) {
  const Overrides bf = {{"train.dtype", "bf16"}, {"train.steps", "2"}};
  Overrides a = bf, b = bf;
  a.emplace_back("log.metrics_out", tmp_.file("none.jsonl"));
  b.emplace_back("log.metrics_out", tmp_.file("offload.jsonl"));
  train(config("none", a));
  train(config("optimizer", b));
  const nlohmann::json dev = final_metrics(tmp_.file("none.jsonl")), off = final_metrics(tmp_.file("offload.jsonl"));
  const int64_t F = off["flat_size"].get<int64_t>();
  ASSERT_GT(F, 0);
  const nlohmann::json &rd = dev["mem_resident_by_category"], &ro = off["mem_resident_by_category"];
  EXPECT_EQ(dev.value("offload", ""), "none");
  EXPECT_EQ(off.value("offload", ""), "optimizer");
  EXPECT_FALSE(dev.contains("mem_host_by_category"));
  EXPECT_EQ(rd["optimizer"].get<int64_t>(), 12 * F);
  EXPECT_EQ(ro["optimizer"].get<int64_t>(), 0);
  EXPECT_EQ(ro["params"].get<int64_t>(), rd["params"].get<int64_t>());
  EXPECT_EQ(ro["grads"].get<int64_t>(), rd["grads"].get<int64_t>());
  const nlohmann::json& host = off["mem_host_by_category"];
  EXPECT_EQ(host["optimizer"].get<int64_t>(), 12 * F);
  EXPECT_EQ(host["grads"].get<int64_t>(), 4 * F);
  EXPECT_EQ(host["params"].get<int64_t>(), 2 * F);

  // The dry run of the same job, in its own process (it replaces the world and the device).
  std::string cmd = std::string(MT_BINARY) + " train --dry-run --world 1 --rank 0";
  Overrides d = overrides("optimizer", bf);
  d.emplace_back("log.metrics_out", tmp_.file("dry.jsonl"));
  for (const auto& [k, v] : d) cmd += " --" + k + " '" + v + "'";
  cmd += " > " + tmp_.file("dry.log") + " 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  const nlohmann::json dry = final_metrics(tmp_.file("dry.jsonl"));
  ASSERT_TRUE(dry.value("dry_run", false)) << dry.dump();
  EXPECT_EQ(dry["mem_host_by_category"], host);
  for (const char* c : {"params", "grads", "optimizer"})
    EXPECT_EQ(dry["mem_resident_by_category"][c], ro[c]) << c;
}

// With offload a step waits for the GPU three times, whatever the gradient accumulation: the loss,
// the gradient norm and the gradient copies (the weights go back without a wait). Measured as the
// difference between a run of 4 steps and one of 1.
TEST_F(GpuOffload, HostWaitsThreeTimesPerStep) {
  auto waits = [&](int steps) {
    const uint64_t before = dev::host_syncs(Device::CUDA);
    train(config("optimizer", {{"train.steps", std::to_string(steps)}, {"train.grad_accum", "2"}}));
    return dev::host_syncs(Device::CUDA) - before;
  };
  const uint64_t one = waits(1), four = waits(4);
  EXPECT_EQ(four - one, 3u * 3u) << "host waits: " << one << " in a run of 1 step, " << four << " in one of 4";
}

// On the CPU the optimizer state is in host memory already: refused with that reason, before
// anything is built.
TEST(OffloadRefusal, CpuDeviceIsRefused) {
  try {
    train(RunConfig::load("", {{"model.preset", "gpt2-tiny"}, {"train.offload", "optimizer"},
                               {"data.train", "/nonexistent"}}));
    ADD_FAILURE() << "train.offload = optimizer was accepted on the CPU";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("already in host memory"), std::string::npos) << e.what();
  }
  try {
    train(RunConfig::load("", {{"model.preset", "gpt2-tiny"}, {"train.offload", "cpu"}, {"data.train", "/nonexistent"}}));
    ADD_FAILURE() << "train.offload = cpu was accepted";
  } catch (const ConfigError& e) {
    EXPECT_EQ(std::string(e.what()), "train.offload must be none or optimizer, got 'cpu'");
  }
}

}  // namespace
}  // namespace mt
