// GEMM library comparison at the benchmark model's shapes (GPT-2 small-cpu: n_embd 384, MLP 1536,
// fused qkv 1152, vocab 50304, N = B*T = 1024 rows): OpenBLAS (cblas_sgemm), BLIS (bli_sgemm),
// oneDNN (dnnl_sgemm, f32 matmul primitive, bf16 matmul primitive) and meshtrain's own
// gemm_f32 / gemm_bf16, on 1 and 2 threads. Prints a table of GFLOP/s (median over rounds of
// side-by-side samples, see "timing" below).
//
// OpenBLAS and BLIS both export the CBLAS/BLAS symbols, so they are loaded with dlopen into
// separate local namespaces instead of being linked. The environment is used as given (in
// particular OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE and BLIS_ARCH_TYPE are neither set nor
// changed here).
//
// Two more columns, not libraries: "split" is dnnl_sgemm called once per OpenMP thread, each call
// single-threaded on its half of C (split along the larger of M and N at a multiple of 16): whether
// oneDNN's own two-thread partition is what holds it back. "peak" is the cores' fp32 FMA peak
// (kernels/cpu/fma_peak.h), sampled in each round between the libraries, so that a GEMM's share
// of the peak is measured in the same seconds (on a shared machine both move minute to minute).
//
// Usage: gemm_libs [--rounds R] [--sample-time SECONDS] [--threads 1,2]
//                  [--libs openblas,blis,sgemm,split,matmul,bf16,mt,mtbf16,peak]
#include <dlfcn.h>
#include <time.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <oneapi/dnnl/dnnl.hpp>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kernels/cpu/fma_peak.h"
#include "kernels/cpu/gemm.h"
#include "runtime/strings.h"
#include "kernels/cpu/gemm_internal.h"
#include "runtime/dtype.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Shape {
  std::string name;
  bool ta, tb;
  int64_t M, N, K;
};

std::vector<Shape> model_shapes() {
  const int64_t rows = 1024;
  struct Layer {
    const char* name;
    int64_t C, OC;
  };
  const Layer layers[] = {{"qkv 384->1152", 384, 1152},
                          {"fc 384->1536", 384, 1536},
                          {"proj 1536->384", 1536, 384},
                          {"lm_head 384->50304", 384, 50304}};
  std::vector<Shape> s;
  for (const Layer& l : layers) {
    s.push_back({std::string(l.name) + " fwd  (NT)", false, true, rows, l.OC, l.C});
    s.push_back({std::string(l.name) + " dinp (NN)", false, false, rows, l.C, l.OC});
    s.push_back({std::string(l.name) + " dW   (TN)", true, false, l.OC, l.C, rows});
  }
  return s;
}

// ---- libraries ----------------------------------------------------------------------------------

using cblas_sgemm_fn = void (*)(int, int, int, int, int, int, float, const float*, int, const float*,
                                int, float, float*, int);
using openblas_set_threads_fn = void (*)(int);
using openblas_str_fn = char* (*)();
// BLIS 0.9 typed API (dim_t / inc_t are 64-bit in Debian's build; trans_t is an int enum with
// BLIS_NO_TRANSPOSE = 0, BLIS_TRANSPOSE = 0x08).
using bli_sgemm_fn = void (*)(int, int, int64_t, int64_t, int64_t, const float*, const float*, int64_t,
                              int64_t, const float*, int64_t, int64_t, const float*, float*, int64_t,
                              int64_t);
using bli_set_threads_fn = void (*)(int64_t);
using bli_arch_query_fn = int (*)();
using bli_arch_string_fn = char* (*)(int);
constexpr int kBliNoTrans = 0, kBliTrans = 0x08;

struct OpenBlas {
  void* h = nullptr;
  cblas_sgemm_fn sgemm = nullptr;
  openblas_set_threads_fn set_threads = nullptr;
  std::string info;
  bool load() {
    h = dlopen("libopenblas.so.0", RTLD_NOW | RTLD_LOCAL);
    if (!h) return false;
    sgemm = reinterpret_cast<cblas_sgemm_fn>(dlsym(h, "cblas_sgemm"));
    set_threads = reinterpret_cast<openblas_set_threads_fn>(dlsym(h, "openblas_set_num_threads"));
    auto cfg = reinterpret_cast<openblas_str_fn>(dlsym(h, "openblas_get_config"));
    auto core = reinterpret_cast<openblas_str_fn>(dlsym(h, "openblas_get_corename"));
    if (cfg) info += cfg();
    if (core) info += std::string(", core ") + core();
    return sgemm && set_threads;
  }
};

