// `meshtrain bench adamw`: the CPU AdamW kernel's throughput on this machine - what the planner's
// CPU-offload estimate assumes of a node's CPUs (docs/plan.md, "CPU offload").
#include "cli/bench_adamw.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "cli/arg_parser.h"
#include "kernels/backend.h"
#include "runtime/memory.h"

namespace mt::cli {

namespace {

const char* kHelp =
    "usage: meshtrain bench adamw [--params N] [--threads LIST] [--reps R] [--bf16]\n\n"
    "Times the engine's CPU AdamW kernel (the one train.offload = optimizer runs) over N fp32\n"
    "parameters (fp32 master, gradient, two moments; with --bf16 also the bf16 copy it writes), on\n"
    "each thread count, and prints the median time per update, parameters per second, the optimizer\n"
    "state updated per second (12 bytes per parameter: master and moments) and the memory traffic\n"
    "per second as the planner counts it (28 bytes per parameter: master and moments read and\n"
    "written, the gradient read, the weight written): the figure `meshtrain plan --host-mem-bw`\n"
    "takes, per node.\n\n"
    "options:\n"
    "  --params N     parameters per update (default 33554432; suffixes K, M)\n"
    "  --threads LIST comma-separated thread counts (default 1 and every core)\n"
    "  --reps R       timed updates per thread count (default 7; the median is reported)\n"
    "  --bf16         also write the bf16 copy (a bf16 run's upload)\n"
    "  --help         this text\n";

int64_t parse_count(const std::string& s) {
  if (s.empty()) throw ArgError("--params: empty");
  size_t pos = 0;
  double v = 0;
  try {
    v = std::stod(s, &pos);
  } catch (const std::exception&) {
    throw ArgError("--params: bad count '" + s + "'");
  }
  const std::string suf = s.substr(pos);
  if (suf == "K" || suf == "k") v *= 1024;
  else if (suf == "M" || suf == "m") v *= 1024 * 1024;
  else if (!suf.empty()) throw ArgError("--params: bad suffix in '" + s + "' (K or M)");
  if (v < 1) throw ArgError("--params must be >= 1");
  return static_cast<int64_t>(v);
}

}  // namespace

int run_bench_adamw_command(int argc, char** argv) {
  int first = 0;
  if (first < argc && !std::strcmp(argv[first], "bench")) ++first;
  if (first < argc && !std::strcmp(argv[first], "adamw")) ++first;
  ArgParser ap({"params", "threads", "reps"}, {"bf16", "help", "h"});
  int64_t n = 0;
  int reps = 0;
  std::vector<int> threads;
  try {
    ap.parse(argc, argv, first);
    if (ap.flag("help") || ap.flag("h")) {
      std::fputs(kHelp, stdout);
      return 0;
    }
    n = parse_count(ap.get("params", "33554432"));
    reps = static_cast<int>(ap.get_int("reps", 7));
    if (reps < 1) throw ArgError("--reps must be >= 1");
    const int cores = omp_get_num_procs();
    std::string list = ap.get("threads", cores > 1 ? "1," + std::to_string(cores) : "1");
    for (size_t at = 0; at <= list.size();) {
      const size_t comma = std::min(list.find(',', at), list.size());
      const std::string t = list.substr(at, comma - at);
      int v = 0;
      try {
        v = std::stoi(t);
      } catch (const std::exception&) {
        throw ArgError("--threads: bad count '" + t + "'");
      }
      if (v < 1) throw ArgError("--threads: counts must be >= 1");
      threads.push_back(v);
      at = comma + 1;
    }
  } catch (const ArgError& e) {
    std::fprintf(stderr, "meshtrain bench adamw: %s\n", e.what());
    return 2;
  }
  const bool bf = ap.flag("bf16");
  const auto& K = kernels::table(Device::CPU);
  const size_t N = static_cast<size_t>(n);
  std::vector<float> w(N, 0.01f), g(N, 0.001f), m(N, 0.0f), v(N, 0.0f);
  std::vector<bf16> wb(bf ? N : 0);
  for (size_t i = 0; i < N; ++i) g[i] = 1e-3f * static_cast<float>(static_cast<int>(i % 97) - 48);
  std::printf("# CPU AdamW (the offloaded optimizer's kernel), %lld parameters%s, median of %d updates\n",
              static_cast<long long>(n), bf ? " + bf16 copy" : "", reps);
  std::printf("# %s\n", kernels::describe(Device::CPU).c_str());
  std::printf("%8s %12s %14s %16s %18s\n", "threads", "ms/update", "Mparams/s", "state GB/s (12B)", "traffic GB/s (28B)");
  int64_t step = 0;
  for (int t : threads) {
    omp_set_num_threads(t);
    auto once = [&] {
      const auto t0 = std::chrono::steady_clock::now();
      K.adamw_update(w.data(), g.data(), m.data(), v.data(), n, 1e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, ++step, 1.0f,
                     bf ? wb.data() : nullptr);
      return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    };
    once();  // first touch and warm-up
    std::vector<double> s;
    for (int r = 0; r < reps; ++r) s.push_back(once());
    std::sort(s.begin(), s.end());
    const double sec = s[s.size() / 2];
    std::printf("%8d %12.2f %14.1f %16.2f %18.2f\n", t, 1e3 * sec, n / sec / 1e6, 12.0 * n / sec / 1e9,
                28.0 * n / sec / 1e9);
  }
  return 0;
}

}  // namespace mt::cli
