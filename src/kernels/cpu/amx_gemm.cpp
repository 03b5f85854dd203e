// bf16 GEMM on AMX tiles (Intel Sapphire Rapids and newer): meshtrain's own, because oneDNN 2.6's
// matmul runs the model's forward and input-gradient shapes slower on AMX Xeons
// (docs/cpu.md, "bf16 GEMMs on AMX tiles", and docs/benchmarks.md).
//
// C[M,N] = alpha * op(A) @ op(B) + beta * C (+ bias[n] on every row), bf16 inputs, fp32 sums and
// output, row-major with leading dimensions.
//
// How it works. A tile register holds 16 rows of 64 bytes. TDPBF16PS multiplies a 16 x 32 bf16
// tile of A by a 32 x 16 tile of B held in pairs ("VNNI": row kk holds B[2kk][n], B[2kk+1][n]
// next to each other for the 16 columns) and adds the 16 x 16 products into an fp32 tile. The
// micro-kernel keeps a 32 x 32 block of C in four tiles, loads two A and two B tiles per step of
// 32 along K, and issues four multiplies; the block is stored once, after its whole K, into a
// buffer from which an AVX-512 epilogue applies alpha, beta and the bias. (Storing the tiles
// straight into C, and starting them from C or the bias, measured slower.) An output with beta = 0
// far larger than the caches (the LM head's logits) is written with streaming stores, so its old
// lines are not fetched only to be overwritten.
//   - op(B) is packed in panels of 32 columns, two VNNI sub-panels each (one per tile): pairs of
//     rows interleaved when op(B) = B, a 16 x 16 transpose of 32-bit pairs when op(B) = B^T (the
//     forward's W^T). All threads pack every panel up front, unless each group of panels has one
//     unit of work (a vocabulary-sized N): then that unit packs its group.
//   - A is used in place when it is row-major with K and M multiples of 32; otherwise each block
//     of 32 rows is copied into a padded row-major buffer (transposed when op(A) = A^T: the weight
//     gradient's dout^T), once for all groups when A is small.
//   - Panels are swept in groups sized to stay in L2; work units are (group, chunk of rows),
//     handed out by an atomic counter so that a slower core takes fewer. A unit's result does not
//     depend on which thread runs it, so the output is bit-identical on any number of threads.
//   - Each element's K sum runs 32 at a time in the tile unit's order; when neither op(B) nor A
//     fits in L2, K runs in chunks whose sums are added to C in order. The chunks depend on the
//     shape only.
//
// Everything that executes AMX or AVX-512 instructions is in the namespace amx_avx512 and runs
// only after detail::amx_gemm_ready() (run-time check of the CPU, the ISA cap and the kernel's
// permission for the tile state); tests/kernels/isa_test.cpp checks the binary for that.
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <string_view>

#include "kernels/cpu/avx512_transpose.h"
#include "kernels/cpu/cpu_isa.h"
#include "kernels/cpu/gemm_internal.h"
#include "kernels/cpu/workspace.h"
#include "runtime/dtype.h"

