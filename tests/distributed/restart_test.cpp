// `meshtrain launch --max-restarts K`: a rank killed with SIGKILL mid-run (MESHTRAIN_FAULT_KILL)
// makes the job restart from its newest complete checkpoint, and the restarted job's losses after
// the resume point are the uninterrupted run's; without restarts left it gives up with the
// failure's exit code; a relaunch on fewer ranks continues from the same checkpoint.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "harness.h"

namespace mt {
namespace {

class Restart : public ParityFixture {
 protected:
  // `meshtrain launch -n np [launch_args] -- train ...` writing checkpoints every 4 of 12 steps.
  RunOut launch(int np, const std::string& tag, const std::string& launch_args, const std::string& env = "",
                const std::string& train_extra = "") {
    return run("OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 " + env + " timeout 300 " + MT_BINARY +
               " launch -n " + std::to_string(np) + " " + launch_args +
               " -- train --model.preset gpt2-tiny --data.train " + (dir_ / "train.bin").string() +
               " --data.val '' --train.steps 12 --train.warmup_steps 2 --train.lr 3e-3 --train.threads 1"
               " --train.micro_batch " + std::to_string(8 / np) + " --parallel.strategy FULL_SHARD"
               " --train.checkpoint_every 4 --train.checkpoint_dir " + (dir_ / ("ck_" + tag)).string() +
               " --log.metrics_out " + (dir_ / ("m_" + tag + ".jsonl")).string() + " " + train_extra);
  }
  std::vector<double> losses_of(const std::string& tag) { return losses((dir_ / ("m_" + tag + ".jsonl")).string()); }
  std::string kill(int rank, int step) const {
    return "MESHTRAIN_FAULT_KILL=" + std::to_string(rank) + ":" + std::to_string(step) + ":" + (dir_ / "killed").string();
  }
};

TEST_F(Restart, SigkilledRankRestartsFromTheNewestCheckpoint) {
  RunOut plain = launch(2, "plain", "--max-restarts 2");
  ASSERT_EQ(plain.code, 0) << plain.output;
  const std::vector<double> want = losses_of("plain");
  ASSERT_EQ(want.size(), 12u);

  RunOut r = launch(2, "killed", "--max-restarts 2", kill(1, 7));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("killing myself (SIGKILL) after step 7"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("signal 9"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("restart 1 of 2"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("at step 4"), std::string::npos) << r.output;  // step 4's checkpoint: the newest complete one
  EXPECT_NE(r.output.find("the job finished after 1 restart"), std::string::npos) << r.output;
  // The restarted run's metrics file: steps 5..12, the uninterrupted run's losses bit for bit.
  const std::vector<double> got = losses_of("killed");
  ASSERT_EQ(got.size(), 8u);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(got[i], want[4 + i]) << "step " << 5 + i;
}

TEST_F(Restart, NoRestartsLeftGivesUpAndFewerRanksContinue) {
  RunOut plain = launch(2, "plain", "--max-restarts 1");
  ASSERT_EQ(plain.code, 0) << plain.output;
  const std::vector<double> want = losses_of("plain");
  ASSERT_EQ(want.size(), 12u);
  RunOut r = launch(2, "lost", "--max-restarts 0", kill(0, 6));
  EXPECT_EQ(r.code, 137) << r.output;
  EXPECT_NE(r.output.find("giving up after 0 restarts"), std::string::npos) << r.output;
  // Relaunched on one rank (a node lost): loading reshards; the run continues from step 4 with the
  // same global batch (1 x 8 sequences instead of 2 x 4).
  RunOut again = launch(1, "lost", "--max-restarts 1", "", "--train.resume latest");
  ASSERT_EQ(again.code, 0) << again.output;
  EXPECT_NE(again.output.find("at step 4"), std::string::npos) << again.output;
  const std::vector<double> got = losses_of("lost");
  ASSERT_EQ(got.size(), 8u);
  for (int i = 0; i < 8; ++i) EXPECT_NEAR(got[i], want[4 + i], 1e-5) << "step " << 5 + i;
}

}  // namespace
}  // namespace mt
