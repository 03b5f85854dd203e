// Fused softmax + cross-entropy over a padded vocabulary, one row per loop iteration (rows are
// independent, so the result does not depend on the thread count). Per row: max, then
// e_j = exp(x_j - max) written in place while summing, then the gradient e_j / sum * dloss with
// dloss subtracted at the target. Padded columns [V, Vp) are never read and are set to 0.
#include "kernels/cpu/loss.h"

#include <emmintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

#include "kernels/cpu/softmax_row.h"
#include "kernels/cpu/vecmath.h"
#include "kernels/cpu/workspace.h"

MT_CPU_VARIANT_BEGIN

namespace {
void check_targets(const int32_t* targets, int64_t N, int64_t V, int64_t Vp, const char* fn) {
  if (V <= 0 || Vp < V) {
    throw std::invalid_argument(std::string("meshtrain: ") + fn + ": need 0 < V <= Vp (V=" +
                                std::to_string(V) + ", Vp=" + std::to_string(Vp) + ")");
  }
  for (int64_t n = 0; n < N; ++n) {
    if (targets[n] >= V) {
      throw std::out_of_range(std::string("meshtrain: ") + fn + ": target " +
                              std::to_string(targets[n]) + " at row " + std::to_string(n) +
                              " is outside the vocabulary of " + std::to_string(V));
    }
  }
}

// One row's max, exponentials (into e, which may be x itself) and loss; returns dloss / (sum of
// the exponentials).
float ce_row_exp(const float* x, float* e, float* loss, int32_t tgt, int64_t V, float dloss) {
  const float xt = x[tgt];  // before e (which may be x) is written
  const RowExp r = exp_row(x, e, V);
  *loss = std::log(r.sum) + r.max - xt;
  return dloss / r.sum;
}
}  // namespace

void softmax_cross_entropy(float* logits, float* losses, const int32_t* targets, int64_t N, int64_t V,
                           int64_t Vp, float dloss) {
  check_targets(targets, N, V, Vp, "softmax_cross_entropy");
#pragma omp parallel for schedule(static) if (N * Vp > detail::kParallelMin)
  for (int64_t n = 0; n < N; ++n) {
    float* x = logits + n * Vp;
    const int32_t tgt = targets[n];
    if (tgt < 0) {
      for (int64_t j = 0; j < Vp; ++j) x[j] = 0.0f;
      losses[n] = 0.0f;
      continue;
    }
    const float f = ce_row_exp(x, x, losses + n, tgt, V, dloss);
#pragma omp simd
    for (int64_t j = 0; j < V; ++j) x[j] *= f;
    x[tgt] -= dloss;
    for (int64_t j = V; j < Vp; ++j) x[j] = 0.0f;
  }
}

namespace {
constexpr int64_t kChunk = 64;  // values of a row the bf16 gradient converts at a time

// One chunk of the gradient (128 bytes) to memory without reading its lines first: they hold
// logits already consumed, so a plain store would fetch 128 bytes to overwrite them.
inline void stream_chunk(unsigned char* dst, const bf16* o) {
  static_assert(kChunk * sizeof(bf16) == 8 * sizeof(__m128i));
  for (int i = 0; i < 8; ++i)
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst) + i, _mm_loadu_si128(reinterpret_cast<const __m128i*>(o) + i));
}

void scale_to_bf16(bf16* o, const float* e, float f) {
#pragma omp simd
  for (int64_t i = 0; i < kChunk; ++i) o[i] = detail::to_bf16(e[i] * f);
}

}  // namespace

void softmax_cross_entropy_bf16(float* logits, float* losses, const int32_t* targets, int64_t N, int64_t V,
                                int64_t Vp, float dloss) {
  check_targets(targets, N, V, Vp, "softmax_cross_entropy_bf16");
  bf16* grad = reinterpret_cast<bf16*>(logits);  // [N, Vp], over the first half of the logits
  // A row's exponentials go to a per-thread buffer (it stays in cache; the logits are only read,
  // so no fp32 row is written back to memory), then its bf16 gradient to bytes [2 n Vp, 2 (n + 1)
  // Vp) of the logits: inside the storage of row n / 2 (row 0: its own, already read). Rows
  // therefore run in waves [1, 2), [2, 4), [4, 8), ...: each wave writes only over rows an earlier
  // wave has read, its own rows in parallel.
  auto row = [&](int64_t n) {
    const float* x = logits + n * Vp;
    unsigned char* g = reinterpret_cast<unsigned char*>(grad + n * Vp);
    const int32_t tgt = targets[n];
    if (tgt < 0) {
      std::memset(g, 0, static_cast<size_t>(Vp) * sizeof(bf16));
      losses[n] = 0.0f;
      return;
    }
    thread_local detail::Scratch scratch;
    float* e = scratch.as<float>(static_cast<size_t>(Vp));
    const float f = ce_row_exp(x, e, losses + n, tgt, V, dloss);
    std::fill(e + V, e + Vp, 0.0f);  // the padded columns' chunk reads defined values
    for (int64_t j0 = 0; j0 < Vp; j0 += kChunk) {
      const int64_t c = std::min(kChunk, Vp - j0);
      bf16 o[kChunk];
      if (c == kChunk)
        scale_to_bf16(o, e + j0, f);  // fixed trip count: vectorised
      else
        for (int64_t i = 0; i < c; ++i) o[i] = detail::to_bf16(e[j0 + i] * f);
      for (int64_t j = std::max(j0, V); j < j0 + c; ++j) o[j - j0] = bf16{0};  // padded columns
      if (tgt >= j0 && tgt < j0 + c) o[tgt - j0] = detail::to_bf16(e[tgt] * f - dloss);
      unsigned char* dst = g + j0 * static_cast<int64_t>(sizeof(bf16));
      if (c == kChunk && reinterpret_cast<uintptr_t>(dst) % 16 == 0)
        stream_chunk(dst, o);
      else
        std::memcpy(dst, o, static_cast<size_t>(c) * sizeof(bf16));
    }
    _mm_sfence();  // the streamed rows are seen by whichever thread reads them next
  };
  if (N > 0) row(0);
  for (int64_t lo = 1; lo < N; lo *= 2) {
    const int64_t hi = std::min(2 * lo, N);
#pragma omp parallel for schedule(static) if ((hi - lo) * Vp > detail::kParallelMin)
    for (int64_t n = lo; n < hi; ++n) row(n);
  }
}

