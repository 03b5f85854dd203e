// Launching this binary's ranks on one machine or a host file through mpirun: the mpirun command
// line `meshtrain launch` (cli/launch.cpp) executes, and the machine facts it depends on.
#pragma once
#include <string>
#include <utility>
#include <vector>

namespace mt::comm {

// Cores this process may run on (its CPU affinity; the hardware count when that is unknown).
int detect_cores();
// The path of the running executable (/proc/self/exe); `fallback` when it cannot be resolved.
std::string self_exe(const std::string& fallback = "meshtrain");
// GLIBC_TUNABLES for a rank: the caller's value with glibc.malloc.hugetlb=1 added (large temporary
// buffers are otherwise very slow on these machines).
std::string rank_glibc_tunables();

// What `meshtrain launch` executes.
struct LaunchOptions {
  int nranks = 1;
  std::string hostfile;         // empty: this machine only
  std::string mpirun = "mpirun";
  std::string exe;              // the program each rank runs (default: this executable)
  int threads = 0;              // OMP_NUM_THREADS per rank; 0 = cores / ranks (at least 1)
  int cores = 0;                // 0 = detect
  bool is_root = false;
  // One machine: "cores" binds each rank to its own `threads` CPUs when the ranks' threads fit on
  // the machine (otherwise, and with "none", no binding); mpirun arguments that place ranks
  // themselves (--bind-to, --map-by, --cpu-set, --rankfile) turn it off.
  std::string bind = "cores";
  std::vector<std::string> extra_mpirun_args;
  std::vector<std::string> forward_env;  // names of variables to pass with -x (if set)
  std::vector<std::string> command;      // subcommand and arguments
};
// The argv to exec (argv[0] = mpirun) and the environment variables to set before.
struct LaunchPlan {
  std::vector<std::string> argv;
  std::vector<std::pair<std::string, std::string>> env;
};
LaunchPlan build_launch_plan(const LaunchOptions& o);
// Shell-quoted command line, for printing.
std::string shell_join(const std::vector<std::string>& argv);

}  // namespace mt::comm
