// The emulator's cuBLASLt (runtime/cuda/emu/cublaslt.cpp) against a double-precision column-major
// reference: every transpose pair, fp32 and bf16 inputs, fp32 and bf16 outputs, padded leading
// dimensions, alpha and beta (beta = 0 never reads C); and the calls cuBLASLt refuses.
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

namespace {

uint16_t to_bf16(float f) {  // round to nearest even
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
float from_bf16(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// A column-major rows x cols matrix with leading dimension ld, random values, on the host and on
// the device (fp32 or bf16 storage).
struct Mat {
  uint64_t rows, cols;
  int64_t ld;
  cudaDataType_t type;
  std::vector<float> h;  // the values as stored (bf16 ones widened)
  void* d = nullptr;
  Mat(uint64_t r, uint64_t c, int64_t l, cudaDataType_t t, uint64_t seed) : rows(r), cols(c), ld(l), type(t) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    h.assign(static_cast<size_t>(ld) * cols, 0.0f);
    for (auto& x : h) x = t == CUDA_R_16BF ? from_bf16(to_bf16(nd(rng))) : nd(rng);
    const size_t es = t == CUDA_R_16BF ? 2 : 4;
    EXPECT_EQ(cudaMalloc(&d, h.size() * es), cudaSuccess);
    upload();
  }
  void upload() {
    if (type == CUDA_R_16BF) {
      std::vector<uint16_t> b(h.size());
      for (size_t i = 0; i < h.size(); ++i) b[i] = to_bf16(h[i]);
      cudaMemcpy(d, b.data(), b.size() * 2, cudaMemcpyHostToDevice);
    } else {
      cudaMemcpy(d, h.data(), h.size() * 4, cudaMemcpyHostToDevice);
    }
  }
  std::vector<float> download() const {
    std::vector<float> out(h.size());
    if (type == CUDA_R_16BF) {
      std::vector<uint16_t> b(h.size());
      cudaMemcpy(b.data(), d, b.size() * 2, cudaMemcpyDeviceToHost);
      for (size_t i = 0; i < b.size(); ++i) out[i] = from_bf16(b[i]);
    } else {
      cudaMemcpy(out.data(), d, out.size() * 4, cudaMemcpyDeviceToHost);
    }
    return out;
  }
  double at(uint64_t r, uint64_t c) const { return h[r + c * static_cast<uint64_t>(ld)]; }
  ~Mat() { cudaFree(d); }
  Mat(const Mat&) = delete;
  Mat& operator=(const Mat&) = delete;
};

struct Lt {
  cublasLtHandle_t h = nullptr;
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  Lt() {
    EXPECT_EQ(cublasLtCreate(&h), CUBLAS_STATUS_SUCCESS);
    EXPECT_EQ(cublasLtMatmulPreferenceCreate(&pref), CUBLAS_STATUS_SUCCESS);
  }
  ~Lt() {
    cublasLtMatmulPreferenceDestroy(pref);
    cublasLtMatrixLayoutDestroy(a);
    cublasLtMatrixLayoutDestroy(b);
    cublasLtMatrixLayoutDestroy(c);
    cublasLtMatmulDescDestroy(op);
    cublasLtDestroy(h);
  }
  void describe(cublasOperation_t ta, cublasOperation_t tb, const Mat& A, const Mat& B, const Mat& C) {
    ASSERT_EQ(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F), CUBLAS_STATUS_SUCCESS);
    ASSERT_EQ(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta), CUBLAS_STATUS_SUCCESS);
    ASSERT_EQ(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb), CUBLAS_STATUS_SUCCESS);
    ASSERT_EQ(cublasLtMatrixLayoutCreate(&a, A.type, A.rows, A.cols, A.ld), CUBLAS_STATUS_SUCCESS);
    ASSERT_EQ(cublasLtMatrixLayoutCreate(&b, B.type, B.rows, B.cols, B.ld), CUBLAS_STATUS_SUCCESS);
    ASSERT_EQ(cublasLtMatrixLayoutCreate(&c, C.type, C.rows, C.cols, C.ld), CUBLAS_STATUS_SUCCESS);
  }
  cublasStatus_t heuristic(cublasLtMatmulHeuristicResult_t* r, int* found) {
    return cublasLtMatmulAlgoGetHeuristic(h, op, a, b, c, c, pref, 1, r, found);
  }
  cublasStatus_t matmul(float alpha, const Mat& A, const Mat& B, float beta, const Mat& C,
                        const cublasLtMatmulHeuristicResult_t& r, void* ws, size_t ws_bytes) {
    return cublasLtMatmul(h, op, &alpha, A.d, a, B.d, b, &beta, C.d, c, C.d, c, &r.algo, ws, ws_bytes, nullptr);
  }
};

