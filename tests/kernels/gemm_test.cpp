// GEMM (fp32, bf16) and linear layers against double-precision references; linear backward
// against central finite differences of the double reference.
#include "kernels/cpu/gemm.h"

#include <gtest/gtest.h>

#include <omp.h>

#include <cmath>
#include <cstring>
#include <iostream>
#include <limits>
#include <tuple>

#include "kernels/cpu/gemm_internal.h"
#include "test_util.h"

namespace mt::kernels::cpu {
namespace {

// C = alpha op(A) op(B) + beta C in double (row-major, as gemm.h).
std::vector<double> ref_gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, double alpha,
                             const std::vector<double>& A, const std::vector<double>& B, double beta,
                             const std::vector<double>& C) {
  std::vector<double> out(static_cast<size_t>(M * N));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double s = 0.0;
      for (int64_t k = 0; k < K; ++k) {
        const double a = ta ? A[k * M + m] : A[m * K + k];
        const double b = tb ? B[n * K + k] : B[k * N + n];
        s += a * b;
      }
      out[m * N + n] = alpha * s + (beta == 0.0 ? 0.0 : beta * C[m * N + n]);
    }
  return out;
}

// sum_k |a||b| per output element: the scale of the rounding error of a dot product.
std::vector<double> ref_abs_gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K,
                                 const std::vector<double>& A, const std::vector<double>& B) {
  std::vector<double> a(A.size()), b(B.size());
  for (size_t i = 0; i < A.size(); ++i) a[i] = std::abs(A[i]);
  for (size_t i = 0; i < B.size(); ++i) b[i] = std::abs(B[i]);
  return ref_gemm(ta, tb, M, N, K, 1.0, a, b, 0.0, {});
}

std::vector<bf16> to_bf16(const std::vector<float>& v) {
  std::vector<bf16> o(v.size());
  for (size_t i = 0; i < v.size(); ++i) o[i] = float_to_bf16(v[i]);
  return o;
}
std::vector<double> bf16_to_double(const std::vector<bf16>& v) {
  std::vector<double> o(v.size());
  for (size_t i = 0; i < v.size(); ++i) o[i] = bf16_to_float(v[i]);
  return o;
}

struct Shape {
  int64_t M, N, K;
};
const Shape kShapes[] = {{5, 7, 9}, {1, 1, 1}, {33, 17, 65}, {64, 130, 48}};

TEST(GemmF32, AllTransposesAlphaBetaMatchDoubleReference) {
  for (const Shape& s : kShapes)
    for (int ta = 0; ta < 2; ++ta)
      for (int tb = 0; tb < 2; ++tb) {
        auto A = kt::randn(static_cast<size_t>(s.M * s.K), 1);
        auto B = kt::randn(static_cast<size_t>(s.K * s.N), 2);
        auto C = kt::randn(static_cast<size_t>(s.M * s.N), 3);
        auto want = ref_gemm(ta, tb, s.M, s.N, s.K, 0.7, kt::to_double(A), kt::to_double(B), 0.3,
                             kt::to_double(C));
        gemm_f32(ta, tb, s.M, s.N, s.K, 0.7f, A.data(), B.data(), 0.3f, C.data());
        // fp32 dot products of length K of unit-variance values: error ~ K * 2^-24.
        EXPECT_TRUE(kt::close(C, want, 1e-5, 1e-5 * std::sqrt(double(s.K))))
            << "M=" << s.M << " N=" << s.N << " K=" << s.K << " ta=" << ta << " tb=" << tb;
      }
}

TEST(GemmF32, BetaZeroDoesNotReadC) {
  const int64_t M = 6, N = 5, K = 4;
  auto A = kt::randn(M * K, 4), B = kt::randn(K * N, 5);
  std::vector<float> C(M * N, std::numeric_limits<float>::quiet_NaN());
  gemm_f32(false, false, M, N, K, 1.0f, A.data(), B.data(), 0.0f, C.data());
  auto want = ref_gemm(false, false, M, N, K, 1.0, kt::to_double(A), kt::to_double(B), 0.0, {});
  EXPECT_TRUE(kt::close(C, want, 1e-5, 1e-5));
  // bf16 too.
  auto A16 = to_bf16(A), B16 = to_bf16(B);
  std::fill(C.begin(), C.end(), std::numeric_limits<float>::quiet_NaN());
  gemm_bf16(false, false, M, N, K, 1.0f, A16.data(), B16.data(), 0.0f, C.data());
  auto want16 = ref_gemm(false, false, M, N, K, 1.0, bf16_to_double(A16), bf16_to_double(B16), 0.0, {});
  EXPECT_TRUE(kt::close(C, want16, 1e-5, 1e-5));
}

