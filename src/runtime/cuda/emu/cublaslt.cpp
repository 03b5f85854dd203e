// The emulator's cuBLASLt (cublasLt.h): descriptors with cuBLASLt's checks, a heuristic that
// returns one algorithm carrying the alignments and workspace it was chosen for, and a host matmul
// with fp32 accumulation in index order (the GPU's order differs; tolerances in the tests).
#include "cublasLt.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "internal.h"

struct cublasLtContext {
  uint32_t magic;
};
struct cublasLtMatmulDescOpaque_t {
  int32_t compute, scale, pointer_mode = 0;
  int32_t transa = CUBLAS_OP_N, transb = CUBLAS_OP_N, transc = CUBLAS_OP_N;
  uint32_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  const void* bias = nullptr;  // CUBLASLT_MATMUL_DESC_BIAS_POINTER
  void* aux = nullptr;         // CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER
  int64_t aux_ld = 0;          // CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD
  int32_t bias_type = -1;      // CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE (-1: D's type)
};
struct cublasLtMatrixLayoutOpaque_t {
  cudaDataType_t type;
  uint64_t rows, cols;
  int64_t ld;
};
struct cublasLtMatmulPreferenceOpaque_t {
  uint64_t max_workspace = 0;
  uint32_t align[4] = {256, 256, 256, 256};  // A, B, C, D: cuBLASLt assumes 256-byte aligned pointers by default
  uint32_t search_mode = 0;
};

