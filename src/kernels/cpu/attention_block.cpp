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
#include "kernels/cpu/rope.h"
#include "kernels/cpu/softmax_row.h"
#include "kernels/cpu/vecmath.h"
#include "kernels/cpu/workspace.h"

MT_CPU_VARIANT_BEGIN

namespace {

// One call's dimensions: chunks of c tokens; rows of qkv are ldq floats, of kv ldkv, of out ldo;
// query head h reads key / value head h / g; queries go in tiles of BQ rows; scores are scaled.
// Checks the heads and the chunking (std::invalid_argument naming `fn`).
struct Dims {
  int64_t c, ldq, ldkv, ldo, g, BQ;
  float scale;
};

constexpr int64_t kBlockQ = 64;  // query rows per tile

Dims dims(int64_t T, int64_t nh, int64_t nkv, int64_t hd, int64_t chunks, const char* fn) {
  if (nh <= 0 || nkv <= 0 || nh % nkv != 0)
    throw std::invalid_argument(std::string("meshtrain: ") + fn + ": n_head (" + std::to_string(nh) +
                                ") must be a positive multiple of n_kv_head (" + std::to_string(nkv) + ")");
  if (chunks <= 0 || T % chunks != 0)
    throw std::invalid_argument(std::string("meshtrain: ") + fn + ": " + std::to_string(T) +
                                " tokens do not split into " + std::to_string(chunks) + " equal chunks");
  const int64_t c = T / chunks;
  return {c, (nh + 2 * nkv) * hd, 2 * nkv * hd, nh * hd, nh / nkv, std::min(kBlockQ, c),
          1.0f / std::sqrt(static_cast<float>(hd))};
}

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// Key chunk bk's visible columns for the query tile starting at row t0 (within its chunk) of bq
// rows: all c for a full pair, t0 + bq for the causal diagonal (rows mask their later keys).
inline int64_t visible(int8_t mode, int64_t c, int64_t t0, int64_t bq) { return mode == 1 ? c : t0 + bq; }

// Causal diagonal: row r (query t0 + r of the chunk) sees keys j <= t0 + r of the keys k0 .. L-1
// in S's columns 0 .. L-k0-1.
inline void mask_causal(float* S, int64_t lds, int64_t bq, int64_t L, int64_t t0, int64_t k0 = 0) {
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < bq; ++r)
    for (int64_t j = std::max(k0, t0 + r + 1); j < L; ++j) S[r * lds + (j - k0)] = ninf;
}

// Document masking: the keys k0 .. L-1 of a chunk are in S's columns 0 .. L-k0-1; row r sees key
// j only from lo[r] on (lo: the row's first visible key within the chunk).
inline void mask_documents(float* S, int64_t lds, int64_t bq, int64_t k0, int64_t L, const int64_t* lo) {
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < bq; ++r)
    for (int64_t j = k0; j < std::min(lo[r], L); ++j) S[r * lds + (j - k0)] = ninf;
}
}  // namespace