TEST(EmulatedCublasLt, MatchesAReferenceForEveryTransposeAndType) {
  const uint64_t m = 37, n = 29, k = 45;
  void* ws = nullptr;
  ASSERT_EQ(cudaMalloc(&ws, 1 << 20), cudaSuccess);
  for (int in16 = 0; in16 < 2; ++in16)
    for (int out16 = 0; out16 <= in16; ++out16)
      for (int ta = 0; ta < 2; ++ta)
        for (int tb = 0; tb < 2; ++tb)
          for (float beta : {0.0f, 0.5f}) {
            const cudaDataType_t ti = in16 ? CUDA_R_16BF : CUDA_R_32F, to = out16 ? CUDA_R_16BF : CUDA_R_32F;
            Mat A(ta ? k : m, ta ? m : k, (ta ? k : m) + 3, ti, 1), B(tb ? n : k, tb ? k : n, (tb ? n : k) + 1, ti, 2);
            Mat C(m, n, m + 2, to, 3);
            if (beta == 0.0f) {  // C holds NaN: with beta = 0 cuBLASLt must not read it
              for (auto& x : C.h) x = NAN;
              C.upload();
            }
            const std::vector<float> c0 = C.h;
            Lt lt;
            lt.describe(ta ? CUBLAS_OP_T : CUBLAS_OP_N, tb ? CUBLAS_OP_T : CUBLAS_OP_N, A, B, C);
            const uint64_t wsb = 1 << 20;
            ASSERT_EQ(cublasLtMatmulPreferenceSetAttribute(lt.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb,
                                                           sizeof wsb),
                      CUBLAS_STATUS_SUCCESS);
            cublasLtMatmulHeuristicResult_t r{};
            int found = 0;
            ASSERT_EQ(lt.heuristic(&r, &found), CUBLAS_STATUS_SUCCESS);
            ASSERT_EQ(found, 1);
            ASSERT_EQ(lt.matmul(1.5f, A, B, beta, C, r, ws, 1 << 20), CUBLAS_STATUS_SUCCESS);
            const auto got = C.download();
            const double tol = out16 ? 1.0 / 128 : 1e-5;
            for (uint64_t j = 0; j < n; ++j)
              for (uint64_t i = 0; i < m; ++i) {
                double want = 0.0;
                for (uint64_t p = 0; p < k; ++p)
                  want += (ta ? A.at(p, i) : A.at(i, p)) * (tb ? B.at(j, p) : B.at(p, j));
                want = 1.5 * want + (beta != 0.0f ? beta * c0[i + j * (m + 2)] : 0.0);
                const double g = got[i + j * (m + 2)];
                ASSERT_LE(std::abs(g - want), tol * (std::abs(want) + 1.0))
                    << "in16 " << in16 << " out16 " << out16 << " ta " << ta << " tb " << tb << " beta " << beta
                    << " at (" << i << ", " << j << ")";
              }
            for (uint64_t j = 0; j < n; ++j)  // the padding rows of C are not written
              for (uint64_t i = m; i < m + 2; ++i)
                ASSERT_EQ(std::isnan(got[i + j * (m + 2)]), std::isnan(c0[i + j * (m + 2)]));
          }
  cudaFree(ws);
}

