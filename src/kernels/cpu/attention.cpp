// Causal grouped-query attention, flash style, and rotary embedding.
//
// Work is split into tasks (batch b, query head h), run in parallel. A task walks the queries in
// blocks of kBlockQ rows; for a block of rows [t0, t0+bq) only the keys [0, t0+bq) can be seen, so
// the scores S = scale * Q_blk K^T are one small GEMM into a per-thread tile [bq, t0+bq], the
// softmax is done row by row in that tile (exact, no online rescaling needed since the whole
// visible row fits) and O_blk = P V is a second small GEMM. Forward keeps only the row
// log-sum-exp; backward recomputes P = exp(S - lse) per block. In the avx512 variant the small
// GEMMs are this file's own register-blocked FMA loops (small_gemm below) over K, V, K^T and V^T
// packed once per task: oneDNN's sgemm cost more in its per-call set-up than in arithmetic at these
// sizes (64 x 256 x 64). The baseline variant calls oneDNN's sgemm. All of them run on the calling
// thread. Each task is sequential and
// every output element is one FMA chain over k in order, so the result does not depend on how
// tasks are spread over threads.
//
// Backward, grouped-query case: several query heads share one key/value head, so their dK/dV
// contributions are first summed per (b, h) into scratch and then added per (b, kv head) in head
// order (again independent of the thread count). With nh == nkv each task owns its key/value
// head and accumulates straight into dqkv.
#include "kernels/cpu/attention.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include <immintrin.h>

#include "kernels/cpu/avx512_transpose.h"
#include "kernels/cpu/gemm_internal.h"
#include "kernels/cpu/rope.h"
#include "kernels/cpu/softmax_row.h"
#include "kernels/cpu/vecmath.h"
#include "kernels/cpu/workspace.h"

MT_CPU_VARIANT_BEGIN

