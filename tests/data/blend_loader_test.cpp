// BlendLoader (data.train = "0.7:a/*.bin,0.3:b/*.bin"): parsing and its errors, determinism by seed,
// the weights over many samples, each dataset's own order (and shuffled epochs), disjoint ranks whose
// union is the one-process batch, and exact continuation from a saved state.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "../test_files.h"
#include "data/data_loader.h"
#include "data/token_shards.h"

namespace fs = std::filesystem;
using mt::test::TestDir;
using mt::test::Batch;
using mt::test::take;
using mt::test::write_ramp;

namespace {

// Three datasets: a (two shards), b, c; T = 8. Dataset d's tokens count up from d * 10000 (a's
// second shard from 1000): a row's first token says which dataset and sample it is.
struct ThreeSets {
  TestDir dir;
  std::string spec;
  ThreeSets(double wa = 0.5, double wb = 0.3, double wc = 0.2) {
    fs::create_directories(dir.path / "a");
    fs::create_directories(dir.path / "b");
    fs::create_directories(dir.path / "c");
    write_ramp(dir.file("a/0.bin"), 0, 801);      // 100 samples of T = 8
    write_ramp(dir.file("a/1.bin"), 1000, 405);   // 50 samples
    write_ramp(dir.file("b/0.bin"), 10000, 241);  // 30 samples
    write_ramp(dir.file("c/0.bin"), 20000, 170);  // 21 samples
    spec = std::to_string(wa) + ":" + dir.file("a/*.bin") + "," + std::to_string(wb) + ":" + dir.file("b/*.bin") +
           ", " + std::to_string(wc) + ":" + dir.file("c/0.bin");
  }
};

int dataset_of_token(int32_t t) { return t / 10000; }

}  // namespace

TEST(BlendLoader, ParsesBlendsAndTellsPlainPathsApart) {
  EXPECT_FALSE(mt::is_blend_spec("data/web/*.bin"));
  EXPECT_FALSE(mt::is_blend_spec("data/default/train.bin"));
  EXPECT_FALSE(mt::is_blend_spec("a,b.bin"));
  EXPECT_FALSE(mt::is_blend_spec("C:/data/x.bin"));
  EXPECT_TRUE(mt::is_blend_spec("0.7:data/web/*.bin,0.3:data/books/*.bin"));
  EXPECT_TRUE(mt::is_blend_spec("1:only.bin"));
  const auto b = mt::parse_blend(" 0.7:web/*.bin , 3e-1:books/*.bin", "data.train");
  ASSERT_EQ(b.size(), 2u);
  EXPECT_DOUBLE_EQ(b[0].weight, 0.7);
  EXPECT_EQ(b[0].pattern, "web/*.bin");
  EXPECT_DOUBLE_EQ(b[1].weight, 0.3);
  EXPECT_EQ(b[1].pattern, "books/*.bin");
}