TEST(GemmF32, DegenerateKScalesC) {
  std::vector<float> C = {1.0f, 2.0f, 3.0f, 4.0f};
  gemm_f32(false, false, 2, 2, 0, 1.0f, nullptr, nullptr, 0.5f, C.data());
  EXPECT_EQ(C, (std::vector<float>{0.5f, 1.0f, 1.5f, 2.0f}));
  std::fill(C.begin(), C.end(), std::numeric_limits<float>::quiet_NaN());
  gemm_f32(false, false, 2, 2, 0, 1.0f, nullptr, nullptr, 0.0f, C.data());
  EXPECT_EQ(C, (std::vector<float>(4, 0.0f)));
}

TEST(GemmF32, RunToRunBitIdentical) {
  const int64_t M = 200, N = 384, K = 300;
  auto A = kt::randn(M * K, 6), B = kt::randn(K * N, 7);
  std::vector<float> C1(M * N, 0.0f), C2(M * N, 0.0f);
  gemm_f32(true, false, M, N, K, 1.0f, A.data(), B.data(), 0.0f, C1.data());
  gemm_f32(true, false, M, N, K, 1.0f, A.data(), B.data(), 0.0f, C2.data());
  EXPECT_TRUE(kt::bitwise_equal(C1, C2));
}

// A vocabulary-sized K runs in chunks accumulated into C (both transposes of A and B, alpha, beta):
// it still matches the double reference, and the chunks depend on the shape only, so 1 and 2
// threads give the same bits wherever one sgemm call does (checked on the LM head's dinp shape).
TEST(GemmF32, LargeKInChunksMatchesReferenceAndThreadCounts) {
  const int64_t M = 40, N = 24, K = 20000;
  auto C0 = kt::randn(static_cast<size_t>(M * N), 73);
  for (int ta = 0; ta < 2; ++ta)
    for (int tb = 0; tb < 2; ++tb) {
      auto A = kt::randn(static_cast<size_t>(M * K), 71), B = kt::randn(static_cast<size_t>(K * N), 72);
      std::vector<float> C = C0;
      gemm_f32(ta, tb, M, N, K, 0.5f, A.data(), B.data(), 0.75f, C.data());
      auto want = ref_gemm(ta, tb, M, N, K, 0.5, kt::to_double(A), kt::to_double(B), 0.75, kt::to_double(C0));
      EXPECT_TRUE(kt::close(C, want, 1e-5, 2e-5 * std::sqrt(double(K)))) << "ta=" << ta << " tb=" << tb;
    }
  const int64_t T = 64, C = 96, V = 20000;
  auto D = kt::randn(static_cast<size_t>(T * V), 74), W = kt::randn(static_cast<size_t>(V * C), 75);
  auto run = [&](int threads) {
    std::vector<float> dX(static_cast<size_t>(T * C), 0.0f);
    kt::with_threads(threads, [&] { gemm_f32(false, false, T, C, V, 1.0f, D.data(), W.data(), 1.0f, dX.data()); });
    return dX;
  };
  EXPECT_TRUE(kt::bitwise_equal(run(1), run(2)));
}

// bf16 GEMM: exact products of the bf16 inputs summed in fp32, so it matches the double product
// of the rounded inputs to fp32 accuracy, and the fp32 GEMM of the unrounded inputs to within
// the bf16 input rounding (2 * 2^-8 relative per product, bounded by sum |a||b|).
void check_bf16_gemm(const char* path) {
  for (const Shape& s : kShapes)
    for (int ta = 0; ta < 2; ++ta)
      for (int tb = 0; tb < 2; ++tb) {
        auto A = kt::randn(static_cast<size_t>(s.M * s.K), 11);
        auto B = kt::randn(static_cast<size_t>(s.K * s.N), 12);
        auto C0 = kt::randn(static_cast<size_t>(s.M * s.N), 13);
        auto A16 = to_bf16(A), B16 = to_bf16(B);
        std::vector<float> C = C0;
        gemm_bf16(ta, tb, s.M, s.N, s.K, 1.5f, A16.data(), B16.data(), 1.0f, C.data());
        auto want = ref_gemm(ta, tb, s.M, s.N, s.K, 1.5, bf16_to_double(A16), bf16_to_double(B16),
                             1.0, kt::to_double(C0));
        EXPECT_TRUE(kt::close(C, want, 1e-5, 2e-5 * std::sqrt(double(s.K))))
            << path << " M=" << s.M << " N=" << s.N << " K=" << s.K << " ta=" << ta << " tb=" << tb;
        // Against fp32 of the unrounded inputs.
        std::vector<float> Cf = C0;
        gemm_f32(ta, tb, s.M, s.N, s.K, 1.5f, A.data(), B.data(), 1.0f, Cf.data());
        auto absref = ref_abs_gemm(ta, tb, s.M, s.N, s.K, kt::to_double(A), kt::to_double(B));
        for (size_t i = 0; i < C.size(); ++i) {
          const double bound = 1.5 * 2.0 * std::ldexp(1.0, -8) * absref[i] * 1.01 + 1e-4;
          ASSERT_LE(std::abs(double(C[i]) - double(Cf[i])), bound) << path << " element " << i;
        }
      }
}