namespace {

using detail::Scratch;
using detail::sgemm_strided;

constexpr int64_t kBlockQ = 64;
// Upper bound for the per-(b, h) dK/dV scratch of the grouped-query backward; batches are
// processed in chunks that fit.
constexpr int64_t kGqaScratchBytes = int64_t(64) << 20;

void check_heads(int64_t nh, int64_t nkv, const char* fn) {
  if (nh <= 0 || nkv <= 0 || nh % nkv != 0) {
    throw std::invalid_argument(std::string("meshtrain: ") + fn + ": n_head (" + std::to_string(nh) +
                                ") must be a positive multiple of n_kv_head (" +
                                std::to_string(nkv) + ")");
  }
}

// ---- small GEMMs (avx512 variant) ---------------------------------------------------------------
//
// C[M x N] = alpha * op(A)[M x K] * B[K x N] + beta * C (beta 0: C is not read), op(A) = A
// (row-major, lda) or A^T (A stored [K][M]); B packed in panels of kNr columns (pack_rows /
// pack_cols): panel p holds B[k][p kNr + c] at p K kNr + k kNr + c, zero past N, so that a tile
// reads B at a short fixed stride. A tile of kMr rows x kNr columns stays in registers while k
// runs; each element is acc = fma(a_k, b_k, acc) for k = 0 .. K-1 in order, then alpha * acc
// (+ beta * C, as one more fma).
//
// The baseline (AVX2) variant keeps oneDNN's sgemm: the same loop with 16 ymm registers (4 x 16;
// GCC spilled 6 x 16) ran slower than oneDNN's AVX2 code on the benchmark shapes, where the
// AVX-512 one is faster (docs/cpu.md).
#if defined(MT_CPU_VARIANT_AVX512)
#define MT_ATTENTION_OWN_GEMM 1
using vec = __m512;
constexpr int64_t kW = 16;     // floats per register
constexpr int kMr = 8;         // rows per register tile
constexpr int64_t kNr = 2 * kW;  // columns per register tile and per packed panel

int64_t packed_size(int64_t K, int64_t N) { return (N + kNr - 1) / kNr * kNr * K; }

// B[k][n] = src[k * ld + n] (row-major), n < N.
void pack_rows(float* Bp, const float* src, int64_t ld, int64_t K, int64_t N) {
  for (int64_t p = 0; p * kNr < N; ++p) {
    const int64_t n0 = p * kNr, w = std::min(kNr, N - n0);
    float* dst = Bp + p * K * kNr;
    for (int64_t k = 0; k < K; ++k) {
      const float* row = src + k * ld + n0;
      float* d = dst + k * kNr;
      for (int64_t c = 0; c < w; ++c) d[c] = row[c];
      for (int64_t c = w; c < kNr; ++c) d[c] = 0.0f;
    }
  }
}

// B[k][n] = src[n * ld + k] (B = src^T: a head's keys or values as [hd][keys]), n < N.
void pack_cols(float* Bp, const float* src, int64_t ld, int64_t K, int64_t N) {
  for (int64_t p = 0; p * kNr < N; ++p) {
    const int64_t n0 = p * kNr, w = std::min(kNr, N - n0);
    float* dst = Bp + p * K * kNr;
    // A whole panel: kW x kW blocks through registers for the rows k < k0.
    const int64_t k0 = w == kNr ? K / kW * kW : 0;
    for (int64_t c0 = 0; k0 > 0 && c0 < kNr; c0 += kW)
      for (int64_t k = 0; k < k0; k += kW) {
        __m512i r[16];
        for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(src + (n0 + c0 + i) * ld + k);
        avx512_util::transpose16(r);
        for (int i = 0; i < 16; ++i) _mm512_storeu_si512(dst + (k + i) * kNr + c0, r[i]);
      }
    for (int64_t c = 0; c < kNr; ++c) {  // the rest, and the zero columns of a partial panel
      const float* row = c < w ? src + (n0 + c) * ld : nullptr;
      for (int64_t k = k0; k < K; ++k) dst[k * kNr + c] = row ? row[k] : 0.0f;
    }
  }
}

// Rows [0, MR) x one panel of C (cols <= kNr valid columns); op(A)'s element (r, k) is at
// a[r * ars + k * aks].
template <int MR>
inline void tile(const float* a, int64_t ars, int64_t aks, const float* b, int64_t K, float alpha, float beta,
                 float* c, int64_t ldc, int64_t cols) {
  vec acc[MR][2];
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const vec b0 = _mm512_loadu_ps(b + k * kNr), b1 = _mm512_loadu_ps(b + k * kNr + kW);
    const float* ak = a + k * aks;
    for (int r = 0; r < MR; ++r) {
      const vec x = _mm512_set1_ps(ak[r * ars]);
      acc[r][0] = _mm512_fmadd_ps(x, b0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(x, b1, acc[r][1]);
    }
  }
  const vec va = _mm512_set1_ps(alpha), vb = _mm512_set1_ps(beta);
  for (int r = 0; r < MR; ++r) {
    float* cr = c + r * ldc;
    vec y0 = _mm512_mul_ps(va, acc[r][0]), y1 = _mm512_mul_ps(va, acc[r][1]);
    if (cols == kNr) {
      if (beta != 0.0f) {
        y0 = _mm512_fmadd_ps(vb, _mm512_loadu_ps(cr), y0);
        y1 = _mm512_fmadd_ps(vb, _mm512_loadu_ps(cr + kW), y1);
      }
      _mm512_storeu_ps(cr, y0);
      _mm512_storeu_ps(cr + kW, y1);
    } else {  // a last, partial panel
      alignas(64) float y[kNr];
      _mm512_store_ps(y, y0);
      _mm512_store_ps(y + kW, y1);
      for (int64_t j = 0; j < cols; ++j) cr[j] = beta != 0.0f ? std::fma(beta, cr[j], y[j]) : y[j];
    }
  }
}

// What a causal block of queries [t0, t0 + bq) lets a GEMM skip (row r of a score tile sees keys
// j <= t0 + r): kScores: the register tiles of S / dP wholly above the diagonal (their entries
// are never read as scores: the softmax and dS read only visible ones); kKeysK: with K running over
// keys (O = P V, dQ = dS K), the keys past a tile's last visible one (P, dS are 0 there); kQueriesK:
// with K running over queries and M over keys (dK = dS^T Q, dV = P^T dO), the queries before a
// key tile's first visible one. Skipped products are exact zeros added to a sum, so the sums
// are unchanged (up to the sign of a zero sum).
enum class Causal { kNone, kScores, kKeysK, kQueriesK };

// pstride: elements from one panel of Bp to the next (K kNr, or more when B is the first K rows of
// a packed matrix).
void small_gemm(bool ta, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda, const float* Bp,
                int64_t pstride, float beta, float* C, int64_t ldc, Causal causal = Causal::kNone, int64_t t0 = 0) {
  const int64_t ars = ta ? 1 : lda, aks = ta ? lda : 1;
  auto run = [&](auto rows_tag, int64_t r, int64_t n0, const float* b, int64_t cols) {
    constexpr int MR = decltype(rows_tag)::value;
    int64_t kb = 0, ke = K;
    if (causal == Causal::kScores && n0 > t0 + r + MR - 1) return;
    if (causal == Causal::kKeysK) ke = std::min(K, t0 + r + MR);
    if (causal == Causal::kQueriesK) kb = std::clamp<int64_t>(r - t0, 0, K);
    tile<MR>(A + r * ars + kb * aks, ars, aks, b + kb * kNr, ke - kb, alpha, beta, C + r * ldc + n0, ldc, cols);
  };
  for (int64_t p = 0; p * kNr < N; ++p) {
    const int64_t n0 = p * kNr, cols = std::min(kNr, N - n0);
    const float* b = Bp + p * pstride;
    int64_t r = 0;
    for (; r + kMr <= M; r += kMr) run(std::integral_constant<int, kMr>{}, r, n0, b, cols);
    for (; r + 4 <= M; r += 4) run(std::integral_constant<int, 4>{}, r, n0, b, cols);
    for (; r + 2 <= M; r += 2) run(std::integral_constant<int, 2>{}, r, n0, b, cols);
    for (; r < M; ++r) run(std::integral_constant<int, 1>{}, r, n0, b, cols);
  }
}
#endif  // MT_CPU_VARIANT_AVX512

// Row softmax of a score tile in place. Row r (query t0 + r) sees keys j <= t0 + r; entries past
// that are set to 0. With lse_in == nullptr the max/sum are computed and the log-sum-exp written
// to lse_out; otherwise P = exp(S - lse_in) (backward recompute).
void softmax_rows(float* S, int64_t bq, int64_t L, int64_t t0, const float* lse_in, float* lse_out) {
  for (int64_t r = 0; r < bq; ++r) {
    float* row = S + r * L;
    const int64_t nv = t0 + r + 1;  // visible keys
    if (lse_in) {
      const float l = lse_in[t0 + r];
#pragma omp simd
      for (int64_t j = 0; j < nv; ++j) row[j] = detail::exp_f(row[j] - l);
    } else {
      const auto [m, s] = exp_row(row, row, nv);
      const float inv = 1.0f / s;
#pragma omp simd
      for (int64_t j = 0; j < nv; ++j) row[j] *= inv;
      lse_out[t0 + r] = m + std::log(s);
    }
    for (int64_t j = nv; j < L; ++j) row[j] = 0.0f;
  }
}

// One attention call's dimensions: rows of qkv are ld floats, rows of out od; query head h reads
// key / value head h / grp; queries go in blocks of BQ rows; scores are scaled by sc.
struct Dims {
  int64_t T, nh, nkv, hd, ld, od, grp, BQ;
  float sc;
  Dims(int64_t T_, int64_t nh_, int64_t nkv_, int64_t hd_)
      : T(T_), nh(nh_), nkv(nkv_), hd(hd_), ld((nh_ + 2 * nkv_) * hd_), od(nh_ * hd_), grp(nh_ / nkv_),
        BQ(std::min(kBlockQ, T_)), sc(1.0f / std::sqrt(static_cast<float>(hd_))) {}
};

// f(t0, bq, L) for each block of query rows [t0, t0 + bq) in order; the block sees L = t0 + bq keys.
template <class F>
void for_each_block(const Dims& d, F&& f) {
  for (int64_t t0 = 0; t0 < d.T; t0 += d.BQ) {
    const int64_t bq = std::min(d.BQ, d.T - t0);
    f(t0, bq, t0 + bq);
  }
}

// A head's keys K^T packed into `buf` for block_softmax (own GEMMs; null otherwise: the library
// GEMM reads K in place).
const float* packed_keys(float* buf, const float* k, const Dims& d) {
#if MT_ATTENTION_OWN_GEMM
  pack_cols(buf, k, d.ld, d.hd, d.T);
  return buf;
#else
  return nullptr;
#endif
}

// P = softmax(sc Q K^T) of the query rows [t0, t0 + bq) over the keys they see (L = t0 + bq
// columns): forward writes each row's log-sum-exp to lse_out, backward recomputes P from lse_in.
// q and k are a head's rows in qkv; kt is K^T packed (own GEMMs only).
void block_softmax(float* P, const Dims& d, const float* q, const float* k, const float* kt, int64_t t0, int64_t bq,
                   const float* lse_in, float* lse_out) {
  const int64_t L = t0 + bq;
#if MT_ATTENTION_OWN_GEMM
  small_gemm(false, bq, L, d.hd, d.sc, q + t0 * d.ld, d.ld, kt, d.hd * kNr, 0.0f, P, L, Causal::kScores, t0);
#else
  sgemm_strided(false, true, bq, L, d.hd, d.sc, q + t0 * d.ld, d.ld, k, d.ld, 0.0f, P, L);
#endif
  softmax_rows(P, bq, L, t0, lse_in, lse_out);
}

// dS = P * (dP - D) in place of dP for the query rows [t0, t0 + bq), D[r] = dO_r . O_r; 0 where
// P is masked (dP was not computed there). dO and o point at the head's first row.
void block_dscores(float* dP, const float* P, float* D, const float* dO, const float* o, const Dims& d, int64_t t0,
                   int64_t bq) {
  const int64_t L = t0 + bq;
  for (int64_t r = 0; r < bq; ++r) {
    const float* a = dO + (t0 + r) * d.od;
    const float* c = o + (t0 + r) * d.od;
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < d.hd; ++i) s += a[i] * c[i];
    D[r] = s;
  }
  for (int64_t r = 0; r < bq; ++r) {
    float* dpr = dP + r * L;
    const float* pr = P + r * L;
    const float dr = D[r];
    const int64_t nv = t0 + r + 1;
#pragma omp simd
    for (int64_t j = 0; j < nv; ++j) dpr[j] = pr[j] * (dpr[j] - dr);
    for (int64_t j = nv; j < L; ++j) dpr[j] = 0.0f;
  }
}

