// The straggler rule (train/straggler.h): a rank's busy time (data wait + compute) against the ranks'
// median, the part that makes it slow, and the estimated idle time of the others at collectives.
#include <gtest/gtest.h>

#include "train/straggler.h"

namespace {

std::vector<mt::RankTimes> even(int n, double data, double compute) {
  std::vector<mt::RankTimes> v(static_cast<size_t>(n));
  for (auto& r : v) r = {data + compute + 5, data, compute, 5};
  return v;
}

TEST(Straggler, EvenRanksNameNobody) {
  auto v = even(4, 1.0, 100.0);
  v[2].compute = 110;  // within 1.2x of the median
  EXPECT_TRUE(mt::find_stragglers(v, 1.2, 10.0).empty());
}

TEST(Straggler, SlowDataAndSlowComputeAreNamedWithTheirPart) {
  auto v = even(4, 1.0, 100.0);
  v[3].data_wait = 80;  // waits for its batch
  v[1].compute = 200;   // computes slowly
  const auto s = mt::find_stragglers(v, 1.2, 10.0);
  ASSERT_EQ(s.size(), 2u);
  EXPECT_EQ(s[0].rank, 1);  // slowest first
  EXPECT_EQ(s[0].part, "compute");
  EXPECT_EQ(s[1].rank, 3);
  EXPECT_EQ(s[1].part, "data_wait");
}

TEST(Straggler, TheAbsoluteFloorKeepsNoiseOfTinyStepsQuiet) {
  auto v = even(2, 0.1, 2.0);
  v[1].compute = 4.0;  // twice the other, but 1 ms over the median
  EXPECT_TRUE(mt::find_stragglers(v, 1.2, 10.0).empty());
  EXPECT_EQ(mt::find_stragglers(v, 1.2, 0.5).size(), 1u);
}

TEST(Straggler, IdleAtCollectivesIsTheSlowestBusyTimeMinusOwnCappedByExposed) {
  std::vector<mt::RankTimes> v = {{300, 0, 100, 190}, {300, 180, 100, 10}};
  const auto idle = mt::idle_at_collectives(v);
  EXPECT_DOUBLE_EQ(idle[0], 180.0);
  EXPECT_DOUBLE_EQ(idle[1], 0.0);
  v[0].exposed = 50;  // never more than the time it spent in collectives
  EXPECT_DOUBLE_EQ(mt::idle_at_collectives(v)[0], 50.0);
}

}  // namespace
