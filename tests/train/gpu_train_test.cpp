// Training on the CUDA device (train.device = cuda) against the same runs on the CPU: GPT-2 and
// Llama, fp32 and bf16, recompute, gradient accumulation, chunked loss, eval, a mixture of
// experts; checkpoints saved on one device and resumed on the other; Hugging Face weights; the
// host waits per step. They run where a GPU is usable: on a GPU and in the emulator build
// (-DMESHTRAIN_CUDA=EMU, CTest label `emu`); elsewhere they skip with the reason, and
// GpuTrainRefusal checks the error instead.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "../test_files.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/export.h"
#include "data/token_shards.h"
#include "runtime/device.h"
#include "train/config.h"
#include "train/trainer.h"

#ifdef MT_CUDA_EMU
#include "emu.h"
#include "runtime/cuda/copy_stream.h"
#include "runtime/cuda/cuda_device.h"
#endif

namespace fs = std::filesystem;

namespace mt {
namespace {

using test::final_metrics;

using Overrides = std::vector<std::pair<std::string, std::string>>;

// Per-step losses of two runs agree within `rel` relative error.
void expect_close(const std::vector<double>& want, const std::vector<double>& got, double rel, const char* what) {
  ASSERT_EQ(want.size(), got.size()) << what;
  double worst = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_NEAR(got[i], want[i], rel * std::abs(want[i])) << what << ", step " << i + 1;
    worst = std::max(worst, std::abs(got[i] - want[i]) / std::abs(want[i]));
  }
  std::printf("%s: largest relative difference %.2e over %zu values (tolerance %.0e)\n", what, worst, want.size(), rel);
}

class GpuTrain : public ::testing::Test {
 public:  // for the checks shared by several tests (fused_mlp_check)
  void SetUp() override {
    std::string why;
    if (!device_available(Device::CUDA, &why)) GTEST_SKIP() << "GPU training test not run: " << why;
    std::string text;
    for (int i = 0; i < 300; ++i) text += "the quick brown fox jumps over the lazy dog " + std::to_string(i % 7) + "\n";
    std::vector<int32_t> toks(text.begin(), text.end());
    write_token_shard(tmp_.file("train.bin"), toks);
    write_token_shard(tmp_.file("val.bin"), std::vector<int32_t>(toks.begin(), toks.begin() + 1000));
  }
  RunConfig config(const std::string& device, const Overrides& extra = {}) {
    return RunConfig::load("", overrides(device, extra));
  }
  // Two GPU runs that differ in one choice (overrides a and b; ma / mb: their resident memory by
  // category): a dry run of each (in its own process: it replaces the world and the device) counts
  // its run's model state, workspace and activations (the device batch buffers included), and the
  // two dry runs differ in activations by `saved` bytes (b's minus a's), as the runs do.
  void expect_dry_runs_agree(const Overrides& a, const Overrides& b, const nlohmann::json& ma,
                             const nlohmann::json& mb, int64_t saved, const char* what_a, const char* what_b) {
    nlohmann::json dry[2];
    for (int i = 0; i < 2; ++i) {
      std::string cmd = std::string(MT_BINARY) + " train --dry-run --world 1 --rank 0";
      Overrides d = overrides("cuda", i == 0 ? a : b);
      d.back().second = tmp_.file("dry.jsonl");  // log.metrics_out
      for (const auto& [k, v] : d) cmd += " --" + k + " '" + v + "'";
      cmd += " > " + tmp_.file("dry.log") + " 2>&1";
      ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
      dry[i] = final_metrics(tmp_.file("dry.jsonl"));
      ASSERT_TRUE(dry[i].value("dry_run", false)) << dry[i].dump();
      dry[i] = dry[i]["mem_resident_by_category"];
      for (const char* c : {"params", "grads", "optimizer", "workspace", "activations"})
        EXPECT_EQ(dry[i][c], (i == 0 ? ma : mb)[c]) << c << ", " << (i == 0 ? what_a : what_b);
    }
    EXPECT_EQ(dry[1]["activations"].get<int64_t>() - dry[0]["activations"].get<int64_t>(), saved)
        << what_a << " against " << what_b;
  }

