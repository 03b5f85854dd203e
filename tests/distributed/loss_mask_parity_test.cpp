// Loss masks (instruction data) across ranks: with a mask that trains a very different number of
// targets on each rank and in each micro-batch, 2-rank DDP and FULL_SHARD (with gradient
// accumulation) and context parallelism 2 give the same losses and weights as one process on the whole global batch - the
// loss is the mean over the global batch's trained targets, not a mean of per-rank means - and
// the trained_tokens metric is the count the mask file gives.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include "data/token_shards.h"
#include "harness.h"

namespace mt {
namespace {

// As the DDP parity tests (only the order of the gradient sums differs).
constexpr double kLossTol = 1e-5, kWeightTol = 2e-5;

class LossMaskParity : public ParityFixture {
 protected:
  void SetUp() override {
    ParityFixture::SetUp();
    const std::string shard = (dir_ / "train.bin").string();
    const auto n = static_cast<size_t>(read_token_shard_header(shard));
    // Trained in uneven runs: 150 of every 1000 tokens, plus every 7th token - so the two ranks'
    // halves of a global batch (128 tokens each) train very different numbers of targets.
    mask_.resize(n);
    for (size_t i = 0; i < n; ++i) mask_[i] = (i % 1000 < 150 || i % 7 == 0) ? 1 : 0;
    write_mask_shard(mask_shard_path(shard), mask_);
  }
  std::vector<uint8_t> mask_;
};

TEST_F(LossMaskParity, TwoRanksDdpFullShardAndCpMatchOneProcess) {
  const RunResult single = train(1, 8, 1, "single");
  ASSERT_EQ(single.losses.size(), 8u);
  // trained_tokens per step: the mask of the targets (token k*256 + 1 .. k*256 + 256) of step k.
  std::vector<int64_t> expect(8, 0), got;
  for (size_t k = 0; k < 8; ++k)
    for (size_t i = k * 256 + 1; i <= k * 256 + 256; ++i) expect[k] += mask_[i];
  {
    std::ifstream f((dir_ / "m_single.jsonl").string());
    std::string line;
    while (std::getline(f, line)) {
      const auto j = nlohmann::json::parse(line);
      if (!j.contains("final") && j.contains("trained_tokens")) got.push_back(j["trained_tokens"].get<int64_t>());
    }
  }
  EXPECT_EQ(got, expect);
  int64_t total = 0;
  for (int64_t e : expect) total += e;
  EXPECT_EQ(single.final.value("trained_tokens", int64_t{-1}), total);

  expect_close(single, train(2, 4, 1, "ddp2"), kLossTol, kWeightTol, "masked DDP np=2");
  expect_close(single, train(2, 2, 2, "fsdp2_acc2", "--parallel.strategy FULL_SHARD"), kLossTol, kWeightTol,
               "masked FULL_SHARD np=2 accum=2");
  // Context parallelism: each rank holds half of every sequence (and half of its trained targets).
  expect_close(single, train(2, 8, 1, "cp2", "--parallel.cp 2"), kLossTol, kWeightTol, "masked cp 2");
}

// Without its mask the same data trains on every target: the mask does change what is learnt.
TEST_F(LossMaskParity, TheMaskChangesTheWeights) {
  const RunResult masked = train(1, 8, 1, "masked");
  std::filesystem::remove(mask_shard_path((dir_ / "train.bin").string()));
  const RunResult plain = train(1, 8, 1, "plain");
  ASSERT_EQ(masked.weights.size(), plain.weights.size());
  ASSERT_FALSE(masked.weights.empty());
  double max_diff = 0;
  for (size_t i = 0; i < masked.weights.size(); ++i)
    max_diff = std::max(max_diff, static_cast<double>(std::abs(masked.weights[i] - plain.weights[i])));
  EXPECT_GT(max_diff, 100 * kWeightTol);  // far beyond the parity tolerance
}

}  // namespace
}  // namespace mt
