// The mpirun command line for N ranks of this binary (comm/launch.h).
#include "comm/launch.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <cstring>
#include <thread>

namespace mt::comm {

int detect_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0) {
    const int c = CPU_COUNT(&set);
    if (c > 0) return c;
  }
  const unsigned h = std::thread::hardware_concurrency();
  return h ? static_cast<int>(h) : 1;
}

std::string self_exe(const std::string& fallback) {
  char buf[4096];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) return fallback;
  buf[n] = 0;
  return buf;
}

std::string rank_glibc_tunables() {
  const std::string want = "glibc.malloc.hugetlb=1";
  const char* t = std::getenv("GLIBC_TUNABLES");
  if (!t || !*t) return want;
  const std::string cur = t;
  return cur.find("glibc.malloc.hugetlb") != std::string::npos ? cur : cur + ":" + want;
}

std::string shell_join(const std::vector<std::string>& argv) {
  std::string out;
  for (const auto& a : argv) {
    if (!out.empty()) out += ' ';
    bool plain = !a.empty();
    for (char c : a)
      if (!(std::isalnum(static_cast<unsigned char>(c)) || std::strchr("-_./=:,+@%", c)))
        plain = false;
    if (plain) {
      out += a;
    } else {
      out += '\'';
      for (char c : a) {
        if (c == '\'') out += "'\\''";
        else out += c;
      }
      out += '\'';
    }
  }
  return out;
}

LaunchPlan build_launch_plan(const LaunchOptions& o) {
  LaunchPlan p;
  const int cores = o.cores > 0 ? o.cores : detect_cores();
  const bool local = o.hostfile.empty();
  p.argv = {o.mpirun, "-np", std::to_string(o.nranks)};
  int threads = o.threads;
  if (threads <= 0) threads = local ? std::max(1, cores / std::max(1, o.nranks)) : 1;
  if (!local) {
    p.argv.insert(p.argv.end(), {"--hostfile", o.hostfile});
  } else {
    bool user_places = false;
    for (const auto& a : o.extra_mpirun_args)
      for (const char* f : {"--bind-to", "--map-by", "--cpu-set", "--rankfile", "-bind-to", "-map-by"})
        if (a == f || a.rfind(std::string(f) + "=", 0) == 0) user_places = true;
    if (o.nranks > cores) {
      p.argv.insert(p.argv.end(), {"--bind-to", "none", "--oversubscribe", "--mca", "mpi_yield_when_idle", "1"});
    } else if (o.bind == "cores" && !user_places && int64_t(o.nranks) * threads <= cores) {
      // Each rank on its own `threads` CPUs (logical ones, as counted above): its OpenMP threads
      // and its communication threads share them, and no rank's compute thread is moved onto
      // another's CPU. Unbound, the scheduler does exactly that, and pipeline and context-parallel
      // steps run markedly slower (docs/comm.md, "Launching").
      p.argv.insert(p.argv.end(), {"--use-hwthread-cpus", "--map-by", "slot:PE=" + std::to_string(threads),
                                   "--bind-to", "hwthread:if-supported"});
    } else if (!user_places) {
      p.argv.insert(p.argv.end(), {"--bind-to", "none"});
    }
  }
  p.argv.insert(p.argv.end(), {"-x", "OMP_NUM_THREADS=" + std::to_string(threads)});
  p.argv.insert(p.argv.end(), {"-x", "GLIBC_TUNABLES=" + rank_glibc_tunables()});
  for (const auto& name : o.forward_env) p.argv.insert(p.argv.end(), {"-x", name});
  p.argv.insert(p.argv.end(), o.extra_mpirun_args.begin(), o.extra_mpirun_args.end());
  p.argv.push_back(o.exe.empty() ? self_exe() : o.exe);
  p.argv.insert(p.argv.end(), o.command.begin(), o.command.end());
  if (o.is_root) {
    p.env.emplace_back("OMPI_ALLOW_RUN_AS_ROOT", "1");
    p.env.emplace_back("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
  }
  return p;
}

}  // namespace mt::comm
