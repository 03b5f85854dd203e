// Context parallelism's attention block kernels (see attention_block.h), flash-style as
// attention.cpp: per (sequence, head) task, tiles of query rows; a tile's scores are small GEMMs
// into a per-thread buffer (at most 64 x T floats), never a T x T matrix.
#include "kernels/cpu/attention_block.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/cpu/gemm_internal.h"
#include "kernels/cpu/vecmath.h"
#include "kernels/cpu/workspace.h"

MT_CPU_VARIANT_BEGIN

namespace {

void check(int64_t T, int64_t nh, int64_t nkv, int64_t chunks, const char* fn) {
  if (nh <= 0 || nkv <= 0 || nh % nkv != 0)
    throw std::invalid_argument(std::string("meshtrain: ") + fn + ": n_head (" + std::to_string(nh) +
                                ") must be a positive multiple of n_kv_head (" + std::to_string(nkv) + ")");
  if (chunks <= 0 || T % chunks != 0)
    throw std::invalid_argument(std::string("meshtrain: ") + fn + ": " + std::to_string(T) +
                                " tokens do not split into " + std::to_string(chunks) + " equal chunks");
}

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

}  // namespace

namespace {
constexpr int64_t kBlockQ = 64;  // query rows per tile

// Key chunk bk's visible columns for the query tile starting at row t0 (within its chunk) of bq
// rows: all c for a full pair, t0 + bq for the causal diagonal (rows mask their later keys).
inline int64_t visible(int8_t mode, int64_t c, int64_t t0, int64_t bq) { return mode == 1 ? c : t0 + bq; }

// Causal diagonal: row r (query t0 + r of the chunk) sees keys j <= t0 + r of the L columns at S.
inline void mask_causal(float* S, int64_t lds, int64_t bq, int64_t L, int64_t t0) {
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < bq; ++r)
    for (int64_t j = t0 + r + 1; j < L; ++j) S[r * lds + j] = ninf;
}
}  // namespace

// Tiles of up to 64 query rows of one head and query chunk: the scores against every visible key
// chunk side by side in one per-thread tile (two GEMMs), the softmax of the block per row, the
// block's output (two GEMMs), merged into out / lse.
void attention_block_forward(float* out, float* lse, const float* qkv, const float* kv, int64_t B, int64_t T,
                             int64_t nh, int64_t nkv, int64_t hd, int64_t chunks, const int8_t* modes, bool first) {
  check(T, nh, nkv, chunks, "attention_block_forward");
  if (B <= 0 || T <= 0 || hd <= 0) return;
  const int64_t c = T / chunks, ldq = (nh + 2 * nkv) * hd, ldkv = 2 * nkv * hd, ldo = nh * hd, g = nh / nkv;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const float ninf = -std::numeric_limits<float>::infinity();
  const int64_t BQ = std::min(kBlockQ, c);
#pragma omp parallel
  {
    thread_local detail::Scratch buf;
    float* S = buf.as<float>(static_cast<size_t>(BQ * T + BQ * hd + 2 * BQ));
    float* O = S + BQ * T;
    float* rmax = O + BQ * hd;
    float* rsum = rmax + BQ;
#pragma omp for collapse(3) schedule(dynamic, 1)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < nh; ++h)
        for (int64_t a = 0; a < chunks; ++a) {
          const float* kb = kv + b * T * ldkv + (h / g) * hd;
          const float* vb = kb + nkv * hd;
          for (int64_t t0 = 0; t0 < c; t0 += BQ) {
            const int64_t bq = std::min(BQ, c - t0), row0 = b * T + a * c + t0;
            const float* q = qkv + row0 * ldq + h * hd;
            float* o = out + row0 * ldo + h * hd;
            float* l = lse + (b * nh + h) * T + a * c + t0;
            int64_t Lt = 0;  // visible columns of the tile
            for (int64_t bk = 0; bk < chunks; ++bk)
              if (modes[a * chunks + bk]) Lt += visible(modes[a * chunks + bk], c, t0, bq);
            if (Lt == 0) {  // entirely masked: nothing seen yet from this block
              if (first)
                for (int64_t r = 0; r < bq; ++r) {
                  for (int64_t i = 0; i < hd; ++i) o[r * ldo + i] = 0.0f;
                  l[r] = ninf;
                }
              continue;
            }
            int64_t off = 0;
            for (int64_t bk = 0; bk < chunks; ++bk) {
              const int8_t m = modes[a * chunks + bk];
              if (!m) continue;
              const int64_t L = visible(m, c, t0, bq);
              detail::sgemm_strided(false, true, bq, L, hd, scale, q, ldq, kb + bk * c * ldkv, ldkv, 0.0f, S + off, Lt);
              if (m == 2) mask_causal(S + off, Lt, bq, L, t0);
              off += L;
            }
            for (int64_t r = 0; r < bq; ++r) {
              float* row = S + r * Lt;
              float mx = row[0];
#pragma omp simd reduction(max : mx)
              for (int64_t j = 0; j < Lt; ++j) mx = row[j] > mx ? row[j] : mx;  // (std::max here stays scalar)
              float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
              for (int64_t j = 0; j < Lt; ++j) {
                const float e = detail::exp_f(row[j] - mx);
                row[j] = e;
                sum += e;
              }
              rmax[r] = mx;
              rsum[r] = sum;
            }
            off = 0;
            bool beta0 = true;
            for (int64_t bk = 0; bk < chunks; ++bk) {
              const int8_t m = modes[a * chunks + bk];
              if (!m) continue;
              const int64_t L = visible(m, c, t0, bq);
              detail::sgemm_strided(false, false, bq, hd, L, 1.0f, S + off, Lt, vb + bk * c * ldkv, ldkv,
                                    beta0 ? 0.0f : 1.0f, O, hd);
              beta0 = false;
              off += L;
            }
            for (int64_t r = 0; r < bq; ++r) {
              const float lb = rmax[r] + std::log(rsum[r]);
              float* orow = o + r * ldo;
              const float* ob = O + r * hd;
              if (first || l[r] == ninf) {
                const float inv = 1.0f / rsum[r];
#pragma omp simd
                for (int64_t i = 0; i < hd; ++i) orow[i] = ob[i] * inv;
                l[r] = lb;
              } else {
                const float m2 = std::max(l[r], lb);
                const float ln = m2 + std::log(std::exp(l[r] - m2) + std::exp(lb - m2));
                const float wa = std::exp(l[r] - ln), wb = std::exp(lb - ln) / rsum[r];
#pragma omp simd
                for (int64_t i = 0; i < hd; ++i) orow[i] = orow[i] * wa + ob[i] * wb;
                l[r] = ln;
              }
            }
          }
        }
  }
}

