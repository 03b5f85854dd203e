// The comm layer's subcommands: `meshtrain bench comm` and `meshtrain launch`.
#pragma once
#include <string>
#include <vector>

namespace mt::comm {

// `meshtrain bench comm [options]`. argv may start at "bench" (then argv[1] must be "comm") or at
// "comm"; the remaining arguments are the options (see --help). Initialises the World itself when
// no one did. Returns the process exit code.
int run_bench_comm_command(int argc, char** argv);

// `meshtrain launch -n N [--hostfile F] [options] -- <subcommand and its arguments>`. argv[0] is
// "launch". Prints the mpirun command line to stderr and execs it (returns only on error, or after
// printing with --dry-run).
int run_launch_command(int argc, char** argv);

// What run_launch_command would execute (exposed for tests).
struct LaunchOptions {
  int nranks = 1;
  std::string hostfile;         // empty: this machine only
  std::string mpirun = "mpirun";
  std::string exe;              // the program each rank runs (default: this executable)
  int threads = 0;              // OMP_NUM_THREADS per rank; 0 = cores / ranks (at least 1)
  int cores = 0;                // 0 = detect
  bool is_root = false;
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
