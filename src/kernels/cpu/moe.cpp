#include "kernels/cpu/moe.h"

#include <cmath>
#include <cstring>

namespace mt::kernels::cpu {

namespace {
// The k largest of s[0..E) into idx (descending, ties to the lower index).
void top_k(const float* s, int64_t E, int64_t k, int32_t* idx) {
  for (int64_t j = 0; j < k; ++j) {
    int64_t best = -1;
    for (int64_t e = 0; e < E; ++e) {
      bool taken = false;
      for (int64_t i = 0; i < j; ++i) taken = taken || idx[i] == e;
      if (taken) continue;
      if (best < 0 || s[e] > s[best]) best = e;
    }
    idx[j] = static_cast<int32_t>(best);
  }
}
}  // namespace

void moe_router_forward(float* scores, int32_t* idx, float* w, float* lse, const float* logits, int64_t N, int64_t E,
                        int64_t k, int sigmoid) {
#pragma omp parallel for if (N * E > 16384)
  for (int64_t t = 0; t < N; ++t) {
    const float* l = logits + t * E;
    float* s = scores + t * E;
    float mx = l[0];
    for (int64_t e = 1; e < E; ++e) mx = std::fmax(mx, l[e]);
    double z = 0;
    for (int64_t e = 0; e < E; ++e) z += std::exp(static_cast<double>(l[e] - mx));
    lse[t] = mx + static_cast<float>(std::log(z));
    for (int64_t e = 0; e < E; ++e)
      s[e] = sigmoid ? 1.0f / (1.0f + std::exp(-l[e])) : static_cast<float>(std::exp(static_cast<double>(l[e] - mx)) / z);
    int32_t* id = idx + t * k;
    top_k(s, E, k, id);
    double S = 0;
    for (int64_t j = 0; j < k; ++j) S += s[id[j]];
    for (int64_t j = 0; j < k; ++j) w[t * k + j] = static_cast<float>(s[id[j]] / S);
  }
}

void moe_router_backward(float* dlogits, const float* dw, const float* scores, const int32_t* idx, const float* w,
                         const float* lse, const float* logits, const float* aux, float z_scale, int64_t N, int64_t E,
                         int64_t k, int sigmoid) {
#pragma omp parallel for if (N * E > 16384)
  for (int64_t t = 0; t < N; ++t) {
    const float* s = scores + t * E;
    const float* l = logits + t * E;
    float* dl = dlogits + t * E;
    const int32_t* id = idx + t * k;
    // w_j = s_j / S over the chosen experts: dS_j = (dw_j - sum_i w_i dw_i) / S.
    double S = 0, wdw = 0;
    for (int64_t j = 0; j < k; ++j) {
      S += s[id[j]];
      wdw += static_cast<double>(w[t * k + j]) * dw[t * k + j];
    }
    // ds: gradient with respect to the scores.
    for (int64_t e = 0; e < E; ++e) dl[e] = 0.0f;
    for (int64_t j = 0; j < k; ++j) dl[id[j]] += static_cast<float>((dw[t * k + j] - wdw) / S);
    if (sigmoid) {
      // balance probabilities q = s / sum_e s: ds += (aux - <q, aux>) / sum_e s
      if (aux) {
        double tot = 0, qa = 0;
        for (int64_t e = 0; e < E; ++e) tot += s[e];
        for (int64_t e = 0; e < E; ++e) qa += s[e] / tot * aux[e];
        for (int64_t e = 0; e < E; ++e) dl[e] += static_cast<float>((aux[e] - qa) / tot);
      }
      for (int64_t e = 0; e < E; ++e) dl[e] *= s[e] * (1.0f - s[e]);
      if (z_scale != 0.0f) {
        const float g = 2.0f * z_scale * lse[t];
        for (int64_t e = 0; e < E; ++e) dl[e] += g * std::exp(l[e] - lse[t]);
      }
    } else {
      // scores are the softmax p: dl = p * (ds - <p, ds>), with ds += aux and the z-loss's 2 z lse.
      if (aux)
        for (int64_t e = 0; e < E; ++e) dl[e] += aux[e];
      double pd = 0;
      for (int64_t e = 0; e < E; ++e) pd += static_cast<double>(s[e]) * dl[e];
      const float g = 2.0f * z_scale * lse[t];
      for (int64_t e = 0; e < E; ++e) dl[e] = s[e] * (dl[e] - static_cast<float>(pd)) + g * s[e];
    }
  }
}

void moe_balance_probs(float* P, const float* scores, int64_t N, int64_t E, int sigmoid) {
  for (int64_t e = 0; e < E; ++e) P[e] = 0.0f;
  double acc[256];
  const int64_t Eb = E < 256 ? E : 256;
  for (int64_t e0 = 0; e0 < E; e0 += Eb) {
    const int64_t ne = E - e0 < Eb ? E - e0 : Eb;
    for (int64_t e = 0; e < ne; ++e) acc[e] = 0;
    for (int64_t t = 0; t < N; ++t) {
      const float* s = scores + t * E;
      double tot = 1.0;
      if (sigmoid) {
        tot = 0;
        for (int64_t e = 0; e < E; ++e) tot += s[e];
      }
      for (int64_t e = 0; e < ne; ++e) acc[e] += s[e0 + e] / tot;
    }
    for (int64_t e = 0; e < ne; ++e) P[e0 + e] = static_cast<float>(acc[e] / static_cast<double>(N));
  }
}

void moe_gather_rows(void* out, const void* in, const int32_t* rows, int64_t n, int64_t row_bytes) {
  auto* o = static_cast<char*>(out);
  const auto* s = static_cast<const char*>(in);
#pragma omp parallel for if (n * row_bytes > 262144)
  for (int64_t i = 0; i < n; ++i) {
    if (rows[i] < 0)
      std::memset(o + i * row_bytes, 0, static_cast<size_t>(row_bytes));
    else
      std::memcpy(o + i * row_bytes, s + static_cast<int64_t>(rows[i]) * row_bytes, static_cast<size_t>(row_bytes));
  }
}

void moe_combine(float* out, const float* y, const int32_t* pos, const float* w, int64_t N, int64_t k, int64_t C) {
#pragma omp parallel for if (N * k * C > 16384)
  for (int64_t t = 0; t < N; ++t) {
    float* o = out + t * C;
    for (int64_t j = 0; j < k; ++j) {
      const int32_t p = pos[t * k + j];
      if (p < 0) continue;
      const float g = w ? w[t * k + j] : 1.0f;
      const float* r = y + static_cast<int64_t>(p) * C;
      for (int64_t c = 0; c < C; ++c) o[c] += g * r[c];
    }
  }
}

void moe_combine_backward(float* dy, float* dw, const float* dout, const float* y, const int32_t* pos, const float* w,
                          int64_t N, int64_t k, int64_t C) {
#pragma omp parallel for if (N * k * C > 16384)
  for (int64_t t = 0; t < N; ++t) {
    const float* d = dout + t * C;
    for (int64_t j = 0; j < k; ++j) {
      const int32_t p = pos[t * k + j];
      if (p < 0) {
        dw[t * k + j] = 0.0f;
        continue;
      }
      const float g = w[t * k + j];
      float* r = dy + static_cast<int64_t>(p) * C;
      const float* yr = y + static_cast<int64_t>(p) * C;
      double dot = 0;
      for (int64_t c = 0; c < C; ++c) {
        r[c] = g * d[c];
        dot += static_cast<double>(d[c]) * yr[c];
      }
      dw[t * k + j] = static_cast<float>(dot);
    }
  }
}

}  // namespace mt::kernels::cpu
