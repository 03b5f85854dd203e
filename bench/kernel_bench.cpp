// Per-op timings of the CPU kernels at the benchmark model's shapes (GPT-2 small-cpu: 6 layers,
// n_embd 384, 6 heads, seq 256, vocab 50304 padded, micro-batch 4 -> N = 1024 rows), on 1 and 2
// threads, plus a check that GEMM results do not depend on the thread count, and the cores' fp32
// FMA peak (what no GEMM can exceed: the bound on any engine that performs the model's flops).
//
// Usage: kernel_bench [--min-time SECONDS] [--threads 1,2] [--amx-vs-onednn PAIRS] [--amx-probe]
//   --amx-vs-onednn PAIRS: also time meshtrain's AMX tile GEMM against oneDNN's bf16 matmul at every
//   GEMM shape, PAIRS calls of each in alternation (on CPUs with AMX-BF16).
//   --amx-probe: only the tile unit's rate on each thread count: four TDPBF16PS on four accumulator
//   tiles per step, with 0, 1, 2 or 4 tile loads (from a 4 KB buffer in L1) per step; a GEMM's
//   2 x 2 block of C needs 4 (what bounds the tile GEMM where loads are slow).
#include <immintrin.h>
#include <omp.h>
#include <time.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <random>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cpu/activation.h"
#include "kernels/cpu/cpu_isa.h"
#include "kernels/cpu/fma_peak.h"
#include "kernels/cpu/adamw.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/embedding.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/gemm_internal.h"
#include "kernels/cpu/loss.h"
#include "kernels/cpu/norm.h"

using namespace mt;
using namespace mt::kernels::cpu;
using Clock = std::chrono::steady_clock;

