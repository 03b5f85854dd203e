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

// What a GEMM's epilogue adds to D = alpha op(A) op(B) + beta C (row-major names as in gemm()).
struct Epi {
  enum Kind : uint32_t { kPlain, kGeluAux, kDgelu, kBgradB } kind = kPlain;
  const float* bias = nullptr;  // kPlain, kGeluAux: one fp32 value per column of the row-major C, added
  void* aux = nullptr;          // kGeluAux: the pre-activation written (D's type); kDgelu: read
  float* bgrad = nullptr;       // kBgradB: column sums of the row-major A over its rows ([N] for ta), written
  bool out_bf16 = false;        // D (and C) bf16 instead of fp32
  uint32_t lt() const {
    switch (kind) {
      case kGeluAux: return bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX;
      case kDgelu: return CUBLASLT_EPILOGUE_DGELU;
      case kBgradB: return CUBLASLT_EPILOGUE_BGRADB;
      case kPlain: break;
    }
    return bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
  }
};

// cuBLASLt takes an auxiliary (GELU input) matrix whose leading dimension is a multiple of 8 and
// whose pointer is 16-byte aligned; other shapes run the unfused passes.
bool aux_fusable(const void* aux, int64_t ld) { return ld % 8 == 0 && alignment(aux) >= 16; }

using Key = std::tuple<bool, bool, int64_t, int64_t, int64_t, bool, bool, int, int, int, int, uint32_t, bool, int>;

