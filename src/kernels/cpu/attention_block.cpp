// Context parallelism's attention block kernels (see attention_block.h). Row by row: the scores of
// one query row against the keys of the block live in a per-thread buffer of at most T floats.
#include "kernels/cpu/attention_block.h"

#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/cpu/vecmath.h"
#include "kernels/cpu/workspace.h"

namespace mt::kernels::cpu {

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

// Calls f(key row index within the sequence) for every key that query t (of chunk length c) sees.
template <class F>
inline void for_each_key(int64_t t, int64_t c, int64_t chunks, const int8_t* modes, F f) {
  const int64_t a = t / c, ti = t % c;
  for (int64_t bk = 0; bk < chunks; ++bk) {
    const int8_t m = modes[a * chunks + bk];
    if (m == 0) continue;
    const int64_t kend = m == 1 ? c : ti + 1;
    for (int64_t j = 0; j < kend; ++j) f(bk * c + j);
  }
}

}  // namespace

void attention_block_forward(float* out, float* lse, const float* qkv, const float* kv, int64_t B, int64_t T,
                             int64_t nh, int64_t nkv, int64_t hd, int64_t chunks, const int8_t* modes, bool first) {
  check(T, nh, nkv, chunks, "attention_block_forward");
  if (B <= 0 || T <= 0 || hd <= 0) return;
  const int64_t c = T / chunks, ldq = (nh + 2 * nkv) * hd, ldkv = 2 * nkv * hd, ldo = nh * hd, g = nh / nkv;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const float ninf = -std::numeric_limits<float>::infinity();
#pragma omp parallel
  {
    thread_local detail::Scratch buf;
    float* sc = buf.as<float>(static_cast<size_t>(T + hd));
    float* o = sc + T;
#pragma omp for collapse(3) schedule(static)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < nh; ++h)
        for (int64_t t = 0; t < T; ++t) {
          const float* q = qkv + (b * T + t) * ldq + h * hd;
          const float* kbase = kv + b * T * ldkv + (h / g) * hd;
          const float* vbase = kbase + nkv * hd;
          float* orow = out + (b * T + t) * ldo + h * hd;
          float& l = lse[(b * nh + h) * T + t];
          int64_t n = 0;
          float mx = ninf;
          for_each_key(t, c, chunks, modes, [&](int64_t j) {
            const float s = dot(q, kbase + j * ldkv, hd) * scale;
            sc[n++] = s;
            mx = s > mx ? s : mx;
          });
          if (n == 0) {
            if (first) {
              for (int64_t i = 0; i < hd; ++i) orow[i] = 0.0f;
              l = ninf;
            }
            continue;
          }
#pragma omp simd
          for (int64_t i = 0; i < n; ++i) sc[i] = detail::exp_f(sc[i] - mx);
          float sum = 0.0f;
          for (int64_t i = 0; i < n; ++i) sum += sc[i];
          for (int64_t i = 0; i < hd; ++i) o[i] = 0.0f;
          n = 0;
          for_each_key(t, c, chunks, modes, [&](int64_t j) {
            const float p = sc[n++];
            const float* v = vbase + j * ldkv;
#pragma omp simd
            for (int64_t i = 0; i < hd; ++i) o[i] += p * v[i];
          });
          const float lb = mx + std::log(sum);
          if (first || l == ninf) {
            const float inv = 1.0f / sum;
            for (int64_t i = 0; i < hd; ++i) orow[i] = o[i] * inv;
            l = lb;
          } else {
            const float m2 = l > lb ? l : lb;
            const float ln = m2 + std::log(std::exp(l - m2) + std::exp(lb - m2));
            const float wa = std::exp(l - ln), wb = std::exp(lb - ln) / sum;
#pragma omp simd
            for (int64_t i = 0; i < hd; ++i) orow[i] = orow[i] * wa + o[i] * wb;
            l = ln;
          }
        }
  }
}

void attention_block_backward(float* dqkv, float* dkv, const float* dout, const float* qkv, const float* kv,
                              const float* out, const float* lse, int64_t B, int64_t T, int64_t nh, int64_t nkv,
                              int64_t hd, int64_t chunks, const int8_t* modes) {
  check(T, nh, nkv, chunks, "attention_block_backward");
  if (B <= 0 || T <= 0 || hd <= 0) return;
  const int64_t c = T / chunks, ldq = (nh + 2 * nkv) * hd, ldkv = 2 * nkv * hd, ldo = nh * hd, g = nh / nkv;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const float ninf = -std::numeric_limits<float>::infinity();
  // One task per (sequence, kv head): it owns that head's key / value gradient rows and the query
  // gradient rows of its query heads, so the sums run in a fixed order.
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < B; ++b)
    for (int64_t kvh = 0; kvh < nkv; ++kvh) {
      const float* kbase = kv + b * T * ldkv + kvh * hd;
      const float* vbase = kbase + nkv * hd;
      float* dkbase = dkv + b * T * ldkv + kvh * hd;
      float* dvbase = dkbase + nkv * hd;
      for (int64_t h = kvh * g; h < (kvh + 1) * g; ++h)
        for (int64_t t = 0; t < T; ++t) {
          const float L = lse[(b * nh + h) * T + t];
          if (L == ninf) continue;
          const float* q = qkv + (b * T + t) * ldq + h * hd;
          float* dq = dqkv + (b * T + t) * ldq + h * hd;
          const float* dor = dout + (b * T + t) * ldo + h * hd;
          const float D = dot(dor, out + (b * T + t) * ldo + h * hd, hd);
          for_each_key(t, c, chunks, modes, [&](int64_t j) {
            const float* k = kbase + j * ldkv;
            const float* v = vbase + j * ldkv;
            const float p = std::exp(dot(q, k, hd) * scale - L);
            const float ds = p * (dot(dor, v, hd) - D) * scale;
            float* dk = dkbase + j * ldkv;
            float* dv = dvbase + j * ldkv;
#pragma omp simd
            for (int64_t i = 0; i < hd; ++i) {
              dq[i] += ds * k[i];
              dk[i] += ds * q[i];
              dv[i] += p * dor[i];
            }
          });
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

}  // namespace mt::kernels::cpu
