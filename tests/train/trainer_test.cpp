// End-to-end trainer checks on a tiny model: falling loss, determinism, exact resume, gradient
// accumulation equivalence, memory accounting, metrics keys, config errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <sys/wait.h>
#include <string>
#include <vector>

#include "../test_files.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/export.h"
#include "checkpoint/safetensors.h"
#include "data/token_shards.h"
#include "train/config.h"
#include "train/trainer.h"

namespace fs = std::filesystem;

namespace mt {
namespace {

// What `meshtrain export` does: the model comes from the checkpoint's own configuration.
ExportResult export_run(const std::string& checkpoint, const std::string& out, int64_t max_shard_bytes) {
  const std::string dir = resolve_checkpoint(checkpoint);
  return export_checkpoint(dir, load_checkpoint_config(dir).model_config(), out, max_shard_bytes);
}

class TrainerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string text;
    for (int i = 0; i < 400; ++i)
      text += "the quick brown fox jumps over the lazy dog " + std::to_string(i % 7) + "\n";
    std::vector<int32_t> toks(text.begin(), text.end());
    write_token_shard((dir_ / "train.bin").string(), toks);
    std::vector<int32_t> val(toks.begin(), toks.begin() + 2000);
    write_token_shard((dir_ / "val.bin").string(), val);
  }
  RunConfig config(std::vector<std::pair<std::string, std::string>> extra = {}) {
    std::vector<std::pair<std::string, std::string>> ov = {
        {"model.preset", "gpt2-tiny"},  {"data.train", (dir_ / "train.bin").string()},
        {"data.val", (dir_ / "val.bin").string()}, {"train.steps", "12"}, {"train.micro_batch", "4"},
        {"train.warmup_steps", "2"},    {"train.lr", "3e-3"},  {"train.eval_every", "6"},
        {"train.eval_batches", "2"},    {"train.threads", "1"}, {"log.print_every", "100"}};
    for (auto& e : extra) ov.push_back(e);
    return RunConfig::load("", ov);
  }
  test::TestDir tmp_;
  const fs::path& dir_ = tmp_.path;
};

TEST_F(TrainerTest, LossFallsAndRunIsDeterministic) {
  TrainResult a = train(config());
  ASSERT_EQ(a.losses.size(), 12u);
  EXPECT_LT(a.losses.back(), a.losses.front() - 0.5);
  EXPECT_EQ(a.val_losses.size(), 2u);
  TrainResult b = train(config());
  EXPECT_EQ(a.losses, b.losses);  // bit for bit
}

TEST_F(TrainerTest, ResumeReproducesUninterruptedRun) {
  auto ck = (dir_ / "ck").string();
  TrainResult full = train(config());
  train(config({{"train.steps", "12"}, {"train.checkpoint_dir", ck}, {"train.checkpoint_every", "5"}}));
  // Resume from step 5 (the saved run also wrote step 10 and 12; pick step 5 explicitly).
  TrainResult resumed = train(config({{"train.resume", ck + "/step_00000005"}}));
  ASSERT_EQ(resumed.losses.size(), 7u);
  for (size_t i = 0; i < 7; ++i) EXPECT_EQ(resumed.losses[i], full.losses[5 + i]) << "step " << 6 + i;
  EXPECT_TRUE(fs::exists(fs::path(ck) / "latest"));
}

// train.checkpoint_keep: only the newest N checkpoints stay; `latest` names the newest, and the run
// resumes from it.
TEST_F(TrainerTest, CheckpointKeepRemovesOlderCheckpoints) {
  auto ck = (dir_ / "ck").string();
  train(config({{"train.steps", "8"}, {"train.checkpoint_dir", ck}, {"train.checkpoint_every", "2"},
                {"train.checkpoint_keep", "2"}}));
  std::vector<std::string> left;
  for (const auto& e : fs::directory_iterator(ck)) left.push_back(e.path().filename().string());
  std::sort(left.begin(), left.end());
  EXPECT_EQ(left, (std::vector<std::string>{"latest", "step_00000006", "step_00000008"}));
  TrainResult more = train(config({{"train.steps", "10"}, {"train.checkpoint_dir", ck}, {"train.resume", "latest"}}));
  EXPECT_EQ(more.losses.size(), 2u);
}

// With data.shuffle the resumed run continues the same shuffled order (the loader replays its
// position), so it still reproduces the uninterrupted run exactly — across an epoch boundary too.
TEST_F(TrainerTest, ShuffledResumeReproducesUninterruptedRun) {
  auto ck = (dir_ / "ck").string();
  const std::vector<std::pair<std::string, std::string>> sh = {{"data.shuffle", "true"}, {"train.steps", "24"},
                                                               {"train.micro_batch", "32"}};  // 17 batches an epoch
  TrainResult plain = train(config({{"train.steps", "24"}, {"train.micro_batch", "32"}}));
  TrainResult full = train(config(sh));
  EXPECT_NE(full.losses, plain.losses);  // a different order of the same data
  auto v = sh;
  v.push_back({"train.checkpoint_dir", ck});
  v.push_back({"train.checkpoint_every", "7"});
  train(config(v));
  auto r = sh;
  r.push_back({"train.resume", ck + "/step_00000007"});
  TrainResult resumed = train(config(r));
  ASSERT_EQ(resumed.losses.size(), 17u);
  for (size_t i = 0; i < 17; ++i) EXPECT_EQ(resumed.losses[i], full.losses[7 + i]) << "step " << 8 + i;
}