namespace {

// A tile of query rows [t0, t0 + bq) of chunk a of head h of sequence b; its first row is row0 of
// the [B T] rows. The key chunks it sees: mode modes[bk] (0 none, 1 all, 2 the causal diagonal).
struct Tile {
  int64_t b, h, a, t0, bq, row0;
  const int8_t* modes;  // the tile's row of the chunk pair modes
  // Document masking (null: none): the global first visible key of each of the [B T] query rows,
  // and the global position of each key chunk's first token.
  const int32_t* doc_start = nullptr;
  const int32_t* key_start = nullptr;
};

// The keys [k0, L) of key chunk bk that the tile computes (k0 = L: none); with document masking
// lo[r] is row r's first visible key of the chunk (keys before k0 are invisible to every row).
int64_t chunk_keys(const Dims& d, const Tile& t, int64_t bk, int64_t* k0, int64_t* lo) {
  const int8_t m = t.modes[bk];
  if (!m) {
    *k0 = 0;
    return 0;
  }
  const int64_t L = visible(m, d.c, t.t0, t.bq);
  int64_t first = L;
  if (!t.doc_start) {
    *k0 = 0;
    return L;
  }
  for (int64_t r = 0; r < t.bq; ++r) {
    const int64_t v = static_cast<int64_t>(t.doc_start[t.row0 + r]) - t.key_start[bk];
    lo[r] = std::clamp<int64_t>(v, 0, d.c);
    first = std::min(first, lo[r]);
  }
  *k0 = first;
  return L;
}

// Columns the tile's scores have: every visible key chunk's, side by side.
int64_t tile_columns(const Dims& d, const Tile& t, int64_t chunks, int64_t* lo) {
  int64_t Lt = 0;
  for (int64_t bk = 0; bk < chunks; ++bk) {
    int64_t k0 = 0;
    const int64_t L = chunk_keys(d, t, bk, &k0, lo);
    Lt += L - k0;
  }
  return Lt;
}

// Forward of one tile: S = scale Q K^T against the visible chunks into S [bq, Lt] (the diagonal
// chunk masked), each row exponentiated (rmax, rsum: its max and sum), O = P V into O [bq, hd].
// With document masking a row may see no key of the block at all: its rmax is -inf.
void forward_tile(const Dims& d, const Tile& t, int64_t chunks, int64_t Lt, const float* q, const float* kb,
                  const float* vb, int64_t hd, float* S, float* O, float* rmax, float* rsum, int64_t* lo) {
  int64_t off = 0;
  for (int64_t bk = 0; bk < chunks; ++bk) {
    int64_t k0 = 0;
    const int64_t L = chunk_keys(d, t, bk, &k0, lo);
    if (L - k0 <= 0) continue;
    const int8_t m = t.modes[bk];
    detail::sgemm_strided(false, true, t.bq, L - k0, hd, d.scale, q, d.ldq, kb + (bk * d.c + k0) * d.ldkv, d.ldkv,
                          0.0f, S + off, Lt);
    if (m == 2) mask_causal(S + off, Lt, t.bq, L, t.t0, k0);
    if (t.doc_start) mask_documents(S + off, Lt, t.bq, k0, L, lo);
    off += L - k0;
  }
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < t.bq; ++r) {
    if (t.doc_start && row_max(S + r * Lt, Lt) == ninf) {  // nothing visible: P row 0, skipped by the merge
      for (int64_t j = 0; j < Lt; ++j) S[r * Lt + j] = 0.0f;
      rmax[r] = ninf;
      rsum[r] = 0.0f;
      continue;
    }
    const RowExp st = exp_row(S + r * Lt, S + r * Lt, Lt);
    rmax[r] = st.max;
    rsum[r] = st.sum;
  }
  off = 0;
  bool beta0 = true;
  for (int64_t bk = 0; bk < chunks; ++bk) {
    int64_t k0 = 0;
    const int64_t L = chunk_keys(d, t, bk, &k0, lo);
    if (L - k0 <= 0) continue;
    detail::sgemm_strided(false, false, t.bq, hd, L - k0, 1.0f, S + off, Lt, vb + (bk * d.c + k0) * d.ldkv, d.ldkv,
                          beta0 ? 0.0f : 1.0f, O, hd);
    beta0 = false;
    off += L - k0;
  }
}

