// TokenDataset / BatchLoader (llm.c batching across data-parallel ranks) and `meshtrain prepare`.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "../cli/run_command.h"
#include "../test_files.h"
#include "cli/data_commands.h"
#include "data/data_loader.h"
#include "data/token_shards.h"

namespace fs = std::filesystem;
using mt::test::TestDir;
using mt::test::Batch;
using mt::test::take;
using mt::test::write_ramp;

TEST(DataLoader, SingleRankReadsContiguousBatchesAndWraps) {
  TestDir dir;
  const int B = 2, T = 4;
  write_ramp(dir.file("d.bin"), 0, 3 * B * T + 5);  // 3 batches, 4 tokens left over
  mt::TokenDataset ds(dir.file("d.bin"), 1000);
  EXPECT_EQ(ds.num_shards(), 1u);
  EXPECT_EQ(ds.total_tokens(), 3 * B * T + 5);
  mt::BatchLoader l(ds, B, T);
  EXPECT_EQ(l.batches_per_epoch(), 3);
  std::vector<Batch> epoch;
  for (int k = 0; k < 3; ++k) {
    Batch b = take(l);
    for (int i = 0; i < B * T; ++i) {
      EXPECT_EQ(b.x[static_cast<size_t>(i)], k * B * T + i);
      EXPECT_EQ(b.y[static_cast<size_t>(i)], k * B * T + i + 1);
    }
    epoch.push_back(b);
  }
  // Wrap-around: the fourth batch is the first again, and so on.
  for (int k = 0; k < 3; ++k) {
    Batch b = take(l);
    EXPECT_EQ(b.x, epoch[static_cast<size_t>(k)].x) << k;
    EXPECT_EQ(b.y, epoch[static_cast<size_t>(k)].y) << k;
  }
  take(l);
  l.reset();
  EXPECT_EQ(l.shard_index(), 0u);
  EXPECT_EQ(l.batch_index(), 0);
  EXPECT_EQ(take(l).x, epoch[0].x);
  l.seek(0, 2);
  EXPECT_EQ(take(l).x, epoch[2].x);
  EXPECT_EQ(l.batch_index(), 0);  // wrapped
  EXPECT_THROW(l.seek(0, 3), std::out_of_range);
  EXPECT_THROW(l.seek(1, 0), std::out_of_range);
}

TEST(DataLoader, RanksAreDisjointAndTheirUnionIsTheBigBatch) {
  TestDir dir;
  const int W = 4, B = 2, T = 8;
  // Three shards of uneven length, written out of name order; the glob sorts them.
  write_ramp(dir.file("shard_002.bin"), 20000, 2 * W * B * T + 30);  // 2 global batches
  write_ramp(dir.file("shard_000.bin"), 0, 3 * W * B * T + 1);       // 3 (exactly enough)
  write_ramp(dir.file("shard_001.bin"), 10000, W * B * T + 30);      // 1
  mt::TokenDataset ds(dir.file("shard_*.bin"), 50257);
  ASSERT_EQ(ds.num_shards(), 3u);
  EXPECT_EQ(ds.shard(0).path(), dir.file("shard_000.bin"));
  EXPECT_EQ(ds.shard(2).path(), dir.file("shard_002.bin"));

  std::vector<mt::BatchLoader> ranks;
  for (int r = 0; r < W; ++r) ranks.emplace_back(ds, B, T, r, W);
  mt::BatchLoader big(ds, W * B, T);  // one process with B' = W*B
  EXPECT_EQ(big.batches_per_epoch(), 6);
  for (int r = 0; r < W; ++r) EXPECT_EQ(ranks[static_cast<size_t>(r)].batches_per_epoch(), 6);

  const int steps = 2 * 6 + 3;  // over two epochs: crosses every shard boundary and wraps twice
  const int expected_first[6] = {0, W * B * T, 2 * W * B * T, 10000, 20000, 20000 + W * B * T};
  for (int k = 0; k < steps; ++k) {
    const Batch whole = take(big);
    EXPECT_EQ(whole.x[0], expected_first[k % 6]) << "step " << k;
    std::set<int32_t> seen;
    for (int r = 0; r < W; ++r) {
      const Batch part = take(ranks[static_cast<size_t>(r)]);
      // Rank r's rows are rows r*B .. r*B+B-1 of the big batch, inputs and targets alike.
      for (int i = 0; i < B * T; ++i) {
        ASSERT_EQ(part.x[static_cast<size_t>(i)], whole.x[static_cast<size_t>(r * B * T + i)])
            << "step " << k << " rank " << r << " i " << i;
        ASSERT_EQ(part.y[static_cast<size_t>(i)], whole.y[static_cast<size_t>(r * B * T + i)])
            << "step " << k << " rank " << r << " i " << i;
        EXPECT_EQ(part.y[static_cast<size_t>(i)], part.x[static_cast<size_t>(i)] + 1);
        EXPECT_TRUE(seen.insert(part.x[static_cast<size_t>(i)]).second) << "token read twice at step " << k;
      }
    }
    EXPECT_EQ(seen.size(), static_cast<size_t>(W * B * T));  // disjoint, and together the whole batch
  }
}