namespace mt::kernels::cpu::amx_avx512 {
namespace {

constexpr int64_t kPanel = 32;     // columns of C per panel (two tiles)
constexpr int64_t kBlockM = 32;    // rows of C per micro-kernel block (two tiles)
constexpr int64_t kL2Bytes = int64_t(3) << 19;  // packed op(B) kept in L2 (1.5 MiB of the 2 MiB)
constexpr int64_t kMinChunkK = 512;             // shortest K chunk (each costs a pass over C)
constexpr int64_t kStepK = 32;     // K per tile multiply
constexpr int64_t kStreamBytes = int64_t(32) << 20;  // outputs from this size on bypass the caches

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

}  // namespace

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,amx-tile,amx-bf16")
// GCC 12's AVX-512 intrinsic headers start some results from `__m512i __Y = __Y;`, which
// -Wmaybe-uninitialized reports once inlined here (a false positive).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

namespace {

void load_tile_config() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
}

using avx512_util::transpose16;

// 32 bf16 (64 bytes) of a row starting at element k of [0, K): zeros past K.
inline __m512i load_row32(const bf16* row, int64_t k, int64_t K) {
  const int64_t n = K - k;
  if (n >= 32) return _mm512_loadu_si512(row + k);
  if (n <= 0) return _mm512_setzero_si512();
  return _mm512_maskz_loadu_epi16(static_cast<__mmask32>((uint64_t(1) << n) - 1), row + k);
}

// Rows r0 and r1 (32 bf16 each) interleaved element by element: the first 16 pairs (lo) and the
// last 16 (hi), one 32-bit pair per column.
inline __m512i interleave_lo(__m512i r0, __m512i r1) {
  const __m512i idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37,
                                       5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  return _mm512_permutex2var_epi16(r0, idx, r1);
}
inline __m512i interleave_hi(__m512i r0, __m512i r1) {
  const __m512i idx = _mm512_set_epi16(63, 31, 62, 30, 61, 29, 60, 28, 59, 27, 58, 26, 57, 25, 56, 24, 55, 23, 54, 22,
                                       53, 21, 52, 20, 51, 19, 50, 18, 49, 17, 48, 16);
  return _mm512_permutex2var_epi16(r0, idx, r1);
}

// 16 rows of src (r0 .. r0+15 of [0, R), stride ld), 32 elements each from k0 on (of [0, K)), seen
// as 16 pairs of K-consecutive elements, transposed: out[j * out_ld + i] (32-bit) = pair j of row
// r0 + i. Zeros past R and K.
inline void transpose_pairs16(const bf16* src, int64_t ld, int64_t r0, int64_t R, int64_t k0, int64_t K,
                              uint32_t* out, int64_t out_ld) {
  __m512i v[16];
  for (int i = 0; i < 16; ++i)
    v[i] = r0 + i < R ? load_row32(src + (r0 + i) * ld, k0, K) : _mm512_setzero_si512();
  transpose16(v);
  for (int j = 0; j < 16; ++j) _mm512_storeu_si512(out + j * out_ld, v[j]);
}

// Rows m0 .. m0+rows-1 of op(A) (rows a multiple of 32), K elements from k0 on (of [0, K)), into
// Ap[rows][Kp] row-major, zero padded past M and past K.
void pack_a_block(bool ta, const bf16* A, int64_t ld, int64_t M, int64_t K, int64_t m0, int64_t rows, int64_t k0,
                  int64_t Kp, bf16* Ap) {
  if (!ta) {
    for (int64_t r = 0; r < rows; ++r) {
      bf16* dst = Ap + r * Kp;
      const int64_t m = m0 + r;
      for (int64_t k = 0; k < Kp; k += 32)
        _mm512_storeu_si512(dst + k, m < M ? load_row32(A + m * ld, k0 + k, K) : _mm512_setzero_si512());
    }
    return;
  }
  // op(A) = A^T, A stored [K][M]: for 32 columns of A at a time, interleave pairs of A's rows
  // (each row's 64 bytes loaded once), then transpose 16 x 16 pairs twice.
  for (int64_t r0 = 0; r0 < rows; r0 += 32)
    for (int64_t k = 0; k < Kp; k += 32) {
      __m512i lo[16], hi[16];
      for (int j = 0; j < 16; ++j) {
        const int64_t kr = k0 + k + 2 * j;
        const __m512i a0 = kr < K ? load_row32(A + kr * ld, m0 + r0, M) : _mm512_setzero_si512();
        const __m512i a1 = kr + 1 < K ? load_row32(A + (kr + 1) * ld, m0 + r0, M) : _mm512_setzero_si512();
        lo[j] = interleave_lo(a0, a1);
        hi[j] = interleave_hi(a0, a1);
      }
      transpose16(lo);  // lo[i] = the 16 pairs of row m0 + r0 + i
      transpose16(hi);  // hi[i] = those of row m0 + r0 + 16 + i
      for (int i = 0; i < 16; ++i) {
        _mm512_storeu_si512(Ap + (r0 + i) * Kp + k, lo[i]);
        _mm512_storeu_si512(Ap + (r0 + 16 + i) * Kp + k, hi[i]);
      }
    }
}

// One panel (columns n0 .. n0+31 of op(B)) into two VNNI sub-panels of Kp/2 rows x 64 bytes each,
// `sub` elements apart: dst[t * sub + kk * 32 + 2 * c + j] = op(B)[2kk + j][n0 + 16t + c].
void pack_b_panel(bool tb, const bf16* B, int64_t ldb, int64_t N, int64_t K, int64_t k0, int64_t Kp, int64_t n0,
                  bf16* dst, int64_t sub) {
  if (tb) {  // B stored [N][K]: the pairs are contiguous; transpose 16 columns x 16 pairs
    for (int t = 0; t < 2; ++t)
      for (int64_t k = 0; k < Kp; k += 32)
        transpose_pairs16(B, ldb, n0 + 16 * t, N, k0 + k, K, reinterpret_cast<uint32_t*>(dst + t * sub + k * 16), 16);
    return;
  }
  // B stored [K][N]: interleave rows 2kk and 2kk+1.
  for (int64_t kk = 0; kk < Kp / 2; ++kk) {
    const int64_t k = k0 + 2 * kk;
    const __m512i r0 = k < K ? load_row32(B + k * ldb, n0, N) : _mm512_setzero_si512();
    const __m512i r1 = k + 1 < K ? load_row32(B + (k + 1) * ldb, n0, N) : _mm512_setzero_si512();
    _mm512_storeu_si512(dst + kk * 32, interleave_lo(r0, r1));
    _mm512_storeu_si512(dst + sub + kk * 32, interleave_hi(r0, r1));
  }
}

// The 32 x 32 block of C at (m0, n0) into cbuf (row stride 32 floats).
inline void micro_kernel(const bf16* Ap, int64_t lda, int64_t Kp, const bf16* P0, const bf16* P1, float* cbuf) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const bf16* a0 = Ap;
  const bf16* a1 = Ap + 16 * lda;
  const int64_t stride = lda * static_cast<int64_t>(sizeof(bf16));
  for (int64_t k = 0; k < Kp; k += kStepK) {
    _tile_loadd(4, a0 + k, stride);
    _tile_loadd(6, P0 + k * 16, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, P1 + k * 16, 64);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(5, a1 + k, stride);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, cbuf, 128);
  _tile_stored(1, cbuf + 16, 128);
  _tile_stored(2, cbuf + 16 * 32, 128);
  _tile_stored(3, cbuf + 16 * 32 + 16, 128);
}

