// LoRA fine-tuning as real processes: on 2 ranks under DDP, FULL_SHARD and SHARD_GRAD_OP, with a
// pipeline, with recompute and in bf16, it must train as one rank does on the same global batch;
// from a base model (train.init_from) the base stays bit-identical while the adapters move; the
// export merges them; tensor parallelism (with SP, and with data parallelism) trains as one rank.
#include <gtest/gtest.h>

#include <string>

#include "harness.h"

namespace mt {
namespace {

constexpr double kLossTol = 1e-5, kWeightTol = 2e-5;  // fp32: only the reduction order differs
const std::string kGpt2 = " --lora.rank 4 --lora.alpha 8 --lora.targets c_attn,o,up,down --train.lr 1e-2 ";
const std::string kLlama = " --model.preset llama-tiny --lora.rank 4 --lora.targets q,k,v,o,gate,up,down --train.lr 1e-2 ";

class LoraParallel : public ParityFixture {};

TEST_F(LoraParallel, DataParallelStrategiesEqualOneRank) {
  const RunResult ref = train(1, 8, 1, "single", kGpt2);
  const RunResult ddp = train(2, 4, 1, "ddp", kGpt2);
  expect_close(ref, ddp, kLossTol, kWeightTol, "LoRA DDP np=2");
  // DDP reduces the adapters' gradients only: its bytes against full fine-tuning's are about the
  // adapters' share of the parameters (up to 2x: small all-reduces take the one-shot algorithm,
  // which moves more bytes per byte reduced than the ring of a whole-model bucket).
  const RunResult full = train(2, 4, 1, "ddp_full");
  ASSERT_FALSE(full.final.is_null());
  const double lora_bytes = ddp.final["comm_bytes_by_group"]["dp"].get<double>();
  const double full_bytes = full.final["comm_bytes_by_group"]["dp"].get<double>();
  const double share = (ddp.final["num_params"].get<double>() - full.final["num_params"].get<double>()) /
                       full.final["num_params"].get<double>();
  std::printf("DDP bytes: LoRA %.0f, full %.0f (ratio %.4f; adapters / parameters %.4f)\n", lora_bytes, full_bytes,
              lora_bytes / full_bytes, share);
  EXPECT_GT(lora_bytes, 0.0);
  EXPECT_LT(lora_bytes / full_bytes, 2 * share) << "DDP moves the adapters' gradients, not the base's";
  expect_close(ref, train(2, 4, 1, "fsdp", kGpt2 + "--parallel.strategy FULL_SHARD"), kLossTol, kWeightTol,
               "LoRA FULL_SHARD np=2");
  expect_close(ref, train(2, 4, 1, "z2", kGpt2 + "--parallel.strategy SHARD_GRAD_OP"), kLossTol, kWeightTol,
               "LoRA SHARD_GRAD_OP np=2");
}

TEST_F(LoraParallel, LlamaPipelineAndRecomputeEqualOneRank) {
  const RunResult ref = train(1, 2, 4, "single", kLlama);
  expect_close(ref, train(2, 2, 4, "pp", kLlama + "--parallel.pp 2"), kLossTol, kWeightTol, "LoRA Llama pp=2");
  expect_close(ref, train(2, 1, 4, "fsdp_rc", kLlama + "--parallel.strategy FULL_SHARD --train.activation_checkpointing full"),
               kLossTol, kWeightTol, "LoRA Llama FULL_SHARD np=2 full recompute");
}

TEST_F(LoraParallel, Bf16ShardedEqualsBf16OneRank) {
  const std::string bf = kLlama + "--train.dtype bf16 ";
  expect_close(train(1, 8, 1, "single", bf), train(2, 4, 1, "fsdp", bf + "--parallel.strategy FULL_SHARD"), 2e-3, 2e-3,
               "LoRA Llama bf16 FULL_SHARD np=2");
}

// The tensors of a full-format checkpoint directory's latest checkpoint, by name.
std::map<std::string, std::vector<float>> tensors(const std::string& ckdir) {
  std::ifstream latest(ckdir + "/latest");
  std::string step;
  std::getline(latest, step);
  std::map<std::string, std::vector<float>> out;
  for (auto& [name, t] : read_safetensors(ckdir + "/" + step + "/model.safetensors")) {
    const float* p = reinterpret_cast<const float*>(t.bytes.data());
    out[name].assign(p, p + t.bytes.size() / 4);
  }
  return out;
}

TEST_F(LoraParallel, BaseFromInitFromStaysFrozenAndTheExportMerges) {
  train(1, 4, 1, "base", "--train.checkpoint_format full");
  const std::string base_ck = (dir_ / "ck_base").string();
  const RunResult l = train(2, 2, 1, "lora", kGpt2 + "--train.checkpoint_format full --train.init_from " + base_ck);
  ASSERT_EQ(l.losses.size(), 8u);
  const auto base = tensors(base_ck), tuned = tensors((dir_ / "ck_lora").string());
  int adapters = 0;
  for (const auto& [name, v] : tuned) {
    if (name.find(".lora_") != std::string::npos) {
      ++adapters;
      if (name.find("lora_B") != std::string::npos) {
        double mx = 0;
        for (float x : v) mx = std::max(mx, std::abs(static_cast<double>(x)));
        EXPECT_GT(mx, 0.0) << name << " did not train";
      }
      continue;
    }
    ASSERT_TRUE(base.count(name)) << name;
    EXPECT_EQ(v, base.at(name)) << name << ": a frozen base tensor changed";
  }
  EXPECT_EQ(adapters, 2 * 4 * 2);  // 2 blocks x 4 targets x (A, B)
  EXPECT_EQ(base.size() + static_cast<size_t>(adapters), tuned.size());
  // The default export merges: the exported model's loss on a batch equals the LoRA run's (lr 0).
  const std::string out = (dir_ / "merged").string();
  RunOut e = run(std::string(MT_BINARY) + " export --checkpoint " + (dir_ / "ck_lora").string() + " --out " + out);
  ASSERT_EQ(e.code, 0) << e.output;
  const auto merged = read_safetensors(out + "/model.safetensors");
  for (const auto& [name, t] : merged) EXPECT_EQ(name.find("lora_"), std::string::npos) << name;
  // Validation loss before the first step, on the same batches: the LoRA checkpoint (resumed, one
  // more step at lr 0) and the merged export (as a base model).
  const std::string val = " --data.val " + (dir_ / "train.bin").string() + " --train.eval_at_start true --train.eval_batches 2 --train.eval_every 1000 --train.lr 0 ";
  const RunResult a = train(1, 8, 1, "eval_lora", kGpt2 + val + "--train.steps 9 --train.resume " + (dir_ / "ck_lora").string());
  const RunResult b = train(1, 8, 1, "eval_merged", val + "--train.steps 1 --train.init_from " + out + "/model.safetensors");
  ASSERT_TRUE(a.final.contains("val_loss_start")) << a.final.dump();
  ASSERT_TRUE(b.final.contains("val_loss_start")) << b.final.dump();
  EXPECT_NEAR(a.final["val_loss_start"].get<double>(), b.final["val_loss_start"].get<double>(), 1e-5)
      << "the merged export computes what the adapters did";
}

// train.resume checks the checkpoint's [lora] against the run's: a LoRA checkpoint without
// adapters, a full checkpoint with them, or other adapters are refused with one line (exit code 2);
// the same settings resume.
TEST_F(LoraParallel, ResumeRefusesOtherAdapterSettingsWithOneLine) {
  train(1, 4, 1, "lora", kGpt2);
  train(1, 4, 1, "full");
  auto resume = [&](const std::string& tag, const std::string& extra) {
    return run("MESHTRAIN_MPI=0 " + std::string(MT_BINARY) + " train --model.preset gpt2-tiny --data.train " +
               (dir_ / "train.bin").string() + " --data.val '' --train.threads 1 --train.micro_batch 4 --train.steps 9 "
               "--train.resume " + (dir_ / ("ck_" + tag)).string() + extra);
  };
  struct Case {
    std::string tag, extra, says;
  };
  for (const Case& c : {Case{"lora", "", "is a LoRA checkpoint (lora.rank 4, lora.alpha 8, lora.targets c_attn,o,up,down) and this run has no adapters"},
                        Case{"full", kGpt2, "holds no LoRA adapters and this run has lora.rank = 4: to train adapters on that model use train.init_from"},
                        Case{"lora", " --lora.rank 4 --lora.alpha 8 --lora.targets c_attn,o,up", "resume with the checkpoint's [lora] settings"},
                        Case{"lora", " --lora.rank 2 --lora.alpha 8 --lora.targets c_attn,o,up,down", "resume with the checkpoint's [lora] settings"}}) {
    RunOut r = resume(c.tag, c.extra);
    EXPECT_EQ(r.code, 2) << c.extra << "\n" << r.output;
    EXPECT_NE(r.output.find(c.says), std::string::npos) << r.output;
  }
  RunOut ok = resume("lora", kGpt2);
  EXPECT_EQ(ok.code, 0) << ok.output;
}

// Tensor parallelism: column-parallel bases (q, k, v, c_attn, gate, up) with B split by rows and A
// replicated, row-parallel ones (o, down) with A split by columns and B replicated; the replicated
// matrices' gradients are summed over tp. tp 2 (with and without SP), and tp 2 x dp 2, train as
// one rank does, and the exports (merged and PEFT adapter) of a tp run equal one rank's.
TEST_F(LoraParallel, TensorParallelEqualsOneRankAndExportsTheSame) {
  const std::string gq = " --lora.rank 4 --lora.alpha 8 --lora.targets q,k,v,o,up,down --train.lr 1e-2 ";
  const RunResult ref = train(1, 4, 1, "single", kGpt2);
  expect_close(ref, train(2, 4, 1, "tp", kGpt2 + "--parallel.tp 2"), kLossTol, kWeightTol, "LoRA GPT-2 c_attn tp=2");
  const RunResult refq = train(1, 4, 1, "single_q", gq);
  expect_close(refq, train(2, 4, 1, "tp_sp", gq + "--parallel.tp 2 --parallel.sequence_parallel true"), kLossTol,
               kWeightTol, "LoRA GPT-2 q,k,v parts tp=2 SP");
  const RunResult refl = train(1, 4, 1, "single_l", kLlama);
  expect_close(refl, train(4, 2, 1, "tp_dp", kLlama + "--parallel.tp 2"), kLossTol, kWeightTol,
               "LoRA Llama tp=2 x dp=2 (4 ranks)");
  // The exports of the tp run and of the one-rank run: the same tensors, values within the parity
  // tolerance (merged), and PEFT's adapter files.
  for (const std::string flag : {"", " --adapter"}) {
    std::map<std::string, std::vector<float>> t[2];
    int i = 0;
    for (const std::string tag : {"single", "tp"}) {
      const std::string out = (dir_ / ("export_" + tag + (flag.empty() ? "" : "_adapter"))).string();
      RunOut e = run(std::string(MT_BINARY) + " export --checkpoint " + (dir_ / ("ck_" + tag)).string() + " --out " +
                     out + flag);
      ASSERT_EQ(e.code, 0) << e.output;
      for (auto& [name, st] : read_safetensors(out + (flag.empty() ? "/model.safetensors" : "/adapter_model.safetensors"))) {
        const float* p = reinterpret_cast<const float*>(st.bytes.data());
        t[i][name].assign(p, p + st.bytes.size() / 4);
      }
      ++i;
    }
    ASSERT_EQ(t[0].size(), t[1].size()) << flag;
    for (const auto& [name, v] : t[0]) {
      ASSERT_TRUE(t[1].count(name)) << name;
      const auto& w = t[1].at(name);
      ASSERT_EQ(v.size(), w.size()) << name;
      for (size_t k = 0; k < v.size(); ++k) ASSERT_NEAR(v[k], w[k], kWeightTol) << name << "[" << k << "]" << flag;
    }
  }
}

// Adapter dropout (PEFT's lora_dropout): the mask is a function of the run seed, the micro-batch,
// the global sample, the token, the input column and the adapter, so 2 ranks (DDP, FULL_SHARD with
// accumulation, tp 2 with SP, pp 2) train as one rank on the global batch, and full recompute draws the
// same masks again (so does a pipeline, whose stages count their micro-batches); with dropout the
// run differs from the run without.
TEST_F(LoraParallel, DropoutEqualsOneRankAndUnderRecompute) {
  const std::string d = kGpt2 + "--lora.dropout 0.3 ";
  const RunResult ref = train(1, 8, 2, "single", d);
  const RunResult off = train(1, 8, 2, "nodrop", kGpt2);
  ASSERT_EQ(ref.losses.size(), off.losses.size());
  double diff = 0;
  for (size_t i = 0; i < ref.losses.size(); ++i) diff = std::max(diff, std::abs(ref.losses[i] - off.losses[i]));
  EXPECT_GT(diff, 1e-4) << "dropout changed nothing";
  expect_close(ref, train(1, 8, 2, "recompute", d + "--train.activation_checkpointing full"), 1e-30, 1e-30,
               "LoRA dropout, full recompute (bit-identical)");
  expect_close(ref, train(2, 4, 2, "ddp", d), kLossTol, kWeightTol, "LoRA dropout DDP np=2");
  expect_close(ref, train(2, 4, 2, "fsdp", d + "--parallel.strategy FULL_SHARD"), kLossTol, kWeightTol,
               "LoRA dropout FULL_SHARD np=2");
  expect_close(ref, train(2, 8, 2, "tp_sp", d + "--parallel.tp 2 --parallel.sequence_parallel true"), kLossTol,
               kWeightTol, "LoRA dropout tp=2 SP");
  expect_close(ref, train(2, 8, 2, "pp", d + "--parallel.pp 2"), kLossTol, kWeightTol, "LoRA dropout pp=2");
}

// What adapter dropout does not cover is refused with one line and exit code 2.
TEST_F(LoraParallel, DropoutRefusalsAreOneLine) {
  const std::string base = std::string(MT_BINARY) + " train --model.preset gpt2-tiny --data.train " +
                           (dir_ / "train.bin").string() + " --data.val '' --train.steps 1" + kGpt2;
  struct Case {
    std::string cmd, says;
  };
  for (const Case& c : {Case{"MESHTRAIN_MPI=0 " + base + "--lora.dropout 1", "lora.dropout = 1.000000 is outside [0, 1)"},
                        Case{"MESHTRAIN_MPI=0 " + base + "--lora.dropout 0.1 --train.device cuda", "lora.dropout > 0 runs on train.device = cpu only"},
                        Case{mpirun(2) + base + "--lora.dropout 0.1 --parallel.cp 2", "adapter dropout is not supported with context parallelism"}}) {
    RunOut r = run(c.cmd);
    EXPECT_EQ(r.code, 2) << c.cmd << "\n" << r.output;
    EXPECT_NE(r.output.find(c.says), std::string::npos) << r.output;
  }
}

}  // namespace
}  // namespace mt
