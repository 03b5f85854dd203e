// Linear layers on cuBLASLt (contracts: kernels/cpu/gemm.h). Row-major GEMMs map to cuBLASLt's
// column-major ones by the usual transpose trick: row-major C[M,N] = op(A) op(B) is column-major
// C^T[N,M] = op(B)^T op(A)^T, and a row-major matrix is its own transpose in column-major order,
// so we call cuBLASLt with the operands swapped and m = N, n = M.
//
// fp32 GEMMs use CUBLAS_COMPUTE_32F (true fp32, no TF32: the CPU path's numerics); bf16 ones take
// bf16 A and B with fp32 accumulation and fp32 C/D. Backward accumulates (beta = 1). The forward's
// bias is cuBLASLt's BIAS epilogue (added to the fp32 result before it is stored: the same sum as a
// separate pass, without that pass over the output). The bias gradient is a two-stage deterministic
// column sum (reduce.cu), not the BGRAD epilogue: that one overwrites instead of accumulating and
// its summation order is not documented. The algorithm per (shape, alignments, epilogue) comes
// from the heuristic once and is cached; a 32 MiB workspace is kept as Scratch.
#include <cublasLt.h>

#include <map>
#include <mutex>
#include <tuple>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels.h"

namespace mt::kernels::cuda {

namespace {
constexpr size_t kWorkspace = size_t(32) << 20;

void lt_check(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS)
    throw std::runtime_error(std::string("meshtrain: cuda: cuBLASLt ") + what + " failed (status " +
                             std::to_string(static_cast<int>(s)) + ")");
}

cublasLtHandle_t lt_handle() {
  static cublasLtHandle_t h = [] {
    mt::cuda::require();
    cublasLtHandle_t x = nullptr;
    lt_check(cublasLtCreate(&x), "cublasLtCreate");
    return x;
  }();
  return h;
}

int alignment(const void* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  int al = 256;
  while (al > 1 && (a % static_cast<uintptr_t>(al)) != 0) al >>= 1;
  return al;
}

// RAII for the descriptors of one call.
struct Desc {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  ~Desc() {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

using Key = std::tuple<bool, bool, int64_t, int64_t, int64_t, bool, bool, int, int, int, int>;

// Row-major C[M,N] = alpha op(A) op(B) + beta C; A is [M,K] ([K,M] if ta), B is [K,N] ([N,K] if
// tb); A and B fp32 or bf16 (in_bf16), C fp32. bias (may be null): C[m, :] += bias, N values, in
// the epilogue.
void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const void* A, const void* B, float beta,
          float* C, bool in_bf16, const float* bias = nullptr) {
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {  // C = beta C (+ bias)
    if (beta == 0.0f) mt::cuda::zero(C, static_cast<size_t>(M * N) * sizeof(float));
    else if (beta != 1.0f) scale(C, beta, M * N);
    if (bias) add_bias(C, bias, M, N);
    return;
  }
  const cudaDataType_t in_t = in_bf16 ? CUDA_R_16BF : CUDA_R_32F;
  // Column-major view: D[N x M] = opX(B_rm) [N x K] * opY(A_rm) [K x M].
  const cublasOperation_t opa = tb ? CUBLAS_OP_T : CUBLAS_OP_N;  // applies to B_rm
  const cublasOperation_t opb = ta ? CUBLAS_OP_T : CUBLAS_OP_N;  // applies to A_rm
  Desc d;
  lt_check(cublasLtMatmulDescCreate(&d.op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "MatmulDescCreate");
  lt_check(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof opa), "set TRANSA");
  lt_check(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof opb), "set TRANSB");
  if (bias) {  // column-major D is [N x M]: one bias value per row of D, broadcast over its M columns
    const uint32_t epi = CUBLASLT_EPILOGUE_BIAS;
    lt_check(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi), "set EPILOGUE");
    lt_check(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias),
             "set BIAS_POINTER");
  }
  // Stored shapes (rows x cols, column-major, ld = rows).
  const uint64_t a_rows = tb ? K : N, a_cols = tb ? N : K;  // B_rm
  const uint64_t b_rows = ta ? M : K, b_cols = ta ? K : M;  // A_rm
  lt_check(cublasLtMatrixLayoutCreate(&d.a, in_t, a_rows, a_cols, static_cast<int64_t>(a_rows)), "layout A");
  lt_check(cublasLtMatrixLayoutCreate(&d.b, in_t, b_rows, b_cols, static_cast<int64_t>(b_rows)), "layout B");
  lt_check(cublasLtMatrixLayoutCreate(&d.c, CUDA_R_32F, N, M, N), "layout C");

  const int al_a = alignment(B), al_b = alignment(A), al_c = alignment(C);
  const Key key{ta, tb, M, N, K, in_bf16, beta != 0.0f, al_a, al_b, al_c, bias ? alignment(bias) : 0};
  static std::map<Key, cublasLtMatmulAlgo_t> algos;
  static std::mutex mu;
  cublasLtMatmulAlgo_t algo{};
  {
    std::lock_guard<std::mutex> lk(mu);
    auto it = algos.find(key);
    if (it != algos.end()) {
      algo = it->second;
    } else {
      lt_check(cublasLtMatmulPreferenceCreate(&d.pref), "PreferenceCreate");
      const uint64_t ws = kWorkspace;
      lt_check(cublasLtMatmulPreferenceSetAttribute(d.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws),
               "set workspace");
      const uint32_t ua = static_cast<uint32_t>(al_a), ub = static_cast<uint32_t>(al_b),
                     uc = static_cast<uint32_t>(al_c);
      lt_check(cublasLtMatmulPreferenceSetAttribute(d.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &ua, sizeof ua),
               "set alignment A");
      lt_check(cublasLtMatmulPreferenceSetAttribute(d.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &ub, sizeof ub),
               "set alignment B");
      lt_check(cublasLtMatmulPreferenceSetAttribute(d.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &uc, sizeof uc),
               "set alignment C");
      lt_check(cublasLtMatmulPreferenceSetAttribute(d.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &uc, sizeof uc),
               "set alignment D");
      cublasLtMatmulHeuristicResult_t res{};
      int found = 0;
      lt_check(cublasLtMatmulAlgoGetHeuristic(lt_handle(), d.op, d.a, d.b, d.c, d.c, d.pref, 1, &res, &found),
               "AlgoGetHeuristic");
      if (found == 0)
        throw std::runtime_error("meshtrain: cuda: cuBLASLt has no algorithm for a " + std::string(in_bf16 ? "bf16" : "fp32") +
                                 " GEMM of M=" + std::to_string(M) + " N=" + std::to_string(N) + " K=" + std::to_string(K));
      algo = res.algo;
      algos.emplace(key, algo);
    }
  }
  void* ws = scratch(kScratchGemm, kWorkspace);
  lt_check(cublasLtMatmul(lt_handle(), d.op, &alpha, B, d.a, A, d.b, &beta, C, d.c, C, d.c, &algo, ws, kWorkspace,
                          stream()),
           "Matmul");
}