// C block (rows m0.., columns n0..) = alpha * cbuf + beta * C (+ bias), rows < rows, columns < cols.
// stream: whole 64-byte-aligned rows go to memory without their lines being read first (beta = 0).
inline void epilogue(const float* cbuf, int64_t rows, int64_t cols, float alpha, float beta, const float* bias,
                     float* C, int64_t ldc, bool stream) {
  const __mmask16 m0 = cols >= 16 ? __mmask16(0xffff) : __mmask16((1u << cols) - 1);
  const __mmask16 m1 = cols >= 32 ? __mmask16(0xffff) : cols <= 16 ? __mmask16(0) : __mmask16((1u << (cols - 16)) - 1);
  const __m512 va = _mm512_set1_ps(alpha), vb = _mm512_set1_ps(beta);
  const __m512 b0 = bias ? _mm512_maskz_loadu_ps(m0, bias) : _mm512_setzero_ps();
  const __m512 b1 = bias ? _mm512_maskz_loadu_ps(m1, bias + 16) : _mm512_setzero_ps();
  for (int64_t r = 0; r < rows; ++r) {
    float* c = C + r * ldc;
    __m512 x0 = _mm512_load_ps(cbuf + r * 32), x1 = _mm512_load_ps(cbuf + r * 32 + 16);
    if (alpha != 1.0f) {
      x0 = _mm512_mul_ps(x0, va);
      x1 = _mm512_mul_ps(x1, va);
    }
    if (beta != 0.0f) {
      x0 = _mm512_fmadd_ps(vb, _mm512_maskz_loadu_ps(m0, c), x0);
      x1 = _mm512_fmadd_ps(vb, _mm512_maskz_loadu_ps(m1, c + 16), x1);
    }
    if (bias) {
      x0 = _mm512_add_ps(x0, b0);
      x1 = _mm512_add_ps(x1, b1);
    }
    if (stream && cols == 32 && reinterpret_cast<uintptr_t>(c) % 64 == 0) {
      _mm512_stream_ps(c, x0);
      _mm512_stream_ps(c + 16, x1);
    } else {
      _mm512_mask_storeu_ps(c, m0, x0);
      _mm512_mask_storeu_ps(c + 16, m1, x1);
    }
  }
}