namespace {

double g_min_time = 0.3;
int g_amx_pairs = 0;  // --amx-vs-onednn
volatile float g_sink = 0.0f;

double cpu_now() {
  timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

// Median wall-clock time per call (ms) and the process CPU time of that same call. On a shared
// machine the CPU time is the less load-sensitive figure (with 2 threads it is summed over both).
struct Ms {
  double wall, cpu;
};

template <class F>
Ms median_ms(F&& f) {
  f();
  std::vector<Ms> t;
  const auto start = Clock::now();
  while (t.size() < 5 || std::chrono::duration<double>(Clock::now() - start).count() < g_min_time) {
    const double c0 = cpu_now();
    const auto t0 = Clock::now();
    f();
    const double w = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    t.push_back({w, (cpu_now() - c0) * 1e3});
    if (t.size() >= 200) break;
  }
  std::sort(t.begin(), t.end(), [](const Ms& a, const Ms& b) { return a.wall < b.wall; });
  Ms med = t[t.size() / 2];
  std::vector<double> c;
  for (const Ms& m : t) c.push_back(m.cpu);
  std::sort(c.begin(), c.end());
  med.cpu = c[c.size() / 2];
  return med;
}

// Buffers aligned to 64 bytes like the engine's allocations (the tile GEMM streams a large output
// only in whole aligned rows: with malloc's 16-byte alignment the LM head's forward would not
// take the path it takes in training).
template <class T>
struct Aligned64 {
  using value_type = T;
  Aligned64() = default;
  template <class U>
  Aligned64(const Aligned64<U>&) {}
  T* allocate(size_t n) {
    void* p = std::aligned_alloc(64, (n * sizeof(T) + 63) / 64 * 64);
    if (!p) throw std::bad_alloc();
    return static_cast<T*>(p);
  }
  void deallocate(T* p, size_t) { std::free(p); }
  template <class U>
  bool operator==(const Aligned64<U>&) const { return true; }
};
using Buf = std::vector<float, Aligned64<float>>;

Buf rnd(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  Buf v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// fp32 FMA peak of `nt` threads, GFLOP/s: ~0.1 s per trial, the median of 5 (kernels/cpu/fma_peak.h).
double fma_peak_gflops(int nt) { return kernels::cpu::fma_peak(nt, 0.1, 5) / 1e9; }
bool peak_uses_avx512() { return kernels::cpu::fma_peak_uses_avx512(); }

int run_amx_probe(const std::vector<int>& threads) {
  if (!kernels::cpu::detail::amx_gemm_ready()) {
    std::printf("--amx-probe: no AMX-BF16 tiles here (or the level is capped below amx_bf16)\n");
    return 0;
  }
  std::printf("AMX tile unit, GFLOP/s summed over the threads (median of 5 trials of 2^21 steps per thread);\n"
              "a step: 4 TDPBF16PS (16x16x32) on 4 accumulator tiles, with N tile loads from L1\n\n| loads per step |");
  for (int nt : threads) std::printf(" %dt |", nt);
  std::printf("\n|---|");
  for (size_t i = 0; i < threads.size(); ++i) std::printf("---:|");
  std::printf("\n");
  for (int loads : {0, 1, 2, 4}) {
    std::printf("| %d |", loads);
    for (int nt : threads) {
      std::vector<double> trials;
      for (int r = 0; r < 5; ++r) {
        std::vector<double> per(nt, 0.0);
#pragma omp parallel num_threads(nt)
        per[omp_get_thread_num()] = detail::amx_tile_probe_gflops(1L << 21, loads);
        double sum = 0;
        for (double g : per) sum += g;
        trials.push_back(sum);
      }
      std::sort(trials.begin(), trials.end());
      std::printf(" %.0f |", trials[2]);
    }
    std::printf("\n");
  }
  return 0;
}

// The benchmark model's shapes: GPT-2 small-cpu, one micro-batch.
constexpr int64_t B = 4, T = 256, C = 384, NH = 6, HD = 64, L = 6, V = 50257, VP = 50304;
constexpr int64_t N = B * T;

// One GEMM layer of the model (input width -> output width).
struct G {
  const char* name;
  int64_t Cin, OC;
};
const G kLayers[] = {{"qkv 384->1152", C, 3 * C}, {"attn_proj 384->384", C, C},
                     {"fc 384->1536", C, 4 * C},  {"proj 1536->384", 4 * C, C},
                     {"lm_head 384->50304", C, VP}};

// A layer's three GEMMs (forward, input gradient, weight gradient) on the shared buffers.
struct Op {
  const char* name;
  bool ta, tb;
  int64_t M, Nn, K;
  const float *a, *b;
  const bf16 *a16, *b16;
  float* c;
};

// The GEMM buffers sized for the largest layer, in fp32 and bf16.
struct GemmBuffers {
  Buf X, W, Y, dX, dW;
  std::vector<bf16> X16, W16, Y16;
  GemmBuffers() {
    int64_t maxw = 0, maxo = 0, maxi = 0;
    for (const G& g : kLayers) {
      maxw = std::max(maxw, g.Cin * g.OC);
      maxo = std::max(maxo, N * g.OC);
      maxi = std::max(maxi, N * g.Cin);
    }
    X = rnd(static_cast<size_t>(maxi), 1), W = rnd(static_cast<size_t>(maxw), 2, 0.02f), Y = rnd(static_cast<size_t>(maxo), 3);
    dX.assign(static_cast<size_t>(maxi), 0.0f), dW.assign(static_cast<size_t>(maxw), 0.0f);
    X16.resize(X.size()), W16.resize(W.size()), Y16.resize(Y.size());
    cast_f32_to_bf16(X16.data(), X.data(), int64_t(X.size()));
    cast_f32_to_bf16(W16.data(), W.data(), int64_t(W.size()));
    cast_f32_to_bf16(Y16.data(), Y.data(), int64_t(Y.size()));
  }
  std::array<Op, 3> ops_of(const G& g) {
    return std::array<Op, 3>{
        Op{"fwd", false, true, N, g.OC, g.Cin, X.data(), W.data(), X16.data(), W16.data(), Y.data()},
        Op{"dinp", false, false, N, g.Cin, g.OC, Y.data(), W.data(), Y16.data(), W16.data(), dX.data()},
        Op{"dW", true, false, g.OC, g.Cin, N, Y.data(), X.data(), Y16.data(), X16.data(), dW.data()}};
  }
};

void print_table_head(const char* first_columns, const char* first_rule, const std::vector<int>& threads,
                      const char* cell, const char* rule) {
  std::printf("%s", first_columns);
  for (int nt : threads) std::printf(cell, nt, nt);
  std::printf("\n%s", first_rule);
  for (size_t i = 0; i < threads.size(); ++i) std::printf("%s", rule);
  std::printf("\n");
}

// GFLOP/s of every layer's GEMMs in fp32 and bf16 per thread count; adds one step's GEMM time per
// thread count to step_ms[f32 / bf16][thread index].
void gemm_table(GemmBuffers& gb, const std::vector<int>& threads, double step_ms[2][8]) {
  std::printf("GEMM GFLOP/s (median), N = %ld rows; fwd = inp @ W^T (NT), dinp = dout @ W (NN), "
              "dW = dout^T @ inp (TN)\n\n",
              long(N));
  std::printf("Each cell: wall-clock GFLOP/s (GFLOP per process CPU-second in brackets)\n\n");
  print_table_head("| layer | op | M x N x K |", "|---|---|---|", threads, " f32 %dt | bf16 %dt |", "---:|---:|");
  for (const G& g : kLayers) {
    const int per_step = (std::string(g.name).rfind("lm_head", 0) == 0) ? 1 : int(L);
    for (const Op& o : gb.ops_of(g)) {
      const double flop = 2.0 * double(o.M) * double(o.Nn) * double(o.K);
      std::printf("| %s | %s | %ldx%ldx%ld |", g.name, o.name, long(o.M), long(o.Nn), long(o.K));
      for (size_t ti = 0; ti < threads.size(); ++ti) {
        omp_set_num_threads(threads[ti]);
        const Ms t32 = median_ms([&] {
          gemm_f32(o.ta, o.tb, o.M, o.Nn, o.K, 1.0f, o.a, o.b, 0.0f, o.c);
        });
        const Ms t16 = median_ms([&] {
          gemm_bf16(o.ta, o.tb, o.M, o.Nn, o.K, 1.0f, o.a16, o.b16, 0.0f, o.c);
        });
        step_ms[0][ti] += per_step * t32.wall;
        step_ms[1][ti] += per_step * t16.wall;
        std::printf(" %.1f (%.1f) | %.1f (%.1f) |", flop / t32.wall * 1e-6, flop / t32.cpu * 1e-6,
                    flop / t16.wall * 1e-6, flop / t16.cpu * 1e-6);
      }
      std::printf("\n");
      std::fflush(stdout);
    }
  }
}

// The AMX tile GEMM against oneDNN's matmul at the same shapes, call by call in alternation (on a
// shared machine the two must see the same moments): the median over the pairs of oneDNN's time
// / the tile GEMM's, with the quartiles. The tile GEMM is called directly, so the LM head's
// input and weight gradients (which gemm_bf16 leaves to oneDNN) are shown too. beta = 1 for the
// gradients, as the engine accumulates them.
void amx_vs_onednn(GemmBuffers& gb, const std::vector<int>& threads) {
  if (!detail::amx_gemm_ready()) {
    std::printf("\n--amx-vs-onednn: the AMX tile GEMM does not run here (%s)\n", kernels::describe(Device::CPU).c_str());
    return;
  }
  std::printf("\nbf16: oneDNN time / AMX tile GEMM time, median of %d alternating pairs [quartiles]\n\n", g_amx_pairs);
  print_table_head("| layer | op | M x N x K |", "|---|---|---|", threads, " %dt |", "---:|");
  for (const G& g : kLayers)
    for (const Op& o : gb.ops_of(g)) {
      const float beta = o.ta || !o.tb ? 1.0f : 0.0f;
      auto tile = [&] {
        detail::amx_gemm_bf16(o.ta, o.tb, o.M, o.Nn, o.K, 1.0f, o.a16, o.ta ? o.M : o.K, o.b16, o.tb ? o.K : o.Nn,
                              beta, o.c, o.Nn, nullptr);
      };
      auto onednn = [&] {
        detail::set_amx_gemm_enabled(false);
        gemm_bf16(o.ta, o.tb, o.M, o.Nn, o.K, 1.0f, o.a16, o.b16, beta, o.c);
        detail::set_amx_gemm_enabled(true);
      };
      std::printf("| %s | %s | %ldx%ldx%ld |", g.name, o.name, long(o.M), long(o.Nn), long(o.K));
      for (int nt : threads) {
        omp_set_num_threads(nt);
        tile();
        onednn();
        std::vector<double> r;
        for (int i = 0; i < g_amx_pairs; ++i) {
          auto t0 = Clock::now();
          tile();
          auto t1 = Clock::now();
          onednn();
          auto t2 = Clock::now();
          r.push_back(std::chrono::duration<double>(t2 - t1).count() / std::chrono::duration<double>(t1 - t0).count());
        }
        std::sort(r.begin(), r.end());
        std::printf(" %.2fx [%.2f, %.2f] |", r[r.size() / 2], r[r.size() / 4], r[3 * r.size() / 4]);
      }
      std::printf("\n");
      std::fflush(stdout);
    }
}

// Thread-count independence of the fp32 GEMM (matters for bitwise parity between runs that use
// different OMP_NUM_THREADS).
void gemm_thread_independence(GemmBuffers& gb) {
  std::printf("\nGEMM result identical on 1 and 2 threads (bitwise):");
  for (const G& g : kLayers) {
    Buf c1(static_cast<size_t>(g.Cin * g.OC)), c2(c1.size());
    omp_set_num_threads(1);
    gemm_f32(true, false, g.OC, g.Cin, N, 1.0f, gb.Y.data(), gb.X.data(), 0.0f, c1.data());
    omp_set_num_threads(2);
    gemm_f32(true, false, g.OC, g.Cin, N, 1.0f, gb.Y.data(), gb.X.data(), 0.0f, c2.data());
    const bool dw_same = std::memcmp(c1.data(), c2.data(), c1.size() * 4) == 0;
    Buf f1(static_cast<size_t>(N * g.OC)), f2(f1.size());
    omp_set_num_threads(1);
    gemm_f32(false, true, N, g.OC, g.Cin, 1.0f, gb.X.data(), gb.W.data(), 0.0f, f1.data());
    omp_set_num_threads(2);
    gemm_f32(false, true, N, g.OC, g.Cin, 1.0f, gb.X.data(), gb.W.data(), 0.0f, f2.data());
    const bool fw_same = std::memcmp(f1.data(), f2.data(), f1.size() * 4) == 0;
    std::printf(" %s fwd %s dW %s;", g.name, fw_same ? "yes" : "NO", dw_same ? "yes" : "NO");
  }
  std::printf("\n");
}

// One timed op: per thread count, the median call; called per_step times in a training step.
struct Row {
  std::string name;
  std::vector<Ms> ms;
  int per_step;
};

// The non-GEMM kernels through the dispatched table `K`, at the model's shapes.
struct OtherOps {
  const kernels::KernelTable& K;
  static constexpr int64_t ld = 3 * C;
  static constexpr int64_t nparams = 12 * L * C * C + VP * C + T * C;  // ~30M
  Buf qkv = rnd(static_cast<size_t>(N * ld), 10), att = Buf(static_cast<size_t>(N * C)),
      lse = Buf(static_cast<size_t>(B * NH * T)), dqkv = Buf(qkv.size(), 0.0f), datt = rnd(static_cast<size_t>(N * C), 11);
  Buf x = rnd(static_cast<size_t>(N * C), 12), w = rnd(static_cast<size_t>(C), 13), b = rnd(static_cast<size_t>(C), 14);
  Buf y = Buf(static_cast<size_t>(N * C)), mean = Buf(static_cast<size_t>(N)), rstd = Buf(static_cast<size_t>(N)),
      dx = Buf(static_cast<size_t>(N * C), 0.0f), dw = Buf(static_cast<size_t>(C), 0.0f), db = Buf(static_cast<size_t>(C), 0.0f);
  Buf h = rnd(static_cast<size_t>(N * 4 * C), 15), dh = rnd(static_cast<size_t>(N * 4 * C), 16);
  Buf gh = Buf(h.size()), dgh = Buf(h.size(), 0.0f);
  Buf logits0 = rnd(static_cast<size_t>(N * VP), 17, 2.0f);
  Buf logits = Buf(logits0.size()), losses = Buf(static_cast<size_t>(N));
  std::vector<int32_t> targets = std::vector<int32_t>(static_cast<size_t>(N)), ids = std::vector<int32_t>(static_cast<size_t>(N));
  Buf p = rnd(static_cast<size_t>(nparams), 18, 0.02f), pg = rnd(static_cast<size_t>(nparams), 19, 0.01f);
  Buf pm = Buf(static_cast<size_t>(nparams), 0.0f), pv = Buf(static_cast<size_t>(nparams), 0.0f);
  Buf wte = rnd(static_cast<size_t>(VP * C), 20), dwte = Buf(static_cast<size_t>(VP * C), 0.0f);

  explicit OtherOps(const kernels::KernelTable& table) : K(table) {
    for (int64_t i = 0; i < N; ++i) {
      targets[static_cast<size_t>(i)] = int32_t((i * 7919) % V);
      ids[static_cast<size_t>(i)] = int32_t((i * 104729) % V);
    }
  }

  // Times every op on the current thread count; rec(name, calls per step, time).
  template <class Rec>
  void time_all(Rec&& rec) {
    rec("attention fwd (B4 T256 nh6 hd64)", int(L),
        median_ms([&] { K.attention_forward(att.data(), lse.data(), qkv.data(), B, T, NH, NH, HD, nullptr); }));
    rec("attention bwd", int(L), median_ms([&] {
          K.attention_backward(dqkv.data(), datt.data(), qkv.data(), att.data(), lse.data(), B, T, NH,
                             NH, HD, nullptr);
        }));
    rec("layernorm fwd (1024x384)", int(2 * L + 1), median_ms([&] {
          K.layernorm_forward(y.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C, 1e-5f);
        }));
    rec("layernorm bwd", int(2 * L + 1), median_ms([&] {
          K.layernorm_backward(dx.data(), dw.data(), db.data(), y.data(), x.data(), w.data(),
                             mean.data(), rstd.data(), N, C);
        }));
    rec("gelu fwd (1024x1536)", int(L), median_ms([&] { K.gelu_forward(gh.data(), h.data(), N * 4 * C); }));
    rec("gelu bwd", int(L), median_ms([&] { K.gelu_backward(dgh.data(), h.data(), dh.data(), N * 4 * C); }));
    rec("residual add (1024x384)", int(2 * L), median_ms([&] { K.accumulate(y.data(), x.data(), N * C); }));
    time_losses(rec);
    rec("embedding fwd (1024x384)", 1, median_ms([&] { K.embedding_forward(y.data(), ids.data(), wte.data(), N, C); }));
    rec("embedding bwd", 1, median_ms([&] { K.embedding_backward(dwte.data(), dx.data(), ids.data(), N, C); }));
    rec("adamw (30.3M params)", 1, median_ms([&] {
          K.adamw_update(p.data(), pg.data(), pm.data(), pv.data(), nparams, 1e-4f, 0.9f, 0.95f, 1e-8f,
                       0.1f, 10, 1.0f, nullptr);
        }));
    rec("adamw + its bf16 copy (bf16 runs)", 0, median_ms([&] {
          K.adamw_update(p.data(), pg.data(), pm.data(), pv.data(), nparams, 1e-4f, 0.9f, 0.95f, 1e-8f,
                       0.1f, 10, 1.0f, reinterpret_cast<bf16*>(dwte.data()));
        }));
    rec("cast f32->bf16 (30.3M)", 0, median_ms([&] {
          K.cast_f32_to_bf16(reinterpret_cast<bf16*>(pm.data()), p.data(), nparams);
        }));
  }

  template <class Rec>
  void time_losses(Rec&& rec) {
    // In place: the first call turns the logits into their gradient, later calls run on that
    // (the work does not depend on the values), so no copy of the logits is timed.
    std::memcpy(logits.data(), logits0.data(), logits.size() * 4);
    rec("cross-entropy fused fwd+grad (1024x50304)", 1, median_ms([&] {
          K.softmax_cross_entropy(logits.data(), losses.data(), targets.data(), N, V, VP, 1.0f / N);
        }));
    // The bf16 form leaves bf16 pairs in the logits, which read as floats would give other work
    // (denormal products): every call gets fresh logits, and the copy is timed on its own.
    rec("copy of the logits (206 MB)", 0,
        median_ms([&] { std::memcpy(logits.data(), logits0.data(), logits.size() * 4); }));
    rec("copy + cross-entropy fused, bf16 gradient (bf16 runs)", 0, median_ms([&] {
          std::memcpy(logits.data(), logits0.data(), logits.size() * 4);
          K.softmax_cross_entropy_bf16(logits.data(), losses.data(), targets.data(), N, V, VP, 1.0f / N);
        }));
    rec("cross-entropy forward only", 0, median_ms([&] {
          K.softmax_cross_entropy_forward(logits0.data(), losses.data(), targets.data(), N, V, VP);
        }));
  }
};

// The non-GEMM ops per thread count; prints their table and returns one step's time of them per
// thread count.
std::vector<double> other_ops_table(const kernels::KernelTable& K, const std::vector<int>& threads) {
  OtherOps ops(K);
  std::vector<Row> rows;
  for (size_t ti = 0; ti < threads.size(); ++ti) {
    omp_set_num_threads(threads[ti]);
    ops.time_all([&](const std::string& name, int per_step, Ms ms) {
      if (ti == 0) rows.push_back({name, {}, per_step});
      for (Row& r : rows)
        if (r.name == name) r.ms.push_back(ms);
    });
  }
  std::printf("\nPer-call time, ms (median): wall clock (process CPU time in brackets)\n\n");
  print_table_head("| op | calls/step |", "|---|---:|", threads, " %dt |", "---:|");
  std::vector<double> other(threads.size(), 0.0);
  for (const Row& r : rows) {
    std::printf("| %s | %d |", r.name.c_str(), r.per_step);
    for (size_t ti = 0; ti < r.ms.size(); ++ti) {
      std::printf(" %.3f (%.3f) |", r.ms[ti].wall, r.ms[ti].cpu);
      other[ti] += r.per_step * r.ms[ti].wall;
    }
    std::printf("\n");
  }
  return other;
}

// The options; false after printing the usage.
bool parse_args(int argc, char** argv, std::vector<int>& threads, bool& probe) {
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--amx-probe") probe = true;
    else if (a == "--min-time" && i + 1 < argc) g_min_time = std::atof(argv[++i]);
    else if (a == "--amx-vs-onednn" && i + 1 < argc) g_amx_pairs = std::max(1, std::atoi(argv[++i]));
    else if (a == "--threads" && i + 1 < argc) {
      threads.clear();
      for (const char* p = argv[++i]; *p;) {
        threads.push_back(std::atoi(p));
        while (*p && *p != ',') ++p;
        if (*p == ',') ++p;
      }
    } else {
      std::fprintf(stderr, "usage: %s [--min-time S] [--threads 1,2] [--amx-vs-onednn PAIRS] [--amx-probe]\n", argv[0]);
      return false;
    }
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> threads = {1, 2};
  bool probe = false;
  if (!parse_args(argc, argv, threads, probe)) return 2;
  if (probe) return run_amx_probe(threads);
  // The non-GEMM kernels through the dispatched table: the variant the engine runs on this CPU
  // (MESHTRAIN_CPU_ISA caps it, e.g. avx2 to time the baseline variant on an AVX-512 machine).
  const kernels::KernelTable& K = kernels::table(Device::CPU);
  std::printf("%s\n\n", kernels::describe(Device::CPU).c_str());
  double step_gemm_ms[2][8] = {};  // [f32/bf16][thread idx]: fwd+bwd time of all GEMMs in one step
  {
    GemmBuffers gb;
    gemm_table(gb, threads, step_gemm_ms);
    if (g_amx_pairs > 0) amx_vs_onednn(gb, threads);
    gemm_thread_independence(gb);
  }
  const std::vector<double> other = other_ops_table(K, threads);
  std::printf("\nfp32 FMA peak (%s, all threads busy; median of 5):", peak_uses_avx512() ? "AVX-512" : "AVX2+FMA");
  for (int nt : threads) std::printf(" %dt %.1f GFLOP/s;", nt, fma_peak_gflops(nt));
  std::printf("\n");
  std::printf("\nPer training step (one micro-batch of 1024 tokens, fwd+bwd+adamw):\n");
  for (size_t ti = 0; ti < threads.size(); ++ti) {
    std::printf("  %d thread(s): GEMMs f32 %.0f ms (bf16 %.0f ms), other listed ops %.0f ms\n",
                threads[ti], step_gemm_ms[0][ti], step_gemm_ms[1][ti], other[ti]);
  }
  return 0;
}