// One (sequence, query head) task of the backward: per query block, P and dP, dS, then dq, dk and
// dv accumulate (+=). q, k, v, dq point at the head's rows in qkv / dqkv (row stride d.ld); o, dO
// at its rows in out / dout; dk, dv (row stride ldkv) are where its key / value gradients go.
// `tile` is the thread's scratch (P, dP and D tiles, then the packed operands).
void backward_head(const Dims& d, float* tile, const float* q, const float* k, const float* v, const float* o,
                   const float* dO, const float* l, float* dq, float* dk, float* dv, int64_t ldkv) {
  const int64_t T = d.T, hd = d.hd, ld = d.ld, od = d.od, BQ = d.BQ;
  float* P = tile;
  float* dP = P + BQ * T;
  float* D = dP + BQ * T;
  const float* kt = packed_keys(D + BQ, k, d);  // packed right-hand sides: K^T, V^T, K, a block's Q and dO
#if MT_ATTENTION_OWN_GEMM
  const int64_t pkt = packed_size(hd, T), pkr = packed_size(T, hd), pq = packed_size(BQ, hd);
  float* vt = D + BQ + pkt;
  float* kr = vt + pkt;
  float* qp = kr + pkr;
  float* dop = qp + pq;
  pack_cols(vt, v, ld, hd, T);
  pack_rows(kr, k, ld, T, hd);
#endif
  for_each_block(d, [&](int64_t t0, int64_t bq, int64_t L) {
    block_softmax(P, d, q, k, kt, t0, bq, l, nullptr);
#if MT_ATTENTION_OWN_GEMM
    small_gemm(false, bq, L, hd, 1.0f, dO + t0 * od, od, vt, hd * kNr, 0.0f, dP, L, Causal::kScores, t0);
#else
    sgemm_strided(false, true, bq, L, hd, 1.0f, dO + t0 * od, od, v, ld, 0.0f, dP, L);
#endif
    block_dscores(dP, P, D, dO, o, d, t0, bq);
#if MT_ATTENTION_OWN_GEMM
    pack_rows(qp, q + t0 * ld, ld, bq, hd);
    pack_rows(dop, dO + t0 * od, od, bq, hd);
    small_gemm(false, bq, hd, L, d.sc, dP, L, kr, T * kNr, 1.0f, dq + t0 * ld, ld, Causal::kKeysK, t0);  // K's first L rows
    small_gemm(true, L, hd, bq, d.sc, dP, L, qp, bq * kNr, 1.0f, dk, ldkv, Causal::kQueriesK, t0);
    small_gemm(true, L, hd, bq, 1.0f, P, L, dop, bq * kNr, 1.0f, dv, ldkv, Causal::kQueriesK, t0);
#else
    sgemm_strided(false, false, bq, hd, L, d.sc, dP, L, k, ld, 1.0f, dq + t0 * ld, ld);
    sgemm_strided(true, false, L, hd, bq, d.sc, dP, L, q + t0 * ld, ld, 1.0f, dk, ldkv);
    sgemm_strided(true, false, L, hd, bq, 1.0f, P, L, dO + t0 * od, od, 1.0f, dv, ldkv);
#endif
  });
}

