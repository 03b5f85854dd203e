// Every rank runs the same job: ranks launched with different configurations or data (mpirun's
// MPMD form gives each rank its own command line) stop before the first step with a message that
// names the key and each rank's value.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "harness.h"

namespace mt {
namespace {

class JobAgreement : public ParityFixture {
 protected:
  std::string cmd(const std::string& extra) const {
    return std::string(MT_BINARY) + " train --model.preset gpt2-tiny --data.val '' --train.steps 3 --train.threads 1 " +
           extra;
  }
  // Rank 0 runs `a`, rank 1 runs `b`.
  RunOut two(const std::string& a, const std::string& b, bool desync = false) {
    const std::string env = desync ? "MESHTRAIN_DEBUG=desync " : "", x = desync ? "-x MESHTRAIN_DEBUG " : "";
    return run(env + mpirun(1) + x + cmd(a) + " : -np 1 -x OMP_NUM_THREADS=1 " + x + cmd(b));
  }
  void expect_refused(const RunOut& r, const std::vector<std::string>& words) {
    EXPECT_NE(r.code, 0) << r.output;
    EXPECT_NE(r.output.find("ranks disagree on the configuration"), std::string::npos) << r.output;
    for (const auto& w : words) EXPECT_NE(r.output.find(w), std::string::npos) << "no '" << w << "' in\n" << r.output;
    EXPECT_EQ(r.output.find("step     1/"), std::string::npos) << "it trained:\n" << r.output;
  }
  std::string data() const { return " --data.train " + (dir_ / "train.bin").string(); }
};

TEST_F(JobAgreement, SameJobRuns) {
  RunOut r = two(data(), data());
  EXPECT_EQ(r.code, 0) << r.output;
}

TEST_F(JobAgreement, DifferentMicroBatchOrLearningRateIsRefused) {
  expect_refused(two(data() + " --train.micro_batch 2", data() + " --train.micro_batch 4"),
                 {"train.micro_batch", "'2' on rank 0", "'4' on rank 1"});
  // Also with the desync checks on (the collectives would have equal sizes).
  expect_refused(two(data() + " --train.lr 0.5", data(), true), {"train.lr", "'0.5' on rank 0", "'0.0006' on rank 1"});
}

TEST_F(JobAgreement, AnotherConfigFileIsRefused) {
  const std::string f = (dir_ / "other.toml").string();
  std::ofstream(f) << "[train]\nweight_decay = 0.3\n";
  expect_refused(two(data(), data() + " --config " + f), {"train.weight_decay", "'0.3' on rank 1"});
}

TEST_F(JobAgreement, DifferentDataIsRefusedNamingTheFile) {
  // The same shard with one header byte changed (a node with a different copy).
  const std::filesystem::path other = dir_ / "other.bin";
  std::filesystem::copy_file(dir_ / "train.bin", other);
  {
    std::fstream f(other, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(40);
    f.put('\x7f');
  }
  expect_refused(two(data(), " --data.train " + other.string()), {"data.train file 0", "train.bin", "other.bin"});
}

}  // namespace
}  // namespace mt