TEST(GemmBf16, MatchesReferenceOnDefaultPath) {
  std::cout << "[ info ] bf16 GEMM path on this CPU: "
            << (detail::amx_gemm_ready() ? "meshtrain's AMX tile GEMM"
                : detail::bf16_gemm_is_native(false, true, 64, 64, 64, 1.0f, 0.0f)
                    ? "oneDNN bf16 matmul"
                    : "widen to fp32 + sgemm (no oneDNN bf16 support)")
            << "\n";
  check_bf16_gemm("default");
}

TEST(GemmBf16, OneDnnPathMatchesReference) {
  // On AMX machines the default path is meshtrain's tile GEMM; oneDNN's matmul stays what serves
  // the vocabulary-sized K and what MESHTRAIN_AMX_GEMM=0 selects.
  const bool was = detail::amx_gemm_enabled();
  detail::set_amx_gemm_enabled(false);
  check_bf16_gemm("oneDNN");
  detail::set_amx_gemm_enabled(was);
}

// ---- the AMX tile GEMM ----------------------------------------------------------------------

// Strided operands (leading dimensions past the logical width), every transpose, alpha, beta and
// the bias, tails in M, N and K, and shapes for each blocking path: against the double reference
// of the bf16 inputs.
TEST(GemmBf16Amx, MatchesReferenceWithStridesBiasAndKChunks) {
  if (!detail::amx_gemm_ready()) GTEST_SKIP() << "no AMX-BF16 here (or the level is capped below amx_bf16)";
  // {400, 20, 70}: a tall weight-gradient shape (M = 20 N) with a tail in K; {800, 800, 1000}: K
  // in chunks; {40, 6528, 2000}: op(B) packed per group by its unit (the LM head's forward), A (a
  // tail in M) packed once for all groups.
  const Shape shapes[] = {{5, 7, 9},       {1, 1, 1},         {33, 17, 65},       {64, 130, 48},
                          {400, 20, 70},   {96, 64, 2000},    {800, 800, 1000},   {40, 6528, 2000}};
  for (const Shape& s : shapes)
    for (int ta = 0; ta < 2; ++ta)
      for (int tb = 0; tb < 2; ++tb) {
        if (s.M * s.N * s.K > 1e8 && (ta || !tb)) continue;  // the chunked shape once (forward layout)
        const int64_t ar = ta ? s.K : s.M, ac = ta ? s.M : s.K, br = tb ? s.N : s.K, bc = tb ? s.K : s.N;
        const int64_t lda = ac + 3, ldb = bc + 5, ldc = s.N + 2;
        auto A16 = to_bf16(kt::randn(static_cast<size_t>(ar * lda), 71));
        auto B16 = to_bf16(kt::randn(static_cast<size_t>(br * ldb), 72));
        auto bias = kt::randn(static_cast<size_t>(s.N), 73);
        auto C0 = kt::randn(static_cast<size_t>(s.M * ldc), 74);
        // Dense copies for the reference.
        std::vector<double> A(ar * ac), B(br * bc), Cd(s.M * s.N);
        for (int64_t i = 0; i < ar; ++i)
          for (int64_t j = 0; j < ac; ++j) A[i * ac + j] = bf16_to_float(A16[i * lda + j]);
        for (int64_t i = 0; i < br; ++i)
          for (int64_t j = 0; j < bc; ++j) B[i * bc + j] = bf16_to_float(B16[i * ldb + j]);
        for (int64_t i = 0; i < s.M; ++i)
          for (int64_t j = 0; j < s.N; ++j) Cd[i * s.N + j] = C0[i * ldc + j];
        const std::vector<double> P = ref_gemm(ta, tb, s.M, s.N, s.K, 1.0, A, B, 0.0, {});
        for (auto [alpha, beta, with_bias] : {std::tuple<float, float, bool>{1.0f, 0.0f, true}, {0.5f, 1.0f, false},
                                              {1.0f, 1.0f, true}, {-2.0f, 0.25f, false}}) {
          std::vector<float> C = C0;
          if (beta == 0.0f)  // beta = 0 must not read C
            for (int64_t i = 0; i < s.M; ++i)
              for (int64_t j = 0; j < s.N; ++j) C[i * ldc + j] = std::numeric_limits<float>::quiet_NaN();
          detail::amx_gemm_bf16(ta, tb, s.M, s.N, s.K, alpha, A16.data(), lda, B16.data(), ldb, beta, C.data(), ldc,
                                with_bias ? bias.data() : nullptr);
          std::vector<double> want(P.size());
          for (size_t i = 0; i < P.size(); ++i) want[i] = alpha * P[i] + (beta == 0.0f ? 0.0 : beta * Cd[i]);
          std::vector<float> got(s.M * s.N);
          for (int64_t i = 0; i < s.M; ++i)
            for (int64_t j = 0; j < s.N; ++j) {
              got[i * s.N + j] = C[i * ldc + j];
              if (with_bias) want[i * s.N + j] += bias[j];
            }
          EXPECT_TRUE(kt::close(got, want, 1e-5, 2e-5 * std::abs(alpha) * std::sqrt(double(s.K))))
              << "M=" << s.M << " N=" << s.N << " K=" << s.K << " ta=" << ta << " tb=" << tb << " alpha=" << alpha
              << " beta=" << beta << " bias=" << with_bias;
          // The padding columns past N (ldc) are left alone.
          for (int64_t i = 0; i < s.M; ++i)
            for (int64_t j = s.N; j < ldc; ++j) ASSERT_EQ(C[i * ldc + j], C0[i * ldc + j]) << i << "," << j;
        }
      }
}

