// DocumentLoader (data.packing = false): one document per sample, padded per micro-batch, the
// ranks' share of a global batch, and length grouping.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>
#include <tuple>
#include <string>
#include <vector>

#include "../test_files.h"
#include "data/document_loader.h"
#include "data/token_shards.h"
#include "model/rng.h"

using mt::test::TestDir;

namespace {

constexpr int32_t kSep = 1;

// Documents of the given lengths: document 0 is `lens[0]` tokens 100, document k > 0 the separator
// then lens[k] - 1 tokens 100 + k % 150.
std::vector<int32_t> corpus(const std::vector<int64_t>& lens) {
  std::vector<int32_t> t;
  for (size_t k = 0; k < lens.size(); ++k)
    for (int64_t i = 0; i < lens[k]; ++i) t.push_back(k > 0 && i == 0 ? kSep : static_cast<int32_t>(100 + k % 150));
  return t;
}

std::vector<int64_t> skewed_lengths(size_t n, uint64_t seed) {
  mt::Rng r(seed);
  std::vector<int64_t> lens;
  for (size_t i = 0; i < n; ++i) {
    const uint64_t u = r.next_u64() % 100;
    lens.push_back(u < 70 ? 2 + static_cast<int64_t>(r.next_u64() % 10) : 10 + static_cast<int64_t>(r.next_u64() % 80));
  }
  return lens;
}

struct Micro {
  int64_t L, real;
  std::vector<int32_t> x, y;
  bool operator<(const Micro& o) const { return std::tie(L, x, y) < std::tie(o.L, o.x, o.y); }
  bool operator==(const Micro& o) const { return L == o.L && x == o.x && y == o.y; }
};

Micro take(mt::DocumentLoader& l, int B, int T) {
  Micro m;
  m.x.resize(static_cast<size_t>(B * T));
  m.y.resize(m.x.size());
  m.L = l.next(m.x.data(), m.y.data(), &m.real);
  return m;
}

}  // namespace

TEST(DocumentLoader, SamplesAreDocumentsPaddedToTheLongestRoundedUp) {
  TestDir dir;
  // The last document's last token is only a target: its sample is 5 tokens. Document 2 is
  // truncated to T = 16.
  mt::write_token_shard(dir.file("d.bin"), corpus({5, 3, 20, 7, 1, 9, 2, 6}));
  mt::TokenDataset ds(dir.file("d.bin"), 256);
  mt::DocumentBatching o;
  o.B = 2;
  o.T = 16;
  o.multiple = 4;
  o.separator = kSep;
  mt::DocumentLoader l(ds, o);
  ASSERT_EQ(l.num_documents(), 8);
  EXPECT_EQ(l.steps_per_epoch(), 4);
  const std::vector<int64_t> want_len = {5, 3, 16, 7, 1, 9, 2, 5};
  for (int64_t d = 0; d < 8; ++d) EXPECT_EQ(l.length(d), want_len[static_cast<size_t>(d)]) << d;

  Micro m = take(l, 2, 16);
  EXPECT_EQ(m.L, 8);  // longest 5, rounded up to 4's multiple
  EXPECT_EQ(m.real, 8);
  const std::vector<int32_t> x0 = {100, 100, 100, 100, 100, 0, 0, 0, kSep, 101, 101, 0, 0, 0, 0, 0};
  const std::vector<int32_t> y0 = {100, 100, 100, 100, kSep, -1, -1, -1, 101, 101, kSep, -1, -1, -1, -1, -1};
  EXPECT_EQ(std::vector<int32_t>(m.x.begin(), m.x.begin() + 16), x0);
  EXPECT_EQ(std::vector<int32_t>(m.y.begin(), m.y.begin() + 16), y0);
  for (size_t i = 16; i < 32; ++i) {  // the rest of the B x T buffers is padding
    EXPECT_EQ(m.x[i], 0);
    EXPECT_EQ(m.y[i], -1);
  }
  m = take(l, 2, 16);
  EXPECT_EQ(m.L, 16);  // the truncated document
  EXPECT_EQ(m.real, 16 + 7);
  EXPECT_EQ(m.y[15], 102);  // truncated: the target of its 16th token is its 17th
  take(l, 2, 16);
  m = take(l, 2, 16);
  EXPECT_EQ(m.L, 8);
  EXPECT_EQ(m.y[8 + 4], 107);  // the shard's last document: its last target is the shard's last token
  m = take(l, 2, 16);  // the next epoch starts over
  EXPECT_EQ(std::vector<int32_t>(m.x.begin(), m.x.begin() + 16), x0);

  o.multiple = 0;  // fixed shapes: every micro-batch is T long
  mt::DocumentLoader fixed(ds, o);
  EXPECT_EQ(take(fixed, 2, 16).L, 16);
}