// The tile's block result (O, rmax, rsum) merged into its rows of out (o) and lse (l): taken as
// it is on the first block (or where nothing was seen yet), else combined by log-sum-exp.
void merge_tile(const Dims& d, int64_t bq, int64_t hd, const float* O, const float* rmax, const float* rsum,
                bool first, float* o, float* l) {
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < bq; ++r) {
    if (rmax[r] == ninf) {  // document masking: the row sees no key of this block
      if (first) {
        for (int64_t i = 0; i < hd; ++i) o[r * d.ldo + i] = 0.0f;
        l[r] = ninf;
      }
      continue;
    }
    const float lb = rmax[r] + std::log(rsum[r]);
    float* orow = o + r * d.ldo;
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

// Backward of one tile against one visible key chunk (k, v; dk, dv its gradient rows): P from the
// scores and lse, dP = dO V^T, dS = P (dP - D) in place, then dq, dk and dv accumulate.
// Document masking: only the keys k0 .. Lv-1 (k, v, dk, dv start at key k0), row r from lo[r] on.
void backward_chunk(const Dims& d, const Tile& t, int8_t mode, int64_t hd, const float* q, const float* dO,
                    const float* l, const float* D, const float* k, const float* v, float* dq, float* dk, float* dv,
                    float* P, float* dP, int64_t k0, int64_t Lv, const int64_t* lo) {
  const int64_t bq = t.bq, L = Lv - k0;
  detail::sgemm_strided(false, true, bq, L, hd, d.scale, q, d.ldq, k, d.ldkv, 0.0f, P, L);
  if (mode == 2) mask_causal(P, L, bq, Lv, t.t0, k0);
  if (t.doc_start) mask_documents(P, L, bq, k0, Lv, lo);
  detail::sgemm_strided(false, true, bq, L, hd, 1.0f, dO, d.ldo, v, d.ldkv, 0.0f, dP, L);
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
  detail::sgemm_strided(false, false, bq, hd, L, d.scale, dP, L, k, d.ldkv, 1.0f, dq, d.ldq);
  detail::sgemm_strided(true, false, L, hd, bq, d.scale, dP, L, q, d.ldq, 1.0f, dk, d.ldkv);
  detail::sgemm_strided(true, false, L, hd, bq, 1.0f, P, L, dO, d.ldo, 1.0f, dv, d.ldkv);
}

}  // namespace

// Tiles of up to 64 query rows of one head and query chunk: the scores against every visible key
// chunk side by side in one per-thread tile (two GEMMs), the softmax of the block per row, the
// block's output (two GEMMs), merged into out / lse.
void attention_block_forward(float* out, float* lse, const float* qkv, const float* kv, int64_t B, int64_t T,
                             int64_t nh, int64_t nkv, int64_t hd, int64_t chunks, const int8_t* modes, bool first,
                             const int32_t* doc_start, const int32_t* key_start) {
  const Dims d = dims(T, nh, nkv, hd, chunks, "attention_block_forward");
  if (B <= 0 || T <= 0 || hd <= 0) return;
  const int64_t c = d.c, BQ = d.BQ;
#pragma omp parallel
  {
    thread_local detail::Scratch buf;
    float* S = buf.as<float>(static_cast<size_t>(BQ * T + BQ * hd + 2 * BQ));
    float* O = S + BQ * T;
    float* rmax = O + BQ * hd;
    float* rsum = rmax + BQ;
    thread_local std::vector<int64_t> lo_buf;  // document masking: each row's first visible key
    lo_buf.resize(static_cast<size_t>(BQ));
    int64_t* lo = lo_buf.data();
#pragma omp for collapse(3) schedule(dynamic, 1)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < nh; ++h)
        for (int64_t a = 0; a < chunks; ++a) {
          const float* kb = kv + b * T * d.ldkv + (h / d.g) * hd;
          const float* vb = kb + nkv * hd;
          for (int64_t t0 = 0; t0 < c; t0 += BQ) {
            const Tile t{b,  h, a, t0, std::min(BQ, c - t0), b * T + a * c + t0, modes + a * chunks,
                         doc_start, key_start};
            float* o = out + t.row0 * d.ldo + h * hd;
            float* l = lse + (b * nh + h) * T + a * c + t0;
            const int64_t Lt = tile_columns(d, t, chunks, lo);
            if (Lt == 0) {  // entirely masked: nothing seen yet from this block
              if (first)
                for (int64_t r = 0; r < t.bq; ++r) {
                  for (int64_t i = 0; i < hd; ++i) o[r * d.ldo + i] = 0.0f;
                  l[r] = -std::numeric_limits<float>::infinity();
                }
              continue;
            }
            forward_tile(d, t, chunks, Lt, qkv + t.row0 * d.ldq + h * hd, kb, vb, hd, S, O, rmax, rsum, lo);
            merge_tile(d, t.bq, hd, O, rmax, rsum, first, o, l);
          }
        }
  }
}