struct Blis {
  void* h = nullptr;
  bli_sgemm_fn sgemm = nullptr;
  bli_set_threads_fn set_threads = nullptr;
  std::string info;
  bool load() {
    h = dlopen("libblis.so.4", RTLD_NOW | RTLD_LOCAL);
    if (!h) return false;
    sgemm = reinterpret_cast<bli_sgemm_fn>(dlsym(h, "bli_sgemm"));
    set_threads = reinterpret_cast<bli_set_threads_fn>(dlsym(h, "bli_thread_set_num_threads"));
    auto q = reinterpret_cast<bli_arch_query_fn>(dlsym(h, "bli_arch_query_id"));
    auto s = reinterpret_cast<bli_arch_string_fn>(dlsym(h, "bli_arch_string"));
    if (q && s) {
      const int id = q();
      info = std::string("arch ") + s(id) + " (id " + std::to_string(id) + ")";
    }
    return sgemm && set_threads;
  }
};

// oneDNN matmul primitives cached per shape/type (creation is not timed).
struct Matmuls {
  dnnl::engine eng{dnnl::engine::kind::cpu, 0};
  dnnl::stream strm{eng};
  struct Entry {
    dnnl::matmul prim;
    dnnl::memory::desc a, b, c;
    std::string impl;
  };
  std::map<std::string, Entry> cache;
  // Returns nullptr when the primitive cannot be created (e.g. bf16 on a CPU without AVX-512).
  Entry* get(const Shape& s, bool bf16) {
    const std::string key = s.name + (bf16 ? "/bf16" : "/f32");
    auto it = cache.find(key);
    if (it != cache.end()) return &it->second;
    using dt = dnnl::memory::data_type;
    using dims = dnnl::memory::dims;
    const dt in = bf16 ? dt::bf16 : dt::f32;
    Entry e;
    e.a = dnnl::memory::desc({s.M, s.K}, in, s.ta ? dims{1, s.M} : dims{s.K, 1});
    e.b = dnnl::memory::desc({s.K, s.N}, in, s.tb ? dims{1, s.K} : dims{s.N, 1});
    e.c = dnnl::memory::desc({s.M, s.N}, dt::f32, dims{s.N, 1});
    try {
      dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(e.a, e.b, e.c), eng);
      e.impl = pd.impl_info_str();
      e.prim = dnnl::matmul(pd);
    } catch (const dnnl::error&) {
      return nullptr;
    }
    return &cache.emplace(key, e).first->second;
  }
  void run(Entry& e, const void* A, const void* B, float* C) {
    dnnl::memory am(e.a, eng, const_cast<void*>(A)), bm(e.b, eng, const_cast<void*>(B)),
        cm(e.c, eng, C);
    e.prim.execute(strm, {{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bm}, {DNNL_ARG_DST, cm}});
    strm.wait();
  }
};

// ---- timing -------------------------------------------------------------------------------------
//
// The machines are shared, so libraries are measured side by side: for each shape, several
// rounds, and in each round one sample of every library (a sample repeats the call until it has
// run for g_sample_time). A pause before each sample lets the previous library's worker threads
// stop spinning (OpenBLAS's pthreads spin for ~0.1 s after a call). The table reports the median
// sample of each library.

double g_sample_time = 0.05;  // seconds per sample
int g_rounds = 5;