// One K chunk: C = alpha op(A) op(B) [k0, k0 + kc) + beta C (+ bias).
void gemm_chunk(bool ta, bool tb, int64_t M, int64_t N, int64_t K, int64_t k0, int64_t kc, float alpha,
                const bf16* A, int64_t lda, const bf16* B, int64_t ldb, float beta, float* C, int64_t ldc,
                const float* bias) {
  const int64_t Kp = round_up(kc, kStepK), Kend = k0 + kc;
  const int nth = omp_in_parallel() ? 1 : omp_get_max_threads();
  const int64_t npanels = (N + kPanel - 1) / kPanel, mblocks = (M + kBlockM - 1) / kBlockM;
  const int64_t sub = Kp * 16;  // elements per VNNI sub-panel; a panel is two
  // Panels in groups that stay in L2 (kL2Bytes) while a block of rows sweeps them; all of them in
  // one group when they fit, so that A streams through once.
  const int64_t panel_bytes = Kp * 64;
  const int64_t group = npanels * panel_bytes <= kL2Bytes
                            ? npanels
                            : std::clamp<int64_t>(kL2Bytes / panel_bytes, 1, npanels);
  const int64_t ngroups = (npanels + group - 1) / group;
  // Rows in chunks so that each thread gets several units (the counter lets a slower core take
  // fewer). Units run group by group, so a group's panels are reused by every chunk of rows.
  const int64_t mchunks = std::clamp<int64_t>((8 * nth + ngroups - 1) / ngroups, 1, mblocks);
  const int64_t blocks_per_chunk = (mblocks + mchunks - 1) / mchunks;
  const int64_t nchunks = (mblocks + blocks_per_chunk - 1) / blocks_per_chunk;
  const int64_t units = ngroups * nchunks;
  // op(B): when each group has one unit (a vocabulary-sized N) that unit packs it; otherwise all
  // threads pack every panel once, up front.
  const bool b_per_unit = nchunks == 1 && ngroups > 1;
  static thread_local detail::Scratch b_scratch;
  bf16* bp = nullptr;
  if (!b_per_unit) {
    bp = b_scratch.as<bf16>(static_cast<size_t>(npanels * 2 * sub));
#pragma omp parallel for schedule(static) num_threads(nth) if (nth > 1 && npanels > 1)
    for (int64_t p = 0; p < npanels; ++p) pack_b_panel(tb, B, ldb, N, Kend, k0, Kp, p * kPanel, bp + p * 2 * sub, sub);
  }
  // A: in place when it is row-major with whole steps of K; else copied (transposed for
  // op(A) = A^T) into a padded buffer, once up front when it is small, otherwise per block of rows
  // while the block sweeps its group's panels.
  const int64_t Mp = mblocks * kBlockM;
  const bool a_in_place = !ta && kc % kStepK == 0 && M % kBlockM == 0;
  const bool a_once = !a_in_place && ngroups > 1 && Mp * Kp * 2 <= 2 * kL2Bytes;
  static thread_local detail::Scratch a_all_scratch;
  bf16* a_all = nullptr;
  if (a_once) {
    a_all = a_all_scratch.as<bf16>(static_cast<size_t>(Mp * Kp));
#pragma omp parallel for schedule(static) num_threads(nth) if (nth > 1 && mblocks > 1)
    for (int64_t mb = 0; mb < mblocks; ++mb)
      pack_a_block(ta, A, lda, M, Kend, mb * kBlockM, kBlockM, k0, Kp, a_all + mb * kBlockM * Kp);
  }
  // An output far larger than the caches (the LM head's logits) is written without reading it:
  // with beta = 0 its old lines are never needed, and fetching them costs as much as the write.
  const bool stream_c = beta == 0.0f && M * N * int64_t(sizeof(float)) > kStreamBytes;
  std::atomic<int64_t> next{0};
#pragma omp parallel num_threads(nth) if (nth > 1 && units > 1)
  {
    static thread_local detail::Scratch a_scratch, g_scratch;
    bf16* ap = a_in_place || a_once ? nullptr : a_scratch.as<bf16>(static_cast<size_t>(kBlockM * Kp));
    bf16* gp = b_per_unit ? g_scratch.as<bf16>(static_cast<size_t>(group * 2 * sub)) : nullptr;
    alignas(64) float cbuf[kBlockM * kPanel];
    load_tile_config();
    for (int64_t u = next.fetch_add(1); u < units; u = next.fetch_add(1)) {
      const int64_t g = u / nchunks, chunk = u % nchunks;
      const int64_t mb0 = chunk * blocks_per_chunk, mb1 = std::min(mblocks, mb0 + blocks_per_chunk);
      const int64_t p0 = g * group, p1 = std::min(npanels, p0 + group);
      const bf16* panels = gp;
      if (b_per_unit)
        for (int64_t p = p0; p < p1; ++p)
          pack_b_panel(tb, B, ldb, N, Kend, k0, Kp, p * kPanel, gp + (p - p0) * 2 * sub, sub);
      else
        panels = bp + p0 * 2 * sub;
      for (int64_t mb = mb0; mb < mb1; ++mb) {
        const int64_t m0 = mb * kBlockM, rows = std::min(kBlockM, M - m0);
        const bf16* a = a_in_place ? A + m0 * lda + k0 : a_once ? a_all + m0 * Kp : ap;
        const int64_t ld = a_in_place ? lda : Kp;
        if (!a_in_place && !a_once) pack_a_block(ta, A, lda, M, Kend, m0, kBlockM, k0, Kp, ap);
        for (int64_t p = p0; p < p1; ++p) {
          const int64_t n0 = p * kPanel, cols = std::min(kPanel, N - n0);
          const bf16* panel = panels + (p - p0) * 2 * sub;
          // C's rows of this block are 32 short runs far apart: fetch them while the tiles multiply
          // (unless they are only written, straight to memory).
          if (!stream_c)
            for (int64_t r = 0; r < rows; ++r) {
              __builtin_prefetch(C + (m0 + r) * ldc + n0, 1, 3);
              __builtin_prefetch(C + (m0 + r) * ldc + n0 + 16, 1, 3);
            }
          micro_kernel(a, ld, Kp, panel, panel + sub, cbuf);
          epilogue(cbuf, rows, cols, alpha, beta, bias ? bias + n0 : nullptr, C + m0 * ldc + n0, ldc, stream_c);
        }
      }
    }
    if (stream_c) _mm_sfence();  // the streamed rows are seen by whichever thread reads them next
    _tile_release();
  }
}