// Row-major C[M,N] = alpha op(A) op(B) + beta C; A is [M,K] ([K,M] if ta), B is [K,N] ([N,K] if
// tb); A and B fp32 or bf16 (in_bf16), C fp32 (bf16 with e.out_bf16). The epilogue e: the bias
// (e.bias: C[m, :] += bias, N values), GELU with its input saved (kGeluAux), the GELU gradient
// (kDgelu) or the bias gradient of the row-major A (kBgradB).
void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const void* A, const void* B, float beta,
          void* C, bool in_bf16, const Epi& e = {}) {
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {  // C = beta C (+ bias); only plain epilogues reach here (the fused ops check K)
    float* Cf = static_cast<float*>(C);
    if (beta == 0.0f) mt::cuda::zero(Cf, static_cast<size_t>(M * N) * sizeof(float));
    else if (beta != 1.0f) scale(Cf, beta, M * N);
    if (e.bias) add_bias(Cf, e.bias, M, N);
    return;
  }
  const cudaDataType_t in_t = in_bf16 ? CUDA_R_16BF : CUDA_R_32F, out_t = e.out_bf16 ? CUDA_R_16BF : CUDA_R_32F;
  // Column-major view: D[N x M] = opX(B_rm) [N x K] * opY(A_rm) [K x M].
  const cublasOperation_t opa = tb ? CUBLAS_OP_T : CUBLAS_OP_N;  // applies to B_rm
  const cublasOperation_t opb = ta ? CUBLAS_OP_T : CUBLAS_OP_N;  // applies to A_rm
  Desc d;
  lt_check(cublasLtMatmulDescCreate(&d.op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "MatmulDescCreate");
  lt_check(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof opa), "set TRANSA");
  lt_check(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof opb), "set TRANSB");
  const uint32_t epi = e.lt();
  const float* vec = e.kind == Epi::kBgradB ? e.bgrad : e.bias;
  if (epi != CUBLASLT_EPILOGUE_DEFAULT)
    lt_check(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi), "set EPILOGUE");
  if (vec) {  // column-major D is [N x M]: one bias value per row of D, broadcast over its M columns
    lt_check(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &vec, sizeof vec),
             "set BIAS_POINTER");
    if (e.out_bf16) {  // the bias stays fp32 under a bf16 D (its type defaults to D's)
      const int32_t bt = CUDA_R_32F;
      lt_check(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof bt),
               "set BIAS_DATA_TYPE");
    }
  }
  if (e.aux) {  // the GELU input, laid out as D
    const int64_t ld = N;
    lt_check(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &e.aux, sizeof e.aux),
             "set EPILOGUE_AUX_POINTER");
    lt_check(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld, sizeof ld),
             "set EPILOGUE_AUX_LD");
  }
  // Stored shapes (rows x cols, column-major, ld = rows).
  const uint64_t a_rows = tb ? K : N, a_cols = tb ? N : K;  // B_rm
  const uint64_t b_rows = ta ? M : K, b_cols = ta ? K : M;  // A_rm
  lt_check(cublasLtMatrixLayoutCreate(&d.a, in_t, a_rows, a_cols, static_cast<int64_t>(a_rows)), "layout A");
  lt_check(cublasLtMatrixLayoutCreate(&d.b, in_t, b_rows, b_cols, static_cast<int64_t>(b_rows)), "layout B");
  lt_check(cublasLtMatrixLayoutCreate(&d.c, out_t, N, M, N), "layout C");

  const int al_a = alignment(B), al_b = alignment(A), al_c = alignment(C);
  const Key key{ta, tb, M, N, K, in_bf16, beta != 0.0f, al_a, al_b, al_c, vec ? alignment(vec) : 0,
                epi, e.out_bf16, e.aux ? alignment(e.aux) : 0};
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
                                 " GEMM of M=" + std::to_string(M) + " N=" + std::to_string(N) + " K=" + std::to_string(K) +
                                 " (epilogue " + std::to_string(epi) + ")");
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
  gemm(false, true, N, OC, C, 1.0f, inp, W, 0.0f, out, false, Epi{.bias = bias});
}
void linear_backward(float* dinp, float* dW, float* dbias, const float* dout, const float* inp, const float* W,
                     int64_t N, int64_t C, int64_t OC) {
  if (dinp) gemm(false, false, N, C, OC, 1.0f, dout, W, 1.0f, dinp, false);
  if (dW) gemm(true, false, OC, C, N, 1.0f, dout, inp, 1.0f, dW, false);
  if (dbias && N > 0 && OC > 0) bias_backward(dbias, dout, N, OC);
}
void linear_forward_bf16(float* out, const bf16* inp, const bf16* W, const float* bias, int64_t N, int64_t C,
                         int64_t OC) {
  gemm(false, true, N, OC, C, 1.0f, inp, W, 0.0f, out, true, Epi{.bias = bias});
}
void linear_forward_bf16_out16(bf16* out, const bf16* inp, const bf16* W, const float* bias, int64_t N, int64_t C,
                               int64_t OC) {
  if (N <= 0 || OC <= 0) return;
  if (C > 0) {  // D in bf16 (the fp32 bias through BIAS_DATA_TYPE)
    gemm(false, true, N, OC, C, 1.0f, inp, W, 0.0f, out, true, Epi{.bias = bias, .out_bf16 = true});
    return;
  }
  float* y = static_cast<float*>(scratch(kScratchEpilogue, static_cast<size_t>(N * OC) * sizeof(float)));
  gemm(false, true, N, OC, C, 1.0f, inp, W, 0.0f, y, true, Epi{.bias = bias});  // no products: zeros (+ bias)
  cast_f32_to_bf16(out, y, N * OC);
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


namespace {
// The unfused passes of the GELU epilogues (shapes cuBLASLt cannot fuse): GELU's tanh form, as
// gelu_forward / gelu_backward (elementwise.cu) and cuBLASLt's epilogue compute it.
__device__ __forceinline__ float gelu_t(float x) {
  return 0.5f * x * (1.0f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
}
__device__ __forceinline__ float dgelu_t(float x) {
  const float k = 0.7978845608028654f, t = tanhf(k * (x + 0.044715f * x * x * x));
  return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * k * (1.0f + 3.0f * 0.044715f * x * x);
}
__global__ void gelu_split_k(uint16_t* act, uint16_t* pre, const float* y, int64_t n) {
  MT_GRID_STRIDE(i, n) {
    pre[i] = f32_to_bf16_bits(y[i]);
    act[i] = f32_to_bf16_bits(gelu_t(y[i]));
  }
}
__global__ void dgelu_k(uint16_t* dpre, const float* dx, const uint16_t* pre, int64_t n) {
  MT_GRID_STRIDE(i, n) dpre[i] = f32_to_bf16_bits(dx[i] * dgelu_t(bf16_bits_to_f32(pre[i])));
}
}  // namespace

void linear_gelu_forward_bf16(bf16* act, bf16* pre, const bf16* inp, const bf16* W, const float* bias, int64_t N,
                              int64_t C, int64_t OC) {
  if (N <= 0 || OC <= 0) return;
  if (C > 0 && aux_fusable(pre, OC)) {  // GELU_AUX(_BIAS): D = gelu(y) in bf16, aux = y in bf16
    gemm(false, true, N, OC, C, 1.0f, inp, W, 0.0f, act, true, Epi{.kind = Epi::kGeluAux, .bias = bias, .aux = pre,
                                                                    .out_bf16 = true});
    return;
  }
  float* y = static_cast<float*>(scratch(kScratchEpilogue, static_cast<size_t>(N * OC) * sizeof(float)));
  gemm(false, true, N, OC, C, 1.0f, inp, W, 0.0f, y, true, Epi{.bias = bias});
  MT_LAUNCH(gelu_split_k, grid_for(N * OC, 256), 256, 0, stream())(reinterpret_cast<uint16_t*>(act),
                                                                   reinterpret_cast<uint16_t*>(pre), y, N * OC);
  check_launch("gelu_split_k");
}

void linear_backward_dgelu_bf16(bf16* dpre, float* dW, float* dbias, const float* dout, const bf16* inp,
                                const bf16* W, const bf16* pre, int64_t N, int64_t C, int64_t OC) {
  if (N <= 0 || C <= 0) return;
  if (OC <= 0) {  // no output: the GELU input gets a zero gradient
    if (dpre) mt::cuda::zero(dpre, static_cast<size_t>(N * C) * sizeof(bf16));
    return;
  }
  bf16* d16 = static_cast<bf16*>(scratch(kScratchTmp, static_cast<size_t>(N * OC) * sizeof(bf16)));
  cast_f32_to_bf16(d16, dout, N * OC);
  if (dW) gemm(true, false, OC, C, N, 1.0f, d16, inp, 1.0f, dW, true);
  if (dbias) bias_backward(dbias, dout, N, OC);
  if (!dpre) return;
  if (aux_fusable(pre, C)) {  // DGELU: D = gelu'(aux) * (dout16 W), in bf16
    gemm(false, false, N, C, OC, 1.0f, d16, W, 0.0f, dpre, true,
         Epi{.kind = Epi::kDgelu, .aux = const_cast<bf16*>(pre), .out_bf16 = true});
    return;
  }
  float* dx = static_cast<float*>(scratch(kScratchEpilogue, static_cast<size_t>(N * C) * sizeof(float)));
  gemm(false, false, N, C, OC, 1.0f, d16, W, 0.0f, dx, true);
  MT_LAUNCH(dgelu_k, grid_for(N * C, 256), 256, 0, stream())(reinterpret_cast<uint16_t*>(dpre), dx,
                                                             reinterpret_cast<const uint16_t*>(pre), N * C);
  check_launch("dgelu_k");
}

void linear_backward_bf16_dy_bias(float* dinp, float* dW, float* dbias, const bf16* dout, const bf16* inp,
                                  const bf16* W, int64_t N, int64_t C, int64_t OC) {
  if (N <= 0 || OC <= 0) return;
  if (dinp) gemm(false, false, N, C, OC, 1.0f, dout, W, 1.0f, dinp, true);
  if (!dbias) {
    if (dW) gemm(true, false, OC, C, N, 1.0f, dout, inp, 1.0f, dW, true);
    return;
  }
  // BGRADB overwrites its vector: it goes to scratch and is added to dbias.
  float* bg = static_cast<float*>(scratch(kScratchBgrad, static_cast<size_t>(OC) * sizeof(float)));
  if (dW && C > 0) {
    gemm(true, false, OC, C, N, 1.0f, dout, inp, 1.0f, dW, true, Epi{.kind = Epi::kBgradB, .bgrad = bg});
  } else {  // no weight gradient to ride on: the column sums as a GEMM with a ones vector would; widen and sum
    float* w = static_cast<float*>(scratch(kScratchEpilogue, static_cast<size_t>(N * OC) * sizeof(float)));
    cast_bf16_to_f32(w, dout, N * OC);
    column_sums(dbias, nullptr, w, nullptr, nullptr, nullptr, N, OC);
    return;
  }
  accumulate(dbias, bg, OC);
}

}  // namespace mt::kernels::cuda