// data.shuffle: every epoch visits each shard once and, within it, samples (T + 1 tokens starting
// at multiples of T) in a permuted order; ranks stay disjoint and their union is the big batch;
// epochs differ; the same seed gives the same order.
TEST(DataLoader, ShuffledEpochsKeepRanksDisjointAndTheUnionTheBigBatch) {
  TestDir dir;
  const int W = 2, B = 2, T = 8;
  write_ramp(dir.file("shard_000.bin"), 0, 5 * W * B * T + 1);      // 5 global batches, 20 samples
  write_ramp(dir.file("shard_001.bin"), 10000, 3 * W * B * T + 20);  // 3 global batches, 14 samples
  mt::TokenDataset ds(dir.file("shard_*.bin"));
  std::vector<mt::BatchLoader> ranks;
  for (int r = 0; r < W; ++r) {
    ranks.emplace_back(ds, B, T, r, W);
    ranks.back().set_shuffle(7);
  }
  mt::BatchLoader big(ds, W * B, T);
  big.set_shuffle(7);
  mt::BatchLoader again(ds, W * B, T);
  again.set_shuffle(7);
  mt::BatchLoader other_seed(ds, W * B, T);
  other_seed.set_shuffle(8);
  const int per_epoch = 8;
  std::vector<std::vector<int32_t>> epoch_starts(2);
  bool differs_from_other_seed = false;
  for (int e = 0; e < 2; ++e) {
    std::set<int32_t> sample_starts;
    for (int k = 0; k < per_epoch; ++k) {
      const Batch whole = take(big);
      EXPECT_EQ(take(again).x, whole.x) << "same seed, same order";
      differs_from_other_seed |= take(other_seed).x != whole.x;
      for (int r = 0; r < W; ++r) {
        const Batch part = take(ranks[static_cast<size_t>(r)]);
        for (int i = 0; i < B * T; ++i) {
          ASSERT_EQ(part.x[static_cast<size_t>(i)], whole.x[static_cast<size_t>(r * B * T + i)]) << "epoch " << e << " k " << k;
          ASSERT_EQ(part.y[static_cast<size_t>(i)], whole.y[static_cast<size_t>(r * B * T + i)]);
        }
      }
      for (int row = 0; row < W * B; ++row) {
        const int32_t first = whole.x[static_cast<size_t>(row * T)];
        EXPECT_EQ(first % 10000 % T, 0) << "a sample starts at a multiple of T";
        for (int t = 0; t < T; ++t) {  // T consecutive tokens, targets shifted by one
          EXPECT_EQ(whole.x[static_cast<size_t>(row * T + t)], first + t);
          EXPECT_EQ(whole.y[static_cast<size_t>(row * T + t)], first + t + 1);
        }
        EXPECT_TRUE(sample_starts.insert(first).second) << "sample read twice in epoch " << e;
        epoch_starts[static_cast<size_t>(e)].push_back(first);
      }
    }
    EXPECT_EQ(sample_starts.size(), static_cast<size_t>(per_epoch * W * B));
  }
  EXPECT_NE(epoch_starts[0], epoch_starts[1]) << "each epoch draws a new order";
  EXPECT_TRUE(differs_from_other_seed);
  // Not shuffled: the contiguous order, which the shuffled reader's samples tile exactly.
  mt::BatchLoader plain(ds, W * B, T);
  EXPECT_EQ(take(plain).x[0], 0);
}