TEST(BlendLoader, BadBlendsNameTheKeyAndTheEntry) {
  auto error_of = [](const std::string& spec) {
    try {
      mt::parse_blend(spec, "data.train");
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  for (const char* bad : {"0:a.bin,1:b.bin", "-0.5:a.bin,1:b.bin", "1:a.bin,0.0:b.bin", "1:a.bin,1e999:b.bin"}) {
    const std::string m = error_of(bad);
    EXPECT_NE(m.find("data.train"), std::string::npos) << bad << ": " << m;
    EXPECT_NE(m.find("must be a positive number"), std::string::npos) << bad << ": " << m;
  }
  std::string m = error_of("0.5:a.bin,b.bin");
  EXPECT_NE(m.find("data.train: blend entry 2 ('b.bin')"), std::string::npos) << m;
  EXPECT_NE(m.find("WEIGHT:PATTERN"), std::string::npos) << m;
  m = error_of("0.5:a.bin,0.5:");
  EXPECT_NE(m.find("blend entry 2"), std::string::npos) << m;
  m = error_of("0.5:a.bin,0.5:a.bin");
  EXPECT_NE(m.find("given twice"), std::string::npos) << m;

  // Files: a pattern matching nothing, a missing file, a dataset too short for one sample.
  TestDir dir;
  write_ramp(dir.file("ok.bin"), 0, 100);
  write_ramp(dir.file("short.bin"), 0, 8);
  auto load_error = [&](const std::string& spec) {
    try {
      mt::BlendLoader l(spec, "data.val", 2, 8, 0, 1, 1, false);
    } catch (const std::runtime_error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  m = load_error("0.5:" + dir.file("ok.bin") + ",0.5:" + dir.file("none/*.bin"));
  EXPECT_NE(m.find("data.val: blend entry 2"), std::string::npos) << m;
  EXPECT_NE(m.find("no file matches"), std::string::npos) << m;
  m = load_error("0.5:" + dir.file("missing.bin") + ",0.5:" + dir.file("ok.bin"));
  EXPECT_NE(m.find("data.val: blend entry 1"), std::string::npos) << m;
  EXPECT_NE(m.find(dir.file("missing.bin")), std::string::npos) << m;
  m = load_error("0.5:" + dir.file("ok.bin") + ",0.5:" + dir.file("short.bin"));
  EXPECT_NE(m.find("data.val: blend entry 2"), std::string::npos) << m;
  EXPECT_NE(m.find("seq_len + 1 = 9"), std::string::npos) << m;
}

TEST(BlendLoader, DeterministicBySeed) {
  ThreeSets s;
  mt::BlendLoader a(s.spec, "data.train", 4, 8, 0, 1, 7, false), b(s.spec, "data.train", 4, 8, 0, 1, 7, false),
      c(s.spec, "data.train", 4, 8, 0, 1, 8, false);
  bool differs = false;
  for (int i = 0; i < 50; ++i) {
    Batch ra = take(a), rb = take(b), rc = take(c);
    EXPECT_EQ(ra.x, rb.x) << "batch " << i;
    EXPECT_EQ(ra.y, rb.y) << "batch " << i;
    differs |= ra.x != rc.x;
  }
  EXPECT_TRUE(differs) << "another seed should draw another mixture";
  a.reset();
  mt::BlendLoader fresh(s.spec, "data.train", 4, 8, 0, 1, 7, false);
  EXPECT_EQ(take(a).x, take(fresh).x);
}

// Each dataset's share of 60000 samples lies within 5 standard deviations of its weight (binomial:
// sd = sqrt(n p (1 - p)), about 120 samples here; a chance failure has probability < 1e-6), and
// every row is one of its dataset's samples, taken in that dataset's own order (wrapping).
TEST(BlendLoader, WeightsRespectedAndEachDatasetReadInOrder) {
  ThreeSets s(7, 2, 1);  // relative weights: 0.7, 0.2, 0.1
  const int B = 16, T = 8, batches = 3750;  // 60000 samples
  mt::BlendLoader l(s.spec, "data.train", B, T, 0, 1, 1337, false);
  EXPECT_NEAR(l.weight(0), 0.7, 1e-12);
  EXPECT_NEAR(l.weight(1), 0.2, 1e-12);
  EXPECT_NEAR(l.weight(2), 0.1, 1e-12);
  // Dataset sample k (unshuffled): a's shard 0 samples 0..99, then a's shard 1 samples 0..49, ...
  auto expect_first = [](int d, int64_t k) -> int32_t {
    if (d == 0) {
      k %= 150;
      return k < 100 ? static_cast<int32_t>(k * 8) : static_cast<int32_t>(1000 + (k - 100) * 8);
    }
    if (d == 1) return static_cast<int32_t>(10000 + (k % 30) * 8);
    return static_cast<int32_t>(20000 + (k % 21) * 8);
  };
  std::vector<int64_t> seen(3, 0);
  for (int i = 0; i < batches; ++i) {
    Batch r = take(l);
    for (int b = 0; b < B; ++b) {
      const int32_t t0 = r.x[static_cast<size_t>(b * T)];
      const int d = dataset_of_token(t0);
      ASSERT_EQ(static_cast<size_t>(d), l.dataset_of(int64_t{i} * B + b));
      ASSERT_EQ(t0, expect_first(d, seen[static_cast<size_t>(d)])) << "dataset " << d << " sample " << seen[d];
      for (int t = 0; t < T; ++t) {  // contiguous tokens, targets shifted by one
        ASSERT_EQ(r.x[static_cast<size_t>(b * T + t)], t0 + t);
        ASSERT_EQ(r.y[static_cast<size_t>(b * T + t)], t0 + t + 1);
      }
      ++seen[static_cast<size_t>(d)];
    }
  }
  const double n = double(B) * batches;
  const double p[3] = {0.7, 0.2, 0.1};
  for (size_t d = 0; d < 3; ++d) {
    EXPECT_EQ(l.dataset_samples(d), seen[d]);
    EXPECT_EQ(l.dataset_tokens(d), seen[d] * T);
    const double sd = std::sqrt(n * p[d] * (1 - p[d]));
    EXPECT_LT(std::abs(double(seen[d]) - n * p[d]), 5 * sd) << "dataset " << d << ": " << seen[d] << " of " << n;
  }
}

// Shuffled: every pass over a dataset (an epoch of that dataset) visits each of its samples once.
TEST(BlendLoader, ShuffledEpochsVisitEverySampleOnce) {
  ThreeSets s;
  const int B = 5, T = 8;
  mt::BlendLoader l(s.spec, "data.train", B, T, 0, 1, 3, true), plain(s.spec, "data.train", B, T, 0, 1, 3, false);
  std::vector<std::vector<int32_t>> order(3);
  bool permuted = false;
  for (int i = 0; i < 400; ++i) {
    Batch r = take(l), q = take(plain);
    for (int b = 0; b < B; ++b) {
      const int32_t t0 = r.x[static_cast<size_t>(b * T)];
      order[static_cast<size_t>(dataset_of_token(t0))].push_back(t0);
      ASSERT_EQ(dataset_of_token(t0), dataset_of_token(q.x[static_cast<size_t>(b * T)]));  // same mixture
      permuted |= t0 != q.x[static_cast<size_t>(b * T)];
    }
  }
  EXPECT_TRUE(permuted);
  const size_t per_epoch[3] = {150, 30, 21};
  for (size_t d = 0; d < 3; ++d) {
    ASSERT_GE(order[d].size(), 2 * per_epoch[d]) << d;
    for (size_t e = 0; e < 2; ++e) {
      std::set<int32_t> distinct(order[d].begin() + static_cast<long>(e * per_epoch[d]),
                                 order[d].begin() + static_cast<long>((e + 1) * per_epoch[d]));
      EXPECT_EQ(distinct.size(), per_epoch[d]) << "dataset " << d << " epoch " << e;
    }
    EXPECT_FALSE(std::equal(order[d].begin(), order[d].begin() + static_cast<long>(per_epoch[d]),
                            order[d].begin() + static_cast<long>(per_epoch[d])))
        << "dataset " << d << ": each epoch draws a new permutation";
  }
}

// Ranks read disjoint samples (no sample twice before a dataset wraps) and one process with
// B' = W * B reads exactly their union: row r*B + b of its batch is rank r's row b.
TEST(BlendLoader, RanksAreDisjointAndTheirUnionIsTheBigBatch) {
  for (bool shuffle : {false, true}) {
    ThreeSets s(1, 1, 1);
    const int B = 3, T = 8, W = 3;
    std::vector<std::unique_ptr<mt::BlendLoader>> ranks;
    for (int r = 0; r < W; ++r)
      ranks.push_back(std::make_unique<mt::BlendLoader>(s.spec, "data.train", B, T, r, W, 11, shuffle));
    mt::BlendLoader one(s.spec, "data.train", B * W, T, 0, 1, 11, shuffle);
    std::set<int32_t> seen;
    for (int i = 0; i < 4; ++i) {  // 36 samples: no dataset (21 or more samples, ~12 drawn each) wraps
      Batch big = take(one);
      for (int r = 0; r < W; ++r) {
        Batch mine = take(*ranks[static_cast<size_t>(r)]);
        for (int k = 0; k < B * T; ++k) {
          ASSERT_EQ(mine.x[static_cast<size_t>(k)], big.x[static_cast<size_t>(r * B * T + k)]) << shuffle;
          ASSERT_EQ(mine.y[static_cast<size_t>(k)], big.y[static_cast<size_t>(r * B * T + k)]) << shuffle;
        }
        for (int b = 0; b < B; ++b)
          EXPECT_TRUE(seen.insert(mine.x[static_cast<size_t>(b * T)]).second) << "sample read twice, rank " << r;
      }
    }
    for (int r = 1; r < W; ++r)
      for (size_t d = 0; d < 3; ++d) EXPECT_EQ(ranks[static_cast<size_t>(r)]->dataset_samples(d), ranks[0]->dataset_samples(d));
  }
}

// A loader restored from another's state continues with exactly its batches (what a resumed run
// does with the state in trainer.json); a changed blend keeps the datasets it still names.
TEST(BlendLoader, RestoredStateContinuesExactly) {
  ThreeSets s;
  for (bool shuffle : {false, true}) {
    mt::BlendLoader a(s.spec, "data.train", 4, 8, 1, 2, 5, shuffle);
    for (int i = 0; i < 37; ++i) take(a);  // past an epoch of b and c
    const mt::BlendLoader::State st = a.state();
    EXPECT_EQ(st.samples, 37 * 8);
    mt::BlendLoader b(s.spec, "data.train", 4, 8, 1, 2, 5, shuffle);
    EXPECT_TRUE(b.set_state(st));
    for (int i = 0; i < 40; ++i) {
      Batch ra = take(a), rb = take(b);
      ASSERT_EQ(ra.x, rb.x) << "batch " << i << " shuffle " << shuffle;
      ASSERT_EQ(ra.y, rb.y) << "batch " << i << " shuffle " << shuffle;
    }
  }
  // The same datasets with other weights: counters are kept by pattern.
  mt::BlendLoader a(s.spec, "data.train", 4, 8, 0, 1, 5, false);
  for (int i = 0; i < 10; ++i) take(a);
  mt::BlendLoader::State st = a.state();
  st.patterns.pop_back();  // as if c had not been in the earlier run
  st.dataset_samples.pop_back();
  mt::BlendLoader c(s.spec, "data.train", 4, 8, 0, 1, 5, false);
  EXPECT_FALSE(c.set_state(st));
  EXPECT_EQ(c.dataset_samples(0), a.dataset_samples(0));
  EXPECT_EQ(c.dataset_samples(2), 0);
}
