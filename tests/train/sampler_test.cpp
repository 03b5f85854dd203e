// `meshtrain sample` and generate(): a model trained on a cyclic text continues the cycle greedily;
// a checkpoint and its model.safetensors (with --model) sample the same text; top-k 1 is greedy;
// the seed decides the sampled text; the stop token ends it; bad arguments are clear errors.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

#include "../cli/run_command.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/export.h"
#include "cli/commands.h"
#include "data/token_shards.h"
#include "train/config.h"
#include "train/sampler.h"
#include "train/trainer.h"

namespace fs = std::filesystem;

namespace mt {
namespace {

class Sampler : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = fs::temp_directory_path() / ("mt_sampler_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    std::string text;
    for (int i = 0; i < 600; ++i) text += "abcdefghij";
    std::vector<int32_t> toks(text.begin(), text.end());
    write_token_shard((dir_ / "train.bin").string(), toks);
    RunConfig cfg = RunConfig::load(
        "", {{"model.preset", "gpt2-tiny"}, {"data.train", (dir_ / "train.bin").string()}, {"data.val", ""},
             {"train.steps", "80"}, {"train.micro_batch", "8"}, {"train.warmup_steps", "5"}, {"train.lr", "3e-3"},
             {"train.threads", "1"}, {"train.checkpoint_dir", (dir_ / "ck").string()}, {"log.print_every", "1000"}});
    TrainResult r = train(cfg);
    ASSERT_LT(r.losses.back(), 0.5);  // the cycle is learnt
  }
  static void TearDownTestSuite() { fs::remove_all(dir_); }
  static std::string sample(std::vector<std::string> extra, int* rc = nullptr, std::string* err = nullptr) {
    std::vector<std::string> args = {"sample", "--prompt", "abc", "--tokens", "20", "--threads", "1"};
    args.insert(args.end(), extra.begin(), extra.end());
    std::string out;
    const int code = run_cmd(cli::run_sample_command, args, &out, err);
    if (rc) *rc = code;
    return out;
  }
  static fs::path dir_;
};
fs::path Sampler::dir_;

TEST_F(Sampler, GreedyContinuesTheLearntCycle) {
  const std::string out = sample({"--checkpoint", (dir_ / "ck").string(), "--temperature", "0"});
  EXPECT_EQ(out, "abcdefghijabcdefghijabc\n");
}

TEST_F(Sampler, WeightsFileSamplesLikeItsCheckpoint) {
  const std::string ck = resolve_checkpoint((dir_ / "ck").string());
  const std::string hf = (dir_ / "hf").string();  // the checkpoint's weights as one Hugging Face file
  export_checkpoint(ck, load_checkpoint_config(ck).model_config(), hf, int64_t{1} << 40);
  for (const char* t : {"0", "0.8"}) {
    const std::string a = sample({"--checkpoint", ck, "--temperature", t, "--seed", "3"});
    const std::string b =
        sample({"--weights", hf + "/model.safetensors", "--model", "gpt2-tiny", "--temperature", t, "--seed", "3"});
    EXPECT_EQ(a, b) << "temperature " << t;
  }
}

TEST_F(Sampler, TopKOneIsGreedyAndTheSeedDecides) {
  Transformer m(model_preset("gpt2-tiny"), DType::F32);
  load_checkpoint(resolve_checkpoint((dir_ / "ck").string()), m, m.weights().f32(), nullptr, nullptr);
  const std::vector<int32_t> prompt = {'a'};
  SampleOptions greedy;
  greedy.tokens = 15;
  greedy.temperature = 0;
  SampleOptions k1 = greedy;
  k1.temperature = 1.5f;
  k1.top_k = 1;
  const auto g = generate(m, prompt, greedy);
  EXPECT_EQ(g.size(), 16u);  // prompt + tokens
  EXPECT_EQ(generate(m, prompt, k1), g);
  // A hot distribution over the whole vocabulary: the seed decides, and the same seed repeats.
  SampleOptions hot;
  hot.tokens = 30;
  hot.temperature = 20.0f;
  hot.seed = 1;
  const auto s1 = generate(m, prompt, hot);
  EXPECT_EQ(generate(m, prompt, hot), s1);
  hot.seed = 2;
  EXPECT_NE(generate(m, prompt, hot), s1);
  // A stop token ends the text: after 'a', greedy gives 'b' next.
  const auto stopped = generate(m, prompt, greedy, 'c');
  EXPECT_EQ(stopped, (std::vector<int32_t>{'a', 'b', 'c'}));
}

TEST_F(Sampler, BadArgumentsAreClearErrors) {
  int rc = 0;
  std::string err;
  sample({}, &rc, &err);
  EXPECT_EQ(rc, 2);
  EXPECT_NE(err.find("--checkpoint"), std::string::npos) << err;
  sample({"--weights", (dir_ / "x.safetensors").string()}, &rc, &err);
  EXPECT_EQ(rc, 2);
  EXPECT_NE(err.find("--model"), std::string::npos) << err;
  sample({"--weights", (dir_ / "missing.safetensors").string(), "--model", "gpt2-tiny"}, &rc, &err);
  EXPECT_EQ(rc, 1);
  EXPECT_NE(err.find("missing.safetensors"), std::string::npos) << err;
  sample({"--weights", (dir_ / "x.safetensors").string(), "--model", "no-such-model"}, &rc, &err);
  EXPECT_EQ(rc, 1);
  EXPECT_NE(err.find("no-such-model"), std::string::npos) << err;
}

}  // namespace
}  // namespace mt