// Regression: with vocab 123 (padded to 128) the MLP weight [4*32, 32] has as many rows as the padded vocabulary;
// only the vocabulary tables may lose their padding rows in a checkpoint.
TEST_F(TrainerTest, ResumeIsExactWhenAMatrixHasAsManyRowsAsTheVocabulary) {
  auto ck = (dir_ / "ck").string();
  std::vector<std::pair<std::string, std::string>> v = {{"model.vocab_size", "123"}};
  TrainResult full = train(config(v));
  v.push_back({"train.checkpoint_dir", ck});
  v.push_back({"train.checkpoint_every", "5"});
  train(config(v));
  TrainResult resumed = train(config({{"model.vocab_size", "123"}, {"train.resume", ck + "/step_00000005"}}));
  ASSERT_EQ(resumed.losses.size(), 7u);
  for (size_t i = 0; i < 7; ++i) EXPECT_EQ(resumed.losses[i], full.losses[5 + i]) << "step " << 6 + i;
}

// train.init_from starts from saved weights (a checkpoint, or its model.safetensors file) with fresh
// optimizer state at step 0. With lr 0 the weights stay as loaded, so the first evaluation gives
// the saved run's final validation loss exactly.
TEST_F(TrainerTest, InitFromStartsFromSavedWeights) {
  auto ck = (dir_ / "ck").string();
  TrainResult a = train(config({{"train.steps", "6"}, {"train.checkpoint_dir", ck}}));
  export_run(ck, (dir_ / "hf").string(), int64_t{1} << 40);  // the same weights as one safetensors file
  for (const std::string& src : {ck, (dir_ / "hf" / "model.safetensors").string()}) {
    SCOPED_TRACE(src);
    TrainResult b = train(config({{"train.steps", "1"}, {"train.lr", "0"}, {"train.init_from", src}}));
    ASSERT_EQ(b.losses.size(), 1u);
    ASSERT_EQ(b.val_losses.size(), 1u);
    EXPECT_EQ(b.val_losses[0], a.final_val_loss);
    EXPECT_LT(b.losses[0], a.losses[0] - 0.3);  // well below a fresh model's first loss
  }
  // A restartable fine-tuning job sets both: its first launch (no checkpoint yet) starts from
  // init_from, a relaunch resumes from its own latest checkpoint.
  const std::string ck2 = (dir_ / "ck2").string();
  std::vector<std::pair<std::string, std::string>> job = {
      {"train.lr", "0"}, {"train.init_from", ck}, {"train.resume", "latest"}, {"train.checkpoint_dir", ck2}};
  job.push_back({"train.steps", "1"});
  TrainResult first = train(config(job));
  ASSERT_EQ(first.val_losses.size(), 1u);
  EXPECT_EQ(first.val_losses[0], a.final_val_loss);
  job.back().second = "3";
  TrainResult again = train(config(job));
  EXPECT_EQ(again.losses.size(), 2u);  // steps 2 and 3: resumed at step 1
  // Weights of another shape: the error names the file and the tensor.
  try {
    train(config({{"model.n_embd", "64"}, {"train.init_from", ck}}));
    ADD_FAILURE() << "no error";
  } catch (const std::exception& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("metadata.json"), std::string::npos) << m;
    EXPECT_NE(m.find("wte.weight"), std::string::npos) << m;
  }
}

TEST_F(TrainerTest, GradientAccumulationMatchesLargeBatch) {
  TrainResult big = train(config({{"train.micro_batch", "4"}, {"train.grad_accum", "1"}}));
  TrainResult acc = train(config({{"train.micro_batch", "1"}, {"train.grad_accum", "4"}}));
  ASSERT_EQ(big.losses.size(), acc.losses.size());
  // Same tokens per step; only the order of the gradient sums differs (fp32 rounding).
  for (size_t i = 0; i < big.losses.size(); ++i) EXPECT_NEAR(big.losses[i], acc.losses[i], 1e-4) << "step " << i + 1;
}

TEST_F(TrainerTest, MetricsFileHasTheInterfaceKeys) {
  auto path = (dir_ / "m.jsonl").string();
  train(config({{"log.metrics_out", path}, {"log.peak_flops", "1e11"}}));
  std::ifstream f(path);
  std::string line;
  int steps = 0;
  nlohmann::json last;
  while (std::getline(f, line)) {
    auto j = nlohmann::json::parse(line);
    if (j.contains("final")) {
      last = j;
      continue;
    }
    ++steps;
    for (const char* k : {"step", "loss", "lr", "tokens_per_s", "step_ms", "mfu", "mem_peak_bytes", "comm_ms",
                          "exposed_comm_ms"})
      EXPECT_TRUE(j.contains(k)) << k;
    EXPECT_TRUE(j["mfu"].is_number());
  }
  EXPECT_EQ(steps, 12);
  ASSERT_TRUE(last.is_object());
  for (const char* k : {"mem_peak_by_category", "mem_resident_by_category", "comm_bytes_by_group", "tokens_per_s"})
    EXPECT_TRUE(last.contains(k)) << k;
  // Model state in fp32: params 4 bytes, grads 4 bytes, AdamW moments 8 bytes per parameter.
  int64_t P = last["num_params"];
  EXPECT_EQ(last["mem_resident_by_category"]["params"].get<int64_t>(), 4 * P);
  EXPECT_EQ(last["mem_resident_by_category"]["grads"].get<int64_t>(), 4 * P);
  EXPECT_EQ(last["mem_resident_by_category"]["optimizer"].get<int64_t>(), 8 * P);
  EXPECT_GT(last["mem_peak_by_category"]["activations"].get<int64_t>(), 0);
}

