// Published training results predicted from their setups alone, within the stated error.
#include <gtest/gtest.h>

#include <cmath>

#include "plan/report.h"
#include "plan/published.h"

namespace mt::plan {
namespace {

TEST(Published, EveryCaseWithinTheStatedError) {
  const auto cases = published_cases();
  ASSERT_GE(cases.size(), 5u);
  for (const auto& c : cases) {
    const PublishedResult r = evaluate_published(c);
    EXPECT_TRUE(r.within) << c.id << ": published " << c.published << " " << metric_name(c.metric) << ", predicted "
                          << r.predicted << " (" << 100 * r.error << "%)";
    EXPECT_LE(std::fabs(r.error), kPublishedTolerance);
    EXPECT_EQ(r.e.world, c.cluster.gpus) << c.id;
    EXPECT_TRUE(r.e.fits || c.system == "llm.c") << c.id;  // llm.c's lean kernels use less than our generic count
  }
}

TEST(Published, TheRequiredCasesArePresent) {
  bool megatron = false, titan8 = false, titan70 = false;
  for (const auto& c : published_cases()) {
    if (c.id == "megatron-gpt3-175b") {
      megatron = true;
      EXPECT_EQ(c.cluster.gpus, 1024);
      EXPECT_EQ(c.layout.tp, 8);
      EXPECT_EQ(c.layout.pp, 16);
      EXPECT_EQ(c.layout.global_batch(), 1536);
      EXPECT_EQ(c.published, 138);
    }
    if (c.id == "torchtitan-llama3-8b-op-sac") {
      titan8 = true;
      EXPECT_EQ(c.cluster.gpus, 64);
    }
    if (c.id == "torchtitan-llama3-70b") {
      titan70 = true;
      EXPECT_EQ(c.layout.checkpointing, Checkpointing::Full);
    }
  }
  EXPECT_TRUE(megatron && titan8 && titan70);
}

TEST(Published, MfuAgreesWithTheSourcesConvention) {
  // torchtitan's MFU uses the same 6N + 12Lhs convention as ours: compare directly.
  for (const auto& c : published_cases())
    if (c.system == "torchtitan") {
      const PublishedResult r = evaluate_published(c);
      EXPECT_NEAR(r.e.mfu / c.published_mfu, 1.0, kPublishedTolerance) << c.id;
    }
}

TEST(Published, CommandPrintsTheTable) {
  const std::string s = format_published(false);
  for (const auto& c : published_cases()) EXPECT_NE(s.find(c.id), std::string::npos);
  EXPECT_NE(s.find("stated error"), std::string::npos);
}

}  // namespace
}  // namespace mt::plan
