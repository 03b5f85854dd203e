// `meshtrain launch`: runs a subcommand of this binary on N ranks through mpirun
// (comm::build_launch_plan makes the command line).
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "cli/arg_parser.h"
#include "cli/commands.h"
#include "comm/launch.h"

extern char** environ;

namespace mt::cli {

using comm::LaunchOptions;
using comm::LaunchPlan;

namespace {

const char* kHelp =
    "usage: meshtrain launch -n N [options] -- <subcommand and its arguments>\n\n"
    "Runs `meshtrain <subcommand ...>` on N ranks through mpirun and prints the mpirun command.\n"
    "On one machine (no --hostfile) every rank is bound to its own T CPUs (T = its threads) when\n"
    "N x T fits on the machine (--use-hwthread-cpus --map-by slot:PE=T\n"
    "--bind-to hwthread:if-supported); otherwise, or with --bind none, it passes --bind-to none,\n"
    "and when N exceeds the cores also\n"
    "--oversubscribe and --mca mpi_yield_when_idle 1. Every rank gets OMP_NUM_THREADS (cores / N,\n"
    "at least 1, unless --threads), GLIBC_TUNABLES=glibc.malloc.hugetlb=1 (large temporary\n"
    "buffers are otherwise very slow on these machines) and every MESHTRAIN_* variable that is\n"
    "set. As root it sets OMPI_ALLOW_RUN_AS_ROOT=1 and OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1.\n\n"
    "options:\n"
    "  -n, --np N          number of ranks (required)\n"
    "  --hostfile FILE     run across the machines listed in FILE (mpirun host file; this\n"
    "                      binary must exist at the same path on every machine)\n"
    "  --threads T         OMP_NUM_THREADS per rank\n"
    "  --bind cores|none   one machine: bind each rank to its own CPUs when they fit (default\n"
    "                      cores), or leave placement to the scheduler; placement arguments in\n"
    "                      --mpirun-args (--bind-to, --map-by, ...) replace it\n"
    "  --mpirun PATH       the mpirun to run (default: $MESHTRAIN_MPIRUN or mpirun)\n"
    "  --mpirun-args ARGS  extra mpirun arguments, space-separated (e.g. \"--mca btl_tcp_links 2\")\n"
    "  --max-restarts K    when the job fails (a rank exits non-zero or dies from a signal),\n"
    "                      run it again, up to K times, printing why; a `train` job is restarted\n"
    "                      with --train.resume latest (the newest complete checkpoint in its\n"
    "                      train.checkpoint_dir). The exit code is 0 once a run finishes, else the\n"
    "                      last run's. Ctrl-C / SIGTERM stop the job without a restart.\n"
    "  --dry-run           print the command and exit\n"
    "  --help              this text\n\n"
    "Ctrl-C (or SIGTERM) stops a `train` job cleanly: mpirun passes SIGUSR1 to every rank, the ranks\n"
    "finish the step, write the final checkpoint when train.checkpoint_dir is set and exit 0. A second\n"
    "Ctrl-C aborts the job. (Under a plain mpirun, `kill -USR1 <mpirun pid>` does the same.)\n\n"
    "examples:\n"
    "  meshtrain launch -n 4 -- train --config run.toml --parallel.dp_shard=4\n"
    "  meshtrain launch -n 2 -- bench comm --max-bytes 64M\n"
    "  meshtrain launch -n 4 --max-restarts 3 -- train --config run.toml --train.checkpoint_every 100\n";

// Ctrl-C (SIGINT) or SIGTERM: the first asks the job to stop cleanly - mpirun passes SIGUSR1 on to
// every rank, and training stops after the step, writing its final checkpoint - the second aborts
// it (SIGTERM to mpirun), the third kills mpirun's process group.
volatile sig_atomic_t g_stop = 0;
volatile sig_atomic_t g_signals = 0;
volatile pid_t g_child = 0;
void forward_signal(int sig) {
  g_stop = sig;
  const int n = g_signals + 1;
  g_signals = n;
  const pid_t child = g_child;
  if (child <= 0) return;
  if (n == 1) {
    static const char msg[] =
        "\nmeshtrain launch: stopping after the current step (Ctrl-C again to abort)\n";
    (void)!::write(2, msg, sizeof msg - 1);
    ::kill(child, SIGUSR1);
  } else if (n == 2) {
    ::kill(child, SIGTERM);
  } else {
    ::kill(-child, SIGKILL);
  }
}

// Why a run ended, in words.
std::string describe_status(int st) {
  if (WIFSIGNALED(st)) return "mpirun was killed by signal " + std::to_string(WTERMSIG(st)) + " (" + strsignal(WTERMSIG(st)) + ")";
  const int code = WEXITSTATUS(st);
  std::string s = "exit code " + std::to_string(code);
  if (code > 128 && code < 128 + 65)
    s += " (a rank died from signal " + std::to_string(code - 128) + ", " + strsignal(code - 128) + ")";
  else if (code != 0)
    s += " (a rank failed; its error is above)";
  return s;
}

int exit_code(int st) { return WIFSIGNALED(st) ? 128 + WTERMSIG(st) : WEXITSTATUS(st); }

// Runs argv (argv[0] looked up in PATH) and waits; returns the wait status (or -1 if it could not start).
int run_and_wait(const std::vector<std::string>& argv) {
  std::vector<std::string> copy = argv;
  std::vector<char*> xargv;
  for (auto& a : copy) xargv.push_back(a.data());
  xargv.push_back(nullptr);
  const pid_t pid = ::fork();
  if (pid < 0) return -1;
  if (pid == 0) {
    // Its own process group, so a Ctrl-C at the terminal reaches only this process, which turns it
    // into a clean stop; no terminal input (a background group that reads it would be stopped).
    ::setpgid(0, 0);
    const int null_fd = ::open("/dev/null", O_RDONLY);
    if (null_fd >= 0) ::dup2(null_fd, 0);
    execvp(xargv[0], xargv.data());
    std::fprintf(stderr, "meshtrain launch: cannot run '%s': %s\n", xargv[0], std::strerror(errno));
    _exit(127);
  }
  ::setpgid(pid, pid);
  g_child = pid;
  int st = 0;
  while (::waitpid(pid, &st, 0) < 0 && errno == EINTR) {
  }
  g_child = 0;
  return st;
}

}  // namespace

int run_launch_command(int argc, char** argv) {
  // Accept the single-dash spellings -n / -np before the "--".
  std::vector<std::string> args;
  bool rest = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--") rest = true;
    if (!rest && (a == "-n" || a == "-np")) a = "--np";
    if (!rest && a.rfind("-n=", 0) == 0) a = "--np=" + a.substr(3);
    args.push_back(a);
  }
  std::vector<char*> cargs = {argv[0]};
  for (auto& a : args) cargs.push_back(a.data());
  ArgParser ap({"np", "n", "hostfile", "threads", "bind", "mpirun", "mpirun-args", "max-restarts"},
               {"dry-run", "help", "h"});
  LaunchOptions o;
  try {
    ap.parse(static_cast<int>(cargs.size()), cargs.data(), 1);
    if (ap.flag("help") || ap.flag("h")) {
      std::fputs(kHelp, stdout);
      return 0;
    }
    if (!ap.positional().empty())
      throw ArgError("unexpected argument '" + ap.positional()[0] +
                     "' (put the subcommand after --)");
    o.nranks = static_cast<int>(ap.get_int("np", ap.get_int("n", 0)));
    if (o.nranks < 1) throw ArgError("give the number of ranks with -n N (N >= 1)");
    if (ap.rest().empty())
      throw ArgError("no subcommand: meshtrain launch -n N -- <subcommand ...>");
    o.hostfile = ap.get("hostfile");
    if (!o.hostfile.empty() && access(o.hostfile.c_str(), R_OK) != 0)
      throw ArgError("cannot read host file '" + o.hostfile + "'");
    o.threads = static_cast<int>(ap.get_int("threads", 0));
    o.bind = ap.get("bind", "cores");
    if (o.bind != "cores" && o.bind != "none") throw ArgError("--bind must be cores or none, not '" + o.bind + "'");
    if (ap.get_int("max-restarts", 0) < 0) throw ArgError("--max-restarts must be >= 0");
    const char* env_mpirun = std::getenv("MESHTRAIN_MPIRUN");
    o.mpirun = ap.get("mpirun", env_mpirun && *env_mpirun ? env_mpirun : "mpirun");
    std::stringstream ss(ap.get("mpirun-args"));
    std::string w;
    while (ss >> w) o.extra_mpirun_args.push_back(w);
  } catch (const ArgError& e) {
    std::fprintf(stderr, "meshtrain launch: %s\n(see meshtrain launch --help)\n", e.what());
    return 2;
  }
  o.command = ap.rest();
  o.is_root = geteuid() == 0;
  for (char** e = environ; e && *e; ++e) {
    std::string kv = *e;
    if (kv.rfind("MESHTRAIN_", 0) == 0) {
      std::string name = kv.substr(0, kv.find('='));
      if (name != "MESHTRAIN_MPIRUN") o.forward_env.push_back(name);
    }
  }
  const LaunchPlan p = comm::build_launch_plan(o);
  if (o.hostfile.empty() && o.nranks > comm::detect_cores())
    std::fprintf(stderr,
                 "meshtrain launch: note: %d ranks on %d cores: they take turns on the cores, so every step is slower "
                 "than with -n %d\n",
                 o.nranks, comm::detect_cores(), comm::detect_cores());
  std::string line;
  for (const auto& [k, v] : p.env) line += k + "=" + v + " ";
  std::fprintf(stderr, "meshtrain launch: %s%s\n", line.c_str(), comm::shell_join(p.argv).c_str());
  std::fflush(stderr);
  if (ap.flag("dry-run")) return 0;
  for (const auto& [k, v] : p.env) setenv(k.c_str(), v.c_str(), 1);
  const int64_t max_restarts = ap.get_int("max-restarts", 0);
  struct sigaction sa {};
  sa.sa_handler = forward_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  if (!ap.has("max-restarts")) {  // no supervision: one run
    const int st = run_and_wait(p.argv);
    if (st == -1) {
      std::fprintf(stderr, "meshtrain launch: cannot start '%s': %s\n", p.argv[0].c_str(), std::strerror(errno));
      return 127;
    }
    return exit_code(st);
  }
  // Supervised: run, and after a failure run again from the newest complete checkpoint.
  const bool is_train = !o.command.empty() && o.command[0] == "train";
  bool sets_resume = false;
  for (const auto& a : o.command) sets_resume = sets_resume || a.rfind("--train.resume", 0) == 0;
  std::vector<std::string> job = p.argv;
  for (int64_t attempt = 0;; ++attempt) {
    const int st = run_and_wait(job);
    if (st == -1) {
      std::fprintf(stderr, "meshtrain launch: cannot start '%s': %s\n", job[0].c_str(), std::strerror(errno));
      return 127;
    }
    if (WIFEXITED(st) && WEXITSTATUS(st) == 0) {
      if (attempt > 0)
        std::fprintf(stderr, "meshtrain launch: the job finished after %lld restart%s\n", static_cast<long long>(attempt),
                     attempt == 1 ? "" : "s");
      return 0;
    }
    const std::string why = describe_status(st);
    if (g_stop) {
      std::fprintf(stderr, "meshtrain launch: stopped by signal %d (%s); not restarting\n", static_cast<int>(g_stop), why.c_str());
      return exit_code(st);
    }
    if (attempt >= max_restarts) {
      std::fprintf(stderr, "meshtrain launch: the job failed (%s); giving up after %lld restart%s (--max-restarts %lld)\n",
                   why.c_str(), static_cast<long long>(attempt), attempt == 1 ? "" : "s",
                   static_cast<long long>(max_restarts));
      return exit_code(st) == 0 ? 1 : exit_code(st);
    }
    if (is_train && !sets_resume && attempt == 0) job.push_back("--train.resume=latest");
    std::fprintf(stderr, "meshtrain launch: the job failed (%s); restart %lld of %lld%s\n", why.c_str(),
                 static_cast<long long>(attempt + 1), static_cast<long long>(max_restarts),
                 is_train ? " from the newest complete checkpoint (--train.resume latest)" : "");
    std::fprintf(stderr, "meshtrain launch: %s\n", comm::shell_join(job).c_str());
    std::fflush(stderr);
  }
}

}  // namespace mt::cli