void softmax_cross_entropy_forward(const float* logits, float* losses, const int32_t* targets,
                                   int64_t N, int64_t V, int64_t Vp) {
  check_targets(targets, N, V, Vp, "softmax_cross_entropy_forward");
#pragma omp parallel for schedule(static) if (N * Vp > detail::kParallelMin)
  for (int64_t n = 0; n < N; ++n) {
    const float* x = logits + n * Vp;
    const int32_t tgt = targets[n];
    if (tgt < 0) {
      losses[n] = 0.0f;
      continue;
    }
    const float m = row_max(x, V);
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t j = 0; j < V; ++j) s += detail::exp_f(x[j] - m);
    losses[n] = std::log(s) + m - x[tgt];
  }
}

void softmax_cross_entropy_from_bf16(bf16* logits, float* losses, const int32_t* targets, int64_t N, int64_t V,
                                     int64_t Vp, bool train, float dloss) {
  check_targets(targets, N, V, Vp, "softmax_cross_entropy_from_bf16");
  // Rows are independent and each is rewritten only within its own storage.
#pragma omp parallel for schedule(static) if (N * Vp > detail::kParallelMin)
  for (int64_t n = 0; n < N; ++n) {
    bf16* x = logits + n * Vp;
    const int32_t tgt = targets[n];
    if (tgt < 0) {
      if (train) std::memset(static_cast<void*>(x), 0, static_cast<size_t>(Vp) * sizeof(bf16));
      losses[n] = 0.0f;
      continue;
    }
    thread_local detail::Scratch scratch;
    float* e = scratch.as<float>(static_cast<size_t>(V));  // the widened row, then its exponentials
#pragma omp simd
    for (int64_t j = 0; j < V; ++j) e[j] = detail::from_bf16(x[j]);
    const float f = ce_row_exp(e, e, losses + n, tgt, V, dloss);
    if (!train) continue;
#pragma omp simd
    for (int64_t j = 0; j < V; ++j) x[j] = detail::to_bf16(e[j] * f);
    x[tgt] = detail::to_bf16(e[tgt] * f - dloss);
    for (int64_t j = V; j < Vp; ++j) x[j] = bf16{0};
  }
}

// The vocabulary-parallel loss (one rank's columns [lo, lo + valid) of every row) in the same
// float arithmetic as softmax_cross_entropy: on one rank holding the whole vocabulary the three
// passes give its bits. Vectorised like it (exp_f, simd reductions); rows in parallel.
void vp_ce_rowmax(float* rowmax, const float* lg, int64_t N, int64_t Vl, int64_t valid) {
#pragma omp parallel for schedule(static) if (N * Vl > detail::kParallelMin)
  for (int64_t n = 0; n < N; ++n) rowmax[n] = valid > 0 ? row_max(lg + n * Vl, valid) : -INFINITY;
}

void vp_ce_stats(float* stats, const float* lg, const float* rowmax, const int32_t* targets, int64_t N, int64_t Vl,
                 int64_t valid, int64_t lo) {
#pragma omp parallel for schedule(static) if (N * Vl > detail::kParallelMin)
  for (int64_t n = 0; n < N; ++n) {
    const float* x = lg + n * Vl;
    const float m = rowmax[n];
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t j = 0; j < valid; ++j) s += detail::exp_f(x[j] - m);
    stats[n] = s;
    const int64_t t = targets[n] - lo;
    stats[N + n] = (targets[n] >= 0 && t >= 0 && t < valid) ? x[t] : 0.0f;
  }
}

void vp_ce_finish(float* lg, float* losses, const float* rowmax, const float* stats, const int32_t* targets, int64_t N,
                  int64_t Vl, int64_t valid, int64_t lo, bool train, float dloss) {
#pragma omp parallel for schedule(static) if (N * Vl > detail::kParallelMin)
  for (int64_t n = 0; n < N; ++n) {
    const bool ignore = targets[n] < 0;
    losses[n] = ignore ? 0.0f : std::log(stats[n]) + rowmax[n] - stats[N + n];
    if (!train) continue;
    float* x = lg + n * Vl;
    if (ignore) {
      std::fill(x, x + Vl, 0.0f);
      continue;
    }
    const float m = rowmax[n], f = dloss / stats[n];
#pragma omp simd
    for (int64_t j = 0; j < valid; ++j) x[j] = detail::exp_f(x[j] - m) * f;
    const int64_t t = targets[n] - lo;
    if (t >= 0 && t < valid) x[t] -= dloss;
    std::fill(x + std::max<int64_t>(valid, 0), x + Vl, 0.0f);
  }
}

MT_CPU_VARIANT_END  // namespace mt::kernels::cpu