// Grouped-query backward: dqkv[b, t, kv head] += the sums of its query heads' dK / dV rows kept in
// kvbuf (per_bh floats per (batch of the chunk, head)), in head order.
void add_group_kv_grads(float* dqkv, const float* kvbuf, const Dims& d, int64_t b0, int64_t nb, int64_t per_bh) {
  const int64_t T = d.T, nh = d.nh, nkv = d.nkv, hd = d.hd, ld = d.ld, grp = d.grp;
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t bi = 0; bi < nb; ++bi) {
    for (int64_t t = 0; t < T; ++t) {
      float* row = dqkv + ((b0 + bi) * T + t) * ld;
      for (int64_t kvh = 0; kvh < nkv; ++kvh) {
        float* dk = row + (nh + kvh) * hd;
        float* dv = row + (nh + nkv + kvh) * hd;
        for (int64_t g = 0; g < grp; ++g) {
          const float* sk = kvbuf + (bi * nh + kvh * grp + g) * per_bh + t * hd;
          const float* sv = sk + T * hd;
#pragma omp simd
          for (int64_t i = 0; i < hd; ++i) {
            dk[i] += sk[i];
            dv[i] += sv[i];
          }
        }
      }
    }
  }
}


// ---- document masking ---------------------------------------------------------------------------
// Query t of row b sees keys doc_start[b*T + t] .. t only. A direct loop per (row, key/value head):
// the scores of one query at a time, a max-subtracted softmax, and its log-sum-exp.