// An output larger than 32 MiB with beta = 0 (the LM head's logits) is written with streaming
// stores where a row's 32 columns are 64-byte aligned, plain stores elsewhere: the same bits as the
// GEMM computed one row at a time (outputs small enough to go through the caches), and C is never
// read (it starts as NaN). C starts 64-byte aligned and ldc = N + 1 makes every other row
// misaligned; N has a tail panel.
TEST(GemmBf16Amx, LargeOutputStreamedEqualsRowByRow) {
  if (!detail::amx_gemm_ready()) GTEST_SKIP() << "no AMX-BF16 here (or the level is capped below amx_bf16)";
  const int64_t M = 64, N = 131104 + 7, K = 64, ldc = N + 1;
  ASSERT_GT(M * N * 4, int64_t(32) << 20);
  auto A = to_bf16(kt::randn(static_cast<size_t>(M * K), 91)), B = to_bf16(kt::randn(static_cast<size_t>(N * K), 92));
  auto aligned = [](std::vector<float>& v) {
    return v.data() + (64 - reinterpret_cast<uintptr_t>(v.data()) % 64) % 64 / sizeof(float);
  };
  std::vector<float> whole_buf(static_cast<size_t>(M * ldc + 16), std::numeric_limits<float>::quiet_NaN()),
      rows_buf(whole_buf);
  float* whole = aligned(whole_buf);
  float* rows = aligned(rows_buf);
  kt::with_threads(2, [&] {
    detail::amx_gemm_bf16(false, true, M, N, K, 1.0f, A.data(), K, B.data(), K, 0.0f, whole, ldc, nullptr);
    for (int64_t m = 0; m < M; ++m)
      detail::amx_gemm_bf16(false, true, 1, N, K, 1.0f, A.data() + m * K, K, B.data(), K, 0.0f, rows + m * ldc, ldc,
                            nullptr);
  });
  int64_t differ = 0, nan = 0;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      const float w = whole[m * ldc + n], r = rows[m * ldc + n];
      nan += std::isnan(w);
      differ += std::memcmp(&w, &r, sizeof(float)) != 0;
    }
  EXPECT_EQ(nan, 0);
  EXPECT_EQ(differ, 0);
}

// Units of work are handed out by a counter, and each one computes its block the same way on any
// thread: 1, 2 and 3 threads give the same bits, for the block layers' three GEMMs.
TEST(GemmBf16Amx, BitIdenticalOnAnyNumberOfThreads) {
  if (!detail::amx_gemm_ready()) GTEST_SKIP() << "no AMX-BF16 here (or the level is capped below amx_bf16)";
  const int64_t T = 300, C = 200, OC = 520;
  auto X = to_bf16(kt::randn(T * C, 81)), W = to_bf16(kt::randn(OC * C, 82)), D = to_bf16(kt::randn(T * OC, 83));
  auto run = [&](int threads) {
    std::vector<float> Y(T * OC), dX(T * C, 0.5f), dW(OC * C, 0.25f);
    kt::with_threads(threads, [&] {
      gemm_bf16(false, true, T, OC, C, 1.0f, X.data(), W.data(), 0.0f, Y.data());
      gemm_bf16(false, false, T, C, OC, 1.0f, D.data(), W.data(), 1.0f, dX.data());
      gemm_bf16(true, false, OC, C, T, 1.0f, D.data(), X.data(), 1.0f, dW.data());
    });
    return std::make_tuple(Y, dX, dW);
  };
  auto [Y1, dX1, dW1] = run(1);
  for (int threads : {2, 3}) {
    auto [Y, dX, dW] = run(threads);
    EXPECT_TRUE(kt::bitwise_equal(Y1, Y)) << threads;
    EXPECT_TRUE(kt::bitwise_equal(dX1, dX)) << threads;
    EXPECT_TRUE(kt::bitwise_equal(dW1, dW)) << threads;
  }
}