// When neither op(B) nor A fits in L2 (a long K with wide operands), K runs in chunks sized for
// op(B)'s panels to fit, and each chunk's sums are added to C in order (the
// chunks depend on the shape only). fn(k0, kc, beta for this chunk).
template <class F>
void for_each_k_chunk(int64_t M, int64_t N, int64_t K, F&& fn, float beta) {
  const int64_t Np = round_up(N, kPanel), Kp = round_up(K, kStepK);
  int64_t kc = K;
  if (Np * Kp * 2 > kL2Bytes && round_up(M, kBlockM) * Kp * 2 > kL2Bytes)
    kc = std::max<int64_t>(kMinChunkK, kL2Bytes / (Np * 2) / kStepK * kStepK);
  for (int64_t k0 = 0; k0 < K; k0 += kc) fn(k0, std::min(kc, K - k0), k0 == 0 ? beta : 1.0f);
}

}  // namespace

void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const bf16* A, int64_t lda,
          const bf16* B, int64_t ldb, float beta, float* C, int64_t ldc, const float* bias) {
  for_each_k_chunk(M, N, K, [&](int64_t k0, int64_t kc, float b) {
    gemm_chunk(ta, tb, M, N, K, k0, kc, alpha, A, lda, B, ldb, b, C, ldc, k0 == 0 ? bias : nullptr);
  }, beta);
}