TEST_F(TrainerTest, ChromeTraceHasEveryUnitOfEveryStep) {
  auto path = (dir_ / "trace.json").string();
  train(config({{"log.trace_out", path}, {"train.steps", "3"}}));
  std::ifstream f((dir_ / "trace.rank0.json").string());
  ASSERT_TRUE(f.good()) << "no per-rank trace file";
  auto j = nlohmann::json::parse(f);
  int fwd = 0, bwd = 0, steps = 0;
  for (const auto& e : j["traceEvents"]) {
    std::string n = e["name"];
    if (e["ph"] != "X") continue;
    EXPECT_GE(e["dur"].get<int64_t>(), 0);
    fwd += n.rfind("forward ", 0) == 0;
    bwd += n.rfind("backward ", 0) == 0;
    steps += n.rfind("step ", 0) == 0;
  }
  EXPECT_EQ(steps, 3);
  EXPECT_EQ(bwd, 3 * 4);       // gpt2-tiny: embedding, 2 blocks, head
  EXPECT_GE(fwd, 3 * 4);       // plus the evaluation forwards
}

// data.train as a blend of two datasets: every step's metrics (and the final object) count the
// tokens seen per dataset; the checkpoint stores the blend loader's state and a resumed run
// continues with exactly the uninterrupted run's batches (hence its losses, bit for bit).
TEST_F(TrainerTest, BlendedDataResumesExactlyAndCountsTokensPerDataset) {
  std::string other;
  for (int i = 0; i < 300; ++i) other += "pack my box with five dozen liquor jugs " + std::to_string(i % 5) + "\n";
  write_token_shard((dir_ / "other.bin").string(), std::vector<int32_t>(other.begin(), other.end()));
  const std::string a = (dir_ / "train.bin").string(), b = (dir_ / "other.bin").string();
  const std::string spec = "0.75:" + a + ",0.25:" + b;
  const auto m1 = (dir_ / "m1.jsonl").string(), ck = (dir_ / "ck").string();
  TrainResult full = train(config({{"data.train", spec}, {"log.metrics_out", m1}}));
  TrainResult plain = train(config());
  EXPECT_NE(full.losses, plain.losses);
  std::ifstream f(m1);
  std::string line;
  int steps = 0;
  nlohmann::json last;
  while (std::getline(f, line)) {
    auto j = nlohmann::json::parse(line);
    if (j.contains("final")) {
      last = j;
      continue;
    }
    ++steps;
    ASSERT_TRUE(j.contains("data_tokens_by_dataset")) << line;
    const auto& d = j["data_tokens_by_dataset"];
    ASSERT_EQ(d.size(), 2u);
    EXPECT_EQ(d[a].get<int64_t>() + d[b].get<int64_t>(), steps * 4 * 32) << line;  // B x T per step
  }
  EXPECT_EQ(steps, 12);
  ASSERT_TRUE(last.contains("data_tokens_by_dataset"));
  EXPECT_GT(last["data_tokens_by_dataset"][a].get<int64_t>(), last["data_tokens_by_dataset"][b].get<int64_t>());

  train(config({{"data.train", spec}, {"train.checkpoint_dir", ck}, {"train.checkpoint_every", "5"}}));
  auto tj = nlohmann::json::parse(std::ifstream(ck + "/step_00000005/trainer.json"));
  ASSERT_TRUE(tj.contains("data")) << tj.dump();
  EXPECT_EQ(tj["data"]["samples"].get<int64_t>(), 5 * 4);
  EXPECT_EQ(tj["data"]["datasets"][0]["samples"].get<int64_t>() + tj["data"]["datasets"][1]["samples"].get<int64_t>(),
            5 * 4);
  TrainResult resumed = train(config({{"data.train", spec}, {"train.resume", ck + "/step_00000005"}}));
  ASSERT_EQ(resumed.losses.size(), 7u);
  for (size_t i = 0; i < 7; ++i) EXPECT_EQ(resumed.losses[i], full.losses[5 + i]) << "step " << 6 + i;

  // A plain data.train writes neither the metrics key nor a blend state.
  const auto m2 = (dir_ / "m2.jsonl").string(), ck2 = (dir_ / "ck2").string();
  train(config({{"train.steps", "2"}, {"log.metrics_out", m2}, {"train.checkpoint_dir", ck2}}));
  std::ifstream g(m2);
  while (std::getline(g, line)) EXPECT_EQ(line.find("data_tokens_by_dataset"), std::string::npos) << line;
  EXPECT_FALSE(nlohmann::json::parse(std::ifstream(ck2 + "/step_00000002/trainer.json")).contains("data"));
}

