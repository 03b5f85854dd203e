// LoRA checkpoints hold the adapters and their optimizer state only (the base comes from
// train.init_from): the files hold no base tensor and are the adapters' size; a checkpoint saved
// under FULL_SHARD on 2 ranks resumes on 1 rank and under DDP on 2 as the uninterrupted run goes
// on; another base is refused; the exports of a resumed run equal the uninterrupted run's.
#include <gtest/gtest.h>

#include <string>

#include "harness.h"

namespace mt {
namespace {

constexpr double kLossTol = 1e-5, kWeightTol = 2e-5;  // fp32: only the reduction order differs
const std::string kLora = " --lora.rank 4 --lora.alpha 8 --lora.targets c_attn,o,up,down --train.lr 1e-2 ";

class LoraCheckpoint : public ParityFixture {
 protected:
  std::string ck(const std::string& tag) const { return (dir_ / ("ck_" + tag)).string(); }
  std::string step_dir(const std::string& tag) const {
    std::ifstream latest(ck(tag) + "/latest");
    std::string step;
    std::getline(latest, step);
    return ck(tag) + "/" + step;
  }
  // The tensors of a safetensors file, by name.
  static std::map<std::string, std::vector<float>> tensors(const std::string& file) {
    std::map<std::string, std::vector<float>> out;
    for (auto& [name, t] : read_safetensors(file)) {
      const float* p = reinterpret_cast<const float*>(t.bytes.data());
      out[name].assign(p, p + t.bytes.size() / 4);
    }
    return out;
  }
  static double max_diff(const std::map<std::string, std::vector<float>>& a, const std::map<std::string, std::vector<float>>& b) {
    EXPECT_EQ(a.size(), b.size());
    double d = 0;
    for (const auto& [name, v] : a) {
      if (!b.count(name) || b.at(name).size() != v.size()) {
        ADD_FAILURE() << name << " differs in presence or size";
        return 1e30;
      }
      for (size_t i = 0; i < v.size(); ++i) d = std::max(d, std::abs(static_cast<double>(v[i]) - b.at(name)[i]));
    }
    return d;
  }
  RunOut export_(const std::string& tag, const std::string& out, const std::string& extra = "") {
    return run(std::string(MT_BINARY) + " export --checkpoint " + ck(tag) + " --out " + (dir_ / out).string() + extra);
  }
};

// Steps 5..8 of `resumed` (a run resumed at step 4) against those of the uninterrupted `ref`, and
// the final adapters.
void expect_continues(const RunResult& ref, const RunResult& resumed, const std::string& what) {
  ASSERT_EQ(ref.losses.size(), 8u) << what;
  ASSERT_EQ(resumed.losses.size(), 4u) << what;
  for (size_t i = 0; i < 4; ++i) EXPECT_NEAR(ref.losses[4 + i], resumed.losses[i], kLossTol) << what << " step " << 5 + i;
  ASSERT_EQ(ref.weights.size(), resumed.weights.size()) << what;
  double d = 0;
  for (size_t i = 0; i < ref.weights.size(); ++i)
    d = std::max(d, std::abs(static_cast<double>(ref.weights[i]) - resumed.weights[i]));
  EXPECT_LT(d, kWeightTol) << what << ": final adapters differ by " << d;
  std::printf("[%s] step 8 loss %.7f vs %.7f, max |dw| %.3g\n", what.c_str(), ref.losses.back(), resumed.losses.back(), d);
}

TEST_F(LoraCheckpoint, HoldsTheAdaptersOnlyAndResumesUnderOtherLayouts) {
  train(1, 4, 1, "base", "--train.checkpoint_format full --train.steps 2");
  const std::string init = " --train.init_from " + ck("base") + " ";
  const std::string fsdp = kLora + init + "--parallel.strategy FULL_SHARD ";
  const RunResult ref = train(2, 2, 1, "ref", fsdp + "--train.checkpoint_every 4");
  const std::string half = ck("ref") + "/step_00000004";

  // The sharded checkpoint holds adapters (and their moments) only: its rank files are the
  // adapters' weights and two moments in fp32, plus headers.
  const int64_t adapters = ref.final["num_params"].get<int64_t>() -
                           train(1, 4, 1, "plain", "--train.steps 1").final["num_params"].get<int64_t>();
  ASSERT_GT(adapters, 0);
  const auto meta = nlohmann::json::parse(std::ifstream(half + "/metadata.json"));
  int64_t numel = 0, bytes = 0;
  for (auto it = meta["tensors"].begin(); it != meta["tensors"].end(); ++it) {
    EXPECT_NE(it.key().find(".lora_"), std::string::npos) << it.key() << ": a base tensor in a LoRA checkpoint";
    if (it.key().rfind("exp_avg", 0) == 0) continue;
    int64_t n = 1;
    for (int64_t d : (*it)["shape"].get<std::vector<int64_t>>()) n *= d;
    numel += n;
  }
  EXPECT_EQ(numel, adapters);
  for (const auto& f : meta["files"]) bytes += std::filesystem::file_size(half + "/" + f["name"].get<std::string>());
  std::printf("sharded LoRA checkpoint: %lld bytes in rank files for %lld adapter parameters (%lld bytes of state)\n",
              static_cast<long long>(bytes), static_cast<long long>(adapters), static_cast<long long>(12 * adapters));
  EXPECT_GE(bytes, 12 * adapters);
  EXPECT_LT(bytes, 12 * adapters + 64 * 1024) << "more than the adapters' weights and moments";

  // Resume on 1 rank (the same global batch) and under DDP on 2 ranks, each from a copy.
  for (const char* t : {"r1", "ddp"}) {
    std::filesystem::create_directories(ck(t));
    std::filesystem::copy(half, ck(t) + "/step_00000004", std::filesystem::copy_options::recursive);
    std::ofstream(ck(t) + "/latest") << "step_00000004\n";
  }
  expect_continues(ref, train(1, 4, 1, "r1", kLora + init + "--train.resume latest"), "FULL_SHARD np=2 -> 1 rank");
  expect_continues(ref, train(2, 2, 1, "ddp", kLora + init + "--train.resume latest"), "FULL_SHARD np=2 -> DDP np=2");

  // The exports of the resumed run (merged, and the PEFT adapter) equal the uninterrupted run's;
  // base tensors of the merged export are the base model's.
  for (const char* tag : {"ref", "r1"}) {
    RunOut m = export_(tag, std::string("merged_") + tag), a = export_(tag, std::string("adapter_") + tag, " --adapter");
    ASSERT_EQ(m.code, 0) << m.output;
    ASSERT_EQ(a.code, 0) << a.output;
  }
  const auto merged_ref = tensors((dir_ / "merged_ref/model.safetensors").string());
  EXPECT_LT(max_diff(merged_ref, tensors((dir_ / "merged_r1/model.safetensors").string())), kWeightTol);
  EXPECT_LT(max_diff(tensors((dir_ / "adapter_ref/adapter_model.safetensors").string()),
                     tensors((dir_ / "adapter_r1/adapter_model.safetensors").string())),
            kWeightTol);
  const auto base = tensors(step_dir("base") + "/model.safetensors");
  ASSERT_TRUE(merged_ref.count("wte.weight") && base.count("wte.weight"));
  EXPECT_EQ(merged_ref.at("wte.weight"), base.at("wte.weight")) << "the merged export's base is not init_from's";
}

// A resume onto another base (another init_from, or none: the seed's initialisation) is refused with
// one line naming both; export and sample refuse a recorded base that is gone or changed.
TEST_F(LoraCheckpoint, RefusesAnotherBaseWithOneLine) {
  train(1, 4, 1, "base", "--train.checkpoint_format full --train.steps 2");
  train(1, 4, 1, "other", "--train.checkpoint_format full --train.steps 2 --train.seed 7");
  train(1, 4, 1, "lora", kLora + "--train.steps 2 --train.init_from " + ck("base"));
  auto resume = [&](const std::string& extra) {
    return run("MESHTRAIN_MPI=0 " + std::string(MT_BINARY) + " train --model.preset gpt2-tiny --data.train " +
               (dir_ / "train.bin").string() + " --data.val '' --train.threads 1 --train.micro_batch 4 --train.steps 3 " +
               kLora + "--train.resume " + ck("lora") + extra);
  };
  auto one_line = [](const std::string& s) {
    size_t n = 0;
    for (char c : s) n += c == '\n';
    return n <= 1;
  };
  for (const std::string& extra : {" --train.init_from " + ck("other"), std::string()}) {
    RunOut r = resume(extra);
    EXPECT_EQ(r.code, 2) << extra << "\n" << r.output;
    EXPECT_NE(r.output.find("holds LoRA adapters only, trained on train.init_from " + step_dir("base")), std::string::npos) << r.output;
    EXPECT_NE(r.output.find(extra.empty() ? "this run's base is the seed 1337 initialisation" : "this run's base is train.init_from " + ck("other")),
              std::string::npos)
        << r.output;
    EXPECT_TRUE(one_line(r.output)) << r.output;
  }
  RunOut ok = resume(" --train.init_from " + ck("base"));
  EXPECT_EQ(ok.code, 0) << ok.output;

  // The recorded base replaced by another model, then gone: export and sample refuse (exit code 2).
  std::filesystem::rename(ck("base"), ck("base_kept"));
  std::filesystem::copy(ck("other"), ck("base"), std::filesystem::copy_options::recursive);
  for (const std::string& cmd : {" export --checkpoint " + ck("lora") + " --out " + (dir_ / "x").string(),
                                " sample --checkpoint " + ck("lora") + " --tokens 4"}) {
    RunOut r = run(std::string(MT_BINARY) + cmd);
    EXPECT_EQ(r.code, 2) << cmd << "\n" << r.output;
    EXPECT_NE(r.output.find("which now holds other weights"), std::string::npos) << r.output;
  }
  std::filesystem::remove_all(ck("base"));
  RunOut gone = run(std::string(MT_BINARY) + " export --checkpoint " + ck("lora") + " --out " + (dir_ / "x").string());
  EXPECT_EQ(gone.code, 2) << gone.output;
  EXPECT_NE(gone.output.find("does not exist: put that base model back at its path"), std::string::npos) << gone.output;
  std::filesystem::rename(ck("base_kept"), ck("base"));
  RunOut back = run(std::string(MT_BINARY) + " export --checkpoint " + ck("lora") + " --out " + (dir_ / "x").string());
  EXPECT_EQ(back.code, 0) << back.output;
}

}  // namespace
}  // namespace mt