  Overrides overrides(const std::string& device, const Overrides& extra = {}) {
    Overrides ov = {{"model.preset", "gpt2-tiny"},   {"data.train", tmp_.file("train.bin")},
                    {"data.val", tmp_.file("val.bin")}, {"train.steps", "20"},
                    {"train.micro_batch", "2"},        {"train.warmup_steps", "2"},
                    {"train.lr", "3e-3"},              {"train.eval_every", "10"},
                    {"train.eval_batches", "1"},       {"train.threads", "1"},
                    {"log.print_every", "100"},        {"train.device", device}};
    // The CPU twin of a bf16 run keeps the residual stream in bf16 as the GPU's does
    // (model.residual_dtype = auto is bf16 there), and the LM head's logits too where the GPU's
    // model.logits_dtype = auto is bf16 (no chunked head); a key in `extra` wins (it comes later).
    auto has = [&](const char* k, const char* v) {
      return std::any_of(extra.begin(), extra.end(), [&](const auto& kv) { return kv.first == k && kv.second == v; });
    };
    const bool chunked = std::any_of(extra.begin(), extra.end(), [](const auto& kv) {
      return kv.first == "train.loss_chunk_tokens" && kv.second != "0";
    });
    if (device == "cpu" && has("train.dtype", "bf16")) {
      ov.emplace_back("model.residual_dtype", "bf16");
      if (!chunked) ov.emplace_back("model.logits_dtype", "bf16");
    }
    ov.insert(ov.end(), extra.begin(), extra.end());
    return ov;
  }
  std::string file(const std::string& name) { return tmp_.file(name); }
  // The same run on the CPU and on the GPU.
  void expect_parity(const Overrides& extra, double rel) {
    const TrainResult cpu = train(config("cpu", extra)), gpu = train(config("cuda", extra));
    ASSERT_EQ(cpu.losses.size(), 20u);
    EXPECT_LT(cpu.losses.back(), cpu.losses.front() - 0.5);  // it trains
    expect_close(cpu.losses, gpu.losses, rel, "training loss");
    expect_close(cpu.val_losses, gpu.val_losses, rel, "validation loss");
  }
  test::TestDir tmp_;
};

// fp32: the kernels differ from the CPU's by rounding only (reduction order, fused multiply-adds,
// libm), a few ulps per operation. In the emulator 20 steps differ by at most 5e-8 relative; the
// margin is for a GPU, whose compiler fuses other products and whose math library differs more.
constexpr double kFp32Rel = 1e-5;
// bf16: activations and weights are rounded to bf16 (8 significant bits) before every GEMM, so a
// difference of one fp32 ulp before the rounding moves some bf16 values by one bf16 ulp (2^-8
// relative), and training carries that on. In the emulator the losses differ by at most 4e-5
// relative; the tolerance leaves the same factor of about 50 for a GPU.
constexpr double kBf16Rel = 2e-3;

TEST_F(GpuTrain, Gpt2Fp32MatchesCpu) {
  expect_parity({{"train.grad_accum", "2"}}, kFp32Rel);
}

// Unpacked documents (data.packing = false) of 1 to 40 bytes, grouped by length, each micro-batch
// at its own padded length: the device's loss accumulator and eval give the CPU's losses, and the
// same as every micro-batch padded to seq_len.
TEST_F(GpuTrain, UnpackedVariableLengthsMatchCpuAndFixedShapes) {
  std::string text;
  for (int i = 0; i < 200; ++i) text += std::string(static_cast<size_t>(1 + (i * 37) % 40), static_cast<char>('a' + i % 26)) + "\n";
  write_token_shard(tmp_.file("docs.bin"), std::vector<int32_t>(text.begin(), text.end()));
  const Overrides ov = {{"data.train", tmp_.file("docs.bin")}, {"data.val", tmp_.file("docs.bin")},
                        {"data.packing", "false"},             {"data.group_by_length", "true"},
                        {"data.length_group_window", "4"},     {"data.pad_to_multiple", "4"},
                        {"data.shuffle", "true"},              {"train.grad_accum", "2"},
                        {"train.steps", "6"},                  {"train.eval_every", "3"}};
  Overrides fixed = ov;
  fixed.push_back({"data.pad_to_multiple", "0"});
  const TrainResult cpu = train(config("cpu", ov)), gpu = train(config("cuda", ov)), gpu_fixed = train(config("cuda", fixed));
  ASSERT_EQ(cpu.losses.size(), 6u);
  expect_close(cpu.losses, gpu.losses, kFp32Rel, "training loss, cpu vs cuda");
  expect_close(cpu.val_losses, gpu.val_losses, kFp32Rel, "validation loss, cpu vs cuda");
  expect_close(gpu_fixed.losses, gpu.losses, kFp32Rel, "training loss, cuda padded to seq_len vs per micro-batch");
}

TEST_F(GpuTrain, LlamaFp32RecomputeChunkedLossMatchesCpu) {
  expect_parity({{"model.preset", "llama-tiny"},
                 {"train.activation_checkpointing", "full"},
                 {"train.loss_chunk_tokens", "24"}},
                kFp32Rel);
}

// bf16 on the GPU attends with the flash-attention kernels (model.attention_kernel = auto): bf16
// q, k and v, fp32 accumulation, the lse kept for the backward. The CPU (reference kernel, fp32 on
// the fp32 projection) differs from it by the rounding of q, k, v to bf16 and the tensor-core
// reduction order, within the bf16 tolerance; with model.attention_kernel = reference the GPU runs
// the fp32 attention as before, also within it - and the two GPU runs differ (flash was used).
TEST_F(GpuTrain, Gpt2Bf16MatchesCpu) {
  const Overrides bf = {{"train.dtype", "bf16"}, {"train.grad_accum", "2"}};
  Overrides ref = bf;
  ref.push_back({"model.attention_kernel", "reference"});
  const TrainResult cpu = train(config("cpu", bf)), flash = train(config("cuda", bf)), plain = train(config("cuda", ref));
  ASSERT_EQ(cpu.losses.size(), 20u);
  EXPECT_LT(cpu.losses.back(), cpu.losses.front() - 0.5);  // it trains
  expect_close(cpu.losses, flash.losses, kBf16Rel, "training loss, flash attention");
  expect_close(cpu.val_losses, flash.val_losses, kBf16Rel, "validation loss, flash attention");
  expect_close(cpu.losses, plain.losses, kBf16Rel, "training loss, reference attention");
  expect_close(cpu.val_losses, plain.val_losses, kBf16Rel, "validation loss, reference attention");
  EXPECT_NE(flash.losses, plain.losses) << "model.attention_kernel made no difference on the GPU";
}

// Flash attention keeps bf16 q|k|v per layer instead of fp32 (2 bytes less per element of the
// [B*T, 3C] projection output, every layer), its output in bf16 only (the reference attention keeps
// it in fp32 beside the bf16 copy the output projection reads: 4 bytes less per element of every
// layer's [B*T, C]), and holds the fp32 projection output once, as workspace. The dry run
// (`train --dry-run`, the Meta device) counts the same bytes as the real run.
TEST_F(GpuTrain, FlashAttentionMemoryAndTheDryRunAgree) {
  const Overrides bf = {{"train.dtype", "bf16"}, {"train.steps", "1"}, {"train.eval_every", "0"}};
  Overrides flash = bf, ref = bf;
  flash.emplace_back("log.metrics_out", tmp_.file("flash.jsonl"));
  ref.emplace_back("model.attention_kernel", "reference");
  ref.emplace_back("log.metrics_out", tmp_.file("ref.jsonl"));
  const RunConfig rc = config("cuda", flash);
  train(rc);
  train(config("cuda", ref));
  const nlohmann::json f = final_metrics(tmp_.file("flash.jsonl")), r = final_metrics(tmp_.file("ref.jsonl"));
  const nlohmann::json &mf = f["mem_resident_by_category"], &mr = r["mem_resident_by_category"];
  const ModelConfig mc = rc.model_config();
  const int64_t qkv = rc.train.micro_batch * mc.seq_len * 3 * mc.n_embd;  // elements per layer
  const int64_t att = rc.train.micro_batch * mc.seq_len * mc.n_embd;      // attention output elements per layer
  const int64_t saved = (2 * qkv + 4 * att) * mc.n_layer;
  EXPECT_EQ(mr["activations"].get<int64_t>() - mf["activations"].get<int64_t>(), saved);
  EXPECT_EQ(mf["workspace"].get<int64_t>() - mr["workspace"].get<int64_t>(), 4 * qkv);

  // The dry runs of both count the same model state, workspace and activations.
  expect_dry_runs_agree(flash, ref, mf, mr, saved, "flash", "reference");
}

// One value of every step's metrics line.
std::vector<double> step_values(const std::string& path, const char* key) {
  std::ifstream f(path);
  std::string line;
  std::vector<double> v;
  while (std::getline(f, line)) {
    if (line.empty()) continue;
    const nlohmann::json j = nlohmann::json::parse(line);
    if (j.contains("step") && j.contains(key)) v.push_back(j[key].get<double>());
  }
  return v;
}

// The MLP in bf16 on the GPU keeps its pre-activations in bf16 (model.mlp_kernel = auto = fused):
// 4 steps fused, unfused and on the CPU. Every step's loss and gradient norm of the fused run within
// the bf16 tolerance of the CPU's, the losses within it of the unfused run and different from them;
// activations smaller by `act` bytes per pre-activation element of every layer, workspace by `ws`
// bytes per element of one layer, the model state equal; the dry run of each counts the same model
// state and workspace as its real run and the same difference in activations.
void fused_mlp_check(GpuTrain& t, const char* preset, int64_t act, int64_t ws) {
  const Overrides bf = {{"model.preset", preset}, {"train.dtype", "bf16"}, {"train.steps", "4"}, {"train.eval_every", "0"}};
  Overrides fused = bf, plain = bf;
  fused.emplace_back("log.metrics_out", t.file("fused.jsonl"));
  plain.emplace_back("model.mlp_kernel", "unfused");
  plain.emplace_back("log.metrics_out", t.file("plain.jsonl"));
  Overrides cpu = bf;
  cpu.emplace_back("log.metrics_out", t.file("cpu.jsonl"));
  const RunConfig rc = t.config("cuda", fused);
  const TrainResult tf = train(rc), tp = train(t.config("cuda", plain)), tc = train(t.config("cpu", cpu));
  expect_close(tc.losses, tf.losses, kBf16Rel, "training loss, fused MLP against the CPU");
  expect_close(tp.losses, tf.losses, kBf16Rel, "training loss, fused MLP against the unfused one");
  EXPECT_NE(tf.losses, tp.losses) << "model.mlp_kernel made no difference on the GPU";
  // AdamW is blind to a gradient's scale; the gradient norm is not.
  expect_close(step_values(t.file("cpu.jsonl"), "grad_norm"), step_values(t.file("fused.jsonl"), "grad_norm"),
               kBf16Rel, "gradient norm, fused MLP against the CPU");
  const nlohmann::json f = final_metrics(t.file("fused.jsonl")), r = final_metrics(t.file("plain.jsonl"));
  const nlohmann::json &mf = f["mem_resident_by_category"], &mr = r["mem_resident_by_category"];
  ModelConfig mc = rc.model_config();
  mc.resolve();
  const int64_t fc = rc.train.micro_batch * mc.seq_len * mc.ffn_hidden;  // pre-activation elements per layer
  EXPECT_EQ(mr["activations"].get<int64_t>() - mf["activations"].get<int64_t>(), act * fc * mc.n_layer);
  EXPECT_EQ(mr["workspace"].get<int64_t>() - mf["workspace"].get<int64_t>(), ws * fc);
  for (const char* c : {"params", "grads", "optimizer"}) EXPECT_EQ(mf[c], mr[c]) << c;
  t.expect_dry_runs_agree(fused, plain, mf, mr, act * fc * mc.n_layer, "fused", "unfused");
}

// GPT-2: the up projection's GELU_AUX_BIAS epilogue writes the pre-activation in bf16 (kept for the
// backward instead of fp32: 2 bytes less per element of every layer's [B*T, F]) and the GELU's input
// gradient comes out of the down projection's DGELU epilogue in bf16 (the workspace holds one bf16
// [B*T, F] instead of three fp32 ones). The losses differ from the unfused run's because gelu' is
// evaluated at the bf16 pre-activation.
TEST_F(GpuTrain, FusedGeluMlpKeepsBf16ActivationsAndTheDryRunAgrees) { fused_mlp_check(*this, "gpt2-tiny", 2, 3 * 4 - 2); }

// Llama: the gate and up projections write bf16 (cuBLASLt's bf16 D), SwiGLU reads them
// (swiglu_forward_bf16) and its backward writes their bf16 gradients (swiglu_backward_bf16), which
// the projections' backward reads directly (linear_backward_bf16_dy): 2 bytes less per element for
// each of gate and up in every layer; the workspace holds the activation's fp32 gradient and two bf16
// ones instead of three fp32 ones (4 bytes less per element).
TEST_F(GpuTrain, FusedSwigluMlpKeepsBf16ActivationsAndTheDryRunAgrees) {
  fused_mlp_check(*this, "llama-tiny", 2 + 2, 3 * 4 - (4 + 2 + 2));
}

// A Llama mixture of experts in bf16 with the fused MLP: the routed experts' gate and up (h1, h3)
// are written in bf16 too, SwiGLU and its backward run on them (the shared expert keeps fp32 ones).
// Every step's loss within the bf16 tolerance of the CPU's, different from the unfused GPU run's;
// with every expert padded to its capacity (routing-independent row counts) the activations are
// smaller by exactly 4 bytes per element of every MoE layer's routed [rows, Fe] (h1 and h3) plus
// 4 per element of every dense layer's [B*T, F].
TEST_F(GpuTrain, FusedSwigluMoeExpertsKeepBf16PreActivations) {
  const Overrides bf = {{"model.preset", "llama-tiny"},        {"model.moe_experts", "4"},
                        {"model.moe_top_k", "2"},              {"model.moe_shared_experts", "1"},
                        {"model.moe_every", "2"},              {"model.moe_capacity_factor", "2"},
                        {"model.moe_pad_to_capacity", "true"}, {"train.dtype", "bf16"},
                        {"train.steps", "4"},                  {"train.eval_every", "0"}};
  Overrides fused = bf, plain = bf;
  fused.emplace_back("log.metrics_out", file("fused.jsonl"));
  plain.emplace_back("model.mlp_kernel", "unfused");
  plain.emplace_back("log.metrics_out", file("plain.jsonl"));
  Overrides cpu = bf;
  cpu.emplace_back("log.metrics_out", file("cpu.jsonl"));
  const RunConfig rc = config("cuda", fused);
  const TrainResult tf = train(rc), tp = train(config("cuda", plain)), tc = train(config("cpu", cpu));
  expect_close(tc.losses, tf.losses, kBf16Rel, "training loss, fused MoE MLP against the CPU");
  expect_close(step_values(file("cpu.jsonl"), "grad_norm"), step_values(file("fused.jsonl"), "grad_norm"), kBf16Rel,
               "gradient norm, fused MoE MLP against the CPU");
  EXPECT_NE(tf.losses, tp.losses) << "model.mlp_kernel made no difference to the MoE run on the GPU";
  ModelConfig mc = rc.model_config();
  mc.resolve();
  const int64_t N = rc.train.micro_batch * mc.seq_len, E = mc.moe_experts;
  const int64_t M = E * ((2 * N * mc.moe_top_k + E - 1) / E);  // every expert padded to ceil(2 N k / E)
  int64_t want = 0;
  for (int64_t l = 0; l < mc.n_layer; ++l) want += mc.is_moe_layer(l) ? 4 * M * mc.expert_ffn() : 4 * N * mc.ffn_hidden;
  const nlohmann::json f = final_metrics(file("fused.jsonl")), r = final_metrics(file("plain.jsonl"));
  EXPECT_EQ(r["mem_resident_by_category"]["activations"].get<int64_t>() -
                f["mem_resident_by_category"]["activations"].get<int64_t>(),
            want);
}

// The residual stream in bf16 (model.residual_dtype = auto on the GPU in bf16): every unit's output
// and each block's res2 are kept in bf16, 2 bytes less per element of (L + 1) + L tensors of
// [B*T, C]; the workspace and the model state are unchanged, and the dry run counts the same bytes
// and the same difference. The losses and gradient norms match the CPU run with
// model.residual_dtype = bf16 within the bf16 tolerance, and the GPU run with the fp32 stream differs.
TEST_F(GpuTrain, Bf16ResidualMatchesCpuAndTheDryRunAgrees) {
  const Overrides bf = {{"train.dtype", "bf16"}, {"train.steps", "4"}, {"train.eval_every", "0"}};
  Overrides res = bf, f32 = bf, cpu = bf;
  res.emplace_back("log.metrics_out", tmp_.file("res.jsonl"));
  f32.emplace_back("model.residual_dtype", "fp32");
  f32.emplace_back("log.metrics_out", tmp_.file("f32.jsonl"));
  cpu.emplace_back("log.metrics_out", tmp_.file("cpu.jsonl"));  // model.residual_dtype = bf16 (overrides())
  const RunConfig rc = config("cuda", res);
  const TrainResult tr = train(rc), tf = train(config("cuda", f32)), tc = train(config("cpu", cpu));
  ASSERT_EQ(tr.losses.size(), 4u);
  expect_close(tc.losses, tr.losses, kBf16Rel, "training loss, bf16 residual, GPU against the CPU");
  expect_close(step_values(tmp_.file("cpu.jsonl"), "grad_norm"), step_values(tmp_.file("res.jsonl"), "grad_norm"),
               kBf16Rel, "gradient norm, bf16 residual, GPU against the CPU");
  EXPECT_NE(tr.losses, tf.losses) << "model.residual_dtype made no difference on the GPU";
  const nlohmann::json r = final_metrics(tmp_.file("res.jsonl")), f = final_metrics(tmp_.file("f32.jsonl"));
  const nlohmann::json &mr = r["mem_resident_by_category"], &mf = f["mem_resident_by_category"];
  ModelConfig mc = rc.model_config();
  mc.resolve();
  const int64_t saved = 2 * rc.train.micro_batch * mc.seq_len * mc.n_embd * (2 * mc.n_layer + 1);
  EXPECT_EQ(mf["activations"].get<int64_t>() - mr["activations"].get<int64_t>(), saved);
  for (const char* c : {"params", "grads", "optimizer", "workspace"}) EXPECT_EQ(mr[c], mf[c]) << c;
  expect_dry_runs_agree(res, f32, mr, mf, saved, "bf16 residual", "fp32 residual");
}

// The LM head's logits in bf16 (model.logits_dtype = auto on the GPU in bf16): the head GEMM writes
// bf16 logits, the loss reads them and writes their bf16 gradient over them, so the [B*T, Vp] logits
// take 2 bytes less per element; the other categories are unchanged, and each dry run counts its
// real run's model state and workspace and the same difference in activations. Training and validation losses and gradient norms match the CPU run with
// model.logits_dtype = bf16 within the bf16 tolerance; the GPU run with fp32 logits differs; the
// end-of-run sample reads the bf16 logits widened.
TEST_F(GpuTrain, Bf16LogitsMatchCpuAndTheDryRunAgrees) {
  const Overrides bf = {{"train.dtype", "bf16"}, {"train.steps", "4"}, {"train.eval_every", "2"},
                        {"train.sample_tokens", "4"}};
  Overrides l16 = bf, f32 = bf, cpu = bf;
  l16.emplace_back("log.metrics_out", tmp_.file("l16.jsonl"));
  f32.emplace_back("model.logits_dtype", "fp32");
  f32.emplace_back("log.metrics_out", tmp_.file("f32.jsonl"));
  cpu.emplace_back("log.metrics_out", tmp_.file("cpu.jsonl"));  // model.logits_dtype = bf16 (overrides())
  const RunConfig rc = config("cuda", l16);
  const TrainResult tl = train(rc), tf = train(config("cuda", f32)), tc = train(config("cpu", cpu));
  ASSERT_EQ(tl.losses.size(), 4u);
  ASSERT_FALSE(tl.val_losses.empty());
  expect_close(tc.losses, tl.losses, kBf16Rel, "training loss, bf16 logits, GPU against the CPU");
  expect_close(tc.val_losses, tl.val_losses, kBf16Rel, "validation loss, bf16 logits, GPU against the CPU");
  expect_close(step_values(tmp_.file("cpu.jsonl"), "grad_norm"), step_values(tmp_.file("l16.jsonl"), "grad_norm"),
               kBf16Rel, "gradient norm, bf16 logits, GPU against the CPU");
  EXPECT_NE(tl.losses, tf.losses) << "model.logits_dtype made no difference on the GPU";
  const nlohmann::json l = final_metrics(tmp_.file("l16.jsonl")), f = final_metrics(tmp_.file("f32.jsonl"));
  const nlohmann::json &ml = l["mem_resident_by_category"], &mf = f["mem_resident_by_category"];
  ModelConfig mc = rc.model_config();
  mc.resolve();
  const int64_t saved = 2 * rc.train.micro_batch * mc.seq_len * mc.padded_vocab;
  EXPECT_EQ(mf["activations"].get<int64_t>() - ml["activations"].get<int64_t>(), saved);
  for (const char* c : {"params", "grads", "optimizer", "workspace"}) EXPECT_EQ(ml[c], mf[c]) << c;
  expect_dry_runs_agree(l16, f32, ml, mf, saved, "bf16 logits", "fp32 logits");
}

// Grouped-query attention (4 query heads, 2 key/value heads) in the flash kernels, recomputed.
TEST_F(GpuTrain, LlamaBf16SelectiveRecomputeMatchesCpu) {
  expect_parity({{"model.preset", "llama-tiny"},
                 {"train.dtype", "bf16"},
                 {"train.activation_checkpointing", "selective"}},
                kBf16Rel);
}

// Document masking with flash attention (model.attention_kernel = auto picks it with
// data.document_masking): the flash kernels skip the keys before each query's document start. Against
// the CPU's masked fp32 attention (which tests/model/document_masking_test.cpp checks against every
// document alone) within the bf16 tolerance, for Llama (rotary positions restarting per document,
// grouped-query heads); and the masking matters (the unmasked CPU run trains differently).
TEST_F(GpuTrain, DocumentMaskingBf16FlashMatchesCpu) {
  const Overrides plain = {{"model.preset", "llama-tiny"}, {"train.dtype", "bf16"}};
  Overrides docs = plain;
  docs.push_back({"data.document_masking", "true"});
  const TrainResult cpu = train(config("cpu", docs)), flash = train(config("cuda", docs)),
                    unmasked = train(config("cpu", plain));
  ASSERT_EQ(cpu.losses.size(), 20u);
  expect_close(cpu.losses, flash.losses, kBf16Rel, "training loss, documents, flash attention");
  expect_close(cpu.val_losses, flash.val_losses, kBf16Rel, "validation loss, documents, flash attention");
  ASSERT_EQ(unmasked.losses.size(), 20u);
  double apart = 0;  // beyond the tolerance: a flash kernel that ignored the documents would fail above
  for (size_t i = 0; i < 20; ++i) apart = std::max(apart, std::abs(unmasked.losses[i] - cpu.losses[i]) / cpu.losses[i]);
  std::printf("masked vs unmasked CPU runs: largest relative difference %.2e\n", apart);
  EXPECT_GT(apart, kBf16Rel) << "document masking made no difference";
}

// A mixture of experts on one device: the router, the dispatch (its plan is made on the host from
// the router's choices, copied back explicitly, one wait per MoE layer), the experts and the
// combine, with a shared expert and the auxiliary loss.
TEST_F(GpuTrain, LlamaMoeFp32MatchesCpu) {
  expect_parity({{"model.preset", "llama-tiny"},
                 {"model.moe_experts", "4"},
                 {"model.moe_top_k", "2"},
                 {"model.moe_shared_experts", "1"}},
                kFp32Rel);
}

// A checkpoint saved on one device, resumed on the other, continues as the run that saved it did
// without stopping (within the fp32 tolerance: the devices round differently), in both formats.
TEST_F(GpuTrain, CheckpointsMoveBetweenDevices) {
  for (const std::string fmt : {"sharded", "full"}) {
    for (const auto& [from, to] : {std::pair<std::string, std::string>{"cuda", "cpu"}, {"cpu", "cuda"}}) {
      SCOPED_TRACE(fmt + " checkpoint saved on " + from + ", resumed on " + to);
      const std::string ck = tmp_.file("ck_" + fmt + "_" + from);
      const Overrides common = {{"train.steps", "8"}, {"train.checkpoint_format", fmt}, {"train.eval_every", "0"}};
      Overrides save = common;
      save.insert(save.end(), {{"train.checkpoint_dir", ck}, {"train.checkpoint_every", "4"}});
      const TrainResult whole = train(config(from, save));
      Overrides resume = common;
      resume.emplace_back("train.resume", ck + "/step_00000004");
      const TrainResult resumed = train(config(to, resume));
      expect_close(std::vector<double>(whole.losses.begin() + 4, whole.losses.end()), resumed.losses, kFp32Rel,
                   "resumed loss");
    }
  }
}

// Hugging Face weights (train.init_from) load onto the GPU as onto the CPU, and a run that samples
// at the end (the logits read back from the device) completes.
TEST_F(GpuTrain, InitFromHuggingFaceWeightsAndSample) {
  train(config("cpu", {{"train.steps", "3"}, {"train.checkpoint_dir", tmp_.file("ck")}, {"train.eval_every", "0"}}));
  const std::string dir = resolve_checkpoint(tmp_.file("ck"));
  export_checkpoint(dir, load_checkpoint_config(dir).model_config(), tmp_.file("hf"), int64_t{1} << 40);
  const Overrides ft = {{"train.steps", "4"},
                        {"train.init_from", tmp_.file("hf/model.safetensors")},
                        {"train.eval_every", "0"},
                        {"train.sample_tokens", "8"}};
  const TrainResult cpu = train(config("cpu", ft)), gpu = train(config("cuda", ft));
  expect_close(cpu.losses, gpu.losses, kFp32Rel, "fine-tuning loss");
  // Starting from trained weights: below a fresh run's first loss.
  EXPECT_LT(gpu.losses.front(), train(config("cuda", {{"train.steps", "1"}, {"train.eval_every", "0"}})).losses.front());
}

// The host waits for the GPU once per step: the loss and the gradient norm come back in one read
// after the optimizer step (clipping happens on the device, from the norm there), whatever the
// gradient accumulation. Measured as the difference between a run of 6 steps and one of 2, which
// share every wait before and after the steps.
TEST_F(GpuTrain, HostWaitsOncePerStep) {
  auto waits = [&](int steps) {
    const uint64_t before = dev::host_syncs(Device::CUDA);
    train(config("cuda", {{"train.steps", std::to_string(steps)}, {"train.eval_every", "0"}, {"train.grad_accum", "3"}}));
    return dev::host_syncs(Device::CUDA) - before;
  };
  const uint64_t two = waits(2), six = waits(6);
  EXPECT_EQ(six - two, 4u * 1u) << "host waits: " << two << " in a run of 2 steps, " << six << " in one of 6";
}

// Clipping on the device (the norm never read before the update) clips as the CPU does: a clip
// far below the norm (every step clipped) gives the CPU's losses, differs from no clipping, and
// two runs give the same bits.
TEST_F(GpuTrain, ClipsOnTheDeviceAsTheHostDoes) {
  const Overrides clip = {{"train.steps", "4"}, {"train.eval_every", "0"}, {"train.grad_clip", "0.05"}};
  const TrainResult cpu = train(config("cpu", clip)), gpu = train(config("cuda", clip)),
                    again = train(config("cuda", clip));
  expect_close(cpu.losses, gpu.losses, kFp32Rel, "clipped training loss");
  EXPECT_EQ(gpu.losses, again.losses) << "two runs on the device differ";
  const TrainResult free = train(config("cuda", {{"train.steps", "4"}, {"train.eval_every", "0"}, {"train.grad_clip", "0"}}));
  EXPECT_GT(std::abs(free.losses.back() - gpu.losses.back()), 1e-3) << "clipping at 0.05 changed nothing";
}

// The streams of a GPU step and the device-side norm of the sharded strategies: a suite (and CTest
// entry, CudaEmu.TrainStreams) of its own beside CudaEmu.Train.
class GpuStreams : public GpuTrain {};

// The sharded strategies at one rank keep the norm on the device too: one reduction over the
// local gradient, clipping in the optimizer's kernel, one host wait per step. With every step
// clipped, each strategy's losses equal the CPU's, and a run of 3 steps waits twice more than one
// of 1 step (reading the norm on the host, one read per parameter, waits 29 times per step here).
TEST_F(GpuStreams, ShardedStrategiesClipOnTheDeviceWithOneWaitPerStep) {
  for (const char* strategy : {"FULL_SHARD", "SHARD_GRAD_OP", "ZERO1"}) {
    auto ov = [&](int steps) {
      return Overrides{{"train.steps", std::to_string(steps)}, {"train.eval_every", "0"},
                       {"train.grad_clip", "0.05"},          {"train.sample_tokens", "0"},
                       {"parallel.strategy", strategy}};
    };
    const TrainResult cpu = train(config("cpu", ov(3)));
    uint64_t before = dev::host_syncs(Device::CUDA);
    train(config("cuda", ov(1)));
    const uint64_t one = dev::host_syncs(Device::CUDA) - before;
    before = dev::host_syncs(Device::CUDA);
    const TrainResult gpu = train(config("cuda", ov(3)));
    const uint64_t three = dev::host_syncs(Device::CUDA) - before;
    expect_close(cpu.losses, gpu.losses, kFp32Rel, strategy);
    EXPECT_EQ(three - one, 2u) << strategy << ": host waits " << one << " in a run of 1 step, " << three
                               << " in one of 3";
  }
}

#ifdef MT_CUDA_EMU
// A step's batches are read and uploaded during the step before: the emulator logs every stream
// operation in the order the host queued it (emu::set_op_log). For each step after the first, its
// micro-batches' uploads are queued on the copy stream after the previous step's first kernels
// and before that step's one read of the loss (so the copies overlap its work on a GPU), an event
// recorded on the copy stream after them is waited for by the compute stream before the step's
// first kernel, and no batch goes up on the compute stream. The losses are the CPU's.
TEST_F(GpuStreams, UploadsTheNextStepsBatchesOnTheCopyStreamAhead) {
  const int steps = 3, accum = 2;
  const Overrides ov = {{"train.steps", std::to_string(steps)}, {"train.eval_every", "0"},
                        {"train.grad_accum", std::to_string(accum)}, {"train.sample_tokens", "0"}};
  const TrainResult cpu = train(config("cpu", ov));
  std::vector<emu::StreamOp> log;
  emu::set_op_log(&log);
  const TrainResult gpu = train(config("cuda", ov));
  emu::set_op_log(nullptr);
  expect_close(cpu.losses, gpu.losses, kFp32Rel, "training loss");
  auto* compute = static_cast<cudaStream_t>(cuda::stream());
  auto* copies = static_cast<cudaStream_t>(cuda::copy_stream());
  using K = emu::StreamOp;
  std::vector<size_t> uploads, reads;  // batch uploads on the copy stream; the steps' loss reads
  for (size_t i = 0; i < log.size(); ++i) {
    if (log[i].kind == K::CopyH2D && log[i].stream == copies) uploads.push_back(i);
    if (log[i].kind == K::CopyD2H && log[i].stream == compute && !uploads.empty()) reads.push_back(i);
  }
  ASSERT_EQ(uploads.size(), static_cast<size_t>(steps * accum));
  ASSERT_GE(reads.size(), static_cast<size_t>(steps));  // one per step (then the end of the run's)
  auto first_kernel_after = [&](size_t from) {
    for (size_t i = from; i < log.size(); ++i)
      if (log[i].kind == K::Kernel && log[i].stream == compute) return i;
    return log.size();
  };
  // Waits on the compute stream for an event recorded on the copy stream after upload `u`.
  auto waits_for_upload = [&](size_t u, size_t before) {
    for (size_t i = u + 1; i < before; ++i) {
      if (log[i].kind != K::WaitEvent || log[i].stream != compute) continue;
      for (size_t j = i; j-- > u;)
        if (log[j].kind == K::Record && log[j].event == log[i].event) {
          if (log[j].stream == copies) return true;
          break;
        }
    }
    return false;
  };
  size_t step_begin = uploads[0];
  for (int k = 0; k < steps; ++k) {
    const size_t last_upload = uploads[static_cast<size_t>((k + 1) * accum - 1)];
    // Step k's first kernel: after its uploads, and after step k - 1's loss read.
    const size_t first = first_kernel_after(k > 0 ? std::max(last_upload, reads[static_cast<size_t>(k - 1)]) : last_upload);
    if (k > 0) {
      // Queued during step k - 1: after its first kernel, before its loss read.
      EXPECT_LT(first_kernel_after(step_begin), uploads[static_cast<size_t>(k * accum)]) << "step " << k + 1;
      EXPECT_LT(last_upload, reads[static_cast<size_t>(k - 1)]) << "step " << k + 1 << "'s batches went up after step "
                                                                  << k << " had finished";
    }
    EXPECT_TRUE(waits_for_upload(last_upload, first)) << "step " << k + 1 << " does not wait for its uploads";
    step_begin = first;
  }
  for (size_t i = uploads[0]; i < reads[steps - 1]; ++i)
    EXPECT_FALSE(log[i].kind == K::CopyH2D && log[i].stream == compute) << "an upload on the compute stream";
}
#endif

// Where no GPU can be used (no CUDA backend in the build, or no device), train.device = cuda fails
// before anything is built, with the reason.
TEST(GpuTrainRefusal, UnusableDeviceIsRefusedWithTheReason) {
  std::string why;
  if (device_available(Device::CUDA, &why)) GTEST_SKIP() << "a CUDA device is usable here";
  try {
    train(RunConfig::load("", {{"model.preset", "gpt2-tiny"}, {"train.device", "cuda"}, {"data.train", "/nonexistent"}}));
    ADD_FAILURE() << "train.device = cuda was accepted";
  } catch (const ConfigError& e) {
    EXPECT_EQ(std::string(e.what()), "train.device = cuda: " + why);
  }
}

}  // namespace
}  // namespace mt