TEST(GemmBf16, BlockedWideningPathMatchesReference) {
  // Tiny blocks so that the M, N and K splits of the widening path are all exercised.
  detail::set_bf16_force_fallback(true);
  detail::set_bf16_fallback_block_elems(300);
  check_bf16_gemm("widened, small blocks");
  detail::set_bf16_fallback_block_elems(int64_t(4) << 20);
  detail::set_bf16_force_fallback(false);
}

TEST(GemmBf16, SplitLargeGemmsMatchReference) {
  // The native path splits a dimension >= min_dim (the LM head's vocabulary) into chunks: with
  // tiny limits both splits (K accumulated, N through a contiguous block) and their nesting run
  // on the test shapes. On CPUs without native bf16 this covers the strided widening.
  // (oneDNN's split path: the tile GEMM is switched off for it.)
  const bool was = detail::amx_gemm_enabled();
  detail::set_amx_gemm_enabled(false);
  detail::set_bf16_split(16, 7, 9);
  check_bf16_gemm("split into chunks");
  // beta = 0 must not read C (it may hold NaN), also through the N split's copy-out.
  const int64_t M = 33, N = 40, K = 50;
  auto A = to_bf16(kt::randn(M * K, 41)), B = to_bf16(kt::randn(K * N, 42));
  std::vector<float> C(M * N, std::numeric_limits<float>::quiet_NaN());
  gemm_bf16(false, true, M, N, K, 1.0f, A.data(), B.data(), 0.0f, C.data());
  auto want = ref_gemm(false, true, M, N, K, 1.0, bf16_to_double(A), bf16_to_double(B), 0.0,
                       std::vector<double>(M * N, 0.0));
  EXPECT_TRUE(kt::close(C, want, 1e-5, 2e-5 * std::sqrt(double(K))));
  detail::set_bf16_split(16384, 4096, 4096);
  detail::set_amx_gemm_enabled(was);
}

TEST(GemmBf16, LmHeadShapesBitIdenticalAcrossThreadCounts) {
  // The split depends on the shape only: 1 and 2 threads give the same bits on the LM head's
  // three GEMMs (vocabulary 20000, so every split engages at the default limits).
  const int64_t T = 64, V = 20000, C = 96;
  auto X = to_bf16(kt::randn(T * C, 51)), W = to_bf16(kt::randn(V * C, 52)), D = to_bf16(kt::randn(T * V, 53));
  auto run = [&](int threads) {
    const int saved = omp_get_max_threads();
    omp_set_num_threads(threads);
    std::vector<float> L(T * V, 0.0f), dX(T * C, 0.0f), dW(V * C, 0.0f);
    gemm_bf16(false, true, T, V, C, 1.0f, X.data(), W.data(), 0.0f, L.data());   // forward
    gemm_bf16(false, false, T, C, V, 1.0f, D.data(), W.data(), 1.0f, dX.data());  // dinp
    gemm_bf16(true, false, V, C, T, 1.0f, D.data(), X.data(), 1.0f, dW.data());   // dW
    omp_set_num_threads(saved);
    return std::make_tuple(L, dX, dW);
  };
  auto [L1, dX1, dW1] = run(1);
  auto [L2, dX2, dW2] = run(2);
  EXPECT_TRUE(kt::bitwise_equal(L1, L2));
  EXPECT_TRUE(kt::bitwise_equal(dX1, dX2));
  EXPECT_TRUE(kt::bitwise_equal(dW1, dW2));
  // and the split forward agrees with the reference
  auto want = ref_gemm(false, true, T, V, C, 1.0, bf16_to_double(X), bf16_to_double(W), 0.0,
                       std::vector<double>(T * V, 0.0));
  EXPECT_TRUE(kt::close(L1, want, 1e-5, 2e-5 * std::sqrt(double(C))));
}

// ---- linear layers --------------------------------------------------------------------------