// One task per (sequence, kv head): it owns that head's key / value gradient rows and the query
// gradient rows of its query heads, so every sum runs in a fixed order. Per query tile and visible
// key chunk: P = exp(S - lse), dP = dO V^T, dS = P (dP - D) and three GEMMs into dq, dk, dv.
void attention_block_backward(float* dqkv, float* dkv, const float* dout, const float* qkv, const float* kv,
                              const float* out, const float* lse, int64_t B, int64_t T, int64_t nh, int64_t nkv,
                              int64_t hd, int64_t chunks, const int8_t* modes) {
  check(T, nh, nkv, chunks, "attention_block_backward");
  if (B <= 0 || T <= 0 || hd <= 0) return;
  const int64_t c = T / chunks, ldq = (nh + 2 * nkv) * hd, ldkv = 2 * nkv * hd, ldo = nh * hd, g = nh / nkv;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const float ninf = -std::numeric_limits<float>::infinity();
  const int64_t BQ = std::min(kBlockQ, c);
#pragma omp parallel
  {
    thread_local detail::Scratch buf;
    float* P = buf.as<float>(static_cast<size_t>(2 * BQ * c + BQ));
    float* dP = P + BQ * c;
    float* D = dP + BQ * c;
#pragma omp for collapse(2) schedule(dynamic, 1)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t kvh = 0; kvh < nkv; ++kvh) {
        const float* kb = kv + b * T * ldkv + kvh * hd;
        const float* vb = kb + nkv * hd;
        float* dkb = dkv + b * T * ldkv + kvh * hd;
        float* dvb = dkb + nkv * hd;
        for (int64_t h = kvh * g; h < (kvh + 1) * g; ++h)
          for (int64_t a = 0; a < chunks; ++a)
            for (int64_t t0 = 0; t0 < c; t0 += BQ) {
              const int64_t bq = std::min(BQ, c - t0), row0 = b * T + a * c + t0;
              const float* q = qkv + row0 * ldq + h * hd;
              float* dq = dqkv + row0 * ldq + h * hd;
              const float* dO = dout + row0 * ldo + h * hd;
              const float* o = out + row0 * ldo + h * hd;
              const float* l = lse + (b * nh + h) * T + a * c + t0;
              bool any = false;
              for (int64_t bk = 0; bk < chunks; ++bk) any |= modes[a * chunks + bk] != 0;
              if (!any) continue;
              for (int64_t r = 0; r < bq; ++r) D[r] = l[r] == ninf ? 0.0f : dot(dO + r * ldo, o + r * ldo, hd);
              for (int64_t bk = 0; bk < chunks; ++bk) {
                const int8_t m = modes[a * chunks + bk];
                if (!m) continue;
                const int64_t L = visible(m, c, t0, bq);
                const float* k = kb + bk * c * ldkv;
                const float* v = vb + bk * c * ldkv;
                detail::sgemm_strided(false, true, bq, L, hd, scale, q, ldq, k, ldkv, 0.0f, P, L);
                if (m == 2) mask_causal(P, L, bq, L, t0);
                detail::sgemm_strided(false, true, bq, L, hd, 1.0f, dO, ldo, v, ldkv, 0.0f, dP, L);
                for (int64_t r = 0; r < bq; ++r) {
                  float* pr = P + r * L;
                  float* dpr = dP + r * L;
                  const float lr = l[r], dr = D[r];
#pragma omp simd
                  for (int64_t j = 0; j < L; ++j) {
                    const float p = detail::exp_f(pr[j] - lr);
                    pr[j] = p;
                    dpr[j] = p * (dpr[j] - dr);
                  }
                }
                detail::sgemm_strided(false, false, bq, hd, L, scale, dP, L, k, ldkv, 1.0f, dq, ldq);
                detail::sgemm_strided(true, false, L, hd, bq, scale, dP, L, q, ldq, 1.0f, dkb + bk * c * ldkv, ldkv);
                detail::sgemm_strided(true, false, L, hd, bq, 1.0f, P, L, dO, ldo, 1.0f, dvb + bk * c * ldkv, ldkv);
              }
            }
      }
  }
}