// Two ranks with accum 2 read, step by step, exactly the micro-batches one process with accum 4
// reads (the same chunks of the same global batch, padded alike), with and without grouping.
TEST(DocumentLoader, RanksReadTheMicroBatchesOneProcessReads) {
  TestDir dir;
  mt::write_token_shard(dir.file("d.bin"), corpus(skewed_lengths(230, 5)));
  mt::TokenDataset ds(dir.file("d.bin"), 256);
  for (bool group : {false, true}) {
    SCOPED_TRACE(group ? "grouped" : "not grouped");
    mt::DocumentBatching o;
    o.B = 3;
    o.T = 64;
    o.separator = kSep;
    o.shuffle = true;
    o.seed = 9;
    o.group_by_length = group;
    o.window = 4;
    o.accum = 4;
    mt::DocumentLoader one(ds, o);
    o.accum = 2;
    o.dp_world = 2;
    o.dp_rank = 0;
    mt::DocumentLoader r0(ds, o);
    o.dp_rank = 1;
    mt::DocumentLoader r1(ds, o);
    const int64_t steps = one.steps_per_epoch() + 3;  // into the second epoch
    for (int64_t k = 0; k < steps; ++k) {
      std::multiset<Micro> a, b;
      for (int m = 0; m < 4; ++m) a.insert(take(one, 3, 64));
      for (int m = 0; m < 2; ++m) {
        b.insert(take(r0, 3, 64));
        b.insert(take(r1, 3, 64));
      }
      ASSERT_TRUE(a == b) << "step " << k;
    }
  }
}