// y[n, o] = sum_c x[n, c] W[o, c] + bias[o]
std::vector<double> ref_linear(const std::vector<double>& x, const std::vector<double>& W,
                               const std::vector<double>* bias, int64_t N, int64_t C, int64_t OC) {
  std::vector<double> y(static_cast<size_t>(N * OC));
  for (int64_t n = 0; n < N; ++n)
    for (int64_t o = 0; o < OC; ++o) {
      double s = bias ? (*bias)[o] : 0.0;
      for (int64_t c = 0; c < C; ++c) s += x[n * C + c] * W[o * C + c];
      y[n * OC + o] = s;
    }
  return y;
}

TEST(Linear, ForwardMatchesReference) {
  const int64_t N = 5, C = 7, OC = 3;
  auto x = kt::randn(N * C, 21), W = kt::randn(OC * C, 22), b = kt::randn(OC, 23);
  auto bd = kt::to_double(b);
  std::vector<float> y(N * OC, std::numeric_limits<float>::quiet_NaN());
  linear_forward(y.data(), x.data(), W.data(), b.data(), N, C, OC);
  EXPECT_TRUE(kt::close(y, ref_linear(kt::to_double(x), kt::to_double(W), &bd, N, C, OC), 1e-5, 1e-6));
  std::fill(y.begin(), y.end(), std::numeric_limits<float>::quiet_NaN());
  linear_forward(y.data(), x.data(), W.data(), nullptr, N, C, OC);
  EXPECT_TRUE(kt::close(y, ref_linear(kt::to_double(x), kt::to_double(W), nullptr, N, C, OC), 1e-5, 1e-6));
}

// Gradient check: L = sum dout * linear(x, W, b); analytic (float kernel) vs central differences
// of the double reference. Tolerance rel 1e-4, abs 1e-5 (gradients are O(1)).
TEST(Linear, BackwardMatchesFiniteDifferences) {
  const int64_t N = 5, C = 7, OC = 3;
  auto x = kt::randn(N * C, 31), W = kt::randn(OC * C, 32), b = kt::randn(OC, 33);
  auto dout = kt::randn(N * OC, 34);
  auto xd = kt::to_double(x), Wd = kt::to_double(W), bd = kt::to_double(b), dd = kt::to_double(dout);
  std::vector<float> dx(N * C, 0.0f), dW(OC * C, 0.0f), db(OC, 0.0f);
  linear_backward(dx.data(), dW.data(), db.data(), dout.data(), x.data(), W.data(), N, C, OC);
  auto gx = kt::numgrad([&](const std::vector<double>& v) { return kt::dot(dd, ref_linear(v, Wd, &bd, N, C, OC)); }, xd);
  auto gW = kt::numgrad([&](const std::vector<double>& v) { return kt::dot(dd, ref_linear(xd, v, &bd, N, C, OC)); }, Wd);
  auto gb = kt::numgrad([&](const std::vector<double>& v) { return kt::dot(dd, ref_linear(xd, Wd, &v, N, C, OC)); }, bd);
  EXPECT_TRUE(kt::close(dx, gx, 1e-4, 1e-5));
  EXPECT_TRUE(kt::close(dW, gW, 1e-4, 1e-5));
  EXPECT_TRUE(kt::close(db, gb, 1e-4, 1e-5));
}

TEST(Linear, BackwardAccumulatesAndSkipsNullOutputs) {
  const int64_t N = 9, C = 5, OC = 4;
  auto x = kt::randn(N * C, 41), W = kt::randn(OC * C, 42), dout = kt::randn(N * OC, 43);
  std::vector<float> dx0(N * C, 0.0f), dW0(OC * C, 0.0f), db0(OC, 0.0f);
  linear_backward(dx0.data(), dW0.data(), db0.data(), dout.data(), x.data(), W.data(), N, C, OC);
  auto gx = kt::randn(N * C, 44), gW = kt::randn(OC * C, 45), gb = kt::randn(OC, 46);
  auto dx = gx, dW = gW, db = gb;
  linear_backward(dx.data(), dW.data(), db.data(), dout.data(), x.data(), W.data(), N, C, OC);
  auto sum = [](const std::vector<float>& a, const std::vector<float>& b) {
    std::vector<double> s(a.size());
    for (size_t i = 0; i < a.size(); ++i) s[i] = double(a[i]) + double(b[i]);
    return s;
  };
  EXPECT_TRUE(kt::close(dx, sum(gx, dx0), 1e-6, 1e-6));
  EXPECT_TRUE(kt::close(dW, sum(gW, dW0), 1e-6, 1e-6));
  EXPECT_TRUE(kt::close(db, sum(gb, db0), 1e-6, 1e-6));
  // dinp and dbias may be null (first layer, no bias).
  auto dW2 = gW;
  linear_backward(nullptr, dW2.data(), nullptr, dout.data(), x.data(), W.data(), N, C, OC);
  EXPECT_TRUE(kt::bitwise_equal(dW2, dW));
}