namespace {
void rope_pos(float* qkv, int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd, float theta,
              const float* inv_freq, const int32_t* pos, float sign, const char* fn) {
  if (hd % 2 != 0)
    throw std::invalid_argument(std::string("meshtrain: ") + fn + ": head_dim (" + std::to_string(hd) +
                                ") must be even for rotary embedding");
  if (B <= 0 || T <= 0 || hd <= 0) return;
  const int64_t half = hd / 2, ld = (nh + 2 * nkv) * hd;
  // cos / sin of pos * theta^(-2i/hd), in double and rounded once (as rope_forward's table).
  std::vector<float> cs(static_cast<size_t>(2 * T * half));
  float* sn = cs.data() + T * half;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < half; ++i) {
      const double inv = inv_freq ? static_cast<double>(inv_freq[i])
                                  : std::pow(static_cast<double>(theta), -2.0 * static_cast<double>(i) /
                                                                             static_cast<double>(hd));
      const double a = static_cast<double>(pos[t]) * inv;
      cs[static_cast<size_t>(t * half + i)] = static_cast<float>(std::cos(a));
      sn[t * half + i] = static_cast<float>(std::sin(a));
    }
#pragma omp parallel for collapse(2) schedule(static) if (B * T * ld > detail::kParallelMin)
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      float* row = qkv + (b * T + t) * ld;
      const float* cc = cs.data() + t * half;
      const float* s = sn + t * half;
      for (int64_t hh = 0; hh < nh + nkv; ++hh) {
        float* x = row + hh * hd;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = x[i], x2 = x[i + half];
          const float si = sign * s[i];
          x[i] = x1 * cc[i] - x2 * si;
          x[i + half] = x2 * cc[i] + x1 * si;
        }
      }
    }
}
}  // namespace

void rope_forward_pos(float* qkv, int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd, float theta,
                      const float* inv_freq, const int32_t* pos) {
  rope_pos(qkv, B, T, nh, nkv, hd, theta, inv_freq, pos, 1.0f, "rope_forward_pos");
}

void rope_backward_pos(float* dqkv, int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd, float theta,
                       const float* inv_freq, const int32_t* pos) {
  rope_pos(dqkv, B, T, nh, nkv, hd, theta, inv_freq, pos, -1.0f, "rope_backward_pos");
}

void position_add_pos(float* x, const float* table, const int32_t* pos, int64_t R, int64_t T, int64_t row0,
                      int64_t C) {
#pragma omp parallel for schedule(static) if (R * C > detail::kParallelMin)
  for (int64_t i = 0; i < R; ++i) {
    const float* p = table + static_cast<int64_t>(pos[(row0 + i) % T]) * C;
    float* xr = x + i * C;
#pragma omp simd
    for (int64_t c = 0; c < C; ++c) xr[c] += p[c];
  }
}

void position_backward_pos(float* dtable, const float* dout, const int32_t* pos, int64_t B, int64_t T, int64_t C) {
  // Positions of one rank are distinct, so the rows of dtable are disjoint across t.
#pragma omp parallel for schedule(static) if (B * T * C > detail::kParallelMin)
  for (int64_t t = 0; t < T; ++t) {
    float* dp = dtable + static_cast<int64_t>(pos[t]) * C;
    for (int64_t b = 0; b < B; ++b) {
      const float* src = dout + (b * T + t) * C;
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) dp[c] += src[c];
    }
  }
}

void add_columns(float* out, const float* in, int64_t N, int64_t ld, int64_t c0, int64_t cols) {
#pragma omp parallel for schedule(static) if (N * cols > detail::kParallelMin)
  for (int64_t n = 0; n < N; ++n) {
    float* o = out + n * ld + c0;
    const float* s = in + n * cols;
#pragma omp simd
    for (int64_t j = 0; j < cols; ++j) o[j] += s[j];
  }
}

MT_CPU_VARIANT_END  // namespace mt::kernels::cpu