TEST_F(TrainerTest, BadBlendsNameTheKey) {
  const std::string a = (dir_ / "train.bin").string();
  try {
    train(config({{"data.train", "0:" + a + ",1:" + a + "x"}}));
    ADD_FAILURE() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("data.train: blend entry 1"), std::string::npos) << e.what();
  }
  try {
    train(config({{"data.val", "0.5:" + a + ",0.5:" + (dir_ / "nope/*.bin").string()}}));
    ADD_FAILURE() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("data.val: blend entry 2"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("no file matches"), std::string::npos) << e.what();
  }
}

// model.hf_config: the architecture, dimensions, norm epsilon and position table come from the
// config.json, explicit model.* keys override; a GPT-2 with a 64-row position table trains at
// seq_len 32 and its checkpoint (64 rows, the config.json alongside) initialises a seq_len 16 run.
TEST_F(TrainerTest, HfConfigSetsTheModelAndKeysOverride) {
  const std::string cfg = (dir_ / "config.json").string();
  std::ofstream(cfg) << R"({"model_type":"gpt2","n_embd":32,"n_layer":2,"n_head":2,"n_positions":64,
                             "vocab_size":256,"layer_norm_epsilon":1e-6})";
  ModelConfig m = config({{"model.hf_config", cfg}, {"model.seq_len", "32"}}).model_config();
  EXPECT_EQ(m.arch, Arch::GPT2);
  EXPECT_EQ(m.max_position, 64);
  EXPECT_EQ(m.seq_len, 32);
  EXPECT_FLOAT_EQ(m.norm_eps, 1e-6f);
  ModelConfig o = config({{"model.hf_config", cfg}, {"model.n_layer", "1"}, {"model.norm_eps", "1e-3"}}).model_config();
  EXPECT_EQ(o.n_layer, 1);
  EXPECT_FLOAT_EQ(o.norm_eps, 1e-3f);
  // A preset's position table still follows seq_len.
  EXPECT_EQ(config({{"model.seq_len", "16"}}).model_config().max_position, 16);

  const auto ck = (dir_ / "ck").string();
  train(config({{"model.hf_config", cfg}, {"train.steps", "3"}, {"train.checkpoint_dir", ck}}));
  const auto meta = nlohmann::json::parse(std::ifstream(ck + "/step_00000003/metadata.json"));
  ASSERT_TRUE(meta["tensors"].contains("wpe.weight"));
  EXPECT_EQ(meta["tensors"]["wpe.weight"]["shape"].get<std::vector<int64_t>>(), (std::vector<int64_t>{64, 32}));
  EXPECT_TRUE(fs::exists(ck + "/step_00000003/hf_config.json"));
  TrainResult r = train(config({{"model.hf_config", cfg}, {"model.seq_len", "16"}, {"train.steps", "2"},
                                {"train.init_from", ck}}));
  TrainResult fresh = train(config({{"model.hf_config", cfg}, {"model.seq_len", "16"}, {"train.steps", "1"}}));
  ASSERT_EQ(r.losses.size(), 2u);
  EXPECT_LT(r.losses[0], fresh.losses[0]);  // it starts from the trained weights

  try {
    config({{"model.hf_config", (dir_ / "none.json").string()}}).model_config();
    ADD_FAILURE();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("model.hf_config"), std::string::npos) << e.what();
  }
  std::ofstream(cfg) << R"({"model_type":"llama","hidden_size":32,"intermediate_size":64,"num_hidden_layers":1,
                             "num_attention_heads":2,"vocab_size":256,"num_local_experts":4})";
  try {
    config({{"model.hf_config", cfg}}).model_config();
    ADD_FAILURE();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("num_local_experts"), std::string::npos) << e.what();
  }
}

