// Unpacked, length-grouped data (data.packing = false, data.group_by_length = true): the same
// documents in the same global batches give the same losses and weights on one process (all of a
// step's micro-batches) as on two DDP or FULL_SHARD ranks, under context, pipeline and tensor +
// sequence parallelism and with full recompute, although every micro-batch runs at its own padded
// length; padding to seq_len (fixed shapes) gives the same run; the padding_share and
// trained_tokens metrics are what the loader's batches say; a resumed run continues the same
// batches. Invalid combinations are refused.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "data/document_loader.h"
#include "data/token_shards.h"
#include "harness.h"
#include "model/rng.h"

namespace mt {
namespace {

constexpr double kLossTol = 1e-5, kWeightTol = 2e-5;  // as the DDP parity tests
const std::string kUnpacked =
    " --data.packing false --data.group_by_length true --data.length_group_window 4 --data.pad_to_multiple 4"
    " --data.shuffle true ";

class LengthGroupParity : public ParityFixture {
 protected:
  void SetUp() override {
    ParityFixture::SetUp();
    // Lines (documents: the byte tokenizer's separator is '\n') of 1 to 44 characters, most short.
    Rng r(17);
    std::string text;
    for (int i = 0; i < 600; ++i) {
      const uint64_t u = r.next_u64() % 100;
      const int64_t len = u < 65 ? 1 + static_cast<int64_t>(r.next_u64() % 8) : 9 + static_cast<int64_t>(r.next_u64() % 36);
      for (int64_t k = 0; k < len; ++k) text += static_cast<char>('a' + (i * 7 + k * 3) % 26);
      text += '\n';
    }
    std::vector<int32_t> toks(text.begin(), text.end());
    write_token_shard((dir_ / "train.bin").string(), toks);
  }
  std::vector<nlohmann::json> steps(const std::string& tag) {
    std::vector<nlohmann::json> v;
    std::ifstream f((dir_ / ("m_" + tag + ".jsonl")).string());
    std::string line;
    while (std::getline(f, line)) {
      auto j = nlohmann::json::parse(line);
      if (!j.contains("final")) v.push_back(j);
    }
    return v;
  }
};

TEST_F(LengthGroupParity, TwoRanksAndEveryLayoutMatchOneProcess) {
  // One process, micro_batch 2, 4 micro-batches per step: the global batch of every layout below.
  const RunResult single = train(1, 2, 4, "single", kUnpacked);
  ASSERT_EQ(single.losses.size(), 8u);
  // The metrics: the loader's micro-batches of each step.
  {
    TokenDataset ds((dir_ / "train.bin").string(), 256);
    DocumentBatching o;
    o.B = 2;
    o.T = 32;
    o.accum = 4;
    o.multiple = 4;
    o.separator = '\n';
    o.shuffle = true;
    o.seed = 1337;  // train.seed's default
    o.group_by_length = true;
    o.window = 4;
    DocumentLoader l(ds, o);
    const std::vector<nlohmann::json> got = steps("single");
    ASSERT_EQ(got.size(), 8u);
    double min_share = 1, max_share = 0;
    for (int64_t k = 0; k < 8; ++k) {
      int64_t real = 0, pos = 0;
      for (int m = 0; m < 4; ++m) {
        const std::vector<int64_t> docs = l.micro_batch(0, k, 0, m);
        for (int64_t d : docs) real += l.length(d);
        pos += 2 * l.padded_length(docs);
      }
      const double share = 1.0 - static_cast<double>(real) / static_cast<double>(pos);
      EXPECT_NEAR(got[static_cast<size_t>(k)].at("padding_share").get<double>(), share, 1e-12) << "step " << k + 1;
      EXPECT_EQ(got[static_cast<size_t>(k)].at("trained_tokens").get<int64_t>(), real) << "step " << k + 1;
      min_share = std::min(min_share, share);
      max_share = std::max(max_share, share);
    }
    EXPECT_GT(max_share, 0.0);  // there is padding to leave out
  }
  expect_close(single, train(2, 2, 2, "ddp2", kUnpacked), kLossTol, kWeightTol, "unpacked grouped DDP np=2");
  expect_close(single, train(2, 2, 2, "fsdp2", kUnpacked + "--parallel.strategy FULL_SHARD"), kLossTol, kWeightTol,
               "unpacked grouped FULL_SHARD np=2");
  // One data-parallel rank in every layout below: the same micro-batches as the single process.
  expect_close(single, train(2, 2, 4, "cp2", kUnpacked + "--parallel.cp 2"), kLossTol, kWeightTol, "unpacked cp 2");
  expect_close(single, train(2, 2, 4, "pp2", kUnpacked + "--parallel.pp 2"), kLossTol, kWeightTol, "unpacked pp 2");
  // The zero-bubble schedules: each micro-batch's weight gradients from its own B, however many
  // micro-batches of other lengths ran in between (ZB-V defers W past other F and B on the rank).
  expect_close(single, train(2, 2, 4, "zb1p", kUnpacked + "--parallel.pp 2 --parallel.pp_schedule zb1p"), kLossTol,
               kWeightTol, "unpacked pp 2 zb1p");
  expect_close(single, train(2, 2, 4, "zbv", kUnpacked + "--parallel.pp 2 --parallel.pp_schedule zbv"), kLossTol,
               kWeightTol, "unpacked pp 2 zbv");
  // Two data-parallel replicas of it, sharded: the reduce-scatters fire at each unit's last W.
  expect_close(single,
               train(4, 1, 4, "zbvfs", kUnpacked + "--parallel.pp 2 --parallel.pp_schedule zbv --parallel.strategy FULL_SHARD"),
               kLossTol, kWeightTol, "unpacked pp 2 zbv x FULL_SHARD 2");
  expect_close(single,
               train(2, 2, 4, "intl",
                     kUnpacked + "--parallel.pp 2 --parallel.pp_schedule interleaved_1f1b --parallel.pp_virtual_stages 2"),
               kLossTol, kWeightTol, "unpacked pp 2 interleaved");
  expect_close(single, train(2, 2, 4, "sp2", kUnpacked + "--parallel.tp 2 --parallel.sequence_parallel true"), kLossTol,
               kWeightTol, "unpacked tp 2 + sequence parallel");
  expect_close(single, train(1, 2, 4, "recompute", kUnpacked + "--train.activation_checkpointing full"), kLossTol,
               kWeightTol, "unpacked, full recompute");
  // Every micro-batch padded to seq_len: the same computation at fixed shapes.
  expect_close(single, train(1, 2, 4, "fixed", kUnpacked + "--data.pad_to_multiple 0"), kLossTol, kWeightTol,
               "unpacked padded to seq_len");
}

// The grouping does change the batches (the parity above is not a packed run in disguise), and
// the padding share drops.
TEST_F(LengthGroupParity, GroupingChangesTheBatchesAndLowersThePadding) {
  const RunResult grouped = train(1, 2, 4, "grouped", kUnpacked);
  const RunResult plain = train(1, 2, 4, "plain", kUnpacked + "--data.group_by_length false");
  ASSERT_EQ(grouped.losses.size(), 8u);
  ASSERT_EQ(plain.losses.size(), 8u);
  EXPECT_NE(grouped.losses, plain.losses);
  double g = 0, p = 0;
  for (const auto& j : steps("grouped")) g += j.at("padding_share").get<double>();
  for (const auto& j : steps("plain")) p += j.at("padding_share").get<double>();
  EXPECT_LT(g, 0.7 * p) << "mean padding share grouped " << g / 8 << ", not grouped " << p / 8;
}

// A run stopped after 4 steps and resumed continues with the same batches (the loader's position
// is replayed): steps 5-8 equal those of the uninterrupted run, bit for bit.
TEST_F(LengthGroupParity, ResumeContinuesTheSameBatches) {
  const std::string base = mpirun(2) + MT_BINARY + " train --model.preset gpt2-tiny --data.val '' --train.threads 1" +
                           " --train.micro_batch 2 --train.grad_accum 2 --data.train " + (dir_ / "train.bin").string() +
                           kUnpacked;
  auto go = [&](const std::string& tag, const std::string& args) {
    const RunOut r = run(base + args + " --log.metrics_out " + (dir_ / ("m_" + tag + ".jsonl")).string());
    EXPECT_EQ(r.code, 0) << args << "\n" << r.output;
  };
  go("whole", " --train.steps 8 --train.checkpoint_dir " + (dir_ / "ck_whole").string());
  go("first", " --train.steps 4 --train.checkpoint_dir " + (dir_ / "ck_part").string());
  go("rest", " --train.steps 8 --train.resume latest --train.checkpoint_dir " + (dir_ / "ck_part").string());
  const std::vector<nlohmann::json> whole = steps("whole"), rest = steps("rest");
  ASSERT_EQ(whole.size(), 8u);
  ASSERT_EQ(rest.size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(rest[i].at("loss").get<double>(), whole[i + 4].at("loss").get<double>()) << "step " << i + 5;
    EXPECT_EQ(rest[i].at("padding_share").get<double>(), whole[i + 4].at("padding_share").get<double>());
  }
}

TEST_F(LengthGroupParity, UnsupportedCombinationsAreRefusedWithOneLine) {
  const std::string base = std::string("MESHTRAIN_MPI=0 ") + MT_BINARY +
                           " train --model.preset gpt2-tiny --data.val '' --train.steps 1 --data.train " +
                           (dir_ / "train.bin").string();
  struct Case {
    std::string args, says;
  } cases[] = {
      {" --data.group_by_length true", "data.group_by_length = true groups documents by length, which needs data.packing = false"},
      {" --data.packing false --data.document_masking true", "data.document_masking is for packed rows"},
      {" --data.packing false --data.pad_to_multiple -1", "data.pad_to_multiple must be >= 0"},
      {" --data.packing false --model.moe_experts 4", "data.packing = false does not run mixture-of-experts models"},
      {" --data.packing false --data.train 1:" + (dir_ / "train.bin").string(), "is a blend"},
  };
  for (const Case& c : cases) {
    const RunOut r = run(base + c.args);
    EXPECT_EQ(r.code, 2) << c.args << "\n" << r.output;
    EXPECT_NE(r.output.find(c.says), std::string::npos) << c.args << "\n" << r.output;
  }
}

}  // namespace
}  // namespace mt