TEST(LinearBf16, ForwardAndBackwardMatchRoundedReference) {
  const int64_t N = 5, C = 7, OC = 3;
  auto x = kt::randn(N * C, 51), W = kt::randn(OC * C, 52), b = kt::randn(OC, 53);
  auto dout = kt::randn(N * OC, 54);
  auto x16 = to_bf16(x), W16 = to_bf16(W);
  auto xr = bf16_to_double(x16), Wr = bf16_to_double(W16), bd = kt::to_double(b);
  std::vector<float> y(N * OC);
  linear_forward_bf16(y.data(), x16.data(), W16.data(), b.data(), N, C, OC);
  EXPECT_TRUE(kt::close(y, ref_linear(xr, Wr, &bd, N, C, OC), 1e-5, 1e-6));
  // Backward: dout is rounded to bf16 for the GEMMs, the bias gradient uses fp32 dout.
  auto dr = bf16_to_double(to_bf16(dout));
  auto dd = kt::to_double(dout);
  std::vector<float> dx(N * C, 0.0f), dW(OC * C, 0.0f), db(OC, 0.0f);
  linear_backward_bf16(dx.data(), dW.data(), db.data(), dout.data(), x16.data(), W16.data(), N, C, OC);
  auto gx = kt::numgrad([&](const std::vector<double>& v) { return kt::dot(dr, ref_linear(v, Wr, &bd, N, C, OC)); }, xr);
  auto gW = kt::numgrad([&](const std::vector<double>& v) { return kt::dot(dr, ref_linear(xr, v, &bd, N, C, OC)); }, Wr);
  auto gb = kt::numgrad([&](const std::vector<double>& v) { return kt::dot(dd, ref_linear(xr, Wr, &v, N, C, OC)); }, bd);
  EXPECT_TRUE(kt::close(dx, gx, 1e-4, 1e-5));
  EXPECT_TRUE(kt::close(dW, gW, 1e-4, 1e-5));
  EXPECT_TRUE(kt::close(db, gb, 1e-4, 1e-5));
  // Accumulates into existing gradients.
  auto g0x = kt::randn(N * C, 55), g0W = kt::randn(OC * C, 56), g0b = kt::randn(OC, 57);
  auto ax = g0x, aW = g0W, ab = g0b;
  linear_backward_bf16(ax.data(), aW.data(), ab.data(), dout.data(), x16.data(), W16.data(), N, C, OC);
  auto plus = [](const std::vector<float>& a, const std::vector<float>& b) {
    std::vector<double> r(a.size());
    for (size_t i = 0; i < a.size(); ++i) r[i] = double(a[i]) + double(b[i]);
    return r;
  };
  EXPECT_TRUE(kt::close(ax, plus(g0x, dx), 1e-6, 1e-6));
  EXPECT_TRUE(kt::close(aW, plus(g0W, dW), 1e-6, 1e-6));
  EXPECT_TRUE(kt::close(ab, plus(g0b, db), 1e-6, 1e-6));
}

// The linear forward's bias added by the bf16 primitive itself (written once) gives what filling
// the output with the bias and accumulating the product into it (beta = 1) gives, bit for bit, at
// a block layer's shape and an odd one, on 1 and 2 threads.
TEST(LinearBf16, FusedBiasEqualsBroadcastThenAccumulate) {
  const int before = omp_get_max_threads();
  for (auto [N, C, OC] : {std::tuple<int64_t, int64_t, int64_t>{1024, 384, 1152}, {37, 53, 29}})
    for (int threads : {1, 2}) {
      omp_set_num_threads(threads);
      auto x16 = to_bf16(kt::randn(N * C, 61)), W16 = to_bf16(kt::randn(OC * C, 62));
      auto b = kt::randn(OC, 63);
      std::vector<float> fused(N * OC, 7.0f), acc(N * OC);
      linear_forward_bf16(fused.data(), x16.data(), W16.data(), b.data(), N, C, OC);
      for (int64_t n = 0; n < N; ++n) std::copy(b.begin(), b.end(), acc.begin() + n * OC);
      gemm_bf16(false, true, N, OC, C, 1.0f, x16.data(), W16.data(), 1.0f, acc.data());
      EXPECT_TRUE(kt::bitwise_equal(fused, acc)) << N << "x" << OC << "x" << C << ", " << threads << " threads";
    }
  omp_set_num_threads(before);
}

