// The run readers behind `meshtrain diagnose` and `compare` (train/report_diagnose.h,
// train/report_compare.h) on metrics files holding the keys a run writes: data_wait_ms and
// straggler (per step), the final summary's comm_bytes_by_group.
#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <vector>
#include <string>

#include "../test_files.h"
#include "checkpoint/safetensors.h"
#include "train/report_compare.h"
#include "train/report_diagnose.h"

namespace {

// Six steps of 100 ms with `extra` keys on every step record and a final summary.
std::string write_run(const mt::test::TestDir& d, const std::string& name, const std::string& extra,
                      double lr_loss_slope = 0.1) {
  const std::string p = d.file(name);
  std::ofstream f(p);
  for (int s = 1; s <= 6; ++s)
    f << R"({"step":)" << s << R"(,"loss":)" << 5.0 - lr_loss_slope * (s - 1) << R"(,"grad_norm":)" << 1.0 + 0.01 * s
      << R"(,"step_ms":100,"compute_ms":80,"exposed_comm_ms":5,"mfu":null,"mem_peak_bytes":1000)" << extra << "}\n";
  f << R"({"final":true,"steps":6,"world_size":4,"comm_bytes_by_group":{"dp":600,"tp":60}})" << "\n";
  return p;
}

mt::DiagnoseContext ctx() {
  mt::DiagnoseContext c;
  c.capacity_bytes = 1 << 20;
  return c;
}

TEST(Diagnose, DataWaitAboveTheThresholdIsDataStalled) {
  mt::test::TestDir d;
  const auto stalled = mt::diagnose(mt::read_run_metrics(write_run(d, "a.jsonl", R"(,"data_wait_ms":30)")), ctx());
  EXPECT_EQ(stalled.verdict, "data-stalled");
  const auto fine = mt::diagnose(mt::read_run_metrics(write_run(d, "b.jsonl", R"(,"data_wait_ms":2)")), ctx());
  EXPECT_EQ(fine.verdict, "compute-bound");
  EXPECT_NE(fine.text().find("waiting for data 2.0 ms per step (2%)"), std::string::npos) << fine.text();
}

TEST(Diagnose, NamedStragglerIsReportedWithItsRank) {
  mt::test::TestDir d;
  const std::string s = R"(,"straggler":{"rank":3,"host":"n1","part":"data_wait"})";
  const auto g = mt::diagnose(mt::read_run_metrics(write_run(d, "a.jsonl", s)), ctx());
  EXPECT_EQ(g.verdict, "straggling");
  EXPECT_NE(g.advice.find("rank 3 on n1 (data_wait)"), std::string::npos) << g.advice;
  const auto none = mt::diagnose(mt::read_run_metrics(write_run(d, "b.jsonl", R"(,"straggler":null)")), ctx());
  EXPECT_NE(none.verdict, "straggling");
}

TEST(Diagnose, ExposedCommunicationShareAndBusiestGroup) {
  mt::test::TestDir d;
  const auto g = mt::diagnose(mt::read_run_metrics(write_run(d, "a.jsonl", R"(,"exposed_comm_ms":40)")), ctx());
  EXPECT_EQ(g.verdict, "communication-bound");
  EXPECT_NE(g.text().find("(40%); most bytes on dp (100 B per step"), std::string::npos) << g.text();
}

TEST(Compare, ToleranceFollowsThePrecisionAndNamesTheFirstDivergingStep) {
  mt::test::TestDir d;
  const auto a = mt::read_run_metrics(write_run(d, "a.jsonl", ""));
  const auto b = mt::read_run_metrics(write_run(d, "b.jsonl", "", 0.1 + 2e-6));
  const auto c = mt::read_run_metrics(write_run(d, "c.jsonl", "", 0.11));
  EXPECT_TRUE(mt::compare_runs(a, b, mt::tolerance_for("fp32")).equal());
  const auto diff = mt::compare_runs(a, c, mt::tolerance_for("fp32"));
  ASSERT_TRUE(diff.first_diverging.has_value());
  EXPECT_EQ(*diff.first_diverging, 2);
  EXPECT_TRUE(mt::compare_runs(a, c, mt::tolerance_for("bf16")).equal());  // 1.1% apart at most
  EXPECT_THROW(mt::tolerance_for("fp16"), std::invalid_argument);
}

}  // namespace

namespace {

void write_weights(const std::string& path, float bias_shift) {
  std::map<std::string, mt::SafeTensor> t;
  const std::vector<float> w = {1.0f, -2.0f, 0.5f, 4.0f}, b = {0.001f + bias_shift, -0.002f};
  t["w"].shape = {2, 2};
  t["w"].bytes.assign(reinterpret_cast<const char*>(w.data()), reinterpret_cast<const char*>(w.data() + w.size()));
  t["b"].shape = {2};
  t["b"].bytes.assign(reinterpret_cast<const char*>(b.data()), reinterpret_cast<const char*>(b.data() + b.size()));
  mt::write_safetensors(path, t);
}

TEST(Compare, FinalWeightsAgainstEachTensorsLargestValue) {
  mt::test::TestDir d;
  write_weights(d.file("a.safetensors"), 0.0f);
  write_weights(d.file("b.safetensors"), 1e-6f);  // 5e-4 of the bias tensor's largest value
  write_weights(d.file("c.safetensors"), 1e-4f);  // 5e-2 of it
  const mt::Tolerance wt = mt::weight_tolerance(mt::tolerance_for("fp32"));
  const mt::WeightDiff same = mt::compare_weights(d.file("a.safetensors"), d.file("b.safetensors"), wt);
  EXPECT_TRUE(same.within);
  EXPECT_EQ(same.tensors, 2);
  EXPECT_EQ(same.worst_tensor, "b");
  EXPECT_NEAR(same.max_rel, 5e-4, 1e-5);
  EXPECT_FALSE(mt::compare_weights(d.file("a.safetensors"), d.file("c.safetensors"), wt).within);
}

}  // namespace