// meshtrain export: config.json and HF-named safetensors (sharded with an index when asked), whose
// weights start a run exactly where the checkpoint does. A tied Llama 3.1-style model (scaled rope).
TEST_F(TrainerTest, ExportWritesAHuggingFaceDirectory) {
  const std::string cfg = (dir_ / "config.json").string();
  std::ofstream(cfg) << R"({"model_type":"llama","hidden_size":32,"intermediate_size":64,"num_hidden_layers":2,
      "num_attention_heads":4,"num_key_value_heads":2,"vocab_size":256,"max_position_embeddings":64,
      "rms_norm_eps":1e-5,"rope_theta":10000.0,"tie_word_embeddings":true,
      "rope_scaling":{"rope_type":"llama3","factor":4.0,"low_freq_factor":1.0,"high_freq_factor":4.0,
                      "original_max_position_embeddings":16}})";
  const auto ck = (dir_ / "ck").string(), out = (dir_ / "hf").string();
  const auto hf = std::vector<std::pair<std::string, std::string>>{{"model.hf_config", cfg}};
  auto with = [&](std::vector<std::pair<std::string, std::string>> more) {
    auto v = hf;
    v.insert(v.end(), more.begin(), more.end());
    return config(v);
  };
  TrainResult t = train(with({{"train.steps", "3"}, {"train.checkpoint_dir", ck}}));
  EXPECT_LT(t.losses.back(), t.losses.front());
  ExportResult sharded = export_run(ck, out, 1);  // every tensor its own shard
  const int64_t n_params = 1 + 2 * 9 + 1;               // embedding, 9 per block, final norm; tied: no lm_head
  EXPECT_EQ(sharded.tensors, n_params);
  EXPECT_EQ(sharded.files, n_params);
  auto index = nlohmann::json::parse(std::ifstream(out + "/model.safetensors.index.json"));
  EXPECT_EQ(index["weight_map"].size(), static_cast<size_t>(n_params));
  EXPECT_FALSE(index["weight_map"].contains("lm_head.weight"));
  EXPECT_EQ(index["weight_map"]["model.embed_tokens.weight"], "model-00001-of-00020.safetensors");
  ExportResult one = export_run(ck, out, int64_t{5} << 30);
  EXPECT_EQ(one.files, 1);
  EXPECT_FALSE(fs::exists(out + "/model.safetensors.index.json"));
  auto cj = nlohmann::json::parse(std::ifstream(out + "/config.json"));
  EXPECT_EQ(cj["architectures"][0], "LlamaForCausalLM");
  EXPECT_EQ(cj["tie_word_embeddings"], true);
  EXPECT_EQ(cj["rope_scaling"]["rope_type"], "llama3");
  EXPECT_EQ(cj["num_key_value_heads"], 2);
  // The exported weights are the checkpoint's.
  TrainResult a = train(with({{"train.steps", "1"}, {"train.lr", "0"}, {"train.init_from", ck}}));
  TrainResult b = train(with({{"train.steps", "1"}, {"train.lr", "0"}, {"train.init_from", out + "/model.safetensors"}}));
  EXPECT_EQ(a.losses, b.losses);
  EXPECT_THROW(export_run((dir_ / "nothing").string(), out, 1), std::runtime_error);
}

// train.eval_at_start: a validation loss before the first step, in the final metrics object.
TEST_F(TrainerTest, EvalAtStartReportsTheInitialValidationLoss) {
  auto path = (dir_ / "m.jsonl").string();
  TrainResult r = train(config({{"train.eval_at_start", "true"}, {"log.metrics_out", path}}));
  std::ifstream f(path);
  std::string line, last;
  while (std::getline(f, line)) last = line;
  auto j = nlohmann::json::parse(last);
  ASSERT_TRUE(j.contains("val_loss_start")) << last;
  EXPECT_GT(j["val_loss_start"].get<double>(), r.final_val_loss + 0.3);
  EXPECT_EQ(r.losses, train(config()).losses);  // evaluating first does not change training
  // Without periodic evaluation (eval_every 0) the loss before training is still measured, and only it.
  TrainResult s = train(config({{"train.eval_at_start", "true"}, {"train.eval_every", "0"}, {"log.metrics_out", path}}));
  std::ifstream g(path);
  for (last.clear(); std::getline(g, line);) last = line;
  auto k = nlohmann::json::parse(last);
  ASSERT_TRUE(k.contains("val_loss_start")) << last;
  EXPECT_EQ(k["val_loss_start"].get<double>(), j["val_loss_start"].get<double>());
  EXPECT_TRUE(s.val_losses.empty());
  EXPECT_EQ(s.losses, r.losses);
}

// On the CPU model.attention_kernel = auto is the reference kernel (the run is unchanged, bit for
// bit); flash attends with bf16 q, k, v (the CPU's bf16 attention ops), a different rounding that
// trains as closely as bf16 allows.
TEST_F(TrainerTest, AttentionKernelChoiceOnTheCpu) {
  const std::vector<std::pair<std::string, std::string>> bf = {{"train.dtype", "bf16"}, {"train.eval_every", "0"}};
  auto with = [&](const char* kernel) {
    auto ov = bf;
    ov.emplace_back("model.attention_kernel", kernel);
    return train(config(ov)).losses;
  };
  const std::vector<double> automatic = train(config(bf)).losses, ref = with("reference"), flash = with("flash");
  EXPECT_EQ(automatic, ref);
  ASSERT_EQ(flash.size(), ref.size());
  EXPECT_NE(flash, ref);
  for (size_t i = 0; i < ref.size(); ++i) EXPECT_NEAR(flash[i], ref[i], 2e-3 * ref[i]) << "step " << i + 1;
}

// Each step's gradient norm in a metrics file (AdamW is blind to a gradient's scale; the norm is not).
std::vector<double> step_grad_norms(const std::string& metrics) {
  std::vector<double> norms;
  std::ifstream f(metrics);
  std::string line;
  while (std::getline(f, line)) {
    if (line.empty()) continue;
    const auto j = nlohmann::json::parse(line);
    if (j.contains("step") && j.contains("grad_norm")) norms.push_back(j["grad_norm"].get<double>());
  }
  return norms;
}