// The BIAS epilogue: D = alpha A B + beta C + bias, one fp32 value per row of D; the sum equals the
// plain matmul's result plus the bias, added once in fp32. An algorithm remembers its epilogue: one
// chosen without the bias is refused with it, and a bias without its pointer is invalid.
TEST(EmulatedCublasLt, BiasEpilogueAddsOneValuePerRowOfD) {
  Mat A(7, 5, 7, CUDA_R_32F, 11), B(5, 6, 5, CUDA_R_32F, 12), C(7, 6, 7, CUDA_R_32F, 13), bias(7, 1, 7, CUDA_R_32F, 14);
  Lt lt;
  lt.describe(CUBLAS_OP_N, CUBLAS_OP_N, A, B, C);
  cublasLtMatmulHeuristicResult_t plain{}, with_bias{};
  int found = 0;
  ASSERT_EQ(lt.heuristic(&plain, &found), CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(found, 1);
  ASSERT_EQ(lt.matmul(1.0f, A, B, 0.0f, C, plain, nullptr, 0), CUBLAS_STATUS_SUCCESS);
  const std::vector<float> product = C.download();
  const uint32_t epi = CUBLASLT_EPILOGUE_BIAS;
  ASSERT_EQ(cublasLtMatmulDescSetAttribute(lt.op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi),
            CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(lt.heuristic(&with_bias, &found), CUBLAS_STATUS_INVALID_VALUE);  // no bias pointer yet
  const void* bp = bias.d;
  ASSERT_EQ(cublasLtMatmulDescSetAttribute(lt.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bp, sizeof bp),
            CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(lt.matmul(1.0f, A, B, 0.0f, C, plain, nullptr, 0), CUBLAS_STATUS_NOT_SUPPORTED);  // chosen without it
  ASSERT_EQ(lt.heuristic(&with_bias, &found), CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(found, 1);
  ASSERT_EQ(lt.matmul(1.0f, A, B, 0.0f, C, with_bias, nullptr, 0), CUBLAS_STATUS_SUCCESS);
  const std::vector<float> got = C.download();
  for (uint64_t j = 0; j < 6; ++j)
    for (uint64_t i = 0; i < 7; ++i) {
      const float want = product[i + j * 7] + bias.h[i];
      EXPECT_EQ(got[i + j * 7], want) << "row " << i << ", column " << j;
    }
}

TEST(EmulatedCublasLt, RefusesWhatCublasLtRefuses) {
  Mat A(8, 6, 8, CUDA_R_32F, 1), B(6, 5, 6, CUDA_R_32F, 2), C(8, 5, 8, CUDA_R_32F, 3);
  Lt lt;
  lt.describe(CUBLAS_OP_N, CUBLAS_OP_N, A, B, C);
  cublasLtMatmulHeuristicResult_t r{};
  int found = 0;
  // An attribute of the wrong size.
  const int64_t wide = CUBLAS_OP_T;
  EXPECT_EQ(cublasLtMatmulDescSetAttribute(lt.op, CUBLASLT_MATMUL_DESC_TRANSA, &wide, sizeof wide),
            CUBLAS_STATUS_INVALID_VALUE);
  // Shapes that do not agree with the transposes: A as 8 x 6 but op(A) = A^T.
  const cublasOperation_t t = CUBLAS_OP_T;
  ASSERT_EQ(cublasLtMatmulDescSetAttribute(lt.op, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof t), CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(lt.heuristic(&r, &found), CUBLAS_STATUS_INVALID_VALUE);
  const cublasOperation_t nt = CUBLAS_OP_N;
  ASSERT_EQ(cublasLtMatmulDescSetAttribute(lt.op, CUBLASLT_MATMUL_DESC_TRANSA, &nt, sizeof nt), CUBLAS_STATUS_SUCCESS);
  // No algorithm for operands aligned below their element size.
  const uint32_t two = 2;
  ASSERT_EQ(cublasLtMatmulPreferenceSetAttribute(lt.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &two, sizeof two),
            CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(lt.heuristic(&r, &found), CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(found, 0);
  // An algorithm chosen for 256-byte aligned pointers, called with a 4-byte aligned one.
  const uint32_t full = 256;
  ASSERT_EQ(
      cublasLtMatmulPreferenceSetAttribute(lt.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &full, sizeof full),
      CUBLAS_STATUS_SUCCESS);
  const uint64_t wsb = 4096;
  ASSERT_EQ(cublasLtMatmulPreferenceSetAttribute(lt.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof wsb),
            CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(lt.heuristic(&r, &found), CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(found, 1);
  EXPECT_EQ(r.workspaceSize, 4096u);
  void* ws = nullptr;
  ASSERT_EQ(cudaMalloc(&ws, 4096), cudaSuccess);
  const float alpha = 1.0f, beta = 0.0f;
  EXPECT_EQ(cublasLtMatmul(lt.h, lt.op, &alpha, static_cast<float*>(A.d) + 1, lt.a, B.d, lt.b, &beta, C.d, lt.c, C.d,
                           lt.c, &r.algo, ws, 4096, nullptr),
            CUBLAS_STATUS_NOT_SUPPORTED);
  // A workspace smaller than the algorithm asks for.
  EXPECT_EQ(lt.matmul(1.0f, A, B, 0.0f, C, r, ws, 1024), CUBLAS_STATUS_INVALID_VALUE);
  // bf16 output from fp32 inputs.
  cublasLtMatrixLayout_t c16 = nullptr;
  ASSERT_EQ(cublasLtMatrixLayoutCreate(&c16, CUDA_R_16BF, 8, 5, 8), CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(cublasLtMatmulAlgoGetHeuristic(lt.h, lt.op, lt.a, lt.b, c16, c16, lt.pref, 1, &r, &found),
            CUBLAS_STATUS_NOT_SUPPORTED);
  EXPECT_EQ(lt.matmul(1.0f, A, B, 0.0f, C, r, ws, 4096), CUBLAS_STATUS_SUCCESS);
  // A host operand: the GPU would fault; the emulator stops with the operand's name.
  alignas(256) float host[64] = {};
  EXPECT_DEATH(cublasLtMatmul(lt.h, lt.op, &alpha, host, lt.a, B.d, lt.b, &beta, C.d, lt.c, C.d, lt.c, &r.algo, ws,
                              4096, nullptr),
               "cublasLtMatmul: operand A .* is not inside one device allocation");
  cublasLtMatrixLayoutDestroy(c16);
  cudaFree(ws);
}

}  // namespace
