// Whole-job tests: each runs mpirun on comm_tool (tests/comm/comm_tool.cpp) and checks the exit
// code and what the job printed. These are the failure paths: a desync, a stalled rank (watchdog),
// a killed rank; plus tracing and the launcher. No test times the job: that a stall is named in
// bounded time is the watchdog's configured timeout (MESHTRAIN_TIMEOUT_S), which its message
// reports; a job that never ends is killed by the hang guard below, well inside CTest's timeout.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <vector>

namespace {

struct Result {
  int code = -1;  // exit code, or 128 + signal
  std::string out;  // stdout and stderr together
  bool timed_out = false;  // killed by the hang guard
};

std::vector<std::string> mpirun(int np, std::vector<std::string> args) {
  std::vector<std::string> a = {MT_MPIRUN, "-np", std::to_string(np), "--oversubscribe",
                                "--bind-to", "none", "--mca", "mpi_yield_when_idle", "1",
                                MT_COMM_TOOL};
  a.insert(a.end(), args.begin(), args.end());
  return a;
}

// A job still running after this long is hung; it is killed and the test fails on `timed_out`.
constexpr double kHangGuardS = 300;

// Runs argv with extra environment, killing its process group after kHangGuardS.
Result run(const std::vector<std::string>& argv, const std::vector<std::string>& env = {}) {
  int fds[2];
  if (pipe(fds) != 0) return {};
  auto t0 = std::chrono::steady_clock::now();
  pid_t pid = fork();
  if (pid == 0) {
    setpgid(0, 0);
    dup2(fds[1], 1);
    dup2(fds[1], 2);
    close(fds[0]);
    close(fds[1]);
    // mpirun refuses to run as root without these (harmless otherwise).
    setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
    setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
    for (const auto& kv : env) putenv(const_cast<char*>(kv.c_str()));
    std::vector<char*> v;
    for (const auto& s : argv) v.push_back(const_cast<char*>(s.c_str()));
    v.push_back(nullptr);
    execvp(v[0], v.data());
    _exit(127);
  }
  close(fds[1]);
  Result r;
  auto elapsed = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  char buf[4096];
  for (;;) {
    double left = kHangGuardS - elapsed();
    if (left <= 0) {
      r.timed_out = true;
      kill(-pid, SIGKILL);
      break;
    }
    pollfd p{fds[0], POLLIN, 0};
    int pr = poll(&p, 1, static_cast<int>(std::min(left, 0.2) * 1000) + 1);
    if (pr > 0) {
      ssize_t n = read(fds[0], buf, sizeof buf);
      if (n <= 0) break;
      r.out.append(buf, static_cast<size_t>(n));
    }
  }
  close(fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  kill(-pid, SIGKILL);  // whatever is left of the job
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return r;
}

bool has(const Result& r, const std::string& s) { return r.out.find(s) != std::string::npos; }

// Some line holds both strings.
bool line_has(const Result& r, const std::string& a, const std::string& b) {
  size_t start = 0;
  while (start < r.out.size()) {
    size_t end = r.out.find('\n', start);
    if (end == std::string::npos) end = r.out.size();
    std::string line = r.out.substr(start, end - start);
    if (line.find(a) != std::string::npos && line.find(b) != std::string::npos) return true;
    start = end + 1;
  }
  return false;
}

// The watchdog's "has not finished after S s (MESHTRAIN_TIMEOUT_S=...)": S, or -1 without it.
double watchdog_seconds(const Result& r) {
  const std::string key = "has not finished after ";
  const size_t at = r.out.find(key);
  if (at == std::string::npos || r.out.find("(MESHTRAIN_TIMEOUT_S=", at) == std::string::npos) return -1;
  return std::stod(r.out.substr(at + key.size()));
}

}  // namespace

TEST(Job, DesyncIsNamedOnEveryRank) {
  Result r = run(mpirun(4, {"desync"}), {"MESHTRAIN_DEBUG=desync", "MESHTRAIN_TIMEOUT_S=60"});
  EXPECT_FALSE(r.timed_out);
  EXPECT_NE(r.code, 0);
  const std::string want =
      "rank 2 called all_gather(bf16, 1024) as collective #4 of group dp while rank 0 called "
      "all_reduce(f32, 4096)";
  EXPECT_TRUE(has(r, want)) << r.out;
  EXPECT_TRUE(has(r, "flight recorder")) << r.out;
  // Found by the fingerprint exchange, not left to the watchdog's 60 s.
  EXPECT_FALSE(has(r, "watchdog:")) << r.out;
}

TEST(Job, WatchdogNamesTheRankThatDidNotJoin) {
  Result r = run(mpirun(3, {"stall"}), {"MESHTRAIN_TIMEOUT_S=3"});
  EXPECT_FALSE(r.timed_out);
  EXPECT_NE(r.code, 0);
  EXPECT_TRUE(has(r, "watchdog: collective #4 all_reduce(f32, 4096, sum) of group dp")) << r.out;
  EXPECT_TRUE(has(r, "ranks that have not joined it: 2 (last called #3)")) << r.out;
  EXPECT_TRUE(has(r, "flight recorder")) << r.out;
  EXPECT_TRUE(has(r, "RUNNING")) << r.out;
  // Named by the watchdog at its configured timeout, not when the stalled rank (60 s) returns.
  const double after = watchdog_seconds(r);
  EXPECT_GE(after, 3.0) << r.out;
  EXPECT_LT(after, 60.0) << r.out;
}

TEST(Job, KilledRankEndsTheJob) {
  Result r = run(mpirun(3, {"kill"}), {"MESHTRAIN_TIMEOUT_S=10"});
  EXPECT_FALSE(r.timed_out);
  EXPECT_NE(r.code, 0);
  // mpirun notices the dead process; failing that the watchdog names it.
  EXPECT_TRUE(has(r, "signal 9") || has(r, "Killed") || has(r, "did not answer")) << r.out;
}

TEST(Job, TraceLogsEveryCollective) {
  Result r = run(mpirun(2, {"ops"}), {"MESHTRAIN_DEBUG=trace"});
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(has(r, "meshtrain[rank 1]: trace group dp #1 all_reduce(f32, 4096, sum): ")) << r.out;
  EXPECT_TRUE(has(r, "meshtrain[rank 0]: trace group dp #4 all_gather(bf16, 1024): ")) << r.out;
  EXPECT_TRUE(has(r, "trace group dp #5 barrier()")) << r.out;
}

TEST(Job, TraceAndDesyncCheckPassWhenRanksAgree) {
  Result r = run(mpirun(3, {"ops"}), {"MESHTRAIN_DEBUG=desync"});
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_FALSE(has(r, "desync")) << r.out;
}

TEST(Job, LaunchRunsTheSubcommandOnNRanks) {
  Result r = run({MT_COMM_TOOL, "launch", "-n", "3", "--mpirun", MT_MPIRUN, "--", "hello"});
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(has(r, "meshtrain launch: ")) << r.out;
  EXPECT_TRUE(has(r, "-np 3")) << r.out;
  for (int i = 0; i < 3; ++i)
    EXPECT_TRUE(has(r, "hello from rank " + std::to_string(i) + " of 3")) << r.out;
  EXPECT_TRUE(has(r, "GLIBC_TUNABLES=glibc.malloc.hugetlb=1")) << r.out;
  // Only rank 0 prints through log_printf unless MESHTRAIN_LOG_RANKS says otherwise.
  EXPECT_TRUE(has(r, "printer 0")) << r.out;
  EXPECT_FALSE(has(r, "printer 1")) << r.out;
  Result all = run({MT_COMM_TOOL, "launch", "-n", "2", "--mpirun", MT_MPIRUN, "--", "hello"},
                   {"MESHTRAIN_LOG_RANKS=all"});
  EXPECT_EQ(all.code, 0) << all.out;
  EXPECT_TRUE(has(all, "[rank 1] printer 1")) << all.out;
}

TEST(Job, BenchRunsOnTwoRanks) {
  Result r = run(mpirun(2, {"bench", "comm", "--max-bytes", "64K", "--iters", "3"}));
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(has(r, "2 ranks")) << r.out;
  for (const char* op : {"all_reduce", "all_gather", "reduce_scatter", "broadcast"})
    EXPECT_TRUE(line_has(r, std::string("  ") + op + " ", " 64K ")) << r.out;
}