// On the CPU model.mlp_kernel = auto is the unfused MLP (the run is unchanged, bit for bit); fused
// runs the bf16 MLP with its pre-activations kept in bf16 (GPT-2: the CPU's forms of the
// fused-epilogue ops; Llama: bf16 gate and up, the bf16 SwiGLU ops), a different rounding that
// trains as closely as bf16 allows.
void mlp_kernel_choice(const std::filesystem::path& dir,
                       const std::function<RunConfig(std::vector<std::pair<std::string, std::string>>)>& config,
                       const char* preset) {
  const std::vector<std::pair<std::string, std::string>> bf = {
      {"train.dtype", "bf16"}, {"train.eval_every", "0"}, {"model.preset", preset}};
  // Each step's loss and gradient norm.
  auto with = [&](const char* kernel, std::vector<double>* norms) {
    auto ov = bf;
    if (kernel) ov.emplace_back("model.mlp_kernel", kernel);
    const std::string out = (dir / (std::string(preset) + "-" + (kernel ? kernel : "auto") + ".jsonl")).string();
    ov.emplace_back("log.metrics_out", out);
    const std::vector<double> losses = train(config(ov)).losses;
    *norms = step_grad_norms(out);
    return losses;
  };
  std::vector<double> na, np, nf;
  const std::vector<double> automatic = with(nullptr, &na), plain = with("unfused", &np), fused = with("fused", &nf);
  EXPECT_EQ(automatic, plain);
  EXPECT_EQ(na, np);
  ASSERT_EQ(fused.size(), plain.size());
  ASSERT_EQ(nf.size(), plain.size());
  EXPECT_NE(fused, plain);
  double worst = 0;
  for (size_t i = 0; i < plain.size(); ++i) {
    EXPECT_NEAR(fused[i], plain[i], 2e-3 * plain[i]) << "loss, step " << i + 1;
    EXPECT_NEAR(nf[i], np[i], 2e-3 * np[i]) << "gradient norm, step " << i + 1;
    worst = std::max(worst, std::abs(nf[i] - np[i]) / np[i]);
  }
  std::printf("%s: gradient norm, fused against unfused MLP: largest relative difference %.2e\n", preset, worst);
}

TEST_F(TrainerTest, MlpKernelChoiceOnTheCpu) {
  mlp_kernel_choice(dir_, [&](auto ov) { return config(std::move(ov)); }, "gpt2-tiny");
}
TEST_F(TrainerTest, MlpKernelChoiceOnTheCpuLlama) {
  mlp_kernel_choice(dir_, [&](auto ov) { return config(std::move(ov)); }, "llama-tiny");
}

// model.residual_dtype on the CPU: auto is the fp32 residual stream (the run is unchanged, bit for
// bit); bf16 keeps the stream between blocks and after attention in bf16 (each add rounded once, the
// norms reading bf16), a different rounding that trains as closely as bf16 allows: every loss within
// 2e-3 relative of the fp32 stream's, every gradient norm within 1e-2 (at most 9.5e-5 and 2.0e-3
// here; the norms move more, most in the mixture of experts, where a rounding can change a routing
// choice), for GPT-2 (LayerNorm), Llama (RMSNorm, with full recompute: the recomputed block reads
// the bf16 stream it saved) and a Llama mixture of experts (4 experts, top-2, a shared expert;
// selective recompute).
TEST_F(TrainerTest, Bf16ResidualOnTheCpu) {
  using Ov = std::vector<std::pair<std::string, std::string>>;
  auto run = [&](const std::string& name, Ov ov, const char* res, std::vector<double>* norms) {
    ov.insert(ov.end(), {{"train.dtype", "bf16"}, {"train.eval_every", "0"}});
    if (res) ov.emplace_back("model.residual_dtype", res);
    const std::string out = (dir_ / (name + (res ? res : "auto") + ".jsonl")).string();
    ov.emplace_back("log.metrics_out", out);
    const std::vector<double> losses = train(config(ov)).losses;
    *norms = step_grad_norms(out);
    return losses;
  };
  const std::vector<std::pair<std::string, Ov>> runs = {
      {"gpt2", {{"model.preset", "gpt2-tiny"}}},
      {"llama, full recompute", {{"model.preset", "llama-tiny"}, {"train.activation_checkpointing", "full"}}},
      {"llama moe, selective recompute",
       {{"model.preset", "llama-tiny"}, {"model.moe_experts", "4"}, {"model.moe_top_k", "2"},
        {"model.moe_shared_experts", "1"}, {"train.activation_checkpointing", "selective"}}}};
  for (size_t r = 0; r < runs.size(); ++r) {
    const std::string& what = runs[r].first;
    const std::string name = "res" + std::to_string(r);
    std::vector<double> na, n32, n16;
    const std::vector<double> automatic = run(name, runs[r].second, nullptr, &na),
                              f32 = run(name, runs[r].second, "fp32", &n32),
                              b16 = run(name, runs[r].second, "bf16", &n16);
    EXPECT_EQ(automatic, f32) << what;
    EXPECT_EQ(na, n32) << what;
    ASSERT_EQ(b16.size(), f32.size());
    ASSERT_EQ(n16.size(), n32.size());
    EXPECT_NE(b16, f32) << what << ": model.residual_dtype = bf16 made no difference";
    EXPECT_LT(b16.back(), b16.front() - 0.3) << what;  // it trains
    double worst_loss = 0, worst_norm = 0;
    for (size_t i = 0; i < f32.size(); ++i) {
      EXPECT_NEAR(b16[i], f32[i], 2e-3 * f32[i]) << what << ", loss, step " << i + 1;
      EXPECT_NEAR(n16[i], n32[i], 1e-2 * n32[i]) << what << ", gradient norm, step " << i + 1;
      worst_loss = std::max(worst_loss, std::abs(b16[i] - f32[i]) / f32[i]);
      worst_norm = std::max(worst_norm, std::abs(n16[i] - n32[i]) / n32[i]);
    }
    std::printf("%s, bf16 against fp32 residual: largest relative difference %.2e (loss), %.2e (gradient norm)\n",
                what.c_str(), worst_loss, worst_norm);
  }
}

