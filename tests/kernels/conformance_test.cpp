// The conformance suite (kernels/conformance/check.h) itself: it covers every op of the registry,
// passes on the CPU tables, and fails - naming the reason - on a table with a broken kernel: one
// that overwrites a gradient it should add to, one off by more than the op's tolerance, a GEMM
// one element off the exact result, one that writes an input, one that is not deterministic.
// (`meshtrain check-ops` runs the whole suite in CTest; these tests check the checker.)
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "kernels/conformance/check.h"
#include "kernels/cpu/activation.h"
#include "kernels/cpu/cpu_isa.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/norm.h"

namespace mt::kernels::conformance {
namespace {

const KernelTable& base() { return cpu::base::isa_table(); }

std::vector<Result> check(const KernelTable& t, Op op) {
  Options o;
  o.op = op;
  return run(Target{"test", &t, Device::CPU}, o);
}

// Every result supported and passed, or the first failure.
::testing::AssertionResult all_pass(const std::vector<Result>& rs) {
  if (rs.empty()) return ::testing::AssertionFailure() << "no case ran";
  for (const Result& r : rs)
    if (!r.supported || !r.pass)
      return ::testing::AssertionFailure()
             << op_name(r.op) << " " << r.shape << ": " << (r.supported ? r.detail : "not supported");
  return ::testing::AssertionSuccess();
}

// The first failure's detail ("" when every case passed).
std::string first_failure(const std::vector<Result>& rs) {
  for (const Result& r : rs)
    if (!r.pass) return r.detail;
  return "";
}

TEST(Conformance, EveryOpHasACaseInEachOfItsDtypes) {
  const std::vector<std::string> missing = missing_cases();
  EXPECT_TRUE(missing.empty()) << "ops without a small case: " << ::testing::PrintToString(missing);
}

TEST(Conformance, CpuVariantsPassAtSmallShapes) {
  for (const Target& t : targets(Device::CPU)) EXPECT_TRUE(all_pass(run(t, Options{}))) << t.name;
}

// A backward that overwrites its gradients instead of adding to them.
void layernorm_backward_overwrites(float* dinp, float* dw, float* db, const float* dout, const float* inp,
                                   const float* w, const float* mean, const float* rstd, int64_t N, int64_t C) {
  std::fill(dinp, dinp + N * C, 0.0f);
  std::fill(dw, dw + C, 0.0f);
  std::fill(db, db + C, 0.0f);
  cpu::base::layernorm_backward(dinp, dw, db, dout, inp, w, mean, rstd, N, C);
}

TEST(Conformance, ANonAccumulatingBackwardFails) {
  KernelTable t = base();
  ASSERT_TRUE(all_pass(check(t, Op::layernorm_backward)));
  t.layernorm_backward = layernorm_backward_overwrites;
  const std::string why = first_failure(check(t, Op::layernorm_backward));
  EXPECT_NE(why.find("dinp: "), std::string::npos) << why;
  EXPECT_NE(why.find("out of tolerance"), std::string::npos) << why;
}

// GELU off by a relative 3e-5 (its tolerance is 1e-5), and by 3e-7 (within it).
template <int kPpb>  // parts per billion
void gelu_scaled(float* out, const float* inp, int64_t n) {
  cpu::base::gelu_forward(out, inp, n);
  for (int64_t i = 0; i < n; ++i) out[i] *= 1.0f + static_cast<float>(kPpb) * 1e-9f;
}

TEST(Conformance, AnErrorBeyondTheOpsToleranceFailsAndOneWithinPasses) {
  ASSERT_EQ(tolerance(Op::gelu_forward, DType::F32).rtol, 1e-5);
  KernelTable t = base();
  t.gelu_forward = gelu_scaled<30000>;
  const std::vector<Result> bad = check(t, Op::gelu_forward);
  EXPECT_NE(first_failure(bad).find("out: "), std::string::npos) << first_failure(bad);
  for (const Result& r : bad) EXPECT_GT(r.max_rel, 1e-5) << r.shape;
  t.gelu_forward = gelu_scaled<300>;
  const std::vector<Result> good = check(t, Op::gelu_forward);
  EXPECT_TRUE(all_pass(good));
  for (const Result& r : good) EXPECT_GT(r.max_abs, 0.0) << "the perturbation is visible but tolerated";
}

// A GEMM one element off (the GEMMs and attention are checked against an exact computation, not
// against the baseline's shared oneDNN kernels).
void linear_forward_bf16_one_off(float* out, const bf16* inp, const bf16* W, const float* bias, int64_t N, int64_t C,
                                 int64_t OC) {
  cpu::linear_forward_bf16(out, inp, W, bias, N, C, OC);
  out[N * OC - 1] += 1e-2f;
}

TEST(Conformance, AGemmOffTheExactResultFails) {
  KernelTable t = base();
  ASSERT_TRUE(all_pass(check(t, Op::linear_forward_bf16)));
  t.linear_forward_bf16 = linear_forward_bf16_one_off;
  const std::vector<Result> rs = check(t, Op::linear_forward_bf16);
  ASSERT_FALSE(rs.empty());
  for (const Result& r : rs) {
    EXPECT_FALSE(r.pass) << r.shape;
    EXPECT_NE(r.detail.find("out: 1 of "), std::string::npos) << r.detail;
  }
}

void accumulate_writes_input(float* y, const float* x, int64_t n) {
  cpu::base::accumulate(y, x, n);
  const_cast<float*>(x)[n / 2] += 1.0f;
}

int g_calls = 0;
void scale_drifts(float* x, float s, int64_t n) {
  cpu::base::scale(x, s, n);
  if (++g_calls % 2 == 0) x[0] = std::nextafter(x[0], 1e30f);  // every second call: one ulp off
}

TEST(Conformance, AKernelWritingAnInputOrDifferingRunToRunFails) {
  KernelTable t = base();
  t.accumulate = accumulate_writes_input;
  EXPECT_NE(first_failure(check(t, Op::accumulate)).find("input x was modified"), std::string::npos);
  t = base();
  t.scale = scale_drifts;
  g_calls = 0;
  EXPECT_NE(first_failure(check(t, Op::scale)).find("not deterministic: x differs between two runs"),
            std::string::npos);
}

TEST(Conformance, AnUnsupportedOpIsReportedOnceAndNotRun) {
  KernelTable t = base();
  t.supported[static_cast<size_t>(Op::moe_combine)] = false;
  t.moe_combine = nullptr;  // never called
  const std::vector<Result> rs = check(t, Op::moe_combine);
  ASSERT_EQ(rs.size(), 1u);
  EXPECT_FALSE(rs[0].supported);
}

}  // namespace
}  // namespace mt::kernels::conformance
