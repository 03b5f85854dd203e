// `meshtrain plot`: metrics files are read (final object skipped, validation points kept), the SVG
// holds one line per run and panel with every step, and bad input is a clear error.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "train/metrics_plot.h"

namespace fs = std::filesystem;

namespace mt {
namespace {

size_t count(const std::string& s, const std::string& what) {
  size_t n = 0;
  for (size_t p = s.find(what); p != std::string::npos; p = s.find(what, p + 1)) ++n;
  return n;
}

class MetricsPlot : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("mt_plot_" + std::to_string(::getpid()));
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string write(const std::string& name, int steps, double scale) {
    const fs::path p = dir_ / name;
    std::ofstream f(p);
    for (int s = 1; s <= steps; ++s) {
      f << "{\"step\":" << s << ",\"loss\":" << scale * (5.0 - 0.1 * s) << ",\"lr\":0.001,\"tokens_per_s\":" << 1000 + s
        << ",\"step_ms\":10,\"mfu\":null,\"mem_peak_bytes\":1,\"comm_ms\":2,\"exposed_comm_ms\":" << 0.5 * s;
      if (s % 5 == 0) f << ",\"val_loss\":" << scale * (5.1 - 0.1 * s);
      f << "}\n";
    }
    f << "{\"final\":true,\"tokens_per_s\":1005}\n";
    return p.string();
  }
  fs::path dir_;
};

TEST_F(MetricsPlot, ReadsStepsAndValidationPoints) {
  MetricsSeries s = read_metrics_series(write("a.jsonl", 12, 1.0), "a");
  ASSERT_EQ(s.step.size(), 12u);  // the final object is not a step
  EXPECT_DOUBLE_EQ(s.loss[2], 4.7);
  EXPECT_DOUBLE_EQ(s.tokens_per_s[11], 1012);
  EXPECT_DOUBLE_EQ(s.exposed_comm_ms[3], 2.0);
  ASSERT_EQ(s.val_step.size(), 2u);
  EXPECT_EQ(s.val_step[1], 10);
  EXPECT_DOUBLE_EQ(s.val_loss[1], 4.1);
}

TEST_F(MetricsPlot, SvgHasALinePerRunAndPanel) {
  std::vector<MetricsSeries> runs = {read_metrics_series(write("a.jsonl", 12, 1.0), "DDP"),
                                     read_metrics_series(write("b.jsonl", 8, 1.1), "FULL_SHARD <2 ranks>")};
  const std::string svg = metrics_svg(runs, "compare");
  EXPECT_EQ(svg.rfind("<svg", 0), 0u);
  EXPECT_NE(svg.find("</svg>"), std::string::npos);
  EXPECT_EQ(count(svg, "<polyline"), 6u);         // 2 runs x 3 panels
  EXPECT_EQ(count(svg, "<circle class=\"val\""), 3u);  // validation points: 2 + 1
  EXPECT_NE(svg.find("FULL_SHARD &lt;2 ranks&gt;"), std::string::npos);  // labels are escaped
  // Every step is a point of the run's line.
  const size_t a = svg.find("points=\"");
  const size_t b = svg.find('"', a + 8);
  EXPECT_EQ(count(svg.substr(a, b - a), ","), 12u);
}

TEST_F(MetricsPlot, NiceTicks) {
  EXPECT_EQ(nice_ticks(0, 10, 5), (std::vector<double>{0, 2, 4, 6, 8, 10}));
  EXPECT_EQ(nice_ticks(3.2, 5.1, 4), (std::vector<double>{3.5, 4.0, 4.5, 5.0}));
  const auto t = nice_ticks(990, 1013, 5);
  EXPECT_EQ(t.front(), 990);
  EXPECT_EQ(t.back(), 1010);
}

TEST_F(MetricsPlot, BadInputIsAClearError) {
  const fs::path p = dir_ / "bad.jsonl";
  std::ofstream(p) << "{\"step\":1,\"loss\":2}\nnot json\n";
  try {
    read_metrics_series(p.string(), "x");
    ADD_FAILURE() << "no error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find(p.string() + ":2"), std::string::npos) << e.what();
  }
  std::ofstream(p, std::ios::trunc) << "{\"final\":true}\n";
  EXPECT_THROW(read_metrics_series(p.string(), "x"), std::runtime_error);
  EXPECT_THROW(read_metrics_series((dir_ / "missing.jsonl").string(), "x"), std::runtime_error);
}

}  // namespace
}  // namespace mt
