// The expert-parallel groups' layout (ParallelGroups::build's ep / edp colourings) over the mesh
// pp x dp_replicate x dp_shard x cp x tp, with tensor, context and pipeline parallelism: every world
// rank's coordinates are computed here from the mesh's row-major order (tp fastest), and each group
// must be what docs/moe.md says: ep = a block of ep consecutive data-parallel ranks of one stage,
// cp rank and tp rank, ordered by dp rank; edp = the data-parallel ranks of one stage and tp rank
// at the same place in their blocks, with every cp rank.
#include <gtest/gtest.h>

#include <array>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "parallel/mesh.h"

namespace mt {
namespace {

struct Coord {
  int stage = 0, dp = 0, cp = 0, tp = 0;
};

TEST(ExpertGroups, EpAndEdpGroupsFollowTheMeshWithTensorContextAndPipelineParallelism) {
  // pp, dp_replicate, dp_shard, cp, tp, ep
  const std::vector<std::array<int, 6>> cases = {{1, 1, 2, 1, 2, 2}, {1, 1, 4, 1, 2, 2}, {2, 1, 4, 1, 2, 2},
                                                 {1, 2, 2, 1, 2, 2}, {2, 2, 2, 1, 2, 4}, {1, 1, 8, 1, 1, 4},
                                                 {1, 1, 6, 1, 4, 3}, {1, 1, 2, 2, 1, 2}, {2, 1, 4, 2, 2, 2},
                                                 {1, 2, 2, 3, 2, 4}};
  for (const auto& cs : cases) {
    ParallelPlan d;
    d.pp = cs[0];
    d.dp_replicate = cs[1];
    d.dp_shard = cs[2];
    d.cp = cs[3];
    d.tp = cs[4];
    d.ep = cs[5];
    const std::string what = "pp " + std::to_string(d.pp) + " dp " + std::to_string(d.dp_replicate) + "x" +
                             std::to_string(d.dp_shard) + " cp " + std::to_string(d.cp) + " tp " +
                             std::to_string(d.tp) + " ep " + std::to_string(d.ep);
    std::map<int, Coord> at;
    for (int s = 0; s < d.pp; ++s)
      for (int rep = 0; rep < d.dp_replicate; ++rep)
        for (int sh = 0; sh < d.dp_shard; ++sh)
          for (int c = 0; c < d.cp; ++c)
            for (int t = 0; t < d.tp; ++t) {
              const int r = (((s * d.dp_replicate + rep) * d.dp_shard + sh) * d.cp + c) * d.tp + t;
              at[r] = Coord{s, rep * d.dp_shard + sh, c, t};  // dp rank as ParallelGroups::data_rank
            }
    ASSERT_EQ(static_cast<int>(at.size()), d.world()) << what;
    std::map<int, std::map<int, int>> ep, edp;  // colour -> key -> world rank
    for (const auto& [r, c] : at) {
      const auto [ec, ek] = ep_color_key(d, r);
      const auto [dc, dk] = edp_color_key(d, r);
      EXPECT_TRUE(ep[ec].emplace(ek, r).second) << what << ": two ranks with one key in an ep group";
      EXPECT_TRUE(edp[dc].emplace(dk, r).second) << what << ": two ranks with one key in an edp group";
    }
    EXPECT_EQ(static_cast<int>(ep.size()), d.world() / d.ep) << what;
    EXPECT_EQ(static_cast<int>(edp.size()), d.world() / (d.dp() / d.ep * d.cp)) << what;
    for (const auto& group : ep) {
      const std::map<int, int>& members = group.second;
      ASSERT_EQ(static_cast<int>(members.size()), d.ep) << what;
      const Coord first = at[members.begin()->second];
      for (const auto& [key, r] : members) {
        const Coord c = at[r];
        EXPECT_EQ(c.stage, first.stage) << what << ": an ep group spans stages";
        EXPECT_EQ(c.tp, first.tp) << what << ": an ep group spans tp ranks";
        EXPECT_EQ(c.cp, first.cp) << what << ": an ep group spans cp ranks (they route other tokens)";
        EXPECT_EQ(c.dp / d.ep, first.dp / d.ep) << what << ": an ep group is not one block of dp ranks";
        EXPECT_EQ(key, c.dp % d.ep) << what << ": ep rank is not the place in the block";
      }
    }
    for (const auto& group : edp) {
      const std::map<int, int>& members = group.second;
      ASSERT_EQ(static_cast<int>(members.size()), d.dp() / d.ep * d.cp) << what;
      const Coord first = at[members.begin()->second];
      for (const auto& [key, r] : members) {
        const Coord c = at[r];
        EXPECT_EQ(c.stage, first.stage) << what;
        EXPECT_EQ(c.tp, first.tp) << what << ": an edp group spans tp ranks (they hold other slices)";
        EXPECT_EQ(c.dp % d.ep, first.dp % d.ep) << what << ": an edp group holds different experts";
        EXPECT_EQ(key, c.dp / d.ep * d.cp + c.cp) << what;
      }
    }
  }
}

}  // namespace
}  // namespace mt