// GFLOP/s of `steps` steps of four TDPBF16PS on four accumulator tiles, with `loads` (0, 1, 2 or
// 4) tile loads each from a 4 KB buffer (in L1), on the calling thread.
double tile_probe(long steps, int loads) {
  alignas(64) static thread_local char buf[4096] = {};  // zeros: bf16 0.0
  load_tile_config();
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
  const auto t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < steps; ++i) {
    if (loads >= 4) _tile_loadd(4, buf, 64);
    if (loads >= 1) _tile_loadd(6, buf + 1024, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (loads >= 2) _tile_loadd(7, buf + 2048, 64);
    _tile_dpbf16ps(1, 4, 7);
    if (loads >= 4) _tile_loadd(5, buf + 3072, 64);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  _tile_release();
  return 4.0 * static_cast<double>(steps) * 16 * 16 * 32 * 2 / s / 1e9;
}

#pragma GCC diagnostic pop
#pragma GCC pop_options

}  // namespace mt::kernels::cpu::amx_avx512

namespace mt::kernels::cpu::detail {

#ifndef ARCH_REQ_XCOMP_PERM
#define ARCH_REQ_XCOMP_PERM 0x1023
#endif
constexpr int kXfeatureXtiledata = 18;

namespace {
// -1: not decided yet (MESHTRAIN_AMX_GEMM=0 turns the path off, for comparisons with oneDNN).
std::atomic<int> g_amx_enabled{-1};
}  // namespace

void set_amx_gemm_enabled(bool enabled) { g_amx_enabled = enabled ? 1 : 0; }

bool amx_gemm_env() {
  const char* v = std::getenv("MESHTRAIN_AMX_GEMM");
  if (!v || !*v || std::string_view(v) == "1") return true;
  if (std::string_view(v) == "0") return false;
  throw std::runtime_error(std::string("meshtrain: MESHTRAIN_AMX_GEMM=") + v +
                           " (expected 0: bf16 GEMMs on oneDNN, or 1: on AMX tiles where the CPU has them)");
}

bool amx_gemm_enabled() {
  int e = g_amx_enabled.load();
  if (e < 0) {
    e = amx_gemm_env() ? 1 : 0;
    g_amx_enabled = e;
  }
  return e == 1;
}

bool amx_gemm_ready() {
  // The kernel hands out the tile state only on request (Linux 5.16+), once per process.
  static const bool granted = [] {
    if (!cpu_features().amx_tile || !cpu_features().amx_bf16 || !cpu_features().os_amx) return false;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, kXfeatureXtiledata) == 0;
  }();
  return granted && active_isa() >= CpuIsa::AMX_BF16 && amx_gemm_enabled();
}

double amx_tile_probe_gflops(long steps, int loads) { return amx_avx512::tile_probe(steps, loads); }

void amx_gemm_bf16(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const bf16* A, int64_t lda,
                   const bf16* B, int64_t ldb, float beta, float* C, int64_t ldc, const float* bias) {
  amx_avx512::gemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, bias);
}

}  // namespace mt::kernels::cpu::detail