void check_doc_start(const int32_t* ds, int64_t B, int64_t T, const char* fn) {
  for (int64_t i = 0; i < B * T; ++i) {
    const int64_t t = i % T;
    if (ds[i] < 0 || ds[i] > t)
      throw std::invalid_argument(std::string(fn) + ": doc_start[" + std::to_string(i) + "] = " +
                                  std::to_string(ds[i]) + " is outside [0, " + std::to_string(t) + "]");
  }
}

void doc_attention_forward(float* out, float* lse, const float* qkv, const Dims& d, int64_t B, int64_t nh,
                           int64_t nkv, const int32_t* doc_start) {
  const int64_t T = d.T, hd = d.hd, ld = d.ld, od = d.od, grp = d.grp;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
#pragma omp parallel
  {
    std::vector<float> s(static_cast<size_t>(T));
#pragma omp for collapse(2) schedule(dynamic, 1)
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t h = 0; h < nh; ++h) {
        const float* row = qkv + b * T * ld;
        const int64_t kh = (nh + h / grp) * hd, vh = (nh + nkv + h / grp) * hd;
        for (int64_t t = 0; t < T; ++t) {
          const int64_t s0 = doc_start[b * T + t];
          const float* q = row + t * ld + h * hd;
          float m = -INFINITY;
          for (int64_t j = s0; j <= t; ++j) {
            const float* k = row + j * ld + kh;
            float acc = 0.0f;
            for (int64_t i = 0; i < hd; ++i) acc += q[i] * k[i];
            s[j] = acc * scale;
            m = std::max(m, s[j]);
          }
          float sum = 0.0f;
          for (int64_t j = s0; j <= t; ++j) {
            s[j] = std::exp(s[j] - m);
            sum += s[j];
          }
          float* o = out + (b * T + t) * od + h * hd;
          std::fill(o, o + hd, 0.0f);
          const float inv = 1.0f / sum;
          for (int64_t j = s0; j <= t; ++j) {
            const float* v = row + j * ld + vh;
            const float p = s[j] * inv;
            for (int64_t i = 0; i < hd; ++i) o[i] += p * v[i];
          }
          lse[(b * nh + h) * T + t] = m + std::log(sum);
        }
      }
    }
  }
}