// dbias[o] += sum_n dout[n, o]: a two-stage deterministic column sum (reduce.cu).
void bias_backward(float* dbias, const float* dout, int64_t N, int64_t OC) {
  column_sums(dbias, nullptr, dout, nullptr, nullptr, nullptr, N, OC);
}
}  // namespace

void linear_forward(float* out, const float* inp, const float* W, const float* bias, int64_t N, int64_t C, int64_t OC) {
  gemm(false, true, N, OC, C, 1.0f, inp, W, 0.0f, out, false, bias);
}
void linear_backward(float* dinp, float* dW, float* dbias, const float* dout, const float* inp, const float* W,
                     int64_t N, int64_t C, int64_t OC) {
  if (dinp) gemm(false, false, N, C, OC, 1.0f, dout, W, 1.0f, dinp, false);
  if (dW) gemm(true, false, OC, C, N, 1.0f, dout, inp, 1.0f, dW, false);
  if (dbias && N > 0 && OC > 0) bias_backward(dbias, dout, N, OC);
}
void linear_forward_bf16(float* out, const bf16* inp, const bf16* W, const float* bias, int64_t N, int64_t C,
                         int64_t OC) {
  gemm(false, true, N, OC, C, 1.0f, inp, W, 0.0f, out, true, bias);
}
void linear_backward_bf16(float* dinp, float* dW, float* dbias, const float* dout, const bf16* inp, const bf16* W,
                          int64_t N, int64_t C, int64_t OC) {
  if ((dinp || dW) && N > 0 && OC > 0) {
    // dout rounded to bf16 for the two GEMMs, as the CPU does.
    bf16* d16 = static_cast<bf16*>(scratch(kScratchTmp, static_cast<size_t>(N * OC) * sizeof(bf16)));
    cast_f32_to_bf16(d16, dout, N * OC);
    linear_backward_bf16_dy(dinp, dW, d16, inp, W, N, C, OC);
  }
  if (dbias && N > 0 && OC > 0) bias_backward(dbias, dout, N, OC);
}
void linear_backward_bf16_dy(float* dinp, float* dW, const bf16* dout, const bf16* inp, const bf16* W, int64_t N,
                             int64_t C, int64_t OC) {
  if (N <= 0 || OC <= 0) return;
  if (dinp) gemm(false, false, N, C, OC, 1.0f, dout, W, 1.0f, dinp, true);
  if (dW) gemm(true, false, OC, C, N, 1.0f, dout, inp, 1.0f, dW, true);
}

}  // namespace mt::kernels::cuda
