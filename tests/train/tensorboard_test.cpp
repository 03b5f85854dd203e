// TensorBoard event files (train/tensorboard.h) read back by TensorBoard's own reader: the same
// values as the JSON lines written beside them. Skipped when python3 cannot import tensorboard.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "runtime/crc32c.h"
#include "train/metrics.h"
#include "train/tensorboard.h"

namespace fs = std::filesystem;

namespace {

fs::path fresh_dir(const std::string& name) {
  const fs::path d = fs::temp_directory_path() / ("mt_tb_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

int run_oracle(const fs::path& ev, const fs::path& metrics, const std::string& config_part) {
  const std::string cmd = "python3 " MT_SOURCE_DIR "/tests/train/tensorboard_oracle.py " + ev.string() + " " +
                          metrics.string() + " '" + config_part + "'";
  const int rc = std::system(cmd.c_str());
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

bool have_tensorboard() { return std::system("python3 -c 'import tensorboard' >/dev/null 2>&1") == 0; }

}  // namespace

TEST(TensorBoard, MaskedCrcMatchesTheFormat) {
  // The masked CRC32C of TFRecord, from the CRC32C check value of "123456789" (0xE3069283).
  EXPECT_EQ(mt::crc32c(0, "123456789", 9), 0xE3069283u);
  const uint32_t c = 0xE3069283u;
  EXPECT_EQ(mt::tfrecord_masked_crc("123456789", 9), ((c >> 15) | (c << 17)) + 0xa282ead8u);
  const std::string r = mt::tfrecord("abc");
  ASSERT_EQ(r.size(), 8u + 4u + 3u + 4u);
  EXPECT_EQ(static_cast<unsigned char>(r[0]), 3u);
  EXPECT_EQ(r.substr(12, 3), "abc");
}

TEST(TensorBoard, ReaderReturnsTheMetricsValues) {
  if (!have_tensorboard()) GTEST_SKIP() << "python3 cannot import tensorboard (pip install tensorboard)";
  const fs::path d = fresh_dir("values");
  const fs::path metrics = d / "metrics.jsonl", ev = d / "tb";
  {
    mt::MetricsWriter w(metrics.string());
    w.attach_tensorboard(ev.string(), "model.n_layer = 2\nlog.tensorboard_dir = \"tb\"\n");
    for (int s = 1; s <= 5; ++s) {
      mt::StepMetrics m;
      m.step = s;
      m.loss = 10.0 / s + 0.123456;
      m.lr = 3e-4 * s;
      m.tokens_per_s = 1234.5 * s;
      m.step_ms = 80.25 + s;
      m.compute_ms = 60.5;
      m.comm_ms = 20.0 + s;
      m.exposed_comm_ms = 4.0 * s;
      m.grad_norm = 1.5 / s;
      m.mem_peak_bytes = 123456789 + s;
      if (s % 2 == 0) m.val_loss = 9.0 / s;
      m.mfu = 0.01 * s;
      w.step(m);
    }
    w.final({{"final", true},
             {"tokens_per_s", 4321.0},
             {"mem_peak_by_category", {{"params", 1000}, {"grads", 2000}, {"activations", 123456}}},
             {"comm_bytes_by_group", {{"dp_shard", 98765}}},
             {"strategy", "FULL_SHARD"}});
  }
  EXPECT_EQ(run_oracle(ev, metrics, "log.tensorboard_dir = \"tb\""), 0);
  // A value the JSON lines do not hold is reported as different (the oracle can fail).
  std::ofstream(metrics, std::ios::app) << R"({"step": 5, "loss": 1.0})" << "\n";
  EXPECT_EQ(run_oracle(ev, metrics, "model.n_layer"), 1);
  fs::remove_all(d);
}
