// Causal grouped-query attention, flash style, and rotary embedding.
//
// Work is split into tasks (batch b, query head h), run in parallel. A task walks the queries in
// blocks of kBlockQ rows; for a block of rows [t0, t0+bq) only the keys [0, t0+bq) can be seen, so
// the scores S = scale * Q_blk K^T are one small GEMM into a per-thread tile [bq, t0+bq], the
// softmax is done row by row in that tile (exact, no online rescaling needed since the whole
// visible row fits) and O_blk = P V is a second small GEMM. Forward keeps only the row
// log-sum-exp; backward recomputes P = exp(S - lse) per block. The small GEMMs run on the calling
// thread (oneDNN sgemm inside a parallel region), so each task is sequential and the result does
// not depend on how tasks are spread over threads.
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
#include <vector>

#include "kernels/cpu/gemm_internal.h"
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
      float m = row[0];
#pragma omp simd reduction(max : m)
      for (int64_t j = 0; j < nv; ++j) m = std::max(m, row[j]);
      float s = 0.0f;
#pragma omp simd reduction(+ : s)
      for (int64_t j = 0; j < nv; ++j) {
        const float e = detail::exp_f(row[j] - m);
        row[j] = e;
        s += e;
      }
      const float inv = 1.0f / s;
#pragma omp simd
      for (int64_t j = 0; j < nv; ++j) row[j] *= inv;
      lse_out[t0 + r] = m + std::log(s);
    }
    for (int64_t j = nv; j < L; ++j) row[j] = 0.0f;
  }
}

}  // namespace

void attention_forward(float* out, float* lse, const float* qkv, int64_t B, int64_t T, int64_t nh,
                       int64_t nkv, int64_t hd) {
  check_heads(nh, nkv, "attention_forward");
  if (B <= 0 || T <= 0 || hd <= 0) return;
  const int64_t ld = (nh + 2 * nkv) * hd;
  const int64_t od = nh * hd;
  const int64_t grp = nh / nkv;
  const float sc = 1.0f / std::sqrt(static_cast<float>(hd));
  const int64_t BQ = std::min(kBlockQ, T);
  const int nthr = omp_get_max_threads();
  thread_local Scratch scratch;
  float* tiles = scratch.as<float>(static_cast<size_t>(nthr) * BQ * T);

#pragma omp parallel for collapse(2) schedule(dynamic, 1)
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < nh; ++h) {
      float* S = tiles + static_cast<int64_t>(omp_get_thread_num()) * BQ * T;
      const float* q = qkv + b * T * ld + h * hd;
      const float* k = qkv + b * T * ld + (nh + h / grp) * hd;
      const float* v = qkv + b * T * ld + (nh + nkv + h / grp) * hd;
      float* o = out + b * T * od + h * hd;
      float* l = lse + (b * nh + h) * T;
      for (int64_t t0 = 0; t0 < T; t0 += BQ) {
        const int64_t bq = std::min(BQ, T - t0);
        const int64_t L = t0 + bq;
        sgemm_strided(false, true, bq, L, hd, sc, q + t0 * ld, ld, k, ld, 0.0f, S, L);
        softmax_rows(S, bq, L, t0, nullptr, l);
        sgemm_strided(false, false, bq, hd, L, 1.0f, S, L, v, ld, 0.0f, o + t0 * od, od);
      }
    }
  }
}