// model.logits_dtype on the CPU: auto is fp32 logits (the run is unchanged, bit for bit, validation
// included); bf16 has the head GEMM round the logits to bf16 and the loss write their gradient in
// bf16 over them, which trains as closely as bf16 allows: every training and validation loss within
// 2e-3 relative of the fp32 logits' run, every gradient norm within 1e-2, for GPT-2 (tied head,
// padded vocabulary) and Llama (untied head).
TEST_F(TrainerTest, Bf16LogitsOnTheCpu) {
  using Ov = std::vector<std::pair<std::string, std::string>>;
  auto run = [&](const std::string& name, Ov ov, const char* lg, std::vector<double>* norms) {
    ov.insert(ov.end(), {{"train.dtype", "bf16"}, {"train.eval_every", "4"}});
    if (lg) ov.emplace_back("model.logits_dtype", lg);
    const std::string out = (dir_ / (name + (lg ? lg : "auto") + ".jsonl")).string();
    ov.emplace_back("log.metrics_out", out);
    const TrainResult r = train(config(ov));
    *norms = step_grad_norms(out);
    std::vector<double> losses = r.losses;
    losses.insert(losses.end(), r.val_losses.begin(), r.val_losses.end());
    return std::make_pair(losses, r.losses.size());
  };
  const std::vector<std::pair<std::string, Ov>> runs = {{"gpt2", {{"model.preset", "gpt2-tiny"}}},
                                                        {"llama", {{"model.preset", "llama-tiny"}}}};
  for (size_t r = 0; r < runs.size(); ++r) {
    const std::string& what = runs[r].first;
    const std::string name = "logits" + std::to_string(r);
    std::vector<double> na, n32, n16;
    const auto [automatic, steps] = run(name, runs[r].second, nullptr, &na);
    const auto f32 = run(name, runs[r].second, "fp32", &n32).first, b16 = run(name, runs[r].second, "bf16", &n16).first;
    EXPECT_EQ(automatic, f32) << what;
    EXPECT_EQ(na, n32) << what;
    ASSERT_EQ(b16.size(), f32.size());
    ASSERT_GT(f32.size(), steps) << what << ": no validation loss";
    ASSERT_EQ(n16.size(), n32.size());
    EXPECT_NE(b16, f32) << what << ": model.logits_dtype = bf16 made no difference";
    EXPECT_LT(b16[steps - 1], b16.front() - 0.3) << what;  // it trains
    double worst_loss = 0, worst_norm = 0;
    for (size_t i = 0; i < f32.size(); ++i) {
      EXPECT_NEAR(b16[i], f32[i], 2e-3 * f32[i]) << what << ", loss " << i + 1 << (i < steps ? " (training)" : " (validation)");
      worst_loss = std::max(worst_loss, std::abs(b16[i] - f32[i]) / f32[i]);
    }
    for (size_t i = 0; i < n32.size(); ++i) {
      EXPECT_NEAR(n16[i], n32[i], 1e-2 * n32[i]) << what << ", gradient norm, step " << i + 1;
      worst_norm = std::max(worst_norm, std::abs(n16[i] - n32[i]) / n32[i]);
    }
    std::printf("%s, bf16 against fp32 logits: largest relative difference %.2e (loss), %.2e (gradient norm)\n",
                what.c_str(), worst_loss, worst_norm);
  }
}