TEST(DataLoader, TooShortShardNamesTheFile) {
  TestDir dir;
  write_ramp(dir.file("long.bin"), 0, 1000);
  write_ramp(dir.file("short.bin"), 0, 64);  // exactly B*T for B=4, T=16: one token short
  mt::TokenDataset ds(dir.file("*.bin"));
  EXPECT_NO_THROW(mt::BatchLoader(ds, 3, 16));  // 49 tokens needed
  try {
    mt::BatchLoader l(ds, 4, 16);
    FAIL() << "expected an error";
  } catch (const std::runtime_error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(dir.file("short.bin")), std::string::npos) << msg;
    EXPECT_NE(msg.find("longer than the data"), std::string::npos) << msg;
    EXPECT_NE(msg.find("65"), std::string::npos) << msg;
  }
  // Enough for one rank's batch but not for the global batch of 2 ranks.
  try {
    mt::BatchLoader l(ds, 2, 16, 1, 2);
    FAIL() << "expected an error";
  } catch (const std::runtime_error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(dir.file("short.bin")), std::string::npos) << msg;
    EXPECT_NE(msg.find("dp_world*B*T+1 = 65"), std::string::npos) << msg;
  }
  EXPECT_THROW(mt::BatchLoader(ds, 0, 16), std::invalid_argument);
  EXPECT_THROW(mt::BatchLoader(ds, 1, 16, 2, 2), std::invalid_argument);
}

TEST(DataLoader, DatasetErrorsNameThePatternOrFile) {
  TestDir dir;
  const std::string pattern = dir.file("nothing_*.bin");
  try {
    mt::TokenDataset ds(pattern);
    FAIL() << "expected an error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find(pattern), std::string::npos) << e.what();
  }
  try {
    mt::TokenDataset ds(dir.file("missing.bin"));
    FAIL() << "expected an error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find(dir.file("missing.bin")), std::string::npos) << e.what();
  }
  write_ramp(dir.file("ok.bin"), 0, 100);
  write_ramp(dir.file("toobig.bin"), 250, 10);
  try {
    mt::TokenDataset ds(dir.file("*.bin"), 256);
    FAIL() << "expected an error";
  } catch (const std::runtime_error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(dir.file("toobig.bin")), std::string::npos) << msg;
    EXPECT_NE(msg.find("token id 256"), std::string::npos) << msg;
    EXPECT_NE(msg.find("byte offset 1036"), std::string::npos) << msg;
  }
}

TEST(PrepareCommand, ByteTokenizerConcatenatesInputsAndSplits) {
  TestDir dir;
  std::ofstream(dir.file("b.txt")) << "world";
  std::ofstream(dir.file("a.txt")) << "hello ";
  std::ofstream(dir.file("c.txt")) << std::string(88, 'x');
  const std::string out_dir = dir.file("out/nested");
  std::string out, err;
  // A quoted glob (a.txt, b.txt sorted) plus a further --input: 6 + 1 + 5 + 1 + 88 = 101 tokens.
  ASSERT_EQ(run_cmd(mt::run_prepare_command,
                    {"prepare", "--input", dir.file("[ab].txt"), "--input=" + dir.file("c.txt"), "--out", out_dir,
                     "--tokenizer", "byte", "--val-fraction", "0.2"},
                    &out, &err),
            0)
      << err;
  EXPECT_NE(out.find("3 input files"), std::string::npos) << out;
  EXPECT_NE(out.find("101 tokens"), std::string::npos) << out;
  const auto train = mt::read_token_shard(out_dir + "/train.bin", 256);
  const auto val = mt::read_token_shard(out_dir + "/val.bin", 256);
  EXPECT_EQ(train.size(), 81u);
  EXPECT_EQ(val.size(), 20u);
  std::string all(train.begin(), train.end());
  all.append(val.begin(), val.end());
  EXPECT_EQ(all, "hello \nworld\n" + std::string(88, 'x'));

  // Bare arguments after --input are more inputs (an unquoted shell glob); default val fraction 0.1.
  ASSERT_EQ(run_cmd(mt::run_prepare_command,
                    {"prepare", "--tokenizer=byte", "--out", out_dir, "--input", dir.file("c.txt"), dir.file("a.txt")},
                    &out, &err),
            0)
      << err;
  EXPECT_EQ(mt::read_token_shard_header(out_dir + "/train.bin") + mt::read_token_shard_header(out_dir + "/val.bin"),
            95);
  EXPECT_EQ(mt::read_token_shard_header(out_dir + "/val.bin"), 9);
}