double cpu_now() {
  timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

struct Sample {
  double wall, cpu;  // seconds per call: elapsed, and CPU time of the whole process
};

template <class F>
Sample sample_seconds(F&& f) {
  std::this_thread::sleep_for(std::chrono::milliseconds(150));
  int reps = 0;
  const auto t0 = Clock::now();
  const double c0 = cpu_now();
  double el = 0.0;
  do {
    f();
    ++reps;
    el = std::chrono::duration<double>(Clock::now() - t0).count();
  } while (el < g_sample_time);
  return {el / reps, (cpu_now() - c0) / reps};
}


// The libraries, loaded (OpenBLAS and BLIS through dlopen) or created (oneDNN's primitives).
struct Libraries {
  OpenBlas ob;
  Blis bl;
  bool have_ob = false, have_bl = false;
  Matmuls mm;
};

// The operands, sized for the largest shape, in fp32 and bf16.
struct Operands {
  std::vector<float> A, B, C;
  std::vector<mt::bf16> A16, B16;
  explicit Operands(const std::vector<Shape>& shapes) {
    int64_t maxA = 0, maxB = 0, maxC = 0;
    for (const Shape& s : shapes) {
      maxA = std::max(maxA, s.M * s.K);
      maxB = std::max(maxB, s.K * s.N);
      maxC = std::max(maxC, s.M * s.N);
    }
    A.resize(static_cast<size_t>(maxA)), B.resize(static_cast<size_t>(maxB)), C.assign(static_cast<size_t>(maxC), 0.0f);
    std::mt19937 rng(1);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    for (auto& x : A) x = u(rng);
    for (auto& x : B) x = u(rng);
    A16.resize(A.size()), B16.resize(B.size());
    for (size_t i = 0; i < A.size(); ++i) A16[i] = mt::float_to_bf16(A[i]);
    for (size_t i = 0; i < B.size(); ++i) B16[i] = mt::float_to_bf16(B[i]);
  }
};

// dnnl_sgemm once per thread on its half of C (along C's larger side). oneDNN runs a call made
// inside a parallel region on the calling thread alone, so each half is a single-threaded sgemm.
void split_sgemm(const Shape& s, Operands& op, int lda, int ldb, int ldc) {
  const bool by_n = s.N >= s.M;
  const int64_t len = by_n ? s.N : s.M;
#pragma omp parallel
  {
    const int64_t T = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t per = (len / T + 15) / 16 * 16;
    const int64_t lo = std::min(len, t * per), hi = t == T - 1 ? len : std::min(len, lo + per);
    if (hi > lo) {
      const float* a = op.A.data();
      const float* b = op.B.data();
      if (by_n) b += s.tb ? lo * ldb : lo;
      else a += s.ta ? lo : lo * lda;
      dnnl_sgemm(s.ta ? 'T' : 'N', s.tb ? 'T' : 'N', by_n ? s.M : hi - lo, by_n ? hi - lo : s.N, s.K, 1.0f, a, lda, b,
                 ldb, 0.0f, op.C.data() + (by_n ? lo : lo * ldc), ldc);
    }
  }
}

// One callable per library for shape `s` (empty when the library is not available); notes[lib]
// says what ran, or why nothing did.
std::vector<std::function<void()>> library_calls(const std::vector<std::string>& libs, const Shape& s, Libraries& L,
                                                 Operands& op, std::map<std::string, std::string>& notes) {
  const int lda = int(s.ta ? s.M : s.K), ldb = int(s.tb ? s.K : s.N), ldc = int(s.N);
  std::vector<std::function<void()>> fns(libs.size());
  for (size_t li = 0; li < libs.size(); ++li) {
    const std::string& lib = libs[li];
    if (lib == "openblas" && L.have_ob) {
      fns[li] = [&, lda, ldb, ldc] {
        L.ob.sgemm(101, s.ta ? 112 : 111, s.tb ? 112 : 111, int(s.M), int(s.N), int(s.K), 1.0f, op.A.data(), lda,
                   op.B.data(), ldb, 0.0f, op.C.data(), ldc);
      };
    } else if (lib == "blis" && L.have_bl) {
      fns[li] = [&, lda, ldb, ldc] {
        const float one = 1.0f, zero = 0.0f;
        L.bl.sgemm(s.ta ? kBliTrans : kBliNoTrans, s.tb ? kBliTrans : kBliNoTrans, s.M, s.N, s.K, &one, op.A.data(),
                   lda, 1, op.B.data(), ldb, 1, &zero, op.C.data(), ldc, 1);
      };
    } else if (lib == "sgemm") {
      fns[li] = [&, lda, ldb, ldc] {
        dnnl_sgemm(s.ta ? 'T' : 'N', s.tb ? 'T' : 'N', s.M, s.N, s.K, 1.0f, op.A.data(), lda, op.B.data(), ldb, 0.0f,
                   op.C.data(), ldc);
      };
    } else if (lib == "split") {
      fns[li] = [&, lda, ldb, ldc] { split_sgemm(s, op, lda, ldb, ldc); };
    } else if (lib == "peak") {
      notes[lib] = "fp32 FMA peak of the threads (not a GEMM), sampled in each round";
    } else if (lib == "matmul" || lib == "bf16") {
      Matmuls::Entry* e = L.mm.get(s, lib == "bf16");
      if (!e) {
        notes[lib] = "primitive not available on this CPU";
      } else if (e->impl.rfind("ref", 0) == 0) {
        notes[lib] = e->impl + " (reference implementation, not timed)";
      } else {
        notes[lib] = e->impl;
        const void* a = lib == "bf16" ? static_cast<const void*>(op.A16.data()) : op.A.data();
        const void* b = lib == "bf16" ? static_cast<const void*>(op.B16.data()) : op.B.data();
        Matmuls& mm = L.mm;
        fns[li] = [&mm, e, a, b, &op] { mm.run(*e, a, b, op.C.data()); };
      }
    } else if (lib == "mt") {
      fns[li] = [&] {
        mt::kernels::cpu::gemm_f32(s.ta, s.tb, s.M, s.N, s.K, 1.0f, op.A.data(), op.B.data(), 0.0f, op.C.data());
      };
    } else if (lib == "mtbf16") {
      notes[lib] = mt::kernels::cpu::detail::bf16_gemm_is_native(s.ta, s.tb, s.M, s.N, s.K, 1.0f, 0.0f)
                       ? "oneDNN bf16 matmul"
                       : "widened to fp32 + sgemm";
      fns[li] = [&] {
        mt::kernels::cpu::gemm_bf16(s.ta, s.tb, s.M, s.N, s.K, 1.0f, op.A16.data(), op.B16.data(), 0.0f, op.C.data());
      };
    }
  }
  return fns;
}

// results[lib][threads][shape] = GFLOP/s (negative: not available)
using Results = std::map<std::string, std::map<int, std::vector<double>>>;

// Every library at shape `s` on nt threads, side by side over the rounds; appends the medians to
// res (wall clock) and res_cpu (process CPU time).
void measure_shape(const std::vector<std::string>& libs, const Shape& s, int nt, Libraries& L, Operands& op,
                   std::map<std::string, std::string>& notes, Results& res, Results& res_cpu) {
  const double flop = 2.0 * double(s.M) * double(s.N) * double(s.K);
  std::vector<std::function<void()>> fns = library_calls(libs, s, L, op, notes);
  for (auto& f : fns)
    if (f) f();  // warm-up: page faults, packing buffers, primitive scratch
  std::vector<std::vector<double>> wall(libs.size()), cpu(libs.size());
  for (int r = 0; r < g_rounds; ++r)
    for (size_t li = 0; li < libs.size(); ++li)
      if (libs[li] == "peak") {
        // Stored as the time this shape's flops would take at the peak, so that the table's
        // flop / time gives the peak itself.
        const double secs = flop / mt::kernels::cpu::fma_peak(nt, g_sample_time, 1);
        wall[li].push_back(secs);
        cpu[li].push_back(secs * nt);
      } else if (fns[li]) {
        const Sample smp = sample_seconds(fns[li]);
        wall[li].push_back(smp.wall);
        cpu[li].push_back(smp.cpu);
      }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  for (size_t li = 0; li < libs.size(); ++li) {
    const bool ok = !wall[li].empty();
    res[libs[li]][nt].push_back(ok ? flop / median(wall[li]) * 1e-9 : -1.0);
    res_cpu[libs[li]][nt].push_back(ok ? flop / median(cpu[li]) * 1e-9 : -1.0);
    std::fprintf(stderr, "  %-8s %dt %-28s %8.1f GFLOP/s (%.1f per CPU-second)\n", libs[li].c_str(), nt,
                 s.name.c_str(), res[libs[li]][nt].back(), res_cpu[libs[li]][nt].back());
  }
}

// One row per shape, one column per (library, threads).
void print_table(const char* title, const std::vector<std::string>& libs, const std::vector<int>& threads,
                 const std::vector<Shape>& shapes, Results& r) {
  std::printf("\n%s\n\n", title);
  std::printf("| %-30s | %-18s |", "shape", "M x N x K");
  for (const std::string& lib : libs)
    for (int nt : threads) std::printf(" %s %dt |", lib.c_str(), nt);
  std::printf("\n|%s|%s|", std::string(32, '-').c_str(), std::string(20, '-').c_str());
  for (size_t i = 0; i < libs.size() * threads.size(); ++i) std::printf("------:|");
  std::printf("\n");
  for (size_t si = 0; si < shapes.size(); ++si) {
    const Shape& s = shapes[si];
    char dims[64];
    std::snprintf(dims, sizeof dims, "%ldx%ldx%ld", long(s.M), long(s.N), long(s.K));
    std::printf("| %-30s | %-18s |", s.name.c_str(), dims);
    for (const std::string& lib : libs)
      for (int nt : threads) {
        const double g = r[lib][nt][si];
        if (g > 0) std::printf(" %6.1f |", g);
        else std::printf("    n/a |");
      }
    std::printf("\n");
  }
}

// The options; false after printing the usage.
bool parse_args(int argc, char** argv, std::vector<int>& threads, std::vector<std::string>& libs) {
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--sample-time" && i + 1 < argc) g_sample_time = std::atof(argv[++i]);
    else if (a == "--rounds" && i + 1 < argc) g_rounds = std::max(1, std::atoi(argv[++i]));
    else if (a == "--threads" && i + 1 < argc) {
      threads.clear();
      for (auto& s : mt::split_list(argv[++i])) threads.push_back(std::atoi(s.c_str()));
    } else if (a == "--libs" && i + 1 < argc) libs = mt::split_list(argv[++i]);
    else {
      std::fprintf(stderr, "usage: %s [--rounds R] [--sample-time S] [--threads 1,2] [--libs %s]\n", argv[0],
                   "openblas,blis,sgemm,split,matmul,bf16,mt,mtbf16,peak");
      return false;
    }
  }
  return true;
}