// One task per (row, key/value head): the group's query heads in turn, so dK / dV have one writer.
void doc_attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse,
                            const Dims& d, int64_t B, int64_t nh, int64_t nkv, const int32_t* doc_start) {
  const int64_t T = d.T, hd = d.hd, ld = d.ld, od = d.od, grp = d.grp;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
#pragma omp parallel for collapse(2) schedule(dynamic, 1)
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t g = 0; g < nkv; ++g) {
      const float* row = qkv + b * T * ld;
      float* drow = dqkv + b * T * ld;
      const int64_t kh = (nh + g) * hd, vh = (nh + nkv + g) * hd;
      for (int64_t h = g * grp; h < (g + 1) * grp; ++h) {
        for (int64_t t = 0; t < T; ++t) {
          const int64_t s0 = doc_start[b * T + t];
          const float* q = row + t * ld + h * hd;
          const float* dy = dout + (b * T + t) * od + h * hd;
          const float* o = out + (b * T + t) * od + h * hd;
          float* dq = drow + t * ld + h * hd;
          const float l = lse[(b * nh + h) * T + t];
          float D = 0.0f;
          for (int64_t i = 0; i < hd; ++i) D += dy[i] * o[i];
          for (int64_t j = s0; j <= t; ++j) {
            const float* k = row + j * ld + kh;
            const float* v = row + j * ld + vh;
            float sc = 0.0f, dp = 0.0f;
            for (int64_t i = 0; i < hd; ++i) {
              sc += q[i] * k[i];
              dp += dy[i] * v[i];
            }
            const float p = std::exp(sc * scale - l);
            const float ds = p * (dp - D) * scale;
            float* dk = drow + j * ld + kh;
            float* dv = drow + j * ld + vh;
            for (int64_t i = 0; i < hd; ++i) {
              dq[i] += ds * k[i];
              dk[i] += ds * q[i];
              dv[i] += p * dy[i];
            }
          }
        }
      }
    }
  }
}

}  // namespace

void attention_forward(float* out, float* lse, const float* qkv, int64_t B, int64_t T, int64_t nh,
                       int64_t nkv, int64_t hd, const int32_t* doc_start) {
  check_heads(nh, nkv, "attention_forward");
  if (B <= 0 || T <= 0 || hd <= 0) return;
  const Dims d(T, nh, nkv, hd);
  if (doc_start) {
    check_doc_start(doc_start, B, T, "attention_forward");
    doc_attention_forward(out, lse, qkv, d, B, nh, nkv, doc_start);
    return;
  }
  const int64_t ld = d.ld, od = d.od, grp = d.grp, BQ = d.BQ;
  const int nthr = omp_get_max_threads();
  thread_local Scratch scratch;
#if MT_ATTENTION_OWN_GEMM
  const int64_t pk = packed_size(hd, T), pv = packed_size(T, hd);
#else
  const int64_t pk = 0, pv = 0;
#endif
  const int64_t per_thr = BQ * T + pk + pv;  // score tile, K^T and V packed
  float* tiles = scratch.as<float>(static_cast<size_t>(nthr) * per_thr);

#pragma omp parallel for collapse(2) schedule(dynamic, 1)
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < nh; ++h) {
      float* S = tiles + static_cast<int64_t>(omp_get_thread_num()) * per_thr;
      const float* q = qkv + b * T * ld + h * hd;
      const float* k = qkv + b * T * ld + (nh + h / grp) * hd;
      const float* v = qkv + b * T * ld + (nh + nkv + h / grp) * hd;
      float* o = out + b * T * od + h * hd;
      float* l = lse + (b * nh + h) * T;
      const float* kt = packed_keys(S + BQ * T, k, d);
#if MT_ATTENTION_OWN_GEMM
      float* vp = S + BQ * T + pk;  // V packed after K^T
      pack_rows(vp, v, ld, T, hd);
#endif
      for_each_block(d, [&](int64_t t0, int64_t bq, int64_t L) {
        block_softmax(S, d, q, k, kt, t0, bq, nullptr, l);
#if MT_ATTENTION_OWN_GEMM
        small_gemm(false, bq, hd, L, 1.0f, S, L, vp, T * kNr, 0.0f, o + t0 * od, od, Causal::kKeysK, t0);  // V's first L rows
#else
        sgemm_strided(false, false, bq, hd, L, 1.0f, S, L, v, ld, 0.0f, o + t0 * od, od);
#endif
      });
    }
  }
}