TEST(DocumentLoader, GroupingSortsMegabatchesDeterministically) {
  TestDir dir;
  const std::vector<int64_t> lens = skewed_lengths(1000, 11);
  mt::write_token_shard(dir.file("d.bin"), corpus(lens));
  mt::TokenDataset ds(dir.file("d.bin"), 256);
  mt::DocumentBatching o;
  o.B = 4;
  o.T = 128;
  o.accum = 2;
  o.dp_world = 2;
  o.separator = kSep;
  o.shuffle = true;
  o.seed = 3;
  o.window = 8;
  o.multiple = 1;  // the padding to the longest only
  const int G = 16;
  // Per epoch: padded positions / all positions, and the mean over steps of the ranks' spread
  // (most minus least padded positions of a rank in the step, over the mean).
  auto measure = [&](const mt::DocumentLoader& l, int64_t epoch, double* padding, double* spread) {
    int64_t real = 0, pos = 0;
    double spread_sum = 0;
    std::set<int64_t> seen;
    for (int64_t k = 0; k < l.steps_per_epoch(); ++k) {
      std::vector<int64_t> per_rank(2, 0);
      for (int r = 0; r < 2; ++r)
        for (int m = 0; m < 2; ++m) {
          const std::vector<int64_t> docs = l.micro_batch(epoch, k, r, m);
          const int64_t L = l.padded_length(docs);
          for (int64_t d : docs) {
            real += l.length(d);
            EXPECT_TRUE(seen.insert(d).second) << "document " << d << " twice in an epoch";
          }
          pos += 4 * L;
          per_rank[static_cast<size_t>(r)] += 4 * L;
        }
      spread_sum += static_cast<double>(std::max(per_rank[0], per_rank[1]) - std::min(per_rank[0], per_rank[1])) /
                    (0.5 * static_cast<double>(per_rank[0] + per_rank[1]));
    }
    EXPECT_EQ(static_cast<int64_t>(seen.size()), l.steps_per_epoch() * G);
    *padding = 1.0 - static_cast<double>(real) / static_cast<double>(pos);
    *spread = spread_sum / static_cast<double>(l.steps_per_epoch());
  };
  mt::DocumentLoader plain(ds, o);
  o.group_by_length = true;
  mt::DocumentLoader grouped(ds, o), again(ds, o);
  o.seed = 4;
  mt::DocumentLoader other_seed(ds, o);
  EXPECT_EQ(grouped.steps_per_epoch(), 1000 / G);
  double pad_plain, spread_plain, pad_grouped, spread_grouped;
  measure(plain, 0, &pad_plain, &spread_plain);
  measure(grouped, 1, &pad_grouped, &spread_grouped);
  EXPECT_LT(pad_grouped, 0.5 * pad_plain) << pad_grouped << " vs " << pad_plain;
  EXPECT_LT(spread_grouped, 0.5 * spread_plain) << spread_grouped << " vs " << spread_plain;
  // Inside a megabatch (8 global batches) the global batches hold disjoint length ranges.
  for (int64_t mb = 0; mb < grouped.steps_per_epoch() / 8; ++mb) {
    std::vector<std::pair<int64_t, int64_t>> range;  // (shortest, longest) per global batch
    for (int64_t k = mb * 8; k < mb * 8 + 8; ++k) {
      int64_t lo = 1 << 30, hi = 0;
      for (int r = 0; r < 2; ++r)
        for (int m = 0; m < 2; ++m)
          for (int64_t d : grouped.micro_batch(0, k, r, m)) {
            lo = std::min(lo, grouped.length(d));
            hi = std::max(hi, grouped.length(d));
          }
      range.emplace_back(lo, hi);
    }
    for (size_t i = 0; i < range.size(); ++i)
      for (size_t j = 0; j < range.size(); ++j)
        if (i != j) {
          EXPECT_TRUE(range[i].second <= range[j].first || range[j].second <= range[i].first);
        }
    // and the batch order is shuffled, not longest first
    bool sorted = true;
    for (size_t i = 1; i < range.size(); ++i) sorted &= range[i].second <= range[i - 1].first;
    EXPECT_FALSE(sorted) << "megabatch " << mb;
  }
  // Deterministic by seed; another seed gives another order.
  bool same = true, differs = false;
  for (int64_t k = 0; k < grouped.steps_per_epoch(); ++k) {
    same &= grouped.micro_batch(0, k, 1, 1) == again.micro_batch(0, k, 1, 1);
    differs |= grouped.micro_batch(0, k, 1, 1) != other_seed.micro_batch(0, k, 1, 1);
  }
  EXPECT_TRUE(same);
  EXPECT_TRUE(differs);
}

TEST(DocumentLoader, TooFewDocumentsForAGlobalBatchIsRefused) {
  TestDir dir;
  mt::write_token_shard(dir.file("d.bin"), corpus({4, 4, 4}));
  mt::TokenDataset ds(dir.file("d.bin"), 256);
  mt::DocumentBatching o;
  o.B = 2;
  o.T = 8;
  o.dp_world = 2;
  o.separator = kSep;
  try {
    mt::DocumentLoader l(ds, o);
    FAIL() << "accepted 3 documents for a global batch of 4";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("3 documents, fewer than one global batch of 4"), std::string::npos) << e.what();
  }
}