// One task per (sequence, kv head): it owns that head's key / value gradient rows and the query
// gradient rows of its query heads, so every sum runs in a fixed order. Per query tile and visible
// key chunk: P = exp(S - lse), dP = dO V^T, dS = P (dP - D) and three GEMMs into dq, dk, dv.
void attention_block_backward(float* dqkv, float* dkv, const float* dout, const float* qkv, const float* kv,
                              const float* out, const float* lse, int64_t B, int64_t T, int64_t nh, int64_t nkv,
                              int64_t hd, int64_t chunks, const int8_t* modes, const int32_t* doc_start,
                              const int32_t* key_start) {
  const Dims d = dims(T, nh, nkv, hd, chunks, "attention_block_backward");
  if (B <= 0 || T <= 0 || hd <= 0) return;
  const int64_t c = d.c, ldq = d.ldq, ldkv = d.ldkv, ldo = d.ldo, BQ = d.BQ;
#pragma omp parallel
  {
    thread_local detail::Scratch buf;
    float* P = buf.as<float>(static_cast<size_t>(2 * BQ * c + BQ));
    float* dP = P + BQ * c;
    float* D = dP + BQ * c;
    thread_local std::vector<int64_t> lo_buf;  // document masking: each row's first visible key
    lo_buf.resize(static_cast<size_t>(BQ));
    int64_t* lo = lo_buf.data();
#pragma omp for collapse(2) schedule(dynamic, 1)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t kvh = 0; kvh < nkv; ++kvh) {
        const float* kb = kv + b * T * ldkv + kvh * hd;
        const float* vb = kb + nkv * hd;
        float* dkb = dkv + b * T * ldkv + kvh * hd;
        float* dvb = dkb + nkv * hd;
        for (int64_t h = kvh * d.g; h < (kvh + 1) * d.g; ++h)
          for (int64_t a = 0; a < chunks; ++a)
            for (int64_t t0 = 0; t0 < c; t0 += BQ) {
              const Tile t{b,  h, a, t0, std::min(BQ, c - t0), b * T + a * c + t0, modes + a * chunks,
                           doc_start, key_start};
              if (tile_columns(d, t, chunks, lo) == 0) continue;
              const float* q = qkv + t.row0 * ldq + h * hd;
              const float* dO = dout + t.row0 * ldo + h * hd;
              const float* o = out + t.row0 * ldo + h * hd;
              const float* l = lse + (b * nh + h) * T + a * c + t0;
              for (int64_t r = 0; r < t.bq; ++r)
                D[r] = l[r] == -std::numeric_limits<float>::infinity() ? 0.0f : dot(dO + r * ldo, o + r * ldo, hd);
              for (int64_t bk = 0; bk < chunks; ++bk) {
                int64_t k0 = 0;
                const int64_t Lv = chunk_keys(d, t, bk, &k0, lo);
                if (Lv - k0 <= 0) continue;
                const int64_t o0 = (bk * c + k0) * ldkv;
                backward_chunk(d, t, t.modes[bk], hd, q, dO, l, D, kb + o0, vb + o0, dqkv + t.row0 * ldq + h * hd,
                               dkb + o0, dvb + o0, P, dP, k0, Lv, lo);
              }
            }
      }
  }
}

namespace {
void rope_pos(float* qkv, int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd, float theta,
              const float* inv_freq, const int32_t* pos, float sign, const char* fn) {
  rope_check_head_dim(hd, fn);
  if (B <= 0 || T <= 0 || hd <= 0) return;
  const int64_t half = hd / 2;
  // cos / sin of pos * rope_rate(i), in double and rounded once (as rope_forward's table).
  std::vector<float> cs(static_cast<size_t>(2 * T * half));
  float* sn = cs.data() + T * half;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < half; ++i) {
      const double a = static_cast<double>(pos[t]) * rope_rate(i, hd, theta, inv_freq);
      cs[static_cast<size_t>(t * half + i)] = static_cast<float>(std::cos(a));
      sn[t * half + i] = static_cast<float>(std::sin(a));
    }
  rope_rotate(qkv, B, T, nh, nkv, hd, cs.data(), sn, sign);
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