void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out,
                        const float* lse, int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd,
                        const int32_t* doc_start) {
  check_heads(nh, nkv, "attention_backward");
  if (B <= 0 || T <= 0 || hd <= 0) return;
  const Dims d(T, nh, nkv, hd);
  if (doc_start) {
    check_doc_start(doc_start, B, T, "attention_backward");
    doc_attention_backward(dqkv, dout, qkv, out, lse, d, B, nh, nkv, doc_start);
    return;
  }
  const int64_t ld = d.ld, od = d.od, grp = d.grp, BQ = d.BQ;
  const int nthr = omp_get_max_threads();
  thread_local Scratch tile_scratch, kv_scratch;
  // Per thread: P tile, dP tile, D [BQ], then packed: K^T and V^T, K, and a block's Q and dO.
#if MT_ATTENTION_OWN_GEMM
  const int64_t pkt = packed_size(hd, T), pkr = packed_size(T, hd), pq = packed_size(BQ, hd);
#else
  const int64_t pkt = 0, pkr = 0, pq = 0;
#endif
  const int64_t per_thr = 2 * BQ * T + BQ + 2 * pkt + pkr + 2 * pq;
  float* tiles = tile_scratch.as<float>(static_cast<size_t>(nthr) * per_thr);
  // Grouped-query: dK, dV per (b, h) in scratch, for a chunk of batches at a time.
  const int64_t per_bh = 2 * T * hd;
  int64_t bchunk = B;
  float* kvbuf = nullptr;
  if (grp > 1) {
    const int64_t per_b = nh * per_bh * static_cast<int64_t>(sizeof(float));
    bchunk = std::clamp<int64_t>(kGqaScratchBytes / std::max<int64_t>(per_b, 1), 1, B);
    kvbuf = kv_scratch.as<float>(static_cast<size_t>(bchunk * nh * per_bh));
  }

  for (int64_t b0 = 0; b0 < B; b0 += bchunk) {
    const int64_t nb = std::min(bchunk, B - b0);
#pragma omp parallel for collapse(2) schedule(dynamic, 1)
    for (int64_t bi = 0; bi < nb; ++bi) {
      for (int64_t h = 0; h < nh; ++h) {
        const int64_t b = b0 + bi, kvh = h / grp;
        const float* row0 = qkv + b * T * ld;
        float* drow0 = dqkv + b * T * ld;
        float *dk, *dv;
        int64_t ldkv;
        if (grp == 1) {  // the task owns its key / value head
          dk = drow0 + (nh + kvh) * hd;
          dv = drow0 + (nh + nkv + kvh) * hd;
          ldkv = ld;
        } else {
          dk = kvbuf + (bi * nh + h) * per_bh;
          dv = dk + T * hd;
          ldkv = hd;
          std::fill(dk, dk + per_bh, 0.0f);
        }
        backward_head(d, tiles + static_cast<int64_t>(omp_get_thread_num()) * per_thr, row0 + h * hd,
                      row0 + (nh + kvh) * hd, row0 + (nh + nkv + kvh) * hd, out + b * T * od + h * hd,
                      dout + b * T * od + h * hd, lse + (b * nh + h) * T, drow0 + h * hd, dk, dv, ldkv);
      }
    }
    if (grp > 1) add_group_kv_grads(dqkv, kvbuf, d, b0, nb, per_bh);
  }
}

// ---- RoPE ---------------------------------------------------------------------------------------

void rope_check_head_dim(int64_t hd, const char* fn) {
  if (hd % 2 != 0)
    throw std::invalid_argument(std::string("meshtrain: ") + fn + ": head_dim (" + std::to_string(hd) +
                                ") must be even for rotary embedding");
}

double rope_rate(int64_t i, int64_t hd, float theta, const float* inv_freq) {
  return inv_freq ? static_cast<double>(inv_freq[i])
                  : std::pow(static_cast<double>(theta), -2.0 * static_cast<double>(i) / static_cast<double>(hd));
}

void rope_rotate(float* qkv, int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd, const float* cs,
                 const float* sn, float sign) {
  const int64_t half = hd / 2;
  const int64_t ld = (nh + 2 * nkv) * hd;
#pragma omp parallel for collapse(2) schedule(static) if (B * T * ld > detail::kParallelMin)
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < T; ++t) {
      float* row = qkv + (b * T + t) * ld;
      const float* c = cs + t * half;
      const float* s = sn + t * half;
      for (int64_t hh = 0; hh < nh + nkv; ++hh) {
        float* x = row + hh * hd;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = x[i], x2 = x[i + half];
          const float si = sign * s[i];
          x[i] = x1 * c[i] - x2 * si;
          x[i + half] = x2 * c[i] + x1 * si;
        }
      }
    }
  }
}