TEST(PrepareCommand, Gpt2SeparatesFilesWithEndOfText) {
  const std::string gpt2_dir = std::string(MT_SOURCE_DIR) + "/assets/gpt2";
  TestDir dir;
  std::ofstream(dir.file("1.txt")) << "Hello world";
  std::ofstream(dir.file("2.txt")) << " Hello World!";
  std::string out, err;
  ASSERT_EQ(run_cmd(mt::run_prepare_command,
                    {"prepare", "--input", dir.file("*.txt"), "--out", dir.file("o"), "--tokenizer", "gpt2",
                     "--gpt2-dir", gpt2_dir, "--val-fraction", "0"},
                    &out, &err),
            0)
      << err;
  const auto train = mt::read_token_shard(dir.file("o/train.bin"), 50257);
  EXPECT_EQ(std::vector<int32_t>(train.begin(), train.end()), (std::vector<int32_t>{15496, 995, 50256, 18435, 2159, 0}));
  EXPECT_EQ(mt::read_token_shard_header(dir.file("o/val.bin")), 0);
}

TEST(PrepareCommand, HelpAndErrors) {
  TestDir dir;
  std::string out, err;
  EXPECT_EQ(run_cmd(mt::run_prepare_command, {"prepare", "--help"}, &out, &err), 0);
  EXPECT_NE(out.find("usage: meshtrain prepare"), std::string::npos);
  for (const char* flag : {"--input", "--out", "--tokenizer", "--gpt2-dir", "--val-fraction", "MESHTRAIN_GPT2_DIR",
                           "--jsonl-field", "--shard-tokens", "--skip-bad", "--tokenizer-file"})
    EXPECT_NE(out.find(flag), std::string::npos) << flag;
  EXPECT_EQ(run_cmd(mt::run_prepare_command, {"prepare", "-h"}, &out, &err), 0);

  std::ofstream(dir.file("t.txt")) << "some text";
  struct Case {
    std::vector<std::string> args;
    std::string needle;
  };
  const std::vector<Case> cases = {
      {{"prepare", "--out", dir.file("o"), "--tokenizer", "byte"}, "--input"},
      {{"prepare", "--input", dir.file("t.txt"), "--tokenizer", "byte"}, "--out"},
      {{"prepare", "--input", dir.file("t.txt"), "--out", dir.file("o")}, "--tokenizer"},
      {{"prepare", "--input", dir.file("zz_*.txt"), "--out", dir.file("o"), "--tokenizer", "byte"},
       dir.file("zz_*.txt")},
      {{"prepare", "--input", dir.file("nope.txt"), "--out", dir.file("o"), "--tokenizer", "byte"},
       dir.file("nope.txt")},
      {{"prepare", "--input", dir.file("t.txt"), "--out", dir.file("o"), "--tokenizer", "wordpiece"}, "wordpiece"},
      {{"prepare", "--input", dir.file("t.txt"), "--out", dir.file("o"), "--tokenizer", "byte", "--val-fraction",
        "1.5"},
       "--val-fraction"},
      {{"prepare", "--input", dir.file("t.txt"), "--out", dir.file("o"), "--tokenizer", "byte", "--val-fraction",
        "abc"},
       "--val-fraction"},
      {{"prepare", "--input", dir.file("t.txt"), "--out", dir.file("o"), "--tokenizer", "byte", "--frobnicate"},
       "--frobnicate"},
  };
  for (const auto& c : cases) {
    EXPECT_EQ(run_cmd(mt::run_prepare_command, c.args, &out, &err), 2) << c.needle;
    EXPECT_NE(err.find(c.needle), std::string::npos) << "stderr should name '" << c.needle << "': " << err;
    EXPECT_TRUE(out.empty()) << out;
  }
  EXPECT_FALSE(fs::exists(dir.file("o/train.bin")));
}