// model.logits_dtype = bf16 where the whole vocabulary's logits are not on one rank (tensor
// parallelism: a dry run of 2 ranks) is refused with one line naming the key, exit code 2; auto is
// fp32 logits there (the dry run goes through).
TEST_F(TrainerTest, Bf16LogitsRefusedWithTensorParallelism) {
  for (const char* lg : {"bf16", "auto"}) {
    const std::string log = (dir_ / "refused.log").string();
    const std::string cmd = std::string(MT_BINARY) + " train --dry-run --world 2 --rank 0 --model.preset gpt2-tiny" +
                            " --data.train " + (dir_ / "train.bin").string() + " --data.val ''" +
                            " --train.steps 1 --train.dtype bf16 --train.device cuda --parallel.tp 2" +
                            " --model.logits_dtype " + lg + " > " + log + " 2>&1";
    const int rc = std::system(cmd.c_str());
    std::ifstream f(log);
    const std::string out((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    if (std::string(lg) == "bf16") {
      ASSERT_TRUE(WIFEXITED(rc)) << cmd;
      EXPECT_EQ(WEXITSTATUS(rc), 2) << out;
      EXPECT_NE(out.find("model.logits_dtype = bf16 needs the whole vocabulary's logits on one rank"), std::string::npos)
          << out;
    } else {
      EXPECT_EQ(rc, 0) << out;
    }
  }
}

// With tensor, pipeline or context parallelism model.residual_dtype = bf16 is refused with one line
// naming the key (exit code 2, a configuration error; checked in dry runs of 2 ranks), and auto is
// the fp32 stream there (the dry run goes through).
TEST_F(TrainerTest, Bf16ResidualRefusedWithModelParallelism) {
  for (const char* par : {"parallel.tp", "parallel.pp", "parallel.cp"})
    for (const char* res : {"bf16", "auto"}) {
      const std::string log = (dir_ / "refused.log").string();
      const std::string cmd = std::string(MT_BINARY) + " train --dry-run --world 2 --rank 0 --model.preset gpt2-tiny" +
                              " --data.train " + (dir_ / "train.bin").string() + " --data.val ''" +
                              " --train.steps 1 --train.dtype bf16 --train.device cuda --" + par + " 2" +
                              " --model.residual_dtype " + res + " > " + log + " 2>&1";
      const int rc = std::system(cmd.c_str());
      std::ifstream f(log);
      const std::string out((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
      if (std::string(res) == "bf16") {
        ASSERT_TRUE(WIFEXITED(rc)) << cmd;
        EXPECT_EQ(WEXITSTATUS(rc), 2) << par << "\n" << out;
        EXPECT_NE(out.find("model.residual_dtype = bf16 runs with one model-parallel rank"), std::string::npos)
            << par << "\n" << out;
      } else {
        EXPECT_EQ(rc, 0) << par << "\n" << out;
      }
    }
}

TEST_F(TrainerTest, ConfigErrorsNameTheKey) {
  auto expect_error = [&](std::vector<std::pair<std::string, std::string>> ov, const std::string& needle) {
    try {
      train(config(ov));
      ADD_FAILURE() << "no error for " << needle;
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error({{"model.n_head", "3"}}, "n_head");
  expect_error({{"train.dtype", "fp8"}}, "train.dtype");
  expect_error({{"train.dtype", "i32"}}, "train.dtype must be fp32 or bf16");  // a dtype, not a compute type
  expect_error({{"train.device", "tpu"}}, "train.device must be cpu or cuda");
  // cuda where it cannot be used: why (no CUDA build, no GPU). Training on it: gpu_train_test.cpp.
  std::string why;
  if (!device_available(Device::CUDA, &why)) expect_error({{"train.device", "cuda"}}, "train.device = cuda: " + why);
  expect_error({{"parallel.strategy", "BOGUS"}},
               "parallel.strategy must be one of NO_SHARD, ZERO1, SHARD_GRAD_OP, FULL_SHARD, HYBRID_SHARD, "
               "HYBRID_SHARD_ZERO2; got 'BOGUS'");
  expect_error({{"train.activation_checkpointing", "some"}},
               "train.activation_checkpointing must be one of none, full, selective; got 'some'");
  expect_error({{"data.train", (dir_ / "missing*.bin").string()}}, "missing");
  expect_error({{"model.attention_kernel", "fast"}}, "model.attention_kernel must be auto, flash or reference");
  expect_error({{"model.attention_kernel", "flash"}}, "model.attention_kernel = flash takes bf16 q, k, v");
  expect_error({{"model.mlp_kernel", "fast"}}, "model.mlp_kernel must be auto, fused or unfused");
  expect_error({{"model.mlp_kernel", "fused"}}, "model.mlp_kernel = fused keeps the MLP's activations in bf16");
  expect_error({{"model.mlp_kernel", "fused"}, {"train.dtype", "bf16"}, {"lora.rank", "4"}},
               "model.mlp_kernel = fused runs without tensor or pipeline parallelism and without LoRA");
  expect_error({{"model.residual_dtype", "fp16"}}, "model.residual_dtype must be auto, fp32 or bf16");
  expect_error({{"model.residual_dtype", "bf16"}}, "model.residual_dtype = bf16 needs bf16 compute");
  expect_error({{"model.logits_dtype", "fp16"}}, "model.logits_dtype must be auto, fp32 or bf16");
  expect_error({{"model.logits_dtype", "bf16"}}, "model.logits_dtype = bf16 needs bf16 compute");
  expect_error({{"model.logits_dtype", "bf16"}, {"train.dtype", "bf16"}, {"train.loss_chunk_tokens", "16"}},
               "model.logits_dtype = bf16 needs the whole vocabulary's logits on one rank");
  EXPECT_THROW(RunConfig::load("", {{"train.stepz", "1"}}), ConfigError);
  EXPECT_THROW(RunConfig::load("", {{"train.steps", "ten"}}), ConfigError);
}

TEST_F(TrainerTest, TomlFileAndOverrides) {
  auto path = dir_ / "run.toml";
  std::ofstream(path) << "[model]\npreset = \"llama-tiny\"\n[train]\nsteps = 3\nlr = 1e-3\n";
  RunConfig c = RunConfig::load(path.string(), {{"train.steps", "5"}});
  EXPECT_EQ(c.model.preset, "llama-tiny");
  EXPECT_EQ(c.train.steps, 5);
  EXPECT_DOUBLE_EQ(c.train.lr, 1e-3);
  std::ofstream(path) << "[train]\nsteps = \"many\"\n";
  try {
    RunConfig::load(path.string(), {});
    ADD_FAILURE();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("train.steps"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("run.toml"), std::string::npos);
  }
}

}  // namespace
}  // namespace mt