// With a bias, the bf16 copy of dout and the bias gradient come from one pass over dout: the same
// bits as the gradients computed without the bias plus the bias gradient alone, on 1 and 2 threads
// (a width with a partial column block).
TEST(LinearBf16, BackwardWithBiasEqualsSeparatePasses) {
  const int before = omp_get_max_threads();
  const int64_t N = 300, C = 48, OC = 1000 + 37;
  auto x16 = to_bf16(kt::randn(N * C, 66)), W16 = to_bf16(kt::randn(OC * C, 67));
  auto dout = kt::randn(N * OC, 68);
  for (int threads : {1, 2}) {
    omp_set_num_threads(threads);
    auto ax = kt::randn(N * C, 69), aW = kt::randn(OC * C, 70), ab = kt::randn(OC, 71);
    auto bx = ax, bW = aW, bb = ab;
    linear_backward_bf16(ax.data(), aW.data(), ab.data(), dout.data(), x16.data(), W16.data(), N, C, OC);
    linear_backward_bf16(bx.data(), bW.data(), nullptr, dout.data(), x16.data(), W16.data(), N, C, OC);
    linear_backward_bf16(nullptr, nullptr, bb.data(), dout.data(), x16.data(), W16.data(), N, C, OC);
    EXPECT_TRUE(kt::bitwise_equal(ax, bx)) << threads;
    EXPECT_TRUE(kt::bitwise_equal(aW, bW)) << threads;
    EXPECT_TRUE(kt::bitwise_equal(ab, bb)) << threads;
  }
  omp_set_num_threads(before);
}

// An output gradient that is already bf16 (the LM head's, as softmax_cross_entropy_bf16 leaves
// it): the same sums as linear_backward_bf16 on the fp32 gradient it rounds, bit for bit, on the
// default and the widening path, with a vocabulary-sized width (dinp's K split engages), and
// accumulating.
TEST(LinearBf16, BackwardFromBf16GradientEqualsRoundedFp32Gradient) {
  const int64_t N = 48, C = 40, OC = 20000;
  auto x16 = to_bf16(kt::randn(N * C, 61)), W16 = to_bf16(kt::randn(OC * C, 62, 0.05f));
  auto dout = kt::randn(N * OC, 63, 1e-3f);
  auto d16 = to_bf16(dout);
  for (bool widen : {false, true}) {
    detail::set_bf16_force_fallback(widen);
    auto ax = kt::randn(N * C, 64), aW = kt::randn(OC * C, 65);
    auto bx = ax, bW = aW;
    linear_backward_bf16(ax.data(), aW.data(), nullptr, dout.data(), x16.data(), W16.data(), N, C, OC);
    linear_backward_bf16_dy(bx.data(), bW.data(), d16.data(), x16.data(), W16.data(), N, C, OC);
    EXPECT_TRUE(kt::bitwise_equal(ax, bx)) << (widen ? "widened" : "default");
    EXPECT_TRUE(kt::bitwise_equal(aW, bW)) << (widen ? "widened" : "default");
  }
  detail::set_bf16_force_fallback(false);
  // Against the double reference of the rounded gradient.
  std::vector<float> dx(N * C, 0.0f);
  linear_backward_bf16_dy(dx.data(), nullptr, d16.data(), x16.data(), W16.data(), N, C, OC);
  auto want = ref_gemm(false, false, N, C, OC, 1.0, bf16_to_double(d16), bf16_to_double(W16), 0.0,
                       std::vector<double>(N * C, 0.0));
  EXPECT_TRUE(kt::close(dx, want, 1e-5, 2e-5 * std::sqrt(double(OC)) * 1e-3));
}

// The gradient check must reject a wrong gradient: a linear backward that forgets the bias
// broadcast (dbias from only the first row) or transposes W is caught at these tolerances.
TEST(Linear, GradientCheckRejectsWrongGradient) {
  const int64_t N = 5, C = 7, OC = 3;
  auto x = kt::randn(N * C, 61), W = kt::randn(OC * C, 62), dout = kt::randn(N * OC, 63);
  auto xd = kt::to_double(x), Wd = kt::to_double(W), dd = kt::to_double(dout);
  auto gW = kt::numgrad([&](const std::vector<double>& v) { return kt::dot(dd, ref_linear(xd, v, nullptr, N, C, OC)); }, Wd);
  std::vector<float> dW(OC * C, 0.0f);
  linear_backward(nullptr, dW.data(), nullptr, dout.data(), x.data(), W.data(), N - 1, C, OC);  // drops a row
  EXPECT_FALSE(kt::close(dW, gW, 1e-4, 1e-5));
}

}  // namespace
}  // namespace mt::kernels::cpu