void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out,
                        const float* lse, int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd) {
  check_heads(nh, nkv, "attention_backward");
  if (B <= 0 || T <= 0 || hd <= 0) return;
  const int64_t ld = (nh + 2 * nkv) * hd;
  const int64_t od = nh * hd;
  const int64_t grp = nh / nkv;
  const float sc = 1.0f / std::sqrt(static_cast<float>(hd));
  const int64_t BQ = std::min(kBlockQ, T);
  const int nthr = omp_get_max_threads();
  thread_local Scratch tile_scratch, kv_scratch;
  // Per thread: P tile, dP tile, D [BQ].
  const int64_t per_thr = 2 * BQ * T + BQ;
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
        const int64_t b = b0 + bi;
        float* P = tiles + static_cast<int64_t>(omp_get_thread_num()) * per_thr;
        float* dP = P + BQ * T;
        float* D = dP + BQ * T;
        const int64_t kvh = h / grp;
        const float* q = qkv + b * T * ld + h * hd;
        const float* k = qkv + b * T * ld + (nh + kvh) * hd;
        const float* v = qkv + b * T * ld + (nh + nkv + kvh) * hd;
        const float* o = out + b * T * od + h * hd;
        const float* dO = dout + b * T * od + h * hd;
        const float* l = lse + (b * nh + h) * T;
        float* dq = dqkv + b * T * ld + h * hd;
        float *dk, *dv;
        int64_t ldkv;
        if (grp == 1) {
          dk = dqkv + b * T * ld + (nh + kvh) * hd;
          dv = dqkv + b * T * ld + (nh + nkv + kvh) * hd;
          ldkv = ld;
        } else {
          dk = kvbuf + (bi * nh + h) * per_bh;
          dv = dk + T * hd;
          ldkv = hd;
          std::fill(dk, dk + per_bh, 0.0f);
        }
        for (int64_t t0 = 0; t0 < T; t0 += BQ) {
          const int64_t bq = std::min(BQ, T - t0);
          const int64_t L = t0 + bq;
          sgemm_strided(false, true, bq, L, hd, sc, q + t0 * ld, ld, k, ld, 0.0f, P, L);
          softmax_rows(P, bq, L, t0, l, nullptr);
          sgemm_strided(false, true, bq, L, hd, 1.0f, dO + t0 * od, od, v, ld, 0.0f, dP, L);
          for (int64_t r = 0; r < bq; ++r) {
            const float* a = dO + (t0 + r) * od;
            const float* c = o + (t0 + r) * od;
            float s = 0.0f;
#pragma omp simd reduction(+ : s)
            for (int64_t d = 0; d < hd; ++d) s += a[d] * c[d];
            D[r] = s;
          }
          // dS = P * (dP - D), in place of dP (zero where P is masked).
          for (int64_t r = 0; r < bq; ++r) {
            float* dpr = dP + r * L;
            const float* pr = P + r * L;
            const float dr = D[r];
#pragma omp simd
            for (int64_t j = 0; j < L; ++j) dpr[j] = pr[j] * (dpr[j] - dr);
          }
          sgemm_strided(false, false, bq, hd, L, sc, dP, L, k, ld, 1.0f, dq + t0 * ld, ld);
          sgemm_strided(true, false, L, hd, bq, sc, dP, L, q + t0 * ld, ld, 1.0f, dk, ldkv);
          sgemm_strided(true, false, L, hd, bq, 1.0f, P, L, dO + t0 * od, od, 1.0f, dv, ldkv);
        }
      }
    }
    if (grp > 1) {
      // dqkv[b, t, kv head] += sum over the group's query heads, in head order.
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
              for (int64_t d = 0; d < hd; ++d) {
                dk[d] += sk[d];
                dv[d] += sv[d];
              }
            }
          }
        }
      }
    }
  }
}

// ---- RoPE ---------------------------------------------------------------------------------------

namespace {

struct RopeTable {
  int64_t T = 0, hd = 0;
  float theta = 0.0f;
  std::vector<float> freq;  // explicit inverse frequencies (empty: from theta)
  Scratch buf;  // cos [T, hd/2] then sin [T, hd/2]
};

// cos/sin of t * theta^(-2i/hd), computed in double and rounded once; cached per thread. Returns
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
        const double inv = inv_freq ? static_cast<double>(inv_freq[i])
                                    : std::pow(static_cast<double>(theta),
                                               -2.0 * static_cast<double>(i) / static_cast<double>(hd));
        const double a = static_cast<double>(t) * inv;
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
  if (hd % 2 != 0) {
    throw std::invalid_argument(std::string("meshtrain: ") + fn + ": head_dim (" +
                                std::to_string(hd) + ") must be even for rotary embedding");
  }
  if (B <= 0 || T <= 0 || hd <= 0) return;
  const int64_t half = hd / 2;
  const int64_t ld = (nh + 2 * nkv) * hd;
  const float* sn = nullptr;
  const float* cs = rope_table(T, hd, theta, &sn, inv_freq);
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

MT_CPU_VARIANT_END  // namespace mt::kernels::cpu