namespace {

constexpr uint32_t kHandleMagic = 0x4c744d54;  // "TMtL"
constexpr uint64_t kAlgoMagic = 0x6f676c41756d45ull;
constexpr uint64_t kAlgoWorkspace = uint64_t(1) << 20;  // what the emulated algorithm asks for, at most

size_t elem_bytes(cudaDataType_t t) { return t == CUDA_R_16BF || t == CUDA_R_16F ? 2 : t == CUDA_R_64F ? 8 : 4; }

struct Problem {
  uint64_t m, n, k;
  bool ta, tb, tf32;
};

cublasStatus_t set(void* dst, size_t want, const void* buf, size_t bytes) {
  if (!buf || bytes != want) return CUBLAS_STATUS_INVALID_VALUE;
  std::memcpy(dst, buf, bytes);
  return CUBLAS_STATUS_SUCCESS;
}

bool layout_ok(const cublasLtMatrixLayoutOpaque_t* l) {
  return l->rows > 0 && l->cols > 0 && l->ld >= static_cast<int64_t>(l->rows);
}

bool known_epilogue(uint32_t e) {
  return e == CUBLASLT_EPILOGUE_DEFAULT || e == CUBLASLT_EPILOGUE_BIAS || e == CUBLASLT_EPILOGUE_GELU_AUX ||
         e == CUBLASLT_EPILOGUE_GELU_AUX_BIAS || e == CUBLASLT_EPILOGUE_DGELU || e == CUBLASLT_EPILOGUE_BGRADB;
}
bool adds_bias(uint32_t e) { return e == CUBLASLT_EPILOGUE_BIAS || e == CUBLASLT_EPILOGUE_GELU_AUX_BIAS; }
bool uses_vector(uint32_t e) { return adds_bias(e) || e == CUBLASLT_EPILOGUE_BGRADB; }
bool uses_aux(uint32_t e) {
  return e == CUBLASLT_EPILOGUE_GELU_AUX || e == CUBLASLT_EPILOGUE_GELU_AUX_BIAS || e == CUBLASLT_EPILOGUE_DGELU;
}

// GELU's tanh form and its derivative (cuBLASLt's GELU epilogues use the tanh approximation).
float gelu_tanh(float x) { return 0.5f * x * (1.0f + std::tanh(0.7978845608028654f * (x + 0.044715f * x * x * x))); }
float dgelu_tanh(float x) {
  const float k = 0.7978845608028654f, t = std::tanh(k * (x + 0.044715f * x * x * x));
  return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * k * (1.0f + 3.0f * 0.044715f * x * x);
}

// cuBLASLt's checks of one problem (what AlgoGetHeuristic and Matmul both refuse).
cublasStatus_t validate(const cublasLtMatmulDescOpaque_t* op, const cublasLtMatrixLayoutOpaque_t* a,
                        const cublasLtMatrixLayoutOpaque_t* b, const cublasLtMatrixLayoutOpaque_t* c,
                        const cublasLtMatrixLayoutOpaque_t* d, Problem* p) {
  if (!op || !a || !b || !c || !d) return CUBLAS_STATUS_INVALID_VALUE;
  if ((op->compute != CUBLAS_COMPUTE_32F && op->compute != CUBLAS_COMPUTE_32F_FAST_TF32) || op->scale != CUDA_R_32F ||
      op->pointer_mode != 0 || op->transc != CUBLAS_OP_N || !known_epilogue(op->epilogue))
    return CUBLAS_STATUS_NOT_SUPPORTED;
  if (uses_vector(op->epilogue) && !op->bias) return CUBLAS_STATUS_INVALID_VALUE;
  if (uses_aux(op->epilogue)) {  // cuBLASLt: aux ld a multiple of 8, pointer 16-byte aligned
    if (!op->aux || op->aux_ld < static_cast<int64_t>(d->rows)) return CUBLAS_STATUS_INVALID_VALUE;
    if (op->aux_ld % 8 != 0 || reinterpret_cast<uintptr_t>(op->aux) % 16 != 0) return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  // The vector's type defaults to D's: an fp32 bias under a bf16 D needs BIAS_DATA_TYPE (only fp32 is emulated).
  if (uses_vector(op->epilogue) && (op->bias_type == -1 ? static_cast<int32_t>(d->type) : op->bias_type) != CUDA_R_32F)
    return CUBLAS_STATUS_NOT_SUPPORTED;
  const auto is_op = [](int32_t t) { return t == CUBLAS_OP_N || t == CUBLAS_OP_T || t == CUBLAS_OP_C; };
  if (!is_op(op->transa) || !is_op(op->transb)) return CUBLAS_STATUS_INVALID_VALUE;
  if (!layout_ok(a) || !layout_ok(b) || !layout_ok(c) || !layout_ok(d)) return CUBLAS_STATUS_INVALID_VALUE;
  p->ta = op->transa != CUBLAS_OP_N;
  p->tb = op->transb != CUBLAS_OP_N;
  p->m = d->rows;
  p->n = d->cols;
  p->k = p->ta ? a->rows : a->cols;
  if ((p->ta ? a->cols : a->rows) != p->m || (p->tb ? b->cols : b->rows) != p->k ||
      (p->tb ? b->rows : b->cols) != p->n || c->rows != p->m || c->cols != p->n)
    return CUBLAS_STATUS_INVALID_VALUE;
  const bool in32 = a->type == CUDA_R_32F, in16 = a->type == CUDA_R_16BF;
  if (b->type != a->type || c->type != d->type || !(in32 || in16)) return CUBLAS_STATUS_NOT_SUPPORTED;
  if (!(d->type == CUDA_R_32F || (in16 && d->type == CUDA_R_16BF))) return CUBLAS_STATUS_NOT_SUPPORTED;
  p->tf32 = op->compute == CUBLAS_COMPUTE_32F_FAST_TF32;
  if (p->tf32 && !in32) return CUBLAS_STATUS_NOT_SUPPORTED;
  return CUBLAS_STATUS_SUCCESS;
}

int alignment_of(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  int al = 256;
  while (al > 1 && a % static_cast<uintptr_t>(al) != 0) al >>= 1;
  return al;
}

// Aborts unless a matrix of layout l at p lies in device memory (the GPU would fault).
void require_device(const char* name, const void* p, const cublasLtMatrixLayoutOpaque_t* l) {
  const size_t bytes = ((l->cols - 1) * static_cast<uint64_t>(l->ld) + l->rows) * elem_bytes(l->type);
  if (p && mt::emu::is_device_range(p, bytes)) return;
  std::fprintf(stderr,
               "meshtrain cuda emulator: cublasLtMatmul: operand %s (%llu x %llu, ld %lld, %zu bytes at %p) is not "
               "inside one device allocation\n",
               name, static_cast<unsigned long long>(l->rows), static_cast<unsigned long long>(l->cols),
               static_cast<long long>(l->ld), bytes, p);
  std::fflush(stderr);
  std::abort();
}

float load(const void* base, cudaDataType_t t, uint64_t idx, bool tf32) {
  if (t == CUDA_R_16BF) return mt::emu::bf16_to_float(static_cast<const uint16_t*>(base)[idx]);
  float v = static_cast<const float*>(base)[idx];
  if (tf32) {  // round to the 10 mantissa bits of TF32, nearest even
    uint32_t u;
    std::memcpy(&u, &v, sizeof u);
    if ((u & 0x7f800000u) != 0x7f800000u) u = (u + 0xfffu + ((u >> 13) & 1u)) & ~0x1fffu;
    std::memcpy(&v, &u, sizeof v);
  }
  return v;
}

// op(X) as a dense [rows][k] float matrix: row r, column p of op(X) (X column-major with ld).
std::vector<float> pack(const void* x, const cublasLtMatrixLayoutOpaque_t* l, bool trans, uint64_t rows, uint64_t k,
                        bool tf32) {
  std::vector<float> out(rows * k);
  const uint64_t ld = static_cast<uint64_t>(l->ld);
  for (uint64_t r = 0; r < rows; ++r)
    for (uint64_t p = 0; p < k; ++p) out[r * k + p] = load(x, l->type, trans ? p + r * ld : r + p * ld, tf32);
  return out;
}

}  // namespace

cublasStatus_t cublasLtCreate(cublasLtHandle_t* h) {
  if (!h) return CUBLAS_STATUS_INVALID_VALUE;
  *h = new cublasLtContext{kHandleMagic};
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtDestroy(cublasLtHandle_t h) {
  if (!h || h->magic != kHandleMagic) return CUBLAS_STATUS_NOT_INITIALIZED;
  h->magic = 0;
  delete h;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* d, cublasComputeType_t compute, cudaDataType_t scale) {
  if (!d) return CUBLAS_STATUS_INVALID_VALUE;
  *d = new cublasLtMatmulDescOpaque_t{compute, scale};
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t d) {
  delete d;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr,
                                              const void* buf, size_t bytes) {
  if (!d) return CUBLAS_STATUS_INVALID_VALUE;
  switch (attr) {
    case CUBLASLT_MATMUL_DESC_COMPUTE_TYPE: return set(&d->compute, sizeof d->compute, buf, bytes);
    case CUBLASLT_MATMUL_DESC_SCALE_TYPE: return set(&d->scale, sizeof d->scale, buf, bytes);
    case CUBLASLT_MATMUL_DESC_POINTER_MODE: return set(&d->pointer_mode, sizeof d->pointer_mode, buf, bytes);
    case CUBLASLT_MATMUL_DESC_TRANSA: return set(&d->transa, sizeof d->transa, buf, bytes);
    case CUBLASLT_MATMUL_DESC_TRANSB: return set(&d->transb, sizeof d->transb, buf, bytes);
    case CUBLASLT_MATMUL_DESC_TRANSC: return set(&d->transc, sizeof d->transc, buf, bytes);
    case CUBLASLT_MATMUL_DESC_EPILOGUE: return set(&d->epilogue, sizeof d->epilogue, buf, bytes);
    case CUBLASLT_MATMUL_DESC_BIAS_POINTER: return set(&d->bias, sizeof d->bias, buf, bytes);
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER: return set(&d->aux, sizeof d->aux, buf, bytes);
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD: return set(&d->aux_ld, sizeof d->aux_ld, buf, bytes);
    case CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE: return set(&d->bias_type, sizeof d->bias_type, buf, bytes);
  }
  return CUBLAS_STATUS_INVALID_VALUE;
}
cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* l, cudaDataType_t type, uint64_t rows, uint64_t cols,
                                          int64_t ld) {
  if (!l) return CUBLAS_STATUS_INVALID_VALUE;
  *l = new cublasLtMatrixLayoutOpaque_t{type, rows, cols, ld};
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t l) {
  delete l;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* p) {
  if (!p) return CUBLAS_STATUS_INVALID_VALUE;
  *p = new cublasLtMatmulPreferenceOpaque_t{};
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t p) {
  delete p;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t p,
                                                    cublasLtMatmulPreferenceAttributes_t attr, const void* buf,
                                                    size_t bytes) {
  if (!p) return CUBLAS_STATUS_INVALID_VALUE;
  switch (attr) {
    case CUBLASLT_MATMUL_PREF_SEARCH_MODE: return set(&p->search_mode, sizeof p->search_mode, buf, bytes);
    case CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES: return set(&p->max_workspace, sizeof p->max_workspace, buf, bytes);
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES: return set(&p->align[0], sizeof p->align[0], buf, bytes);
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES: return set(&p->align[1], sizeof p->align[1], buf, bytes);
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES: return set(&p->align[2], sizeof p->align[2], buf, bytes);
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES: return set(&p->align[3], sizeof p->align[3], buf, bytes);
  }
  return CUBLAS_STATUS_INVALID_VALUE;
}

cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t h, cublasLtMatmulDesc_t op, cublasLtMatrixLayout_t a,
                                              cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t c,
                                              cublasLtMatrixLayout_t d, cublasLtMatmulPreference_t pref, int requested,
                                              cublasLtMatmulHeuristicResult_t results[], int* returned) {
  if (!h || h->magic != kHandleMagic) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (!pref || requested < 1 || !results || !returned) return CUBLAS_STATUS_INVALID_VALUE;
  Problem p{};
  if (const cublasStatus_t s = validate(op, a, b, c, d, &p); s != CUBLAS_STATUS_SUCCESS) return s;
  *returned = 0;
  // No algorithm reads operands aligned below their element size.
  const cublasLtMatrixLayoutOpaque_t* ls[4] = {a, b, c, d};
  for (int i = 0; i < 4; ++i)
    if (pref->align[i] < elem_bytes(ls[i]->type)) return CUBLAS_STATUS_SUCCESS;
  cublasLtMatmulHeuristicResult_t& r = results[0];
  r = cublasLtMatmulHeuristicResult_t{};
  r.algo.data[0] = kAlgoMagic;
  for (int i = 0; i < 4; ++i) r.algo.data[1 + i] = pref->align[i];
  r.algo.data[5] = std::min<uint64_t>(pref->max_workspace, kAlgoWorkspace);
  r.workspaceSize = static_cast<size_t>(r.algo.data[5]);
  // The epilogue it was chosen for, and the bias pointer's alignment (cuBLASLt reads it here).
  r.algo.data[6] = op->epilogue;
  r.algo.data[7] = uses_vector(op->epilogue) ? static_cast<uint64_t>(alignment_of(op->bias)) : 0;
  r.state = CUBLAS_STATUS_SUCCESS;
  r.wavesCount = 1.0f;
  *returned = 1;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmul(cublasLtHandle_t h, cublasLtMatmulDesc_t op, const void* alpha, const void* A,
                              cublasLtMatrixLayout_t a, const void* B, cublasLtMatrixLayout_t b, const void* beta,
                              const void* C, cublasLtMatrixLayout_t c, void* D, cublasLtMatrixLayout_t d,
                              const cublasLtMatmulAlgo_t* algo, void* workspace, size_t workspace_bytes,
                              cudaStream_t stream) {
  if (!h || h->magic != kHandleMagic) return CUBLAS_STATUS_NOT_INITIALIZED;
  Problem p{};
  if (const cublasStatus_t s = validate(op, a, b, c, d, &p); s != CUBLAS_STATUS_SUCCESS) return s;
  if (!alpha || !beta || !mt::emu::valid_stream(stream)) return CUBLAS_STATUS_INVALID_VALUE;
  if (C == D && (c->type != d->type || c->ld != d->ld)) return CUBLAS_STATUS_INVALID_VALUE;  // in place: one layout
  const float al = *static_cast<const float*>(alpha), be = *static_cast<const float*>(beta);
  if (algo) {
    if (algo->data[0] != kAlgoMagic) return CUBLAS_STATUS_INVALID_VALUE;
    const void* ptrs[4] = {A, B, C, D};
    for (int i = 0; i < 4; ++i)
      if (static_cast<uint64_t>(alignment_of(ptrs[i])) < algo->data[1 + i]) return CUBLAS_STATUS_NOT_SUPPORTED;
    if (algo->data[6] != op->epilogue) return CUBLAS_STATUS_NOT_SUPPORTED;  // chosen for another epilogue
    if (algo->data[7] && static_cast<uint64_t>(alignment_of(op->bias)) < algo->data[7]) return CUBLAS_STATUS_NOT_SUPPORTED;
    const uint64_t ws = algo->data[5];
    if (workspace_bytes < ws) return CUBLAS_STATUS_INVALID_VALUE;
    if (ws) {
      if (!workspace || !mt::emu::is_device_range(workspace, ws)) {
        std::fprintf(stderr,
                     "meshtrain cuda emulator: cublasLtMatmul: the workspace (%p, %llu bytes) is not device memory\n",
                     workspace, static_cast<unsigned long long>(ws));
        std::abort();
      }
      std::memset(workspace, 0xFF, ws);  // the algorithm's scratch: nothing may rely on its contents
    }
  }
  require_device("A", A, a);
  require_device("B", B, b);
  if (be != 0.0f) require_device("C", C, c);
  require_device("D", D, d);
  const uint32_t epi = op->epilogue;
  const float* bias = adds_bias(epi) ? static_cast<const float*>(op->bias) : nullptr;
  // The vector (bias, or BGRADB's output: one fp32 value per row of D) and the aux matrix lie in device memory.
  const uint64_t vec_n = epi == CUBLASLT_EPILOGUE_BGRADB ? p.n : p.m;
  if (uses_vector(epi) && !mt::emu::is_device_range(op->bias, vec_n * sizeof(float))) {
    std::fprintf(stderr, "meshtrain cuda emulator: cublasLtMatmul: the bias (%p, %llu floats) is not device memory\n",
                 op->bias, static_cast<unsigned long long>(vec_n));
    std::abort();
  }
  if (uses_aux(epi)) {
    const cublasLtMatrixLayoutOpaque_t aux_l{d->type, d->rows, d->cols, op->aux_ld};
    require_device("EPILOGUE_AUX", op->aux, &aux_l);
  }
  const std::vector<float> opa = pack(A, a, p.ta, p.m, p.k, p.tf32), opb = pack(B, b, !p.tb, p.n, p.k, p.tf32);
  const uint64_t ldc = static_cast<uint64_t>(c->ld), ldd = static_cast<uint64_t>(d->ld);
  const uint64_t ldx = static_cast<uint64_t>(op->aux_ld);
  const int64_t n = static_cast<int64_t>(p.n);
  const bool big = p.m * p.n * p.k > (uint64_t(1) << 22);
  const auto store = [](void* base, cudaDataType_t t, uint64_t idx, float v) {
    if (t == CUDA_R_16BF) static_cast<uint16_t*>(base)[idx] = mt::emu::float_to_bf16(v);
    else static_cast<float*>(base)[idx] = v;
  };
#pragma omp parallel for schedule(static) if (big)
  for (int64_t j = 0; j < n; ++j) {
    const uint64_t uj = static_cast<uint64_t>(j);
    for (uint64_t i = 0; i < p.m; ++i) {
      const float* x = &opa[i * p.k];
      const float* y = &opb[uj * p.k];
      float acc = 0.0f;
      for (uint64_t q = 0; q < p.k; ++q) acc += x[q] * y[q];
      float v = al * acc;
      if (be != 0.0f) v += be * load(C, c->type, i + uj * ldc, false);
      if (bias) v += bias[i];
      if (epi == CUBLASLT_EPILOGUE_GELU_AUX || epi == CUBLASLT_EPILOGUE_GELU_AUX_BIAS) {
        store(op->aux, d->type, i + uj * ldx, v);
        v = gelu_tanh(v);
      } else if (epi == CUBLASLT_EPILOGUE_DGELU) {
        v *= dgelu_tanh(load(op->aux, d->type, i + uj * ldx, false));
      }
      store(D, d->type, i + uj * ldd, v);
    }
  }
  if (epi == CUBLASLT_EPILOGUE_BGRADB) {  // the sums of op(B) over k, one per column of D, in index order
    float* g = static_cast<float*>(const_cast<void*>(op->bias));
    for (int64_t j = 0; j < n; ++j) {
      const float* y = &opb[static_cast<uint64_t>(j) * p.k];
      float acc = 0.0f;
      for (uint64_t q = 0; q < p.k; ++q) acc += y[q];
      g[j] = acc;
    }
  }
  return CUBLAS_STATUS_SUCCESS;
}