namespace {

struct RopeTable {
  int64_t T = 0, hd = 0;
  float theta = 0.0f;
  std::vector<float> freq;  // explicit inverse frequencies (empty: from theta)
  Scratch buf;  // cos [T, hd/2] then sin [T, hd/2]
};

// cos/sin of t * rope_rate(i), computed in double and rounded once; cached per thread. Returns
// the cos table [Tc, hd/2] (Tc >= T); the sin table follows it, at *sin_out.
// inv_freq null: theta^(-2i/hd); otherwise the given frequencies (cached by value).
const float* rope_table(int64_t T, int64_t hd, float theta, const float** sin_out, const float* inv_freq = nullptr) {
  thread_local RopeTable tab;
  const int64_t half = hd / 2;
  const bool same_freq = inv_freq ? tab.freq.size() == static_cast<size_t>(half) &&
                                        std::equal(tab.freq.begin(), tab.freq.end(), inv_freq)
                                  : tab.freq.empty() && tab.theta == theta;
  if (tab.T < T || tab.hd != hd || !same_freq) {
    float* c = tab.buf.as<float>(static_cast<size_t>(2 * T * half));
    float* s = c + T * half;
#pragma omp parallel for schedule(static) if (T * half > 4096)
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t i = 0; i < half; ++i) {
        const double a = static_cast<double>(t) * rope_rate(i, hd, theta, inv_freq);
        c[t * half + i] = static_cast<float>(std::cos(a));
        s[t * half + i] = static_cast<float>(std::sin(a));
      }
    }
    tab.T = T;
    tab.hd = hd;
    tab.theta = theta;
    if (inv_freq) tab.freq.assign(inv_freq, inv_freq + half);
    else tab.freq.clear();
  }
  const float* c = static_cast<const float*>(tab.buf.get(0));
  *sin_out = c + tab.T * half;
  return c;
}

void rope_apply(float* qkv, int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd, float theta,
                float sign, const char* fn, const float* inv_freq = nullptr) {
  check_heads(nh, nkv, fn);
  rope_check_head_dim(hd, fn);
  if (B <= 0 || T <= 0 || hd <= 0) return;
  const float* sn = nullptr;
  const float* cs = rope_table(T, hd, theta, &sn, inv_freq);
  rope_rotate(qkv, B, T, nh, nkv, hd, cs, sn, sign);
}

}  // namespace

void rope_forward(float* qkv, int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd, float theta) {
  rope_apply(qkv, B, T, nh, nkv, hd, theta, 1.0f, "rope_forward");
}

void rope_backward(float* dqkv, int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd,
                   float theta) {
  rope_apply(dqkv, B, T, nh, nkv, hd, theta, -1.0f, "rope_backward");
}

void rope_forward(float* qkv, int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd, const float* inv_freq) {
  rope_apply(qkv, B, T, nh, nkv, hd, 0.0f, 1.0f, "rope_forward", inv_freq);
}

void rope_backward(float* dqkv, int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd, const float* inv_freq) {
  rope_apply(dqkv, B, T, nh, nkv, hd, 0.0f, -1.0f, "rope_backward", inv_freq);
}

// The bf16 variants: the fp32 kernels on the bf16 values (out rounded to bf16; backward: dout
// rounded to bf16 first, the bf16 out widened).
void attention_forward_bf16(bf16* out, float* lse, const bf16* qkv, int64_t B, int64_t T, int64_t nh,
                            int64_t nkv, int64_t hd, const int32_t* doc_start) {
  check_heads(nh, nkv, "attention_forward_bf16");
  if (B <= 0 || T <= 0 || hd <= 0) return;
  const int64_t n = B * T * (nh + 2 * nkv) * hd, no = B * T * nh * hd;
  std::vector<float> q(static_cast<size_t>(n)), y(static_cast<size_t>(no));
  for (int64_t i = 0; i < n; ++i) q[i] = bf16_to_float(qkv[i]);
  attention_forward(y.data(), lse, q.data(), B, T, nh, nkv, hd, doc_start);
  for (int64_t i = 0; i < no; ++i) out[i] = float_to_bf16(y[i]);
}

void attention_backward_bf16(float* dqkv, const float* dout, const bf16* qkv, const bf16* out,
                             const float* lse, int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd,
                             const int32_t* doc_start) {
  check_heads(nh, nkv, "attention_backward_bf16");
  if (B <= 0 || T <= 0 || hd <= 0) return;
  const int64_t n = B * T * (nh + 2 * nkv) * hd, no = B * T * nh * hd;
  std::vector<float> q(static_cast<size_t>(n)), dy(static_cast<size_t>(no)), y(static_cast<size_t>(no));
  for (int64_t i = 0; i < n; ++i) q[i] = bf16_to_float(qkv[i]);
  for (int64_t i = 0; i < no; ++i) dy[i] = bf16_to_float(float_to_bf16(dout[i]));
  for (int64_t i = 0; i < no; ++i) y[i] = bf16_to_float(out[i]);
  attention_backward(dqkv, dy.data(), q.data(), y.data(), lse, B, T, nh, nkv, hd, doc_start);
}

MT_CPU_VARIANT_END  // namespace mt::kernels::cpu
