// GEMM and linear layers on oneDNN (measured against OpenBLAS and BLIS: docs/bench-notes/gemm.md).
//
// fp32: dnnl_sgemm (row-major). On the measured shapes it is as fast as the f32 matmul primitive
// (both run the same jit GEMM) and needs no primitive cache.
// bf16: the oneDNN matmul primitive (bf16 src/weights, f32 dst, alpha as output scale, beta as a
// sum post-op), cached per (transposes, shape, alpha, beta). Where the CPU lacks native bf16
// arithmetic (AVX512_BF16 or AMX; oneDNN's emulation on plain AVX-512 is slower than widening, and
// on AVX2-only machines it refuses to create the primitive), or only a reference implementation
// exists, the inputs are widened to fp32 block by block into cached scratch and multiplied with
// sgemm: the same arithmetic (exact bf16 products, fp32 sums).
#include "kernels/cpu/gemm.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <oneapi/dnnl/dnnl.hpp>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>

#include "kernels/cpu/cpu_isa.h"
#include "kernels/cpu/gemm_internal.h"
#include "kernels/cpu/vecmath.h"
#include "kernels/cpu/workspace.h"

namespace mt::kernels::cpu {

namespace {

using detail::Scratch;

// C = beta * C for the degenerate cases (K == 0 or alpha == 0). beta == 0 writes zeros without
// reading C (BLAS semantics: C may hold NaN).
void scale_c(float* C, int64_t n, float beta) {
  if (beta == 1.0f) return;
  if (beta == 0.0f) {
#pragma omp parallel for simd schedule(static) if (n > detail::kParallelMin)
    for (int64_t i = 0; i < n; ++i) C[i] = 0.0f;
  } else {
#pragma omp parallel for simd schedule(static) if (n > detail::kParallelMin)
    for (int64_t i = 0; i < n; ++i) C[i] *= beta;
  }
}

// The ISA cap (MESHTRAIN_CPU_ISA) must reach oneDNN before its first GEMM.
inline void apply_isa_cap() {
  static const bool done = (active_isa(), true);
  (void)done;
}

void sgemm_raw(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
               int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  apply_isa_cap();
  dnnl_status_t st = dnnl_sgemm(ta ? 'T' : 'N', tb ? 'T' : 'N', M, N, K, alpha, A, lda, B, ldb,
                                beta, C, ldc);
  if (st != dnnl_success) {
    throw std::runtime_error("meshtrain: dnnl_sgemm failed (status " + std::to_string(st) +
                             ") for M=" + std::to_string(M) + " N=" + std::to_string(N) +
                             " K=" + std::to_string(K));
  }
}

// ---- bf16 through the oneDNN matmul primitive -------------------------------------------------

// The thread count is part of the key: a oneDNN primitive splits its work for the number of
// OpenMP threads there were when it was created, and keeps that split (a primitive made at 1
// thread and run at 2 uses one core).
// The leading dimensions are part of it too: the split GEMMs below address blocks of larger
// matrices.
// `bias`: an fp32 bias row [N] added by the primitive (the linear layer's forward), so that the
// output is written once instead of being filled with the bias first and read back (beta = 1).
struct Bf16Key {
  bool ta, tb;
  int64_t M, N, K;
  float alpha, beta;
  int threads;
  int64_t lda, ldb, ldc;
  bool bias = false;
  bool operator<(const Bf16Key& o) const {
    return std::tie(ta, tb, M, N, K, alpha, beta, threads, lda, ldb, ldc, bias) <
           std::tie(o.ta, o.tb, o.M, o.N, o.K, o.alpha, o.beta, o.threads, o.lda, o.ldb, o.ldc, o.bias);
  }
};

Bf16Key dense_key(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, float beta) {
  return Bf16Key{ta, tb, M, N, K, alpha, beta, omp_get_max_threads(), ta ? M : K, tb ? K : N, N};
}

struct Bf16Entry {
  bool native = false;  // false: use the widen-to-fp32 path
  dnnl::matmul prim;
  dnnl::memory::desc a_md, b_md, c_md, bias_md, scratch_md;
  size_t scratch_bytes = 0;
};

struct Bf16Cache {
  std::mutex mu;
  std::unique_ptr<dnnl::engine> eng;
  std::map<Bf16Key, std::shared_ptr<Bf16Entry>> entries;
  bool force_fallback = false;
};

Bf16Cache& bf16_cache() {
  static Bf16Cache* c = new Bf16Cache();  // never destroyed (kernels may run during teardown)
  return *c;
}

dnnl::engine& engine_locked(Bf16Cache& c) {
  if (!c.eng) c.eng = std::make_unique<dnnl::engine>(dnnl::engine::kind::cpu, 0);
  return *c.eng;
}

// Whether oneDNN's bf16 matmul may serve at all: native bf16 arithmetic (AVX512_BF16 or AMX) and
// no test forcing the widening path. Per shape it may still lack a primitive (bf16_entry).
bool bf16_native_possible() {
  apply_isa_cap();
  return !bf16_cache().force_fallback && active_isa() >= CpuIsa::AVX512_BF16;
}

// Whether the AMX tile GEMM (amx_gemm.cpp) serves bf16 GEMMs: ready on this CPU and no test
// forcing the widening path.
bool use_amx() { return detail::amx_gemm_ready() && !bf16_cache().force_fallback; }

std::shared_ptr<Bf16Entry> bf16_entry(const Bf16Key& k) {
  apply_isa_cap();
  Bf16Cache& c = bf16_cache();
  std::lock_guard<std::mutex> lk(c.mu);
  auto it = c.entries.find(k);
  if (it != c.entries.end()) return it->second;
  auto e = std::make_shared<Bf16Entry>();
  // Without AVX512_BF16 (or AMX) oneDNN can still build a bf16 matmul on AVX-512, emulating the
  // bf16 products; that runs at about half the rate of widening to fp32 + sgemm
  // (docs/benchmarks.md, "AMD EPYC Zen 4"): widen there.
  if (bf16_native_possible()) {
    using dt = dnnl::memory::data_type;
    using dims = dnnl::memory::dims;
    e->a_md = dnnl::memory::desc({k.M, k.K}, dt::bf16, k.ta ? dims{1, k.lda} : dims{k.lda, 1});
    e->b_md = dnnl::memory::desc({k.K, k.N}, dt::bf16, k.tb ? dims{1, k.ldb} : dims{k.ldb, 1});
    e->c_md = dnnl::memory::desc({k.M, k.N}, dt::f32, dims{k.ldc, 1});
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    if (k.alpha != 1.0f) attr.set_output_scales(0, {k.alpha});
    if (k.beta != 0.0f) {
      dnnl::post_ops po;
      po.append_sum(k.beta);
      attr.set_post_ops(po);
    }
    if (k.bias) e->bias_md = dnnl::memory::desc({1, k.N}, dt::f32, dims{k.N, 1});
    try {
      dnnl::matmul::primitive_desc pd(k.bias ? dnnl::matmul::desc(e->a_md, e->b_md, e->bias_md, e->c_md)
                                             : dnnl::matmul::desc(e->a_md, e->b_md, e->c_md),
                                      attr, engine_locked(c));
      std::string impl = pd.impl_info_str();
      if (impl.rfind("ref", 0) != 0) {  // a reference implementation is far slower than widening
        e->prim = dnnl::matmul(pd);
        e->scratch_md = pd.scratchpad_desc();
        e->scratch_bytes = e->scratch_md.get_size();
        e->native = true;
      }
    } catch (const dnnl::error&) {
      e->native = false;  // no bf16 support on this CPU
    }
  }
  c.entries.emplace(k, e);
  return e;
}

// Block sizes (in elements of one widened operand block) for the fallback path.
int64_t g_fallback_block_elems = int64_t(4) << 20;

// Widen rows [r0, r0+R) x cols [c0, c0+Cn) of a row-major bf16 matrix with leading dimension ld
// into a packed fp32 [R, Cn] block.
void widen_block(float* dst, const bf16* src, int64_t ld, int64_t r0, int64_t R, int64_t c0,
                 int64_t Cn) {
#pragma omp parallel for schedule(static) if (R * Cn > detail::kParallelMin)
  for (int64_t r = 0; r < R; ++r) {
    const bf16* sr = src + (r0 + r) * ld + c0;
    float* dr = dst + r * Cn;
#pragma omp simd
    for (int64_t c = 0; c < Cn; ++c) dr[c] = detail::from_bf16(sr[c]);
  }
}

void gemm_bf16_widened(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const bf16* A,
                       int64_t lda, const bf16* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  thread_local Scratch sa, sb;
  const int64_t lim = std::max<int64_t>(g_fallback_block_elems, 1);
  // Prefer one block along M and N; split K only when a full-K block of the smaller side would
  // not fit.
  int64_t kb = K;
  int64_t minside = std::min(M, N);
  if (minside * kb > lim) kb = std::max<int64_t>(1, lim / std::max<int64_t>(minside, 1));
  int64_t mb = std::max<int64_t>(1, std::min(M, lim / kb));
  int64_t nb = std::max<int64_t>(1, std::min(N, lim / kb));
  float* wa = sa.as<float>(static_cast<size_t>(mb * kb));
  float* wb = sb.as<float>(static_cast<size_t>(kb * nb));
  for (int64_t k0 = 0; k0 < K; k0 += kb) {
    const int64_t kl = std::min(kb, K - k0);
    const float bk = (k0 == 0) ? beta : 1.0f;
    for (int64_t n0 = 0; n0 < N; n0 += nb) {
      const int64_t nl = std::min(nb, N - n0);
      // op(B) block rows k0.., cols n0..: stored [K,N] (rows k) or [N,K] (rows n).
      if (tb) widen_block(wb, B, ldb, n0, nl, k0, kl);  // packed [nl, kl]
      else widen_block(wb, B, ldb, k0, kl, n0, nl);     // packed [kl, nl]
      for (int64_t m0 = 0; m0 < M; m0 += mb) {
        const int64_t ml = std::min(mb, M - m0);
        if (ta) widen_block(wa, A, lda, k0, kl, m0, ml);  // packed [kl, ml]
        else widen_block(wa, A, lda, m0, ml, k0, kl);     // packed [ml, kl]
        sgemm_raw(ta, tb, ml, nl, kl, alpha, wa, ta ? ml : kl, wb, tb ? kl : nl, bk,
                  C + m0 * ldc + n0, ldc);
      }
    }
  }
}

// dbias[o] += sum_n dout[n, o], blocks of columns per thread, rows in order (deterministic).
// With dout16, dout's bf16 copy is written in the same pass (the bf16 linear backward).
void bias_backward(float* dbias, const float* dout, int64_t N, int64_t OC, bf16* dout16 = nullptr) {
  constexpr int64_t kCb = 64;
  const int64_t nblk = (OC + kCb - 1) / kCb;
#pragma omp parallel for schedule(static) if (N * OC > detail::kParallelMin)
  for (int64_t blk = 0; blk < nblk; ++blk) {
    const int64_t c0 = blk * kCb;
    const int64_t cl = std::min(kCb, OC - c0);
    float acc[kCb] = {};
    for (int64_t n = 0; n < N; ++n) {
      const float* row = dout + n * OC + c0;
      if (dout16) {
        bf16* o = dout16 + n * OC + c0;
#pragma omp simd
        for (int64_t c = 0; c < cl; ++c) {
          acc[c] += row[c];
          o[c] = detail::to_bf16(row[c]);
        }
      } else {
#pragma omp simd
        for (int64_t c = 0; c < cl; ++c) acc[c] += row[c];
      }
    }
    for (int64_t c = 0; c < cl; ++c) dbias[c0 + c] += acc[c];
  }
}

// out[n, :] = bias (so the GEMM can add with beta = 1).
void broadcast_bias(float* out, const float* bias, int64_t N, int64_t OC) {
#pragma omp parallel for schedule(static) if (N * OC > detail::kParallelMin)
  for (int64_t n = 0; n < N; ++n) std::copy(bias, bias + OC, out + n * OC);
}

// The oneDNN primitive of an entry on these operands (and the bias row when the entry has one).
void execute_bf16(const Bf16Entry& e, const bf16* A, const bf16* B, float* C, const float* bias) {
  thread_local std::unique_ptr<dnnl::stream> strm;
  thread_local Scratch scratch;
  dnnl::engine& eng = [] () -> dnnl::engine& {
    Bf16Cache& c = bf16_cache();
    std::lock_guard<std::mutex> lk(c.mu);
    return engine_locked(c);
  }();
  if (!strm) strm = std::make_unique<dnnl::stream>(eng);
  dnnl::memory am(e.a_md, eng, const_cast<bf16*>(A));
  dnnl::memory bm(e.b_md, eng, const_cast<bf16*>(B));
  dnnl::memory cm(e.c_md, eng, C);
  std::unordered_map<int, dnnl::memory> args = {
      {DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bm}, {DNNL_ARG_DST, cm}};
  if (bias) args.emplace(DNNL_ARG_BIAS, dnnl::memory(e.bias_md, eng, const_cast<float*>(bias)));
  if (e.scratch_bytes > 0) {
    dnnl::memory sm(e.scratch_md, eng, scratch.get(e.scratch_bytes));
    args.emplace(DNNL_ARG_SCRATCHPAD, sm);
  }
  e.prim.execute(*strm, args);
  strm->wait();
}

// One oneDNN bf16 matmul on (possibly strided) blocks: C = alpha op(A) op(B) + beta C.
void run_bf16_native(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const bf16* A,
                     int64_t lda, const bf16* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  std::shared_ptr<Bf16Entry> e =
      bf16_entry(Bf16Key{ta, tb, M, N, K, alpha, beta, omp_get_max_threads(), lda, ldb, ldc});
  if (!e->native) {  // no primitive for this block's strides: the same arithmetic by widening
    gemm_bf16_widened(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    return;
  }
  execute_bf16(*e, A, B, C, nullptr);
}

// Splitting large bf16 GEMMs (the LM head: one dimension is the vocabulary). oneDNN 2.6's matmul
// runs them at half the block layers' rate or less (bench/kernel_bench; figures in docs/cpu.md,
// "Large GEMMs: the LM head in bf16"):
//   dinp (K = vocabulary) in K chunks of 4096 accumulated into C;
//   forward (N = vocabulary) in N chunks of 4096 computed into a contiguous block and copied out
//   (writing through a strided destination is the slow part).
// dW (M = vocabulary) stays whole: chunks of M ran slower than the whole.
// At AVX512_BF16 without AMX the splits gain nothing and cost nothing.
// The chunks depend on the shape only, never on the thread count, so results stay bit-identical
// across thread counts; the K split adds fp32 partial sums to C in chunk order.
struct SplitLimits {
  int64_t min_dim = 16384;  // K or N splits from this size on
  int64_t k_chunk = 4096, n_chunk = 4096;
};
SplitLimits g_split;

void gemm_bf16_split(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const bf16* A,
                     int64_t lda, const bf16* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  const SplitLimits& L = g_split;
  if (K >= L.min_dim && K > L.k_chunk) {
    for (int64_t k0 = 0; k0 < K; k0 += L.k_chunk) {
      const int64_t kc = std::min(L.k_chunk, K - k0);
      gemm_bf16_split(ta, tb, M, N, kc, alpha, ta ? A + k0 * lda : A + k0, lda, tb ? B + k0 : B + k0 * ldb, ldb,
                      k0 == 0 ? beta : 1.0f, C, ldc);
    }
    return;
  }
  if (N >= L.min_dim && N > L.n_chunk) {
    thread_local Scratch blk;
    for (int64_t n0 = 0; n0 < N; n0 += L.n_chunk) {
      const int64_t nc = std::min(L.n_chunk, N - n0);
      float* t = blk.as<float>(static_cast<size_t>(M * nc));
      run_bf16_native(ta, tb, M, nc, K, alpha, A, lda, tb ? B + n0 * ldb : B + n0, ldb, 0.0f, t, nc);
#pragma omp parallel for schedule(static) if (M * nc > detail::kParallelMin)
      for (int64_t m = 0; m < M; ++m) {
        float* c = C + m * ldc + n0;
        const float* r = t + m * nc;
        if (beta == 0.0f) {
          std::copy(r, r + nc, c);
        } else {
#pragma omp simd
          for (int64_t j = 0; j < nc; ++j) c[j] = r[j] + beta * c[j];
        }
      }
    }
    return;
  }
  run_bf16_native(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

}  // namespace

namespace detail {
void set_bf16_fallback_block_elems(int64_t elems) { g_fallback_block_elems = elems; }
void set_bf16_force_fallback(bool force) {
  Bf16Cache& c = bf16_cache();
  std::lock_guard<std::mutex> lk(c.mu);
  c.force_fallback = force;
  c.entries.clear();
}
bool bf16_gemm_is_native(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha,
                         float beta) {
  return bf16_entry(dense_key(ta, tb, M, N, K, alpha, beta))->native;
}
void set_bf16_split(int64_t min_dim, int64_t k_chunk, int64_t n_chunk) {
  g_split = SplitLimits{min_dim, k_chunk, n_chunk};
}
void sgemm_strided(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
                   int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if (M <= 0 || N <= 0) return;
  if (K <= 0 || alpha == 0.0f) {
    for (int64_t m = 0; m < M; ++m) {
      float* row = C + m * ldc;
      for (int64_t n = 0; n < N; ++n) row[n] = beta == 0.0f ? 0.0f : beta * row[n];
    }
    return;
  }
  sgemm_raw(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}
}  // namespace detail

void gemm_f32(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
              const float* B, float beta, float* C) {
  if (M <= 0 || N <= 0) return;
  if (K <= 0 || alpha == 0.0f) {
    scale_c(C, M * N, beta);
    return;
  }
  const int64_t lda = ta ? M : K, ldb = tb ? K : N;
  // A vocabulary-sized K (the LM head's input gradient) in chunks accumulated into C, as the bf16
  // GEMMs do: sgemm runs it faster in chunks of 4096 than whole (docs/cpu.md, "The bf16 step
  // without its extra passes"). The chunks depend on the shape only.
  const SplitLimits& L = g_split;
  if (K >= L.min_dim && K > L.k_chunk) {
    for (int64_t k0 = 0; k0 < K; k0 += L.k_chunk)
      sgemm_raw(ta, tb, M, N, std::min(L.k_chunk, K - k0), alpha, ta ? A + k0 * lda : A + k0, lda,
                tb ? B + k0 : B + k0 * ldb, ldb, k0 == 0 ? beta : 1.0f, C, N);
    return;
  }
  sgemm_raw(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, N);
}

void gemm_bf16(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const bf16* A,
               const bf16* B, float beta, float* C) {
  if (M <= 0 || N <= 0) return;
  if (K <= 0 || alpha == 0.0f) {
    scale_c(C, M * N, beta);
    return;
  }
  // AMX tiles, except where the vocabulary is K or M (the LM head's input and weight gradients):
  // there oneDNN's matmul measured as fast or faster (docs/cpu.md, "bf16 GEMMs on AMX tiles").
  if (use_amx() && K < g_split.min_dim && !(ta && M >= g_split.min_dim)) {
    detail::amx_gemm_bf16(ta, tb, M, N, K, alpha, A, ta ? M : K, B, tb ? K : N, beta, C, N, nullptr);
    return;
  }
  if (!bf16_native_possible()) {
    gemm_bf16_widened(ta, tb, M, N, K, alpha, A, ta ? M : K, B, tb ? K : N, beta, C, N);
    return;
  }
  // Each block looks up (or builds) its own primitive and widens where none exists.
  gemm_bf16_split(ta, tb, M, N, K, alpha, A, ta ? M : K, B, tb ? K : N, beta, C, N);
}

void linear_forward(float* out, const float* inp, const float* W, const float* bias, int64_t N,
                    int64_t C, int64_t OC) {
  if (bias) broadcast_bias(out, bias, N, OC);
  gemm_f32(false, true, N, OC, C, 1.0f, inp, W, bias ? 1.0f : 0.0f, out);
}

void linear_backward(float* dinp, float* dW, float* dbias, const float* dout, const float* inp,
                     const float* W, int64_t N, int64_t C, int64_t OC) {
  if (dinp) gemm_f32(false, false, N, C, OC, 1.0f, dout, W, 1.0f, dinp);
  if (dW) gemm_f32(true, false, OC, C, N, 1.0f, dout, inp, 1.0f, dW);
  if (dbias) bias_backward(dbias, dout, N, OC);
}

void linear_forward_bf16(float* out, const bf16* inp, const bf16* W, const float* bias, int64_t N,
                         int64_t C, int64_t OC) {
  const bool fuse_bias = bias && N > 0 && OC > 0 && C > 0;
  if (fuse_bias && use_amx()) {  // bias added in the epilogue
    detail::amx_gemm_bf16(false, true, N, OC, C, 1.0f, inp, C, W, C, 0.0f, out, OC, bias);
    return;
  }
  // The bias added by the primitive when there is one for it (out written once; the same sums:
  // the products' total plus the bias). Shapes the split path handles keep the broadcast.
  if (fuse_bias && bf16_native_possible() && OC < g_split.min_dim && C < g_split.min_dim) {
    Bf16Key k = dense_key(false, true, N, OC, C, 1.0f, 0.0f);
    k.bias = true;
    const std::shared_ptr<Bf16Entry> e = bf16_entry(k);
    if (e->native) {
      execute_bf16(*e, inp, W, out, bias);
      return;
    }
  }
  if (bias) broadcast_bias(out, bias, N, OC);
  gemm_bf16(false, true, N, OC, C, 1.0f, inp, W, bias ? 1.0f : 0.0f, out);
}

void linear_forward_bf16_out16(bf16* out, const bf16* inp, const bf16* W, const float* bias, int64_t N, int64_t C,
                               int64_t OC) {
  thread_local Scratch s;
  const int64_t n = N * OC;
  float* y = s.as<float>(static_cast<size_t>(n));
  linear_forward_bf16(y, inp, W, bias, N, C, OC);
#pragma omp parallel for simd schedule(static) if (n > detail::kParallelMin)
  for (int64_t i = 0; i < n; ++i) out[i] = detail::to_bf16(y[i]);
}

void linear_backward_bf16(float* dinp, float* dW, float* dbias, const float* dout, const bf16* inp,
                          const bf16* W, int64_t N, int64_t C, int64_t OC) {
  if (!dinp && !dW) {
    if (dbias) bias_backward(dbias, dout, N, OC);
    return;
  }
  thread_local Scratch s;
  const int64_t n = N * OC;
  bf16* d16 = s.as<bf16>(static_cast<size_t>(n));
  if (dbias) {
    bias_backward(dbias, dout, N, OC, d16);  // the bf16 copy and the bias gradient in one read of dout
  } else {
#pragma omp parallel for simd schedule(static) if (n > detail::kParallelMin)
    for (int64_t i = 0; i < n; ++i) d16[i] = detail::to_bf16(dout[i]);
  }
  linear_backward_bf16_dy(dinp, dW, d16, inp, W, N, C, OC);
}

void linear_backward_bf16_dy(float* dinp, float* dW, const bf16* dout, const bf16* inp, const bf16* W,
                             int64_t N, int64_t C, int64_t OC) {
  if (dinp) gemm_bf16(false, false, N, C, OC, 1.0f, dout, W, 1.0f, dinp);
  if (dW) gemm_bf16(true, false, OC, C, N, 1.0f, dout, inp, 1.0f, dW);
}


namespace {
constexpr float kGeluK = 0.7978845608028654f;  // sqrt(2/pi), as gelu_forward
constexpr float kGeluC = 0.044715f;
float gelu_of(float x) {
  const float u = kGeluK * (x + kGeluC * x * x * x);
  return x / (1.0f + std::exp(-2.0f * u));
}
float dgelu_of(float x) {
  const float u = kGeluK * (x + kGeluC * x * x * x);
  const float s = 1.0f / (1.0f + std::exp(-2.0f * u));
  const float du = kGeluK * (1.0f + 3.0f * kGeluC * x * x);
  return s + x * 2.0f * s * (1.0f - s) * du;
}
}  // namespace

void linear_gelu_forward_bf16(bf16* act, bf16* pre, const bf16* inp, const bf16* W, const float* bias, int64_t N,
                              int64_t C, int64_t OC) {
  thread_local Scratch s;
  const int64_t n = N * OC;
  float* y = s.as<float>(static_cast<size_t>(n));
  linear_forward_bf16(y, inp, W, bias, N, C, OC);
#pragma omp parallel for schedule(static) if (n > detail::kParallelMin)
  for (int64_t i = 0; i < n; ++i) {
    pre[i] = detail::to_bf16(y[i]);
    act[i] = detail::to_bf16(gelu_of(y[i]));
  }
}

void linear_backward_dgelu_bf16(bf16* dpre, float* dW, float* dbias, const float* dout, const bf16* inp,
                                const bf16* W, const bf16* pre, int64_t N, int64_t C, int64_t OC) {
  thread_local Scratch s16, sd;
  const int64_t n = N * OC;
  bf16* d16 = s16.as<bf16>(static_cast<size_t>(n));
  if (dbias) {
    bias_backward(dbias, dout, N, OC, d16);
  } else {
#pragma omp parallel for simd schedule(static) if (n > detail::kParallelMin)
    for (int64_t i = 0; i < n; ++i) d16[i] = detail::to_bf16(dout[i]);
  }
  if (dW) gemm_bf16(true, false, OC, C, N, 1.0f, d16, inp, 1.0f, dW);
  if (!dpre) return;
  const int64_t m = N * C;
  float* dx = sd.as<float>(static_cast<size_t>(m));
  gemm_bf16(false, false, N, C, OC, 1.0f, d16, W, 0.0f, dx);
#pragma omp parallel for schedule(static) if (m > detail::kParallelMin)
  for (int64_t i = 0; i < m; ++i) dpre[i] = detail::to_bf16(dx[i] * dgelu_of(bf16_to_float(pre[i])));
}

void linear_backward_bf16_dy_bias(float* dinp, float* dW, float* dbias, const bf16* dout, const bf16* inp,
                                  const bf16* W, int64_t N, int64_t C, int64_t OC) {
  linear_backward_bf16_dy(dinp, dW, dout, inp, W, N, C, OC);
  if (!dbias) return;
#pragma omp parallel for schedule(static) if (N * OC > detail::kParallelMin)
  for (int64_t o = 0; o < OC; ++o) {
    float acc = 0.0f;
    for (int64_t r = 0; r < N; ++r) acc += bf16_to_float(dout[r * OC + o]);
    dbias[o] += acc;
  }
}

}  // namespace mt::kernels::cpu
