// `meshtrain schedule` (cli/schedule.cpp): the table, the check, peaks and bubble; bad flags.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "parallel/layout/pipeline_schedule.h"

namespace {

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace

namespace {
int run(std::vector<std::string> args, std::string* out = nullptr) {
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  testing::internal::CaptureStdout();
  testing::internal::CaptureStderr();
  const int rc = mt::cli::run_schedule_command(static_cast<int>(argv.size()), argv.data());
  const std::string o = testing::internal::GetCapturedStdout();
  const std::string e = testing::internal::GetCapturedStderr();
  if (out) *out = o + e;
  return rc;
}
}  // namespace

TEST(ScheduleCommand, PrintsTableCheckPeaksAndBubble) {
  std::string out;
  EXPECT_EQ(run({"schedule", "--pp", "4", "--microbatches", "8", "--schedule", "1f1b"}, &out), 0);
  EXPECT_TRUE(contains(out, "slot | rank 0 | rank 1 | rank 2 | rank 3")) << out;
  EXPECT_TRUE(contains(out, "check: ok:")) << out;
  EXPECT_TRUE(contains(out, "per rank: 4 3 2 1")) << out;
  EXPECT_TRUE(contains(out, "simulated 27.27%")) << out;
  EXPECT_TRUE(contains(out, "(p-1)/(m+p-1), relative (p-1)/m: 27.27%")) << out;

  EXPECT_EQ(run({"schedule", "--pp=4", "--microbatches=8", "--schedule=interleaved_1f1b",
                 "--virtual-stages=2", "--show-comm", "--list", "--comm", "batched"},
                &out),
            0);
  EXPECT_TRUE(contains(out, "(p-1)/(v*m+p-1)")) << out;
  EXPECT_TRUE(contains(out, "rendezvous sends (batched isend/irecv): also deadlock-free")) << out;
  EXPECT_TRUE(contains(out, "rank 0: F0.0 sA0.0>1")) << out;
  EXPECT_EQ(run({"schedule", "--pp", "2", "--microbatches", "4", "--schedule", "gpipe", "--no-table"}, &out),
            0);
  EXPECT_FALSE(contains(out, "slot |")) << out;
  EXPECT_TRUE(contains(out, "per rank: 4 4")) << out;
}

TEST(ScheduleCommand, BadFlagsExitTwo) {
  std::string out;
  EXPECT_EQ(run({"schedule", "--pp", "4", "--microbatches", "6", "--schedule", "interleaved_1f1b"}, &out), 2);
  EXPECT_TRUE(contains(out, "multiple of the pipeline size")) << out;
  EXPECT_EQ(run({"schedule", "--pp", "4", "--microbatches", "8", "--schedule", "bogus"}, &out), 2);
  EXPECT_TRUE(contains(out, "unknown pipeline schedule 'bogus'")) << out;
  EXPECT_EQ(run({"schedule", "--microbatches", "8"}, &out), 2);
  EXPECT_TRUE(contains(out, "--pp is required")) << out;
  EXPECT_EQ(run({"schedule", "--pp", "two", "--microbatches", "8"}, &out), 2);
  EXPECT_EQ(run({"schedule", "--pp", "2", "--microbatches", "8", "--frobnicate"}, &out), 2);
  EXPECT_TRUE(contains(out, "unknown option --frobnicate")) << out;
  EXPECT_EQ(run({"schedule", "--pp", "2", "--microbatches", "8", "--t-fwd", "0"}, &out), 2);
  EXPECT_EQ(run({"schedule", "--pp", "2", "--microbatches", "8", "--comm", "lazy"}, &out), 2);
  EXPECT_EQ(run({"schedule", "--pp", "99999999999", "--microbatches", "8"}, &out), 2);
}

// --costs: the zero-bubble schedule built for the stage costs and simulated with them (the numbers
// the library gives for the same schedule and times); bad costs exit 2.
TEST(ScheduleCommand, CostsBuildAndSimulateTheZeroBubbleSchedules) {
  namespace pl = mt::parallel;
  std::string out;
  EXPECT_EQ(run({"schedule", "--pp", "2", "--microbatches", "8", "--schedule", "zbv", "--costs", "1,1.3,0.7", "--list"},
                &out),
            0);
  const pl::PipeSchedule s = pl::make_schedule("zbv", 2, 8, 2, pl::CommPlacement::Eager, {1, 1.3, 0.7});
  const double b = pl::simulate_timeline(s, 2.0, 4.0, 0.0, 0.35).bubble_fraction;
  char want[64];
  std::snprintf(want, sizeof want, "simulated %.2f%%", 100.0 * b);
  EXPECT_TRUE(contains(out, "t_fwd=2, t_bwd=4 of which W 1.4")) << out;
  EXPECT_TRUE(contains(out, want)) << want << "\n" << out;
  EXPECT_TRUE(contains(out, pl::format_actions(s))) << out;
  EXPECT_EQ(run({"schedule", "--pp", "2", "--microbatches", "8", "--schedule", "zbv", "--costs", "1,0,1"}, &out), 2);
  EXPECT_TRUE(contains(out, "--costs must be three positive numbers F,B,W")) << out;
  EXPECT_EQ(run({"schedule", "--pp", "2", "--microbatches", "8", "--schedule", "zb1p", "--costs", "1,1,1", "--t-fwd", "2"},
                &out),
            2);
  EXPECT_TRUE(contains(out, "leave out --t-fwd and --t-bwd")) << out;
}

TEST(ScheduleCommand, Help) {
  std::string out;
  EXPECT_EQ(run({"schedule", "--help"}, &out), 0);
  EXPECT_TRUE(contains(out, "usage: meshtrain schedule")) << out;
  for (const char* flag : {"--pp", "--microbatches", "--schedule", "--virtual-stages", "--show-comm",
                           "--comm", "--list", "--no-table", "--t-fwd", "--t-bwd", "--t-comm", "--costs", "exit status"})
    EXPECT_TRUE(contains(out, flag)) << flag;
  EXPECT_EQ(run({"schedule", "-h"}, &out), 0);
}