void print_environment(Libraries& L) {
  auto env = [](const char* n) { const char* v = std::getenv(n); return std::string(v ? v : "(unset)"); };
  std::printf("environment: OPENBLAS_CORETYPE=%s OPENBLAS_L2_SIZE=%s BLIS_ARCH_TYPE=%s OMP_NUM_THREADS=%s\n",
              env("OPENBLAS_CORETYPE").c_str(), env("OPENBLAS_L2_SIZE").c_str(),
              env("BLIS_ARCH_TYPE").c_str(), env("OMP_NUM_THREADS").c_str());
  std::printf("OpenBLAS: %s\n", L.have_ob ? L.ob.info.c_str() : "not loadable");
  std::printf("BLIS:     %s\n", L.have_bl ? L.bl.info.c_str() : "not loadable");
  const dnnl_version_t* ver = dnnl_version();
  std::printf("oneDNN:   %d.%d.%d, cpu runtime %s\n", ver->major, ver->minor, ver->patch,
              ver->cpu_runtime == DNNL_RUNTIME_OMP ? "OpenMP" : "other");
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> threads = {1, 2};
  std::vector<std::string> libs = {"openblas", "blis", "sgemm", "split", "matmul", "bf16", "mt", "mtbf16", "peak"};
  if (!parse_args(argc, argv, threads, libs)) return 2;
  Libraries L;
  L.have_ob = L.ob.load(), L.have_bl = L.bl.load();
  print_environment(L);
  const auto shapes = model_shapes();
  Operands op(shapes);
  Results res, res_cpu;
  std::map<std::string, std::string> notes;
  for (int nt : threads) {
    omp_set_num_threads(nt);
    if (L.have_ob) L.ob.set_threads(nt);
    if (L.have_bl) L.bl.set_threads(nt);
    for (const Shape& s : shapes) measure_shape(libs, s, nt, L, op, notes, res, res_cpu);
  }
  char title[256];
  std::snprintf(title, sizeof title,
                "GFLOP/s, wall clock (2*M*N*K / elapsed; median of %d side-by-side rounds)", g_rounds);
  print_table(title, libs, threads, shapes, res);
  print_table("GFLOP per CPU-second of the process (2*M*N*K / process CPU time; median). On a shared "
              "machine this is the less load-sensitive figure; with 2 threads it includes time the "
              "library's threads spin or wait.",
              libs, threads, shapes, res_cpu);
  std::printf("\nlegend: openblas = cblas_sgemm, blis = bli_sgemm, sgemm = dnnl_sgemm, matmul = oneDNN "
              "f32 matmul primitive, bf16 = oneDNN bf16 matmul primitive (bf16 in, f32 out), mt = "
              "mt::kernels::cpu::gemm_f32, mtbf16 = mt::kernels::cpu::gemm_bf16, split = dnnl_sgemm "
              "once per thread on its half of C, peak = the fp32 FMA peak sampled in the same rounds\n");
  for (auto& [k, v] : notes) std::printf("note %s: %s\n", k.c_str(), v.c_str());
  return 0;
}
