// The pipeline's stage cut, in the schedule library (no MPI, no kernels): the balanced cut is the
// best contiguous one, a manual cut is taken as listed, and bad cuts are refused by name.
#include "parallel/layout/pipeline_stages.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

namespace mt::parallel {
namespace {

ModelConfig model(int64_t layers) {
  ModelConfig c = model_preset("gpt2-tiny");
  c.n_layer = layers;
  return c;
}

double max_stage_cost(const std::vector<double>& cost, const StagePartition& p) {
  double m = 0;
  for (auto [a, b] : p.stages) {
    double s = 0;
    for (int u = a; u <= b; ++u) s += cost[static_cast<size_t>(u)];
    m = std::max(m, s);
  }
  return m;
}

// The smallest largest-stage cost over every cut of `cost` into `stages` non-empty contiguous parts.
double best_by_search(const std::vector<double>& cost, size_t first, int stages) {
  if (stages == 1) {
    double s = 0;
    for (size_t u = first; u < cost.size(); ++u) s += cost[u];
    return s;
  }
  double best = std::numeric_limits<double>::infinity(), head = 0;
  for (size_t end = first; end + static_cast<size_t>(stages) <= cost.size(); ++end) {
    head += cost[end];
    best = std::min(best, std::max(head, best_by_search(cost, end + 1, stages - 1)));
  }
  return best;
}

TEST(PipelineStages, BalancedCutIsTheBestContiguousOne) {
  for (int64_t layers : {2, 5, 8}) {
    const ModelConfig c = model(layers);
    const std::vector<double> cost = unit_costs(c);
    ASSERT_EQ(cost.size(), static_cast<size_t>(layers + 2));
    for (int S = 1; S <= static_cast<int>(layers + 2) && S <= 6; ++S) {
      const StagePartition p = partition_stages(c, S);
      ASSERT_EQ(p.stages.size(), static_cast<size_t>(S));
      int next = 0;
      for (auto [a, b] : p.stages) {  // contiguous, non-empty, covering every unit
        EXPECT_EQ(a, next);
        EXPECT_LE(a, b);
        next = b + 1;
      }
      EXPECT_EQ(next, layers + 2);
      EXPECT_NEAR(max_stage_cost(cost, p), best_by_search(cost, 0, S), 1e-6 * best_by_search(cost, 0, S))
          << layers << " layers, " << S << " stages: " << p.describe();
    }
  }
}

TEST(PipelineStages, ManualCutAndOwnership) {
  const ModelConfig c = model(4);
  const StagePartition p = partition_stages(c, 3, "1,2,1");  // embedding joins the first, head the last
  ASSERT_EQ(p.stages.size(), 3u);
  EXPECT_EQ(p.stages[0], std::make_pair(0, 1));
  EXPECT_EQ(p.stages[1], std::make_pair(2, 3));
  EXPECT_EQ(p.stages[2], std::make_pair(4, 5));
  EXPECT_EQ(p.describe(), "units 0-1 | units 2-3 | units 4-5");
  // pp 2 over 4 virtual stages: rank 1 owns stages 1 and 3.
  const StagePartition q = partition_stages(c, 4, "1,1,1,1");
  EXPECT_EQ(stage_units_of_rank(q, 2, 1, 6), (std::vector<char>{0, 0, 1, 0, 1, 1}));
}

TEST(PipelineStages, BadCutsAreRefusedByName) {
  const ModelConfig c = model(2);
  auto error = [&](int S, const std::string& manual) {
    try {
      partition_stages(c, S, manual);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  EXPECT_NE(error(5, "").find("only 4 units"), std::string::npos) << error(5, "");
  EXPECT_NE(error(2, "1,1,0").find("lists 3 stages"), std::string::npos);
  EXPECT_NE(error(2, "1,2").find("assigns 3 blocks"), std::string::npos);
  EXPECT_NE(error(2, "1,x").find("'x' is not a block count"), std::string::npos);
  EXPECT_NE(error(0, "").find(">= 1"), std::string::npos);
}

}  // namespace
}  // namespace mt::parallel
